"""The pair losses (supcon_loss, ntxent_loss) vs pytorch-metric-learning (the library our users
run), the full-matrix references and their torch.compile; forward and forward+backward, with
each one's peak extra memory, against the GEMM roofline: the N×N similarity product (forward),
plus the backward's product of the same shape. PML cases it cannot run in this machine's
memory are skipped with the size it asks for."""

import functools

import pytest
import torch
from common import ROOFLINE, run  # benchmarks/ is on sys.path (rootdir-less test folder)
from pytorch_metric_learning import losses

from torchkit import ops, reference

PML = "pytorch-metric-learning"
TEMPERATURE = {"supcon_loss": 0.1, "ntxent_loss": 0.07}
PML_LOSS = {"supcon_loss": losses.SupConLoss, "ntxent_loss": losses.NTXentLoss}
PML_BUDGET = 8 * 2**30  # bytes a peer may ask for on this machine (24 GiB, shared)


@functools.cache
def compiled_reference(loss):
    return torch.compile(getattr(reference, loss))


@torch.no_grad()
def gemm_roofline(e, backward=False):
    s = e @ e.T
    if backward:
        s @ e
    return s


def pml_bytes(loss, N, per_class):
    """At least what PML's loss allocates at once: N×N float32 masks and similarities for
    SupCon; for NT-Xent, its (positive pairs × negative pairs) float32 matrix."""
    if loss == "supcon_loss":
        return 6 * N * N * 4
    positives, negatives = N * (per_class - 1), N * (N - per_class)
    return positives * negatives * 4


IMPLS = {
    "torchkit": lambda loss: functools.partial(getattr(ops, loss), temperature=TEMPERATURE[loss]),
    PML: lambda loss: PML_LOSS[loss](temperature=TEMPERATURE[loss]),
    "reference": lambda loss: functools.partial(getattr(reference, loss), temperature=TEMPERATURE[loss]),
    "torch.compile(reference)": lambda loss: functools.partial(compiled_reference(loss), temperature=TEMPERATURE[loss]),
    ROOFLINE: lambda loss: gemm_roofline,
}

# (case, N, D, samples per class, dtype, device)
CASES = [
    pytest.param("N=1024 D=512 8/class fp32", 1024, 512, 8, torch.float32, "cpu", marks=pytest.mark.headline),
    pytest.param("N=8192 D=128 8/class fp32", 8192, 128, 8, torch.float32, "cpu"),
]


@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case,N,D,per_class,dtype,device", CASES)
@pytest.mark.parametrize("loss", ["supcon_loss", "ntxent_loss"])
def test_pair_loss(benchmark, loss, case, N, D, per_class, dtype, device, impl, pass_):
    if impl == PML and pml_bytes(loss, N, per_class) > PML_BUDGET:
        gib = pml_bytes(loss, N, per_class) / 2**30
        pytest.skip(f"{PML} would need at least {gib:.0f} GiB here")
    g = torch.Generator(device).manual_seed(0)
    e = torch.randn(N, D, generator=g, device=device).to(dtype)
    labels = torch.arange(N, device=device) // per_class
    fn = IMPLS[impl](loss)
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

    run(benchmark, step, op=loss, case=case, pass_=pass_, impl=impl, device=device, **extra)
