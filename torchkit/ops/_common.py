"""What the ops' registrations share."""

from __future__ import annotations

import torch
from torch import Tensor


def acc_dtype(input: Tensor) -> torch.dtype:
    """The dtype the kernels accumulate in (csrc/common.h's acc_type): float64 for float64
    inputs, float32 for the others."""
    return torch.float64 if input.dtype == torch.float64 else torch.float32


def check_same_device(op: str, **tensors) -> None:
    """The fake kernels' device check, worded as csrc/checks.h's. A meta tensor mixed into a
    call on real tensors dispatches the whole call to the fake kernel, which must refuse it
    rather than return uninitialised memory on the other tensors' device."""
    named = [(name, t) for name, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{op}: {first_name} and {name} must be on the same device, got {first.device} and {t.device}"
            )


def no_double_backward(name: str):
    """The autograd formula of a backward op: the kernels' gradients are not differentiable."""

    def backward(ctx, *grads):
        raise NotImplementedError(
            f"torchkit.ops.{name}: double backward (the gradient of the gradient) is not supported"
        )

    return backward
