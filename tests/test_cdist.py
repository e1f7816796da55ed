"""torchkit.ops.cdist against float64 ground truth, torch.cdist's exact mode and the reference."""

import math

import numpy as np
import pytest
import torch
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
    assert_close_to_exact,
    check_compile,
    check_compiled_refuses_like_eager,
    check_cuda_matches_cpu,
    check_gradcheck,
    check_meta_refuses_like_eager,
    check_opcheck,
    exact_squared_distances,
    extreme_points,
    make_noncontiguous,
    spanning_points,
    spanning_points_with_nonfinite_rows,
    subnormal_points,
    with_triton,
)

import torchkit
from torchkit import ops, reference

OP = torch.ops.torchkit.cdist.default
BACKWARD = torch.ops.torchkit._cdist_backward.default
EXACT = "donot_use_mm_for_euclid_dist"

# (x1 shape, x2 shape): plain, batched, broadcast batches, odd sizes, vector-width tails.
SHAPES = [
    ((5, 3), (7, 3)),
    ((33, 17), (65, 17)),
    ((1, 1), (1, 1)),
    ((2, 9, 4), (2, 11, 4)),
    ((3, 1, 6, 5), (4, 8, 5)),  # batch (3, 1) with (4,) → (3, 4)
    ((1, 6, 5), (2, 3, 4, 5)),
]

DEVICES_TRITON = with_triton("cdist")


DEVICES_SCALED_TRITON = with_triton("cdist", DEVICES_SCALED)


def ground_truth(x1, x2=None, squared=False):
    """float64 distances by the difference formula (torch.cdist's exact mode)."""
    x2 = x1 if x2 is None else x2
    d = torch.cdist(x1.double(), x2.double(), compute_mode=EXACT)
    return d.square() if squared else d


def max_rel_error(actual, truth, floor=1e-3):
    """Largest relative error over entries not negligible against the largest distance."""
    keep = truth > floor * truth.max()
    return ((actual.double() - truth).abs() / truth)[keep].max().item()


def make(shape, dtype=torch.float64, device="cpu", seed=0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (offset + torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("squared", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
def test_matches_exact_cdist(device, dtype, shapes, squared, contiguous):
    x1 = make(shapes[0], dtype, device, seed=1)
    x2 = make(shapes[1], dtype, device, seed=2)
    if not contiguous:
        x1, x2 = make_noncontiguous(x1), make_noncontiguous(x2)
    out = ops.cdist(x1, x2, squared=squared)
    expected = torch.cdist(x1, x2, compute_mode=EXACT)
    expected = expected.square() if squared else expected
    assert out.dtype == dtype and out.shape == expected.shape
    assert_close(out, expected)
    assert max_rel_error(out, ground_truth(x1, x2, squared)) < (2e-5 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("dtype", REDUCED_DTYPES)
@pytest.mark.parametrize("shapes", SHAPES[:4])
def test_reduced_precision(device, dtype, shapes):
    x1 = make(shapes[0], dtype, device, seed=1).requires_grad_()
    x2 = make(shapes[1], dtype, device, seed=2).requires_grad_()
    out = ops.cdist(x1, x2)
    assert out.dtype == dtype
    # Baseline: the reference evaluated in float32 on the same (rounded) inputs, rounded back.
    baseline = reference.cdist(x1.float(), x2.float()).to(dtype)
    assert_close_reduced(out, baseline, ground_truth(x1, x2))
    g = torch.rand_like(out)
    grads = torch.autograd.grad(out, (x1, x2), g)
    a, b = x1.detach().double().requires_grad_(), x2.detach().double().requires_grad_()
    grads64 = torch.autograd.grad(reference.cdist(a, b), (a, b), g.double())
    a32, b32 = x1.detach().float().requires_grad_(), x2.detach().float().requires_grad_()
    base = torch.autograd.grad(reference.cdist(a32, b32), (a32, b32), g.float())
    for actual, b_, r in zip(grads, base, grads64, strict=False):
        assert actual.dtype == dtype
        assert_close_reduced(actual, b_.to(dtype), r)


# Not through the Triton kernels: 2048 × 512 × 128 takes the interpreter half a minute.
@pytest.mark.parametrize("device", DEVICES)
def test_far_from_origin(device):
    """The case torch.cdist's default mode gets wrong (PyTorch #42479): 1000 + N(0, 1)."""
    x = make((2048, 128), torch.float32, device, offset=1000.0).requires_grad_()
    y = make((512, 128), torch.float32, device, seed=3, offset=1000.0).requires_grad_()
    truth = ground_truth(x, y)
    out = ops.cdist(x, y)
    assert max_rel_error(out, truth) < 2e-5
    assert max_rel_error(torch.cdist(x, y), truth) > 1e-2  # the failure this op exists to fix
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, y), g)
    a, b = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    grads64 = torch.autograd.grad(reference.cdist(a, b), (a, b), g.double())
    for actual, expected in zip(grads, grads64, strict=False):
        assert (actual.double() - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("device", DEVICES_TRITON)
def test_near_duplicates_far_from_centre(device):
    """Tight clusters far apart: centring cannot help inside a cluster; the epilogue's direct
    recomputation must, down to distances of 1e-4 between points at distance ~1e3."""
    g = torch.Generator().manual_seed(4)
    centres = 1000 * torch.randn(4, 64, generator=g, dtype=torch.float64)
    x = centres.repeat_interleave(50, 0) + 1e-4 * torch.randn(200, 64, generator=g, dtype=torch.float64)
    x = x.float().to(device)
    truth = ground_truth(x)
    out = ops.cdist(x)
    keep = truth > 0
    assert ((out.double() - truth).abs() / truth)[keep].max() < 2e-5


@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("scale", [1e3, 1e4])
@pytest.mark.parametrize("self_", [False, True])
@pytest.mark.parametrize("squared", [False, True])
def test_gradients_of_near_duplicates_in_far_apart_clusters(device, scale, self_, squared):
    """The forward recomputes these distances directly; the gradient must be as exact: every
    element within float32 precision of the float64 gradient of the same float32 inputs."""
    g = torch.Generator().manual_seed(5)
    A = torch.cat([scale + torch.randn(40, 16, generator=g), -scale + torch.randn(40, 16, generator=g)])
    B = A + 1e-2 * torch.randn(A.shape, generator=g)
    x = (torch.cat([A, B]) if self_ else A).to(device).requires_grad_()
    y = None if self_ else B.to(device).requires_grad_()
    out = ops.cdist(x, y, squared=squared)
    up = torch.randn(out.shape, generator=g, dtype=torch.float64)
    inputs = (x,) if self_ else (x, y)
    grads = torch.autograd.grad(out, inputs, up.float().to(device))
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    d64 = reference.cdist(*inputs64, squared=squared)
    grads64 = torch.autograd.grad(d64, inputs64, up.to(device))
    for actual, expected in zip(grads, grads64, strict=False):
        torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("device", DEVICES_SCALED_TRITON)
@pytest.mark.parametrize("dtype,scale", EXTREMES)
@pytest.mark.parametrize("layout", ["random", "clusters", "spread"])
@pytest.mark.parametrize("self_", [False, True])
@pytest.mark.parametrize("squared", [False, True])
def test_the_whole_finite_range(device, dtype, scale, layout, self_, squared):
    """Every distance that is a finite number of the dtype comes out right (within the
    dtype's tolerance of the exact value rounded to it), where |a|², |b|² and a·b under- or
    overflow: tiny and huge data, far-apart clusters, and one set spanning 20 orders of ten.
    Distances past the dtype's range are inf."""
    x = extreme_points(40, 7, dtype, scale, layout).to(device)
    y = None if self_ else extreme_points(30, 7, dtype, scale, layout, seed=1).to(device)
    exact = exact_squared_distances(x, y)
    out = ops.cdist(x, y, squared=squared)
    assert_close_to_exact(out, exact if squared else np.sqrt(exact), rtol=2e-5 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("device", DEVICES_SCALED_TRITON)
@pytest.mark.parametrize("dtype,exponent", [(torch.float32, -130), (torch.float64, -1060)])
def test_gradient_at_subnormal_distances(device, dtype, exponent, request):
    """(a - b)/d is a unit vector at any distance (testing.subnormal_points): exactly, but for
    the Triton kernels' float32 products on tensor cores (three TF32 products per product,
    whose operands keep 22 of float32's 24 bits: within 2^-20 of it)."""
    x, y, expected_x, expected_y = subnormal_points(device, dtype, exponent)
    d = ops.cdist(x, y)
    gx, gy = torch.autograd.grad(d, (x, y), torch.ones_like(d))
    if request.node.get_closest_marker("triton") and dtype == torch.float32:
        for got, expected in ((gx, expected_x), (gy, expected_y)):
            torch.testing.assert_close(got.cpu(), torch.tensor(expected, dtype=dtype), rtol=0, atol=2**-20)
    else:
        assert gx.tolist() == expected_x and gy.tolist() == expected_y


@pytest.mark.parametrize("device", DEVICES_SCALED_TRITON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("self_", [False, True])
@pytest.mark.parametrize("squared", [False, True])
def test_rows_spanning_the_whole_range(device, dtype, self_, squared):
    """Rows of every magnitude in one batch element: the small distances' squares underflow
    in the units its largest rows set, and must come back from the direct sums exactly."""
    x = spanning_points(40, 3, dtype).to(device)
    y = None if self_ else spanning_points(50, 3, dtype, seed=1).to(device)
    exact = exact_squared_distances(x, y)
    out = ops.cdist(x, y, squared=squared)
    assert_close_to_exact(out, exact if squared else np.sqrt(exact), rtol=2e-5 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("device", DEVICES_SCALED_TRITON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("self_", [False, True])
@pytest.mark.parametrize("squared", [False, True])
def test_nonfinite_rows_among_rows_spanning_the_whole_range(device, dtype, self_, squared):
    """A NaN row and a ±∞ row among rows of every magnitude: the other rows' distances are
    exact (the non-finite rows must not decide their batch element's scale), the NaN row's
    are NaN."""
    x, finite = spanning_points_with_nonfinite_rows(40, 3, dtype)
    y = None if self_ else torch.randn(30, 3, dtype=torch.float64).to(dtype)
    out = ops.cdist(x.to(device), None if y is None else y.to(device), squared=squared).cpu()
    clean = x[finite]
    exact = exact_squared_distances(clean, clean if y is None else y)
    rows = out[finite][:, finite] if self_ else out[finite]
    assert_close_to_exact(rows, exact if squared else np.sqrt(exact), rtol=2e-5 if dtype == torch.float32 else 1e-12)
    assert out[3].isnan().all()


@pytest.mark.parametrize("device", DEVICES_SCALED_TRITON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("self_", [False, True])
@pytest.mark.parametrize("squared", [False, True])
def test_gradients_of_rows_spanning_the_whole_range(device, dtype, self_, squared):
    """Against Σ_j G'_ij·(a_i - b_j) in long double, G' = 2·grad (squared) or grad / d, each
    row within the dtype's tolerance of Σ_j |G'_ij|·d_ij (what the terms' rounding allows)."""
    x = spanning_points(30, 3, dtype).to(device).requires_grad_()
    y = None if self_ else spanning_points(20, 3, dtype, seed=1).to(device).requires_grad_()
    inputs = (x,) if self_ else (x, y)
    out = ops.cdist(x, y, squared=squared)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = torch.autograd.grad(out, inputs, up.to(device, dtype))
    a = x.detach().double().cpu().numpy().astype(np.longdouble)
    b = a if self_ else y.detach().double().cpu().numpy().astype(np.longdouble)
    diff = a[:, None, :] - b[None, :, :]
    d = np.sqrt((diff**2).sum(-1))
    u = up.numpy().astype(np.longdouble)
    with np.errstate(divide="ignore", invalid="ignore"):
        w = 2 * u if squared else np.where(d > 0, u / d, 0)
    terms, size = w[..., None] * diff, np.abs(w) * d
    exact = [terms.sum(1), -terms.sum(0)]
    scale = [size.sum(1), size.sum(0)]
    if self_:
        exact, scale = [exact[0] + exact[1]], [scale[0] + scale[1]]
    info = torch.finfo(dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    for actual, want, s in zip(grads, exact, scale, strict=True):
        got = actual.double().cpu().numpy().astype(np.longdouble)
        inside = s <= np.longdouble(info.max) / 4  # beyond, a partial sum may overflow
        bound = tol * s[:, None] + np.longdouble(info.smallest_normal)
        ok = (np.abs(got - want) <= bound)[inside]
        assert ok.all(), f"{(~ok).sum()} gradient entries off by more than {tol} of their rows' scale"


@pytest.mark.parametrize("device", DEVICES_SCALED_TRITON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_squared_gradient_where_the_square_overflows(device, dtype):
    """A squared distance past the dtype's range comes out ∞ but has the finite gradient
    2·grad·(a - b). Beside a row so far away that the GEMMs' centred form cancels for the
    pair, the backward must still take that entry directly, though the output no longer
    says that its expansion cancelled."""
    info = torch.finfo(dtype)
    pair = 4 * math.sqrt(info.max) * torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    far = torch.full((3,), info.max / 8, dtype=torch.float64)
    x = torch.stack([pair, far]).to(device, dtype).requires_grad_()
    y = (-pair).unsqueeze(0).to(device, dtype).requires_grad_()
    out = ops.cdist(x, y, squared=True)
    assert out[0, 0].isinf()
    gx, gy = torch.autograd.grad(out, (x, y), torch.ones_like(out))
    tol = dict(rtol=1e-6, atol=0) if dtype == torch.float32 else dict(rtol=1e-14, atol=0)
    torch.testing.assert_close(gx.double().cpu(), 2 * (torch.stack([pair, far]) + pair), **tol)
    torch.testing.assert_close(gy.double().cpu(), (-2 * (pair + far) - 4 * pair).unsqueeze(0), **tol)


@pytest.mark.parametrize("device", DEVICES_SCALED_TRITON)
@pytest.mark.parametrize("dtype,scale", EXTREMES)
@pytest.mark.parametrize("layout", ["random", "spread"])
@pytest.mark.parametrize("self_", [False, True])
@pytest.mark.parametrize("squared", [False, True])
def test_gradients_over_the_whole_finite_range(device, dtype, scale, layout, self_, squared):
    """The gradient against float64's of the same inputs, computed on them times 2^-k (exact;
    the gradient is homogeneous of degree 0, or 1 squared) so that float64 itself neither
    under- nor overflows."""
    x = extreme_points(24, 5, dtype, scale, layout).to(device).requires_grad_()
    y = None if self_ else extreme_points(16, 5, dtype, scale, layout, seed=1).to(device).requires_grad_()
    inputs = (x,) if self_ else (x, y)
    out = ops.cdist(x, y, squared=squared)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
    grads = torch.autograd.grad(out, inputs, up.to(dtype))
    k = int(np.frexp(scale)[1])
    # The float64 oracle on the CPU.
    scaled = [torch.ldexp(t.detach().cpu().double(), torch.tensor(-k)).requires_grad_() for t in inputs]
    grads64 = torch.autograd.grad(reference.cdist(*scaled, squared=squared), scaled, up.cpu())
    for actual, expected in zip(grads, grads64, strict=True):
        expected = torch.ldexp(expected, torch.tensor(k if squared else 0))
        actual = actual.cpu().double()
        # Within a factor of 4 of the range's end, a self gradient's two halves (as x1 and
        # as x2) may overflow apart though their sum would not.
        finite = expected.abs() <= torch.finfo(dtype).max / 4
        tol = 1e-4 if dtype == torch.float32 else 1e-10
        torch.testing.assert_close(
            actual[finite], expected[finite], rtol=tol, atol=tol * expected[finite].abs().max().item()
        )


# Not through the Triton kernels: 140 calls of 70 batch elements take the interpreter 20 s.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("self_", [False, True])
def test_many_small_batch_elements(device, dtype, self_):
    """Small batch elements (grouped into one tile on the CPU) each get their own distances:
    the same as one call per element, a NaN row poisoning only its own element's row, and the
    self diagonal 0 in every element."""
    x = make((70, 9, 5), device=device, offset=50.0).to(dtype)
    y = None if self_ else make((70, 6, 5), device=device, seed=2, offset=50.0).to(dtype)
    x[33, 4, 1] = float("nan")
    out = ops.cdist(x, y)
    one_by_one = torch.stack([ops.cdist(x[b], None if y is None else y[b]) for b in range(70)])
    torch.testing.assert_close(out, one_by_one, equal_nan=True, rtol=1e-6, atol=1e-5)
    exact = torch.cdist(x.double(), (x if y is None else y).double(), compute_mode="donot_use_mm_for_euclid_dist")
    if self_:
        exact.diagonal(dim1=-2, dim2=-1).copy_(torch.where(x.double().isfinite().all(-1), 0.0, float("nan")))
    tol = dict(rtol=2e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-1)
    torch.testing.assert_close(out, exact.to(dtype), equal_nan=True, **tol)
    assert out[33, 4].isnan().all() and not out[:33].isnan().any() and not out[34:].isnan().any()


@pytest.mark.bad_input
@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 3e30])
@pytest.mark.parametrize("self_", [False, True])
def test_non_finite_rows_poison_only_their_distances(device, bad, self_):
    """A NaN or ∞ row changes only its own distances, and to what Σ(a - b)² gives, as
    torch.cdist's exact mode does; the rest stay exact. A row whose squared norm overflows
    (3e30 in float32) has finite distances, exact too, where torch.cdist's are inf."""
    x = make((40, 16), torch.float32, device, offset=100.0)
    y = None if self_ else make((30, 16), torch.float32, device, seed=3, offset=100.0)
    x[7, 3] = bad
    if y is not None:
        y[11, 0] = bad
    out = ops.cdist(x, y)
    if math.isfinite(bad):
        if device == "cuda":
            pytest.xfail("CUDA: no power-of-two scaling (#31)")
        assert_close_to_exact(out, np.sqrt(exact_squared_distances(x, y)), rtol=2e-5)
        return
    exact = torch.cdist(x, x if y is None else y, compute_mode="donot_use_mm_for_euclid_dist")
    torch.testing.assert_close(out, exact, equal_nan=True, rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_self_distance(device, dtype):
    x = make((3, 40, 9), dtype, device).requires_grad_()
    d = ops.cdist(x)
    assert d.shape == (3, 40, 40)
    assert (torch.diagonal(d, dim1=-2, dim2=-1) == 0).all()
    expected = ground_truth(x, x)
    tol = {} if dtype in (torch.float32, torch.float64) else dict(rtol=2e-2, atol=2e-2)
    assert_close(d.double(), expected, **({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else tol))
    (g,) = torch.autograd.grad(d.sum(), x)
    assert torch.isfinite(g).all()
    a = x.detach().double().requires_grad_()
    (g64,) = torch.autograd.grad(reference.cdist(a).sum(), a)
    assert (g.double() - g64).abs().max() <= 2e-2 * g64.abs().max()


@pytest.mark.parametrize("device", DEVICES_TRITON)
def test_self_distance_equals_two_set_form(device):
    x = make((30, 7), device=device).requires_grad_()
    y = x.detach().clone().requires_grad_()
    g = torch.randn(30, 30, dtype=torch.float64, device=device)
    (gs,) = torch.autograd.grad(ops.cdist(x), x, g)
    (gy,) = torch.autograd.grad(ops.cdist(y, y), y, g)  # both arguments' halves
    assert_close(gs, gy)


@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("squared", [False, True])
def test_duplicates_have_zero_gradient(device, squared):
    x = make((6, 4), device=device)
    y = torch.cat([x[:3], make((2, 4), device=device, seed=5)]).requires_grad_()
    x.requires_grad_()
    d = ops.cdist(x, y, squared=squared)
    assert (d[torch.arange(3), torch.arange(3)] == 0).all()
    gx, gy = torch.autograd.grad(d, (x, y), torch.ones_like(d))
    tx, ty = torch.autograd.grad(
        torch.cdist(x, y, compute_mode=EXACT) ** (2 if squared else 1), (x, y), torch.ones_like(d)
    )
    assert torch.isfinite(gx).all() and torch.isfinite(gy).all()
    assert_close(gx, tx)
    assert_close(gy, ty)


GRADCHECK_SHAPES = [((4, 3), (5, 3)), ((2, 1, 3, 2), (3, 4, 2))]


# Through the Triton kernels the unbatched shapes only: gradcheck of the broadcast batch takes
# the interpreter 100 s.
@pytest.mark.parametrize(
    "device,shapes",
    [
        pytest.param(*d.values, s, marks=d.marks, id=f"{d.id or d.values[0]}-{i}")
        for d in map(as_param, DEVICES)
        for i, s in enumerate(GRADCHECK_SHAPES)
    ]
    + [pytest.param(*d.values, GRADCHECK_SHAPES[0], marks=d.marks, id=f"{d.id}-0") for d in DEVICES_TRITON[2:]],
)
@pytest.mark.parametrize("squared", [False, True])
def test_gradcheck(device, shapes, squared):
    x1 = make(shapes[0], device=device, seed=1).requires_grad_()
    x2 = make(shapes[1], device=device, seed=2).requires_grad_()
    check_gradcheck(lambda a, b: ops.cdist(a, b, squared=squared), (x1, x2))
    check_gradcheck(lambda a: ops.cdist(a, squared=squared), (x1,))


@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_opcheck(device, dtype):
    x1 = make((2, 5, 3), dtype, device, seed=1).requires_grad_()
    x2 = make((6, 3), dtype, device, seed=2).requires_grad_()
    check_opcheck(OP, (x1, x2, False))
    check_opcheck(OP, (x1, None, True))
    d = OP(x1, x2, False).detach()
    grad = torch.randn_like(d)
    check_opcheck(BACKWARD, (grad, x1.detach(), x2.detach(), d, False, [True, True]))
    check_opcheck(BACKWARD, (grad, x1.detach(), x2.detach(), d, False, [False, True]))


@pytest.mark.parametrize("device", DEVICES_TRITON)
def test_compile_dynamic(device):
    for P, R in ((8, 5), (13, 9)):  # a second shape exercises the dynamic graph
        x1 = make((2, P, 4), torch.float32, device, seed=P).requires_grad_()
        x2 = make((R, 4), torch.float32, device, seed=R).requires_grad_()
        check_compile(ops.cdist, x1, x2)
        check_compile(lambda a: ops.cdist(a, squared=True), x1)


@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("P,R,M", [(0, 5, 3), (5, 0, 3), (4, 5, 0), (0, 0, 0)])
def test_empty(device, P, R, M):
    x1 = make((P, M), device=device).requires_grad_()
    x2 = make((R, M), device=device).requires_grad_()
    out = ops.cdist(x1, x2)
    expected = torch.cdist(x1, x2)
    assert out.shape == expected.shape
    assert_close(out, expected)
    gx1, gx2 = torch.autograd.grad(out.sum(), (x1, x2), allow_unused=True)
    assert gx1.shape == x1.shape and gx2.shape == x2.shape
    assert (gx1 == 0).all() and (gx2 == 0).all()


@pytest.mark.parametrize("device", DEVICES_TRITON)
def test_only_requested_gradients(device):
    x1 = make((5, 3), device=device).requires_grad_()
    x2 = make((4, 3), device=device)
    d = ops.cdist(x1, x2)
    (g,) = torch.autograd.grad(d.sum(), x1)
    assert_close(g, torch.autograd.grad(torch.cdist(x1, x2, compute_mode=EXACT).sum(), x1)[0])
    g1, g2 = BACKWARD(torch.ones_like(d), x1.detach(), x2, d.detach(), False, [False, True])
    assert g1.numel() == 0 and g2.shape == x2.shape


def test_autocast_runs_in_float32_like_torch_cdist():
    x, y = make((8, 16), torch.float32), make((5, 16), torch.float32, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, theirs = ops.cdist(x, y), torch.cdist(x, y)
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, ops.cdist(x, y))


def test_module():
    m = torchkit.nn.CDist(squared=True)
    x1, x2 = make((4, 3)), make((5, 3))
    assert_close(m(x1, x2), ops.cdist(x1, x2, squared=True))
    assert_close(m(x1), ops.cdist(x1, squared=True))
    assert "squared=True" in repr(m)


def test_reference_matches_exact_cdist():
    x1, x2 = make((2, 6, 4)), make((7, 4))
    assert_close(reference.cdist(x1, x2), torch.cdist(x1, x2, compute_mode=EXACT))


@settings(max_examples=40, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), max_size=2),
    P=st.integers(1, 20),
    R=st.integers(1, 20),
    M=st.integers(1, 40),
    offset=st.sampled_from([0.0, 100.0, 1e4]),
    squared=st.booleans(),
    self_=st.booleans(),
)
def test_hypothesis(batch, P, R, M, offset, squared, self_):
    x1 = make((*batch, P, M), torch.float32, seed=P * 100 + M, offset=offset)
    x2 = None if self_ else make((R, M), torch.float32, seed=R, offset=offset)
    out = ops.cdist(x1, x2, squared=squared)
    truth = ground_truth(x1, x2, squared)
    assert out.shape == truth.shape
    keep = truth > 1e-3 * truth.max()
    if keep.any():
        assert ((out.double() - truth).abs() / truth)[keep].max() < 2e-5


# Bad input: a clear exception naming the argument.
BAD = [
    (lambda: ops.cdist(torch.randn(5), torch.randn(3, 5)), ValueError, "x1 must have at least 2 dimensions"),
    (lambda: ops.cdist(torch.randn(3, 5), torch.randn(5)), ValueError, "x2 must have at least 2 dimensions"),
    (lambda: ops.cdist(torch.randn(3, 5), torch.randn(4, 6)), ValueError, "same number of features M"),
    (
        lambda: ops.cdist(torch.randn(2, 3, 5), torch.randn(3, 4, 5)),
        ValueError,
        "batch dimensions of x1 and x2 must broadcast",
    ),
    (lambda: ops.cdist(torch.randn(3, 5), torch.randn(4, 5).double()), TypeError, "x1 and x2 must have the same dtype"),
    (
        lambda: ops.cdist(torch.ones(3, 5, dtype=torch.int64)),
        TypeError,
        "x1 must be float32, float64, float16 or bfloat16, got Long",
    ),
    (lambda: ops.cdist(torch.ones(3, 5, dtype=torch.bool)), TypeError, "x1 must be float32"),
    (lambda: ops.cdist(torch.randn(3, 5, dtype=torch.complex64)), TypeError, "x1 must be float32"),
    (lambda: ops.cdist(torch.randn(3, 5), squared=None), TypeError, "cdist: squared must be a bool, got NoneType None"),
    (lambda: ops.cdist(torch.randn(3, 5), squared=1), TypeError, "cdist: squared must be a bool, got int 1"),
]


@pytest.mark.bad_input
@pytest.mark.parametrize("call,exc,message", BAD)
def test_bad_input(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


@pytest.mark.bad_input
@pytest.mark.cuda
def test_device_mismatch():
    with pytest.raises(ValueError, match="x1 and x2 must be on the same device"):
        ops.cdist(torch.randn(3, 5, device="cuda"), torch.randn(4, 5))


@pytest.mark.parametrize("device", DEVICES_TRITON)
@pytest.mark.parametrize("squared", [False, True])
def test_broadcast_upstream_gradient(device, squared):
    """d.sum() hands backward an expanded gradient (all strides 0), read without a copy."""
    x1, x2 = make((2, 37, 5), device=device), make((41, 5), device=device)
    d = OP(x1, x2, squared)
    g = torch.full((), 0.7, dtype=d.dtype, device=device).expand_as(d)
    assert all(s == 0 for s in g.stride())
    for a, b in zip(
        BACKWARD(g, x1, x2, d, squared, [True, True]),
        BACKWARD(g.contiguous(), x1, x2, d, squared, [True, True]),
        strict=False,
    ):
        assert_close(a, b)


@pytest.mark.bad_input
def test_backward_checks_its_inputs():
    x1, x2 = make((3, 4)), make((5, 4))
    d = OP(x1, x2, False)
    with pytest.raises(ValueError, match=r"backward: grad and dist must have the output's shape \[3, 5\]"):
        BACKWARD(torch.ones(3, 4, dtype=d.dtype), x1, x2, d, False, [True, True])
    with pytest.raises(TypeError, match=r"x1 and grad must have the same dtype"):
        BACKWARD(torch.ones_like(d).float(), x1, x2, d, False, [True, True])


@pytest.mark.bad_input
def test_meta_tensor_mixed_in_is_a_device_error():
    with pytest.raises(ValueError, match=r"cdist: x1 and x2 must be on the same device, got cpu and meta"):
        OP(torch.randn(3, 2), torch.randn(4, 2, device="meta"), False)
    x1, x2 = torch.randn(3, 2), torch.randn(4, 2)
    d = OP(x1, x2, False)
    with pytest.raises(ValueError, match=r"cdist: x1 and grad must be on the same device, got cpu and meta"):
        BACKWARD(torch.ones_like(d, device="meta"), x1, x2, d, False, [True, True])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape1,shape2", [((37, 19), (41, 19)), ((2, 3, 130, 7), (3, 65, 7)), ((64, 33), None)])
def test_cuda_matches_cpu(dtype, shape1, shape2):
    g = torch.Generator().manual_seed(1)
    x1 = (100 + torch.randn(shape1, generator=g, dtype=torch.float64)).to(dtype)
    x2 = None if shape2 is None else (100 + torch.randn(shape2, generator=g, dtype=torch.float64)).to(dtype)
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-4, rtol=1e-5)
    check_cuda_matches_cpu(lambda a, b: ops.cdist(a, b), x1, x2, **tol)


@pytest.mark.bad_input
@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input_under_compile(monkeypatch, call, exc, match):
    check_compiled_refuses_like_eager(monkeypatch, ["cdist"], call)


@pytest.mark.bad_input
@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input_on_meta_tensors(monkeypatch, call, exc, match):
    check_meta_refuses_like_eager(monkeypatch, "cdist", call)
