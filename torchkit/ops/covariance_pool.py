"""covariance_pool: the Python function, its fake kernels, its autograd formula and autocast rule."""

from __future__ import annotations

import torch
from torch import Tensor

from torchkit.ops._common import (
    acc_dtype,
    as_int,
    check_bool,
    check_floating,
    check_same_device,
    check_scalars,
    check_tensor,
    register_op,
)

# The most Newton–Schulz steps a call may ask for (csrc/covariance_pool.h says why).
MAX_ITERATIONS = 100


def covariance_pool(x: Tensor, *, iterations: int = 5, sqrt: bool = True, triu: bool = True) -> Tensor:
    """Global covariance pooling with iterative matrix square-root normalisation
    (iSQRT-COV, Li et al., CVPR 2018), fused.

    The covariance of the channels over the spatial positions,
    ``Σ = (1/M)·(X - X̄)(X - X̄)ᵀ`` (fast-MPN-COV's ``Covpool``, without its M×M centring
    matrix), then with ``sqrt=True`` its square root by ``iterations`` coupled Newton–Schulz
    steps on ``Σ / tr Σ``, compensated by ``√tr Σ`` (fast-MPN-COV's ``Sqrtm``, the same
    values and gradients), then with ``triu=True`` the upper triangle (``Triuvec``).

    Only ``x``, one D×D matrix and one scale per sample are kept for backward (fast-MPN-COV
    keeps an M×M matrix and every iterate). Inputs of any magnitude are exact: each sample is
    scaled by a power of two before its covariance is formed, so float32 features past
    ~1e19 (whose covariance overflows) or below ~1e-19 (whose covariance underflows) give the
    same result as moderate ones, scaled.

    Args:
        x (Tensor[N, D, H, W] or Tensor[N, D, M]): float32, float64, float16 or bfloat16
            (reduced types compute in float32), any memory format (``channels_last`` is read
            in place). At least one position.
        iterations: 1 to 100, the Newton–Schulz steps (fast-MPN-COV's ``iterN``; 3 to 5 in
            its models). ``1`` is ``A·½(3I - A)·√tr Σ``.
        sqrt: take the matrix square root (``False``: the covariance itself).
        triu: return the upper triangle with the diagonal, row by row, ``(N, D(D+1)/2)``;
            ``False`` returns ``(N, D, D)``.

    Returns:
        Tensor of ``x``'s dtype. A sample whose features are all constant over the
        positions has ``Σ = 0``: its output is 0 (the square root of the zero matrix) and its
        gradient is 0. NaN or inf in a sample makes that sample's output NaN.

    Example::

        >>> features = torch.relu(torch.randn(8, 256, 28, 28, requires_grad=True))
        >>> pooled = torchkit.ops.covariance_pool(features)  # (8, 32896)
    """
    check_tensor("covariance_pool", "x", x)
    iterations = as_int("covariance_pool", "iterations", iterations)
    check_bool("covariance_pool", "sqrt", sqrt)
    check_bool("covariance_pool", "triu", triu)
    # Checked here too, not only by the kernels and the fake kernel: torch.compile then raises
    # eager's own exception, where a fake kernel's is wrapped in its TorchRuntimeError.
    _check_inputs(x, iterations)
    out, _, _ = _forward_op(x, iterations, sqrt, triu)
    return out


def _output_shape(x: Tensor, triu: bool) -> tuple:
    N, D = x.shape[0], x.shape[1]
    return (N, D * (D + 1) // 2) if triu else (N, D, D)


def _channels_last(x: Tensor) -> bool:
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


_INT64_MAX = 2**63 - 1


def _check_inputs(x: Tensor, iterations: int) -> None:
    """csrc/covariance_pool.cpp's check_inputs, in the same order with the same messages, for
    the Python function and the fake kernel: torch.compile refuses bad input as eager does
    (tests hold the two together)."""
    check_floating("covariance_pool", "x", x)
    if x.dim() not in (3, 4):
        raise ValueError(
            f"covariance_pool: x must be a feature map (N, D, H, W) or (N, D, M), got shape {list(x.shape)}"
        )
    if not 1 <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"covariance_pool: iterations must be between 1 and {MAX_ITERATIONS}, got {iterations}")
    N, D = x.shape[0], x.shape[1]
    M = x.shape[2] if x.dim() == 3 else x.shape[2] * x.shape[3]
    if M > _INT64_MAX:
        raise ValueError(f"covariance_pool: x's H·W overflows int64, got shape {list(x.shape)}")
    if M == 0:
        raise ValueError(
            "covariance_pool: x must have at least one spatial position (H·W > 0): the covariance is an "
            f"average over them; got shape {list(x.shape)}"
        )
    if D * D > _INT64_MAX or N * D * D > _INT64_MAX:
        raise ValueError(
            f"covariance_pool: N·D·D (the covariances' size) must fit int64 indexing, got N = {N}, D = {D}"
        )


@torch.library.register_fake("torchkit::covariance_pool")
def _(x, iterations, sqrt, triu):
    check_scalars("covariance_pool", ("int", "iterations", iterations), ("bool", "sqrt", sqrt), ("bool", "triu", triu))
    _check_inputs(x, iterations)
    N, D = x.shape[0], x.shape[1]
    acc = acc_dtype(x)
    return x.new_empty(_output_shape(x, triu)), x.new_empty((N, D, D), dtype=acc), x.new_empty((N,), dtype=acc)


@torch.library.register_fake("torchkit::_covariance_pool_backward")
def _(grad, x, sigma, scale, iterations, sqrt, triu):
    check_scalars("covariance_pool", ("int", "iterations", iterations), ("bool", "sqrt", sqrt), ("bool", "triu", triu))
    check_same_device("covariance_pool", x=x, grad=grad, sigma=sigma, scale=scale)
    if _channels_last(x):
        return torch.empty_like(x, memory_format=torch.channels_last)
    return x.new_empty(x.shape)


# The autograd formula. Eager autograd and torch.compile use its C++ form
# (csrc/covariance_pool.cpp, the op's Autograd kernel: no Python per call); this one serves the
# torch.func transforms.
def _setup_context(ctx, inputs, output):
    x, iterations, sqrt, triu = inputs
    _, sigma, scale = output
    ctx.save_for_backward(x, sigma, scale)  # x, one D×D matrix and one scale per sample
    ctx.options = (iterations, sqrt, triu)


def _backward(ctx, grad, _grad_sigma, _grad_scale):
    x, sigma, scale = ctx.saved_tensors
    return _backward_op(grad, x, sigma, scale, *ctx.options), None, None, None


# Under autocast: a matrix function (a square root), as autocast runs linalg: in float32.
_forward_op, _backward_op = register_op("covariance_pool", _setup_context, _backward, autocast_to=torch.float32)
