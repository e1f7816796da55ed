"""region_confusion (RCM) vs the cookbook snippet image by image (torchkit.reference),
kornia's RandomJigsaw(grid=(7, 7)), against the memory roofline: x.clone(), the same
read and write of every byte."""

import functools

import pytest
import torch
from common import ROOFLINE, run  # benchmarks/ is on sys.path (rootdir-less test folder)

from torchkit import ops, reference

N_BLOCKS, K = 7, 2


@functools.cache
def kornia_jigsaw(device):
    from kornia.augmentation import RandomJigsaw  # benchmark-only dependency

    return RandomJigsaw(grid=(N_BLOCKS, N_BLOCKS), p=1.0).to(device)


IMPLS = {
    "torchkit": lambda x: ops.region_confusion(x, N_BLOCKS, K),
    "reference": lambda x: reference.region_confusion(x, N_BLOCKS, K),
    "kornia RandomJigsaw": lambda x: kornia_jigsaw(x.device.type)(x),  # no neighbourhood constraint
    ROOFLINE: lambda x: x.clone(),
}

CPU_CASES = [
    pytest.param("N=64 3x448x448 fp32", (64, 3, 448, 448), torch.float32, "cpu", marks=pytest.mark.headline),
    pytest.param("N=64 3x448x448 uint8", (64, 3, 448, 448), torch.uint8, "cpu"),
    pytest.param("N=256 3x224x224 fp32", (256, 3, 224, 224), torch.float32, "cpu"),
]
GPU_CASES = [
    pytest.param("N=256 3x448x448 fp32", (256, 3, 448, 448), torch.float32, "cuda", marks=pytest.mark.cuda),
]


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case,shape,dtype,device", CPU_CASES + GPU_CASES)
def test_region_confusion(benchmark, case, shape, dtype, device, impl):
    if impl.startswith("kornia"):
        pytest.importorskip("kornia")
        if not dtype.is_floating_point:
            pytest.skip("kornia's augmentations take floating-point images only")
    g = torch.Generator(device).manual_seed(0)  # drawn where they live: GB-sized inputs in ms on a GPU
    x = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8, device=device).to(dtype)

    def step():
        with torch.no_grad():
            IMPLS[impl](x)

    run(
        benchmark,
        step,
        op="region_confusion",
        case=case,
        pass_="forward",
        impl=impl,
        device=device,
        bytes=2 * x.numel() * x.element_size(),
    )
