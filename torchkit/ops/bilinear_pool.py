"""bilinear_pool: the Python function, its fake kernels and its autograd formula."""

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
        sqrt_eps: finite and >= 0, inside the signed square root (bounds its gradient).
        l2_eps: finite and >= 0, the normalisation's lower bound on the norm.

    Returns:
        Tensor[N, D·E] of ``x``'s dtype. At ``Z = 0`` exactly, the output and its gradient
        are 0, as the reference's autograd gives.

    Example::

        >>> features = torch.relu(torch.randn(8, 512, 28, 28, requires_grad=True))
        >>> pooled = torchkit.ops.bilinear_pool(features)  # (8, 262144)
    """
    check_tensor("bilinear_pool", "x", x)
    check_tensor("bilinear_pool", "y", y, optional=True)
    eps = as_float("bilinear_pool", "sqrt_eps", sqrt_eps), as_float("bilinear_pool", "l2_eps", l2_eps)
    # Checked here too, not only by the kernels and the fake kernel: torch.compile then raises
    # eager's own exception, where a fake kernel's is wrapped in its TorchRuntimeError.
    _check_inputs(x, y, *eps)
    out, _ = _forward_op(x, y, *eps)
    return out


def _check_inputs(x: Tensor, y: Optional[Tensor], sqrt_eps: float, l2_eps: float) -> None:
    """csrc/bilinear_pool.cpp's check_inputs, in the same order with the same messages, for
    the Python function and the fake kernel: meta tensors and torch.compile refuse bad input
    as the kernels do."""
    op = "bilinear_pool"
    check_floating(op, "x", x)
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be a 4-D feature map (N, D, H, W), got shape {list(x.shape)}")
    for name, eps in (("sqrt_eps", sqrt_eps), ("l2_eps", l2_eps)):
        if not 0.0 <= eps < math.inf:  # comparisons, which Dynamo traces for a symbolic float; NaN fails
            raise ValueError(f"{op}: {name} must be finite and >= 0, got {eps:g}")  # as C++ prints a double
    if x.shape[2] * x.shape[3] == 0:
        raise ValueError(
            f"{op}: x must have at least one spatial position (H·W > 0): the pooled product is divided by H·W; "
            f"got shape {list(x.shape)}"
        )
    if y is None:
        return
    check_same_device(op, x=x, y=y)
    if y.dtype != x.dtype:
        raise TypeError(f"{op}: x and y must have the same dtype, got {dtype_name(x.dtype)} and {dtype_name(y.dtype)}")
    if y.dim() != 4 or y.shape[0] != x.shape[0] or y.shape[2:] != x.shape[2:]:
        raise ValueError(
            f"{op}: y must be (N, E, H, W) with x's N, H and W, got x of shape {list(x.shape)} and y of shape "
            f"{list(y.shape)}"
        )


@torch.library.register_fake("torchkit::bilinear_pool")
def _(x, y, sqrt_eps, l2_eps):
    check_scalars("bilinear_pool", ("float", "sqrt_eps", sqrt_eps), ("float", "l2_eps", l2_eps))
    _check_inputs(x, y, sqrt_eps, l2_eps)
    E = x.shape[1] if y is None else y.shape[1]
    return x.new_empty((x.shape[0], x.shape[1] * E)), x.new_empty((x.shape[0],), dtype=acc_dtype(x))


def _bilinear_grad_like(t: Tensor, channels_last: bool) -> Tensor:
    return torch.empty_like(t, memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _bilinear_channels_last(x: Tensor, y: Optional[Tensor]) -> bool:
    def cl(t):
        return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()

    return cl(x) and (y is None or cl(y))


@torch.library.register_fake("torchkit::_bilinear_pool_backward")
def _(grad, x, y, out, norm, sqrt_eps, l2_eps, output_mask):
    check_scalars("bilinear_pool", ("float", "sqrt_eps", sqrt_eps), ("float", "l2_eps", l2_eps))
    check_same_device("bilinear_pool", x=x, y=y, grad=grad, out=out, norm=norm)
    cl = _bilinear_channels_last(x, y)
    gx = _bilinear_grad_like(x, cl) if output_mask[0] else x.new_empty(0)
    gy = _bilinear_grad_like(y, cl) if y is not None and output_mask[1] else x.new_empty(0)
    return gx, gy


# The autograd formula. Eager autograd and torch.compile use its C++ form (csrc/bilinear_pool.cpp,
# the op's Autograd kernel: no Python per call); this one serves the torch.func transforms.
def _setup_context(ctx, inputs, output):
    x, y, sqrt_eps, l2_eps = inputs
    out, norm = output
    ctx.save_for_backward(x, y, out, norm)  # inputs, output and N norms: nothing N×D² more
    ctx.eps = (sqrt_eps, l2_eps)


def _backward(ctx, grad, _grad_norm):
    x, y, out, norm = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], y is not None and ctx.needs_input_grad[1]]
    gx, gy = _backward_op(grad, x, y, out, norm, *ctx.eps, mask)
    return (gx if mask[0] else None), (gy if mask[1] else None), None, None


# Under autocast: a normalisation (signed sqrt, L2), as autocast runs norms: the result in
# float32.
_forward_op, _backward_op = register_op("bilinear_pool", _setup_context, _backward, autocast_to=torch.float32)
