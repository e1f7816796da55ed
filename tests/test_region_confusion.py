"""torchkit.ops.region_confusion / permute_blocks against a slicing oracle, the cookbook
reference and the cookbook's distribution."""

import inspect

import pytest
import torch
from testing import (
    DEVICES,
    assert_device_side_assert,
    check_compiled_refuses_like_eager,
    check_gradcheck,
    check_meta_refuses_like_eager,
    check_opcheck,
    compiled,
)

import torchkit
from torchkit import ops, reference

try:  # torchkit.transforms' tests: torchvision is the [vision] extra, not a dependency
    from torchvision import tv_tensors
    from torchvision.transforms import v2
except ImportError:
    tv_tensors = v2 = None
needs_torchvision = pytest.mark.skipif(tv_tensors is None, reason="torchkit.transforms needs torchvision")

OP = torch.ops.torchkit.permute_blocks.default
ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int64, torch.bool]


def make(shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return (torch.rand(shape, generator=g) > 0.5).to(device)
    if not dtype.is_floating_point:
        return torch.randint(0, 250, shape, generator=g).to(dtype).to(device)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def oracle(x, perm, n):
    """Independent of both implementations: cut every block out by its coordinates, paste it."""
    batch = x.unsqueeze(0) if x.dim() == 3 else x
    perm = perm.view(-1, n * n)
    H, W = batch.shape[-2:]
    bh, bw = H // n, W // n
    out = batch.clone()
    for s in range(batch.shape[0]):
        blocks = {
            (i, j): batch[s, :, i * bh : (i + 1) * bh, j * bw : (j + 1) * bw].clone()
            for i in range(n)
            for j in range(n)
        }
        for b in range(n * n):
            src = int(perm[s, b])
            out[s, :, (b // n) * bh : (b // n + 1) * bh, (b % n) * bw : (b % n + 1) * bw] = blocks[divmod(src, n)]
    return out if x.dim() == 4 else out[0]


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(
    "shape,n", [((2, 3, 28, 28), 7), ((3, 30, 29), 7), ((1, 1, 5, 9), 2), ((2, 4, 8, 8), 1), ((2, 3, 7, 7), 7)]
)
def test_output_is_input_moved_by_permutation(device, dtype, shape, n):
    x = make(shape, dtype, device)
    out, perm = ops.region_confusion(x, n, 2, generator=seeded())
    assert out.dtype == dtype and out.shape == x.shape and out.device == x.device
    assert perm.dtype == torch.int64 and perm.shape == ((shape[0], n * n) if len(shape) == 4 else (n * n,))
    assert torch.equal(out, oracle(x, perm, n))


@pytest.mark.parametrize("n,k", [(7, 2), (4, 2), (5, 3), (3, 5)])
def test_permutation_is_a_bijection_within_the_bound(n, k):
    _, perm = ops.region_confusion(torch.zeros(64, 1, n, n), n, k, generator=seeded(n * k))
    assert torch.equal(perm.sort(1).values, torch.arange(n * n).expand(64, -1))
    b = torch.arange(n * n)
    assert ((perm // n - b // n).abs() <= 2 * k - 1).all()
    assert ((perm % n - b % n).abs() <= 2 * k - 1).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 3, 28, 28), (3, 31, 30)])
def test_same_seed_same_result_as_reference(device, shape):
    x = make(shape, device=device)
    out, perm = ops.region_confusion(x, 7, 2, generator=seeded(3))
    ref_out, ref_perm = reference.region_confusion(x, 7, 2, generator=seeded(3))
    assert torch.equal(perm, ref_perm) and torch.equal(out, ref_out)
    again, perm_again = ops.region_confusion(x, 7, 2, generator=seeded(3))
    assert torch.equal(perm, perm_again) and torch.equal(out, again)


@pytest.mark.cuda
def test_cpu_and_cuda_agree():
    x = make((4, 3, 56, 56))
    out, perm = ops.region_confusion(x, 7, 2, generator=seeded(5))
    out_cuda, perm_cuda = ops.region_confusion(x.cuda(), 7, 2, generator=seeded(5))
    assert torch.equal(perm, perm_cuda.cpu()) and torch.equal(out, out_cuda.cpu())


def test_samples_get_independent_draws():
    _, perm = ops.region_confusion(torch.zeros(16, 1, 14, 14), 7, 2, generator=seeded())
    assert len({tuple(p.tolist()) for p in perm}) == 16


def test_move_distribution_matches_cookbook():
    """Monte-Carlo: the distribution of (block-row, block-column) displacements over thousands
    of draws equals the one of the cookbook snippet run image by image (reference)."""
    n, k, draws = 7, 2, 3000
    _, perm = ops.region_confusion(torch.zeros(draws, 1, n, n), n, k, generator=seeded(11))
    _, ref = reference.region_confusion(torch.zeros(600, 1, n, n), n, k, generator=seeded(12))
    b = torch.arange(n * n)

    def histogram(p):
        dy, dx = p // n - b // n, p % n - b % n
        codes = (dy + 2 * k) * (4 * k + 1) + (dx + 2 * k)
        return torch.bincount(codes.flatten(), minlength=(4 * k + 1) ** 2).double() / codes.numel()

    h, h_ref = histogram(perm), histogram(ref)
    # Total-variation distance between the two empirical distributions (n² moves per draw);
    # independent samples of these sizes stay well below 0.03.
    assert 0.5 * (h - h_ref).abs().sum() < 0.03
    # And the structure: a fair share of blocks stays put, none moves 2k block rows or more.
    assert 0.1 < (perm == b).double().mean() < 0.6


@pytest.mark.parametrize("device", DEVICES)
def test_remainder_pixels_untouched(device):
    x = make((2, 3, 31, 33), device=device)  # 7 × 4 = 28 rows, 7 × 4 = 28 columns shuffled
    out, _ = ops.region_confusion(x, 7, 2, generator=seeded())
    assert torch.equal(out[..., 28:, :], x[..., 28:, :])
    assert torch.equal(out[..., :, 28:], x[..., :, 28:])
    assert not torch.equal(out[..., :28, :28], x[..., :28, :28])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_channels_last(device, dtype):
    x = make((2, 3, 28, 28), dtype, device).contiguous(memory_format=torch.channels_last)
    perm = ops.region_confusion(x, 7, 2, generator=seeded())[1]
    out = ops.permute_blocks(x, perm, 7)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, oracle(x.contiguous(), perm, 7))


@pytest.mark.parametrize("device", DEVICES)
def test_other_strides(device):
    x = make((2, 3, 28, 30), device=device)[..., :, 1:29]  # a column-sliced, non-dense view
    perm = ops.region_confusion(x, 7, 2, generator=seeded())[1]
    assert torch.equal(ops.permute_blocks(x, perm, 7), oracle(x.contiguous(), perm, 7))
    y = make((28, 28, 2, 3), device=device).permute(2, 3, 0, 1)  # (N, C, H, W) with odd strides
    perm = ops.region_confusion(y, 7, 2, generator=seeded())[1]
    assert torch.equal(ops.permute_blocks(y, perm, 7), oracle(y.contiguous(), perm, 7))


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_is_inverse_gather(device):
    x = make((2, 3, 14, 14), device=device).requires_grad_()
    out, perm = ops.region_confusion(x, 7, 2, generator=seeded())
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    inverse = torch.argsort(perm, dim=1)
    assert torch.equal(gx, oracle(g, inverse, 7))
    assert torch.equal(gx, torch.autograd.grad(reference.permute_blocks(x, perm, 7), x, g)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device):
    x = make((2, 2, 6, 7), torch.float64, device).requires_grad_()
    perm = ops.region_confusion(x, 3, 2, generator=seeded())[1]
    assert (perm.cpu() != torch.arange(9)).any()
    check_gradcheck(lambda t: ops.permute_blocks(t, perm, 3), (x,))
    assert torch.autograd.gradgradcheck(lambda t: ops.permute_blocks(t, perm, 3), (x,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_opcheck(device, channels_last):
    x = make((2, 3, 8, 8), device=device).requires_grad_()
    if channels_last:
        x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    perm = ops.region_confusion(x, 4, 2, generator=seeded())[1]
    check_opcheck(OP, (x, perm, 4))
    check_opcheck(OP, (x.detach()[0], perm[0], 4))
    check_opcheck(OP, (x.detach().to(torch.uint8), perm, 4))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    def shuffle(t):
        return ops.region_confusion(t, 7, 2)

    x = make((2, 3, 28, 28), device=device).requires_grad_()
    out, perm = compiled(shuffle)(x)
    assert torch.equal(perm.sort(1).values, torch.arange(49, device=device).expand(2, -1))
    assert torch.equal(out, oracle(x.detach(), perm, 7))
    (g,) = torch.autograd.grad(out, x, out.detach())
    assert torch.equal(g, x.detach())
    # Inductor draws random numbers its own way; with eager's generator the results match.
    with torch._inductor.config.patch(fallback_random=True):
        torch.manual_seed(0)
        eager, eager_perm = shuffle(x)
        torch.manual_seed(0)
        out, perm = torch.compile(shuffle, fullgraph=True)(x)
    assert torch.equal(perm, eager_perm) and torch.equal(out, eager)


def test_module_train_and_eval():
    m = torchkit.nn.RegionConfusion(7, 2)
    x = make((4, 3, 28, 28))
    out, perm = m(x)
    assert torch.equal(out, oracle(x, perm, 7)) and not torch.equal(out, x)
    m.eval()
    out, perm = m(x)
    assert out is x and torch.equal(perm, torch.arange(49).expand(4, -1))
    m.train()
    m_off = torchkit.nn.RegionConfusion(7, 2, p=0.0)
    assert torch.equal(m_off(x)[0], x)
    assert "neighbourhood=2" in repr(m)


def test_probability_per_sample():
    torch.manual_seed(0)
    m = torchkit.nn.RegionConfusion(7, 2, p=0.5)
    _, perm = m(torch.zeros(2000, 1, 7, 7))
    shuffled = (perm != torch.arange(49)).any(1).double().mean().item()
    assert 0.45 < shuffled < 0.55


@needs_torchvision
def test_transform_in_compose_with_mask():
    torch.manual_seed(0)
    t = v2.Compose(
        [
            v2.RandomResizedCrop(56, antialias=True),
            torchkit.transforms.RandomRegionConfusion(7, 2),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([0.5] * 3, [0.5] * 3),
        ]
    )
    # The mask holds each pixel's own position, so where it lands shows how the image moved.
    image = tv_tensors.Image(torch.arange(3 * 64 * 64).view(3, 64, 64).remainder(251).to(torch.uint8))
    mask = tv_tensors.Mask(torch.arange(64 * 64).view(64, 64))
    img_out, mask_out = t(image, mask)
    assert isinstance(img_out, tv_tensors.Image) and img_out.dtype == torch.float32 and img_out.shape == (3, 56, 56)
    assert isinstance(mask_out, tv_tensors.Mask) and mask_out.shape == (56, 56)

    # Same permutation for image and mask: applying the transform with a fixed seed to both
    # stacked as one image must equal applying it to them together.
    rcm = torchkit.transforms.RandomRegionConfusion(7, 2)
    img = tv_tensors.Image(make((3, 28, 28)))
    msk = tv_tensors.Mask(torch.arange(28 * 28).view(28, 28))
    torch.manual_seed(1)
    a, b = rcm(img, msk)
    torch.manual_seed(1)
    _, perm = ops.region_confusion(img, 7, 2)
    assert torch.equal(a, oracle(img.as_subclass(torch.Tensor), perm, 7))
    assert torch.equal(b, oracle(msk.as_subclass(torch.Tensor).unsqueeze(0), perm, 7)[0])


@needs_torchvision
def test_transform_batched_plain_tensor():
    rcm = torchkit.transforms.RandomRegionConfusion(7, 2, p=1.0)
    x = make((5, 3, 28, 28))
    out = rcm(x)
    assert type(out) is torch.Tensor and out.shape == x.shape and not torch.equal(out, x)
    assert torch.equal(out.flatten().sort().values, x.flatten().sort().values)


@needs_torchvision
@pytest.mark.bad_input
def test_transform_moves_one_mask_per_image_and_refuses_one_for_a_batch():
    rcm = torchkit.transforms.RandomRegionConfusion(4, 2)
    images = tv_tensors.Image(make((3, 2, 8, 8)))
    masks = tv_tensors.Mask(torch.arange(3 * 64).view(3, 8, 8))
    torch.manual_seed(0)
    _, moved = rcm(images, masks)
    torch.manual_seed(0)
    _, perm = ops.region_confusion(images.as_subclass(torch.Tensor), 4, 2)
    assert torch.equal(moved, oracle(masks.as_subclass(torch.Tensor).unsqueeze(1), perm, 4).squeeze(1))
    with pytest.raises(ValueError, match=r"each image needs its own mask.*3 image\(s\).*got shape \(8, 8\)"):
        rcm(images, tv_tensors.Mask(torch.zeros(8, 8, dtype=torch.long)))


@needs_torchvision
def test_transform_hands_out_the_permutation_in_a_dict_sample():
    rcm = torchkit.transforms.RandomRegionConfusion(7, 2, permutation_key="permutation")
    image = tv_tensors.Image(make((3, 28, 28)))
    mask = tv_tensors.Mask(torch.arange(28 * 28).view(28, 28))
    torch.manual_seed(3)
    sample = rcm({"image": image, "mask": mask, "label": 5})
    assert sample["label"] == 5 and sample["permutation"].shape == (49,)
    assert torch.equal(sample["image"], oracle(image.as_subclass(torch.Tensor), sample["permutation"], 7))
    assert torch.equal(sample["mask"], oracle(mask.as_subclass(torch.Tensor)[None], sample["permutation"], 7)[0])
    torch.manual_seed(3)
    assert torch.equal(ops.region_confusion(image, 7, 2)[1], sample["permutation"])
    identity = torchkit.transforms.RandomRegionConfusion(7, 2, p=0.0, permutation_key="permutation")
    assert torch.equal(identity({"image": image})["permutation"], torch.arange(49))
    with pytest.raises(TypeError, match="adds the permutation to a dict sample"):
        rcm(image)
    with pytest.raises(ValueError, match="already has a key 'permutation'"):
        rcm({"image": image, "permutation": 1})


@needs_torchvision
def test_transform_accepts_pil_images():
    from PIL import Image

    array = torch.arange(3 * 28 * 28).view(3, 28, 28).remainder(251).to(torch.uint8)
    pil = Image.fromarray(array.permute(1, 2, 0).numpy(), mode="RGB")
    rcm = torchkit.transforms.RandomRegionConfusion(7, 2, permutation_key="permutation")
    sample = rcm({"image": pil})
    assert isinstance(sample["image"], Image.Image) and sample["image"].mode == "RGB"
    out = torch.from_numpy(__import__("numpy").asarray(sample["image"])).permute(2, 0, 1)
    assert torch.equal(out, oracle(array, sample["permutation"], 7))


@needs_torchvision
@pytest.mark.bad_input
def test_transform_refuses_boxes():
    rcm = torchkit.transforms.RandomRegionConfusion()
    boxes = tv_tensors.BoundingBoxes(torch.tensor([[0, 0, 5, 5]]), format="XYXY", canvas_size=(28, 28))
    with pytest.raises(TypeError, match="BoundingBoxes"):
        rcm(tv_tensors.Image(make((3, 28, 28))), boxes)


x4 = make((2, 3, 14, 14))
perm4 = torch.arange(49).expand(2, 49).contiguous()
BAD = [
    (lambda: ops.region_confusion(make((14, 14))), ValueError, r"x must be an image \(C, H, W\)"),
    (lambda: ops.region_confusion(make((1, 2, 3, 14, 14))), ValueError, r"x must be an image"),
    (lambda: ops.region_confusion(x4, 0), ValueError, r"num_blocks must be in \[1, min\(H, W\)\] = \[1, 14\].*got 0"),
    (lambda: ops.region_confusion(x4, 15), ValueError, r"num_blocks must be in .* got 15"),
    (lambda: ops.region_confusion(x4, 7, 0), ValueError, r"neighbourhood must be >= 2, got 0"),
    (lambda: ops.region_confusion(x4, 7, 1), ValueError, r"neighbourhood must be >= 2, got 1: .* no block ever moves"),
    (
        lambda: ops.region_confusion(x4, 7, 2.5),
        TypeError,
        r"region_confusion: neighbourhood must be an int, got float 2.5",
    ),
    (lambda: ops.region_confusion(x4, True), TypeError, r"region_confusion: num_blocks must be an int, got bool True"),
    (
        lambda: ops.region_confusion(x4, 7, 2, generator=42),
        TypeError,
        r"generator must be a torch.Generator or None, got int 42",
    ),
    (lambda: torchkit.nn.RegionConfusion(7, 1), ValueError, r"RegionConfusion: neighbourhood must be >= 2, got 1"),
    (lambda: torchkit.nn.RegionConfusion(7.0), TypeError, r"RegionConfusion: num_blocks must be an int, got float 7.0"),
    pytest.param(
        lambda: torchkit.transforms.RandomRegionConfusion(7, 1),
        ValueError,
        r"RandomRegionConfusion: neighbourhood must be >= 2",
        marks=needs_torchvision,
    ),
    pytest.param(
        lambda: torchkit.transforms.RandomRegionConfusion(True),
        TypeError,
        r"num_blocks must be an int, got bool True",
        marks=needs_torchvision,
    ),
    pytest.param(
        lambda: torchkit.transforms.RandomRegionConfusion(p="0.5"),
        TypeError,
        r"p must be a float in \[0, 1\], got str '0.5'",
        marks=needs_torchvision,
    ),
    (lambda: ops.permute_blocks(make((14, 14)), perm4[0], 7), ValueError, r"x must be an image \(C, H, W\)"),
    (lambda: ops.permute_blocks(x4, perm4[:, :48], 7), ValueError, r"permutation must have shape \[2, 49\]"),
    (lambda: ops.permute_blocks(x4, perm4[0], 7), ValueError, r"permutation must have shape \[2, 49\]"),
    (lambda: ops.permute_blocks(x4, perm4.float(), 7), TypeError, r"permutation must hold block indices"),
    (lambda: ops.permute_blocks(x4, perm4 + 1, 7), IndexError, r"permutation values must be in \[0, 49\).*\[1, 49\]"),
    (lambda: ops.permute_blocks(x4, perm4 - 1, 7), IndexError, r"permutation values must be in \[0, 49\)"),
    (lambda: ops.permute_blocks(x4, perm4, 15), ValueError, r"num_blocks must be in"),
    (lambda: torchkit.nn.RegionConfusion(p=1.5), ValueError, r"p must be a probability in \[0, 1\], got 1.5"),
    pytest.param(
        lambda: torchkit.transforms.RandomRegionConfusion(p=-0.1),
        ValueError,
        r"p must be a probability",
        marks=needs_torchvision,
    ),
]


@pytest.mark.bad_input
@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.bad_input
@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input_under_compile(monkeypatch, call, exc, match):
    check_compiled_refuses_like_eager(monkeypatch, ["region_confusion", "permute_blocks"], call)


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "call,exc,match",
    [c for c in BAD if callable(c[0]) and "ops.permute_blocks" in inspect.getsource(c[0]) and c[1] is not IndexError],
)
def test_permute_blocks_bad_input_on_meta_tensors(monkeypatch, call, exc, match):
    """The fake kernel refuses what the kernel refuses; only out-of-range indices (the
    IndexErrors) are the kernel's alone: on meta tensors there are no values to read."""
    check_meta_refuses_like_eager(monkeypatch, "permute_blocks", call)


def test_permute_blocks_is_a_gather():
    """Documented: any index map, a repeated index copies its block to every place naming it."""
    x = make((2, 3, 14, 15))  # a column of remainder on the right, left in place
    perm = torch.zeros(2, 49, dtype=torch.long)
    perm[1] = torch.arange(49).flip(0) // 2  # blocks 24..0, most of them twice
    out = ops.permute_blocks(x, perm, 7)
    for n in range(2):
        for b in range(49):
            src = int(perm[n, b])
            (r, c), (sr, sc) = divmod(b, 7), divmod(src, 7)
            assert torch.equal(
                out[n, :, 2 * r : 2 * r + 2, 2 * c : 2 * c + 2], x[n, :, 2 * sr : 2 * sr + 2, 2 * sc : 2 * sc + 2]
            )
    assert torch.equal(out[..., 14:], x[..., 14:])


@pytest.mark.bad_input
def test_backward_refuses_a_repeated_block_index():
    perm = torch.arange(49).repeat(2, 1)
    perm[1, 3] = 5  # block 5 twice, block 3 never
    x = x4.clone().requires_grad_()
    out = OP(x, perm, 7)
    torch.testing.assert_close(out[1, :, 0:2, 6:8], x4[1, :, 0:2, 10:12])  # the forward copies block 5
    with pytest.raises(RuntimeError, match=r"permute_blocks: the gradient needs a permutation"):
        out.sum().backward()


def test_meta_permutation_is_a_device_error():
    with pytest.raises(
        ValueError, match="permute_blocks: x and permutation must be on the same device, got cpu and meta"
    ):
        OP(x4, perm4.to("meta"), 7)


@pytest.mark.cuda
def test_permutation_on_another_device():
    with pytest.raises(ValueError, match="x and permutation must be on the same device"):
        ops.permute_blocks(x4.cuda(), perm4, 7)


@pytest.mark.cuda
def test_cuda_out_of_range_permutation_is_a_device_side_assert():
    # On CUDA the range check runs in the kernel (a host-side check would synchronise every call).
    code = """
import torch, torchkit
x = torch.randn(2, 3, 14, 14, device="cuda")
perm = torch.arange(49, device="cuda").repeat(2, 1)
perm[1, 5] = 49
try:
    torchkit.ops.permute_blocks(x, perm, 7)
    torch.cuda.synchronize()
except RuntimeError as e:
    print("raised:", e)
"""
    assert_device_side_assert(code, "permutation value out of range")


@pytest.mark.parametrize("n", [2, 3, 4])
def test_reproduces_kornia_random_jigsaw_from_its_own_permutation(n):
    """kornia numbers the output positions column-major: its permutation, transposed to
    row-major, is permute_blocks' (README's drop-in table)."""
    kornia = pytest.importorskip("kornia")
    torch.manual_seed(n)
    x = torch.randn(5, 3, 4 * n, 6 * n)
    jigsaw = kornia.augmentation.RandomJigsaw(grid=(n, n), p=1.0)
    expected = jigsaw(x)
    kornia_perm = jigsaw._params["permutation"]
    row_major = kornia_perm.view(-1, n, n).transpose(1, 2).reshape(-1, n * n)
    assert torch.equal(ops.permute_blocks(x, row_major, n), expected)
    assert not torch.equal(ops.permute_blocks(x, kornia_perm, n), expected)  # without the transpose


def test_integral_settings():
    """num_blocks and neighbourhood as any integral number (numpy, 0-d tensors)."""
    np = pytest.importorskip("numpy")
    x = make((2, 3, 28, 28))
    torch.manual_seed(0)
    expected = ops.region_confusion(x, 7, 2)
    torch.manual_seed(0)
    got = ops.region_confusion(x, np.int64(7), torch.tensor(2))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
