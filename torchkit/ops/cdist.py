"""cdist: the Python function, its fake kernels and its autograd formula."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torchkit.ops._common import (
    check_bool,
    check_floating,
    check_same_device,
    check_scalars,
    check_tensor,
    dtype_name,
    register_op,
)


def cdist(x1: Tensor, x2: Optional[Tensor] = None, *, squared: bool = False) -> Tensor:
    """Pairwise Euclidean distances, exact and fast: a drop-in for ``torch.cdist(x1, x2)``.

    Both sets are centred on their common mean and multiplied by one GEMM; a fused epilogue
    forms ``|a|² + |b|² - 2·a·b`` and recomputes directly, as ``Σ(a - b)²``, the rare entries
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
    check_tensor("cdist", "x1", x1)
    check_tensor("cdist", "x2", x2, optional=True)
    check_bool("cdist", "squared", squared)
    # Checked here too, not only by the kernels and the fake kernel: torch.compile then raises
    # eager's own exception, where a fake kernel's is wrapped in its TorchRuntimeError.
    check_distance_inputs("cdist", "x1", x1, "x2", x2)
    return _forward_op(x1, x2, squared)


def _cdist_shape(x1: Tensor, x2: Optional[Tensor]) -> tuple:
    if x2 is None:
        return (*x1.shape[:-1], x1.shape[-2])
    batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    return (*batch, x1.shape[-2], x2.shape[-2])


def check_distance_inputs(op: str, name1: str, x1: Tensor, name2: str, x2: Optional[Tensor]) -> None:
    """csrc/cdist.cpp's check_inputs, in the same order with the same messages, for the fake
    kernels of cdist and knn: a bad input is refused with the eager message under
    torch.compile too (tests/test_cdist.py and tests/test_knn.py hold the two together)."""
    check_floating(op, name1, x1)
    if x1.dim() < 2:
        raise ValueError(f"{op}: {name1} must have at least 2 dimensions (*, P, M), got shape {list(x1.shape)}")
    if x2 is None:
        return
    check_same_device(op, **{name1: x1, name2: x2})
    if x2.dtype != x1.dtype:
        got = f"{dtype_name(x1.dtype)} and {dtype_name(x2.dtype)}"
        raise TypeError(f"{op}: {name1} and {name2} must have the same dtype, got {got}")
    if x2.dim() < 2:
        raise ValueError(f"{op}: {name2} must have at least 2 dimensions (*, R, M), got shape {list(x2.shape)}")
    if x2.shape[-1] != x1.shape[-1]:
        raise ValueError(
            f"{op}: {name1} and {name2} must have the same number of features M (their last dimension), got "
            f"{name1} of shape {list(x1.shape)} and {name2} of shape {list(x2.shape)}"
        )
    for s1, s2 in zip(reversed(x1.shape[:-2]), reversed(x2.shape[:-2]), strict=False):  # from the right
        if s1 != s2 and s1 != 1 and s2 != 1:
            raise ValueError(
                f"{op}: the batch dimensions of {name1} and {name2} must broadcast, got {name1} of shape "
                f"{list(x1.shape)} and {name2} of shape {list(x2.shape)}"
            )


@torch.library.register_fake("torchkit::cdist")
def _(x1, x2, squared):
    check_scalars("cdist", ("bool", "squared", squared))
    check_distance_inputs("cdist", "x1", x1, "x2", x2)
    return x1.new_empty(_cdist_shape(x1, x2))


@torch.library.register_fake("torchkit::_cdist_backward")
def _(grad, x1, x2, dist, squared, output_mask):
    check_scalars("cdist", ("bool", "squared", squared))
    check_same_device("cdist", x1=x1, x2=x2, grad=grad, dist=dist)

    def grad_like(x, wanted):
        return torch.empty_like(x, memory_format=torch.contiguous_format) if wanted else x1.new_empty(0)

    return grad_like(x1, output_mask[0]), grad_like(x2, x2 is not None and output_mask[1])


# The autograd formula. Eager autograd and torch.compile use its C++ form (csrc/cdist.cpp,
# the op's Autograd kernel: no Python per call); this one serves the torch.func transforms.
def _setup_context(ctx, inputs, output):
    x1, x2, squared = inputs
    ctx.save_for_backward(x1, x2, output)  # inputs and output only: no O(P·R·M) state
    ctx.squared = squared


def _backward(ctx, grad):
    x1, x2, dist = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], x2 is not None and ctx.needs_input_grad[1]]
    g1, g2 = _backward_op(grad, x1, x2, dist, ctx.squared, mask)
    return (g1 if mask[0] else None), (g2 if mask[1] else None), None


# Under autocast: as autocast runs torch.cdist: the expansion needs float32's digits.
_forward_op, _backward_op = register_op("cdist", _setup_context, _backward, autocast_to=torch.float32)
