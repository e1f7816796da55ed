"""What the ops' registrations share."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor


def acc_dtype(input: Tensor) -> torch.dtype:
    """The dtype the kernels accumulate in (csrc/common.h's acc_type): float64 for float64
    inputs, float32 for the others."""
    return torch.float64 if input.dtype == torch.float64 else torch.float32


def as_int(op: str, name: str, value: Any) -> int:
    """An int argument as a Python int: any integral number (numpy integers and 0-d integer
    tensors included, as PyTorch's own functions take them); bool, float and anything else
    refused with a TypeError that names the argument."""
    is_bool = isinstance(value, bool) or type(value).__name__ == "bool_" or getattr(value, "dtype", None) == torch.bool
    if not is_bool:
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r}")


def check_bool(op: str, name: str, value: Any) -> None:
    """A flag must be a bool: None or 1 would otherwise pass for False or True."""
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__} {value!r}")


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


def differentiable(name: str, op, setup_context, backward, jvp=None):
    """``op`` (a ``torch.ops.torchkit`` overload) as an ``autograd.Function`` with the op's
    autograd formula, for the Python functions to call.

    The raw op's own Autograd kernel (in C++, or ``torch.library.register_autograd``) serves
    eager autograd and ``torch.compile``, but not the ``torch.func`` transforms: they need a ``Function``
    with ``setup_context``. With one, ``torch.func.grad``, ``jacrev`` and ``vmap`` over them
    (per-sample gradients) work; ``vmap`` of the kernels falls back to a loop over the batch.
    Forward-mode AD uses ``jvp`` where the op has one (its ``setup_context`` then calls
    ``ctx.save_for_forward``); without one it is refused with the op's name rather than
    leaving the tangent silently zero. Backward ops go through one too (with
    ``no_double_backward``), as the transforms call them with gradient tracking on."""

    def forward(*args):
        return op(*args)

    def refuse_jvp(ctx, *tangents):
        raise NotImplementedError(
            f"torchkit.ops.{name}: forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad) "
            "is not supported; use reverse mode (backward(), torch.func.grad, jacrev)"
        )

    fn = type(
        op.name().split("::")[-1],
        (torch.autograd.Function,),
        dict(
            forward=staticmethod(forward),
            setup_context=staticmethod(setup_context),
            backward=staticmethod(backward),
            jvp=staticmethod(jvp or refuse_jvp),
            generate_vmap_rule=True,
        ),
    )

    def apply(*args):
        # The Function only where a transform or forward AD is active: elsewhere the raw op's
        # registration does the same, and Function.apply would add ~50 µs of argument binding
        # to every call. torch.compile always traces the raw op (Dynamo cannot trace a
        # Function with a custom jvp).
        if not torch.compiler.is_compiling() and transform_or_forward_ad_active():
            return fn.apply(*args)
        return op(*args)

    return apply


# PyTorch has no public way to ask whether a torch.func transform or forward-mode AD is active;
# these private symbols answer it. Where a torch release lacks them, every call takes the
# Function, which is always correct (only slower).
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def transform_or_forward_ad_active() -> bool:
    """Whether a torch.func transform (grad, vmap, jvp, ...) or a forward-AD dual level is
    active: then the ops must go through their autograd.Function."""
    level = getattr(forward_ad, "_current_level", None)
    if _functorch_active is None or level is None:
        return True
    return _functorch_active() or level >= 0
