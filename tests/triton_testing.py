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
- `quick_helper_calls()`: the interpreter re-patches triton.language on every call of a
  @triton.jit helper; patched to do it once per launch (the same kernels and results, about a
  quarter less time). It also makes the interpreter's Triton-to-NumPy type lookup a table
  lookup (quick_np_dtypes).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
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


def quick_helper_calls() -> bool:
    """Patch the interpreter to patch triton.language once per launch for each set of
    language modules a @triton.jit helper sees, not on every call; False where this
    Triton's interpreter is not the one the patch knows (it then changes nothing).

    A launch (GridExecutor.__call__) patches the modules its kernel sees (tl, tl.tensor,
    tl.math) and undoes that when it returns. Every helper call (InterpretedFunction.__call__)
    patches the modules the helper sees (tl.core as well, where its module imports it) by
    inspect.getmembers over each, about 0.2 ms, and never undoes it: a second call within the
    same launch finds them patched and sets only equivalents of what is set. Our kernels call
    small helpers in their inner loops, so that took a quarter of the suite's interpreted
    time. Outside a launch a call keeps the interpreter's own path."""
    import triton.language as tl
    from triton.runtime import interpreter

    launch_class = getattr(interpreter, "GridExecutor", None)
    helper_class = getattr(interpreter, "InterpretedFunction", None)
    patch = getattr(interpreter, "_patch_lang", None)
    error = getattr(interpreter, "InterpreterError", None)
    if None in (launch_class, helper_class, patch, error) or not hasattr(helper_class, "rewrite"):
        return False
    launch, helper = launch_class.__call__, helper_class.__call__
    if getattr(helper, "_quick", False):
        return True
    try:
        source = inspect.getsource(helper)
    except (OSError, TypeError):
        return False
    # (the body this replaces: patch the language, then call the rewritten function)
    if "_patch_lang(self.fn)" not in source or "self.rewrite()" not in source:
        return False
    depth, patched, seen = [0], set(), {}

    def launched(self, *args, **kwargs):
        depth[0] += 1
        if depth[0] == 1:
            patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    def called(self, *args, **kwargs):
        if not depth[0]:
            return helper(self, *args, **kwargs)
        langs = seen.get(self.fn)
        if langs is None:  # (as _patch_lang finds them)
            found = self.fn.__globals__.values()
            langs = seen[self.fn] = frozenset(id(v) for v in found if inspect.ismodule(v) and v in (tl, tl.core))
        if langs not in patched:
            patch(self.fn)
            patched.add(langs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # (as the interpreter reports it)
            raise error(repr(e)) from e

    called._quick = True
    launch_class.__call__ = launched
    helper_class.__call__ = called
    quick_np_dtypes()
    return True


def quick_np_dtypes() -> bool:
    """Patch the interpreter's _get_np_dtype, which builds a dictionary of every Triton scalar
    type (hashing each) on each of its calls, one or more per element operation (about a tenth
    of an interpreted kernel's time), into a lookup by the scalar type's name in the table the
    original gives. False where this Triton has no such function (nothing changes)."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or getattr(original, "_quick", False):
        return original is not None
    table = {}
    for value in vars(tl).values():
        if isinstance(value, tl.dtype) and not isinstance(value, tl.pointer_type | tl.block_type):
            with contextlib.suppress(KeyError):
                table[value.name] = original(value)
    pointer = original(tl.pointer_type(tl.int8))

    def lookup(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return pointer
        found = table.get(getattr(scalar, "name", None))
        return found if found is not None else original(tt_dtype)

    lookup._quick = True
    interpreter._get_np_dtype = lookup
    return True
