"""The fused ops: ``torch.ops.torchkit.*`` behind typed, documented Python functions.

Each op's fake kernel (for ``torch.compile``) and autograd formula are registered here,
next to the function that calls it; schemas and kernels live in ``csrc/``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["bilinear_pool", "cdist", "label_smoothing_cross_entropy", "permute_blocks", "region_confusion"]


def _no_double_backward(name: str):
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"torchkit.ops.{name}: double backward (the gradient of the gradient) is not supported"
        )

    return backward


# ---------------------------------------------------------------------------------------
# label_smoothing_cross_entropy


def label_smoothing_cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Optional[Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.1,
    *,
    exclude_target: bool = False,
) -> Tensor:
    """Cross-entropy with label smoothing, fused: one pass forward, one pass backward.

    With ``exclude_target=False`` this is ``F.cross_entropy(input, target, weight=weight,
    ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)`` for
    every form PyTorch accepts, gradients included, without materialising ``log_softmax``.

    Args:
        input (Tensor[C], Tensor[N, C] or Tensor[N, C, d1, ..., dk]): logits, float32,
            float64, float16 or bfloat16 (reduced types accumulate in float32).
        target: class indices (int64 or int32) of shape ``()``, ``(N,)`` or
            ``(N, d1, ..., dk)``, or class probabilities with ``input``'s shape and dtype.
        weight (Tensor[C], optional): per-class weights, a constant (no gradient).
        ignore_index: positions whose index target equals it add nothing, to the loss or
            to the mean's denominator. Not allowed (>= 0) with probability targets.
        reduction: ``"none"`` (one loss per position), ``"mean"`` (the sum divided by the
            total weight of the kept positions, or by their number for probability
            targets) or ``"sum"``.
        label_smoothing: ε in [0, 1].
        exclude_target: the smoothing convention. ``False`` (PyTorch's): the target
            distribution is ``(1 − ε)·y + ε/C``, the target class included in the uniform
            part. ``True`` (the cookbook's): the target class gets ``1 − ε`` and each of the
            other ``C − 1`` classes ``ε/(C − 1)``; for a probability target ``p`` the
            distribution is ``(1 − ε)·p + ε·(1 − p)/(C − 1)``, which is the same for a
            one-hot ``p``. Weights, ``ignore_index`` and the reductions apply exactly as for
            ``False``: class ``c``'s term ``−q_c·log softmax_c`` is scaled by ``weight[c]``
            and ``"mean"`` divides by the summed ``weight[target]`` of kept positions.
            Needs ``C >= 2`` when ``ε > 0``.

    Returns:
        The loss: a scalar for ``"mean"`` and ``"sum"``, the positions' shape for
        ``"none"``; ``input``'s dtype.

    Example::

        >>> logits = torch.randn(8, 1000, requires_grad=True)
        >>> labels = torch.randint(1000, (8,))
        >>> loss = torchkit.ops.label_smoothing_cross_entropy(logits, labels, label_smoothing=0.1)
        >>> loss.backward()
    """
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "label_smoothing_cross_entropy: weight must not require grad (class weights are "
            "constants here), got a weight with requires_grad=True; pass weight.detach()"
        )
    loss, _, _ = torch.ops.torchkit.label_smoothing_cross_entropy.default(
        input, target, weight, ignore_index, reduction, float(label_smoothing), exclude_target
    )
    return loss


def _lsce_positions(input: Tensor) -> tuple:
    return () if input.dim() == 1 else (input.shape[0], *input.shape[2:])


def _acc_dtype(input: Tensor) -> torch.dtype:
    return torch.float64 if input.dtype == torch.float64 else torch.float32


@torch.library.register_fake("torchkit::label_smoothing_cross_entropy")
def _(input, target, weight, ignore_index, reduction, label_smoothing, exclude_target):
    positions = _lsce_positions(input)
    acc = _acc_dtype(input)
    loss = input.new_empty(positions if reduction == "none" else ())
    return loss, input.new_empty(positions, dtype=acc), input.new_empty((), dtype=acc)


@torch.library.register_fake("torchkit::_label_smoothing_cross_entropy_backward")
def _(grad, input, target, weight, lse, total_weight, ignore_index, reduction, label_smoothing, exclude_target):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _lsce_setup_context(ctx, inputs, output):
    input, target, weight, ignore_index, reduction, label_smoothing, exclude_target = inputs
    _, lse, total_weight = output
    # Only the inputs (no copies), per-position lse and the mean's denominator.
    ctx.save_for_backward(input, target, weight, lse, total_weight)
    ctx.args = (ignore_index, reduction, label_smoothing, exclude_target)


def _lsce_backward(ctx, grad, _grad_lse, _grad_total_weight):
    input, target, weight, lse, total_weight = ctx.saved_tensors
    _, reduction, label_smoothing, exclude_target = ctx.args
    grad_input = grad_target = None
    if ctx.needs_input_grad[0]:
        grad_input = torch.ops.torchkit._label_smoothing_cross_entropy_backward.default(
            grad, input, target, weight, lse, total_weight, *ctx.args
        )
    if ctx.needs_input_grad[1]:
        # Probability targets only: ∂ℓ/∂p_c = a·w_c·(lse − x_c), a the target coefficient.
        class_dim = 0 if input.dim() == 1 else 1
        C = input.shape[class_dim]
        eps = label_smoothing
        a = 1 - eps - (eps / (C - 1) if exclude_target and C > 1 else 0.0)
        scale = grad / total_weight if reduction == "mean" else grad
        scale = scale.to(lse.dtype).unsqueeze(class_dim) if reduction == "none" else scale.to(lse.dtype)
        view = [1] * input.dim()
        view[class_dim] = C
        w = 1.0 if weight is None else weight.to(lse.dtype).view(view)
        grad_target = (scale * a * w * (lse.unsqueeze(class_dim) - input.to(lse.dtype))).to(target.dtype)
    return grad_input, grad_target, None, None, None, None, None


torch.library.register_autograd(
    "torchkit::label_smoothing_cross_entropy", _lsce_backward, setup_context=_lsce_setup_context
)
torch.library.register_autograd(
    "torchkit::_label_smoothing_cross_entropy_backward",
    _no_double_backward("label_smoothing_cross_entropy"),
    setup_context=lambda ctx, inputs, output: None,
)


# ---------------------------------------------------------------------------------------
# cdist


def cdist(x1: Tensor, x2: Optional[Tensor] = None, *, squared: bool = False) -> Tensor:
    """Pairwise Euclidean distances, exact and fast: a drop-in for ``torch.cdist(x1, x2)``.

    Both sets are centred on their common mean and multiplied by one GEMM; a fused epilogue
    forms ``|a|² + |b|² − 2·a·b`` and recomputes directly, as ``Σ(a − b)²``, the rare entries
    where that expansion cancels. Float32 results stay within ~1e-6 relative of float64 even
    for points far from the origin, where ``torch.cdist``'s default mode returns 0
    (PyTorch #42479). Reduced types compute in float32. TF32 is used on CUDA only if
    ``torch.backends.cuda.matmul.allow_tf32`` is set, and then the accuracy is TF32's.

    Args:
        x1 (Tensor[*B1, P, M]): float32, float64, float16 or bfloat16.
        x2 (Tensor[*B2, R, M], optional): same dtype and device; batch dimensions broadcast
            against ``x1``'s. ``None`` means distances within ``x1``: the diagonal is exactly 0.
        squared: return squared distances (cheaper, and differentiable everywhere).

    Returns:
        Tensor[*B, P, R] of ``x1``'s dtype. Where a distance is 0 its gradient is 0, as in
        ``torch.cdist``. Backward needs no O(P·R·M) memory.

    Example::

        >>> x, y = torch.randn(4096, 128), torch.randn(1000, 128)
        >>> d = torchkit.ops.cdist(x, y)  # (4096, 1000)
        >>> nearest = d.argmin(1)
    """
    return torch.ops.torchkit.cdist.default(x1, x2, squared)


def _cdist_shape(x1: Tensor, x2: Optional[Tensor]) -> tuple:
    if x2 is None:
        return (*x1.shape[:-1], x1.shape[-2])
    batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    return (*batch, x1.shape[-2], x2.shape[-2])


@torch.library.register_fake("torchkit::cdist")
def _(x1, x2, squared):
    return x1.new_empty(_cdist_shape(x1, x2))


@torch.library.register_fake("torchkit::_cdist_backward")
def _(grad, x1, x2, dist, squared, output_mask):
    def grad_like(x, wanted):
        return torch.empty_like(x, memory_format=torch.contiguous_format) if wanted else x1.new_empty(0)

    return grad_like(x1, output_mask[0]), grad_like(x2, x2 is not None and output_mask[1])


def _cdist_setup_context(ctx, inputs, output):
    x1, x2, squared = inputs
    ctx.save_for_backward(x1, x2, output)  # inputs and output only: no O(P·R·M) state
    ctx.squared = squared


def _cdist_backward(ctx, grad):
    x1, x2, dist = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], x2 is not None and ctx.needs_input_grad[1]]
    g1, g2 = torch.ops.torchkit._cdist_backward.default(grad, x1, x2, dist, ctx.squared, mask)
    return (g1 if mask[0] else None), (g2 if mask[1] else None), None


torch.library.register_autograd("torchkit::cdist", _cdist_backward, setup_context=_cdist_setup_context)
torch.library.register_autograd(
    "torchkit::_cdist_backward", _no_double_backward("cdist"), setup_context=lambda ctx, inputs, output: None
)


# ---------------------------------------------------------------------------------------
# permute_blocks, region_confusion


def permute_blocks(x: Tensor, permutation: Tensor, num_blocks: int) -> Tensor:
    """Rearrange an image's ``num_blocks × num_blocks`` grid of blocks: output block ``b`` is
    input block ``permutation[..., b]`` (blocks numbered row-major). One pass, one read per
    output element; any dtype (uint8 and bool included), contiguous or ``channels_last``
    (kept in the output). Differentiable: the gradient is the gather by the inverse.

    Args:
        x (Tensor[C, H, W] or Tensor[N, C, H, W]): blocks are ``⌊H/n⌋ × ⌊W/n⌋``; rows below
            and columns right of the last full block stay in place.
        permutation (Tensor[n²] or Tensor[N, n²]): int64 or int32 block indices in
            ``[0, n²)``, a permutation per sample (values out of range raise on the CPU and
            fail a device-side assertion on CUDA).
        num_blocks: ``n``, in ``[1, min(H, W)]``.
    """
    return torch.ops.torchkit.permute_blocks.default(x, permutation, num_blocks)


def _permute_blocks_format(x: Tensor) -> torch.memory_format:
    x4 = x if x.dim() == 4 else x.unsqueeze(0)
    cl = x4.shape[1] > 1 and x4.is_contiguous(memory_format=torch.channels_last) and not x4.is_contiguous()
    return torch.channels_last if cl else torch.contiguous_format


@torch.library.register_fake("torchkit::permute_blocks")
def _(x, permutation, num_blocks):
    x4 = x if x.dim() == 4 else x.unsqueeze(0)
    out = torch.empty_like(x4, memory_format=_permute_blocks_format(x))
    return out if x.dim() == 4 else out.squeeze(0)


def _inverse_permutation(permutation: Tensor) -> Tensor:
    index = permutation.long()
    ids = torch.arange(index.shape[-1], device=index.device).expand_as(index)
    return torch.empty_like(index).scatter_(-1, index, ids)


def _permute_blocks_setup_context(ctx, inputs, output):
    _, permutation, num_blocks = inputs
    ctx.save_for_backward(permutation)
    ctx.num_blocks = num_blocks


def _permute_blocks_backward(ctx, grad):
    (permutation,) = ctx.saved_tensors
    # Linear, so its gradient is itself with the inverse permutation (and differentiable again).
    return permute_blocks(grad, _inverse_permutation(permutation), ctx.num_blocks), None, None


torch.library.register_autograd(
    "torchkit::permute_blocks", _permute_blocks_backward, setup_context=_permute_blocks_setup_context
)


def _check_probability(name: str, p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name}: p must be a probability in [0, 1], got {p}")


def _check_rcm_args(x: Tensor, num_blocks: int, neighbourhood: int) -> None:
    if x.dim() not in (3, 4):
        raise ValueError(
            f"region_confusion: x must be an image (C, H, W) or a batch (N, C, H, W), got shape {tuple(x.shape)}"
        )
    if not 1 <= num_blocks <= min(x.shape[-2:]):
        raise ValueError(
            f"region_confusion: num_blocks must be in [1, min(H, W)] = [1, {min(x.shape[-2:])}] for x of shape "
            f"{tuple(x.shape)}, got {num_blocks}"
        )
    if neighbourhood < 1:
        raise ValueError(f"region_confusion: neighbourhood must be >= 1, got {neighbourhood}")


def _rcm_permutations(
    samples: int, n: int, k: int, generator: Optional[torch.Generator], device, p: float = 1.0
) -> Tensor:
    """The cookbook's draws for `samples` images at once, as (samples, n²) block indices.

    Per sample: offsets r ~ randint(−k, k) of shape (n, n) for the row pass, then another
    (n, n) for the column pass, drawn in that order so that the sequence equals the
    reference's sample-by-sample loop. Row pass: σ[:, j] = argsort(i + r[:, j]); column
    pass: τ[i, :] = argsort(j + r'[i, :]); stable sorts. Output block (i, j) is input block
    (σ[i, τ[i, j]], τ[i, j]). Drawn on the generator's device (the CPU by default), so a seed
    gives the same permutations whatever device x is on. With ``p < 1`` each sample is
    shuffled with probability p (one more draw per sample, after the offsets) and otherwise
    gets the identity.
    """
    draw_device = generator.device if generator is not None else torch.device("cpu")
    # generator=None is left out rather than passed: the explicit-generator overload of
    # randint does not take symbolic sizes under torch.compile(dynamic=True).
    rng = {} if generator is None else {"generator": generator}
    r = torch.randint(-k, k, (samples, 2, n, n), device=draw_device, **rng).to(device)
    ar = torch.arange(n, device=device)
    sigma = torch.argsort(ar.view(n, 1) + r[:, 0], dim=1, stable=True)
    tau = torch.argsort(ar.view(1, n) + r[:, 1], dim=2, stable=True)
    perm = (torch.gather(sigma, 2, tau) * n + tau).view(samples, n * n)
    if p < 1.0:
        keep = torch.rand(samples, device=draw_device, **rng).to(device) >= p
        perm = torch.where(keep.unsqueeze(1), torch.arange(n * n, device=device), perm)
    return perm


def region_confusion(
    x: Tensor, num_blocks: int = 7, neighbourhood: int = 2, *, generator: Optional[torch.Generator] = None
) -> tuple[Tensor, Tensor]:
    """DCL's region confusion mechanism (RCM): shuffle each image's ``n × n`` blocks within a
    neighbourhood, exactly as the cookbook's snippet does, for a whole batch at once.

    Every sample gets its own draws; every block moves fewer than ``2k`` block rows and
    ``2k`` block columns. Returns the permutation too: it is the exact label of DCL's
    location loss.

    Args:
        x (Tensor[C, H, W] or Tensor[N, C, H, W]): any dtype, any device, contiguous or
            ``channels_last``. If ``H`` or ``W`` is not divisible by ``n``, blocks are
            ``⌊H/n⌋ × ⌊W/n⌋`` and the remainder rows (bottom) and columns (right) stay put.
        num_blocks: ``n``, in ``[1, min(H, W)]``.
        neighbourhood: ``k >= 1``; offsets are drawn from ``randint(−k, k)``, i.e. [−k, k−1].
        generator: the source of randomness (the global CPU generator by default). Draws
            happen on the generator's device, so the same seed gives the same result for x
            on the CPU and on CUDA.

    Returns:
        ``(shuffled, permutation)``: ``permutation`` is int64 of shape ``(N, n²)`` (``(n²,)``
        for a 3-D x); output block ``b`` is input block ``permutation[..., b]``.
    """
    _check_rcm_args(x, num_blocks, neighbourhood)
    samples = x.shape[0] if x.dim() == 4 else 1
    perm = _rcm_permutations(samples, num_blocks, neighbourhood, generator, x.device)
    if x.dim() == 3:
        perm = perm.squeeze(0)
    return permute_blocks(x, perm, num_blocks), perm


# ---------------------------------------------------------------------------------------
# bilinear_pool


def bilinear_pool(x: Tensor, y: Optional[Tensor] = None, *, sqrt_eps: float = 1e-5, l2_eps: float = 1e-12) -> Tensor:
    """Bilinear pooling with signed-sqrt and L2 normalisation (B-CNN), fused.

    ``Z = x·yᵀ / (H·W)`` over the flattened spatial positions, then
    ``sign(Z)·sqrt(|Z| + sqrt_eps)``, flattened and L2-normalised per sample exactly as
    ``F.normalize(·, eps=l2_eps)``. For ``y = None`` the symmetric product is computed once
    per pair of channels. Only ``x``, ``y``, the output and one norm per sample are kept
    for backward (the unfused composition keeps three N×D² tensors).

    Args:
        x (Tensor[N, D, H, W]): float32, float64, float16 or bfloat16 (reduced types
            accumulate in float32), any memory format (``channels_last`` is read in place).
        y (Tensor[N, E, H, W], optional): the second stream; same N, H, W, dtype, device.
        sqrt_eps: >= 0, inside the signed square root (bounds its gradient).
        l2_eps: >= 0, the normalisation's lower bound on the norm.

    Returns:
        Tensor[N, D·E] of ``x``'s dtype. At ``Z = 0`` exactly, the output and its gradient
        are 0, as the reference's autograd gives.

    Example::

        >>> features = torch.relu(torch.randn(8, 512, 28, 28, requires_grad=True))
        >>> pooled = torchkit.ops.bilinear_pool(features)  # (8, 262144)
    """
    out, _ = torch.ops.torchkit.bilinear_pool.default(x, y, float(sqrt_eps), float(l2_eps))
    return out


@torch.library.register_fake("torchkit::bilinear_pool")
def _(x, y, sqrt_eps, l2_eps):
    E = x.shape[1] if y is None else y.shape[1]
    return x.new_empty((x.shape[0], x.shape[1] * E)), x.new_empty((x.shape[0],), dtype=_acc_dtype(x))


def _bilinear_grad_like(t: Tensor, channels_last: bool) -> Tensor:
    return torch.empty_like(t, memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _bilinear_channels_last(x: Tensor, y: Optional[Tensor]) -> bool:
    def cl(t):
        return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()

    return cl(x) and (y is None or cl(y))


@torch.library.register_fake("torchkit::_bilinear_pool_backward")
def _(grad, x, y, out, norm, sqrt_eps, l2_eps, output_mask):
    cl = _bilinear_channels_last(x, y)
    gx = _bilinear_grad_like(x, cl) if output_mask[0] else x.new_empty(0)
    gy = _bilinear_grad_like(y, cl) if y is not None and output_mask[1] else x.new_empty(0)
    return gx, gy


def _bilinear_setup_context(ctx, inputs, output):
    x, y, sqrt_eps, l2_eps = inputs
    out, norm = output
    ctx.save_for_backward(x, y, out, norm)  # inputs, output and N norms: nothing N×D² more
    ctx.eps = (sqrt_eps, l2_eps)


def _bilinear_backward(ctx, grad, _grad_norm):
    x, y, out, norm = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], y is not None and ctx.needs_input_grad[1]]
    gx, gy = torch.ops.torchkit._bilinear_pool_backward.default(grad, x, y, out, norm, *ctx.eps, mask)
    return (gx if mask[0] else None), (gy if mask[1] else None), None, None


torch.library.register_autograd("torchkit::bilinear_pool", _bilinear_backward, setup_context=_bilinear_setup_context)
torch.library.register_autograd(
    "torchkit::_bilinear_pool_backward",
    _no_double_backward("bilinear_pool"),
    setup_context=lambda ctx, inputs, output: None,
)
