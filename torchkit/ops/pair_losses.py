"""The pair losses (supcon_loss, ntxent_loss, contrastive_loss, triplet_margin_loss,
multi_similarity_loss, proxy_anchor_loss): their Python functions, fake kernels and autograd
formulas. The losses themselves are described in csrc/pair_losses.h."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from torchkit.ops._common import (
    acc_dtype,
    as_float,
    check_floating,
    check_same_device,
    check_scalars,
    check_tensor,
    describe,
    dtype_name,
    register_op,
)


def supcon_loss(
    embeddings: Tensor,
    labels: Tensor,
    temperature: float = 0.1,
    *,
    indices_tuple: Optional[tuple] = None,
    ref_embeddings: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
    group=None,
) -> Tensor:
    """Supervised contrastive loss (Khosla et al., 2020) without the N×N similarity matrix.

    Exactly pytorch-metric-learning's ``SupConLoss(temperature)`` with its defaults (cosine
    similarity of L2-normalised embeddings, ``AvgNonZeroReducer``), values and gradients: for
    anchor i, ``L_i = log Σ_j exp(s_ij/τ)`` over its pairs (every other row, or every row of
    ``ref_embeddings``) and ``loss_i = L_i − mean over its positives of s_ij/τ``; the loss is
    the mean of the ``loss_i > 0``. The similarities are computed in tiles and folded into
    per-anchor sums at once: memory O((N + M)·D), whatever N.

    Args:
        embeddings (Tensor[N, D]): float32, float64, float16 or bfloat16 (reduced types
            accumulate in float32).
        labels (Tensor[N]): any integer dtype; pairs of equal labels are positives.
        temperature: finite and > 0.
        indices_tuple (optional): the pairs ``(anchors, positives, anchors, negatives)`` (or
            triplets ``(a, p, n)``, as the pairs (a, p) and (a, n)) a PML miner returns, index
            tensors into the embeddings (anchors) and the refs (the embeddings without refs):
            PML's loss given ``indices_tuple``, each anchor's sums over its listed pairs (a
            pair listed twice counts once, PML's mask); a short list in O(list · D)
            (docs/ops.md). The labels are not read. Not with ``group``.
        ref_embeddings (Tensor[M, D], optional): the pairs' other side instead of the batch
            itself (PML's ``ref_emb``: another view, a memory; PML's CrossBatchMemory is
            ``torchkit.nn.CrossBatchMemory``); then every
            (anchor, ref) pair counts, none is left out as "itself".
        ref_labels (Tensor[M], optional): their labels; given with ``ref_embeddings``.
        group (optional): a ``torch.distributed`` process group: every rank passes its own
            batch and gets the loss of the ranks' batches concatenated in rank order (their
            ``ref_embeddings`` likewise), each rank computing its own anchors' terms; the
            gradient of each rank's embeddings is theirs of that loss (docs/ops.md, "The pair
            losses across ranks"). Default: this process's batch alone.

    Returns:
        A scalar of ``embeddings``' dtype. 0 (with zero gradients) when the batch has no
        positive pair or no negative pair, as PML gives; an anchor without positives adds
        nothing. A NaN embedding makes the loss NaN wherever it is a pair of an anchor with
        positives (PML drops NaN anchors from its mean and returns a finite value).

    Example::

        >>> emb = model(images)  # (N, 128)
        >>> loss = torchkit.ops.supcon_loss(emb, labels, temperature=0.1)
    """
    return _loss("supcon_loss", embeddings, labels, (temperature,), ref_embeddings, ref_labels, group, indices_tuple)


def ntxent_loss(
    embeddings: Tensor,
    labels: Tensor,
    temperature: float = 0.07,
    *,
    indices_tuple: Optional[tuple] = None,
    ref_embeddings: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
    group=None,
) -> Tensor:
    """NT-Xent (normalised temperature-scaled cross-entropy; SimCLR's InfoNCE) with labels,
    without the N×N similarity matrix nor PML's (positive pairs × negative pairs) one.

    Exactly pytorch-metric-learning's ``NTXentLoss(temperature)`` with its defaults (cosine
    similarity of L2-normalised embeddings, ``MeanReducer``), values and gradients: each
    positive pair (i, p) is a softmax over p and all of anchor i's negatives,
    ``loss_ip = −log(exp(s_ip/τ) / (exp(s_ip/τ) + Σ_n exp(s_in/τ)) + tiny)``, and the loss is
    the mean over every positive pair. Memory O((N + M)·D), whatever N and the number of pairs.

    Args:
        embeddings (Tensor[N, D]): float32, float64, float16 or bfloat16 (reduced types
            accumulate in float32).
        labels (Tensor[N]): any integer dtype; pairs of equal labels are positives (for
            SimCLR, the two views of an image share a label).
        temperature: finite and > 0.
        indices_tuple (optional): the pairs ``(anchors, positives, anchors, negatives)`` (or
            triplets ``(a, p, n)``, as the pairs (a, p) and (a, n)) a PML miner returns, index
            tensors into the embeddings (anchors) and the refs (the embeddings without refs):
            PML's loss given ``indices_tuple``, each listed positive pair against its anchor's
            listed negatives (PML: O(positive pairs × negative pairs)); a short list in
            O(list · D) (docs/ops.md). The labels are not read. Not with ``group``.
        ref_embeddings (Tensor[M, D], optional): the pairs' other side instead of the batch
            itself (PML's ``ref_emb``); then every (anchor, ref) pair counts.
        ref_labels (Tensor[M], optional): their labels; given with ``ref_embeddings``.
        group (optional): a ``torch.distributed`` process group: every rank passes its own
            batch and gets the loss of the ranks' batches concatenated in rank order (their
            ``ref_embeddings`` likewise), each rank computing its own anchors' terms; the
            gradient of each rank's embeddings is theirs of that loss (docs/ops.md, "The pair
            losses across ranks"). Default: this process's batch alone.

    Returns:
        A scalar of ``embeddings``' dtype; 0 (with zero gradients) when the batch has no
        positive pair or no negative pair, as PML gives. ``tiny`` is the accumulation type's
        smallest normal number (PML's ``small_val``): it bounds a pair's loss at about 87
        (float32).

    Example::

        >>> z = model(torch.cat([view1, view2]))  # (2B, 128)
        >>> loss = torchkit.ops.ntxent_loss(z, torch.arange(B).repeat(2), temperature=0.5)
    """
    return _loss("ntxent_loss", embeddings, labels, (temperature,), ref_embeddings, ref_labels, group, indices_tuple)


def contrastive_loss(
    embeddings: Tensor,
    labels: Tensor,
    pos_margin: float = 0.0,
    neg_margin: float = 1.0,
    *,
    distance: str = "euclidean",
    indices_tuple: Optional[tuple] = None,
    ref_embeddings: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
    group=None,
) -> Tensor:
    """Contrastive loss (Hadsell et al., 2006) over every pair, without the N×N distance matrix.

    Exactly pytorch-metric-learning's ``ContrastiveLoss(pos_margin, neg_margin)`` with its
    defaults (Euclidean distance of L2-normalised embeddings, ``AvgNonZeroReducer``), values and
    gradients: the mean of the positive pairs' ``relu(d − pos_margin)`` that are > 0 plus the
    mean of the negative pairs' ``relu(neg_margin − d)`` that are > 0. Distances are exact for
    near-duplicates (where ``torch.cdist``, which PML calls, returns about 0 and so a wrong
    loss and gradient), and whether a term is > 0 is exact arithmetic's answer (a zero row lies
    at distance exactly 1, adding nothing at ``neg_margin=1``, where PML's rounding counts
    ~1e-16). Memory O((N + M)·D), whatever N.

    ``distance="cosine"`` is ``ContrastiveLoss(pos_margin, neg_margin,
    distance=CosineSimilarity())``: on the cosine similarity s, the mean of the positive pairs'
    ``relu(pos_margin − s)`` > 0 plus that of the negative pairs' ``relu(s − neg_margin)`` > 0
    (PML's users set ``pos_margin=1, neg_margin=0`` or so: the defaults are the Euclidean
    distance's), whether a term is > 0 decided on the exact similarity.

    Args:
        embeddings (Tensor[N, D]): float32, float64, float16 or bfloat16 (reduced types
            accumulate in float32).
        labels (Tensor[N]): any integer dtype; pairs of equal labels are positives.
        pos_margin, neg_margin: finite, of either sign (as PML takes them).
        distance: "euclidean" (PML's default ``LpDistance()``) or "cosine"
            (``CosineSimilarity()``).
        indices_tuple (optional): the pairs ``(anchors, positives, anchors, negatives)`` or
            triplets ``(anchors, positives, negatives)`` (as the pairs (a, p) and (a, n)) a PML
            miner returns, index tensors into the embeddings (anchors) and the refs (the
            embeddings without refs): PML's loss given ``indices_tuple``, on those pairs; a
            short list in O(list · D) (docs/ops.md). The labels are not read. Not with
            ``group``.
        ref_embeddings (Tensor[M, D], optional): the pairs' other side instead of the batch
            itself (PML's ``ref_emb``); then every (anchor, ref) pair counts.
        ref_labels (Tensor[M], optional): their labels; given with ``ref_embeddings``.
        group (optional): a ``torch.distributed`` process group: every rank passes its own
            batch and gets the loss of the ranks' batches concatenated in rank order (their
            ``ref_embeddings`` likewise), each rank computing its own anchors' terms; the
            gradient of each rank's embeddings is theirs of that loss (docs/ops.md, "The pair
            losses across ranks"). Default: this process's batch alone.

    Returns:
        A scalar of ``embeddings``' dtype; a kind of pair with no term > 0 adds 0, and a batch
        of at most one positive and one negative pair gives 0 (PML's rule). A NaN embedding
        makes the loss NaN (PML's reducer drops NaN terms).

    Example::

        >>> loss = torchkit.ops.contrastive_loss(model(images), labels, neg_margin=1.0)
    """
    return _loss(
        "contrastive_loss",
        embeddings,
        labels,
        (pos_margin, neg_margin, distance),
        ref_embeddings,
        ref_labels,
        group,
        indices_tuple,
    )


def triplet_margin_loss(
    embeddings: Tensor,
    labels: Tensor,
    margin: float = 0.05,
    *,
    mining: str = "all",
    distance: str = "euclidean",
    indices_tuple: Optional[tuple] = None,
    ref_embeddings: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
    group=None,
) -> Tensor:
    """Triplet margin loss over all, semi-hard or batch-hard triplets, without the N×N distance
    matrix nor PML's N³ triplet indices.

    Exactly pytorch-metric-learning's ``TripletMarginLoss(margin)`` with its defaults
    (Euclidean distance of L2-normalised embeddings, ``AvgNonZeroReducer``), on the triplets
    its miners give, values and gradients: per triplet (anchor a, positive p, negative n)
    ``relu(d_ap − d_an + margin)``, and the loss is the mean of those > 0.

    - ``mining="all"``: every triplet (``TripletMarginLoss(margin)`` alone).
    - ``mining="semi_hard"``: those with ``d_ap < d_an`` (with
      ``TripletMarginMiner(margin, type_of_triplets="semihard")``).
    - ``mining="batch_hard"``: per anchor its farthest positive and nearest negative (with
      ``BatchHardMiner()``); ties go to the lower index.

    Distances are exact for near-duplicates (where ``torch.cdist`` returns about 0), and which
    triplets count is decided on exact distances: a negative equal to a positive is a tie, no
    semi-hard triplet and no term > 0 at margin 0 (PML's rounding breaks such ties). Memory
    O((N + M)·D) plus, for "all" and "semi_hard", a few numbers per positive pair, however
    many triplets there are.

    ``distance="cosine"`` is PML's loss and miner with ``distance=CosineSimilarity()``: per
    triplet ``relu(s_an − s_ap + margin)`` on the cosine similarities, semi-hard triplets those
    with ``s_ap > s_an``, batch-hard the least similar positive and the most similar negative;
    choices and ties as above, on the exact similarities.

    Args:
        embeddings (Tensor[N, D]): float32, float64, float16 or bfloat16 (reduced types
            accumulate in float32).
        labels (Tensor[N]): any integer dtype.
        margin: finite, of either sign (as PML takes it; semi_hard mines none below 0).
        mining: "all", "semi_hard" or "batch_hard".
        distance: "euclidean" (PML's default ``LpDistance()``) or "cosine"
            (``CosineSimilarity()``).
        indices_tuple (optional): the triplets ``(anchors, positives, negatives)`` or pairs
            ``(anchors, positives, anchors, negatives)`` (each positive pair with each negative
            pair of its anchor, as PML converts them) a PML miner returns, index tensors into
            the embeddings (anchors) and the refs (the embeddings without refs): PML's loss
            given ``indices_tuple``, on those triplets (pairs: O(positive pairs × negative
            pairs), as PML); a short list in O(list · D) (docs/ops.md). With ``mining="all"``,
            the labels not read. Not with ``group``.
        ref_embeddings (Tensor[M, D], optional): the positives' and negatives' rows instead
            of the batch itself (PML's ``ref_emb``).
        ref_labels (Tensor[M], optional): their labels; given with ``ref_embeddings``.
        group (optional): a ``torch.distributed`` process group: every rank passes its own
            batch and gets the loss of the ranks' batches concatenated in rank order (their
            ``ref_embeddings`` likewise), each rank computing its own anchors' terms; the
            gradient of each rank's embeddings is theirs of that loss (docs/ops.md, "The pair
            losses across ranks"). Default: this process's batch alone.

    Returns:
        A scalar of ``embeddings``' dtype; 0 (with zero gradients) when no triplet has a loss
        > 0. A NaN embedding makes the loss NaN wherever it is in a triplet (PML's reducer
        drops NaN terms).

    Example::

        >>> loss = torchkit.ops.triplet_margin_loss(model(images), labels, 0.2, mining="batch_hard")
    """
    return _loss(
        "triplet_margin_loss",
        embeddings,
        labels,
        (margin, mining, distance),
        ref_embeddings,
        ref_labels,
        group,
        indices_tuple,
    )


def multi_similarity_loss(
    embeddings: Tensor,
    labels: Tensor,
    alpha: float = 2.0,
    beta: float = 50.0,
    base: float = 0.5,
    *,
    miner_epsilon: Optional[float] = 0.1,
    indices_tuple: Optional[tuple] = None,
    ref_embeddings: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
    group=None,
) -> Tensor:
    """Multi-similarity loss (Wang et al., 2019) with its pair miner, without the N×N similarity
    matrix.

    Exactly pytorch-metric-learning's ``MultiSimilarityLoss(alpha, beta, base)`` with its
    defaults (cosine similarity of L2-normalised embeddings, ``MeanReducer``) on the pairs of
    ``MultiSimilarityMiner(epsilon=miner_epsilon)`` (every pair with ``miner_epsilon=None``),
    values and gradients: anchor i keeps the positives with ``s − ε`` below its largest
    negative similarity and the negatives with ``s + ε`` above its smallest positive one; its
    loss is ``log(1 + Σ_kept positives exp(−α(s − base)))/α + log(1 + Σ_kept negatives
    exp(β(s − base)))/β``, and the loss is the mean over the anchors. Which pairs are kept is
    decided on the exact similarities. Memory O((N + M)·D), whatever N.

    Args:
        embeddings (Tensor[N, D]): float32, float64, float16 or bfloat16 (reduced types
            accumulate in float32).
        labels (Tensor[N]): any integer dtype; pairs of equal labels are positives.
        alpha, beta: finite and > 0. base: finite.
        miner_epsilon: the miner's ε, finite, of either sign; None: no miner, every pair. The
            default mines with ε = 0.1, where ``torchkit.nn.MultiSimilarityLoss``, as PML's
            module, defaults to no miner.
        indices_tuple (optional): the pairs ``(anchors, positives, anchors, negatives)`` (or
            triplets ``(a, p, n)``, as the pairs (a, p) and (a, n)) another PML miner returns,
            index tensors into the embeddings (anchors) and the refs (the embeddings without
            refs), with ``miner_epsilon=None``: PML's loss given ``indices_tuple``, each
            anchor's sums over its listed pairs (a pair listed twice counts once, PML's mask);
            a short list in O(list · D) (docs/ops.md). The labels are not read. Not with
            ``group``.
        ref_embeddings (Tensor[M, D], optional): the pairs' other side instead of the batch
            itself (PML's ``ref_emb``).
        ref_labels (Tensor[M], optional): their labels; given with ``ref_embeddings``.
        group (optional): a ``torch.distributed`` process group: every rank passes its own
            batch and gets the loss of the ranks' batches concatenated in rank order (their
            ``ref_embeddings`` likewise), each rank computing its own anchors' terms; the
            gradient of each rank's embeddings is theirs of that loss (docs/ops.md, "The pair
            losses across ranks"). Default: this process's batch alone.

    Returns:
        A scalar of ``embeddings``' dtype; 0 (with zero gradients) when each kind of pair
        keeps at most one pair, or, with the miner, when the batch has no positive or no
        negative pair (PML's rules). A NaN embedding makes the loss NaN (PML's miner drops
        its pairs).

    Example::

        >>> loss = torchkit.ops.multi_similarity_loss(model(images), labels)
    """
    return _loss(
        "multi_similarity_loss",
        embeddings,
        labels,
        (alpha, beta, base, miner_epsilon),
        ref_embeddings,
        ref_labels,
        group,
        indices_tuple,
    )


def proxy_anchor_loss(
    embeddings: Tensor,
    labels: Tensor,
    proxies: Tensor,
    margin: float = 0.1,
    alpha: float = 32.0,
    *,
    group=None,
) -> Tensor:
    """Proxy-anchor loss (Kim et al., 2020) without the N×C similarity matrix, differentiable in
    the embeddings and the proxies.

    Exactly pytorch-metric-learning's ``ProxyAnchorLoss(C, D, margin, alpha)`` holding
    ``proxies`` (its defaults: cosine similarity of L2-normalised rows, ``DivisorReducer``),
    values and gradients: per proxy c, ``log(1 + Σ_{label = c} exp(α(margin − s)))`` averaged
    over the proxies with positives, plus ``log(1 + Σ_{label ≠ c} exp(α(s + margin)))``
    averaged over all C proxies.

    Args:
        embeddings (Tensor[N, D]): float32, float64, float16 or bfloat16 (reduced types
            accumulate in float32).
        labels (Tensor[N]): any integer dtype, each in [0, C): the row of ``proxies`` of its
            class.
        proxies (Tensor[C, D]): one per class, of ``embeddings``' dtype and device (PML's
            ``loss.proxies``; ``torchkit.nn.ProxyAnchorLoss`` holds them as a parameter).
        margin: finite, of either sign (as PML). alpha: finite and > 0.
        group (optional): a ``torch.distributed`` process group: every rank passes its own
            batch and the same proxies, and gets the loss of the ranks' batches concatenated;
            the gradient of its embeddings is theirs of that loss, and the proxies' gradient
            its batch's share (summed over the ranks it is the proxies' gradient; docs/ops.md,
            "The pair losses across ranks"). Default: this process's batch alone.

    Returns:
        A scalar of ``embeddings``' dtype; 0 for an empty batch. A NaN embedding or proxy
        makes the loss NaN.

    Example::

        >>> proxies = torch.nn.Parameter(torch.randn(num_classes, 128))
        >>> loss = torchkit.ops.proxy_anchor_loss(model(images), labels, proxies)
    """
    op = "proxy_anchor_loss"

    def check() -> tuple:
        check_tensor(op, "embeddings", embeddings)
        check_tensor(op, "labels", labels)
        check_tensor(op, "proxies", proxies)
        m, a = as_float(op, "margin", margin), as_float(op, "alpha", alpha)
        _check_device(op, embeddings)
        _check_proxy_inputs(embeddings, labels, proxies, m, a)
        return m, a

    if group is not None:
        from torchkit.ops._pair_losses_across_ranks import proxy_anchor_across_ranks

        return proxy_anchor_across_ranks(embeddings, labels, proxies, group, check)
    loss, _ = _PROXY_ANCHOR(embeddings, labels, proxies, *check())
    return loss


def _check_proxy_inputs(embeddings: Tensor, labels: Tensor, proxies: Tensor, margin: float, alpha: float) -> None:
    """csrc/pair_losses.cpp's check_proxy_inputs, but for the labels' values (read by the
    kernel, which raises the same way)."""
    op = "proxy_anchor_loss"
    check_floating(op, "embeddings", embeddings)
    if embeddings.dim() != 2:
        raise ValueError(f"{op}: embeddings must be 2-D (N, D), got shape {list(embeddings.shape)}")
    check_same_device(op, embeddings=embeddings, labels=labels)
    _check_labels(op, "labels", labels, "embeddings", embeddings)
    check_same_device(op, embeddings=embeddings, proxies=proxies)
    if proxies.dtype != embeddings.dtype:
        raise TypeError(
            f"{op}: embeddings and proxies must have the same dtype, got {dtype_name(embeddings.dtype)} and "
            f"{dtype_name(proxies.dtype)}"
        )
    if proxies.dim() != 2 or proxies.shape[1] != embeddings.shape[1]:
        raise ValueError(
            f"{op}: proxies must be 2-D (C, D) with embeddings' D, got embeddings of shape "
            f"{list(embeddings.shape)} and proxies of shape {list(proxies.shape)}"
        )
    _check_proxy_params(op, margin, alpha)


def _check_proxy_params(op: str, margin: float, alpha: float) -> None:
    if not -math.inf < margin < math.inf:
        raise ValueError(f"{op}: margin must be finite, got {margin:g}")
    if not 0.0 < alpha < math.inf:
        raise ValueError(f"{op}: alpha must be finite and > 0, got {alpha:g}")


def _check_proxy_shard(shard: Optional[int]) -> None:
    """csrc/pair_losses.cpp's check of proxy_anchor_loss's shard: only -1 (or none)."""
    if shard is not None and shard != -1:
        raise ValueError(
            "proxy_anchor_loss: shard must be -1 (the embeddings are a shard of the refs, the proxies the anchors), "
            f"got {shard}"
        )


def _register_proxy_anchor():
    op = "proxy_anchor_loss"

    @torch.library.register_fake(f"torchkit::{op}")
    def _(embeddings, labels, proxies, margin, alpha, shard=None):
        check_scalars(op, ("float", "margin", margin), ("float", "alpha", alpha))
        _check_proxy_inputs(embeddings, labels, proxies, margin, alpha)
        _check_proxy_shard(shard)
        stats = embeddings.new_empty((proxies.shape[0], 4), dtype=acc_dtype(embeddings))
        if shard is not None:
            return embeddings.new_empty((proxies.shape[0], 3), dtype=torch.float64), stats
        return embeddings.new_empty(()), stats

    @torch.library.register_fake(f"torchkit::_{op}_backward")
    def _(grad, embeddings, labels, proxies, stats, margin, alpha, output_mask):
        check_scalars(op, ("float", "margin", margin), ("float", "alpha", alpha))
        _check_proxy_inputs(embeddings, labels, proxies, margin, alpha)
        _check_backward(op, grad, embeddings, stats, 4, anchors=proxies.shape[0])
        ge = torch.empty_like(embeddings, memory_format=torch.contiguous_format) if output_mask[0] else None
        gp = torch.empty_like(proxies, memory_format=torch.contiguous_format) if output_mask[1] else None
        return (embeddings.new_empty(0) if ge is None else ge), (embeddings.new_empty(0) if gp is None else gp)

    def setup_context(ctx, inputs, output):
        embeddings, labels, proxies, margin, alpha, *rest = inputs
        loss, stats = output
        ctx.mark_non_differentiable(stats)
        ctx.inputs = len(inputs)
        ctx.shard = rest[0] if rest else None
        if ctx.shard is not None:
            ctx.mark_non_differentiable(loss)  # a shard's parts (_register's)
            return
        ctx.save_for_backward(embeddings, labels, proxies, stats)  # and a few numbers per proxy
        ctx.params = (margin, alpha)

    def backward(ctx, grad, _grad_stats):
        none = (None,) * (ctx.inputs - 3)
        if ctx.shard is not None:
            return None, None, None, *none
        embeddings, labels, proxies, stats = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[2]]
        if not any(mask):
            return None, None, None, *none
        ge, gp = backward_op(grad, embeddings, labels, proxies, stats, *ctx.params, mask)
        return (ge if mask[0] else None), None, (gp if mask[1] else None), *none

    forward_op, backward_op = register_op(
        op, setup_context, backward, autograd_in_python=True, autocast_to=torch.float32
    )
    return forward_op


@dataclass(frozen=True)
class PairLossSpec:
    """What every layer reads of one pair loss (the public function, the module, the fake
    kernels, the losses across ranks; csrc/pair_losses.h for the kernels' side):
    params: its parameters after the tensors, as (kind, name) in the schema's order;
    columns: its stats' columns; parts: how many numbers a shard's reducer parts hold;
    stats_dtype: the stats' dtype where it is not the accumulation type;
    whole_stats: a shard's backward (shard >= 0) takes the whole problem's stats and gives the
    rank its rows' whole gradient (torchkit/ops/_pair_losses_across_ranks.py)."""

    params: tuple[tuple[str, str], ...]
    columns: int
    parts: int
    stats_dtype: Optional[torch.dtype] = None
    whole_stats: bool = False


SPECS = {
    "supcon_loss": PairLossSpec((("float", "temperature"),), columns=2, parts=4, whole_stats=True),
    "ntxent_loss": PairLossSpec((("float", "temperature"),), columns=3, parts=3, whole_stats=True),
    "contrastive_loss": PairLossSpec(
        (("float", "pos_margin"), ("float", "neg_margin"), ("str", "distance")), columns=2, parts=6, whole_stats=True
    ),
    "triplet_margin_loss": PairLossSpec(
        (("float", "margin"), ("str", "mining"), ("str", "distance")), columns=3, parts=2, stats_dtype=torch.int64
    ),
    "multi_similarity_loss": PairLossSpec(
        (("float", "alpha"), ("float", "beta"), ("float", "base"), ("optional float", "miner_epsilon")),
        columns=5,
        parts=4,
        stats_dtype=torch.float64,
        whole_stats=True,
    ),
}
# The values of each str parameter, in csrc/pair_losses.cpp's messages' order.
_CHOICES = {"mining": ("all", "batch_hard", "semi_hard"), "distance": ("euclidean", "cosine")}
# The forward schemas' defaults of parameters (csrc/pair_losses.cpp).
_DEFAULTS = {"distance": "euclidean"}


def _choices(name: str) -> str:
    """'a', 'b' or 'c'."""
    quoted = [f"'{v}'" for v in _CHOICES[name]]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _loss(op, embeddings, labels, params, ref_embeddings, ref_labels, group=None, indices_tuple=None) -> Tensor:
    def check(kernel: bool = True) -> tuple:
        check_tensor(op, "embeddings", embeddings)
        check_tensor(op, "labels", labels)
        check_tensor(op, "ref_embeddings", ref_embeddings, optional=True)
        check_tensor(op, "ref_labels", ref_labels, optional=True)
        checked = _as_params(op, params)
        if kernel:  # (indices_tuple's loss runs no kernel: any device)
            _check_device(op, embeddings)
        # Checked here too, not only by the kernels and the fake kernel: torch.compile then
        # raises eager's own exception, where a fake kernel's is wrapped in its TorchRuntimeError.
        _check_inputs(op, embeddings, labels, ref_embeddings, ref_labels)
        _check_params(op, checked)
        return checked

    if indices_tuple is not None:
        return _listed(op, embeddings, labels, params, ref_embeddings, ref_labels, group, indices_tuple, check)
    if group is not None:
        from torchkit.ops._pair_losses_across_ranks import loss_across_ranks

        return loss_across_ranks(op, embeddings, labels, ref_embeddings, ref_labels, group, check)
    loss, _ = _FORWARD[op](embeddings, labels, ref_embeddings, ref_labels, *check())
    return loss


def _listed(op, embeddings, labels, params, ref_embeddings, ref_labels, group, indices_tuple, check) -> Tensor:
    """The loss on the pairs or triplets indices_tuple lists (torchkit/ops/_listed_pairs.py):
    the inputs checked as for every pair, the labels not read."""
    from torchkit.ops._listed_pairs import check_indices_tuple, listed_loss

    checked = check(kernel=False)
    if group is not None:
        raise NotImplementedError(f"{op}: indices_tuple with group= is not supported: give one of them")
    if op == "triplet_margin_loss" and checked[1] != "all":
        raise ValueError(
            f"{op}: indices_tuple and mining='{checked[1]}' both choose the triplets: give indices_tuple with "
            "mining='all' (the default), or mining alone"
        )
    if op == "multi_similarity_loss" and checked[3] is not None:
        raise ValueError(
            f"{op}: indices_tuple and miner_epsilon={checked[3]:g} (the function's default miner) both choose the "
            "pairs: give indices_tuple with miner_epsilon=None, or the miner alone"
        )
    M = embeddings.shape[0] if ref_embeddings is None else ref_embeddings.shape[0]
    indices = check_indices_tuple(op, indices_tuple, embeddings.shape[0], M, embeddings.device)
    return listed_loss(op, embeddings, ref_embeddings, indices, checked)


def _as_params(op: str, params: tuple, *, loss: Optional[str] = None) -> tuple:
    """The parameters as the schema takes them: floats (None where optional), strings."""

    def convert(kind, name, value):
        if kind == "str":
            return _as_str(op, name, value)
        if kind == "optional float" and value is None:
            return None
        return as_float(op, name, value)

    return tuple(convert(kind, name, v) for (kind, name), v in zip(SPECS[loss or op].params, params, strict=True))


def _as_str(op: str, name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(
            f"{op}: {name} must be a str, one of {', '.join(map(repr, _CHOICES[name]))}; got {describe(value)}"
        )
    return value


def _check_params(op: str, params: tuple, *, loss: Optional[str] = None) -> None:
    """csrc/pair_losses.cpp's parameter checks (check_positive, check_finite, check_margin,
    check_mining, check_distance), with their messages (comparisons, which Dynamo traces; NaN
    fails them). ``op`` names the caller in messages; ``loss`` (default: ``op``) says whose
    parameters these are."""
    for (kind, name), value in zip(SPECS[loss or op].params, params, strict=True):
        if kind == "str":
            if value not in _CHOICES[name]:
                raise ValueError(f"{op}: {name} must be {_choices(name)}, got '{value}'")
        elif value is None:
            continue
        elif name in ("temperature", "alpha", "beta"):
            if not 0.0 < value < math.inf:
                raise ValueError(f"{op}: {name} must be finite and > 0, got {value:g}")
        elif not -math.inf < value < math.inf:  # base, the margins, miner_epsilon: either sign, as PML
            raise ValueError(f"{op}: {name} must be finite, got {value:g}")


def _check_device(op: str, embeddings: Tensor) -> None:
    """Refuse a device this build has no kernel for, saying why (the dispatcher's own error
    lists backends)."""
    key = embeddings.device.type.upper()
    if key not in ("CPU", "META") and not torch._C._dispatch_has_kernel_for_dispatch_key(f"torchkit::{op}", key):
        raise NotImplementedError(
            f"{op}: no {embeddings.device.type} kernel yet (the CPU kernel only); compute the loss on "
            f"CPU tensors, e.g. {op}(embeddings.cpu(), labels.cpu())"
        )


def _check_labels(op: str, name: str, labels: Tensor, of: str, rows: Tensor) -> None:
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"{op}: {name} must have an integer dtype, got {dtype_name(labels.dtype)}")
    if labels.dim() != 1 or labels.shape[0] != rows.shape[0]:
        raise ValueError(
            f"{op}: {name} must be 1-D with one label per row of {of} ({rows.shape[0]}), got shape {list(labels.shape)}"
        )


def _check_inputs(
    op: str,
    embeddings: Tensor,
    labels: Tensor,
    ref_embeddings: Optional[Tensor],
    ref_labels: Optional[Tensor],
) -> None:
    """csrc/pair_losses.cpp's check_inputs, in the same order with the same messages, for the
    Python functions and the fake kernels."""
    check_floating(op, "embeddings", embeddings)
    if embeddings.dim() != 2:
        raise ValueError(f"{op}: embeddings must be 2-D (N, D), got shape {list(embeddings.shape)}")
    check_same_device(op, embeddings=embeddings, labels=labels)
    _check_labels(op, "labels", labels, "embeddings", embeddings)
    if (ref_embeddings is None) != (ref_labels is None):
        alone = "ref_embeddings alone" if ref_labels is None else "ref_labels alone"
        raise ValueError(f"{op}: ref_embeddings and ref_labels must be given together, got {alone}")
    if ref_embeddings is None:
        return
    check_same_device(op, embeddings=embeddings, ref_embeddings=ref_embeddings)
    if ref_embeddings.dtype != embeddings.dtype:
        raise TypeError(
            f"{op}: embeddings and ref_embeddings must have the same dtype, got {dtype_name(embeddings.dtype)} and "
            f"{dtype_name(ref_embeddings.dtype)}"
        )
    if ref_embeddings.dim() != 2 or ref_embeddings.shape[1] != embeddings.shape[1]:
        raise ValueError(
            f"{op}: ref_embeddings must be 2-D (M, D) with embeddings' D, got embeddings of shape "
            f"{list(embeddings.shape)} and ref_embeddings of shape {list(ref_embeddings.shape)}"
        )
    check_same_device(op, embeddings=embeddings, ref_labels=ref_labels)
    _check_labels(op, "ref_labels", ref_labels, "ref_embeddings", ref_embeddings)


def _check_shard(op: str, shard: Optional[int], embeddings: Tensor, ref_embeddings: Optional[Tensor]) -> None:
    """csrc/pair_losses.cpp's checks of shard (but for the labels' values, the kernel's to read)."""
    if shard is None:
        return
    if ref_embeddings is None:
        raise ValueError(
            f"{op}: shard needs ref_embeddings (every rank's rows, of which the anchors are a shard), "
            "got ref_embeddings=None"
        )
    high = ref_embeddings.shape[0] - embeddings.shape[0]
    if shard != -1 and not 0 <= shard <= high:  # -1 takes any refs
        raise ValueError(
            f"{op}: shard must be -1 (refs apart from the anchors) or the anchors' first row in ref_embeddings, "
            f"in [0, M - N] = [0, {high}], got {shard}"
        )


def _check_own_stats(op: str, own_stats: bool, shard: Optional[int]) -> None:
    """csrc/pair_losses.cpp's check_own_stats: own_stats only for a shard with its anchors among
    the refs (shard >= 0)."""
    if own_stats and (shard is None or shard < 0):
        raise ValueError(
            f"{op}: backward: own_stats needs shard >= 0 (the anchors' rows among the refs: otherwise the stats "
            f"are the call's own anyway), got shard = {shard}"
        )


def _whole_rows(op: str, shard: Optional[int], own_stats: bool, ref_embeddings: Optional[Tensor]) -> Optional[int]:
    """The rows of the whole problem whose stats a shard's backward takes (its refs': shard >= 0
    of a loss whose spec says whole_stats, without own_stats), or None: it takes the call's own."""
    if shard is None or shard < 0 or own_stats or not SPECS[op].whole_stats:
        return None
    return ref_embeddings.shape[0]


def _check_backward(
    op: str,
    grad: Tensor,
    embeddings: Tensor,
    stats: Tensor,
    columns: int,
    anchors=None,
    stats_dtype=None,
    shard: int | None = None,
    whole: int | None = None,
) -> None:
    """csrc/pair_losses.cpp's check_backward_inputs, with its messages (anchors: their number
    where they are not the embeddings' rows; stats_dtype where it is not the accumulation
    type; a shard's grad may be float64; whole: the whole problem's rows, whose stats a shard's
    backward takes)."""
    if grad.dim() != 0:
        raise ValueError(f"{op}: backward: grad must be a scalar (the loss's), got shape {list(grad.shape)}")
    if grad.dtype != embeddings.dtype and not (shard is not None and grad.dtype == torch.float64):
        raise TypeError(
            f"{op}: embeddings and grad must have the same dtype, got {dtype_name(embeddings.dtype)} and "
            f"{dtype_name(grad.dtype)}"
        )
    check_same_device(op, embeddings=embeddings, grad=grad)
    acc = stats_dtype or acc_dtype(embeddings)
    N = whole if whole is not None else embeddings.shape[0] if anchors is None else anchors
    if stats.dim() != 2 or stats.shape[0] != N or stats.shape[1] != columns or stats.dtype != acc:
        rows, why = ("M", " (with shard >= 0: the whole problem's)") if whole is not None else ("N", "")
        raise ValueError(
            f"{op}: backward: stats must be ({rows}, {columns}) = ({N}, {columns}) of {dtype_name(acc)}{why}, got "
            f"{list(stats.shape)} of {dtype_name(stats.dtype)}"
        )
    check_same_device(op, embeddings=embeddings, stats=stats)


def _check_loss_backward(
    op: str, grad: Tensor, embeddings: Tensor, stats: Tensor, shard: int | None = None, whole: int | None = None
) -> None:
    """_check_backward for the pair loss `op`, its stats as its spec lays them out."""
    spec = SPECS[op]
    _check_backward(op, grad, embeddings, stats, spec.columns, stats_dtype=spec.stats_dtype, shard=shard, whole=whole)


def _register(op: str) -> tuple:
    """The fake kernels and autograd formula of one pair loss; returns its (forward, backward)
    callables. A call with shard (the losses across ranks) returns the reducer's parts, which
    carry no gradient: torchkit/ops/_pair_losses_across_ranks.py differentiates them through
    the backward op."""
    spec = SPECS[op]
    kinds, columns = spec.params, spec.columns
    n = len(kinds)

    def check_raw(params):
        floats = ((name, v) for (kind, name), v in zip(kinds, params, strict=True) if kind != "str" and v is not None)
        check_scalars(op, *(("float", name, v) for name, v in floats))
        # (a str argument is the schema's: the dispatcher refuses anything else)

    @torch.library.register_fake(f"torchkit::{op}")
    def _(embeddings, labels, ref_embeddings, ref_labels, *rest, **named):
        # (the schema's defaults, which a call may leave out: distance, shard)
        rest = (*rest, *(named.get(key, _DEFAULTS[key]) for _, key in kinds[len(rest) :]))
        params, shard = rest[:n], named.get("shard", rest[n] if len(rest) > n else None)
        check_raw(params)
        _check_inputs(op, embeddings, labels, ref_embeddings, ref_labels)
        _check_shard(op, shard, embeddings, ref_embeddings)
        _check_params(op, params)
        dtype = spec.stats_dtype or acc_dtype(embeddings)
        stats = embeddings.new_empty((embeddings.shape[0], columns), dtype=dtype)
        if shard is not None:
            return embeddings.new_empty((spec.parts,), dtype=torch.float64), stats
        return embeddings.new_empty(()), stats

    @torch.library.register_fake(f"torchkit::_{op}_backward")
    def _(grad, embeddings, labels, ref_embeddings, ref_labels, stats, *rest):
        params, output_mask, shard = rest[:n], rest[n], (rest[n + 1] if len(rest) > n + 1 else None)
        own_stats = rest[n + 2] if len(rest) > n + 2 else False
        # The CPU kernel's checks, in its order: the forward's, then grad's and stats'.
        check_raw(params)
        _check_inputs(op, embeddings, labels, ref_embeddings, ref_labels)
        _check_shard(op, shard, embeddings, ref_embeddings)
        _check_params(op, params)
        _check_own_stats(op, own_stats, shard)
        whole = _whole_rows(op, shard, own_stats, ref_embeddings)
        _check_loss_backward(op, grad, embeddings, stats, shard, whole)
        want_ref = ref_embeddings is not None and output_mask[1]
        ge = torch.empty_like(embeddings, memory_format=torch.contiguous_format) if output_mask[0] else None
        gr = torch.empty_like(ref_embeddings, memory_format=torch.contiguous_format) if want_ref else None
        return (embeddings.new_empty(0) if ge is None else ge), (embeddings.new_empty(0) if gr is None else gr)

    def setup_context(ctx, inputs, output):
        embeddings, labels, ref_embeddings, ref_labels, *rest = inputs
        loss, stats = output
        ctx.mark_non_differentiable(stats)
        ctx.inputs = len(inputs)
        ctx.params = rest[:n]
        ctx.shard = rest[n] if len(rest) > n else None
        if ctx.shard is not None:
            ctx.mark_non_differentiable(loss)  # a shard's parts
            return
        # Inputs and a few numbers per anchor: nothing N×M.
        ctx.save_for_backward(embeddings, labels, ref_embeddings, ref_labels, stats)

    def backward(ctx, grad, _grad_stats):
        none = (None,) * (ctx.inputs - 4)
        if ctx.shard is not None:
            return None, None, None, None, *none
        embeddings, labels, ref_embeddings, ref_labels, stats = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ref_embeddings is not None and ctx.needs_input_grad[2]]
        if not any(mask):
            return None, None, None, None, *none
        ge, gr = backward_op(grad, embeddings, labels, ref_embeddings, ref_labels, stats, *ctx.params, mask)
        return (ge if mask[0] else None), None, (gr if mask[1] else None), None, *none

    # Under autocast: in float32, as a loss.
    forward_op, backward_op = register_op(
        op, setup_context, backward, autograd_in_python=True, autocast_to=torch.float32
    )
    return forward_op, backward_op


_FORWARD = {op: _register(op)[0] for op in SPECS}
_PROXY_ANCHOR = _register_proxy_anchor()
