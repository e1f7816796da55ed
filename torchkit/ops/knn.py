"""knn: the Python function, its fake kernel, its autograd formula and autocast rule."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torchkit.ops._common import (
    acc_dtype,
    as_int,
    check_bool,
    check_scalars,
    check_tensor,
    register_op,
    transform_or_forward_ad_active,
)
from torchkit.ops.cdist import check_distance_inputs


def knn(query: Tensor, gallery: Optional[Tensor] = None, k: int = 1, *, squared: bool = False) -> tuple[Tensor, Tensor]:
    """Exact k-nearest neighbours by Euclidean distance, without the distance matrix.

    The distances are ``torchkit.ops.cdist``'s (exact far from the origin and for
    near-duplicates inside far-apart clusters), computed tile by tile and reduced to each
    row's ``k`` best while the tile is in cache: beyond the outputs, the memory is a bounded
    workspace (an 8 MiB tile of products on the CPU), never ``P × R``. The ``k`` results are recomputed
    directly from the inputs.

    Args:
        query (Tensor[*B1, P, M]): float32, float64, float16 or bfloat16 (reduced types
            compute in float32).
        gallery (Tensor[*B2, R, M], optional): same dtype and device; batch dimensions
            broadcast as in ``cdist``. ``None`` ranks each row of ``query`` against the
            other rows, never itself (leave-one-out, the protocol of CUB-200, Cars-196 and
            SOP).
        k: the number of neighbours, ``1 <= k <= R`` (``R - 1`` without a gallery).
        squared: return squared distances.

    Returns:
        ``(distances, indices)``, each ``(*B, P, k)``: distances ascending (``query``'s
        dtype), indices int64 into the gallery. Ties go to the lower index, so results are
        deterministic and the same on the CPU and CUDA. A row holding NaN has NaN distances
        and ranks after every number. ``distances`` is differentiable with respect to
        ``query`` and ``gallery`` (the gradient of ``cdist(...).gather(-1, indices)``);
        ``indices`` carry no gradient.

    Example::

        >>> embeddings = torch.nn.functional.normalize(torch.randn(10000, 128), dim=1)
        >>> distances, neighbours = torchkit.ops.knn(embeddings, k=8)  # leave-one-out
    """
    check_tensor("knn", "query", query)
    check_tensor("knn", "gallery", gallery, optional=True)
    check_bool("knn", "squared", squared)
    k = as_int("knn", "k", k)
    # Checked here too, not only by the kernels and the fake kernel: torch.compile then raises
    # eager's own exception, where a fake kernel's is wrapped in its TorchRuntimeError.
    _check_inputs(query, gallery, k)
    return _forward_op(query, gallery, k, squared)


def _knn_shape(query: Tensor, gallery: Optional[Tensor], k: int) -> tuple:
    batch = query.shape[:-2] if gallery is None else torch.broadcast_shapes(query.shape[:-2], gallery.shape[:-2])
    return (*batch, query.shape[-2], k)


def _check_inputs(query: Tensor, gallery: Optional[Tensor], k: int) -> None:
    """csrc/knn.cpp's checks, in the same order with the same messages."""
    check_distance_inputs("knn", "query", query, "gallery", gallery)
    if k < 1:
        raise ValueError(f"knn: k must be >= 1, got {k}")
    if gallery is None and k > query.shape[-2] - 1:
        raise ValueError(
            f"knn: k must be <= P - 1 = {query.shape[-2] - 1} without a gallery (each row's neighbours are the "
            f"other rows of query), got {k}"
        )
    if gallery is not None and k > gallery.shape[-2]:
        raise ValueError(f"knn: k must be <= the gallery's size R = {gallery.shape[-2]}, got {k}")


@torch.library.register_fake("torchkit::knn")
def _(query, gallery, k, squared):
    check_scalars("knn", ("int", "k", k), ("bool", "squared", squared))
    _check_inputs(query, gallery, k)
    shape = _knn_shape(query, gallery, k)
    return query.new_empty(shape), query.new_empty(shape, dtype=torch.long)


def _setup_context(ctx, inputs, output):
    query, gallery, _k, squared = inputs
    distances, indices = output
    ctx.mark_non_differentiable(indices)
    ctx.save_for_backward(query, gallery, distances, indices)
    ctx.squared = squared


# Rows of the backward's (rows, k, M) temporaries per step: about 1 MiB each in float32, so
# that the backward's workspace stays bounded like the forward's instead of growing as P·k·M.
_BACKWARD_ELEMENTS = 1 << 18


def _backward(ctx, grad, _grad_indices):
    """∂d/∂q_i = (q_i - g_j)/d (2·(q_i - g_j) squared), ∂d/∂g_j = -that, for the k pairs
    kept: PyTorch ops over blocks of query rows (a bounded workspace, never P·k·M at once),
    differences taken directly from the inputs (exact far from the origin), 0 where d = 0 as
    in cdist."""
    query, gallery, distances, indices = ctx.saved_tensors
    need_query = ctx.needs_input_grad[0]
    need_gallery = gallery is not None and ctx.needs_input_grad[1]
    if not (need_query or need_gallery):
        return None, None, None, None
    acc = acc_dtype(query)
    g = query if gallery is None else gallery
    batch, (P, k), M = distances.shape[:-2], distances.shape[-2:], query.shape[-1]
    q = query.to(acc).expand(*batch, P, M)
    gal = g.to(acc).expand(*batch, g.shape[-2], M)
    want_q, want_g = need_query or gallery is None, need_gallery or gallery is None
    grad_q_blocks, grad_g = [], torch.zeros_like(gal) if want_g else None
    rows = max(1, _BACKWARD_ELEMENTS // max(1, k * M))
    # In place into the fresh accumulator, except under a torch.func transform, which cannot
    # add a batched block into an unbatched tensor in place.
    scatter_add = torch.Tensor.scatter_add if transform_or_forward_ad_active() else torch.Tensor.scatter_add_
    for start in range(0, P, rows):
        block = slice(start, start + rows)
        index = indices[..., block, :]
        n = index.shape[-2]
        flat = index.reshape(*batch, n * k, 1).expand(*batch, n * k, M)
        diff = q[..., block, :].unsqueeze(-2) - gal.gather(-2, flat).view(*batch, n, k, M)
        d, up = distances[..., block, :].to(acc).unsqueeze(-1), grad[..., block, :].to(acc).unsqueeze(-1)
        # (q - g)/d before the upstream factor: its entries are at most 1, where up/d overflows
        # for a subnormal d.
        contrib = 2 * up * diff if ctx.squared else up * torch.where(d == 0, 0.0, diff / torch.where(d == 0, 1.0, d))
        if want_q:
            grad_q_blocks.append(contrib.sum(-2))
        if want_g:
            grad_g = scatter_add(grad_g, -2, flat, contrib.reshape(*batch, n * k, M).neg())
    grad_q = torch.cat(grad_q_blocks, -2) if want_q else None
    grad_query = grad_gallery = None
    if gallery is None:
        grad_query = (grad_q + grad_g).sum_to_size(query.shape).to(query.dtype)
    else:
        if need_query:
            grad_query = grad_q.sum_to_size(query.shape).to(query.dtype)
        if need_gallery:
            grad_gallery = grad_g.sum_to_size(gallery.shape).to(gallery.dtype)
    return grad_query, grad_gallery, None, None


# Under autocast: in float32, as cdist.
_forward_op, _ = register_op("knn", _setup_context, _backward, autograd_in_python=True, autocast_to=torch.float32)
