"""covariance_pool (iSQRT-COV, 5 iterations) vs a layer with fast-MPN-COV's structure
(tests/mpncov_peer.py: its M×M centring matrix, its kept iterates, its analytic backward),
the plain composition (torchkit.reference) and its torch.compile; forward and
forward+backward, with the bytes each keeps for backward. Roofline: the GEMMs of the same
shapes, the covariance X·Xᵀ and the iteration's 3n - 3 batched D×D products (forward), plus
the input gradient's GEMM (forward+backward; the backward's own products are what each
implementation chooses, so they are not counted as unavoidable)."""

import functools
import sys
from pathlib import Path

import pytest
import torch
from bench_bilinear_pool import saved_bytes
from common import ROOFLINE, run  # benchmarks/ is on sys.path (rootdir-less test folder)

from torchkit import ops, reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from mpncov_peer import mpncov

ITERATIONS = 5


@functools.cache
def compiled_reference():
    return torch.compile(reference.covariance_pool)


@torch.no_grad()
def gemm_roofline(x, backward=False):
    a = x.flatten(2)
    sigma = torch.bmm(a, a.mT)
    for _ in range(3 * ITERATIONS - 3):
        torch.bmm(sigma, sigma)
    if backward:
        torch.bmm(sigma, a)
    return sigma


IMPLS = {
    "torchkit": ops.covariance_pool,
    "fast-MPN-COV structure": mpncov,
    "reference": reference.covariance_pool,
    "torch.compile(reference)": lambda x: compiled_reference()(x),
    ROOFLINE: gemm_roofline,
}

# (case, N, D, H·W side, device)
CASES = [
    pytest.param("N=32 D=256 28x28 fp32", 32, 256, 28, "cpu", marks=pytest.mark.headline),
    pytest.param("N=8 D=512 14x14 fp32", 8, 512, 14, "cpu"),
    pytest.param("N=32 D=256 28x28 fp32", 32, 256, 28, "cuda", marks=pytest.mark.cuda),
    pytest.param("N=8 D=512 14x14 fp32", 8, 512, 14, "cuda", marks=pytest.mark.cuda),
]


@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case,N,D,side,device", CASES)
def test_covariance_pool(benchmark, case, N, D, side, device, impl, pass_):
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(N, D, side, side, generator=g, device=device).relu_()  # post-ReLU features
    fn = IMPLS[impl]
    M = side * side
    gemm_flops = 2 * N * D * D * M + (3 * ITERATIONS - 3) * 2 * N * D**3
    extra = {"flops": gemm_flops + (2 * N * D * D * M if pass_ != "forward" else 0)}
    if impl == ROOFLINE:

        def step():
            fn(x, backward=pass_ != "forward")
    elif pass_ == "forward":

        def step():
            with torch.no_grad():
                fn(x)
    else:
        x.requires_grad_()
        extra["saved_bytes"] = saved_bytes(fn, x)

        def step():
            fn(x).sum().backward()
            x.grad = None

    run(benchmark, step, op="covariance_pool", case=case, pass_=pass_, impl=impl, device=device, **extra)
