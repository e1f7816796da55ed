"""The pair losses (supcon_loss, ntxent_loss): their Python functions, fake kernels and autograd
formulas. The losses themselves are described in csrc/pair_losses.h."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from torchkit.ops._common import (
    acc_dtype,
    as_float,
    check_floating,
    check_same_device,
    check_scalars,
    check_tensor,
    dtype_name,
    register_op,
)


def supcon_loss(
    embeddings: Tensor,
    labels: Tensor,
    temperature: float = 0.1,
    *,
    ref_embeddings: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
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
        ref_embeddings (Tensor[M, D], optional): the pairs' other side instead of the batch
            itself (PML's ``ref_emb``: a cross-batch memory, another view); then every
            (anchor, ref) pair counts, none is left out as "itself".
        ref_labels (Tensor[M], optional): their labels; given with ``ref_embeddings``.

    Returns:
        A scalar of ``embeddings``' dtype. 0 (with zero gradients) when the batch has no
        positive pair or no negative pair, as PML gives; an anchor without positives adds
        nothing. A NaN embedding makes the loss NaN wherever it is a pair of an anchor with
        positives (PML drops NaN anchors from its mean and returns a finite value).

    Example::

        >>> emb = model(images)  # (N, 128)
        >>> loss = torchkit.ops.supcon_loss(emb, labels, temperature=0.1)
    """
    return _loss("supcon_loss", embeddings, labels, temperature, ref_embeddings, ref_labels)


def ntxent_loss(
    embeddings: Tensor,
    labels: Tensor,
    temperature: float = 0.07,
    *,
    ref_embeddings: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
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
        ref_embeddings (Tensor[M, D], optional): the pairs' other side instead of the batch
            itself (PML's ``ref_emb``); then every (anchor, ref) pair counts.
        ref_labels (Tensor[M], optional): their labels; given with ``ref_embeddings``.

    Returns:
        A scalar of ``embeddings``' dtype; 0 (with zero gradients) when the batch has no
        positive pair or no negative pair, as PML gives. ``tiny`` is the accumulation type's
        smallest normal number (PML's ``small_val``): it bounds a pair's loss at about 87
        (float32).

    Example::

        >>> z = model(torch.cat([view1, view2]))  # (2B, 128)
        >>> loss = torchkit.ops.ntxent_loss(z, torch.arange(B).repeat(2), temperature=0.5)
    """
    return _loss("ntxent_loss", embeddings, labels, temperature, ref_embeddings, ref_labels)


def _loss(op, embeddings, labels, temperature, ref_embeddings, ref_labels) -> Tensor:
    check_tensor(op, "embeddings", embeddings)
    check_tensor(op, "labels", labels)
    check_tensor(op, "ref_embeddings", ref_embeddings, optional=True)
    check_tensor(op, "ref_labels", ref_labels, optional=True)
    t = as_float(op, "temperature", temperature)
    _check_device(op, embeddings)
    # Checked here too, not only by the kernels and the fake kernel: torch.compile then raises
    # eager's own exception, where a fake kernel's is wrapped in its TorchRuntimeError.
    _check_inputs(op, embeddings, labels, ref_embeddings, ref_labels, t)
    loss, _ = _FORWARD[op](embeddings, labels, ref_embeddings, ref_labels, t)
    return loss


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
    temperature: float,
) -> None:
    """csrc/pair_losses.cpp's check_inputs, in the same order with the same messages, for the
    Python functions and the fake kernels."""
    check_floating(op, "embeddings", embeddings)
    if embeddings.dim() != 2:
        raise ValueError(f"{op}: embeddings must be 2-D (N, D), got shape {list(embeddings.shape)}")
    check_same_device(op, embeddings=embeddings, labels=labels)
    _check_labels(op, "labels", labels, "embeddings", embeddings)
    if not 0.0 < temperature < math.inf:  # comparisons, which Dynamo traces; NaN fails
        raise ValueError(f"{op}: temperature must be finite and > 0, got {temperature:g}")
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


def _register(op: str) -> tuple:
    """The fake kernels and autograd formula of one pair loss; returns its (forward, backward)
    callables."""
    columns = 2 if op == "supcon_loss" else 3  # csrc/pair_losses.h

    @torch.library.register_fake(f"torchkit::{op}")
    def _(embeddings, labels, ref_embeddings, ref_labels, temperature):
        check_scalars(op, ("float", "temperature", temperature))
        _check_inputs(op, embeddings, labels, ref_embeddings, ref_labels, temperature)
        stats = embeddings.new_empty((embeddings.shape[0], columns), dtype=acc_dtype(embeddings))
        return embeddings.new_empty(()), stats

    @torch.library.register_fake(f"torchkit::_{op}_backward")
    def _(grad, embeddings, labels, ref_embeddings, ref_labels, stats, temperature, output_mask):
        check_scalars(op, ("float", "temperature", temperature))
        check_same_device(op, embeddings=embeddings, grad=grad, stats=stats)
        want_ref = ref_embeddings is not None and output_mask[1]
        ge = torch.empty_like(embeddings, memory_format=torch.contiguous_format) if output_mask[0] else None
        gr = torch.empty_like(ref_embeddings, memory_format=torch.contiguous_format) if want_ref else None
        return (embeddings.new_empty(0) if ge is None else ge), (embeddings.new_empty(0) if gr is None else gr)

    def setup_context(ctx, inputs, output):
        embeddings, labels, ref_embeddings, ref_labels, temperature = inputs
        _loss, stats = output
        ctx.mark_non_differentiable(stats)
        # Inputs and a few numbers per anchor: nothing N×M.
        ctx.save_for_backward(embeddings, labels, ref_embeddings, ref_labels, stats)
        ctx.temperature = temperature

    def backward(ctx, grad, _grad_stats):
        embeddings, labels, ref_embeddings, ref_labels, stats = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ref_embeddings is not None and ctx.needs_input_grad[2]]
        if not any(mask):
            return None, None, None, None, None
        ge, gr = backward_op(grad, embeddings, labels, ref_embeddings, ref_labels, stats, ctx.temperature, mask)
        return (ge if mask[0] else None), None, (gr if mask[1] else None), None, None

    # Under autocast: in float32, as a loss.
    forward_op, backward_op = register_op(
        op, setup_context, backward, autograd_in_python=True, autocast_to=torch.float32
    )
    return forward_op, backward_op


_FORWARD = {op: _register(op)[0] for op in ("supcon_loss", "ntxent_loss")}
