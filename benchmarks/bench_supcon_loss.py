"""supcon_loss vs pytorch-metric-learning's SupConLoss (the library our users run), the
full-matrix reference and its torch.compile; forward and forward+backward, with each one's
peak extra memory, against the GEMM roofline: the N×N similarity product (forward), plus the
backward's product of the same shape."""

import functools

import pytest
import torch
from common import ROOFLINE, run  # benchmarks/ is on sys.path (rootdir-less test folder)
from pytorch_metric_learning import losses

from torchkit import ops, reference


@functools.cache
def compiled_reference():
    return torch.compile(reference.supcon_loss)


@torch.no_grad()
def gemm_roofline(e, backward=False):
    s = e @ e.T
    if backward:
        s @ e
    return s


IMPLS = {
    "torchkit": lambda e, labels: ops.supcon_loss(e, labels, 0.1),
    "pytorch-metric-learning": lambda e, labels: losses.SupConLoss(temperature=0.1)(e, labels),
    "reference": lambda e, labels: reference.supcon_loss(e, labels, 0.1),
    "torch.compile(reference)": lambda e, labels: compiled_reference()(e, labels, 0.1),
    ROOFLINE: gemm_roofline,
}

# (case, N, D, samples per class, dtype, device)
CASES = [
    pytest.param("N=1024 D=512 8/class fp32", 1024, 512, 8, torch.float32, "cpu", marks=pytest.mark.headline),
    pytest.param("N=8192 D=128 8/class fp32", 8192, 128, 8, torch.float32, "cpu"),
]


@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case,N,D,per_class,dtype,device", CASES)
def test_supcon_loss(benchmark, case, N, D, per_class, dtype, device, impl, pass_):
    g = torch.Generator(device).manual_seed(0)
    e = torch.randn(N, D, generator=g, device=device).to(dtype)
    labels = torch.arange(N, device=device) // per_class
    fn = IMPLS[impl]
    extra = {"flops": 2 * N * N * D * (1 if pass_ == "forward" else 2)}
    if impl == ROOFLINE:

        def step():
            fn(e, backward=pass_ != "forward")
    elif pass_ == "forward":

        def step():
            with torch.no_grad():
                fn(e, labels)
    else:
        e.requires_grad_()

        def step():
            fn(e, labels).backward()
            e.grad = None

    run(benchmark, step, op="supcon_loss", case=case, pass_=pass_, impl=impl, device=device, **extra)
