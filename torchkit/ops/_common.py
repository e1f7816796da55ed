"""What the ops' registrations share."""

from __future__ import annotations

import torch
from torch import Tensor


def acc_dtype(input: Tensor) -> torch.dtype:
    """The dtype the kernels accumulate in (csrc/common.h's acc_type): float64 for float64
    inputs, float32 for the others."""
    return torch.float64 if input.dtype == torch.float64 else torch.float32


def no_double_backward(name: str):
    """The autograd formula of a backward op: the kernels' gradients are not differentiable."""

    def backward(ctx, *grads):
        raise NotImplementedError(
            f"torchkit.ops.{name}: double backward (the gradient of the gradient) is not supported"
        )

    return backward
