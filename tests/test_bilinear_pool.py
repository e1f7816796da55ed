"""torchkit.ops.bilinear_pool against the cookbook composition (torchkit.reference)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from testing import (
    DEVICES,
    DEVICES_SCALED,
    EXTREMES,
    FLOAT_DTYPES,
    REDUCED_DTYPES,
    as_param,
    assert_close,
    assert_close_reduced,
    check_compile,
    check_compiled_refuses_like_eager,
    check_cuda_matches_cpu,
    check_gradcheck,
    check_meta_refuses_like_eager,
    check_opcheck,
    make_noncontiguous,
    with_triton,
)

import torchkit
from torchkit import ops, reference

# The op's tests run through its Triton kernels too ("triton": under the interpreter).
DEVICES_TRITON = with_triton("bilinear_pool")
DEVICES_SCALED_TRITON = with_triton("bilinear_pool", DEVICES_SCALED)

OP = torch.ops.torchkit.bilinear_pool.default
BACKWARD = torch.ops.torchkit._bilinear_pool_backward.default

# (x shape, y channels or None)
SHAPES = [
    ((2, 5, 3, 4), None),
    ((2, 5, 3, 4), 3),
    ((1, 1, 1, 1), None),
    ((3, 1, 2, 2), 1),
    ((2, 7, 1, 1), None),
    ((2, 130, 3, 3), None),  # crosses the CPU kernel's 128-wide tiles
    ((2, 130, 3, 3), 129),
    ((0, 4, 2, 2), None),  # an empty batch
    ((0, 3, 2, 2), 5),
]


def make(shape, dtype=torch.float64, device="cpu", seed=0, relu=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    return (t.relu() if relu else t).to(dtype).to(device)


def inputs(shape, E, dtype=torch.float64, device="cpu", relu=False):
    x = make(shape, dtype, device, 1, relu).requires_grad_()
    y = None if E is None else make((shape[0], E, *shape[2:]), dtype, device, 2, relu).requires_grad_()
    return x, y


def leaves(x, y):
    return (x,) if y is None else (x, y)


def grads(fn, x, y, g):
    return torch.autograd.grad(fn(x, y), leaves(x, y), g)


@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,E", SHAPES)
@pytest.mark.parametrize("relu", [False, True])
def test_matches_reference(device, dtype, shape, E, relu):
    x, y = inputs(shape, E, dtype, device, relu)
    out = ops.bilinear_pool(x, y)
    expected = reference.bilinear_pool(x, y)
    assert out.shape == expected.shape == (shape[0], shape[1] * (E or shape[1])) and out.dtype == dtype
    # The upstream gradient from a generator of its own: the same on every run, whatever ran
    # before (the global one's state depends on the order of the tests).
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=dtype).to(out.device)
    actual = (out, *grads(ops.bilinear_pool, x, y, g))
    ref = (expected, *grads(reference.bilinear_pool, x, y, g))
    if dtype == torch.float64:
        for a, r in zip(actual, ref, strict=True):
            assert_close(a, r, atol=1e-12)
        return
    # float32: as accurate as the reference against float64. Where Z nearly cancels, the
    # signed sqrt's slope 1/(2|s|) magnifies a GEMM's rounding, so another summation order
    # (the Triton tiles) moves those entries as far as the reference's own rounding does.
    x64, y64 = (None if t is None else t.detach().double().requires_grad_() for t in (x, y))
    out64 = reference.bilinear_pool(x64, y64)
    exact = (out64, *grads(reference.bilinear_pool, x64, y64, g.double()))

    def err(t, e):
        return (t.double() - e).abs().max().item() if e.numel() else 0.0

    # (A floor of float32's rounding at the upstream gradient's scale: where the exact gradient
    # is 0 (a single bilinear feature normalises to ±1 whatever the input), the reference may
    # round to exactly 0 and the kernel to ~1e-7·|g|.)
    floor = 1e-6 * max(1.0, g.abs().max().item()) if g.numel() else 1e-6
    for a, r, e in zip(actual, ref, exact, strict=True):
        assert err(a, e) <= 2 * err(r, e) + floor


@pytest.mark.parametrize("device", DEVICES_TRITON)
def test_vgg_sized(device):
    x = make((2, 512, 7, 7), torch.float32, device, relu=True).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    out, ref = ops.bilinear_pool(x), reference.bilinear_pool(x64)
    assert (out.double() - ref).abs().max() < 1e-6
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    (g64,) = torch.autograd.grad(ref, x64, g.double())
    assert (gx.double() - g64).abs().max() <= 1e-5 * g64.abs().max()


@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("dtype", REDUCED_DTYPES)
@pytest.mark.parametrize("E", [None, 6])
def test_reduced_precision(device, dtype, E):
    x, y = inputs((2, 9, 4, 5), E, dtype, device, relu=True)
    out = ops.bilinear_pool(x, y)
    assert out.dtype == dtype
    x32, y32 = (t.detach().float().requires_grad_() if t is not None else None for t in (x, y))
    x64, y64 = (t.detach().double().requires_grad_() if t is not None else None for t in (x, y))
    ref32, ref64 = reference.bilinear_pool(x32, y32), reference.bilinear_pool(x64, y64)
    assert_close_reduced(out, ref32.to(dtype), ref64)
    g = torch.randn_like(out)
    for actual, base, exp in zip(
        grads(ops.bilinear_pool, x, y, g),
        torch.autograd.grad(ref32, leaves(x32, y32), g.float()),
        torch.autograd.grad(ref64, leaves(x64, y64), g.double()),
        strict=False,
    ):
        assert actual.dtype == dtype
        # The backward recovers s from the output as autograd saved it, rounded to the input's
        # dtype, where the float32 baseline keeps s in float32: its floor is two units.
        assert_close_reduced(actual, base.to(dtype), exp, ulps=2)


def exact_bilinear_pool(x, y, grad, sqrt_eps=1e-5, l2_eps=1e-12):
    """The output and the input gradients for upstream `grad`, in numpy's long double (whose
    exponent range holds any float64's square): the cookbook's formulas, with autograd's
    conventions at Z = 0 and at the clamp."""

    def ld(t, shape):
        return t.detach().double().cpu().numpy().astype(np.longdouble).reshape(shape)

    N, D, H, W = x.shape
    E = D if y is None else y.shape[1]
    a = ld(x, (N, D, H * W))
    b = a if y is None else ld(y, (N, E, H * W))
    eps, l2 = np.longdouble(sqrt_eps), np.longdouble(l2_eps)
    Z = a @ b.transpose(0, 2, 1) / (H * W)
    s = np.sign(Z) * np.sqrt(np.abs(Z) + eps)
    norm = np.sqrt((s * s).sum((1, 2), keepdims=True))
    denom = np.maximum(norm, l2)
    out = s / denom
    g = ld(grad, (N, D, E))
    ds = np.where(norm >= l2, (g - out * (out * g).sum((1, 2), keepdims=True)) / denom, g / denom)
    dZ = np.where(Z != 0, ds / (2 * np.where(Z != 0, np.abs(s), 1)), 0) / (H * W)
    if y is None:
        return out.reshape(N, D * E), ((dZ + dZ.transpose(0, 2, 1)) @ a).reshape(x.shape)
    return out.reshape(N, D * E), (dZ @ b).reshape(x.shape), (dZ.transpose(0, 2, 1) @ a).reshape(y.shape)


def assert_close_per_sample(actual, exact, rtol):
    """Within rtol of each sample's largest exact entry (a GEMM's accuracy) or the dtype's
    smallest subnormal, where the exact value is a number of actual's dtype; ±∞ past its
    range."""
    info = torch.finfo(actual.dtype)
    got = actual.detach().double().cpu().numpy().astype(np.longdouble).reshape(actual.shape[0], -1)
    exact = exact.reshape(exact.shape[0], -1)
    big = np.abs(exact) > np.longdouble(info.max)
    assert np.all(got[big] == np.sign(exact[big]) * np.inf), "results past the dtype's range must be ±inf"
    scale = np.where(big, 0, np.abs(exact)).max(1, keepdims=True)
    err = np.where(big, 0, np.abs(got - exact))
    bound = rtol * scale + np.longdouble(info.smallest_normal * info.eps)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (
        f"error {float(err[worst]):.3g} at {worst}, sample scale {float(scale[worst[0], 0]):.3g}"
    )


def maps(shape, dtype, scales, device, seed):
    """Features of magnitude scales[n] in sample n, positive so that Z keeps well away from
    0 (where the signed sqrt's slope, 1/(2|s|), leaves any tolerance)."""
    t = make(shape, seed=seed).abs() + 0.5
    return (t * torch.tensor(scales, dtype=torch.float64).view(-1, 1, 1, 1)).to(dtype).to(device)


# Through the Triton kernels, channels_last with the default epsilons only: the scaled samples
# are read by the same strided loads as the others, and test_memory_formats runs channels_last
# through them.
def whole_range_cases():
    for device in map(as_param, DEVICES_SCALED_TRITON):
        name = device.id or device.values[0]
        for sqrt_eps, l2_eps in [(1e-5, 1e-12), (0.0, 1e-12), (1e30, 1e-12), (0.0, "clamp")]:
            for layout, memory_format in (
                ("contiguous", torch.contiguous_format),
                ("channels_last", torch.channels_last),
            ):
                if "triton" in name and layout == "channels_last" and sqrt_eps != 1e-5:
                    continue
                yield pytest.param(
                    *device.values,
                    sqrt_eps,
                    l2_eps,
                    memory_format,
                    marks=device.marks,
                    id=f"{name}-{sqrt_eps}-{l2_eps}-{layout}",
                )


@pytest.mark.parametrize("device,sqrt_eps,l2_eps,memory_format", list(whole_range_cases()))
@pytest.mark.parametrize("dtype,scale", EXTREMES)
@pytest.mark.parametrize("E", [None, 3])
def test_the_whole_finite_range(device, dtype, scale, E, sqrt_eps, l2_eps, memory_format):
    """Outputs and gradients against long-double ones, for features of any finite magnitude
    (where Z under- or overflows the accumulation type) beside an ordinary sample, sqrt_eps
    from 0 to past the square of the data, and the L2 clamp in force (l2_eps about ten times
    the samples' norms): each sample at its own power-of-two scale."""
    scales = [scale, 1.0]
    if l2_eps == "clamp":
        scales, l2_eps = [scale, 2 * scale], 100 * scale
    x = maps((2, 5, 3, 3), dtype, scales, device, seed=1).to(memory_format=memory_format).requires_grad_()
    y = None if E is None else maps((2, E, 3, 3), dtype, scales, device, seed=2)
    y = None if y is None else y.to(memory_format=memory_format).requires_grad_()
    out = ops.bilinear_pool(x, y, sqrt_eps=sqrt_eps, l2_eps=l2_eps)
    g = make(out.shape, seed=3).to(dtype).to(device)
    exact = exact_bilinear_pool(x, y, g, sqrt_eps, l2_eps)
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    assert_close_per_sample(out, exact[0], rtol)
    for actual, expected in zip(
        grads(lambda a, b: ops.bilinear_pool(a, b, sqrt_eps=sqrt_eps, l2_eps=l2_eps), x, y, g), exact[1:], strict=True
    ):
        assert_close_per_sample(actual, expected, 10 * rtol)


# The promise for channels of different magnitude in one sample (docs/ops.md): every product
# of two channels is a normal number of the accumulation type where each channel's largest
# |value| is within 2^G of the sample's largest, wherever that largest lies in the range.
CHANNEL_GAPS = [(torch.float32, 31, (-32, -40, 0, 40)), (torch.float64, 255, (-256, -300, 0, 300))]


@pytest.mark.parametrize("device", DEVICES_SCALED_TRITON)
@pytest.mark.parametrize("dtype,gap,exponents", CHANNEL_GAPS)
@pytest.mark.parametrize("E", [None, 3])
def test_channels_of_different_magnitudes_at_the_promised_gap(device, dtype, gap, exponents, E):
    """A sample whose first two channels are at 2^e and the others 2^gap below, with random
    signs, beside an ordinary sample; e at the bottom of the unscaled window (2^-32 in
    float32), below it (scaled), ordinary and large. The small channels' products are the
    smallest normal numbers of the type: Z keeps its sign where sqrt_eps dominates (every
    output entry's sign as the long-double one's), and the gradients are exact."""
    for e in exponents:

        def features(channels, seed, e=e):
            t = make((2, channels, 3, 3), seed=seed)
            t[0, :2] = (t[0, :2].abs() + 0.5) * 2.0**e
            t[0, 2:] *= 2.0 ** (e - gap)
            return t.to(dtype).to(device).requires_grad_()

        x = features(6, 1)
        y = None if E is None else features(E + 2, 2)
        out = ops.bilinear_pool(x, y)
        g = make(out.shape, seed=3).to(dtype).to(device)
        exact = exact_bilinear_pool(x, y, g)
        rtol = 1e-5 if dtype == torch.float32 else 1e-12
        assert_close_per_sample(out, exact[0], rtol)
        got = out.detach().double().cpu().numpy()
        assert np.array_equal(np.sign(got), np.sign(exact[0].astype(np.float64))), e
        for actual, expected in zip(grads(ops.bilinear_pool, x, y, g), exact[1:], strict=True):
            assert_close_per_sample(actual, expected, 10 * rtol)


@pytest.mark.parametrize("device", DEVICES_SCALED_TRITON)
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e-30), (torch.float32, 1e30), (torch.float64, 1e-300)])
def test_tiny_products_keep_their_sign(device, dtype, scale):
    """Where Z underflows, its sign alone decides the output (±sqrt(sqrt_eps), normalised):
    random signs at tiny magnitude, and one huge and one tiny stream whose product is ordinary."""
    x = (make((2, 6, 3, 3), seed=1) * scale).to(dtype).to(device)
    y = (make((2, 4, 3, 3), seed=2) / scale).to(dtype).to(device)
    for a, b in [(x, None), (x, y)]:
        out = ops.bilinear_pool(a, b)
        g = torch.ones_like(out)
        exact = exact_bilinear_pool(a, b, g)
        assert_close_per_sample(out, exact[0], 1e-5 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("E", [None, 4])
def test_all_zero_input(device, E):
    """Z = 0 everywhere: the output and the gradient are 0 (not NaN), as the reference gives."""
    x = torch.zeros(2, 3, 2, 2, dtype=torch.float64, device=device, requires_grad=True)
    y = None if E is None else torch.zeros(2, E, 2, 2, dtype=torch.float64, device=device, requires_grad=True)
    out = ops.bilinear_pool(x, y)
    assert (out == 0).all()
    g = torch.randn_like(out)
    for actual, exp in zip(grads(ops.bilinear_pool, x, y, g), grads(reference.bilinear_pool, x, y, g), strict=False):
        assert torch.isfinite(actual).all()
        assert_close(actual, exp)


@pytest.mark.bad_input
@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("D,E", [(3, None), (5, 3), (16, 7), (9, None)])
def test_nan_stays_nan(device, dtype, D, E):
    """A NaN feature makes its sample's output NaN, as the reference's does, in the
    vectorised body and in the scalar tail of the signed sqrt alike; other samples keep theirs."""
    x = make((2, D, 3, 3), device=device).to(dtype)
    y = None if E is None else make((2, E, 3, 3), device=device, seed=1).to(dtype)
    x[0, -1, 1, 1] = float("nan")
    out = ops.bilinear_pool(x, y)
    ref = reference.bilinear_pool(x, y)
    assert out[0].isnan().all() and ref[0].isnan().all()
    assert not out[1].isnan().any()


@pytest.mark.parametrize("device", DEVICES_TRITON)
def test_exact_zeros_in_product(device):
    """Channels that never co-occur give Z_ij = 0 exactly: output and gradient 0 there."""
    x = make((2, 4, 3, 3), device=device)
    x[:, :2, :, :2] = 0
    x[:, 2:, :, 2:] = 0
    x.requires_grad_()
    out = ops.bilinear_pool(x)
    ref = reference.bilinear_pool(x)
    assert (out == 0).sum() == (ref == 0).sum() > 0
    g = torch.randn_like(out)
    assert_close(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x, g)[0])


@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("E", [None, 5])
@pytest.mark.parametrize("layout", ["channels_last", "strided"])
def test_memory_formats(device, E, layout):
    x, y = inputs((2, 6, 4, 3), E, torch.float64, device)
    if layout == "channels_last":
        xs = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
        ys = None if y is None else y.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    else:
        xs = make_noncontiguous(x.detach()).requires_grad_()
        ys = None if y is None else make_noncontiguous(y.detach()).requires_grad_()
    out = ops.bilinear_pool(xs, ys)
    assert_close(out, reference.bilinear_pool(x, y))
    g = torch.randn_like(out)
    got = grads(ops.bilinear_pool, xs, ys, g)
    for actual, exp in zip(got, grads(reference.bilinear_pool, x, y, g), strict=False):
        assert_close(actual, exp)
    if layout == "channels_last":
        assert got[0].is_contiguous(memory_format=torch.channels_last)


# The Triton kernels take the smallest of each case under the interpreter (gradcheck calls
# the op twice per input entry: ~0.3 s a call).
GRADCHECK = [((2, 3, 2, 3), None), ((2, 3, 2, 2), 2), ((1, 4, 1, 3), None)]
GRADCHECK_TRITON = [((1, 3, 1, 2), None), ((1, 2, 1, 2), 2)]


@pytest.mark.parametrize(
    "device,shape,E",
    [
        pytest.param(*d.values, *case, marks=d.marks, id=f"{d.id}-{i}")
        for devices, cases in ((DEVICES, GRADCHECK), (DEVICES_TRITON[2:], GRADCHECK_TRITON))
        for d in map(as_param, devices)
        for i, case in enumerate(cases)
    ],
)
def test_gradcheck(device, shape, E):
    x, y = inputs(shape, E, device=device)
    if y is None:
        check_gradcheck(lambda a: ops.bilinear_pool(a), (x,))
    else:
        check_gradcheck(lambda a, b: ops.bilinear_pool(a, b), (x, y))
    check_gradcheck(lambda a: ops.bilinear_pool(a, sqrt_eps=0.1, l2_eps=1e3), (x,))  # the clamped norm


@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(device, dtype):
    x, y = inputs((2, 4, 3, 3), 3, dtype, device)
    check_opcheck(OP, (x, None, 1e-5, 1e-12))
    check_opcheck(OP, (x, y, 1e-5, 1e-12))
    xc = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    check_opcheck(OP, (xc, None, 1e-5, 1e-12))
    out, norm = OP(x.detach(), y.detach(), 1e-5, 1e-12)
    g = torch.randn_like(out)
    check_opcheck(BACKWARD, (g, x.detach(), y.detach(), out, norm, 1e-5, 1e-12, [True, True]))
    check_opcheck(BACKWARD, (g, x.detach(), y.detach(), out, norm, 1e-5, 1e-12, [False, True]))
    out, norm = OP(xc.detach(), None, 1e-5, 1e-12)
    check_opcheck(BACKWARD, (torch.randn_like(out), xc.detach(), None, out, norm, 1e-5, 1e-12, [True, False]))


@pytest.mark.parametrize("device", DEVICES_TRITON)
def test_compile_dynamic(device):
    for N, H in ((2, 3), (3, 5)):
        x, y = inputs((N, 4, H, H), 3, torch.float32, device)
        check_compile(ops.bilinear_pool, x, y)
        check_compile(ops.bilinear_pool, x)


@pytest.mark.parametrize("E", [None, 16])
def test_saved_for_backward_is_inputs_output_and_norms(E):
    """What autograd keeps: x (and y), the output and N norms; the reference keeps N×D² more."""
    x, y = inputs((4, 32, 6, 6), E, torch.float32)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ops.bilinear_pool(x, y)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    allowed = x.nbytes + (0 if y is None else y.nbytes) + out.nbytes + 4 * 8 * x.shape[0]
    assert sum(storages.values()) <= allowed
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        reference.bilinear_pool(x, y)
    ref_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}.values())
    assert ref_bytes >= allowed + 2 * out.nbytes


def test_module():
    m = torchkit.nn.BilinearPool2d(sqrt_eps=1e-3)
    x, y = inputs((2, 4, 3, 3), 2)
    assert_close(m(x), ops.bilinear_pool(x, sqrt_eps=1e-3))
    assert_close(m(x, y), ops.bilinear_pool(x, y, sqrt_eps=1e-3))
    assert "sqrt_eps=0.001" in repr(m)


def test_module_output_dim():
    one = torchkit.nn.BilinearPool2d(in_channels=4)
    two = torchkit.nn.BilinearPool2d(in_channels=4, y_channels=2)
    assert one.output_dim == 16 and two.output_dim == 8 and "in_channels=4" in repr(one)
    x, y = inputs((2, 4, 3, 3), 2)
    assert one(x).shape == (2, one.output_dim) and two(x, y).shape == (2, two.output_dim)
    with pytest.raises(AttributeError, match=r"output_dim needs the channel count.*in_channels=D"):
        _ = torchkit.nn.BilinearPool2d().output_dim
    with pytest.raises(ValueError, match=r"built for \(x, y\) channels \(4, None\), got \(3, None\)"):
        one(x[:, :3])
    with pytest.raises(ValueError, match="in_channels must be a positive int"):
        torchkit.nn.BilinearPool2d(in_channels=0)


def test_autocast_runs_in_float32():
    x = make((2, 5, 3, 3)).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.bilinear_pool(x.bfloat16())
    assert out.dtype == torch.float32
    assert_close(out, ops.bilinear_pool(x.bfloat16().float()))


def test_reference_is_the_cookbook():
    x = make((2, 3, 4, 4))
    N, D, H, W = x.shape
    X = x.reshape(N, D, H * W)
    X = torch.bmm(X, X.transpose(1, 2)) / (H * W)
    X = X.reshape(N, D * D)
    X = torch.sign(X) * torch.sqrt(torch.abs(X) + 1e-5)
    assert_close(reference.bilinear_pool(x), F.normalize(X))


@settings(max_examples=30, deadline=None)
@given(
    N=st.integers(1, 3),
    D=st.integers(1, 20),
    E=st.one_of(st.none(), st.integers(1, 20)),
    H=st.integers(1, 5),
    W=st.integers(1, 5),
    sqrt_eps=st.sampled_from([0.0, 1e-5, 1.0]),
    channels_last=st.booleans(),
)
def test_hypothesis(N, D, E, H, W, sqrt_eps, channels_last):
    x, y = inputs((N, D, H, W), E)
    if channels_last:
        x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    out = ops.bilinear_pool(x, y, sqrt_eps=sqrt_eps)
    ref = reference.bilinear_pool(x, y, sqrt_eps=sqrt_eps)
    assert_close(out, ref)
    g = torch.randn_like(out)
    for actual, exp in zip(
        grads(lambda a, b: ops.bilinear_pool(a, b, sqrt_eps=sqrt_eps), x, y, g),
        grads(lambda a, b: reference.bilinear_pool(a, b, sqrt_eps=sqrt_eps), x, y, g),
        strict=False,
    ):
        # sqrt_eps = 0 makes the gradient unbounded near Z = 0: compare relative to its size.
        assert_close(actual, exp, rtol=1e-7, atol=1e-9 * max(1.0, exp.abs().max().item()))


x4 = make((2, 3, 4, 4))
BAD = [
    (
        lambda: ops.bilinear_pool(make((3, 4, 4))),
        ValueError,
        r"x must be a 4-D feature map \(N, D, H, W\), got shape \[3, 4, 4\]",
    ),
    (lambda: ops.bilinear_pool(x4, make((3, 2, 4, 4))), ValueError, r"y must be \(N, E, H, W\) with x's N, H and W"),
    (lambda: ops.bilinear_pool(x4, make((2, 2, 4, 5))), ValueError, r"y must be \(N, E, H, W\) with x's N, H and W"),
    (lambda: ops.bilinear_pool(x4, make((2, 2, 4, 4), torch.float32)), TypeError, r"x and y must have the same dtype"),
    (lambda: ops.bilinear_pool(x4.long()), TypeError, r"x must be float32, float64, float16 or bfloat16, got Long"),
    (lambda: ops.bilinear_pool(x4.bool()), TypeError, r"x must be float32"),
    (lambda: ops.bilinear_pool(x4.to(torch.complex64)), TypeError, r"x must be float32"),
    (lambda: ops.bilinear_pool(x4, sqrt_eps=-1e-5), ValueError, r"sqrt_eps must be finite and >= 0, got -1e-05"),
    (lambda: ops.bilinear_pool(x4, sqrt_eps=float("inf")), ValueError, r"sqrt_eps must be finite and >= 0, got inf"),
    (lambda: ops.bilinear_pool(x4, sqrt_eps=float("nan")), ValueError, r"sqrt_eps must be finite and >= 0, got nan"),
    (lambda: ops.bilinear_pool(x4, l2_eps=-1.0), ValueError, r"l2_eps must be finite and >= 0, got -1"),
    (lambda: ops.bilinear_pool(x4, l2_eps=float("inf")), ValueError, r"l2_eps must be finite and >= 0, got inf"),
    (lambda: ops.bilinear_pool(make((2, 3, 0, 4))), ValueError, r"at least one spatial position \(H·W > 0\)"),
]


@pytest.mark.bad_input
@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.bad_input
@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input_under_compile(monkeypatch, call, exc, match):
    check_compiled_refuses_like_eager(monkeypatch, ["bilinear_pool"], call)


@pytest.mark.bad_input
@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input_on_meta_tensors(monkeypatch, call, exc, match):
    """The fake kernel refuses what the kernel refuses: it checked only devices, and returned
    a shape for a 3-D input or a y of another N, H·W or dtype."""
    check_meta_refuses_like_eager(monkeypatch, "bilinear_pool", call)


@pytest.mark.bad_input
@pytest.mark.cuda
def test_device_mismatch():
    with pytest.raises(ValueError, match="x and y must be on the same device"):
        ops.bilinear_pool(x4.cuda(), x4)


@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("E", [None, 5])
def test_broadcast_upstream_gradient(device, dtype, E, request):
    """out.sum() hands backward an expanded gradient (all strides 0), read without a copy."""
    x, y = (t.detach() if t is not None else None for t in inputs((2, 70, 3, 3), E, dtype, device))
    out, norm = OP(x, y, 1e-5, 1e-12)
    g = torch.full((), 0.7, dtype=dtype, device=device).expand_as(out)
    assert all(s == 0 for s in g.stride())
    mask = [True, y is not None]
    got = BACKWARD(g, x, y, out, norm, 1e-5, 1e-12, mask)
    expected = BACKWARD(g.contiguous(), x, y, out, norm, 1e-5, 1e-12, mask)
    # The same bits, except from compiled Triton kernels: Triton specialises a kernel on its
    # strides (0 and 1 here), and the two compilations may sum a sample's products in another
    # order (on an H200: 1 ulp apart in 45 of 1,260 float32 entries).
    eps = 8 * torch.finfo(dtype).eps if device == "cuda" and request.node.get_closest_marker("triton") else 0
    for a, b in zip(got, expected, strict=False):
        torch.testing.assert_close(a, b, rtol=eps, atol=eps * b.abs().max().item() if eps and b.numel() else 0)


@pytest.mark.bad_input
def test_backward_checks_its_inputs():
    x = make((2, 3, 2, 2))
    out, norm = OP(x, None, 1e-5, 1e-12)
    with pytest.raises(ValueError, match=r"backward: grad and out must have the output's shape \[2, 9\]"):
        BACKWARD(torch.ones(2, 8, dtype=x.dtype), x, None, out, norm, 1e-5, 1e-12, [True, False])
    with pytest.raises(ValueError, match=r"backward: norm must be \(N,\) = \(2,\) of Double"):
        BACKWARD(torch.ones_like(out), x, None, out, norm.float(), 1e-5, 1e-12, [True, False])


@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_backward_reads_norm_by_its_strides(layout):
    # Three equal samples, so that one norm expanded to all three is the right norm too.
    x = make((1, 4, 2, 2)).expand(3, -1, -1, -1).contiguous()
    out, norm = OP(x, None, 1e-5, 1e-12)
    grad = torch.randn_like(out)
    odd = {
        "strided": torch.stack([norm, torch.full_like(norm, 1e6)], 1)[:, 0],  # every other element
        "expanded": norm[:1].expand(3),
    }[layout]
    assert not odd.is_contiguous()
    expected = BACKWARD(grad, x, None, out, norm, 1e-5, 1e-12, [True, False])
    actual = BACKWARD(grad, x, None, out, odd, 1e-5, 1e-12, [True, False])
    torch.testing.assert_close(actual, expected)


@pytest.mark.bad_input
@pytest.mark.parametrize("device_of", ["y", "grad", "norm"])
def test_meta_tensor_mixed_in_is_a_device_error(device_of):
    x = make((2, 3, 2, 2))
    y = make((2, 3, 2, 2), seed=1)
    out, norm = OP(x, y, 1e-5, 1e-12)
    args = dict(y=y, grad=torch.ones_like(out), norm=norm)
    args[device_of] = args[device_of].to("meta")
    with pytest.raises(
        ValueError, match=rf"bilinear_pool: x and {device_of} must be on the same device, got cpu and meta"
    ):
        if device_of == "y":
            OP(x, args["y"], 1e-5, 1e-12)
        else:
            BACKWARD(args["grad"], x, args["y"], out, args["norm"], 1e-5, 1e-12, [True, True])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape,E", [((3, 130, 5, 6), None), ((2, 33, 7, 7), 17), ((2, 64, 9, 9), None)])
def test_cuda_matches_cpu(dtype, shape, E):
    x = make(shape, dtype, relu=True)
    y = None if E is None else make((shape[0], E, *shape[2:]), dtype, seed=1, relu=True)
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-6, rtol=1e-4)
    check_cuda_matches_cpu(lambda a, b: ops.bilinear_pool(a, b), x, y, **tol)
