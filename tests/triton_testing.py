"""The Triton path in tests: its kernels run under Triton's interpreter on CPU tensors where no
GPU is visible (conftest.py sets TRITON_INTERPRET=1 before any kernel module is imported), and
compiled on CUDA tensors where one is.

- `installed(op, device)`: the op's Triton kernels hold the dispatcher's slot for `device`
  ("cpu": the CPU slot, so that the op's own tests, its C++ autograd kernel, opcheck and
  torch.compile included, run through the Triton kernels on CPU tensors; "cuda": the CUDA slot)
  for the duration, and the C++ kernels hold it again after. A test marked
  `triton(op, dispatch=False)` skips it: it calls the Triton wrappers itself and compares them
  with the ops, which then are the C++ kernels (on CPU tensors, the CPU kernels).
- `poison_masked_loads()`: the interpreter reads 0 in the masked-off lanes of a tl.load without
  `other`, where a GPU reads whatever is there; patched to NaN (floats) or a sentinel (integers),
  so that a kernel relying on those lanes fails on the CPU too.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import numpy as np
import pytest
import torch

from torchkit import triton as triton_path

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(interpreted: bool = INTERPRETING) -> str | None:
    """Why the Triton path cannot be tested here (compiled, or under the interpreter), or None."""
    found = triton_path.triton_version()
    if found is None:
        return "triton is not installed"
    floor = triton_path.MIN_TRITON_INTERPRETER if interpreted else triton_path.MIN_TRITON
    if found < floor:
        what = "interpreter's" if interpreted else "Triton path's"
        return f"triton {'.'.join(map(str, found))} is below the {what} floor {'.'.join(map(str, floor))}"
    return None


@contextlib.contextmanager
def installed(op: str, device: str):
    reason = available()
    if reason:
        pytest.skip(reason)
    if device == "cpu" and not INTERPRETING:
        pytest.skip("Triton's interpreter is off (a GPU is visible): the Triton kernels run on CUDA tensors there")
    module = importlib.import_module(f"torchkit.triton.{op}")
    library = torch.library.Library("torchkit", "IMPL")
    try:
        for name, function in triton_path.TRITON_KERNELS[op].items():
            library.impl(name.split("::")[1], getattr(module, function), device.upper())
        yield module
    finally:
        library._destroy()


def poison_masked_loads() -> bool:
    """Patch the interpreter's masked load; False where this Triton's private interpreter
    classes are not the ones the patch knows (it then changes nothing)."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_masked_load", None)
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if original is None or np_dtype is None or handle is None:
        return False
    if getattr(original, "_poisoned", False):
        return True

    def create_masked_load(self, ptrs, mask, other, *args, **kwargs):
        if other is None:
            dtype_tt = ptrs.get_element_ty()
            dtype_np = np_dtype(dtype_tt)
            fill = np.nan if np.issubdtype(dtype_np, np.floating) else np.iinfo(dtype_np).max
            other = handle(np.full(ptrs.data.shape, fill, dtype=dtype_np), dtype_tt)
        return original(self, ptrs, mask, other, *args, **kwargs)

    create_masked_load._poisoned = True
    builder.create_masked_load = create_masked_load
    return True
