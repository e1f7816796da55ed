"""label_smoothing_cross_entropy vs F.cross_entropy(label_smoothing=0.1), its torch.compile,
the cookbook reference and timm's LabelSmoothingCrossEntropy; forward and forward+backward."""

import functools

import pytest
import torch
import torch.nn.functional as F
from common import run  # benchmarks/ is on sys.path (rootdir-less test folder)

from torchkit import ops, reference

EPS = 0.1


def f_cross_entropy(x, t):
    return F.cross_entropy(x, t, label_smoothing=EPS)


@functools.cache
def compiled_cross_entropy():
    return torch.compile(f_cross_entropy)


def timm_loss():
    try:
        from timm.loss import LabelSmoothingCrossEntropy
    except ImportError:
        return None
    return LabelSmoothingCrossEntropy(smoothing=EPS)


IMPLS = {
    "torchkit": lambda x, t: ops.label_smoothing_cross_entropy(x, t, label_smoothing=EPS),
    "F.cross_entropy": f_cross_entropy,
    "torch.compile(F.cross_entropy)": lambda x, t: compiled_cross_entropy()(x, t),
    "reference": lambda x, t: reference.label_smoothing_cross_entropy(x, t, label_smoothing=EPS),
    "timm": lambda x, t: timm_loss()(x, t),  # 2-D inputs and mean reduction only
}

CPU_CASES = [
    pytest.param("N=4096 C=32000 fp32", (4096, 32000), torch.float32, "cpu", marks=pytest.mark.headline),
    pytest.param("N=256 C=1000 (ImageNet)", (256, 1000), torch.float32, "cpu"),
    pytest.param("N=8 C=21 128x128 (segmentation)", (8, 21, 128, 128), torch.float32, "cpu"),
    pytest.param("N=4096 C=32000 bf16", (4096, 32000), torch.bfloat16, "cpu"),
    pytest.param("N=1 C=1000000", (1, 1_000_000), torch.float32, "cpu"),
]
GPU_CASES = [
    pytest.param(f"N=16384 C={c} {name}", (16384, c), dtype, "cuda", marks=pytest.mark.cuda)
    for c in (32768, 131072)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
]


@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case,shape,dtype,device", CPU_CASES + GPU_CASES)
def test_label_smoothing_ce(benchmark, case, shape, dtype, device, impl, pass_):
    if impl == "timm" and (len(shape) != 2 or timm_loss() is None):
        pytest.skip("timm's loss takes (N, C) inputs only (or timm is not installed)")
    if impl == "reference" and device == "cpu" and shape[0] * shape[1] > 10**8 and dtype != torch.float32:
        pytest.skip("the reference's N x C float temporaries exceed the benchmark's memory budget")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype).to(device)
    t = torch.randint(shape[1], (shape[0], *shape[2:]), generator=g).to(device)
    fn = IMPLS[impl]
    if pass_ == "forward":

        def step():
            with torch.no_grad():
                fn(x, t)
    else:
        x.requires_grad_()

        def step():
            fn(x, t).backward()
            x.grad = None

    run(
        benchmark,
        step,
        op="label_smoothing_cross_entropy",
        case=case,
        pass_=pass_,
        impl=impl,
        device=device,
        logits_bytes=x.numel() * x.element_size(),
    )
