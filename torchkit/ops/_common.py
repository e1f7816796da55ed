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


def describe(value: Any) -> str:
    """A bad argument as an error message shows it: a tensor by its shape and dtype (not its
    values); a number, string or list of them by its type and repr, cut short; anything else
    by its type (a repr could be long, or holds tensors that torch.compile cannot print)."""
    if torch.is_tensor(value):
        return f"Tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    items = value if isinstance(value, (list, tuple)) else [value]
    if not all(_is_plain(v) for v in items):
        return type(value).__name__
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


# The integer dtypes a 0-d tensor reads back as a Python int. Not "neither float, complex nor
# bool": that would let in quantized dtypes (read back dequantized, so a qint8 holding 1.5
# becomes 1) and bits and sub-byte dtypes (no scalar read at all).
_INTEGRAL = (torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32, torch.int64)


def _is_plain(value: Any) -> bool:
    """A Python or numpy scalar, or a string: short to print, and printable under torch.compile."""
    plain = isinstance(value, (type(None), bool, int, float, complex, str, bytes))
    return plain or (getattr(value, "ndim", None) == 0 and not torch.is_tensor(value))


def _is_bool(value: Any) -> bool:
    """A Python, numpy (dtype kind "b") or torch bool: an int or float argument refuses it."""
    dtype = getattr(value, "dtype", None)
    return isinstance(value, bool) or dtype == torch.bool or getattr(dtype, "kind", None) == "b"


def as_int(op: str, name: str, value: Any) -> int:
    """An int argument as a Python int: any integral number (numpy integers and 0-d integer
    tensors included, as PyTorch's own functions take them); bool, float and anything else
    refused with a TypeError that names the argument, and an int past int64 (the schemas'
    ``int``) with a ValueError."""
    # Python ints first: under torch.compile(dynamic=True) they may be symbolic, which the
    # other tests cannot inspect. No try/except around operator.index: older Dynamo cannot
    # trace one that catches.
    if isinstance(value, int) and not isinstance(value, bool):
        integer = value
    elif torch.is_tensor(value) and value.dim() == 0 and value.dtype in _INTEGRAL:
        _check_readable(op, name, value, "an int")
        return int(value)
    elif not _is_bool(value) and not torch.is_tensor(value) and hasattr(type(value), "__index__"):
        integer = operator.index(value)
    else:
        raise TypeError(f"{op}: {name} must be an int, got {describe(value)}")
    if not -(2**63) <= integer < 2**63:
        raise ValueError(f"{op}: {name} must fit in int64, got {integer}")
    return integer


# The smallest int that float() rounds past float64's largest value (max + half an ulp).
_FLOAT64_OVERFLOW = 2**1024 - 2**970


def as_float(op: str, name: str, value: Any) -> float:
    """A float argument as a Python float: any real number (ints, numpy scalars and 0-d real
    tensors included); bool, complex and anything else refused with a TypeError that names
    the argument; an int past float64's range with a ValueError (Python's own OverflowError
    names neither). Ranges (finite, >= 0, ...) are the kernels' checks."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):  # first, as in as_int
        if isinstance(value, int) and abs(value) >= _FLOAT64_OVERFLOW:  # compared, not caught: Dynamo traces it
            raise ValueError(f"{op}: {name} must fit in a float (float64), got an int of {len(str(abs(value)))} digits")
        return float(value)
    if torch.is_tensor(value):
        if value.dim() == 0 and (value.is_floating_point() or value.dtype in _INTEGRAL):
            _check_readable(op, name, value, "a float")
            return float(value)
    elif not _is_bool(value) and getattr(getattr(value, "dtype", None), "kind", None) in ("f", "i", "u"):
        return float(value)  # numpy reals (dtype.kind: float, int, uint)
    raise TypeError(f"{op}: {name} must be a float, got {describe(value)}")


def _check_readable(op: str, name: str, value: Tensor, must: str) -> None:
    """A 0-d tensor argument must hold a value to read: a meta tensor has none (its item()
    error would name neither the function nor the argument)."""
    if value.device.type == "meta":
        raise TypeError(f"{op}: {name} must be {must}, got a meta tensor, which holds no value to read")


def check_bool(op: str, name: str, value: Any) -> None:
    """A flag must be a bool: None or 1 would otherwise pass for False or True."""
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {describe(value)}")


def check_scalars(op: str, *args: tuple[str, str, Any]) -> None:
    """A raw op's Scalar arguments, (kind, name, value) with kind "float", "int" or "bool", as
    its kernels read them (csrc/checks.h's scalar_float, scalar_int, scalar_bool, with their
    messages), for its fake kernels: a float from any real number but a bool, an int from an
    integer, a flag from a bool only. Symbolic values under torch.compile pass by their kind."""
    for kind, name, value in args:
        if kind == "bool":
            ok = isinstance(value, (bool, torch.SymBool))
        elif isinstance(value, bool):
            ok = False
        else:
            ok = isinstance(value, (int, torch.SymInt)) or (
                kind == "float" and isinstance(value, (float, torch.SymFloat))
            )
        if not ok:
            expected = {"float": "a float", "int": "an int", "bool": "a bool"}[kind]
            raise TypeError(f"{op}: {name} must be {expected}, got {describe(value)}")


def check_tensor(op: str, name: str, value: Any, *, optional: bool = False) -> None:
    """A tensor argument must be a Tensor (or None where optional). Anything else would reach
    the dispatcher, whose error names neither the function nor, for None, the argument."""
    if not (isinstance(value, Tensor) or (optional and value is None)):
        raise TypeError(f"{op}: {name} must be a Tensor{' or None' if optional else ''}, got {describe(value)}")


# The names C++ messages print for dtypes (c10::ScalarType), for messages made in Python.
_SCALAR_TYPE_NAMES = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
    torch.bool: "Bool",
    torch.uint8: "Byte",
    torch.int8: "Char",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the C++ checks print it (c10::ScalarType's name)."""
    return _SCALAR_TYPE_NAMES.get(dtype, str(dtype))


def check_floating(op: str, name: str, x: Tensor) -> None:
    """csrc/checks.h's check_floating, with its message, for the fake kernels."""
    if x.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise TypeError(f"{op}: {name} must be float32, float64, float16 or bfloat16, got {dtype_name(x.dtype)}")


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


def _no_context(ctx, inputs, output) -> None:
    return None


def register_op(
    name: str,
    setup_context,
    backward,
    *,
    jvp=None,
    autograd_in_python: bool = False,
    autocast_to: torch.dtype | None = None,
):
    """The registrations every op module ends with, after its fake kernels; returns the
    callables its Python function and autograd formula use: ``(forward, backward_op)``.

    - ``autograd_in_python``: the formula (``setup_context``, ``backward``) becomes the raw op's
      Autograd kernel (``torch.library.register_autograd``). Otherwise the op has a C++ one
      (``csrc/<op>.cpp``) and the formula here serves only ``torch.func`` and forward AD.
    - ``torch.ops.torchkit._<name>_backward``, where the op has one, refuses double backward
      and is wrapped like the forward (``backward_op``; None for an op without one).
    - ``autocast_to``: the dtype the op runs in under autocast, on CPU and CUDA.

    CONTRIBUTING.md tabulates which op uses which mechanism, and why.
    """
    ops = torch.ops.torchkit
    if autograd_in_python:
        torch.library.register_autograd(f"torchkit::{name}", backward, setup_context=setup_context)
    forward = differentiable(name, getattr(ops, name).default, setup_context, backward, jvp)
    backward_op = None
    if hasattr(ops, f"_{name}_backward"):
        refuse = no_double_backward(name)
        torch.library.register_autograd(f"torchkit::_{name}_backward", refuse, setup_context=_no_context)
        backward_op = differentiable(name, getattr(ops, f"_{name}_backward").default, _no_context, refuse)
    if autocast_to is not None:
        for device in ("cpu", "cuda"):
            torch.library.register_autocast(f"torchkit::{name}", device, autocast_to)
    return forward, backward_op


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
