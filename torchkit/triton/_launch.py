"""What every Triton kernel module shares: launch configurations and whether the kernels run
under Triton's interpreter."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch


class Config:
    """One launch configuration: the kernel's block sizes (constexpr arguments) and the
    compiler's num_warps, num_stages and whether it may fuse a product and a sum into an FMA
    (fp_fusion: the compiler's default, which the interpreter and the CPU kernels never do).
    Tests run every configuration under the interpreter; tools/triton_check.py compiles every
    one for sm_80 and sm_90."""

    def __init__(self, num_warps: int = 4, num_stages: int = 2, fp_fusion: bool = True, **kwargs: int):
        self.kwargs = dict(kwargs)
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.fp_fusion = fp_fusion

    @property
    def options(self) -> dict:
        """The compiler's options: num_warps, num_stages and enable_fp_fusion."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, "enable_fp_fusion": self.fp_fusion}

    @property
    def launch(self) -> dict:
        """Keyword arguments of a launch: the block sizes and the compiler's options."""
        return {**self.kwargs, **self.options}

    def __repr__(self) -> str:
        blocks = ", ".join(f"{k}={v}" for k, v in self.kwargs.items())
        fusion = "" if self.fp_fusion else ", fp_fusion=False"
        return f"Config({blocks}, num_warps={self.num_warps}, num_stages={self.num_stages}{fusion})"


def hot(float64_per_pair: str | None = None, ieee_dot: str | None = None):
    """Marks a @triton.jit kernel whose work is per pair: per element of the N×N, N×C, P×R or
    D×D product it streams, where a GPU spends its time. `make gpu-model`'s rule check
    (tools/gpu_model.py) fails a hot kernel that does float64 work per pair or multiplies
    float32 with an IEEE tl.dot (FMAs reading shared memory, not tensor cores: GPU-PERF.md)
    unless its mark says why."""

    def mark(kernel):
        kernel.hot = {"float64 per pair": float64_per_pair, "IEEE float32 tl.dot": ieee_dot}
        return kernel

    return mark


def checks_on_host(tensor: torch.Tensor) -> bool:
    """Whether the wrappers check `tensor`'s values on the host: a CPU tensor's (the
    interpreter's) by reading them back, to raise an exception naming the first bad one; a CUDA
    tensor's by a device-side assertion (torch._assert_async), with no synchronisation.
    tools/gpu_model.py counts the CUDA branch, as a GPU runs it."""
    return tensor.device.type == "cpu"


def interpreting() -> bool:
    """Whether @triton.jit kernels run under Triton's interpreter (TRITON_INTERPRET=1 when the
    kernel modules were imported): the kernels then take the interpreter's branches, such as
    upcasting bfloat16 operands before tl.dot."""
    import triton

    return bool(triton.knobs.runtime.interpret)


@dataclass(frozen=True)
class CompileCase:
    """One kernel as tools/triton_check.py compiles it: its argument types as a launch would
    give them (pointers "*fp32", ints "i32"), its constexpr values, the configurations to
    compile, whether its products are meant for tensor cores (then the PTX must hold mma or
    wgmma), the int arguments its headline launch passes divisible by 16 (Triton's JIT
    specialises them so, and the loads they index are then vectorised), and the compute
    capabilities that launch it so (a kernel may hold more on sm_90 than on sm_80)."""

    name: str
    kernel: object
    types: dict
    constexprs: dict
    configs: tuple
    tensor_cores: bool = False
    divisible: tuple = ()
    archs: tuple = (80, 90)


def float_bits(value: float) -> int:
    """A float64's bits as an int64, for a kernel argument that _math.f64 turns back into the
    float64 (Triton types a Python float argument as float32)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def acc_tl(dtype: torch.dtype):
    """The Triton type of the accumulation type of `dtype` (ops._common.acc_dtype's result):
    float64 for float64, float32 otherwise."""
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def blocks(n: int, block: int) -> int:
    """Programs of `block` covering n (at least one: a launch over an empty grid is refused)."""
    return max(1, -(-n // block))
