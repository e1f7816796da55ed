"""A Triton kernel's GPU time without a GPU: op counts under the interpreter, the compiled
code, and the time each GPU resource needs (make gpu-model).

    TRITON_INTERPRET=1 python tools/gpu_model.py [case ...] [--gpu h100|h200] [--launches]
        [--output F.md] [--check F.json]

Each case (cases(): the GPU benchmarks' headline Triton shapes, benchmarks/bench_*.py) runs
its Triton kernels under Triton's interpreter at two or three small sizes, counting what every
launch executes (counting(); Launch's keys): tl.dot multiply-adds by operand type and
precision, element operations by type, transcendentals, conversions, reductions, bytes loaded
and stored and the distinct bytes touched, atomics, programs, and the waits for memory a
program makes one after another. Each count is fitted as a polynomial in the case's size and
evaluated at the headline size (extrapolate(): exact where the work per tile is constant,
quadratic in the rows for the pair losses and cdist, linear in the batch for bilinear_pool),
so that a case costs seconds, not the hours the interpreter would take there. The torch
operations the op's wrappers run between the launches (Case.calls; views and allocations
run no kernel) count too, each gap's as one row: a launch each, the bytes each reads and
writes, and the values read back to the host (syncs: a synchronisation on a GPU). Launches whose
work depends on the data (exact rechecks taken only where values are close) extrapolate only
as far as that share stays constant. The counts are cached by what they depend on
(count_keys) and committed for every case (COMMITTED_COUNTS, written with --output), so that a
fresh clone counts only the cases whose kernels changed since.

Each launch is compiled for sm_90 as the GPU would compile it (compile_spec(): its
specialisation, in a process without the interpreter, cached in build/gpu-model): registers,
spills, shared memory, CTAs per SM, and for every tl.dot lowered to FMAs (IEEE float32) the
shared-memory wavefronts its operand loads cost, bank conflicts included (fma_dots()). Those
facts are committed too (COMMITTED_COMPILED, written with --output, by the same keys and
Triton's version), so that a fresh clone compiles only the launches whose kernels changed.

The prediction (predict()) turns a launch's counts into the time each resource needs (GPUS,
PIPES: per-SM rates and peaks, with sources) and takes the largest: tensor cores, the FP32,
FP64, integer and conversion pipes, the special-function unit (MUFU), instruction issue,
shared-memory wavefronts, L2 and DRAM bytes, and latency (waits per program and wave of
resident programs); a grid smaller than the GPU's SMs runs on fewer. Software math counts as
the instructions it compiles to (COSTS); integer work that only forms a load's or store's
addresses and mask counts once per vector access its addresses allow, as compiled code forms
them (Counter_.addresses), not per element as the interpreter does. Per case: the predicted
time beside the recorded GPU run's, the launch and resource that bound it, and with
--launches every launch's largest terms: what to fix first. Counts include masked-off lanes
(a GPU executes whole tiles) except bytes, which count active lanes.

Calibration (fit(), EFFICIENCY): the share of its peak each resource reaches, fitted to the
recorded GPU run where the data supports it, and each case predicted again with itself left
out of the fit. Checks (make gpu-model in CI): the rules hot kernels keep (rules(): no float64
work per pair, no IEEE float32 tl.dot, unless the kernel's @hot mark says why) and no case's
prediction past REGRESSION times the committed one (benchmarks/results/model.json).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Callable

import numpy as np

# --------------------------------------------------------------------------- counting

# The interpreter builder's element operations, by class. Layout operations (splat, broadcast,
# reshape, trans, expand_dims, make_range, bitcast, get_program_id) cost no instruction per
# element and are not counted.
FLOAT_OPS = {
    "fadd", "fsub", "fmul", "fma", "fneg", "fabs", "minimumf", "minnumf", "maximumf", "maxnumf", "clampf",
    "fcmpOLT", "fcmpOGT", "fcmpOLE", "fcmpOGE", "fcmpOEQ", "fcmpONE",
    "fcmpULT", "fcmpUGT", "fcmpULE", "fcmpUGE", "fcmpUEQ", "fcmpUNE",
}  # fmt: skip
INT_OPS = {
    "add", "sub", "mul", "shl", "lshr", "ashr", "and", "or", "xor", "idiv", "sdiv", "udiv", "srem", "urem",
    "umulhi", "iabs", "minsi", "minui", "maxsi", "maxui", "select", "addptr",
    "icmpSLE", "icmpSLT", "icmpSGE", "icmpSGT", "icmpULE", "icmpULT", "icmpUGE", "icmpUGT", "icmpEQ", "icmpNE",
}  # fmt: skip
MATH_OPS = {"exp", "exp2", "log", "log2", "sqrt", "precise_sqrt", "rsqrt", "fdiv", "precise_divf", "erf", "sin", "cos"}
CONVERT_OPS = {"fp_ext", "fp_trunc", "fp_to_si", "fp_to_ui", "si_to_fp", "ui_to_fp", "fp_to_fp", "int_cast"}
LAYOUT_OPS = {"trans", "reshape", "expand_dims", "broadcast"}  # carry a dot operand's origin through

TYPE_NAMES = {
    "fp64": "fp64", "fp32": "fp32", "fp16": "fp16", "bf16": "bf16",
    "int1": "i1", "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "i8", "uint16": "i16", "uint32": "i32", "uint64": "i64",
}  # fmt: skip


def _type(handle_or_type) -> str:
    """A Triton scalar type's short name ("fp32", "i64", "ptr")."""
    t = getattr(handle_or_type, "dtype", handle_or_type)
    t = getattr(t, "scalar", t)
    if getattr(t, "is_ptr", lambda: False)():
        return "ptr"
    return TYPE_NAMES.get(getattr(t, "name", str(t)), str(t))


@dataclasses.dataclass
class Launch:
    """One kernel launch's counts, summed over its programs. Keys are "class:op:type":
    dot:<operand type>-<precision>:<accumulator type> (multiply-adds), float:<op>:<type>,
    int:<op>:<type>, addr:<op>:<type> (integer work that only forms a load's or store's
    addresses and mask, per vector access), math:<op>:<type>, convert:<from>-<to>,
    reduce:<type> (elements reduced),
    load:<type> / store:<type> (bytes of active lanes), atomic:<type> (elements),
    touched (distinct bytes loaded or stored), programs."""

    kernel: str
    counts: Counter = dataclasses.field(default_factory=Counter)
    spec: dict | None = None  # what the kernel compiles with (specialisation())
    compiled: dict | None = None  # compile_spec()'s facts, from compile_launches()
    _addresses: dict = dataclasses.field(default_factory=dict, repr=False)
    _pending: Counter = dataclasses.field(default_factory=Counter, repr=False)  # addresses per itemsize
    _unique: Counter = dataclasses.field(default_factory=Counter, repr=False)  # of them distinct, known

    def touch(self, ptrs: np.ndarray, itemsize: int) -> None:
        batch = self._addresses.setdefault(itemsize, [])
        batch.append(ptrs.ravel())
        self._pending[itemsize] += ptrs.size
        # Keep the addresses small: made unique once 2^22 have come since they last were (a
        # limit on all of them would sort them again at every access once more distinct
        # addresses than that have been touched).
        if self._pending[itemsize] - self._unique[itemsize] > 1 << 22:
            self._addresses[itemsize] = [np.unique(np.concatenate(batch))]
            self._pending[itemsize] = self._unique[itemsize] = self._addresses[itemsize][0].size

    def close(self) -> None:
        self.counts["touched"] = sum(
            len(np.unique(np.concatenate(batch))) * size for size, batch in self._addresses.items() if batch
        )
        self._addresses.clear()
        self._pending.clear()
        self._unique.clear()


class _Launches(list):
    """counting()'s launches, in the order they ran; flush() closes the row of torch
    operations in progress."""

    def __init__(self, counter):
        super().__init__()
        self._counter = counter

    def flush(self) -> int:
        """Close the current torch row; the number of launches so far."""
        self._counter.flush()
        return len(self)


class Counter_:
    """Patches the interpreter while active (counting()); launches in the order they ran."""

    def __init__(self):
        self.launches = _Launches(self)
        self.current: Launch | None = None
        self.torch: Launch | None = None  # the torch operations since the last launch
        self.epoch = 0  # loads issued since the last wait carry the current epoch

    def use(self, *handles) -> None:
        """A GPU issues a warp's instructions in order and stalls at the first one that reads a
        load's result still in flight; every load issued before it has then arrived. Counted as
        `waits`: the round trips to memory a program makes one after another."""
        for h in handles:
            if getattr(h, "model_load", -1) == self.epoch:
                self.add("waits", 1)
                self.epoch += 1
                return

    def add(self, key: str, n) -> None:
        if self.current is not None:
            self.current.counts[key] += int(n)

    def torch_op(self, name: str, inputs: list, outputs: list) -> None:
        """A torch operation that runs a kernel (or reads a value back: `sync`), outside any
        launch: into the row of the operations since the last launch (flush())."""
        if self.torch is None:
            self.torch = Launch("torch", spec={"torch": []})
        self.torch.spec["torch"].append(name)
        c = self.torch.counts
        c["launches"] += 1
        c["programs"] += 1
        for kind, tensors in (("load", inputs), ("store", outputs)):
            for t in tensors:
                size = t.numel() * t.element_size()
                c[f"{kind}:{TORCH_TYPES.get(str(t.dtype).removeprefix('torch.'), 'other')}"] += size
                c["touched"] += size
        if name in SYNC_OPS:
            c["syncs"] += 1

    def flush(self) -> None:
        """The torch operations since the last launch as one row of the launches."""
        if self.torch is not None:
            names = self.torch.spec["torch"]
            self.torch.kernel = "torch " + ", ".join(names)
            self.launches.append(self.torch)
            self.torch = None

    def addresses(self, ptrs, mask, itemsize: int) -> None:
        """A GPU forms a load's or store's addresses and mask once per vector access (up to 16
        bytes of consecutive, aligned elements), not per element as the interpreter does: the
        integer work whose results only reach this access's pointers or mask (through other
        integer and layout operations) moves from int: to addr:, divided by the vector width
        its addresses allow. Counted once, by the first access that reaches it."""
        if self.current is None:
            return
        todo, seen, taken = [ptrs, mask], set(), []
        while todo:
            h = todo.pop()
            if h is None or id(h) in seen:
                continue
            seen.add(id(h))
            todo.extend(getattr(h, "model_prev", ()))
            h.model_prev = ()  # every operation behind it is taken now: keep no chain alive
            if getattr(h, "model_int", None) is not None:
                taken.append(h.model_int)
                h.model_int = None
        if taken:  # (addresses formed before a loop: nothing left to take in its later steps)
            vec = _vector_width(ptrs.data, itemsize)
            for key, n in taken:
                self.add(key, -n)
                self.add("addr:" + key.removeprefix("int:"), -(-n // vec))


def _vector_width(ptrs: np.ndarray, itemsize: int) -> int:
    """The widest vector access (1, 2, 4, ... elements, at most 16 bytes) that the addresses
    allow along one axis: groups of that many consecutive elements, the first aligned to the
    vector's size."""
    ptrs = np.asarray(ptrs, dtype=np.int64)
    best = 1
    for axis in reversed(range(ptrs.ndim)):  # the last first: where tiles are most often contiguous
        along = np.moveaxis(ptrs, axis, -1)
        v = 16 // itemsize
        while v > best:
            if along.shape[-1] % v == 0:
                groups = along.reshape(-1, v)
                if np.all(np.diff(groups, axis=1) == itemsize) and np.all(groups[:, 0] % (v * itemsize) == 0):
                    best = v
                    break
            v //= 2
        if best == 16 // itemsize:
            break
    return best


# torch operations that run no kernel: allocations, the dispatcher's metadata, and a Python
# number wrapped as a tensor (scalar_tensor: on the host, whatever the device). Views are
# told by their schema (OpOverload.is_view).
NO_KERNEL_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
                 "alias", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "resize_", "set_",
                 "scalar_tensor"}  # fmt: skip
# torch operations that launch a kernel with no tensor out: a device-side assertion.
OUTPUTLESS_OPS = {"_assert_async"}
# torch operations that read a tensor's value back to the host: a synchronisation on a GPU.
SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "allclose", "nonzero", "masked_select", "unique",
            "_unique2", "repeat_interleave"}  # fmt: skip

TORCH_TYPES = {"float32": "fp32", "float64": "fp64", "float16": "fp16", "bfloat16": "bf16", "int64": "i64",
               "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}  # fmt: skip


def specialisation(fn, constexpr_names, args, kwargs) -> dict:
    """What a launch compiles with, as Triton's JIT would specialise it: each argument's type
    (tensors as pointers, ints as i32 or i64, an int equal to 1 as the constant 1, ints
    divisible by 16 marked so), the constexpr values (INTERPRET false: the GPU's branch) and the
    compiler's options."""
    import inspect

    import torch

    names = inspect.getfullargspec(fn).args
    options = {k: kwargs[k] for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kwargs}
    bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    signature, constexprs, divisible = {}, {}, []
    for name in names:
        value = bound.get(name)
        if name in constexpr_names:
            signature[name] = "constexpr"
            # (a tl.constexpr's value: what triton.compile takes, and what model-counts.json keeps)
            constexprs[name] = False if name == "INTERPRET" else getattr(value, "value", value)
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TORCH_TYPES[str(value.dtype).removeprefix("torch.")]
            divisible.append(name)  # torch's allocations are 16-byte aligned
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                signature[name] = "constexpr"
                constexprs[name] = 1
            else:
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
                if value % 16 == 0:
                    divisible.append(name)
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:  # None, or a tl.constexpr given as an argument (a constant of the compiled kernel)
            signature[name] = "constexpr"
            constexprs[name] = getattr(value, "value", value)
    return {"module": fn.__module__, "kernel": fn.__name__, "signature": signature, "constexprs": constexprs,
            "divisible": divisible, "options": options}  # fmt: skip


@contextlib.contextmanager
def counting(within: tuple[str, ...] = ()):
    """Count what every Triton launch in the block executes (TRITON_INTERPRET=1): yields the
    list of Launch, filled as launches run. Patches the interpreter's builder, reductions and
    grid executor for the duration (Triton 3.8's private classes). `within`: functions
    ("module.name") whose torch operations between launches count too (Counter_.torch_op),
    as rows of the list (its `flush()` closes the current one: at the forward's end)."""
    import importlib

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    builder_cls = interpreter.InterpreterBuilder
    counter = Counter_()
    patched: list[tuple[object, str, object]] = []

    def patch(owner, name, wrapper):
        original = getattr(owner, name)
        patched.append((owner, name, original))
        setattr(owner, name, wrapper(original))

    def integer(out, key, n, args):  # for Counter_.addresses: what an access may take back
        out.model_int = (key, n)
        out.model_prev = args

    def elementwise(op, cls):
        def wrap(original):
            def method(self, *args):
                counter.use(*args)
                out = original(self, *args)
                data = getattr(out, "data", None)
                if data is not None:
                    key = f"{cls}:{op}:{_type(out)}"
                    counter.add(key, np.size(data))
                    if cls == "int":
                        integer(out, key, np.size(data), args)
                return out

            return method

        return wrap

    def compare(op):  # a comparison's result is i1: count it by its operands' type
        def wrap(original):
            def method(self, lhs, rhs):
                counter.use(lhs, rhs)
                out = original(self, lhs, rhs)
                cls = "float" if op.startswith("fcmp") else "int"
                key = f"{cls}:{op}:{_type(lhs)}"
                counter.add(key, np.size(out.data))
                if cls == "int":
                    integer(out, key, np.size(out.data), (lhs, rhs))
                return out

            return method

        return wrap

    def convert(op):
        def wrap(original):
            def method(self, src, dst_type, *rest):
                counter.use(src)
                out = original(self, src, dst_type, *rest)
                source, target = _type(src), _type(out)
                key = f"convert:{source}-{target}"
                if getattr(src, "model_splat", False):  # a constant's conversion: folded on a GPU
                    out.model_splat = True
                    return out
                counter.add(key, np.size(out.data))
                if source in ("bf16", "fp16") and target == "fp32":
                    # An interpreter-only upcast before tl.dot (a GPU multiplies the 16-bit
                    # operands on tensor cores): the dot counts it as 16-bit and takes back
                    # the conversion.
                    out.model_origin = (source, key)
                return out

            return method

        return wrap

    def layout(original):  # moves no data: a loaded value stays in flight through it
        def method(self, arg, *rest):
            out = original(self, arg, *rest)
            for tag in ("model_origin", "model_load"):
                if hasattr(arg, tag):
                    setattr(out, tag, getattr(arg, tag))
            out.model_prev = (arg,)
            return out

        return method

    def splat(original):
        def method(self, *args):
            out = original(self, *args)
            out.model_splat = True
            if hasattr(args[-1], "model_load"):
                out.model_load = args[-1].model_load
            out.model_prev = (args[-1],)
            return out

        return method

    def dot(original):
        def method(self, a, b, d, input_precision, max_num_imprecise_acc):
            counter.use(a, b, d)
            out = original(self, a, b, d, input_precision, max_num_imprecise_acc)
            operands = []
            for x in (a, b):
                origin = getattr(x, "model_origin", None)
                if origin is not None:
                    counter.add(origin[1], -np.size(x.data))
                    operands.append(origin[0])
                else:
                    operands.append(_type(x))
            operand = operands[0] if operands[0] == operands[1] else "-".join(operands)
            precision = getattr(input_precision, "name", str(input_precision)).lower()
            if operand in ("bf16", "fp16", "fp64"):
                precision = "mma"  # tensor cores, whatever the precision argument says
            m, k = a.data.shape[-2:]
            n = b.data.shape[-1]
            batch = int(np.prod(a.data.shape[:-2], dtype=np.int64))
            counter.add(f"dot:{operand}-{precision}:{_type(out)}", batch * m * n * k)
            return out

        return method

    def memory(kind):
        def wrap(original):
            def method(self, ptrs, *args, **kwargs):
                mask = args[0] if kind == "load" else args[1]
                counter.use(ptrs, *args)
                out = original(self, ptrs, *args, **kwargs)
                if kind == "load":
                    out.model_load = counter.epoch
                element = ptrs.get_element_ty()
                itemsize = np.dtype(interpreter._get_np_dtype(element)).itemsize
                # (a mask combined with a scalar comparison may hold integers: as booleans, not
                # indices)
                active = ptrs.data[mask.data.astype(bool)] if mask is not None else ptrs.data
                counter.add(f"{kind}:{_type(element)}", active.size * itemsize)
                counter.add(f"{kind}-lanes:{_type(element)}", np.size(ptrs.data))
                counter.addresses(ptrs, mask, itemsize)
                if counter.current is not None:
                    counter.current.touch(active, itemsize)
                return out

            return method

        return wrap

    def atomic(original):
        def method(self, op, ptr, val, mask, *rest):
            counter.use(ptr, val, mask)
            out = original(self, op, ptr, val, mask, *rest)
            counter.add(f"atomic:{_type(val)}", int(np.count_nonzero(mask.data)))
            return out

        return method

    def reduce(original):
        def method(self, input):
            tensors = input if isinstance(input, tuple) else (input,)
            counter.use(*(t.handle for t in tensors))
            for t in tensors:
                counter.add(f"reduce:{_type(t.handle)}", np.size(t.handle.data))
            return original(self, input)

        return method

    def grid_dim(original):
        def method(self, nx, ny, nz):
            if counter.current is not None:
                counter.current.counts["programs"] += nx * ny * nz
            return original(self, nx, ny, nz)

        return method

    depth = [0]  # calls of `within` functions in progress

    def inside(original):
        def method(*args, **kwargs):
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        return method

    class TorchOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if depth[0] and counter.current is None and not func.is_view and name not in NO_KERNEL_OPS:
                inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                outputs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
                if name in SYNC_OPS or name in OUTPUTLESS_OPS or any(t.numel() for t in outputs):
                    counter.torch_op(name, inputs, outputs)
            return out

    def launch(original):
        def method(self, *args, **kwargs):
            counter.flush()
            counter.current = Launch(getattr(self.fn, "__name__", str(self.fn)))
            counter.current.spec = specialisation(self.fn, self.constexprs, args, kwargs)
            try:
                return original(self, *args, **kwargs)
            finally:
                counter.current.close()
                counter.launches.append(counter.current)
                counter.current = None

        return method

    # The interpreter checks 32-bit integer arithmetic for overflow (int64 copies, compares and
    # an assert per operation); compiled without debug, a GPU has none of it.
    options = interpreter.interpreter_builder.options
    try:
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)
        for op in FLOAT_OPS | INT_OPS:
            name = f"create_{op}"
            if hasattr(builder_cls, name):
                cmp = op.startswith(("fcmp", "icmp"))
                patch(builder_cls, name, compare(op) if cmp else elementwise(op, "float" if op in FLOAT_OPS else "int"))
        for op in MATH_OPS:
            if hasattr(builder_cls, f"create_{op}"):
                patch(builder_cls, f"create_{op}", elementwise(op, "math"))
        for op in CONVERT_OPS:
            if hasattr(builder_cls, f"create_{op}"):
                patch(builder_cls, f"create_{op}", convert(op))
        for op in LAYOUT_OPS:
            patch(builder_cls, f"create_{op}", layout)
        patch(builder_cls, "create_splat", splat)
        patch(builder_cls, "create_dot", dot)
        patch(builder_cls, "create_masked_load", memory("load"))
        patch(builder_cls, "create_masked_store", memory("store"))
        patch(builder_cls, "create_atomic_rmw", atomic)
        patch(builder_cls, "set_grid_dim", grid_dim)
        patch(interpreter.ReduceOps, "apply", reduce)
        patch(interpreter.ScanOps, "apply", reduce)
        patch(interpreter.GridExecutor, "__call__", launch)
        for call in within:
            module, name = call.rsplit(".", 1)
            patch(importlib.import_module(module), name, inside)
        # Values checked as on a GPU: asserted on the device, not read back (checks_on_host).
        patch(importlib.import_module("torchkit.triton._launch"), "checks_on_host", lambda _: lambda tensor: False)
        with TorchOps():
            yield counter.launches
        counter.flush()
    finally:
        interpreter.interpreter_builder.options = options
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


# --------------------------------------------------------------------------- the compiled code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, "build", "gpu-model")
# Every case's extrapolated counts as make gpu-model-table last counted them, keyed as the
# cache is (count_cases): a fresh clone recounts only the cases whose kernels changed since.
COMMITTED_COUNTS = os.path.join(ROOT, "benchmarks", "results", "model-counts.json")
COMMITTED_COMPILED = os.path.join(ROOT, "benchmarks", "results", "model-compiled.json")
MAX_REGISTERS, MAX_SHARED, MAX_WARPS, MAX_CTAS = 65536, 228 * 1024, 64, 32  # per SM, sm_90

_ALIAS = re.compile(r"^(#\w+) = #ttg\.(\w+)<\{(.*)\}>", re.M)


def _attributes(text: str) -> dict:
    """`sizePerThread = [4, 4], vec = 1, ...` as {name: int or list of int}."""
    out = {}
    for name, value in re.findall(r"(\w+) = (\[[^\]]*\]|[-\w]+)", text):
        out[name] = [int(v) for v in value.strip("[]").split(",") if v.strip()] if value.startswith("[") else value
    return out


def fma_dots(ttgir: str) -> list[dict]:
    """Each tl.dot the compiler lowered to FMAs (its result in a blocked layout, not an MMA
    one): per warp and K step, its FFMA instructions, its shared-memory loads and their
    wavefronts (bank conflicts included), from the operands' shared layouts and the dot's
    blocked layout. NVIDIA's rule for a warp's LDS: a 128-bit load is served a quarter-warp at
    a time (64-bit: a half, 32-bit: the whole warp), each costing the most distinct 32-bit
    words any one of the 32 banks holds (the same word read by several lanes is broadcast)."""
    aliases = {m.group(1): (m.group(2), _attributes(m.group(3))) for m in _ALIAS.finditer(ttgir)}
    loads = {}
    for m in re.finditer(r"(%[\w.]+) = ttg\.local_load [^:]*: !ttg\.memdesc<([\dx]+)x(\w+), (#\w+)", ttgir):
        shape = [int(v) for v in m.group(2).split("x")]
        loads[m.group(1)] = (shape, m.group(3), m.group(4))
    out = []
    for m in re.finditer(r"tt\.dot (%[\w.]+), (%[\w.]+), [^:]*: .* -> tensor<[\dx]+\w+, (#\w+)>", ttgir):
        kind, parent = aliases.get(m.group(3), ("", {}))
        if kind != "blocked":
            continue  # an MMA layout: tensor cores
        a, b = loads.get(m.group(1)), loads.get(m.group(2))
        if a is None or b is None:
            continue  # operands not loaded from shared memory here
        M, K = a[0][-2:]
        N = b[0][-1]
        spt, tpw, wpc = parent["sizePerThread"], parent["threadsPerWarp"], parent["warpsPerCTA"]
        lane_order = parent["order"]
        per_thread = [max(spt[0], M // (tpw[0] * wpc[0])), max(spt[1], N // (tpw[1] * wpc[1]))]
        ffma = per_thread[0] * per_thread[1] * K
        wavefronts = instructions = 0
        for op, (shape, dtype, shared) in enumerate((a, b)):
            layout = aliases[shared][1]
            w, n = _operand_wavefronts(op, shape[-2:], dtype, layout, spt, tpw, lane_order, per_thread[op])
            wavefronts += w
            instructions += n
        out.append({"tile": (M, N, K), "ffma": ffma, "lds": instructions, "wavefronts": wavefronts})
    return out


def _operand_wavefronts(op, shape, dtype, shared, spt, tpw, lane_order, per_thread):
    """Wavefronts and LDS instructions of warp 0 loading its elements of dot operand `op`
    (0: A, M x K; 1: B, K x N) for one K step."""
    size = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8}.get(dtype, 4)
    kdim, mdim = (1, 0) if op == 0 else (0, 1)
    fast = shared["order"][0]
    vec, per_phase, max_phase = (int(shared.get(k, 1)) for k in ("vec", "perPhase", "maxPhase"))
    run = shape[fast] if max_phase == 1 else vec  # elements contiguous in shared memory
    # A lane's vector runs along the contiguous dimension: along K, or its own rows (columns).
    v = min(16 // size, run, shape[kdim] if fast == kdim else spt[op])

    def offset(idx):
        row, col = idx[1 - fast], idx[fast]
        phase = (row // per_phase) % max_phase
        return row * shape[fast] + ((col // vec) ^ phase) * vec + col % vec

    lanes = []
    for lane in range(32):
        t = [0, 0]
        if lane_order[0] == 1:
            t[1], t[0] = lane % tpw[1], lane // tpw[1]
        else:
            t[0], t[1] = lane % tpw[0], lane // tpw[0]
        own = [
            (t[op] * spt[op] + i % spt[op] + (i // spt[op]) * spt[op] * tpw[op]) % shape[mdim]
            for i in range(per_thread)
        ]
        vectors = []
        if fast == kdim:
            for x in own:
                for k in range(0, shape[kdim], v):
                    idx = [0, 0]
                    idx[mdim], idx[kdim] = x, k
                    vectors.append(offset(idx))
        else:
            for k in range(shape[kdim]):
                for j in range(0, per_thread, v):
                    idx = [0, 0]
                    idx[mdim], idx[kdim] = own[j], k
                    vectors.append(offset(idx))
        lanes.append(vectors)
    group = {16: 8, 8: 16}.get(v * size, 32)  # lanes served together
    wavefronts = 0
    for i in range(len(lanes[0])):
        for start in range(0, 32, group):
            banks: dict[int, set] = {}
            for lane in range(start, start + group):
                first = lanes[lane][i] * size // 4
                for word in range(first, first + max(1, v * size // 4)):
                    banks.setdefault(word % 32, set()).add(word)
            wavefronts += max(len(words) for words in banks.values())
    return wavefronts, len(lanes[0])


# SASS opcodes by the resource they use (sass_mix()), as the prediction's classes name them.
SASS_CLASSES = {
    "tensor": ("HMMA", "HGMMA", "IMMA", "DMMA"),
    "fp32": ("FFMA", "FADD", "FMUL"),
    "fp64": ("DFMA", "DADD", "DMUL", "DSETP", "DMNMX"),
    "mufu": ("MUFU",),
    "shared": ("LDS", "LDSM", "STS"),
    "global": ("LDG", "STG", "ATOM", "ATOMG", "RED", "LDGSTS"),
}
_SASS_LINE = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*;")


def sass_mix(cubin: bytes) -> dict:
    """A compiled kernel's instructions by class (SASS_CLASSES; the rest as "other"), in all
    and in its loops (the instructions between a label and a later branch back to it, each
    once), from nvdisasm (shipped with Triton): what the GPU executes per iteration, beside
    what the interpreter counted."""
    import subprocess

    nvdisasm = os.path.join(os.path.dirname(sys.modules["triton"].__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
    opcodes, labels, in_loop = [], {}, set()
    for line in text.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            labels[label.group(1)] = len(opcodes)
            continue
        m = _SASS_LINE.search(line)
        if not m:
            continue
        opcodes.append(m.group(1))
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and target.group(1) in labels:  # a branch back: a loop
            in_loop.update(range(labels[target.group(1)], len(opcodes)))
    kinds = {op: kind for kind, ops in SASS_CLASSES.items() for op in ops}
    every = Counter(kinds.get(op, "other") for op in opcodes)
    loops = Counter(kinds.get(opcodes[i], "other") for i in in_loop)
    return {"all": dict(every), "loops": dict(loops)}


def compile_spec(spec: dict) -> dict:
    """A launch's kernel compiled for sm_90 as it would be on the GPU (run without
    TRITON_INTERPRET): registers, spills, shared memory, CTAs per SM, its dots' kind and the
    FMA dots' shared-memory cost (fma_dots)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from triton_check import usage_of

    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, t) in enumerate(spec["signature"].items()):
        signature[name] = t
        if t == "constexpr":
            constexprs[(i,)] = spec["constexprs"][name]
        elif name in spec["divisible"]:
            attrs[(i,)] = [["tt.divisibility", 16]]
    # (registers and spills from the log of Triton's own ptxas run, as triton_check reads them)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options=spec["options"],
        )
    ptx = compiled.asm["ptx"]
    usage = usage_of(ptx, 90, log.getvalue())
    warps = spec["options"].get("num_warps", 4)
    shared = int(compiled.metadata.shared)
    per_warp = -(-max(usage["registers"], 1) * 32 // 256) * 256  # allocated per warp in 256s
    ctas = min(MAX_CTAS, MAX_WARPS // warps, MAX_REGISTERS // (per_warp * warps), MAX_SHARED // max(shared + 1024, 1))
    return {
        **usage,
        "shared": shared,
        "warps": warps,
        "ctas_per_sm": max(1, ctas),
        "mma": "wgmma" if "wgmma.mma_async" in ptx else ("mma" if re.search(r"\bmma\.sync", ptx) else "fma"),
        "fma_dots": fma_dots(compiled.asm["ttgir"]),
        "sass": sass_mix(compiled.asm["cubin"]),
    }


def _load(path: str):
    import pickle

    with open(path, "rb") as f:
        return pickle.load(f)


def _dump(value, path: str) -> None:
    import pickle

    with open(path, "wb") as f:
        pickle.dump(value, f)


def _to_json(value):
    """A launch's spec as JSON: a Triton dtype (a constexpr's value) tagged by its name."""
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return {"tl.dtype": value.name}
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_json(v) for v in value]
    return value


def _from_json(value):
    import triton.language as tl

    if isinstance(value, dict):
        if set(value) == {"tl.dtype"}:
            return tl.dtype(value["tl.dtype"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def read_counts(path: str) -> dict[str, tuple[list[Launch], int]]:
    """The committed counts (COMMITTED_COUNTS) as count_cases caches them: by key, each case's
    launches and how many of them are the forward's."""
    import json

    if not os.path.exists(path):
        return {}
    with open(path) as f:
        cases = json.load(f)["cases"]
    return {
        entry["key"]: ([Launch(x["kernel"], Counter(x["counts"]), _from_json(x["spec"])) for x in entry["launches"]],
                       entry["forward"])
        for entry in cases.values()
    }  # fmt: skip


def write_counts(path: str, counted: dict[str, tuple[str, tuple[list[Launch], int]]]) -> None:
    """Write `counted` ({case: (key, (launches, forward))}) into the committed counts, keeping
    the entries of the other cases that still exist: one line per launch, so that a kernel's
    change shows as its own lines."""
    import json

    every = {c.counted for c in cases()}
    entries = {}
    if os.path.exists(path):
        with open(path) as f:
            entries = {k: v for k, v in json.load(f)["cases"].items() if k in every}

    def whole(v: float) -> float | int:  # (a count extrapolated exactly, less the fit's rounding)
        return round(v) if abs(v - round(v)) <= 1e-9 * max(1.0, abs(v)) else v

    for name, (key, (launches, forward)) in counted.items():
        rows = [{"kernel": x.kernel, "spec": _to_json(x.spec),
                 "counts": {k: whole(v) for k, v in sorted(x.counts.items()) if v}} for x in launches]  # fmt: skip
        entries[name] = {"key": key, "forward": forward, "launches": rows}
    lines = [
        "{",
        ' "written by": "make gpu-model-table (tools/gpu_model.py: count_cases, write_counts)",',
        ' "cases": {',
    ]
    for n, name in enumerate(sorted(entries)):
        entry = entries[name]
        lines.append(f'  {json.dumps(name)}: {{"key": {json.dumps(entry["key"])}, "forward": {entry["forward"]}, ')
        lines.append('   "launches": [')
        lines += [f"    {json.dumps(row)}{',' if j < len(entry['launches']) - 1 else ''}"
                  for j, row in enumerate(entry["launches"])]  # fmt: skip
        lines.append(f"   ]}}{',' if n < len(entries) - 1 else ''}")
    lines += [" }", "}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _module_file(name: str) -> str | None:
    """The source file of the torchkit.triton module `name`, or None where it is none."""
    path = os.path.join(ROOT, *name.split("."))
    for candidate in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _sources(modules) -> list[str]:
    """The source files of the torchkit.triton modules `modules` and of every torchkit.triton
    module they import, by name, anywhere in their code (a function's lazy import too): what
    their kernels and wrappers can execute. `from package import module` reads the module's
    file, `from package import name` the package's; a package's __init__.py is not read for
    its submodules' sake alone (Python runs it on import, but its code is not theirs)."""
    import ast

    todo = [f for f in (_module_file(m) for m in modules if m.startswith("torchkit.triton")) if f]
    seen = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" if _module_file(f"{node.module}.{a.name}") else node.module
                         for a in node.names]  # fmt: skip
            else:
                continue
            todo += [f for f in (_module_file(n) for n in names if n.startswith("torchkit.triton")) if f]
    return sorted(seen)


def _digest(modules, *parts) -> str:
    """A digest of the Triton modules `modules`' sources with what they import (_sources) and
    of `parts`' (the model's functions that draw facts from them): what a cache of those facts
    is keyed by, so that changing one op's kernels recounts that op's cases alone."""
    import hashlib
    import inspect

    digest = hashlib.sha256()
    for path in _sources(modules):
        digest.update(os.path.relpath(path, ROOT).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    for part in parts:
        digest.update(inspect.getsource(part).encode())
    return digest.hexdigest()


def compile_launches(launches: list[Launch], jobs: int, record: bool | None = None) -> None:
    """Attach each launch's compiled facts (compile_spec) as launch.compiled, compiling each
    distinct specialisation once, on `jobs` processes without the interpreter; cached in
    build/gpu-model by the kernels' sources, how the facts are drawn, and the specialisation,
    and seeded by COMMITTED_COMPILED where it was written by this Triton. record: rewrite
    COMMITTED_COMPILED with these launches' facts (True: theirs alone; False: beside those it
    holds; None: leave it)."""
    import hashlib
    import json
    import subprocess

    import triton

    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, f"compiled-{triton.__version__}.pkl")
    committed = {}
    if os.path.exists(COMMITTED_COMPILED):
        with open(COMMITTED_COMPILED) as f:
            kept = json.load(f)
        committed = kept["launches"] if kept["triton"] == triton.__version__ else {}
    cache = {**committed, **(_load(path) if os.path.exists(path) else {})}
    parts = (compile_spec, sass_mix, fma_dots, _operand_wavefronts)
    launches = [x for x in launches if "module" in (x.spec or {})]  # (not the rows of torch operations)
    source = {m: _digest([m], *parts) for m in {x.spec["module"] for x in launches}}
    keys = {id(x): hashlib.sha256((source[x.spec["module"]] + repr(x.spec)).encode()).hexdigest() for x in launches}
    todo = {keys[id(x)]: x.spec for x in launches if keys[id(x)] not in cache}
    if todo:
        with tempfile.TemporaryDirectory() as tmp:
            src, dst = os.path.join(tmp, "specs.pkl"), os.path.join(tmp, "compiled.pkl")
            _dump(todo, src)
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            env.setdefault("TRITON_CACHE_DIR", os.path.join(ROOT, "build", "triton-cache"))
            command = [sys.executable, os.path.abspath(__file__), "--compile", src, dst, "--jobs", str(max(1, jobs))]
            subprocess.run(command, env=env, check=True)
            cache.update(_load(dst))
        _dump(cache, path)
    for launch in launches:
        launch.compiled = cache[keys[id(launch)]]
    if record is not None:
        facts = {**({} if record else committed), **{keys[id(x)]: cache[keys[id(x)]] for x in launches}}
        lines = [f"  {json.dumps(key)}: {json.dumps(facts[key])}" for key in sorted(facts)]
        head = '{"written by": "make gpu-model-table (tools/gpu_model.py: compile_launches)", '
        head += f'"triton": {json.dumps(triton.__version__)}, "launches": {{'
        with open(COMMITTED_COMPILED, "w") as f:
            f.write("\n".join([head, ",\n".join(lines), "}}"]) + "\n")


# --------------------------------------------------------------------------- the GPUs

# Per-SM rates per clock (NVIDIA's CUDA C++ Programming Guide, "Arithmetic Instructions",
# compute capability 9.0) and whole-GPU peaks (the H100 SXM5 and H200 SXM datasheets, dense
# tensor-core figures). DRAM: the achievable share of the datasheet bandwidth (about 90 %);
# L2: published microbenchmarks of the H100's L2 (GPU-MODEL-STUDY.md).
PIPES = {  # lanes (one per thread) per clock per SM
    "fp32": 128,  # FADD, FMUL, FFMA
    "fp64": 64,  # DADD, DMUL, DFMA, DSETP
    "alu": 64,  # integer add and logic, compare, min/max, select (FP32 compares included)
    "convert": 16,  # conversions to and from 64-bit types, float <-> int
    "mufu": 16,  # special functions: ex2, lg2, rcp, rsq, sqrt
    "issue": 128,  # 4 schedulers x one warp instruction (32 lanes) per clock
}
GPUS = {
    "h100": {"name": "H100 SXM5", "sms": 132, "clock": 1.98e9, "dram": 3.0e12, "l2": 8.0e12,
             "tensor": {"bf16": 989e12, "fp16": 989e12, "tf32": 495e12, "fp64": 67e12}},
    "h200": {"name": "H200 SXM", "sms": 132, "clock": 1.98e9, "dram": 4.32e12, "l2": 8.0e12,
             "tensor": {"bf16": 989e12, "fp16": 989e12, "tf32": 495e12, "fp64": 67e12}},
}  # fmt: skip
LAUNCH_S = 4e-6  # a launch's fixed cost on the device (grid set-up and drain)
LATENCY = 1000  # cycles from a global load's issue to its use (DRAM or L2 and the dependent issue)


def macs_all(counts: Counter) -> float:
    return sum(v for k, v in counts.items() if k.startswith("dot:"))


# Lane-instructions per element by pipe for math that compiles to more than one instruction
# (sm_90 SASS of one-op kernels against a copy kernel, GPU-MODEL-STUDY.md): fp32 exp2, log2,
# sqrt and rsqrt are one MUFU op; fp32 tl.log is a software logf; every float64
# transcendental is software. Correctly rounded division and square roots (fp32 div_rn and
# sqrt_rn, float64's / and sqrt) are a reciprocal or reciprocal root and a few FMAs, then a
# check that branches to a called slow path only for subnormal, huge or special operands
# (FCHK, an exponent compare): what is counted is the fast path, the instructions ordinary
# operands execute (the whole static sequence, slow path included, overstated div_rn 13-fold).
# float64 exp and log likewise, and without their constants' UMOVs (the uniform datapath, one
# per warp, not per lane), counted with the ALU before: IMADs (moves of the constants' halves
# and the exponent's scaling) on the FP32/FMA pipe, integer and compare work on the ALU.
COSTS = {
    ("exp", "fp32"): {"mufu": 1, "fp32": 4},
    ("exp2", "fp32"): {"mufu": 1},
    ("log", "fp32"): {"fp32": 20, "alu": 10},
    ("log2", "fp32"): {"mufu": 1},
    ("sqrt", "fp32"): {"mufu": 1},
    ("rsqrt", "fp32"): {"mufu": 1},
    ("precise_sqrt", "fp32"): {"mufu": 1, "fp32": 4, "alu": 3},
    ("fdiv", "fp32"): {"mufu": 1, "fp32": 5, "alu": 2},
    ("precise_divf", "fp32"): {"mufu": 1, "fp32": 5, "alu": 3},
    ("exp", "fp64"): {"fp64": 18, "fp32": 5, "alu": 10},
    ("exp2", "fp64"): {"fp64": 18, "fp32": 5, "alu": 10},
    ("log", "fp64"): {"fp64": 30, "mufu": 1, "fp32": 8, "alu": 12},
    ("log2", "fp64"): {"fp64": 30, "mufu": 1, "fp32": 8, "alu": 12},
    ("sqrt", "fp64"): {"fp64": 8, "mufu": 1, "alu": 8},
    ("precise_sqrt", "fp64"): {"fp64": 8, "mufu": 1, "alu": 8},
    ("rsqrt", "fp64"): {"fp64": 22, "mufu": 2, "alu": 31},
    ("fdiv", "fp64"): {"fp64": 8, "mufu": 1, "fp32": 1, "alu": 5},
    ("precise_divf", "fp64"): {"fp64": 8, "mufu": 1, "fp32": 1, "alu": 5},
}
WIDE = {"fp64": "fp64", "i64": "alu", "ptr": "alu"}  # 64-bit integer operations issue twice


def lane_work(counts: Counter) -> tuple[Counter, dict]:
    """Lane-instructions per pipe of a launch's counts, and its tensor-core multiply-adds by
    kind (bf16, fp16, tf32, fp64)."""
    pipes: Counter = Counter()
    tensor: Counter = Counter()
    for key, n in counts.items():
        cls, _, rest = key.partition(":")
        op, _, t = rest.rpartition(":")
        if cls == "float":
            if t == "fp64":
                pipes["fp64"] += n
            elif op.startswith(("fcmp", "min", "max", "clamp")):
                pipes["alu"] += n
            else:
                pipes["fp32"] += n
        elif cls in ("int", "addr"):
            pipes["alu"] += 2 * n if t in WIDE else n
        elif cls == "math":
            for pipe, per in COSTS.get((op, t), {"fp32" if t != "fp64" else "fp64": 1}).items():
                pipes[pipe] += per * n
        elif cls == "convert":
            source, target = rest.split("-")
            narrow = {"i1", "i8", "i16", "i32", "i64"}
            pipes["alu" if source in narrow and target in narrow else "convert"] += n
        elif cls == "reduce":
            pipes["fp64" if t == "fp64" else "fp32" if t.startswith(("fp", "bf")) else "alu"] += n
        elif cls == "dot":
            operand, _, precision = op.partition("-")
            if precision == "ieee" and operand == "fp32":
                pipes["fp32"] += n  # lowered to FFMA, one per multiply-add
            elif precision in ("tf32x3", "bf16x3"):
                tensor["tf32" if precision == "tf32x3" else "bf16"] += 3 * n
            else:
                tensor[{"fp32": "tf32"}.get(operand, operand)] += n
        elif cls in ("load-lanes", "store-lanes"):
            pipes["lsu"] += n / 4  # 128-bit accesses: four 32-bit lanes per instruction lane
    pipes["issue"] = sum(v for k, v in pipes.items() if k != "issue")
    return pipes, dict(tensor)


def predict(launches: list[Launch], gpu: str, efficiency: dict | None = None) -> dict:
    """The predicted device time of a list of launches on `gpu`: per launch, the time each
    resource needs at its peak divided by the share of the peak kernels reach (`efficiency`,
    by resource; 1 where not given: EFFICIENCY is the calibrated set) and the largest of them
    (its bound); in all, their sum."""
    spec = GPUS[gpu]
    efficiency = efficiency or {}
    sms, clock = spec["sms"], spec["clock"]
    rows = []
    for launch in launches:
        c = launch.counts
        programs = max(1, c.get("programs", 1))
        pipes, tensor = lane_work(c)
        compiled = launch.compiled or {}
        # A grid of fewer programs than SMs leaves the rest idle: the work runs on `used` SMs.
        used = min(sms, programs)
        macs = sum(v for k, v in c.items() if k.startswith("dot:fp32-ieee"))
        dots = compiled.get("fma_dots") or []
        if macs and dots:
            # FMA-lowered dots read their operands from shared memory: wavefronts and LDS
            # instructions per multiply-add, averaged over the kernel's dots by tile work.
            ffma = sum(d["ffma"] for d in dots)
            pipes["smem"] = macs / 32 * sum(d["wavefronts"] for d in dots) / ffma
            pipes["issue"] += macs * sum(d["lds"] for d in dots) / ffma
        times = {}
        for pipe, rate in PIPES.items():
            if pipes.get(pipe):
                times[pipe] = pipes[pipe] / (rate * used * clock)
        if pipes.get("lsu"):
            times["lsu"] = pipes["lsu"] / (32 * used * clock)
        if pipes.get("smem"):
            times["smem"] = pipes["smem"] / (used * clock)  # one wavefront per clock per SM
        for kind, macs in tensor.items():
            times[f"tensor-{kind}"] = 2 * macs / (spec["tensor"][kind] * used / sms)
        # Round trips to memory one after another (waits): each program's waits per wave of
        # resident programs, hidden in a software-pipelined dot loop over num_stages - 1 steps.
        waves = -(-programs // (sms * compiled.get("ctas_per_sm", 1)))
        stages = (launch.spec or {}).get("options", {}).get("num_stages", 2) if macs_all(c) else 2
        times["latency"] = waves * c.get("waits", 0) / programs * LATENCY / max(1, stages - 1) / clock
        moved = sum(v for k, v in c.items() if k.startswith(("load:", "store:")))
        times["dram"] = c.get("touched", 0) / spec["dram"]
        times["l2"] = moved / spec["l2"]
        times = {k: v / efficiency.get(k, 1.0) for k, v in times.items()}
        bound = max(times, key=times.get)
        launches = c.get("launches", 1)  # (a row of torch operations: one each)
        rows.append(
            {"kernel": launch.kernel, "programs": programs, "seconds": times[bound] + LAUNCH_S * launches,
             "bound": bound, "times": times, "launches": launches}
        )  # fmt: skip
    return {"seconds": sum(r["seconds"] for r in rows), "launches": rows}


# --------------------------------------------------------------------------- calibration

# The share of each resource's peak the project's kernels reach, fitted to the recorded H200
# run (fit(); make gpu-model prints a refit): a resource is fitted only where it bounds the
# slowest launch of at least FIT_MIN_CASES measured cases, the rest stay at their peak. Shared
# memory: FMA-lowered dots do not overlap their LDS wavefronts with everything else. Latency:
# LATENCY's round trip is a floor; loads queued behind others wait longer.
EFFICIENCY = {"latency": 0.759, "smem": 0.632}
FIT_MIN_CASES = 3


def _case_seconds(times: np.ndarray, launches: float, efficiency: np.ndarray) -> float:
    """A case's seconds from its launches' raw times by resource (rows: predict()'s rows,
    columns: resources in fit()'s order), its launch count and one efficiency per resource."""
    return float((times / efficiency).max(axis=1).sum()) + LAUNCH_S * launches


def fit(samples: list[tuple[list[dict], float]], classes: list[str] | None = None) -> dict:
    """Efficiencies (share of peak, 0.05–2) by resource minimising the squared log error of
    the predicted seconds over `samples`: (predict()'s launch rows at peak, measured seconds)
    per case. The resources fitted are `classes`, or those bounding the slowest launch of at
    least FIT_MIN_CASES samples. Coordinate descent over a geometric grid: the error is not
    smooth (each launch takes a maximum), and two or three resources converge in a few sweeps."""
    resources = sorted({k for rows, _ in samples for r in rows for k in r["times"]})
    if classes is None:
        tally = Counter(max(rows, key=lambda r: r["seconds"])["bound"] for rows, _ in samples)
        classes = sorted(k for k, n in tally.items() if n >= FIT_MIN_CASES)
    classes = [k for k in classes if k in resources]  # (a resource no sample uses cannot be fitted)
    matrices = [np.array([[r["times"].get(k, 0.0) for k in resources] for r in rows]) for rows, _ in samples]
    launches = [sum(r.get("launches", 1) for r in rows) for rows, _ in samples]
    seen = np.log([m for _, m in samples])
    efficiency = np.ones(len(resources))

    def error(e):
        cases = zip(matrices, launches, seen, strict=True)
        return float(sum((np.log(_case_seconds(t, n, e)) - s) ** 2 for t, n, s in cases))

    grid = np.geomspace(0.05, 2.0, 161)
    for _ in range(4):
        for name in classes:
            i = resources.index(name)
            trials = []
            for value in grid:
                e = efficiency.copy()
                e[i] = value
                trials.append(error(e))
            efficiency[i] = grid[int(np.argmin(trials))]
    return {name: round(float(efficiency[resources.index(name)]), 3) for name in classes}


# --------------------------------------------------------------------------- extrapolation


def extrapolate(runs: list[tuple], size) -> list[Launch]:
    """Launches at `size` from the same launches counted at smaller sizes. One size variable:
    each count fitted as the polynomial of degree len(runs) - 1 through its values (exact where
    the work grows as that polynomial). Several (sizes are tuples, one value per variable):
    each count fitted as a multilinear polynomial (a sum of products of distinct variables,
    exact where the work is linear in each, as per-pair work is), through 2^variables runs.
    Evaluated at `size`; the launches must match one for one. A single run at `size` itself
    is its own counts."""
    sizes = [s for s, _ in runs]
    names = [[launch.kernel for launch in launches] for _, launches in runs]
    if any(n != names[0] for n in names):
        raise ValueError(f"the launches differ between sizes {sizes}: {names}")
    if sizes == [size]:
        return list(runs[0][1])
    if isinstance(size, tuple):
        import itertools

        powers = list(itertools.product((0, 1), repeat=len(size)))
        if len(runs) < len(powers):
            raise ValueError(f"a multilinear fit in {len(size)} variables needs {len(powers)} runs, got {len(runs)}")

        def design(points):
            return np.array([[np.prod(np.power(np.array(p, float), es)) for es in powers] for p in points])

        basis, at = design(sizes), design([size])[0]
    else:
        basis = np.vander(np.array(sizes, dtype=float), len(runs))
        at = np.vander(np.array([size], dtype=float), len(runs))[0]
    out = []
    for i, kernel in enumerate(names[0]):
        keys = set().union(*(launches[i].counts for _, launches in runs))
        counts = Counter()
        for key in keys:
            values = np.array([launches[i].counts.get(key, 0) for _, launches in runs], dtype=float)
            coefficients = np.linalg.lstsq(basis, values, rcond=None)[0]
            counts[key] = max(0.0, float(at @ coefficients))
        out.append(Launch(kernel, counts, runs[-1][1][i].spec))
    return out


# --------------------------------------------------------------------------- cases


PASSES = ("forward", "backward")  # each op's Triton functions: {op}_forward, {op}_backward


@dataclasses.dataclass(frozen=True)
class Case:
    """A benchmark case (its name in benchmarks/results/<gpu>/gpu.json: op, case, pass) whose
    Triton launches run(*size, between) executes on CPU tensors under the interpreter: the
    forward, between(), then the backward. Counted once for both passes (the forward's
    launches are the first ones) at `sizes` and extrapolated to `size` (extrapolate(); a size
    of several variables is a tuple). `pairs`: the elements of the product its hot kernels
    stream at `size` (N², N·C, P·R, N·D²), what the rule check counts float64 work per.
    `calls`: the torchkit.triton functions run calls, whose modules key its cached counts."""

    op: str
    case: str
    pass_: str
    run: Callable[..., None]
    sizes: tuple
    size: int | tuple
    pairs: int
    calls: tuple[str, ...]

    @property
    def modules(self) -> list[str]:
        """The modules that define `calls` (a package may re-export an engine's function)."""
        import importlib

        out = []
        for call in self.calls:
            module, name = call.rsplit(".", 1)
            out.append(getattr(importlib.import_module(module), name).__module__)
        return out

    @property
    def name(self) -> str:
        return f"{self.op} | {self.case} | {self.pass_}"

    @property
    def counted(self) -> str:
        """What count_case runs: both passes of the op's case."""
        return f"{self.op} | {self.case}"


def _pair_loss(loss: str, params: dict, dtype, width: int) -> Callable[..., None]:
    def run(n: int, between: Callable[[], None]) -> None:
        import torch

        from torchkit.triton import pair_losses as kernels

        g = torch.Generator().manual_seed(0)
        e = torch.randn(n, width, generator=g).to(dtype)
        labels = torch.arange(n) // 8
        name, values = loss.removesuffix("_loss"), tuple(params.values())
        value, stats = getattr(kernels, f"{name}_forward")(e, labels, None, None, *values)
        between()
        grad = torch.ones((), dtype=value.dtype)
        getattr(kernels, f"{name}_backward")(grad, e, labels, None, None, stats, *values, [True, False])

    return run


def _proxy_anchor(n: int, classes: int, between: Callable[[], None]) -> None:
    import torch

    from torchkit.triton import pair_losses as kernels

    g = torch.Generator().manual_seed(0)
    e = torch.randn(n, 512, generator=g)
    proxies = torch.randn(classes, 512, generator=g)
    labels = torch.randint(classes, (n,), generator=g)
    value, stats = kernels.proxy_anchor_forward(e, labels, proxies, 0.1, 32.0)
    between()
    kernels.proxy_anchor_backward(torch.ones((), dtype=value.dtype), e, labels, proxies, stats, 0.1, 32.0, [True, True])


def _cdist(dtype, headline: int, precision: str = "highest") -> Callable[..., None]:
    """cdist of two n x 128 sets, with the prefix and the forward's tiles the headline's n
    takes (the fused prefix for small problems: _Centring; the tiles by the grid:
    _forward_default), at the float32 matmul precision `precision`."""

    def run(n: int, between: Callable[[], None]) -> None:
        import torch

        from torchkit.ops._common import acc_dtype
        from torchkit.triton import cdist as kernels

        fused = 2 * headline * 128 <= kernels.FUSED_PREFIX_VALUES
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, 128, generator=g).to(dtype) for _ in range(2))
        tiles = kernels._forward_default(acc_dtype(a), 1, headline, headline)
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)
        try:
            d = kernels.forward(a, b, False, config=tiles, fused_prefix=fused)
            between()
            kernels.backward(torch.ones_like(d), a, b, d, False, [True, True], fused_prefix=fused)
        finally:
            torch.set_float32_matmul_precision(before)

    return run


def _bilinear_pool(dtype) -> Callable[..., None]:
    def run(n: int, between: Callable[[], None]) -> None:
        import torch

        from torchkit.triton import bilinear_pool as kernels

        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 512, 28, 28, generator=g).relu_().to(dtype)
        out, norm = kernels.forward(x, None, 1e-5, 1e-12)
        between()
        kernels.backward(torch.ones_like(out), x, None, out, norm, 1e-5, 1e-12, [True, False])

    return run


def flash_supcon(n: int = 8192, d: int = 128, block: int = 64) -> dict[str, list[Launch]]:
    """A design probe, not a kernel of the project: SupCon as a FlashAttention-style kernel,
    counted by hand from its design so that predict() can cost it beside the counted kernels.
    bf16 operands on tensor cores, fp32 element math with exp2 (the temperature folded into
    the scale), float64 only per row; `block`-row programs with the refs split in two halves
    whose log-sum-exps merge (2 N / block programs, one CTA per SM).

    Per pair, forward: the running maximum (ALU), label and self comparisons and the positive
    mask (3 ALU), the scaled shift (1 FFMA), one exp2 (MUFU), two sums (2 FADD). Backward
    (both anchors' terms in one pass, no atomics): the tile again, P and dS (1 exp2, 4 FP32,
    3 ALU), dA = dS·B and dB = dSᵀ·A: three products of the forward's one."""
    pairs, programs = n * n, 2 * n // block
    tile_bytes = (n // 2) * d * 2 * programs  # every program reads half the refs (its rows: once)

    def launch(name, macs, fp32, alu, mufu, moved):
        counts = Counter({"programs": programs, "dot:bf16-mma:fp32": macs, "float:fadd:fp32": fp32 * pairs,
                          "int:cmp:i32": alu * pairs, "math:exp2:fp32": mufu * pairs,
                          "load:bf16": moved, "touched": 2 * n * d * 2, "float:fadd:fp64": 20 * n})  # fmt: skip
        return Launch(name, counts, compiled={"ctas_per_sm": 1, "fma_dots": []})

    return {
        "forward": [launch("flash_supcon_forward", pairs * d, 3, 4, 1, tile_bytes)],
        "forward+backward": [
            launch("flash_supcon_forward", pairs * d, 3, 4, 1, tile_bytes),
            launch("flash_supcon_backward", 3 * pairs * d, 4, 3, 1, 2 * tile_bytes),
        ],
    }


def cases() -> list[Case]:
    """The GPU benchmarks' headline Triton cases: the pair losses at N = 8,192, D = 128, 8 per
    class, and in float32 at N = 1,024, D = 512 (each triplet mining; proxy-anchor at N = 1,024
    and 8,192, D = 512, 11,318 classes, and at N = 1,024 with 200), cdist at P = R = 8,192,
    M = 128 (float32 also with TF32, and a batch's 256 x 256 in float32), bilinear_pool at
    N = 32, D = 512, 28 x 28; float32 and bfloat16, forward and forward+backward."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from bench_pair_losses import VARIANTS  # the benchmark's parameters of each loss

    out = []
    for tname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for pass_ in ("forward", "forward+backward"):
            for loss, params in VARIANTS.values():
                if params.get("distance", "euclidean") != "euclidean":
                    continue  # (distance="cosine": the CPU kernel's alone)
                mining = f" {params['mining']}" if loss == "triplet_margin_loss" else ""
                calls = tuple(f"torchkit.triton.pair_losses.{loss.removesuffix('_loss')}_{p}" for p in PASSES)
                # The sliced engines' (lse.py's, ms.py's, euclid.py's, triplets.py's) at sizes whose
                # tiles split as the headline's (headline_slices).
                sliced = loss in ("supcon_loss", "ntxent_loss", "multi_similarity_loss", "contrastive_loss")
                sliced = sliced or loss == "triplet_margin_loss"
                sizes = (192, 384, 576) if sliced else (128, 256, 512)
                case = f"N=8192 D=128 8/class {tname}{mining}"
                out.append(Case(loss, case, pass_, _pair_loss(loss, params, dtype, 128), sizes, 8192, 8192**2, calls))
                if dtype == torch.float32:  # and the benchmark's batch of 1,024 of D = 512, counted as it is
                    case = f"N=1024 D=512 8/class {tname}{mining}"
                    run = _pair_loss(loss, params, dtype, 512)
                    out.append(Case(loss, case, pass_, run, (1024,), 1024, 1024**2, calls))
            if dtype == torch.float32:  # the benchmark's proxy cases: Stanford Online Products' classes
                # Its work is per (embedding, proxy) pair: counted at two sizes of each, whose
                # tiles split into the headline's slices. A batch of 1,024 (the headline's) and
                # of 8,192.
                calls = tuple(f"torchkit.triton.pair_losses.proxy_anchor_{p}" for p in PASSES)
                for n, classes in ((1024, (288, 576)), (8192, (192, 320))):
                    corners = tuple((rows, c) for rows in (128, 256) for c in classes)
                    out.append(Case("proxy_anchor_loss", f"N={n} D=512 C=11318 fp32", pass_, _proxy_anchor,
                                    corners, (n, 11318), n * 11318, calls))  # fmt: skip
                # And the benchmark's few classes (CUB-200's), counted as they are: at a batch of
                # 1,024 the slices are single tiles, which no smaller batch splits into as many.
                out.append(Case("proxy_anchor_loss", "N=1024 D=512 C=200 fp32", pass_, _proxy_anchor,
                                ((1024, 200),), (1024, 200), 1024 * 200, calls))  # fmt: skip
            calls = tuple(f"torchkit.triton.cdist.{p}" for p in PASSES)
            # Whole forward tiles (128) and grad_kernel's tiles of the other rows (32) in the
            # headline's three slices.
            sizes = (384, 768, 1152)
            out.append(
                Case("cdist", f"P=R=8192 M=128 {tname}", pass_, _cdist(dtype, 8192), sizes, 8192, 8192**2, calls)
            )  # fmt: skip
            if dtype == torch.float32:  # TF32 allowed (PyTorch's "high" float32 matmul precision)
                out.append(Case("cdist", "P=R=8192 M=128 fp32 tf32", pass_, _cdist(dtype, 8192, "high"),
                                sizes, 8192, 8192**2, calls))  # fmt: skip
            if dtype == torch.float32:  # a loss's batch, where the launches count: counted as it is
                out.append(Case("cdist", "batch P=R=256 M=128 fp32", pass_, _cdist(dtype, 256), (256,), 256, 256**2,
                                calls))  # fmt: skip
            run, calls = _bilinear_pool(dtype), tuple(f"torchkit.triton.bilinear_pool.{p}" for p in PASSES)
            # Its work is per sample (programs of the same work each): linear from two batches.
            out.append(Case("bilinear_pool", f"N=32 D=512 28x28 {tname}", pass_, run, (1, 2), 32, 32 * 512**2,
                            calls))  # fmt: skip
    return out


@contextlib.contextmanager
def headline_slices(size, headline):
    """Count the log-sum-exp engine's launches with the refs split as at the headline size.
    The engine splits the refs into as many slices as fill the GPU (lse._slices), a count that
    is not polynomial in the size: at the counted sizes every slice is one tile, and the
    extrapolated programs, partials and their merges would grow quadratically. Split into the
    headline's slice count instead, the programs and partials grow as the anchors and the work
    per slice as the pairs, which extrapolate() fits exactly. The refs' size variable is the
    one their count equals (the counted sizes keep the variables' values apart); the anchors'
    is the same one, or the other where there are two (proxy-anchor: embeddings and proxies)."""
    from torchkit.triton.pair_losses import lse

    sizes = size if isinstance(size, tuple) else (size,)
    heads = headline if isinstance(headline, tuple) else (headline,)
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"counted size {size}: its variables must differ to tell the refs from the anchors")
    original = lse._slices

    def split(programs: int, columns: int, block: int) -> tuple[int, int]:
        if columns not in sizes:
            raise ValueError(f"{columns} refs at size {size}: not one of its variables")
        refs = sizes.index(columns)
        anchors = refs if len(sizes) == 1 else 1 - refs
        wanted = original(round(programs * heads[anchors] / sizes[anchors]), heads[refs], block)[0]
        tiles = -(-columns // block)
        chunk = -(-tiles // wanted) * block
        if -(-columns // chunk) != wanted:
            raise ValueError(
                f"{columns} refs in tiles of {block} do not split into the headline's {wanted} slices: count "
                "at sizes whose tiles do"
            )
        return wanted, chunk

    lse._slices = split
    try:
        yield
    finally:
        lse._slices = original


@contextlib.contextmanager
def headline_searches(headline):
    """Count the labels' searches (lse.ids_kernel) as deep as at the headline size: a search's
    levels grow as the log of the labels, which extrapolate()'s polynomials would take for a
    line through the counted sizes' depths. Deeper than the counted labels need, the search is
    the same (its first levels' probes masked)."""
    from torchkit.triton.pair_losses import lse

    original = lse._search_levels
    levels = original(max(headline if isinstance(headline, tuple) else (headline,)))
    lse._search_levels = lambda n: levels
    try:
        yield
    finally:
        lse._search_levels = original


def count_case(index: int) -> tuple[list[Launch], int]:
    """Case `index`'s launches, both passes, at its headline size extrapolated from its small
    sizes, and how many of them are the forward's."""
    import torch

    torch.set_num_threads(1)  # one case per core
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import triton_testing

    triton_testing.quick_helper_calls()  # (the same kernels and counts, in less time)
    case = cases()[index]
    runs, forward = [], set()
    for size in case.sizes:
        with counting(case.calls) as launches, headline_slices(size, case.size), headline_searches(case.size):
            case.run(*(size if isinstance(size, tuple) else (size,)), between=lambda: forward.add(launches.flush()))
        runs.append((size, launches))
    if len(forward) != 1:
        raise ValueError(f"{case.counted}: the forward's launches differ between sizes {case.sizes}")
    return extrapolate(runs, case.size), forward.pop()


def count_keys(chosen: list[int]) -> dict[int, str]:
    """What each chosen case's counts are keyed by: the sources of the Triton modules it runs
    (Case.modules, with what they import: _sources), how they are counted, and the case's
    sizes and run. Not Triton's version: the counts are of the kernels' operations as written
    (Triton's language), not of what a compiler makes of them (compile_launches)."""
    import hashlib
    import inspect

    parts = (
        counting,
        Counter_,
        _vector_width,
        specialisation,
        Launch,
        extrapolate,
        headline_slices,
        headline_searches,
        count_case,
    )
    every = cases()
    keys = {}
    for i in chosen:
        c = every[i]
        case = f"{c.counted} {c.sizes} {c.size} {inspect.getsource(c.run)}"
        keys[i] = hashlib.sha256(f"{_digest(c.modules, *parts)} {case}".encode()).hexdigest()
    return keys


def count_cases(chosen: list[int], jobs: int) -> dict[int, tuple[list[Launch], int]]:
    """The launches of each chosen case and how many are the forward's (count_case: both
    passes counted once), on `jobs` processes, cached in build/gpu-model by count_keys: a
    rerun with nothing changed costs nothing, and a change to one op's module recounts that
    op's cases alone. The committed counts (COMMITTED_COUNTS) seed the cache, so that a fresh
    clone counts only what changed since make gpu-model-table."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from multiprocessing import get_context

    every = cases()
    first = {}  # the index count_case runs for each counted (op, case)
    for i, c in enumerate(every):
        first.setdefault(c.counted, i)
    keys = count_keys(chosen)
    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, "counts.pkl")
    cache = {**read_counts(COMMITTED_COUNTS), **(_load(path) if os.path.exists(path) else {})}
    todo = {keys[i]: first[every[i].counted] for i in chosen if keys[i] not in cache}
    if todo and jobs == 0:  # (in this process: for a profiler or a debugger)
        for key, index in todo.items():
            cache[key] = count_case(index)
            _dump(cache, path)
    elif todo:
        with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(todo))), mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(count_case, index): key for key, index in todo.items()}
            for future in as_completed(futures):
                cache[futures[future]] = future.result()
                _dump(cache, path)  # each case as it completes
    return {i: cache[keys[i]] for i in chosen}


def recorded(gpu: str) -> tuple[dict[str, float], dict[str, tuple[str, float]]]:
    """From the recorded GPU run (benchmarks/results/<gpu>/gpu.json), each case's median
    seconds through the Triton kernels, and its goal: the fastest peer's median (the project
    means to beat every one; the roofline and torchkit's other kernels are not peers)."""
    import json

    path = os.path.join(ROOT, "benchmarks", "results", gpu, "gpu.json")
    if not os.path.exists(path):
        return {}, {}
    with open(path) as f:
        runs = json.load(f)["benchmarks"]
    ours, goals = {}, {}
    for b in runs:
        impl, median = b["params"].get("impl", ""), b["stats"]["median"]
        if impl == "torchkit (triton)":
            ours[b["group"]] = median
        elif not impl.startswith(("torchkit", "roofline")) and median < goals.get(b["group"], ("", np.inf))[1]:
            goals[b["group"]] = (impl, median)
    return ours, goals


def _qualified(launch: Launch) -> str:
    """The launch's kernel with its module's name (several modules have a forward_kernel)."""
    return f"{launch.spec['module'].rsplit('.', 1)[-1]}.{launch.kernel}"


def _torch_names(kernel: str, most: int = 8) -> str:
    """A torch row's operations (its kernel: "torch a, b, b, c"), repeats counted: "a, b ×2, c"."""
    names = Counter(kernel.removeprefix("torch ").split(", "))
    shown = [f"{n} ×{k}" if k > 1 else n for n, k in list(names.items())[:most]]
    return ", ".join(shown) + (", …" if len(names) > most else "")


def cross_check(launch: Launch) -> list[str]:
    """Where a launch's counts and its compiled code disagree about what it executes: a class
    of work (tensor cores, float64, the special-function unit) making up at least 1 % of the
    counted lane-instructions with no such instruction in its SASS, or such instructions in
    its SASS loops and none counted; and a counted IEEE float32 tl.dot without FFMA in a loop."""
    sass = (launch.compiled or {}).get("sass")
    if not sass:
        return []
    pipes, tensor = lane_work(launch.counts)
    work = sum(v for k, v in pipes.items() if k not in ("issue", "lsu")) + sum(tensor.values())
    counted = {"tensor": sum(tensor.values()), "fp64": pipes.get("fp64", 0), "mufu": pipes.get("mufu", 0)}
    out = []
    for kind, n in counted.items():
        if n >= 0.01 * work and not sass["all"].get(kind):
            out.append(f"{kind}: {n / work:.0%} of the counted work, none in the SASS")
        elif not n and sass["loops"].get(kind):
            out.append(f"{kind}: {sass['loops'][kind]} instructions in the SASS loops, none counted")
    if any(k.startswith("dot:fp32-ieee") for k in launch.counts) and not sass["loops"].get("fp32"):
        out.append("IEEE float32 tl.dot counted, no FP32 instruction in the SASS loops")
    return out


# The rule check (rules()): a launch of a @hot kernel does float64 work per pair past this many
# float64 operations per element of its case's product (per-row float64 is a few per row: at
# N = 8,192 rows, 0.01 per pair); an IEEE float32 tl.dot at all.
FP64_PER_PAIR = 0.25


def rules(case: Case, launches: list[Launch]) -> list[dict]:
    """Each launch of a hot kernel (torchkit.triton._launch.hot) against the rules: no float64
    work per pair and no IEEE float32 tl.dot unless the kernel's mark gives the reason; and a
    kernel whose products are per pair (multiply-adds at least the case's pairs) must be
    marked. One row per kernel and rule broken: its reason, or None (a failure)."""
    import importlib

    out = []
    for launch in launches:
        if "module" not in (launch.spec or {}):
            continue  # a row of torch operations
        kernel = getattr(importlib.import_module(launch.spec["module"]), launch.kernel)
        marks = getattr(kernel, "hot", None)
        c = launch.counts
        if marks is None:
            if macs_all(c) >= case.pairs:
                out.append({"kernel": _qualified(launch), "rule": "per-pair products, not marked @hot", "why": None})
            continue
        fp64 = sum(v for k, v in c.items() if k.endswith(":fp64") and k.startswith(("float:", "math:", "reduce:")))
        broken = {
            "float64 per pair": fp64 / case.pairs if fp64 > FP64_PER_PAIR * case.pairs else 0,
            "IEEE float32 tl.dot": sum(v for k, v in c.items() if k.startswith("dot:fp32-ieee")) / case.pairs,
        }
        for rule, amount in broken.items():
            if amount:
                out.append({"kernel": _qualified(launch), "rule": rule, "per_pair": amount, "why": marks[rule]})
    return out


# `make gpu-model` in CI fails where a case's prediction exceeds the committed one
# (benchmarks/results/model.json) by more than this factor: the counts and compiled code are
# deterministic, so only a change of kernel (or of Triton) moves them.
REGRESSION = 1.2


def regressions(predicted: dict[str, float], path: str) -> tuple[list[str], bool]:
    """The predictions (seconds by case name) against those committed in `path` (written by
    --output): lines to print, and whether any exceeds its committed one past REGRESSION.
    Compared only under the Triton that wrote them: another compiles the kernels otherwise."""
    import json

    import triton

    with open(path) as f:
        committed = json.load(f)
    where = os.path.relpath(path, ROOT)
    if committed["triton"] != triton.__version__:
        return [
            "",
            f"Not compared with {where}: written with Triton {committed['triton']}, this is {triton.__version__}",
        ], False
    slower = {k: v / committed["cases"][k] for k, v in predicted.items() if k in committed["cases"]}
    worse = {k: r for k, r in slower.items() if r > REGRESSION}
    low, high = min(slower.values(), default=1), max(slower.values(), default=1)
    lines = ["", f"Against {where}: {len(slower)} cases, predicted / committed {low:.2f}–{high:.2f}"]
    lines += [f"- **{k}: {r:.2f}× the committed prediction, past {REGRESSION}×**" for k, r in worse.items()]
    return lines, bool(worse)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help="substrings of case names (default: all)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    parser.add_argument("--launches", action="store_true", help="a line per launch: its time by resource")
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="processes counting cases and compiling launches (0: count in this process)",
    )
    parser.add_argument("--output", help="also write the table, with its summary, to this markdown file, and "
                        "the predictions to the .json beside it")  # fmt: skip
    parser.add_argument("--check", metavar="JSON", help=f"fail where a prediction exceeds this file's by {REGRESSION}x")
    parser.add_argument("--flash", action="store_true", help="cost the flash-style SupCon probe (flash_supcon)")
    parser.add_argument("--compile", nargs=2, metavar=("SPECS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile:  # compile_launches' worker, without the interpreter
        from concurrent.futures import ProcessPoolExecutor

        specs = _load(args.compile[0])
        with ProcessPoolExecutor(max_workers=max(1, min(args.jobs, len(specs)))) as pool:
            _dump(dict(zip(specs, pool.map(compile_spec, specs.values()), strict=True)), args.compile[1])
        return 0
    if args.flash:
        for pass_, launches in flash_supcon().items():
            result = predict(launches, args.gpu, EFFICIENCY)
            bounds = ", ".join(f"{r['kernel']}: {r['seconds'] * 1e3:.3g} ms ({r['bound']})" for r in result["launches"])
            print(f"flash-style supcon_loss N=8192 D=128 bf16 {pass_}: {result['seconds'] * 1e3:.3g} ms; {bounds}")
        return 0
    if os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("run with TRITON_INTERPRET=1: the counts come from Triton's interpreter")
    every = cases()
    chosen = [i for i, c in enumerate(every) if not args.cases or any(s in c.name for s in args.cases)]
    both = count_cases(chosen, args.jobs)
    counted = {
        i: launches[:forward] if every[i].pass_ == "forward" else launches for i, (launches, forward) in both.items()
    }
    ours, goals = recorded(args.gpu)
    # (--output: the record rewritten, with every case's launches or beside the others')
    record = (not args.cases) if args.output else None
    compile_launches([launch for i in chosen for launch in counted[i]], args.jobs, record)
    peak = {i: predict(counted[i], args.gpu) for i in chosen}
    seen = {i: ours[every[i].name] for i in chosen if every[i].name in ours}
    samples = {i: (peak[i]["launches"], seen[i]) for i in seen}
    # Each measured case predicted by the efficiencies fitted to the others: how well the
    # calibration carries to a case it has not seen.
    left_out = {}
    if len(samples) > 2:
        for i in samples:
            others = [v for j, v in samples.items() if j != i]
            left_out[i] = predict(counted[i], args.gpu, fit(others, sorted(EFFICIENCY)))["seconds"] / seen[i]
    lines = [
        f"| op | case | pass | predicted ms ({GPUS[args.gpu]['name']}) | at peak | measured ms "
        "| predicted / measured | left out | goal ms (fastest peer) | bound: launch (resource) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = {"at peak": [], "calibrated": [], "left out": list(left_out.values())}
    predicted, broken, disagreements, syncs = {}, [], set(), {}
    for i in chosen:
        case = every[i]
        result = predict(counted[i], args.gpu, EFFICIENCY)
        predicted[case.name] = result["seconds"]
        reads = sum(round(x.counts.get("syncs", 0)) for x in counted[i])
        if reads:
            syncs[case.name] = reads
        broken += [{"case": case.name, **r} for r in rules(case, counted[i])]
        for launch, r in zip(counted[i], result["launches"], strict=True):
            r["sass_loops"] = (launch.compiled or {}).get("sass", {}).get("loops")
            disagreements.update(f"{_qualified(launch)}: {d}" for d in cross_check(launch))
        top = max(result["launches"], key=lambda r: r["seconds"])
        if top["kernel"].startswith("torch "):
            top = {**top, "kernel": f"torch operations ×{top['launches']:.0f}"}
        m = seen.get(i)
        row = [case.op, case.case, case.pass_, f"{result['seconds'] * 1e3:.3g}", f"{peak[i]['seconds'] * 1e3:.3g}"]
        if m:
            ratios["at peak"].append(peak[i]["seconds"] / m)
            ratios["calibrated"].append(result["seconds"] / m)
            row += [f"{m * 1e3:.3g}", f"{result['seconds'] / m:.2f}", f"{left_out[i]:.2f}" if i in left_out else "–"]
        else:
            row += ["–", "–", "–"]
        peer = goals.get(case.name)
        row.append(f"{peer[1] * 1e3:.3g} ({peer[0]})" if peer else "–")
        new = [f"| {' | '.join(row)} | {top['kernel']} ({top['bound']}) |"]
        if args.launches:
            for r in result["launches"]:
                ranked = sorted(((k, v) for k, v in r["times"].items() if v), key=lambda kv: -kv[1])[:4]
                shares = ", ".join(f"{k} {v * 1e3:.3g}" for k, v in ranked)
                launch = f"{r['kernel']}, {r['programs']:.0f} programs"
                if r["kernel"].startswith("torch "):
                    launch = f"torch operations ×{r['launches']:.0f}: {_torch_names(r['kernel'])}"
                new.append(f"| | &nbsp; {launch} | | {r['seconds'] * 1e3:.3g} | | | | | | {shares} |")
                loops = r.get("sass_loops")
                if loops:
                    mix = ", ".join(f"{k} {v}" for k, v in sorted(loops.items(), key=lambda kv: -kv[1]))
                    new[-1] = new[-1][:-2] + f"; SASS loops: {mix} |"
        lines += new
    print("\n".join(lines), flush=True)
    summary = [""]
    if samples:
        for name, values in ratios.items():
            if values:
                r = np.array(values)
                within = np.maximum(r, 1 / r)
                summary.append(
                    f"- {name}: {len(r)} measured cases, predicted / measured {r.min():.2f}–{r.max():.2f} "
                    f"(median {np.median(r):.2f}); within 2×: {(within <= 2).sum()}, "
                    f"within 1.5×: {(within <= 1.5).sum()}"
                )
        refit = fit(list(samples.values()))
        summary.append(f"- efficiencies used: {EFFICIENCY}; fitted to these cases now: {refit}")
    # The rule check: each hot kernel's float64 per pair and IEEE products, with the reason its mark gives.
    failures = [b for b in broken if not b["why"]]
    reasons = {}
    for b in broken:
        reasons.setdefault((b["kernel"], b["rule"], b["why"]), []).append(b.get("per_pair", 0))
    summary += ["", "Hot kernels that break a rule (rules()), per element of the case's product:", ""]
    for (kernel, rule, why), amounts in sorted(reasons.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        said = f"why: {why}" if why else "**no reason given: fails**"
        summary.append(f"- {kernel}: {rule}, up to {max(amounts):.3g} per pair; {said}")
    summary += ["", f"Values read back to the host (torch operations; a synchronisation on a GPU): {len(syncs)} cases"]
    summary += [f"- {name}: {n}" for name, n in syncs.items()]
    summary += ["", f"Counts against the compiled code (cross_check()): {len(disagreements)} disagreements"]
    summary += [f"- {d}" for d in sorted(disagreements)]
    failed = bool(failures)
    if args.check:
        said, worse = regressions(predicted, args.check)
        summary += said
        failed |= worse
    print("\n".join(summary))
    lines += summary
    if args.output:
        import json

        import triton

        header = [
            f"# The offline performance model against the recorded {GPUS[args.gpu]['name']} run",
            "",
            "Written by `make gpu-model-table` (tools/gpu_model.py; CONTRIBUTING.md says how it works): each",
            "headline Triton case's predicted time from its operation counts under Triton's interpreter",
            "and its launches' sm_90 compiled code, with the calibrated efficiencies (at peak: without),",
            f"beside the median of the recorded GPU run (benchmarks/results/{args.gpu}/gpu.json, whose kernels",
            "may be older than the counted ones), the prediction with the case left out of the fit, and the",
            "fastest peer there, the goal. Each case's indented rows are its launches, with their four",
            "largest terms in ms.",
            *([f"Cases whose names contain: {', '.join(args.cases)}."] if args.cases else []),
            "",
        ]
        with open(args.output, "w") as f:
            f.write("\n".join(header + lines) + "\n")
        with open(os.path.splitext(args.output)[0] + ".json", "w") as f:
            json.dump({"gpu": args.gpu, "triton": triton.__version__, "cases": predicted}, f, indent=1)
            f.write("\n")
        keys = count_keys(chosen)
        write_counts(COMMITTED_COUNTS, {every[i].counted: (keys[i], both[i]) for i in chosen})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
