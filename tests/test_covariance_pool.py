"""torchkit.ops.covariance_pool against its reference (torchkit.reference), a layer with
fast-MPN-COV's structure (tests/mpncov_peer.py), and the true matrix square root."""

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpncov_peer import mpncov
from testing import (
    DEVICES,
    REDUCED_DTYPES,
    assert_close,
    assert_close_reduced,
    assert_close_to_exact,
    check_compile,
    check_compiled_refuses_like_eager,
    check_cuda_matches_cpu,
    check_gradcheck,
    check_meta_refuses_like_eager,
    check_opcheck,
    make_noncontiguous,
)

import torchkit
from torchkit import ops, reference

OP = torch.ops.torchkit.covariance_pool.default
BACKWARD = torch.ops.torchkit._covariance_pool_backward.default


def make(shape, dtype=torch.float64, device="cpu", seed=0, relu=True):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    return (t.relu() if relu else t).to(dtype).to(device)


def value_and_grad(fn, x, g=None, **kw):
    x = x.detach().requires_grad_()
    out = fn(x, **kw)
    g = torch.randn_like(out) if g is None else g
    return out, torch.autograd.grad(out, x, g)[0], g


def assert_matches(fn, expected_fn, x, rtol=1e-10, **kw):
    """Output and gradient of fn agree with expected_fn's, relative to their largest entries."""
    out, grad, g = value_and_grad(fn, x, **kw)
    exp_out, exp_grad, _ = value_and_grad(expected_fn, x, g, **kw)
    assert out.shape == exp_out.shape and out.dtype == exp_out.dtype
    for a, b in ((out, exp_out), (grad, exp_grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=rtol * max(b.abs().max().item(), 1e-300))


# D from 1 to 130 (crossing 128: the CPU kernel's tile width and the threshold of its
# spectral backward), 3-D and 4-D inputs.
SHAPES = [(2, 1, 3, 3), (3, 2, 2, 2), (2, 5, 3, 4), (2, 17, 5), (2, 70, 4, 4), (2, 130, 3, 5)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "iterations,sqrt,triu",
    [(n, True, triu) for n in (1, 2, 3, 5, 7) for triu in (True, False)] + [(1, False, True), (1, False, False)],
)
def test_matches_reference(device, shape, iterations, sqrt, triu):
    x = make(shape, device=device)
    assert_matches(ops.covariance_pool, reference.covariance_pool, x, iterations=iterations, sqrt=sqrt, triu=triu)


@settings(max_examples=40, deadline=None)
@given(
    N=st.integers(1, 3),
    D=st.integers(1, 80),
    spatial=st.sampled_from([(1, 2), (2, 3), (5,), (3, 3)]),
    iterations=st.integers(1, 7),
    sqrt=st.booleans(),
    triu=st.booleans(),
    channels_last=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_hypothesis(N, D, spatial, iterations, sqrt, triu, channels_last, seed):
    x = make((N, D, *spatial), seed=seed, relu=seed % 2 == 0)
    if channels_last and x.dim() == 4:
        x = x.to(memory_format=torch.channels_last)
    assert_matches(
        ops.covariance_pool, reference.covariance_pool, x, rtol=1e-9, iterations=iterations, sqrt=sqrt, triu=triu
    )


@pytest.mark.parametrize("shape", [(2, 5, 3, 4), (2, 70, 4, 4), (2, 130, 3, 5)])
@pytest.mark.parametrize("iterations", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("sqrt,triu", [(True, True), (True, False), (False, True)])
def test_matches_fast_mpn_cov_structure(shape, iterations, sqrt, triu):
    if not sqrt and iterations > 1:
        return  # iterations only apply to the square root
    assert_matches(ops.covariance_pool, mpncov, make(shape), iterations=iterations, sqrt=sqrt, triu=triu)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 512, 4, 4), (2, 256, 7, 7)])
def test_large_d_matches_reference(shape):
    assert_matches(ops.covariance_pool, reference.covariance_pool, make(shape), rtol=1e-9)


@pytest.mark.parametrize("iterations", [3, 5])
def test_channels_last_and_non_contiguous(iterations):
    x = make((2, 70, 5, 6))
    cl = x.to(memory_format=torch.channels_last)
    out, grad, g = value_and_grad(ops.covariance_pool, cl, iterations=iterations)
    assert grad.is_contiguous(memory_format=torch.channels_last)
    exp_out, exp_grad, _ = value_and_grad(reference.covariance_pool, x, g, iterations=iterations)
    assert_close(out, exp_out)
    assert_close(grad, exp_grad)
    nc = make_noncontiguous(x)
    assert_matches(ops.covariance_pool, reference.covariance_pool, nc, iterations=iterations)
    three_d = x.flatten(2).transpose(1, 2).contiguous().transpose(1, 2)  # (N, D, M) view of (N, M, D)
    assert_matches(ops.covariance_pool, reference.covariance_pool, three_d, iterations=iterations)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_within_1e_5_of_float64(device):
    for shape in [(4, 256, 14, 14), (2, 64, 28, 28)]:
        x = make(shape, torch.float32, device)
        out, grad, g = value_and_grad(ops.covariance_pool, x)
        exp_out, exp_grad, _ = value_and_grad(reference.covariance_pool, x.double(), g.double())
        assert ((out.double() - exp_out).norm() / exp_out.norm()).item() < 1e-5
        assert ((out.double() - exp_out).abs().max() / exp_out.abs().max()).item() < 1e-5
        assert ((grad.double() - exp_grad).norm() / exp_grad.norm()).item() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", REDUCED_DTYPES)
def test_reduced_precision(device, dtype):
    x = make((2, 40, 6, 6), dtype, device)
    out = ops.covariance_pool(x)
    assert out.dtype == dtype
    baseline = reference.covariance_pool(x.float()).to(dtype)  # the float32 composition, rounded
    assert_close_reduced(out, baseline, reference.covariance_pool(x.double()))
    x.requires_grad_()
    ops.covariance_pool(x).sum().backward()
    assert x.grad.dtype == dtype and x.grad.isfinite().all()


def test_approaches_the_true_square_root():
    """On a well-conditioned Σ, more iterations converge to eigh's square root."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 12, 400, generator=g, dtype=torch.float64)  # Σ ≈ I: condition ~1.5
    xc = x - x.mean(2, keepdim=True)
    sigma = xc @ xc.mT / x.shape[2]
    w, v = torch.linalg.eigh(sigma)
    root = v @ torch.diag_embed(w.sqrt()) @ v.mT
    errors = [
        (ops.covariance_pool(x, iterations=n, triu=False) - root).norm().item() / root.norm().item()
        for n in (1, 3, 5, 7, 9)
    ]
    assert errors == sorted(errors, reverse=True), errors
    assert errors[-1] < 1e-12, errors


def test_zero_trace_is_zero_with_a_finite_gradient():
    x = torch.ones(3, 4, 3, 3, dtype=torch.float64)
    x[1] = make((4, 3, 3))  # one ordinary sample between two constant ones
    for sqrt in (True, False):
        out, grad, _ = value_and_grad(ops.covariance_pool, x, sqrt=sqrt)
        assert (out[0] == 0).all() and (out[2] == 0).all() and out[1].abs().max() > 0
        assert grad.isfinite().all() and (grad[0] == 0).all() and (grad[2] == 0).all()
    assert_matches(ops.covariance_pool, reference.covariance_pool, x)
    single_position = make((2, 5, 1, 1))  # M = 1: every Σ is 0
    assert (ops.covariance_pool(single_position) == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channels_last", [False, True])
def test_constant_samples_and_channels_at_any_magnitude(device, dtype, channels_last):
    """A constant sample gives output 0 and gradient 0 at every magnitude, and a constant
    channel beside ordinary ones has covariances exactly 0: its mean must be exact. A float64
    mean summed from the values rounds (0.1 over 35 positions comes out 1e-17 off, a non-zero
    covariance and gradient) or overflows (a constant 1e300)."""
    big = torch.finfo(dtype).max / 4
    tiny = torch.finfo(dtype).tiny * 3
    for c in (0.1, -7.3, 1 / 3, big, -big, tiny, 12345.678):
        x = torch.full((3, 4, 5, 7), c, dtype=dtype)
        x[1] = make((4, 5, 7), dtype, relu=False)  # an ordinary sample between constant ones
        x[1, 2] = c  # with a constant channel
        x = x.to(device)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        for sqrt in (True, False):
            out, grad, _ = value_and_grad(ops.covariance_pool, x, sqrt=sqrt, triu=False)
            assert (out[0] == 0).all() and (out[2] == 0).all(), (c, sqrt)
            assert (grad[0] == 0).all() and (grad[2] == 0).all(), (c, sqrt)
            assert out[1].isfinite().all() and grad[1].isfinite().all(), (c, sqrt)
            if not sqrt:
                assert (out[1, 2] == 0).all() and (out[1, :, 2] == 0).all(), c


# The promise for channels of different magnitude in one sample (docs/ops.md): every
# covariance of two channels is a normal number in the sample's scaled units where each
# channel's largest deviation is within 2^G of the sample's largest (up to 2^20 positions).
CHANNEL_GAPS = [(torch.float32, 53, (-20, 0, 30)), (torch.float64, 500, (-10, 0, 300))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,gap,exponents", CHANNEL_GAPS)
def test_channels_of_different_magnitudes_at_the_promised_gap(device, dtype, gap, exponents):
    """sqrt=False: a sample whose first two channels deviate by 2^e and the others 2^gap
    less: every covariance within the dtype's tolerance of the long-double one (rounded to
    the dtype: the smallest are subnormal or 0 in float32 at e = -20), the small channels'
    variances included; the gradient per sample."""
    for e in exponents:
        x = make((2, 5, 4, 4), relu=False)
        x[0, :2] *= 2.0**e
        x[0, 2:] *= 2.0 ** (e - gap)
        x = x.to(dtype).to(device)
        out, grad, g = value_and_grad(ops.covariance_pool, x, sqrt=False, triu=False)
        a = x.double().cpu().numpy().astype(np.longdouble).reshape(2, 5, 16)
        xc = a - a.mean(-1, keepdims=True)
        sigma = xc @ xc.transpose(0, 2, 1) / 16
        G = g.double().cpu().numpy().astype(np.longdouble)
        exact_grad = ((G + G.transpose(0, 2, 1)) @ xc / 16).reshape(x.shape)
        rtol = 1e-5 if dtype == torch.float32 else 1e-12
        assert_close_to_exact(out.detach(), sigma, rtol)
        assert (out[0, 2:, 2:].diagonal(0, -2, -1) > 0).all(), e  # the small variances are not lost
        err = np.abs(grad.double().cpu().numpy().astype(np.longdouble) - exact_grad).reshape(2, -1).max(1)
        assert np.all(err <= 10 * rtol * np.abs(exact_grad).reshape(2, -1).max(1)), e


@pytest.mark.parametrize("iterations", [1, 3, 5])
def test_rank_deficient(iterations):
    """M < D, and repeated channels: Σ has many zero and repeated eigenvalues (the CPU's
    spectral backward at D = 160, its adjoint chain at 40)."""
    x = make((2, 160, 2, 3))  # rank ≤ 5 of 160
    x[:, 80:] = x[:, :80]
    small = x[:, :40].clone()
    assert_matches(ops.covariance_pool, reference.covariance_pool, small, iterations=iterations, rtol=1e-9)
    assert_matches(ops.covariance_pool, reference.covariance_pool, x, iterations=iterations, rtol=1e-9)
    assert_matches(ops.covariance_pool, mpncov, x, iterations=iterations, rtol=1e-9)


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e20, 1e30])
def test_exact_for_any_magnitude(scale):
    """float32 Σ over- or underflows past ~1e±19; each sample is scaled by a power of two."""
    x = make((2, 6, 4, 4), relu=False) * scale + 3 * scale
    x32 = x.float()
    out, grad, g = value_and_grad(ops.covariance_pool, x32)
    exp_out, exp_grad, _ = value_and_grad(reference.covariance_pool, x32.double(), g.double())
    assert ((out.double() - exp_out).abs().max() / exp_out.abs().max()).item() < 1e-5
    assert ((grad.double() - exp_grad).abs().max() / exp_grad.abs().max()).item() < 1e-4


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_far_from_origin(offset, channels_last):
    """offset + N(0, 1) float32 features: the mean is subtracted in float64 before anything is
    rounded, so Σ stays exact (a mean rounded to float32 first shifts every value by up to
    0.03 at 1e6, an error of ~1e-3 in Σ)."""
    x = (offset + make((2, 30, 5, 5), relu=False)).float()
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    out, grad, g = value_and_grad(ops.covariance_pool, x)
    exp, exp_grad, _ = value_and_grad(reference.covariance_pool, x.double(), g.double())
    assert ((out.double() - exp).abs().max() / exp.abs().max()).item() < 1e-5
    assert ((grad.double() - exp_grad).abs().max() / exp_grad.abs().max()).item() < 1e-4


@pytest.mark.bad_input
@pytest.mark.parametrize("dtype,exponent", [(torch.float32, 64), (torch.float64, 512)])
@pytest.mark.parametrize("nan_channel", [False, True])
def test_plain_covariance_near_the_overflow(dtype, exponent, nan_channel):
    """sqrt=False with one feature spiking past sqrt(max) of the dtype at one position: the
    per-sample scale's square overflows, yet every covariance entry is representable (the
    spike is averaged over the positions). Oracle: the reference on the input divided by a
    power of two, in float64, multiplied back one power at a time; gradients likewise
    (d out / dx = 2^e d out / dy at y = x / 2^e). With a NaN in another channel of the
    spiking sample, only that channel's covariances are NaN: it has no say in the scale."""
    x = make((2, 3, 4, 4), relu=False).to(dtype)
    x[0, 0, 0, 0] = 1.5 * 2.0**exponent
    x[1, 2] = 7.0  # a constant channel: its covariances are 0, never 0 * inf = NaN
    if nan_channel:
        x[0, 1, 2, 3] = float("nan")
    out, grad, g = value_and_grad(ops.covariance_pool, x, sqrt=False)
    y = x.double() / 2.0**exponent
    exp_y, grad_y, _ = value_and_grad(reference.covariance_pool, y, g.double(), sqrt=False)
    expected = exp_y * 2.0**exponent * 2.0**exponent
    assert expected.nan_to_num().abs().max() > torch.finfo(dtype).max / 16  # the test is near the overflow
    assert out.isnan().sum() == expected.isnan().sum() == (3 if nan_channel else 0)
    assert (out.isfinite() | out.isnan()).all()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=0, equal_nan=True)
    finite = slice(1, 2) if nan_channel else slice(0, 2)  # a NaN channel's sample: NaN gradients
    assert grad[finite].isfinite().all()
    torch.testing.assert_close(
        grad[finite].double(), (grad_y * 2.0**exponent)[finite], rtol=1e-4, atol=1e-6 * grad[finite].abs().max().item()
    )


@pytest.mark.bad_input
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_poisons_its_sample_only(value):
    x = make((3, 130, 3, 3))
    x[1, 5, 1, 1] = value
    x.requires_grad_()
    out = ops.covariance_pool(x)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()
    out[[0, 2]].sum().backward()
    assert x.grad[[0, 2]].isfinite().all()


def test_empty():
    for shape, out_shape in [((0, 4, 3, 3), (0, 10)), ((2, 0, 3, 3), (2, 0))]:
        x = torch.zeros(shape, requires_grad=True)
        out = ops.covariance_pool(x)
        assert out.shape == out_shape
        out.sum().backward()
        assert x.grad.shape == x.shape


@pytest.mark.parametrize("sqrt,triu", [(True, True), (False, False)])
def test_gradcheck(sqrt, triu):
    # The D = 129 case (the CPU's spectral backward) in fast mode: its Jacobian has 8,385 rows.
    for shape, iterations, fast in [((2, 3, 2, 3), 1, False), ((2, 4, 3, 3), 3, False), ((1, 129, 2, 1), 3, True)]:
        x = make(shape).requires_grad_()
        check_gradcheck(
            functools.partial(ops.covariance_pool, iterations=iterations, sqrt=sqrt, triu=triu), (x,), fast_mode=fast
        )


@pytest.mark.parametrize("sqrt,triu", [(True, True), (True, False), (False, True)])
def test_opcheck(sqrt, triu):
    for x in (make((2, 4, 3, 3)), make((2, 70, 2, 2)).to(memory_format=torch.channels_last), make((2, 5, 6))):
        check_opcheck(OP, (x.requires_grad_(), 3, sqrt, triu))
        out, sigma, scale = OP(x.detach(), 3, sqrt, triu)
        check_opcheck(BACKWARD, (torch.randn_like(out), x.detach(), sigma, scale, 3, sqrt, triu))


def test_compile():
    for shape in [(2, 5, 3, 4), (3, 7, 2, 2)]:  # two shapes: dynamic, no recompile per shape
        check_compile(lambda a: ops.covariance_pool(a, iterations=3), make(shape).requires_grad_())


def test_saved_tensors_are_x_one_matrix_and_one_scale_per_sample():
    x = make((2, 6, 5, 5), torch.float32).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ops.covariance_pool(x)
    assert sorted(tuple(t.shape) for t in saved) == [(2,), (2, 6, 5, 5), (2, 6, 6)]


def test_autocast():
    x = make((2, 5, 3, 3), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.covariance_pool(x.bfloat16())
    assert out.dtype == torch.float32


def test_module():
    m = torchkit.nn.CovariancePool2d(iterations=3, in_channels=5)
    assert m.output_dim == 15
    assert torchkit.nn.CovariancePool2d(triu=False, in_channels=5).output_dim == 25
    x = make((2, 5, 3, 3))
    torch.testing.assert_close(m(x), ops.covariance_pool(x, iterations=3))
    assert "iterations=3, sqrt=True, triu=True, in_channels=5" in repr(m)
    with pytest.raises(ValueError, match=r"CovariancePool2d: built for 5 channels, got x of shape \(2, 4, 3, 3\)"):
        m(make((2, 4, 3, 3)))
    with pytest.raises(AttributeError, match=r"output_dim needs the channel count"):
        _ = torchkit.nn.CovariancePool2d().output_dim
    with pytest.raises(ValueError, match=r"iterations must be an int between 1 and 100, got 0"):
        torchkit.nn.CovariancePool2d(iterations=0)


x4 = make((2, 3, 4, 4))
BAD = [
    (
        lambda: ops.covariance_pool(make((3, 4))),
        ValueError,
        r"x must be a feature map \(N, D, H, W\) or \(N, D, M\), got shape \[3, 4\]",
    ),
    (
        lambda: ops.covariance_pool(make((1, 2, 3, 4, 5))),
        ValueError,
        r"x must be a feature map .* got shape \[1, 2, 3, 4, 5\]",
    ),
    (lambda: ops.covariance_pool(x4.long()), TypeError, r"x must be float32, float64, float16 or bfloat16, got Long"),
    (lambda: ops.covariance_pool(x4.to(torch.complex64)), TypeError, r"x must be float32"),
    (lambda: ops.covariance_pool(x4, iterations=0), ValueError, r"iterations must be between 1 and 100, got 0"),
    (lambda: OP(x4, -3, True, True), ValueError, r"iterations must be between 1 and 100, got -3"),
    (lambda: OP(x4, 2**40, True, True), ValueError, r"iterations must be between 1 and 100, got 1099511627776"),
    (lambda: ops.covariance_pool(x4, iterations=2.0), TypeError, r"iterations must be an int, got float 2.0"),
    (lambda: ops.covariance_pool(x4, sqrt=1), TypeError, r"sqrt must be a bool, got int 1"),
    (lambda: ops.covariance_pool(x4, sqrt=None), TypeError, r"sqrt must be a bool, got NoneType None"),
    (lambda: ops.covariance_pool(x4, triu=None), TypeError, r"triu must be a bool, got NoneType None"),
    (lambda: ops.covariance_pool(x4, iterations=True), TypeError, r"iterations must be an int, got bool True"),
    (lambda: ops.covariance_pool(make((2, 3, 0, 4))), ValueError, r"at least one spatial position \(H·W > 0\)"),
    (
        lambda: ops.covariance_pool(torch.zeros(1, 1, 1).expand(1, 2**32, 1)),
        ValueError,
        r"N·D·D \(the covariances' size\) must fit int64 indexing, got N = 1, D = 4294967296",
    ),
    (
        lambda: ops.covariance_pool(torch.zeros(1, 1, 1).expand(2**31, 2**16, 1)),
        ValueError,
        r"must fit int64 indexing, got N = 2147483648, D = 65536",
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
    check_compiled_refuses_like_eager(monkeypatch, ["covariance_pool"], call)


@pytest.mark.bad_input
@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input_on_meta_tensors(monkeypatch, call, exc, match):
    check_meta_refuses_like_eager(monkeypatch, "covariance_pool", call)


@pytest.mark.bad_input
def test_backward_checks_its_inputs():
    x = make((2, 3, 2, 2))
    out, sigma, scale = OP(x, 3, True, True)
    g = torch.ones_like(out)
    with pytest.raises(ValueError, match=r"backward: grad must have the output's shape \[2, 6\], got \[2, 5\]"):
        BACKWARD(torch.ones(2, 5, dtype=x.dtype), x, sigma, scale, 3, True, True)
    with pytest.raises(ValueError, match=r"backward: sigma must be \(N, D, D\) = \(2, 3, 3\) of Double"):
        BACKWARD(g, x, sigma.float(), scale, 3, True, True)
    with pytest.raises(ValueError, match=r"backward: sigma must be"):
        BACKWARD(g, x, sigma[:, :2], scale, 3, True, True)
    with pytest.raises(ValueError, match=r"backward: scale must be \(N,\) = \(2,\) of Double"):
        BACKWARD(g, x, sigma, scale[:1], 3, True, True)
    with pytest.raises(TypeError, match=r"x and grad must have the same dtype"):
        BACKWARD(g.float(), x, sigma, scale, 3, True, True)


@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_backward_reads_sigma_and_scale_by_their_strides(layout):
    # Three equal samples, so that one sample's sigma and scale expanded to all three are right too.
    x = make((1, 130, 3, 3)).expand(3, -1, -1, -1).contiguous()
    out, sigma, scale = OP(x, 3, True, True)
    grad = torch.randn_like(out)
    expected = BACKWARD(grad, x, sigma, scale, 3, True, True)
    odd = {
        "strided": (torch.stack([sigma, sigma + 1], 1)[:, 0], torch.stack([scale, scale * 64], 1)[:, 0]),
        "expanded": (sigma[:1].expand(3, -1, -1), scale[:1].expand(3)),
    }[layout]
    assert not odd[0].is_contiguous() and not odd[1].is_contiguous()
    torch.testing.assert_close(BACKWARD(grad, x, *odd, 3, True, True), expected)


@pytest.mark.bad_input
@pytest.mark.parametrize("device_of", ["grad", "sigma", "scale"])
def test_meta_tensor_mixed_in_is_a_device_error(device_of):
    x = make((2, 3, 2, 2))
    out, sigma, scale = OP(x, 3, True, True)
    args = dict(grad=torch.ones_like(out), sigma=sigma, scale=scale)
    args[device_of] = args[device_of].to("meta")
    with pytest.raises(
        ValueError, match=rf"covariance_pool: x and {device_of} must be on the same device, got cpu and meta"
    ):
        BACKWARD(args["grad"], x, args["sigma"], args["scale"], 3, True, True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape,iterations", [((3, 130, 5, 6), 5), ((2, 33, 7, 7), 1), ((2, 64, 9, 9), 3)])
def test_cuda_matches_cpu(dtype, shape, iterations):
    x = make(shape, dtype)
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-5, rtol=1e-4)
    check_cuda_matches_cpu(lambda a: ops.covariance_pool(a, iterations=iterations), x, **tol)


def test_integral_iterations():
    """iterations as any integral number, as PyTorch's own functions take it."""
    np = pytest.importorskip("numpy")
    expected = ops.covariance_pool(x4, iterations=3)
    for iterations in (np.int64(3), torch.tensor(3)):
        torch.testing.assert_close(ops.covariance_pool(x4, iterations=iterations), expected, rtol=0, atol=0)
