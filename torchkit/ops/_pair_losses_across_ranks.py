"""The pair losses across the ranks of a process group (their ``group=``): the loss of the
ranks' batches concatenated in rank order, on every rank, without any rank computing more
than its own anchors' rows of the problem.

How it works: the ranks all-gather the embeddings (and ``ref_embeddings``) once: N_global·D per
rank. Each rank then calls the loss's kernel on its own anchors against the gathered rows as a
shard (csrc/pair_losses.h): its anchors are rows [offset, offset + N_rank) of the refs, the
pair of an anchor with its own row left out, and the kernel returns the reducer's parts (sums
and counts of the terms and the pairs) instead of the loss. One all-reduce sums the parts;
PML's batch rules (no positive pair, at most one of each kind, ...) and the mean's
denominators then hold on the whole problem.

The backward, without ``ref_embeddings`` (a loss whose spec says ``whole_stats``): each rank scales its anchors' stats
to the whole problem's normalisation, the ranks all-gather them (a few numbers per row), and
each rank's backward op takes its rows' pairs with every row once, as anchor and as ref: its
rows' whole gradient, N_local × N_global pairs, and nothing goes back through the gather.
triplet_margin_loss (its mining would need every anchor's per-positive counts) and the losses
with ``ref_embeddings`` call the backward op on the shard with the gradient scaled from the
shard's own normalisation to the whole problem's (a float64 scale), for the anchors' rows and
the gathered rows' from those anchors; the gathered rows' gradient goes back through the
all-gather: a reduce-scatter, each rank receiving its rows' sum over the ranks. Either way
each rank's gradient is its rows' gradient of the whole loss; the rank's terms are exact as on
one process, and only the sums' order differs.

Before any data moves, the ranks exchange a description of their arguments, so that an
argument one rank refuses, or that the ranks disagree on, raises the same exception on every
rank instead of leaving the others waiting.

One process whose refs are a memory that holds its anchors' rows (torchkit.nn.CrossBatchMemory,
loss_against_memory) is the one-rank case: the anchors are a shard of the memory (each anchor's
own copy left out), its parts are the whole problem's, and its backward takes the shard's own
stats (the backward ops' own_stats): the anchors' pairs alone, nothing through the memory.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from torchkit.ops._common import acc_dtype
from torchkit.ops.pair_losses import SPECS

# The stats column of each of them that holds its shard's own normalisation.
_NORMALISED_COLUMN = {"supcon_loss": 1, "ntxent_loss": 2, "multi_similarity_loss": 4}


def loss_across_ranks(
    op: str,
    embeddings: Tensor,
    labels: Tensor,
    ref_embeddings: Optional[Tensor],
    ref_labels: Optional[Tensor],
    group,
    check,
) -> Tensor:
    """``op``'s loss over the ranks of ``group``; ``check()`` runs the single-process checks
    of the arguments and returns the parameters as the schema takes them."""

    def describe(params: tuple) -> dict:
        refs = ref_embeddings is not None
        return dict(
            features=embeddings.shape[1],
            dtype=str(embeddings.dtype),
            device=embeddings.device.type,
            refs=refs,
            params=params,
            grad=embeddings.requires_grad or (refs and ref_embeddings.requires_grad),
            rows=embeddings.shape[0],
            ref_rows=ref_embeddings.shape[0] if refs else None,
        )

    group, params, everyone = _agree(op, group, check, embeddings, describe)
    shards, ref_shards = [r["rows"] for r in everyone], [r["ref_rows"] for r in everyone]
    rank = dist.get_rank(group)
    if ref_embeddings is None:
        if SPECS[op].whole_stats:  # the backward gives each rank its rows' whole gradient: none for the copy
            refs = _gather(embeddings.detach(), shards, group)
        else:
            refs = _Gather.apply(embeddings, shards, rank, group)
        ref_labels, shard = _gather(labels.long(), shards, group), sum(shards[:rank])
    else:
        refs = _Gather.apply(ref_embeddings, ref_shards, rank, group)
        ref_labels, shard = _gather(ref_labels.long(), ref_shards, group), -1
    return _ShardLoss.apply(embeddings, refs, op, labels, ref_labels, params, shard, shards, group)


def proxy_anchor_across_ranks(embeddings: Tensor, labels: Tensor, proxies: Tensor, group, check) -> Tensor:
    """proxy_anchor_loss over the ranks of ``group``: nothing is gathered. Each rank folds its
    own embeddings into every proxy's two log-sums (a shard: csrc/pair_losses.h), one
    all-reduce of their maxima and one of their scaled sums merge them, and each rank's
    backward takes its embeddings' gradient and its share of the proxies' from the merged
    stats."""
    op = "proxy_anchor_loss"

    def describe(params: tuple) -> dict:
        return dict(
            features=embeddings.shape[1],
            dtype=str(embeddings.dtype),
            device=embeddings.device.type,
            classes=proxies.shape[0],
            params=params,
            grad=embeddings.requires_grad or proxies.requires_grad,
        )

    def checked() -> tuple:
        params = check()
        # The kernel's check of the labels' values, before any rank waits on this one.
        C = proxies.shape[0]
        if labels.numel() and labels.device.type == "cpu":
            low, high = int(labels.min()), int(labels.max())
            if low < 0 or high >= C:
                bad = low if low < 0 else high
                raise IndexError(f"{op}: labels must lie in [0, C) = [0, {C}) (a row of proxies each), got {bad}")
        return params

    group, (margin, alpha), _ = _agree(op, group, checked, embeddings, describe)
    return _ProxyShardLoss.apply(embeddings, proxies, labels, margin, alpha, group)


_AGREED = {
    "features": "the feature size D",
    "dtype": "the dtype",
    "device": "the device type",
    "refs": "whether ref_embeddings are given",
    "classes": "the number of proxies C",
    "params": "the loss's parameters",
    "grad": "whether the embeddings require grad (every rank's backward takes part)",
}


def _agree(op: str, group, check, embeddings: Tensor, describe) -> tuple[Any, tuple, list]:
    """The group, the checked parameters and every rank's ``describe(params)``: ``check()``
    runs on every rank and the ranks exchange the outcome before any data moves, so that the
    first rank's error, or a disagreement on what must be the same everywhere, is raised on
    every rank."""
    from torchkit import distributed  # (it imports torchkit.ops)

    group = distributed._resolve_group(op, group)
    try:
        params = check()  # (a device without the loss's kernel refused, as by the loss on one process)
        mine: dict[str, Any] = {"error": None, **describe(params)}
    except (TypeError, ValueError, IndexError, NotImplementedError) as err:
        mine = {"error": (type(err).__name__, str(err))}
    everyone = distributed._all_gather(mine, group)
    kinds = {err.__name__: err for err in (TypeError, ValueError, IndexError, NotImplementedError)}
    for rank, theirs in enumerate(everyone):
        if theirs["error"] is not None:
            kind, message = theirs["error"]
            raise kinds[kind](f"{message} (on rank {rank})")
    for key, name in _AGREED.items():
        values = [theirs.get(key) for theirs in everyone]
        if any(v != values[0] for v in values):
            listed = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(f"{op}: the ranks disagree on {name}: {listed}")
    return group, params, everyone


def _gather(x: Tensor, sizes: list, group) -> Tensor:
    """Every rank's ``x`` (``sizes[r]`` rows on rank r) concatenated in rank order."""
    widest = max(sizes)
    if widest == 0:
        return x.new_empty((0, *x.shape[1:]))
    padded = x.new_zeros((widest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded, group=group)
    return torch.cat([o[:n] for o, n in zip(out, sizes, strict=True)])


class _Gather(torch.autograd.Function):
    """_gather, differentiable: the gathered copy's gradient reduce-scattered, each rank
    receiving its rows summed over the ranks."""

    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        return _gather(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        sizes, widest = ctx.sizes, max(ctx.sizes)
        mine = grad.new_empty((widest, *grad.shape[1:]))
        if widest == 0:
            return mine, None, None, None
        # Each rank's rows padded to the widest shard: the equal blocks reduce-scatter takes.
        if min(sizes) == widest:
            padded = grad.contiguous()
        else:
            padded = grad.new_zeros((len(sizes) * widest, *grad.shape[1:]))
            for r, block in enumerate(grad.split(sizes)):
                padded[r * widest : r * widest + block.shape[0]] = block
        _reduce_scatter(mine, padded, group=ctx.group)
        return mine[: sizes[ctx.rank]], None, None, None


# reduce_scatter_tensor under its newer name, where torch has it (the old name warns there).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def loss_against_memory(
    op: str, embeddings: Tensor, labels: Tensor, memory: Tensor, memory_labels: Tensor, params: tuple, offset: int
) -> Tensor:
    """``op``'s loss of the anchors ``embeddings`` against ``memory``, whose rows [offset,
    offset + N) are the anchors' own (detached) copies, left out of their pairs: PML's
    CrossBatchMemory step, differentiable in the anchors alone."""
    return _ShardLoss.apply(embeddings, memory.detach(), op, labels, memory_labels, params, offset, None, None)


class _ShardLoss(torch.autograd.Function):
    """The whole problem's loss from this rank's shard (its anchors against every rank's rows),
    differentiable in the anchors and the refs; group None: one process's anchors against a
    memory that holds them (loss_against_memory)."""

    @staticmethod
    def forward(ctx, embeddings, refs, op, labels, ref_labels, params, shard, shards, group):
        forward = getattr(torch.ops.torchkit, op).default
        parts, stats = forward(embeddings, labels, refs, ref_labels, *params, shard)
        total = parts.clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        loss, scale, stats = _whole(op, parts, total, stats)
        whole = group is not None and shard >= 0 and SPECS[op].whole_stats
        if whole:
            stats, scale = _whole_stats(op, stats, scale), scale.new_ones(())
        ctx.save_for_backward(embeddings, refs, labels, ref_labels, stats, scale)
        ctx.op, ctx.params, ctx.shard, ctx.shards, ctx.group, ctx.whole = op, params, shard, shards, group, whole
        return loss.to(embeddings.dtype)

    @staticmethod
    def backward(ctx, grad):
        embeddings, refs, labels, ref_labels, stats, scale = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
        own_stats = ()
        if ctx.whole:  # every rank's stats: N_global rows
            stats, mask = _gather(stats, ctx.shards, ctx.group), [mask[0], False]
        elif ctx.shard >= 0 and SPECS[ctx.op].whole_stats:  # (the anchors' pairs alone: nothing for the memory)
            own_stats, mask = (True,), [mask[0], False]
        backward = getattr(torch.ops.torchkit, f"_{ctx.op}_backward").default
        g = grad.double() * scale
        ge, gr = backward(g, embeddings, labels, refs, ref_labels, stats, *ctx.params, mask, ctx.shard, *own_stats)
        return (ge if mask[0] else None), (gr if mask[1] else None), *(None,) * 7


class _ProxyShardLoss(torch.autograd.Function):
    """proxy_anchor_loss over every rank's embeddings from this rank's, differentiable in its
    embeddings and (its share of) the proxies."""

    @staticmethod
    def forward(ctx, embeddings, proxies, labels, margin, alpha, group):
        forward = torch.ops.torchkit.proxy_anchor_loss.default
        parts, stats = forward(embeddings, labels, proxies, margin, alpha, -1)
        log_sums, nan = parts[:, :2], parts[:, :2].isnan()
        # Each proxy's log Σ over every rank's embeddings: the largest log-sum, then the sums
        # scaled by it (NaN counted apart: a maximum need not propagate it).
        top = torch.where(nan, -math.inf, log_sums)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shift = torch.where(top == -math.inf, 0.0, top)
        scaled = torch.where(nan, 0.0, (log_sums - shift).exp())
        sums = torch.cat([scaled, nan.double(), parts[:, 2:]], dim=1)
        dist.all_reduce(sums, group=group)
        merged = torch.where(sums[:, :2] > 0, shift + sums[:, :2].log(), -math.inf)
        # Lp_c, Ln_c: log(1 + Σ) (the 1 the shards leave out), NaN where any rank's was.
        terms = torch.where(sums[:, 2:4] > 0, math.nan, torch.logaddexp(torch.zeros_like(merged), merged))
        C = proxies.shape[0]
        P = (sums[:, 4] > 0).sum().double()
        zero = terms.new_zeros(())
        pos = torch.where(P > 0, terms[:, 0].sum() / P.clamp(min=1), zero)
        loss = pos + (terms[:, 1].sum() / C if C > 0 else zero)
        share = torch.where(P > 0, alpha / P.clamp(min=1), zero).expand(C)
        stats = torch.stack([terms[:, 0], terms[:, 1], share, terms.new_full((C,), alpha / max(C, 1))], dim=1)
        stats = stats.to(acc_dtype(embeddings))
        ctx.save_for_backward(embeddings, proxies, labels, stats)
        ctx.params = (margin, alpha)
        return loss.to(embeddings.dtype)

    @staticmethod
    def backward(ctx, grad):
        embeddings, proxies, labels, stats = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
        backward = torch.ops.torchkit._proxy_anchor_loss_backward.default
        ge, gp = backward(grad, embeddings, labels, proxies, stats, *ctx.params, mask)
        return (ge if mask[0] else None), (gp if mask[1] else None), None, None, None, None


def _whole(op: str, mine: Tensor, total: Tensor, stats: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The whole problem's loss (float64), the backward's scale of this shard's gradient and
    the stats it takes, from this shard's parts and their sums over the ranks, with PML's batch
    rules (the single-process kernels' epilogues, csrc/pair_losses.h)."""
    zero = total.new_zeros(())
    if op == "supcon_loss":
        s, counted, positives, negatives = total
        ok = (positives > 0) & (negatives > 0) & ((positives > 1) | (negatives > 1)) & (counted > 0)
        return torch.where(ok, s / counted, zero), torch.where(ok, mine[1] / counted, zero), stats
    if op == "ntxent_loss":
        s, positives, negatives = total
        ok = (positives > 0) & (negatives > 0) & ((positives > 1) | (negatives > 1))
        return torch.where(ok, s / positives, zero), torch.where(ok, mine[1] / positives, zero), stats
    if op == "triplet_margin_loss":
        s, count = total
        ok = count > 0
        return torch.where(ok, s / count, zero), torch.where(ok, mine[1] / count, zero), stats
    if op == "multi_similarity_loss":
        s, anchors, kept_negatives, kept_positives = total
        ok = ((kept_negatives > 1) | (kept_positives > 1)) & (anchors > 0)
        return torch.where(ok, s * (1 / anchors), zero), torch.where(ok, mine[1] / anchors, zero), stats
    # contrastive_loss: two means, so the stats' two columns (1/count of each kind's terms).
    s_pos, n_pos, s_neg, n_neg, positive_pairs, negative_pairs = total
    ok = (positive_pairs > 1) | (negative_pairs > 1)
    w_pos = torch.where(ok & (n_pos > 0), 1 / n_pos, zero)
    w_neg = torch.where(ok & (n_neg > 0), 1 / n_neg, zero)
    mean_pos = torch.where(n_pos > 0, s_pos / n_pos, zero)
    mean_neg = torch.where(n_neg > 0, s_neg / n_neg, zero)
    loss = torch.where(ok, (zero + mean_neg) + mean_pos, zero)
    stats = torch.stack([w_pos, w_neg]).to(stats.dtype).expand(stats.shape[0], 2).contiguous()
    return loss, total.new_ones(()), stats


def _whole_stats(op: str, stats: Tensor, scale: Tensor) -> Tensor:
    """This shard's rows of the whole problem's stats: its own normalisation scaled to the
    whole problem's (contrastive_loss's are already the whole problem's)."""
    if op in _NORMALISED_COLUMN:
        stats = stats.clone()
        stats[:, _NORMALISED_COLUMN[op]] *= scale.to(stats.dtype)
    return stats
