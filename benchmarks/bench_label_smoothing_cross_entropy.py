"""label_smoothing_cross_entropy vs F.cross_entropy(label_smoothing=0.1), its torch.compile,
the cookbook reference, timm's LabelSmoothingCrossEntropy and (CUDA) Liger-Kernel's
cross-entropy; forward and forward+backward, against the memory roofline: one read of the
logits for a forward, a read plus a write of a fresh gradient (a copy) for forward+backward."""

import functools

import pytest
import torch
import torch.nn.functional as F
from common import ROOFLINE, run  # benchmarks/ is on sys.path (rootdir-less test folder)

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


def liger_loss(x, t):
    # Liger writes the gradient over the logits during the forward pass when they require
    # grad (its memory saving), so a timed loop runs on gradients after its first call:
    # the same amount of work, on other values.
    from liger_kernel.transformers.functional import liger_cross_entropy

    return liger_cross_entropy(x, t, label_smoothing=EPS)


@torch.no_grad()
def memory_roofline(x, t, backward=False):
    """The traffic no implementation avoids: a read of the logits (forward); with backward,
    also the write of a gradient of their size, i.e. one copy (read + write) in all."""
    if backward:
        return torch.empty_like(x).copy_(x)
    return x.sum(dtype=torch.float32)


def has_liger() -> bool:
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError:
        return False
    return True


IMPLS = {
    "torchkit": lambda x, t: ops.label_smoothing_cross_entropy(x, t, label_smoothing=EPS),
    "F.cross_entropy": f_cross_entropy,
    "torch.compile(F.cross_entropy)": lambda x, t: compiled_cross_entropy()(x, t),
    "reference": lambda x, t: reference.label_smoothing_cross_entropy(x, t, label_smoothing=EPS),
    "timm": lambda x, t: timm_loss()(x, t),  # 2-D inputs and mean reduction only
    "Liger-Kernel": liger_loss,  # CUDA (Triton), 2-D inputs
    ROOFLINE: memory_roofline,
}

CPU_CASES = [
    pytest.param("N=4096 C=32000 fp32", (4096, 32000), torch.float32, "cpu", marks=pytest.mark.headline),
    # The classification heads of this project's users (ImageNet; CUB's 200 and Cars' 196 are smaller).
    pytest.param("N=256 C=1000 (ImageNet)", (256, 1000), torch.float32, "cpu", marks=pytest.mark.headline),
    pytest.param("N=8 C=21 128x128 (segmentation)", (8, 21, 128, 128), torch.float32, "cpu"),
    pytest.param("N=4096 C=32000 bf16", (4096, 32000), torch.bfloat16, "cpu"),
    pytest.param("N=1 C=1000000", (1, 1_000_000), torch.float32, "cpu"),
]
GPU_CASES = [
    pytest.param(
        "N=16384 C=32768 fp32", (16384, 32768), torch.float32, "cuda", marks=[pytest.mark.cuda, pytest.mark.headline]
    ),
    pytest.param(
        "N=256 C=1000 (ImageNet)", (256, 1000), torch.float32, "cuda", marks=[pytest.mark.cuda, pytest.mark.headline]
    ),
    pytest.param("N=16384 C=32768 bf16", (16384, 32768), torch.bfloat16, "cuda", marks=pytest.mark.cuda),
    pytest.param("N=8192 C=131072 bf16", (8192, 131072), torch.bfloat16, "cuda", marks=pytest.mark.cuda),
    pytest.param("N=32 C=19 512x512 (segmentation)", (32, 19, 512, 512), torch.float32, "cuda", marks=pytest.mark.cuda),
]


@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case,shape,dtype,device", CPU_CASES + GPU_CASES)
def test_label_smoothing_cross_entropy(benchmark, case, shape, dtype, device, impl, pass_):
    if impl == "timm" and (len(shape) != 2 or timm_loss() is None):
        pytest.skip("timm's loss takes (N, C) inputs only (or timm is not installed)")
    if impl == "Liger-Kernel" and (device != "cuda" or len(shape) != 2 or not has_liger()):
        pytest.skip("Liger-Kernel: (N, C) inputs on CUDA (or it is not installed)")
    if impl == "reference" and device == "cpu" and shape[0] * shape[1] > 10**8 and dtype != torch.float32:
        pytest.skip("the reference's N x C float temporaries exceed the benchmark's memory budget")
    g = torch.Generator(device).manual_seed(0)  # drawn where they live: GB-sized inputs in ms on a GPU
    x = torch.randn(shape, generator=g, device=device).to(dtype)
    t = torch.randint(shape[1], (shape[0], *shape[2:]), generator=g, device=device)
    fn = IMPLS[impl]
    if impl == ROOFLINE:

        def step():
            fn(x, t, backward=pass_ != "forward")
    elif pass_ == "forward":

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
        bytes=x.numel() * x.element_size() * (1 if pass_ == "forward" else 2),
    )
