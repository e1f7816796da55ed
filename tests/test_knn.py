"""torchkit.ops.knn against the reference (cdist + stable sort), a float64 oracle and
torch.cdist + topk."""

import importlib
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from testing import (
    DEVICES,
    DEVICES_SCALED,
    EXTREMES,
    REDUCED_DTYPES,
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
    run_python,
    spanning_points,
    spanning_points_with_nonfinite_rows,
    subnormal_points,
)

from torchkit import ops, reference

knn_module = importlib.import_module("torchkit.ops.knn")

OP = torch.ops.torchkit.knn.default


def make(shape, dtype=torch.float64, device="cpu", seed=0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (offset + torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).to(device)


def assert_same(actual, expected, **tol):
    (d, i), (rd, ri) = actual, expected
    assert i.dtype == torch.int64 and d.dtype == rd.dtype
    torch.testing.assert_close(d, rd, **tol)
    assert torch.equal(i, ri)


# (query shape, gallery shape or None, k): plain, leave-one-out, batched, broadcast, k = 1, R, R - 1.
CASES = [
    ((5, 3), (7, 3), 1),
    ((5, 3), (7, 3), 7),
    ((9, 4), None, 8),
    ((9, 4), None, 1),
    ((40, 17), (70, 17), 5),
    ((2, 9, 4), (2, 11, 4), 3),
    ((3, 1, 6, 5), (4, 8, 5), 4),  # batch (3, 1) with (4,) → (3, 4)
    ((1, 6, 5), (2, 3, 4, 5), 2),
    ((2, 12, 6), None, 11),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("query,gallery,k", CASES)
@pytest.mark.parametrize("squared", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
def test_matches_reference(device, query, gallery, k, squared, contiguous):
    q = make(query, device=device)
    g = None if gallery is None else make(gallery, device=device, seed=1)
    if not contiguous:
        q = make_noncontiguous(q)
        g = None if g is None else make_noncontiguous(g)
    assert_same(ops.knn(q, g, k, squared=squared), reference.knn(q, g, k, squared=squared))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("self_", [False, True])
def test_float32_against_a_float64_oracle_across_tiles(device, self_):
    # 4,500 gallery rows: two gallery chunks of the CPU kernel, and a tail.
    q = make((300, 32), torch.float32, device)
    g = None if self_ else make((4500, 32), torch.float32, device, seed=1)
    d, i = ops.knn(q, g, 10)
    rd, ri = reference.knn(q.double(), None if g is None else g.double(), 10)
    torch.testing.assert_close(d.double(), rd, rtol=2e-6, atol=0)
    assert torch.equal(i, ri)


def oracle(q, g, k):
    """float64, by torch.cdist's exact mode and a stable sort (the reference's order), in
    O(P·R) memory: for sizes the reference's O(P·R·M) temporary cannot hold."""
    d = torch.cdist(q.double(), (q if g is None else g).double(), compute_mode="donot_use_mm_for_euclid_dist")
    if g is None:
        d.fill_diagonal_(float("nan"))
    order = d.sort(dim=-1, stable=True).indices
    if g is None:  # the row itself after the NaNs of others
        own = order == torch.arange(len(d)).unsqueeze(1)
        order = order.gather(-1, own.to(torch.uint8).sort(dim=-1, stable=True).indices)
    return d.gather(-1, order[:, :k]), order[:, :k]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ties", [False, True])
def test_leave_one_out_across_blocks(device, ties):
    """P = 2,500: several square blocks of the leave-one-out kernel and a tail, each pair of
    blocks scanned both ways; with ties (coordinates on a coarse grid), across blocks too."""
    x = make((2500, 6), torch.float32, seed=3)
    x = x.round() if ties else x
    x[1234, 2] = float("nan")
    d, i = ops.knn(x.to(device), k=9)
    rd, ri = oracle(x, None, 9)
    torch.testing.assert_close(d.double().cpu(), rd, rtol=2e-6, atol=1e-7, equal_nan=True)
    assert torch.equal(i.cpu(), ri)


@pytest.mark.parametrize("device", DEVICES)
def test_far_from_origin_where_cdist_and_topk_err(device):
    """1000 + N(0, 1) in float32: torch.cdist's default mode returns distances near 0 with
    relative errors near 1, so its ranking is noise; knn ranks as float64 does."""
    q = make((200, 64), torch.float32, device, offset=1000.0)
    g = make((2500, 64), torch.float32, device, seed=1, offset=1000.0)
    d, i = ops.knn(q, g, 5)
    rd, ri = reference.knn(q.double(), g.double(), 5)
    torch.testing.assert_close(d.double(), rd, rtol=2e-5, atol=0)
    assert torch.equal(i, ri)
    _, cdist_topk = torch.cdist(q, g).topk(5, largest=False)
    assert not torch.equal(cdist_topk, ri)  # the failure knn exists to avoid


@pytest.mark.parametrize("device", DEVICES)
def test_near_duplicates_in_far_apart_clusters(device):
    g = torch.Generator().manual_seed(4)
    centres = 1000 * torch.randn(4, 32, generator=g, dtype=torch.float64)
    x = centres.repeat_interleave(50, 0) + 1e-3 * torch.randn(200, 32, generator=g, dtype=torch.float64)
    x32 = x.float()
    d, i = ops.knn(x32.to(device), k=4)
    rd, ri = reference.knn(x32.double(), k=4)
    torch.testing.assert_close(d.double().cpu(), rd, rtol=2e-5, atol=0)
    assert torch.equal(i.cpu(), ri)
    assert (i.cpu() // 50 == torch.arange(200).unsqueeze(1) // 50).all()  # within the cluster


@pytest.mark.parametrize("device", DEVICES_SCALED)
@pytest.mark.parametrize("dtype,scale", EXTREMES)
@pytest.mark.parametrize("layout", ["random", "clusters", "spread"])
@pytest.mark.parametrize("self_", [False, True])
@pytest.mark.parametrize("squared", [False, True])
def test_the_whole_finite_range(device, dtype, scale, layout, self_, squared):
    """The exact neighbours, in the exact order, where |a|², |b|² and a·b under- or overflow:
    against Σ(a - b)² in long double. Where two exact distances are within the dtype's
    rounding of each other (the spread layout has such near-ties) either order is right, so
    the neighbours are checked by their exact distances."""
    q = extreme_points(50, 6, dtype, scale, layout).to(device)
    g = None if self_ else extreme_points(70, 6, dtype, scale, layout, seed=1).to(device)
    exact = exact_squared_distances(q, g)
    if self_:
        np.fill_diagonal(exact, np.inf)
    order = np.argsort(exact, axis=-1, kind="stable")[:, :5]
    d, i = ops.knn(q, g, k=5, squared=squared)
    rtol = 2e-5 if dtype == torch.float32 else 1e-12
    best = np.take_along_axis(exact, order, axis=-1)
    chosen = np.take_along_axis(exact, i.cpu().numpy(), axis=-1)
    assert np.all(np.abs(chosen - best) <= 2 * rtol * best), "a neighbour that is not among the k nearest"
    assert_close_to_exact(d, best if squared else np.sqrt(best), rtol=rtol)
    if layout != "spread":
        assert np.array_equal(i.cpu().numpy(), order)


# Subnormal data too: distances there are subnormal, and grad / d overflows.
SUBNORMAL = [(torch.float32, 1e-42), (torch.float64, 1e-312)]


@pytest.mark.parametrize("device", DEVICES_SCALED)
@pytest.mark.parametrize("dtype,scale", EXTREMES + SUBNORMAL)
@pytest.mark.parametrize("self_", [False, True])
@pytest.mark.parametrize("squared", [False, True])
def test_gradients_over_the_whole_finite_range(device, dtype, scale, self_, squared):
    """Against Σ G'·(q - g) over the k pairs kept, in long double (G' = 2·grad squared, else
    grad / d), each row within the dtype's tolerance of Σ |G'|·d, plus what the rounding of
    a subnormal output distance allows (|G'| times the smallest subnormal per pair)."""
    q = extreme_points(30, 4, dtype, scale, "random").to(device).requires_grad_()
    g = None if self_ else extreme_points(40, 4, dtype, scale, "random", seed=1).to(device).requires_grad_()
    inputs = (q,) if self_ else (q, g)
    d, i = ops.knn(q, g, k=4, squared=squared)
    up = torch.randn(d.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = torch.autograd.grad(d, inputs, up.to(device, dtype))
    a = q.detach().double().cpu().numpy().astype(np.longdouble)
    b = a if self_ else g.detach().double().cpu().numpy().astype(np.longdouble)
    idx = i.cpu().numpy()
    diff = a[:, None, :] - b[idx]
    dist = np.sqrt((diff**2).sum(-1))
    u = up.numpy().astype(np.longdouble)
    with np.errstate(divide="ignore", invalid="ignore"):
        w = 2 * u if squared else np.where(dist > 0, u / dist, 0)
    terms = w[..., None] * diff
    exact_q, exact_g = terms.sum(1), np.zeros_like(b)
    np.add.at(exact_g, idx, -terms)
    info = torch.finfo(dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    slack = np.abs(w) * (tol * dist + np.longdouble(info.smallest_normal * info.eps))
    scale_q, scale_g = slack.sum(1), np.zeros(len(b), dtype=np.longdouble)
    np.add.at(scale_g, idx, slack)
    exact = [exact_q + exact_g] if self_ else [exact_q, exact_g]
    scales = [scale_q + scale_g] if self_ else [scale_q, scale_g]
    for actual, want, bound in zip(grads, exact, scales, strict=True):
        got = actual.double().cpu().numpy().astype(np.longdouble)
        assert np.all(np.abs(got - want) <= bound[:, None] + np.longdouble(info.smallest_normal)), (
            "gradient off by more than its rows' tolerance"
        )


@pytest.mark.parametrize("device", DEVICES_SCALED)
@pytest.mark.parametrize("dtype,exponent", [(torch.float32, -130), (torch.float64, -1060)])
def test_gradient_at_subnormal_distances(device, dtype, exponent):
    """(a - b)/d is a unit vector at any distance (testing.subnormal_points)."""
    x, y, expected_x, expected_y = subnormal_points(device, dtype, exponent)
    d = ops.knn(x, y, k=2)[0]
    gx, gy = torch.autograd.grad(d, (x, y), torch.ones_like(d))
    assert gx.tolist() == expected_x and gy.tolist() == expected_y


@pytest.mark.parametrize("device", DEVICES_SCALED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("self_", [False, True])
@pytest.mark.parametrize("squared", [False, True])
def test_rows_spanning_the_whole_range(device, dtype, self_, squared):
    """Query and gallery rows of every magnitude in one call: in the units of the batch
    element's scaling (set by its largest row) the squares of the small distances underflow
    even in float64, and must still be ordered and returned exactly."""
    q = spanning_points(60, 3, dtype).to(device)
    g = None if self_ else spanning_points(200, 3, dtype, seed=1).to(device)
    exact = exact_squared_distances(q, g)
    if self_:
        np.fill_diagonal(exact, np.inf)
    k = 20
    d, i = ops.knn(q, g, k=k, squared=squared)
    rtol = 2e-5 if dtype == torch.float32 else 1e-12
    best = np.sort(exact, axis=-1)[:, :k]
    chosen = np.take_along_axis(exact, i.cpu().numpy(), axis=-1)
    assert np.all(np.abs(chosen - best) <= 2 * rtol * best), "a neighbour that is not among the k nearest"
    assert_close_to_exact(d, best if squared else np.sqrt(best), rtol=rtol)


@pytest.mark.parametrize("device", DEVICES_SCALED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("self_", [False, True])
def test_nonfinite_rows_among_rows_spanning_the_whole_range(device, dtype, self_):
    """A NaN row and a ±∞ row among rows of every magnitude: the finite query rows' neighbours
    are exact (the non-finite rows must not decide the scale), the non-finite rows last."""
    x, finite = spanning_points_with_nonfinite_rows(40, 3, dtype)
    g = None if self_ else torch.cat([x[:40], torch.randn(30, 3, dtype=torch.float64).to(dtype)])
    gallery_finite = finite if self_ else g.isfinite().all(-1)
    k = 20
    d, i = (t.cpu() for t in ops.knn(x.to(device), None if g is None else g.to(device), k=k))
    with np.errstate(invalid="ignore"):  # ∞ − ∞
        exact = exact_squared_distances(x, g)
    exact[:, ~gallery_finite.numpy()] = np.inf  # NaN or ∞ rows after every finite one
    if self_:
        np.fill_diagonal(exact, np.inf)
    rtol = 2e-5 if dtype == torch.float32 else 1e-12
    best = np.sort(exact, axis=-1)[finite.numpy(), :k]
    chosen = np.take_along_axis(exact, i.numpy(), axis=-1)[finite.numpy()]
    assert np.all(np.abs(chosen - best) <= 2 * rtol * best), "a neighbour that is not among the k nearest"
    assert_close_to_exact(d[finite], np.sqrt(best), rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_go_to_the_lower_index(device):
    g = torch.tensor([[1.0, 0], [0, 1], [-1, 0], [0, -1], [1, 0], [2, 0]], device=device)
    d, i = ops.knn(torch.zeros(1, 2, device=device), g, 5)
    assert i.tolist() == [[0, 1, 2, 3, 4]] and (d == 1).all()
    x = torch.zeros(5, 3, device=device)  # all rows equal: every distance 0
    _, i = ops.knn(x, k=4)
    expected = [[j for j in range(5) if j != r] for r in range(5)]
    assert i.tolist() == expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("self_", [True, False])
def test_duplicated_rows(device, dtype, self_):
    """Rows drawn from a few points, so that most of a row's k best tie at distance 0: a row
    takes nothing more once its k best are all 0 (later columns lose ties), in the row and the
    column scans of leave-one-out (P = 2,500: several blocks) and in the two-set scan. Some
    rows have fewer than k duplicates, and one point has a single copy. Then runs of repeated
    rows, each repeat skipped where the row before it stayed out of a heap."""
    g = torch.Generator().manual_seed(5)
    points = make((7, 5), dtype, seed=4)
    x = points[torch.randint(6, (2500,), generator=g)]
    x[1777] = points[6]
    gallery = None if self_ else x.flip(0)[:1900]
    for k in (1, 40, 400):
        d, i = ops.knn(x.to(device), None if gallery is None else gallery.to(device), k)
        rd, ri = oracle(x, gallery, k)
        torch.testing.assert_close(d.double().cpu(), rd, rtol=2e-6, atol=0)
        assert torch.equal(i.cpu(), ri)
    # Runs of repeated rows (a sorted draw), ties at non-zero distances: a query among them
    # or apart, the query's own row inside a run, runs across blocks and chunks.
    x = points[torch.randint(6, (2500,), generator=g).sort().values]
    x[1300:1310] = make((10, 5), dtype, seed=9)  # distinct rows inside a run
    gallery = None if self_ else x[::2]
    for k in (1, 3, 40, 500):
        d, i = ops.knn(x.to(device), None if gallery is None else gallery.to(device), k)
        rd, ri = oracle(x, gallery, k)
        torch.testing.assert_close(d.double().cpu(), rd, rtol=2e-6, atol=0)
        assert torch.equal(i.cpu(), ri)


@pytest.mark.bad_input
@pytest.mark.parametrize("device", DEVICES)
def test_nan_rows_rank_last_with_nan_distances(device):
    g = make((6, 4), torch.float32, device, seed=1)
    g[2, 1] = float("nan")
    q = make((3, 4), torch.float32, device)
    q[1, 0] = float("nan")
    d, i = ops.knn(q, g, 6)
    assert (i[[0, 2], -1] == 2).all() and d[[0, 2], -1].isnan().all() and not d[[0, 2], :-1].isnan().any()
    assert d[1].isnan().all() and i[1].tolist() == list(range(6))  # all NaN: index order
    assert_same((d, i), reference.knn(q, g, 6), equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_infinite_coordinates(device):
    g = make((5, 3), torch.float32, device, seed=1)
    g[3, 0] = float("inf")
    d, i = ops.knn(make((2, 3), torch.float32, device), g, 5)
    assert (i[:, -1] == 3).all() and (d[:, -1] == float("inf")).all()


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    d, i = ops.knn(torch.zeros(0, 3, device=device), torch.zeros(4, 3, device=device), 2)
    assert d.shape == i.shape == (0, 2)
    d, i = ops.knn(torch.zeros(3, 0, device=device), torch.zeros(4, 0, device=device), 2)
    assert (d == 0).all() and i.tolist() == [[0, 1]] * 3
    d, i = ops.knn(torch.zeros(2, 0, 5, device=device), torch.zeros(2, 4, 5, device=device), 1)
    assert d.shape == (2, 0, 1)


def peak_rss_growth_mib(fn):
    """The growth of the process's peak resident set during fn(), in MiB (Linux)."""

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024

    base = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    fn()
    return status("VmHWM:") - base


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_gallery_about_the_origin_is_not_copied():
    """Data about the origin is multiplied as it is: the workspace is the tiles only, never a
    centred copy of the 25 MiB gallery (knn on data far from the origin does centre)."""
    query, gallery = make((200, 64), torch.float32, seed=1), make((100_000, 64), torch.float32, seed=2)
    ops.knn(query, gallery, 10)  # thread pools and allocator caches first
    assert peak_rss_growth_mib(lambda: ops.knn(query, gallery, 10)) < 12
    d, _ = ops.knn(query, gallery, 10)
    exact = torch.cdist(query.double(), gallery.double(), compute_mode="donot_use_mm_for_euclid_dist")
    torch.testing.assert_close(d.double(), exact.topk(10, largest=False).values, rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", REDUCED_DTYPES)
def test_reduced_precision_is_computed_in_float32(device, dtype):
    q, g = make((30, 16), dtype, device), make((50, 16), dtype, device, seed=1)
    d, i = ops.knn(q, g, 4)
    rd, ri = reference.knn(q.double(), g.double(), 4)
    assert d.dtype == dtype and torch.equal(i, ri)
    torch.testing.assert_close(d, rd.to(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("self_", [False, True])
@pytest.mark.parametrize("squared", [False, True])
def test_gradcheck(device, self_, squared):
    q = make((7, 3), device=device).requires_grad_()
    g = None if self_ else make((2, 9, 3), device=device, seed=1).requires_grad_()
    inputs = (q,) if self_ else (q, g)
    check_gradcheck(
        lambda *t: ops.knn(*t, k=3, squared=squared)[0] if not self_ else ops.knn(t[0], k=3, squared=squared)[0], inputs
    )


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_is_that_of_cdist_gathered(device):
    q = make((20, 8), torch.float32, device, offset=1000.0).requires_grad_()
    g = make((30, 8), torch.float32, device, seed=1, offset=1000.0).requires_grad_()
    d, i = ops.knn(q, g, 4)
    up = torch.randn_like(d)
    ours = torch.autograd.grad(d, (q, g), up)
    q64, g64 = q.detach().double().requires_grad_(), g.detach().double().requires_grad_()
    theirs = torch.autograd.grad(reference.cdist(q64, g64).gather(-1, i), (q64, g64), up.double())
    for a, b in zip(ours, theirs, strict=False):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("self_", [False, True])
@pytest.mark.parametrize("squared", [False, True])
def test_backward_in_row_blocks(monkeypatch, self_, squared):
    """The backward walks the query rows in blocks (a bounded workspace): blocks of a few rows,
    a ragged last one and batch dimensions give the gradient of cdist gathered."""
    monkeypatch.setattr(knn_module, "_BACKWARD_ELEMENTS", 3 * 4 * 5)  # 3 rows of k = 4, M = 5
    q = make((2, 11, 5), offset=10.0).requires_grad_()
    g = None if self_ else make((1, 13, 5), seed=1).requires_grad_()
    d, i = ops.knn(q, g, 4, squared=squared)
    up = torch.randn_like(d)
    leaves = (q,) if self_ else (q, g)
    ours = torch.autograd.grad(d, leaves, up)
    exact = reference.cdist(q, g)
    theirs = torch.autograd.grad((exact**2 if squared else exact).gather(-1, i), leaves, up)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("self_", [False, True])
def test_backward_memory_is_bounded(self_):
    """At 16384 x 128 with k = 16 the backward's workspace stays near the gradients' own size
    (8 MiB each), where a (P, k, M) temporary alone is 128 MiB: peak RSS growth in a fresh process."""
    code = (
        "import resource, torch, torchkit\n"
        "def case(P, self_):\n"
        "    q = torch.randn(P, 128, requires_grad=True)\n"
        "    g = None if self_ else torch.randn(P, 128, requires_grad=True)\n"
        "    d, _ = torchkit.ops.knn(q, g, 16)\n"
        "    return d, torch.randn_like(d)\n"
        f"d, up = case(256, {self_}); d.backward(up)  # first calls' one-off costs\n"
        f"d, up = case(16384, {self_})\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "d.backward(up)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)\n"
    )
    run = run_python(code)
    assert run.returncode == 0, run.stderr
    growth_mib = float(run.stdout.split()[-1])
    assert growth_mib < 64, f"knn's backward grew the resident set by {growth_mib:.0f} MiB"


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    q = make((6, 4), device=device).requires_grad_()
    g = make((8, 4), device=device, seed=1).requires_grad_()
    check_opcheck(OP, (q, g, 3, False))
    check_opcheck(OP, (q, None, 2, True))
    check_opcheck(OP, (make((2, 6, 4), torch.float32, device), make((5, 4), torch.float32, device), 5, False))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_dynamic(device):
    for P, R in ((6, 9), (11, 13), (7, 20)):
        q = make((P, 4), device=device).requires_grad_()
        g = make((R, 4), device=device, seed=1).requires_grad_()
        check_compile(lambda a, b: ops.knn(a, b, 3)[0], q, g)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.sampled_from([(), (2,), (1, 3)]),
    P=st.integers(1, 12),
    R=st.integers(2, 40),
    M=st.integers(0, 9),
    k=st.integers(1, 40),
    self_=st.booleans(),
    squared=st.booleans(),
    duplicates=st.booleans(),
)
def test_hypothesis(batch, P, R, M, k, self_, squared, duplicates):
    q = make((*batch, P, M), seed=P)
    g = None if self_ else make((R, M), seed=R)
    if duplicates:  # exact ties
        q = q.round()
        g = None if g is None else g.round()
    limit = P - 1 if self_ else R
    if k > limit:
        with pytest.raises(ValueError, match="knn: k must be <="):
            ops.knn(q, g, k)
        return
    assert_same(ops.knn(q, g, k, squared=squared), reference.knn(q, g, k, squared=squared))


q4, g4 = make((4, 3), torch.float32), make((6, 3), torch.float32)
BAD = [
    (lambda: ops.knn(q4, g4, 0), ValueError, r"knn: k must be >= 1, got 0"),
    (lambda: ops.knn(q4, g4, 7), ValueError, r"knn: k must be <= the gallery's size R = 6, got 7"),
    (lambda: ops.knn(q4, None, 4), ValueError, r"knn: k must be <= P - 1 = 3 without a gallery"),
    (lambda: ops.knn(q4, g4, 2.0), TypeError, r"knn: k must be an int, got float 2.0"),
    (lambda: ops.knn(q4, g4, True), TypeError, r"knn: k must be an int, got bool True"),
    (lambda: ops.knn(q4, g4, 2, squared=None), TypeError, r"knn: squared must be a bool, got NoneType None"),
    (lambda: ops.knn(q4, g4, 2, squared=1), TypeError, r"knn: squared must be a bool, got int 1"),
    (lambda: ops.knn(q4[0], g4, 1), ValueError, r"knn: query must have at least 2 dimensions"),
    (lambda: ops.knn(q4, g4[:, :2], 1), ValueError, r"knn: query and gallery must have the same number of features"),
    (lambda: ops.knn(q4, g4.double(), 1), TypeError, r"knn: query and gallery must have the same dtype"),
    (lambda: ops.knn(q4.int(), g4.int(), 1), TypeError, r"knn: query must be float32, float64"),
    (
        lambda: ops.knn(q4.expand(2, 4, 3), g4.expand(3, 6, 3), 1),
        ValueError,
        r"knn: the batch dimensions of query and gallery must broadcast",
    ),
    (
        lambda: ops.knn(q4, g4.to("meta"), 1),
        ValueError,
        r"knn: query and gallery must be on the same device, got cpu and meta",
    ),
]


@pytest.mark.bad_input
@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_integral_k():
    """k as any integral number, as PyTorch's own functions take it (numpy, 0-d tensors)."""
    np = pytest.importorskip("numpy")
    expected = ops.knn(q4, g4, 3)
    for k in (np.int64(3), np.int32(3), torch.tensor(3)):
        assert_same(ops.knn(q4, g4, k), expected)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "shape1,shape2,k", [((37, 19), (4100, 19), 7), ((2, 3, 130, 7), (3, 65, 7), 65), ((64, 33), None, 5)]
)
def test_cuda_matches_cpu(dtype, shape1, shape2, k):
    q = make(shape1, dtype)
    g = None if shape2 is None else make(shape2, dtype, seed=1)
    q[0, ..., 1] = float("nan") if q.dim() == 2 else q[0, ..., 1]
    check_cuda_matches_cpu(lambda a, b=None: ops.knn(a, b, k)[0], *((q,) if g is None else (q, g)))
    _, i_cpu = ops.knn(q, g, k)
    _, i_gpu = ops.knn(q.cuda(), None if g is None else g.cuda(), k)
    assert torch.equal(i_gpu.cpu(), i_cpu)


@pytest.mark.bad_input
@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input_under_compile(monkeypatch, call, exc, match):
    check_compiled_refuses_like_eager(monkeypatch, ["knn"], call)


@pytest.mark.bad_input
@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input_on_meta_tensors(monkeypatch, call, exc, match):
    check_meta_refuses_like_eager(monkeypatch, "knn", call)


# The CUDA kernel screens with a bfloat16 GEMM and recomputes, directly, every entry that its
# error bound cannot rule out. These inputs sit where such a screen fails if the bound or the
# selection is wrong: distances closer together than the screen resolves, exact ties, clusters
# whose norms dwarf their spread, k at the limits of the queue and past it.
def near_ties():
    """Gallery rows on a sphere about each query's centre, radii 1e-5 apart (relative): every
    distance is within the bfloat16 screen's error of the k-th."""
    g = torch.Generator().manual_seed(11)
    u = torch.randn(3000, 32, generator=g, dtype=torch.float64)
    u /= u.norm(dim=1, keepdim=True)
    radii = 10 * (1 + 1e-5 * torch.randperm(3000, generator=g, dtype=torch.float64))
    centre = torch.randn(32, generator=g, dtype=torch.float64)
    gallery = centre + radii.unsqueeze(1) * u
    query = centre + 1e-3 * torch.randn(40, 32, generator=g, dtype=torch.float64)
    return query.float(), gallery.float(), 10


def duplicated_rows():
    g = torch.Generator().manual_seed(12)
    base = torch.randn(700, 16, generator=g)
    gallery = base.repeat(6, 1)[torch.randperm(4200, generator=g)]
    return base[:50] + 0.01 * torch.randn(50, 16, generator=g), gallery, 9


def clusters():
    g = torch.Generator().manual_seed(13)
    centres = 1e4 * torch.randn(5, 24, generator=g, dtype=torch.float64)
    x = centres.repeat_interleave(1200, 0) + 1e-2 * torch.randn(6000, 24, generator=g, dtype=torch.float64)
    return x.float(), None, 20


def far_from_origin(offset):
    def case():
        g = torch.Generator().manual_seed(14)
        return offset + torch.randn(300, 64, generator=g), offset + torch.randn(5000, 64, generator=g), 8

    return case


def all_equal():
    return torch.full((5000, 8), 3.0), None, 7


def k_is_r(R, self_):
    def case():
        g = torch.Generator().manual_seed(R)
        x = torch.randn(R, 12, generator=g)
        return (x, None, R - 1) if self_ else (torch.randn(30, 12, generator=g), x, R)

    return case


def non_finite_rows():
    g = torch.Generator().manual_seed(15)
    q, x = torch.randn(40, 16, generator=g), torch.randn(5000, 16, generator=g)
    q[3, 2] = float("nan")
    x[[7, 4500], 1] = float("nan")
    x[100, 0] = float("inf")
    return q, x, 12


def large_k(k):
    def case():
        g = torch.Generator().manual_seed(k)
        return torch.randn(64, 20, generator=g), torch.randn(9000, 20, generator=g), k

    return case


SCREENING_CASES = {
    "near-ties": near_ties,
    "duplicated rows": duplicated_rows,
    "far-apart clusters of near-duplicates": clusters,
    "1e3 from the origin": far_from_origin(1e3),
    "1e4 from the origin": far_from_origin(1e4),
    "all rows equal": all_equal,
    "k = R (queue)": k_is_r(1500, False),
    "k = R - 1 (queue)": k_is_r(1500, True),
    "k = R (sorted)": k_is_r(5000, False),
    "k = R - 1 (sorted)": k_is_r(5000, True),
    "NaN and inf rows": non_finite_rows,
    "k = 1000": large_k(1000),
    "k = 3000 (sorted)": large_k(3000),
}


EXACT_TIES = ("duplicated rows", "all rows equal")  # ties between identical rows: bit for bit


def assert_indices_match(i, d_ref, i_ref, strict):
    """i equals the first k of i_ref (which may hold one more), except where a distance lies
    within rounding (1e-6) of a neighbour's: there two correct summation orders may swap."""
    k = i.shape[-1]
    if strict:
        assert torch.equal(i, i_ref[:, :k])
        return
    d = d_ref.double()
    near = (d[:, 1:] - d[:, :-1]) <= 1e-6 * d[:, 1:].abs()  # NaN: never near
    ambiguous = torch.zeros_like(d, dtype=torch.bool)
    ambiguous[:, 1:] |= near
    ambiguous[:, :-1] |= near
    ambiguous = ambiguous[:, :k]
    assert ambiguous.float().mean() < 0.25  # the check still covers most positions
    assert torch.equal(i[~ambiguous], i_ref[:, :k][~ambiguous])


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(SCREENING_CASES))
def test_screening_on_cuda_is_exact(case):
    """CUDA against the CPU kernel (indices) and a float64 oracle of the same float32 data
    (distances and indices)."""
    q, g, k = SCREENING_CASES[case]()
    d, i = ops.knn(q.cuda(), None if g is None else g.cuda(), k)
    d, i = d.cpu(), i.cpu()
    more = min(k + 1, len(q) - 1 if g is None else len(g))  # one more: ties at the k-th
    d_cpu, i_cpu = ops.knn(q, g, more)
    assert_indices_match(i, d_cpu, i_cpu, strict=case in EXACT_TIES)
    rd, ri = oracle(q, g, more)
    torch.testing.assert_close(d.double(), rd[:, :k], rtol=2e-6, atol=1e-30, equal_nan=True)
    if not rd.isnan().any():  # NaN rows: the oracle's cdist orders NaN among themselves differently
        assert_indices_match(i, rd, ri, strict=case in EXACT_TIES)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("self_", [False, True])
def test_cuda_matches_cpu_in_every_dtype(dtype, self_):
    q = make((200, 40), dtype, seed=21)
    g = None if self_ else make((5000, 40), dtype, seed=22)
    d, i = ops.knn(q.cuda(), None if g is None else g.cuda(), 6)
    d_cpu, i_cpu = ops.knn(q, g, 6)
    assert d.dtype == dtype and torch.equal(i.cpu(), i_cpu)
    torch.testing.assert_close(d.cpu(), d_cpu)


@pytest.mark.cuda
@pytest.mark.parametrize("k", [8, 3000])  # the queue and the sorted path
def test_no_host_synchronisation(k):
    q = torch.randn(500, 32, device="cuda")
    g = torch.randn(9000, 32, device="cuda")
    ops.knn(q, g, k)  # allocator and cuBLAS handles first
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.knn(q, g, k)
        ops.knn(g, k=k)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@pytest.mark.parametrize("self_", [False, True])
def test_cuda_graph_capture_and_replay(self_):
    q = torch.randn(300, 32, device="cuda")
    g = None if self_ else torch.randn(5000, 32, device="cuda")
    expected = ops.knn(q, g, 8)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.knn(q, g, 8)  # warm-up on the capturing stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d, i = ops.knn(q, g, 8)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    again = ops.knn(q, g, 8)
    assert torch.equal(i, again[1]) and torch.equal(d, again[0])
    assert not torch.equal(i, expected[1])


def test_documented_workspace_is_the_kernels():
    """knn's docstring and docs/ops.md name the CPU kernel's product tile as it is (the
    docstring said 16 MiB of an 8 MiB tile)."""
    root = Path(__file__).resolve().parent.parent
    shift = re.search(r"kProductTileBytes = (\d+) << 20;", (root / "csrc" / "cpu" / "knn_cpu.cpp").read_text())
    assert shift, "csrc/cpu/knn_cpu.cpp: kProductTileBytes"
    tile = f"{int(shift[1])} MiB"
    assert f"an {tile} tile" in " ".join(ops.knn.__doc__.split())
    assert f"{tile} tile" in " ".join((root / "docs" / "ops.md").read_text().split())
