"""bilinear_pool vs the cookbook composition (torchkit.reference), eager and under
torch.compile; forward and forward+backward, with the bytes each keeps for backward, against
the GEMM roofline: the batched X·Yᵀ of the same shape (forward), plus the backward's products
(one, (G + Gᵀ)·X, for self-pooling; G·Y and Gᵀ·X for two streams)."""

import functools

import pytest
import torch
from common import ROOFLINE, run  # benchmarks/ is on sys.path (rootdir-less test folder)

from torchkit import ops, reference

TRITON = "torchkit (triton)"  # GPU cases only: its kernels are staged until a GPU run measures them


@functools.cache
def compiled_reference():
    return torch.compile(reference.bilinear_pool)


@torch.no_grad()
def gemm_roofline(x, y=None, backward=False):
    a = x.flatten(2)
    b = a if y is None else y.flatten(2)
    z = torch.bmm(a, b.mT)
    if backward:
        torch.bmm(z, b)
        if y is not None:
            torch.bmm(z.mT, a)
    return z


class TritonBilinearPool(torch.autograd.Function):
    """bilinear_pool through its Triton kernels (torchkit/triton/bilinear_pool.py) in a process
    whose CUDA slot holds the C++ kernels: the two side by side in one run."""

    @staticmethod
    def forward(ctx, x, y):
        from torchkit.triton import bilinear_pool as kernels

        out, norm = kernels.forward(x, y, 1e-5, 1e-12)
        ctx.save_for_backward(x, y, out, norm)
        return out

    @staticmethod
    def backward(ctx, grad):
        from torchkit.triton import bilinear_pool as kernels

        x, y, out, norm = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], y is not None and ctx.needs_input_grad[1]]
        gx, gy = kernels.backward(grad, x, y, out, norm, 1e-5, 1e-12, mask)
        return (gx if mask[0] else None), (gy if mask[1] else None)


IMPLS = {
    "torchkit": ops.bilinear_pool,
    TRITON: lambda x, y=None: TritonBilinearPool.apply(x, y),
    "reference": reference.bilinear_pool,
    "torch.compile(reference)": lambda x, y=None: compiled_reference()(x, y),
    ROOFLINE: gemm_roofline,
}

# (case, N, D, E or None, H·W side, dtype, device)
CPU_CASES = [
    pytest.param("N=8 D=512 28x28 fp32", 8, 512, None, 28, torch.float32, "cpu", marks=pytest.mark.headline),
    pytest.param("N=32 D=512 28x28 fp32", 32, 512, None, 28, torch.float32, "cpu"),
    pytest.param("N=16 D=2048 7x7 fp32", 16, 2048, None, 7, torch.float32, "cpu"),
    pytest.param("two-stream N=8 D=E=256 28x28", 8, 256, 256, 28, torch.float32, "cpu"),
    pytest.param("N=8 D=512 28x28 bf16", 8, 512, None, 28, torch.bfloat16, "cpu"),
]
GPU_CASES = [
    pytest.param(f"N=32 D=512 28x28 {name}", 32, 512, None, 28, dtype, "cuda", marks=pytest.mark.cuda)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
]


def saved_bytes(fn, *args) -> int:
    """Bytes of the distinct storages autograd keeps for backward."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(storages.values())


@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case,N,D,E,side,dtype,device", CPU_CASES + GPU_CASES)
def test_bilinear_pool(benchmark, case, N, D, E, side, dtype, device, impl, pass_):
    if impl == TRITON and device != "cuda":
        pytest.skip("the Triton kernels run on CUDA tensors (the tests run them under the interpreter)")
    g = torch.Generator(device).manual_seed(0)  # drawn where they live: GB-sized inputs in ms on a GPU
    x = torch.randn(N, D, side, side, generator=g, device=device).relu_().to(dtype)  # post-ReLU features
    y = None if E is None else torch.randn(N, E, side, side, generator=g, device=device).relu_().to(dtype)
    fn = IMPLS[impl]
    gemms = 1 if pass_ == "forward" else (2 if y is None else 3)
    extra = {"flops": 2 * N * D * (E or D) * side * side * gemms}
    if impl == ROOFLINE:

        def step():
            fn(x, y, backward=pass_ != "forward")
    elif pass_ == "forward":

        def step():
            with torch.no_grad():
                fn(x, y)
    else:
        x.requires_grad_()
        if y is not None:
            y.requires_grad_()
        extra["saved_bytes"] = saved_bytes(fn, x, y)

        def step():
            fn(x, y).sum().backward()
            x.grad = None
            if y is not None:
                y.grad = None

    run(benchmark, step, op="bilinear_pool", case=case, pass_=pass_, impl=impl, device=device, **extra)
