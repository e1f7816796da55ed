"""The pair losses (supcon_loss, ntxent_loss) against pytorch-metric-learning (the oracle), the
float64 references (torchkit.reference) and their own edge cases."""

import subprocess
import sys

import pytest
import torch
from pytorch_metric_learning import losses
from testing import (
    check_compile,
    check_compiled_refuses_like_eager,
    check_gradcheck,
    check_meta_refuses_like_eager,
    check_opcheck,
)

import torchkit
from torchkit import ops, reference

# loss -> (PML's class, stats columns per anchor)
LOSSES = {"supcon_loss": (losses.SupConLoss, 2), "ntxent_loss": (losses.NTXentLoss, 3)}
NAMES = list(LOSSES)


def raw(loss):
    return getattr(torch.ops.torchkit, loss).default, getattr(torch.ops.torchkit, f"_{loss}_backward").default


def make(shape, dtype=torch.float64, seed=0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (offset + torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)


def make_labels(n, classes, seed=0, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed + 100)
    return torch.randint(classes, (n,), generator=g).to(dtype)


def pml(loss):
    def fn(embeddings, labels, temperature, ref=None, ref_labels=None):
        return LOSSES[loss][0](temperature=temperature)(embeddings, labels, ref_emb=ref, ref_labels=ref_labels)

    return fn


def loss_and_grads(fn, e, labels, temperature, ref=None, ref_labels=None):
    leaves = [t.detach().clone().requires_grad_() for t in (e, ref) if t is not None]
    out = fn(leaves[0], labels, temperature, *(leaves[1:2] or [None]), ref_labels)
    grads = torch.autograd.grad(out, leaves, allow_unused=True) if out.requires_grad else [None] * len(leaves)
    return out.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)]


def ours(loss):
    def fn(e, labels, temperature, ref=None, ref_labels=None):
        return getattr(ops, loss)(e, labels, temperature, ref_embeddings=ref, ref_labels=ref_labels)

    return fn


def ref_fn(loss):
    def fn(e, labels, temperature, ref=None, ref_labels=None):
        return getattr(reference, loss)(e, labels, temperature, ref_embeddings=ref, ref_labels=ref_labels)

    return fn


# (N, classes, D, M or None): several samples per class, one per class (no positives but for
# refs), a single class (no negatives), odd sizes around the kernel's 64 × 256 tiles.
CASES = [
    (50, 5, 16, None),
    (160, 40, 33, None),
    (70, 70, 8, None),
    (9, 1, 5, None),
    (129, 7, 65, 200),
    (40, 4, 12, 257),
]


@pytest.mark.parametrize("loss", NAMES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("N,C,D,M", CASES)
@pytest.mark.parametrize("temperature", [0.07, 0.5])
def test_matches_pytorch_metric_learning(loss, dtype, N, C, D, M, temperature):
    e = make((N, D), dtype, seed=1)
    labels = make_labels(N, C)
    ref = None if M is None else make((M, D), dtype, seed=2)
    ref_labels = None if M is None else make_labels(M, C, seed=3)
    got, got_grads = loss_and_grads(ours(loss), e, labels, temperature, ref, ref_labels)
    exp, exp_grads = loss_and_grads(pml(loss), e, labels, temperature, ref, ref_labels)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got, exp, **tol)
    for a, b in zip(got_grads, exp_grads, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("loss", NAMES)
@pytest.mark.parametrize("M", [None, 90])
def test_float32_is_within_1e5_of_float64(loss, M):
    """Loss and gradients of float32 inputs against the float64 reference on the same values,
    relative to the largest gradient entry."""
    e = make((200, 64), torch.float32, seed=4, offset=0.3)
    labels = make_labels(200, 10)
    ref = None if M is None else make((M, 64), torch.float32, seed=5)
    ref_labels = None if M is None else make_labels(M, 10, seed=6)
    got, got_grads = loss_and_grads(ours(loss), e, labels, 0.1, ref, ref_labels)
    exp, exp_grads = loss_and_grads(
        ref_fn(loss), e.double(), labels, 0.1, None if ref is None else ref.double(), ref_labels
    )
    assert abs(got.double() - exp).item() <= 1e-5 * exp.abs().item()
    for a, b in zip(got_grads, exp_grads, strict=True):
        assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize("loss", NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_accumulates_in_float32(loss, dtype):
    e = make((100, 32), torch.float64, seed=7).to(dtype)
    labels = make_labels(100, 8)
    got, (g,) = loss_and_grads(ours(loss), e, labels, 0.1)
    exp, (g64,) = loss_and_grads(ref_fn(loss), e.double(), labels, 0.1)
    assert got.dtype == g.dtype == dtype
    eps = torch.finfo(dtype).eps
    assert abs(got.double() - exp).item() <= 2 * eps * exp.abs().item()
    assert (g.double() - g64).abs().max() <= 4 * eps * g64.abs().max()


@pytest.mark.parametrize("loss", NAMES)
def test_real_embeddings(loss):
    """sklearn's digits (64 pixel features, 10 classes) as embeddings, against PML (NT-Xent on
    fewer: PML's (positive pairs × negative pairs) matrix for 600 digits is 46 GB)."""
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    n = 600 if loss == "supcon_loss" else 150
    e = torch.tensor(digits.data[:n], dtype=torch.float32)
    labels = torch.tensor(digits.target[:n])
    for ref_rows in (None, slice(n, n + n // 2)):
        ref = None if ref_rows is None else torch.tensor(digits.data[ref_rows], dtype=torch.float32)
        ref_labels = None if ref_rows is None else torch.tensor(digits.target[ref_rows])
        got, got_grads = loss_and_grads(ours(loss), e, labels, 0.1, ref, ref_labels)
        exp, exp_grads = loss_and_grads(pml(loss), e, labels, 0.1, ref, ref_labels)
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)
        for a, b in zip(got_grads, exp_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss", NAMES)
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_any_integer_label_dtype(loss, dtype):
    e = make((40, 6), torch.float32)
    labels = make_labels(40, 5)
    fn = getattr(ops, loss)
    assert torch.equal(fn(e, labels.to(dtype)), fn(e, labels))


@pytest.mark.parametrize("loss", NAMES)
@pytest.mark.parametrize(
    "labels,why",
    [
        (torch.arange(6), "no positive pair"),
        (torch.zeros(6, dtype=torch.long), "no negative pair"),
        (torch.tensor([0]), "one embedding"),
        (torch.zeros(0, dtype=torch.long), "an empty batch"),
    ],
)
def test_no_pairs_of_one_kind_is_zero_with_zero_gradient(loss, labels, why):
    """PML's convention (its zero_losses): 0 and zero gradients, not NaN."""
    e = make((len(labels), 4)).requires_grad_()
    out = getattr(ops, loss)(e, labels)
    assert out.item() == 0 == pml(loss)(e, labels, 0.1).item(), why
    (g,) = torch.autograd.grad(out, e, allow_unused=True, materialize_grads=True)
    assert torch.equal(g, torch.zeros_like(e))


def test_supcon_anchor_without_positives_adds_nothing():
    """Labels 0, 0, 1: the lone 1 is nobody's positive but everyone's negative; the mean is over
    the two anchors with a positive."""
    e = make((3, 4))
    labels = torch.tensor([0, 0, 1])
    torch.testing.assert_close(ops.supcon_loss(e, labels), pml("supcon_loss")(e, labels, 0.1))
    x = torch.nn.functional.normalize(e, dim=1)
    s = x @ x.T / 0.1
    per = [torch.logsumexp(s[i, [j for j in range(3) if j != i]], 0) - s[i, 1 - i] for i in (0, 1)]
    torch.testing.assert_close(ops.supcon_loss(e, labels), (per[0] + per[1]) / 2)


def test_ntxent_each_positive_pair_against_its_anchors_negatives():
    """Labels 0, 0, 0, 1: six positive pairs, each a softmax of its similarity against its
    anchor's one negative (row 3); the mean is over the pairs."""
    e = make((4, 5), seed=3)
    labels = torch.tensor([0, 0, 0, 1])
    x = torch.nn.functional.normalize(e, dim=1)
    s = x @ x.T / 0.2
    pairs = [(i, p) for i in range(3) for p in range(3) if i != p]
    expected = torch.stack([torch.logaddexp(s[i, p], s[i, 3]) - s[i, p] for i, p in pairs]).mean()
    torch.testing.assert_close(ops.ntxent_loss(e, labels, 0.2), expected)


def test_ntxent_a_pair_loss_is_bounded_as_in_pml():
    """PML adds its small_val (the smallest normal) inside the log: a pair whose softmax
    underflows costs −log(tiny), about 87.3 in float32, not ∞."""
    e = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [1.0, 0.0]])  # the positive pair is opposite
    labels = torch.tensor([0, 0, 1])
    got = ops.ntxent_loss(e, labels, 0.01)
    exp = pml("ntxent_loss")(e, labels, 0.01)
    torch.testing.assert_close(got, exp)
    assert torch.isfinite(got)


@pytest.mark.parametrize("loss", NAMES)
def test_nan_embedding_makes_the_loss_nan(loss):
    """A NaN embedding among pairs of anchors with positives: NaN, never a finite value computed
    without it (PML's AvgNonZeroReducer drops NaN anchors from SupCon's mean)."""
    e = make((20, 5))
    labels = make_labels(20, 3)
    e[4, 2] = float("nan")
    assert getattr(ops, loss)(e, labels).isnan()
    assert getattr(reference, loss)(e, labels).isnan()


@pytest.mark.parametrize("loss", NAMES)
def test_zero_embedding_is_normalised_as_f_normalize(loss):
    """An all-zero row stays 0 after F.normalize's clamp: similarities 0, as PML computes."""
    e = make((12, 4))
    e[3] = 0
    labels = make_labels(12, 3)
    got, (g,) = loss_and_grads(ours(loss), e, labels, 0.2)
    exp, (g_exp,) = loss_and_grads(pml(loss), e, labels, 0.2)
    torch.testing.assert_close(got, exp)
    torch.testing.assert_close(g, g_exp)


@pytest.mark.parametrize("loss", NAMES)
def test_deterministic_on_any_number_of_threads(loss):
    e = make((300, 40), torch.float32, seed=8)
    labels = make_labels(300, 12)
    results = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            results.append(loss_and_grads(ours(loss), e, labels, 0.1))
        finally:
            torch.set_num_threads(before)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1][0], results[1][1][0])


@pytest.mark.parametrize("loss", NAMES)
@pytest.mark.parametrize("M", [None, 5])
def test_gradcheck(loss, M):
    fn = getattr(ops, loss)
    e = make((7, 3), seed=9).requires_grad_()
    labels = torch.tensor([0, 1, 0, 2, 1, 0, 2])
    if M is None:
        check_gradcheck(lambda a: fn(a, labels, 0.5), (e,))
    else:
        ref = make((M, 3), seed=10).requires_grad_()
        ref_labels = torch.tensor([1, 0, 2, 2, 0])
        check_gradcheck(lambda a, b: fn(a, labels, 0.5, ref_embeddings=b, ref_labels=ref_labels), (e, ref))


@pytest.mark.parametrize("loss", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(loss, dtype):
    op, backward = raw(loss)
    e = make((10, 4), dtype).requires_grad_()
    labels = make_labels(10, 3)
    ref = make((6, 4), dtype, seed=1).requires_grad_()
    ref_labels = make_labels(6, 3, seed=1)
    check_opcheck(op, (e, labels, None, None, 0.1))
    check_opcheck(op, (e, labels, ref, ref_labels, 0.1))
    value, stats = op(e.detach(), labels, ref.detach(), ref_labels, 0.1)
    g = torch.ones_like(value)
    check_opcheck(backward, (g, e.detach(), labels, ref.detach(), ref_labels, stats, 0.1, [True, True]))
    _, stats = op(e.detach(), labels, None, None, 0.1)
    check_opcheck(backward, (g, e.detach(), labels, None, None, stats, 0.1, [True, False]))


@pytest.mark.parametrize("loss", NAMES)
def test_compile_dynamic(loss):
    fn = getattr(ops, loss)
    for N in (20, 33):
        e = make((N, 8), torch.float32).requires_grad_()
        labels = make_labels(N, 4)
        check_compile(fn, e, labels, 0.1)
        ref = make((N + 3, 8), torch.float32, seed=1).requires_grad_()
        check_compile(
            lambda a, b, lab, rl: fn(a, lab, ref_embeddings=b, ref_labels=rl),
            e,
            ref,
            labels,
            make_labels(N + 3, 4, seed=1),
        )


@pytest.mark.parametrize("loss,module", [("supcon_loss", "SupConLoss"), ("ntxent_loss", "NTXentLoss")])
def test_module(loss, module):
    m = getattr(torchkit.nn, module)(temperature=0.2)
    e, labels = make((10, 4)), make_labels(10, 3)
    ref, ref_labels = make((7, 4), seed=1), make_labels(7, 3, seed=1)
    fn = getattr(ops, loss)
    assert m(e, labels).item() == fn(e, labels, 0.2).item()
    assert m(e, labels, ref, ref_labels).item() == fn(e, labels, 0.2, ref_embeddings=ref, ref_labels=ref_labels).item()
    assert "temperature=0.2" in repr(m)
    with pytest.raises(ValueError, match=f"{module}: temperature must be finite and > 0, got 0"):
        getattr(torchkit.nn, module)(temperature=0.0)


@pytest.mark.parametrize("loss", NAMES)
def test_saved_for_backward_is_inputs_and_a_few_numbers_per_anchor(loss):
    e = make((64, 16), torch.float32).requires_grad_()
    labels = make_labels(64, 4)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        getattr(ops, loss)(e, labels)
    total = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}.values())
    assert total <= e.nbytes + labels.nbytes + LOSSES[loss][1] * 4 * 64


def peak_growth_mib(call: str, N: int, D: int, classes: int) -> float:
    """Peak resident-set growth of one forward and backward in a fresh process (allocator caches
    and thread pools warmed on a small batch first), in MiB."""
    code = (
        "import torch, torchkit\n"
        "from torchkit import ops\n"
        "def status(key):\n"
        "    with open('/proc/self/status') as f:\n"
        "        return next(int(l.split()[1]) for l in f if l.startswith(key)) / 1024\n"
        "g = torch.Generator().manual_seed(0)\n"
        f"e = torch.randn({N}, {D}, generator=g).requires_grad_()\n"
        f"labels = torch.randint({classes}, ({N},), generator=g)\n"
        f"ops.{call}(e[:300], labels[:300]).backward()\n"
        "e.grad = None\n"
        "base = status('VmRSS:')\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        f"ops.{call}(e, labels).backward()\n"
        "print(status('VmHWM:') - base)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("loss", NAMES)
def test_memory_is_linear_in_the_batch(loss):
    """N = 8192, D = 128 float32, forward and backward: the peak resident set grows by less than
    16 MiB (the gradient itself is 4), where one N×N float32 matrix is 256 MiB."""
    growth = peak_growth_mib(loss, 8192, 128, 100)
    assert growth < 16, f"peak grew by {growth:.1f} MiB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_ntxent_at_pml_547s_batch_needs_under_8_mib():
    """PML #547: NT-Xent at N = 1,200 with 10 classes asked for 120 GB there (its (positive pairs
    × negative pairs) matrix)."""
    growth = peak_growth_mib("ntxent_loss", 1200, 128, 10)
    assert growth < 8, f"peak grew by {growth:.1f} MiB"


e4 = make((6, 4), torch.float32)
l6 = torch.tensor([0, 1, 0, 1, 2, 2])


def bad_cases(loss):
    fn = getattr(ops, loss)
    return [
        (lambda: fn(e4[0], l6), ValueError, r"embeddings must be 2-D \(N, D\), got shape \[4\]"),
        (lambda: fn(e4.long(), l6), TypeError, r"embeddings must be float32, float64, float16 or bfloat16"),
        (lambda: fn(e4, l6.float()), TypeError, r"labels must have an integer dtype, got Float"),
        (lambda: fn(e4, l6.bool()), TypeError, r"labels must have an integer dtype, got Bool"),
        (
            lambda: fn(e4, l6[:5]),
            ValueError,
            r"labels must be 1-D with one label per row of embeddings \(6\), got shape \[5\]",
        ),
        (lambda: fn(e4, l6[None]), ValueError, r"labels must be 1-D"),
        (lambda: fn(e4, l6, 0.0), ValueError, r"temperature must be finite and > 0, got 0"),
        (lambda: fn(e4, l6, -0.1), ValueError, r"temperature must be finite and > 0, got -0.1"),
        (lambda: fn(e4, l6, float("inf")), ValueError, r"temperature must be finite and > 0, got inf"),
        (lambda: fn(e4, l6, float("nan")), ValueError, r"temperature must be finite and > 0, got nan"),
        (lambda: fn(e4, l6, ref_embeddings=e4), ValueError, r"must be given together, got ref_embeddings alone"),
        (lambda: fn(e4, l6, ref_labels=l6), ValueError, r"must be given together, got ref_labels alone"),
        (
            lambda: fn(e4, l6, ref_embeddings=e4.double(), ref_labels=l6),
            TypeError,
            r"embeddings and ref_embeddings must have the same dtype, got Float and Double",
        ),
        (
            lambda: fn(e4, l6, ref_embeddings=e4[:, :3], ref_labels=l6),
            ValueError,
            r"ref_embeddings must be 2-D \(M, D\) with embeddings' D",
        ),
        (
            lambda: fn(e4, l6, ref_embeddings=e4, ref_labels=l6[:4]),
            ValueError,
            r"ref_labels must be 1-D with one label per row of ref_embeddings \(6\), got shape \[4\]",
        ),
    ]


BAD = [pytest.param(loss, *case, id=f"{loss}-{i}") for loss in NAMES for i, case in enumerate(bad_cases(loss))]


@pytest.mark.bad_input
@pytest.mark.parametrize("loss,call,exc,match", BAD)
def test_bad_input(loss, call, exc, match):
    with pytest.raises(exc, match=match) as err:
        call()
    assert str(err.value).startswith(f"{loss}: ")


@pytest.mark.bad_input
@pytest.mark.parametrize("loss,call,exc,match", BAD)
def test_bad_input_under_compile(monkeypatch, loss, call, exc, match):
    check_compiled_refuses_like_eager(monkeypatch, [loss], call)


@pytest.mark.bad_input
@pytest.mark.parametrize("loss,call,exc,match", BAD)
def test_bad_input_on_meta_tensors(monkeypatch, loss, call, exc, match):
    check_meta_refuses_like_eager(monkeypatch, loss, call)


@pytest.mark.bad_input
@pytest.mark.parametrize("loss,call,exc,match", BAD)
def test_raw_op_refuses_like_the_function(monkeypatch, loss, call, exc, match):
    """torch.ops.torchkit.<loss> validates what it reads: the same exception and message."""
    op, _ = raw(loss)
    monkeypatch.setattr(
        ops,
        loss,
        lambda e, labels, temperature=0.1, *, ref_embeddings=None, ref_labels=None: op(
            e, labels, ref_embeddings, ref_labels, temperature
        ),
    )
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.bad_input
@pytest.mark.parametrize("loss", NAMES)
def test_raw_op_refuses_a_bool_temperature(loss):
    op, _ = raw(loss)
    with pytest.raises(TypeError, match=rf"{loss}: temperature must be a float, got bool True"):
        op(e4, l6, None, None, True)


@pytest.mark.bad_input
@pytest.mark.parametrize("loss", NAMES)
def test_backward_checks_its_inputs(loss):
    op, backward = raw(loss)
    columns = LOSSES[loss][1]
    value, stats = op(e4, l6, None, None, 0.1)
    g = torch.ones_like(value)
    with pytest.raises(ValueError, match=r"backward: grad must be a scalar"):
        backward(torch.ones(2), e4, l6, None, None, stats, 0.1, [True, False])
    with pytest.raises(
        ValueError,
        match=rf"backward: stats must be \(N, {columns}\) = \(6, {columns}\) of Float, got \[6, 7\] of Float",
    ):
        backward(g, e4, l6, None, None, torch.zeros(6, 7), 0.1, [True, False])
    with pytest.raises(TypeError, match=r"embeddings and grad must have the same dtype"):
        backward(g.double(), e4, l6, None, None, stats, 0.1, [True, False])


@pytest.mark.parametrize("loss", NAMES)
def test_cuda_tensors_are_refused_with_a_reason(loss):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with pytest.raises(NotImplementedError, match=rf"{loss}: no cuda kernel yet"):
        getattr(ops, loss)(e4.cuda(), l6.cuda())


@pytest.mark.parametrize("loss", NAMES)
def test_reference_is_pml(loss):
    e, labels = make((30, 6)), make_labels(30, 4)
    ref, ref_labels = make((11, 6), seed=1), make_labels(11, 4, seed=1)
    fn = getattr(reference, loss)
    torch.testing.assert_close(fn(e, labels), pml(loss)(e, labels, 0.1 if loss == "supcon_loss" else 0.07))
    torch.testing.assert_close(
        fn(e, labels, 0.3, ref_embeddings=ref, ref_labels=ref_labels), pml(loss)(e, labels, 0.3, ref, ref_labels)
    )


def test_ntxent_anchor_without_negatives_counts_zero_pairs():
    """Refs all of anchor 0's label: its two positive pairs cost 0 and count in the mean (PML);
    anchor 1 has no positives, but gives the batch its negative pairs."""
    e, labels = make((2, 3)), torch.tensor([0, 1])
    ref, ref_labels = make((2, 3), seed=1), torch.tensor([0, 0])
    got = ops.ntxent_loss(e, labels, 0.1, ref_embeddings=ref, ref_labels=ref_labels)
    torch.testing.assert_close(got, pml("ntxent_loss")(e, labels, 0.1, ref, ref_labels))
    assert abs(got.item()) < 1e-300


@pytest.mark.parametrize("loss", NAMES)
@pytest.mark.parametrize(
    "dtype,scales", [(torch.float32, (1e-11, 1e20, 1e30, 1e38)), (torch.float64, (1e-11, 1e200, 1e300))]
)
def test_the_whole_finite_range(loss, dtype, scales):
    """Cosine similarity does not see a row's scale: above F.normalize's clamp (norms >= 1e-12)
    the loss is the unit rows' and the gradient scales as 1/scale, where the embeddings'
    squares overflow (F.normalize divides by ∞ there, and PML returns log(#pairs)); below it,
    the clamp's own result, as the float64 reference computes it."""
    e, labels = make((40, 6), dtype, seed=11), make_labels(40, 4)
    ref, ref_labels = make((17, 6), dtype, seed=12), make_labels(17, 4, seed=1)
    for r in (None, ref):
        rl = None if r is None else ref_labels
        base, (g_base, *_) = loss_and_grads(ours(loss), e, labels, 0.1, r, rl)
        for scale in scales:
            got, (g, *_) = loss_and_grads(ours(loss), e * scale, labels, 0.1, None if r is None else r * scale, rl)
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got, base, **tol)
            torch.testing.assert_close(g.double() * scale, g_base.double(), **tol)
    for scale in (1e-20, 1e-30) if dtype == torch.float32 else (1e-200, 1e-300):
        x = e * scale
        got, (g,) = loss_and_grads(ours(loss), x, labels, 0.1)
        exp, (g64,) = loss_and_grads(ref_fn(loss), x.double(), labels, 0.1)
        torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g.double(), g64, rtol=1e-5, atol=1e-6 * g64.abs().max().item())


@pytest.mark.parametrize("loss", NAMES)
def test_non_finite_embedding_makes_the_loss_nan(loss):
    e, labels = make((20, 5)), make_labels(20, 3)
    e[7, 1] = float("inf")
    assert getattr(ops, loss)(e, labels).isnan()


@pytest.mark.parametrize("loss", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 1e300])
def test_inputs_are_never_written(loss, dtype, scale):
    """Rows of the accumulation type are read in place (no copy): the kernels must not write
    into them, on the ordinary path nor where rows are normalised first."""
    e = (make((30, 5)) * min(scale, torch.finfo(dtype).max / 10)).to(dtype).requires_grad_()
    ref = make((9, 5), dtype, seed=1).requires_grad_()
    labels, ref_labels = make_labels(30, 3), make_labels(9, 3, seed=1)
    before = e.detach().clone(), ref.detach().clone()
    getattr(ops, loss)(e, labels, ref_embeddings=ref, ref_labels=ref_labels).backward()
    getattr(ops, loss)(e, labels).backward()
    assert torch.equal(e.detach(), before[0]) and torch.equal(ref.detach(), before[1])
