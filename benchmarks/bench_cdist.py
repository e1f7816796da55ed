"""cdist vs torch.cdist (default = matmul mode, exact mode, torch.compile), the cookbook
reference and faiss's pairwise L2; forward and forward+backward, with each implementation's
accuracy against float64 on the far-from-origin case, against the GEMM roofline: the
x1·x2ᵀ product of the same shape (forward), plus the two products of the backward."""

import functools

import pytest
import torch
from common import ROOFLINE, run  # benchmarks/ is on sys.path (rootdir-less test folder)

from torchkit import ops, reference

EXACT = "donot_use_mm_for_euclid_dist"
TRITON = "torchkit (triton)"  # GPU cases only: its kernels are staged until a GPU run measures them
REFERENCE_MAX_ELEMENTS = 2**28  # the reference's (B, P, R, M) temporary: 1 GiB of float32


@functools.cache
def compiled_cdist():
    return torch.compile(torch.cdist, dynamic=False)


def faiss_l2(x1, x2):
    import faiss  # benchmark-only dependency

    return torch.from_numpy(faiss.pairwise_distances(x1.numpy(), x2.numpy())).sqrt_()


@torch.no_grad()
def gemm_roofline(a, b, backward=False):
    """The BLAS work no implementation by the GEMM identity avoids: x1·x2ᵀ (P×M by M×R); with
    backward, also G·x2 and Gᵀ·x1, G of the output's shape."""
    d = torch.matmul(a, b.mT)
    if backward:
        torch.matmul(d, b)
        torch.matmul(d.mT, a)
    return d


class TritonCdist(torch.autograd.Function):
    """cdist through its Triton kernels (torchkit/triton/cdist.py) in a process whose CUDA
    slot holds the C++ kernels: the two side by side in one run."""

    @staticmethod
    def forward(ctx, a, b):
        from torchkit.triton import cdist as kernels

        d = kernels.forward(a, b, False)
        ctx.save_for_backward(a, b, d)
        return d

    @staticmethod
    def backward(ctx, grad):
        from torchkit.triton import cdist as kernels

        a, b, d = ctx.saved_tensors
        return kernels.backward(grad, a, b, d, False, [True, True])


IMPLS = {
    "torchkit": lambda a, b: ops.cdist(a, b),
    TRITON: lambda a, b: TritonCdist.apply(a, b),
    "torch.cdist": lambda a, b: torch.cdist(a, b),
    "torch.cdist exact": lambda a, b: torch.cdist(a, b, compute_mode=EXACT),
    "torch.compile(torch.cdist)": lambda a, b: compiled_cdist()(a, b),
    "reference": lambda a, b: reference.cdist(a, b),
    "faiss": faiss_l2,  # forward only, 2-D float32 on the CPU; squared distances (+ sqrt here)
    ROOFLINE: gemm_roofline,
}

# (case, x1 shape, x2 shape or None for self-distances, offset, dtype, device, float32 matmul
# precision: "highest", PyTorch's default, or "high", TF32 allowed, for every implementation)
CPU_CASES = [
    pytest.param(
        "P=R=4096 M=128", (4096, 128), (4096, 128), 0.0, torch.float32, "cpu", "highest", marks=pytest.mark.headline
    ),
    pytest.param("P=R=1024 M=512", (1024, 512), (1024, 512), 0.0, torch.float32, "cpu", "highest"),
    pytest.param("B=16 P=R=512 M=64", (16, 512, 64), (16, 512, 64), 0.0, torch.float32, "cpu", "highest"),
    pytest.param("self P=4096 M=128", (4096, 128), None, 0.0, torch.float32, "cpu", "highest"),
    # A metric-learning loss's call: one batch's embeddings, where per-call overhead counts.
    pytest.param("batch P=R=256 M=128", (256, 128), (256, 128), 0.0, torch.float32, "cpu", "highest"),
    pytest.param("far from origin P=R=2048 M=128", (2048, 128), (2048, 128), 1000.0, torch.float32, "cpu", "highest"),
]
GPU_CASES = [
    pytest.param(f"P=R=8192 M=128 {name}", (8192, 128), (8192, 128), 0.0, dtype, "cuda", precision,
                 marks=pytest.mark.cuda)
    for name, dtype, precision in (("fp32", torch.float32, "highest"), ("fp32 tf32", torch.float32, "high"),
                                   ("bf16", torch.bfloat16, "highest"))
] + [
    # A metric-learning loss's call on the GPU, where the launches of the prefix count.
    pytest.param(
        "batch P=R=256 M=128 fp32", (256, 128), (256, 128), 0.0, torch.float32, "cuda", "highest",
        marks=pytest.mark.cuda
    ),
]  # fmt: skip


def max_rel_error(d, a, b):
    truth = torch.cdist(a.double(), (a if b is None else b).double(), compute_mode=EXACT)
    keep = truth > 1e-3 * truth.max()
    return (((d.double() - truth).abs() / truth)[keep]).max().item()


@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case,shape1,shape2,offset,dtype,device,precision", CPU_CASES + GPU_CASES)
def test_cdist(benchmark, case, shape1, shape2, offset, dtype, device, precision, impl, pass_):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        _test_cdist(benchmark, case, shape1, shape2, offset, dtype, device, impl, pass_)
    finally:
        torch.set_float32_matmul_precision(before)


def _test_cdist(benchmark, case, shape1, shape2, offset, dtype, device, impl, pass_):
    batch = shape1[0] if len(shape1) == 3 else 1
    R = (shape2 or shape1)[-2]
    if impl == TRITON and device != "cuda":
        pytest.skip("the Triton kernels run on CUDA tensors (the tests run them under the interpreter)")
    if impl == "faiss" and (pass_ != "forward" or device != "cpu" or len(shape1) != 2 or shape2 is None):
        pytest.skip("faiss: forward only, two 2-D float32 sets on the CPU")
    if impl == "reference" and batch * shape1[-2] * R * shape1[-1] > REFERENCE_MAX_ELEMENTS:
        pytest.skip("the reference's O(P·R·M) temporary exceeds the benchmark's memory budget")
    if impl == "torch.cdist exact" and device == "cuda" and dtype not in (torch.float32, torch.float64):
        pytest.skip("torch.cdist's exact mode has no CUDA kernel for float16 or bfloat16")
    g = torch.Generator(device).manual_seed(0)  # drawn where they live: GB-sized inputs in ms on a GPU
    a = (offset + torch.randn(shape1, generator=g, device=device)).to(dtype)
    b = None if shape2 is None else (offset + torch.randn(shape2, generator=g, device=device)).to(dtype)
    fn = IMPLS[impl]
    if impl in ("torchkit", TRITON):
        call = functools.partial(fn, a, b)
    elif impl == ROOFLINE:
        call = functools.partial(fn, a, a if b is None else b)
    elif b is None:  # the peers have no self-distance form: pass the set twice
        call = functools.partial(fn, a, a)
    else:
        call = functools.partial(fn, a, b)
    M = shape1[-1]
    extra = {"flops": 2 * batch * shape1[-2] * R * M * (1 if pass_ == "forward" else 3)}
    # The accuracy column: far from the origin, and where the products are rounded (16-bit
    # inputs, TF32), each implementation's error against float64 on the same inputs.
    rounded = dtype != torch.float32 or torch.get_float32_matmul_precision() != "highest"
    if (offset or (device == "cuda" and rounded)) and impl != ROOFLINE:
        with torch.no_grad():
            extra["max_rel_error"] = max_rel_error(call(), a, b)
    if impl == ROOFLINE:

        def step():
            call(backward=pass_ != "forward")
    elif pass_ == "forward":

        def step():
            with torch.no_grad():
                call()
    else:
        a.requires_grad_()
        if b is not None:
            b.requires_grad_()

        def step():
            call().sum().backward()
            a.grad = None
            if b is not None:
                b.grad = None

    run(benchmark, step, op="cdist", case=case, pass_=pass_, impl=impl, device=device, **extra)
