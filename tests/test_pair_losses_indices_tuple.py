"""The pair losses on the pairs or triplets a pytorch-metric-learning miner returns
(indices_tuple=, torchkit/ops/_listed_pairs.py): against PML's losses fed the same miner's
output, in every dtype, with and without refs, for both distances of the Euclidean losses;
against the loss over every pair or triplet; the exact distances' ties; its checks; compile
and the modules."""

import pytest
import torch
from pytorch_metric_learning import losses, miners
from pytorch_metric_learning.distances import CosineSimilarity
from test_pair_losses import exact_pair_loss, make, make_labels
from testing import check_compile

import torchkit
from torchkit import ops, reference

# (name, miner given the distance's keyword arguments): PML's miners of pairs and of triplets.
MINERS = {
    "PairMarginMiner": lambda kw: miners.PairMarginMiner(0.2, 0.8, **kw),
    "TripletMarginMiner-hard": lambda kw: miners.TripletMarginMiner(0.1, type_of_triplets="hard", **kw),
    "TripletMarginMiner-easy": lambda kw: miners.TripletMarginMiner(0.1, type_of_triplets="easy", **kw),
    "TripletMarginMiner-semihard": lambda kw: miners.TripletMarginMiner(0.3, type_of_triplets="semihard", **kw),
    "BatchEasyHardMiner": lambda kw: miners.BatchEasyHardMiner(**kw),
    "BatchHardMiner": lambda kw: miners.BatchHardMiner(**kw),
    "MultiSimilarityMiner": lambda kw: miners.MultiSimilarityMiner(0.1),
}
LOSSES = {
    # name: (torchkit's function, PML's loss given the distance's keyword arguments)
    "contrastive_loss": (
        lambda e, labels, distance, **kw: ops.contrastive_loss(e, labels, 0.1, 0.8, distance=distance, **kw),
        lambda kw: losses.ContrastiveLoss(0.1, 0.8, **kw),
    ),
    "triplet_margin_loss": (
        lambda e, labels, distance, **kw: ops.triplet_margin_loss(e, labels, 0.2, distance=distance, **kw),
        lambda kw: losses.TripletMarginLoss(0.2, **kw),
    ),
    # (cosine similarity only: distance is "cosine" for them)
    "supcon_loss": (
        lambda e, labels, distance, **kw: ops.supcon_loss(e, labels, 0.1, **kw),
        lambda kw: losses.SupConLoss(0.1),
    ),
    "ntxent_loss": (
        lambda e, labels, distance, **kw: ops.ntxent_loss(e, labels, 0.2, **kw),
        lambda kw: losses.NTXentLoss(0.2),
    ),
    "multi_similarity_loss": (
        lambda e, labels, distance, **kw: ops.multi_similarity_loss(
            e, labels, 2.0, 40.0, 0.5, miner_epsilon=None, **kw
        ),
        lambda kw: losses.MultiSimilarityLoss(2.0, 40.0, 0.5),
    ),
}
EUCLIDEAN = ("contrastive_loss", "triplet_margin_loss")
# (loss, distance): the Euclidean losses with both, the others with their cosine.
LOSS_DISTANCES = [(loss, d) for loss in LOSSES for d in (("euclidean", "cosine") if loss in EUCLIDEAN else ("cosine",))]
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def pml_kwargs(distance):
    return {"distance": CosineSimilarity()} if distance == "cosine" else {}


def mined(miner, distance, e, labels, ref=None, ref_labels=None):
    m = MINERS[miner](pml_kwargs(distance))
    return m(e, labels) if ref is None else m(e, labels, ref, ref_labels)


def ours_and_pml(loss, distance, dtype, e, labels, ref, ref_labels, tuple_of, pml_dtype=None):
    """Loss and gradients of torchkit's and PML's (in pml_dtype: the inputs' own by default) on
    the same tuple."""
    ours, theirs = LOSSES[loss]
    results = []
    for fn, dt in (
        (
            lambda x, r: ours(x, labels, distance, indices_tuple=tuple_of, ref_embeddings=r, ref_labels=ref_labels),
            dtype,
        ),
        (lambda x, r: theirs(pml_kwargs(distance))(x, labels, tuple_of, r, ref_labels), pml_dtype or dtype),
    ):
        x = e.to(dt).requires_grad_()
        r = None if ref is None else ref.to(dt).requires_grad_()
        out = fn(x, r)
        leaves = [x] if r is None else [x, r]
        grads = torch.autograd.grad(out, leaves, allow_unused=True)
        results.append(
            (out.detach(), [torch.zeros_like(v) if g is None else g for v, g in zip(leaves, grads, strict=True)])
        )
    return results


@pytest.mark.parametrize("loss,distance", LOSS_DISTANCES)
@pytest.mark.parametrize("miner", list(MINERS))
def test_matches_pytorch_metric_learning(miner, loss, distance):
    """Every miner's pairs or triplets into each loss, with and without refs: float64 and
    float32 against PML in the same dtype (values and gradients)."""
    e, labels = make((32, 12), seed=11), make_labels(32, 5, seed=11)
    ref, ref_labels = make((24, 12), seed=12), make_labels(24, 5, seed=12)
    for r, rl in ((None, None), (ref, ref_labels)):
        for dtype, tol in TOLERANCE.items():
            x, y = e.to(dtype), None if r is None else r.to(dtype)
            tuple_of = mined(miner, distance, x, labels, y, rl)
            (got, got_grads), (want, want_grads) = ours_and_pml(loss, distance, dtype, x, labels, y, rl, tuple_of)
            assert got.dtype == dtype
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            for a, b in zip(got_grads, want_grads, strict=True):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("loss,distance", LOSS_DISTANCES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_match_pytorch_metric_learning(dtype, loss, distance):
    """float16 and bfloat16 inputs (float64 per listed pair, one rounding of the loss) against
    PML in float64 on the same rounded values, pairs and triplets."""
    e, labels = make((40, 10), seed=13).to(dtype), make_labels(40, 5, seed=13)
    eps = torch.finfo(dtype).eps
    for miner in ("PairMarginMiner", "TripletMarginMiner-hard"):
        tuple_of = mined(miner, distance, e.double(), labels)
        (got, (g,)), (want, (g64,)) = ours_and_pml(
            loss, distance, dtype, e, labels, None, None, tuple_of, pml_dtype=torch.float64
        )
        assert got.dtype == g.dtype == dtype
        assert abs(got.double() - want).item() <= eps * want.abs().item()
        assert (g.double() - g64).abs().max() <= eps * g64.abs().max()


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_pair_or_triplet_is_the_loss_without_a_list(dtype, distance):
    """Listing every pair (contrastive) or every triplet (triplet) gives the kernels' loss on
    the whole batch, gradients included: on random rows, and on a collapsed batch (equal rows,
    zero rows of either sign, a row one ulp from another) where only exact distances and
    similarities agree; on rows of no feature (all zero)."""
    from test_pair_losses import collapsed

    e, labels = make((30, 7), seed=14).to(dtype), make_labels(30, 4, seed=14)
    z, z_labels = collapsed(24, dtype, seed=0)
    for x, lab in ((e, labels), (z, z_labels), (e[:9, :0], labels[:9])):  # (and rows without features)
        same = lab[:, None] == lab[None, :]
        positive = same & ~torch.eye(len(lab), dtype=torch.bool)
        pairs = (*positive.nonzero(as_tuple=True), *(~same).nonzero(as_tuple=True))
        triplets = torch.where(positive[:, :, None] & ~same[:, None, :])
        cases = [
            ("contrastive_loss", pairs, dict(pos_margin=1.0, neg_margin=0.0) if distance == "cosine" else {}),
            ("triplet_margin_loss", triplets, dict(margin=0.0)),
        ]
        cases = [(loss, t, {**params, "distance": distance}) for loss, t, params in cases]
        if distance == "cosine":
            cases += [
                ("supcon_loss", pairs, {}),
                ("ntxent_loss", pairs, dict(temperature=0.5)),
                ("multi_similarity_loss", pairs, dict(miner_epsilon=None)),
            ]
        for loss, tuple_of, params in cases:
            fn = getattr(ops, loss)
            leaves = [x.clone().requires_grad_() for _ in range(2)]
            got = fn(leaves[0], lab, **params, indices_tuple=tuple_of)
            want = fn(leaves[1], lab, **params)
            tol = 1e-12 if dtype == torch.float64 else 1e-5
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            (g,), (g_want,) = torch.autograd.grad(got, leaves[:1]), torch.autograd.grad(want, leaves[1:])
            assert g.shape == g_want.shape
            if g.numel():  # (relative to the largest entry: a zero row's is ~1e12 times the others')
                assert (g - g_want).abs().max() <= tol * g_want.abs().max()


def test_ties_are_exact():
    """Zero rows (at exactly 1 from every unit row, cosine 0) and equal rows (distance 0, cosine
    1) decide the terms on PML's margins as exact arithmetic does: the float64 exact loss, not
    PML's rounding (collapsed batches of test_pair_losses)."""
    from test_pair_losses import collapsed

    e, labels = collapsed(24, torch.float64, seed=1)
    same = labels[:, None] == labels[None, :]
    positive = same & ~torch.eye(24, dtype=torch.bool)
    pairs = (*positive.nonzero(as_tuple=True), *(~same).nonzero(as_tuple=True))
    for params in (
        {"pos_margin": 0.0, "neg_margin": 1.0, "distance": "euclidean"},
        {"pos_margin": 1.0, "neg_margin": 0.0, "distance": "cosine"},
    ):
        got = ops.contrastive_loss(e, labels, **params, indices_tuple=pairs)
        torch.testing.assert_close(got, exact_pair_loss("contrastive_loss", params, e, labels), rtol=1e-12, atol=0)


def test_reference_takes_the_tuple_as_pml():
    e, labels = make((30, 6), seed=15), make_labels(30, 4, seed=15)
    for distance in ("euclidean", "cosine"):
        for miner in ("PairMarginMiner", "TripletMarginMiner-hard"):
            t = mined(miner, distance, e, labels)
            for loss, kwargs in (
                ("contrastive_loss", dict(pos_margin=0.1, neg_margin=0.8)),
                ("triplet_margin_loss", {}),
            ):
                want = getattr(ops, loss)(e, labels, **kwargs, distance=distance, indices_tuple=t)
                got = getattr(reference, loss)(e, labels, **kwargs, distance=distance, indices_tuple=t)
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_pml_rules_for_short_lists():
    """PML's rules: a contrastive loss whose every list holds at most one index is 0, a
    triplet loss without triplets is 0, both with zero gradients (NaN rows included)."""
    e = make((6, 3)).requires_grad_()
    labels = make_labels(6, 2)
    one, none = torch.tensor([0]), torch.tensor([], dtype=torch.long)
    with torch.no_grad():
        e[5] = float("nan")
    for loss, t in (
        ("contrastive_loss", (one, torch.tensor([1]), one, torch.tensor([2]))),
        ("triplet_margin_loss", (none, none, none)),
        ("triplet_margin_loss", (one, torch.tensor([1]), torch.tensor([2]), torch.tensor([3]))),  # no match
    ):
        out = getattr(ops, loss)(e, labels, indices_tuple=t)
        (g,) = torch.autograd.grad(out, e)
        assert out.item() == 0 and not g.any(), loss


e6, l6 = make((6, 4), torch.float32), make_labels(6, 3)
r4 = make((4, 4), torch.float32, seed=1)
BAD = [
    ([torch.tensor([0])], TypeError, r"indices_tuple must be a tuple of 3 index tensors .* got list of 1$"),
    (torch.tensor([0, 1, 2]), TypeError, r"indices_tuple must be a tuple of 3 index tensors .* got Tensor"),
    ((torch.tensor([0]), [1], torch.tensor([2])), TypeError, r"indices_tuple\[1\] must be a Tensor of indices"),
    ((torch.tensor([0.0]),) * 3, TypeError, r"indices_tuple\[0\] must have an integer dtype, got Float"),
    ((torch.tensor([[0]]),) * 3, ValueError, r"indices_tuple\[0\] must be 1-D, got shape \[1, 1\]"),
    (
        (torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([2])),
        ValueError,
        r"indices_tuple's three .* one length .* \[2, 1, 1\]",
    ),
    (
        (torch.tensor([0]), torch.tensor([1]), torch.tensor([2, 3])),
        ValueError,
        r"indices_tuple's three .* one length .* \[1, 1, 2\]",
    ),
    ((torch.tensor([0]), torch.tensor([1]), torch.tensor([6])), IndexError, r"indices_tuple\[2\] .* \[0, 6\), got 6"),
    ((torch.tensor([-1]), torch.tensor([1]), torch.tensor([2])), IndexError, r"indices_tuple\[0\] .* \[0, 6\), got -1"),
]


@pytest.mark.bad_input
@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("bad,exc,match", BAD)
def test_bad_tuples_are_refused(loss, bad, exc, match):
    extra = {"miner_epsilon": None} if loss == "multi_similarity_loss" else {}
    with pytest.raises(exc, match=rf"^{loss}: {match}"):
        getattr(ops, loss)(e6, l6, indices_tuple=bad, **extra)


@pytest.mark.bad_input
def test_refs_and_other_options_are_checked():
    """With refs, positives and negatives index the refs; the triplet loss refuses a mining
    beside the tuple, both refuse group=."""
    t = (torch.tensor([5]), torch.tensor([4]), torch.tensor([1]))
    with pytest.raises(
        IndexError, match=r"indices_tuple\[1\] must index the rows of ref_embeddings .* \[0, 4\), got 4"
    ):
        ops.contrastive_loss(e6, l6, indices_tuple=t, ref_embeddings=r4, ref_labels=l6[:4])
    with pytest.raises(ValueError, match=r"indices_tuple and mining='batch_hard' both choose the triplets"):
        ops.triplet_margin_loss(e6, l6, mining="batch_hard", indices_tuple=t)
    with pytest.raises(ValueError, match=r"indices_tuple and miner_epsilon=0.1 .* both choose the pairs"):
        ops.multi_similarity_loss(e6, l6, indices_tuple=t)
    both = (torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([1, 4]), torch.tensor([3, 5]))
    for loss in ("supcon_loss", "multi_similarity_loss"):  # (PML's matrix losses assert it)
        with pytest.raises(ValueError, match=rf"^{loss}: indices_tuple lists a pair both as a positive and as a"):
            getattr(ops, loss)(e6, l6, indices_tuple=both, **({"miner_epsilon": None} if "multi" in loss else {}))
    with pytest.raises(NotImplementedError, match=r"^contrastive_loss: indices_tuple with group= is not supported"):
        ops.contrastive_loss(e6, l6, indices_tuple=t, group=object())
    with pytest.raises(ValueError, match=r"^triplet_margin_loss: margin must be finite"):  # (the loss's own checks)
        ops.triplet_margin_loss(e6, l6, float("nan"), indices_tuple=t)


# (NT-Xent and multi-similarity run supcon_loss's primitives: per-pair values, scattered sums)
@pytest.mark.parametrize("loss", ["contrastive_loss", "triplet_margin_loss", "supcon_loss"])
def test_compile(loss):
    torch._dynamo.reset()
    fn = LOSSES[loss][0]
    for n in (20, 27):
        e, labels = make((n, 5), torch.float32, seed=n).requires_grad_(), make_labels(n, 4, seed=n)
        pairs = mined("PairMarginMiner", "euclidean", e.detach(), labels)
        triplets = mined("TripletMarginMiner-hard", "cosine", e.detach(), labels)
        check_compile(
            lambda x, lab, a1, p, a2, nn: fn(x, lab, "euclidean", indices_tuple=(a1, p, a2, nn)), e, labels, *pairs
        )
        check_compile(lambda x, lab, a, p, nn: fn(x, lab, "cosine", indices_tuple=(a, p, nn)), e, labels, *triplets)


def test_modules_take_the_tuple_by_keyword():
    e, labels = make((20, 5), seed=16), make_labels(20, 4, seed=16)
    t = mined("TripletMarginMiner-hard", "euclidean", e, labels)
    m = torchkit.nn.TripletMarginLoss(0.2)
    assert m(e, labels, indices_tuple=t) == ops.triplet_margin_loss(e, labels, 0.2, indices_tuple=t)
    with pytest.raises(TypeError, match=r"^TripletMarginLoss: ref_embeddings must be a Tensor .* indices_tuple="):
        m(e, labels, t)  # (PML's positional order)
    pairs = mined("PairMarginMiner", "cosine", e, labels)
    assert torchkit.nn.MultiSimilarityLoss()(e, labels, indices_tuple=pairs) == losses.MultiSimilarityLoss()(
        e, labels, pairs
    )


def test_needs_no_kernel():
    """The listed loss is PyTorch operations (and torchkit.ops.cdist): any device, meta included
    (where the losses' kernels are not asked for), shapes and dtypes as on the CPU."""
    e, labels = make((12, 4), torch.float32).to("meta"), make_labels(12, 3).to("meta")
    pairs = tuple(torch.tensor(v, device="meta") for v in ([0, 1], [1, 0], [0, 2], [3, 3]))
    for loss, extra in (
        ("contrastive_loss", {}),
        ("supcon_loss", {}),
        ("multi_similarity_loss", {"miner_epsilon": None}),
    ):
        out = getattr(ops, loss)(e, labels, indices_tuple=pairs, **extra)
        assert out.device.type == "meta" and out.shape == () and out.dtype == torch.float32


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
def test_gathered_rows_and_the_matrix_give_one_loss(monkeypatch, distance):
    """A short list gathers its pairs' rows, a long one indexes the exact N × M matrix
    (_listed_pairs.GATHER_FRACTION): both give the same values and gradients, ties included
    (a collapsed batch's equal and zero rows), with and without refs."""
    from test_pair_losses import collapsed

    from torchkit.ops import _listed_pairs

    e, labels = collapsed(24, torch.float64, seed=2)
    ref, ref_labels = e[:10].flip(0).clone(), labels[:10].flip(0)
    results = []
    for fraction in (0.0, float("inf")):
        monkeypatch.setattr(_listed_pairs, "GATHER_FRACTION", fraction)
        out = []
        for r, rl in ((None, None), (ref, ref_labels)):
            x, y = e.clone().requires_grad_(), None if r is None else r.clone().requires_grad_()
            t = mined("TripletMarginMiner-easy", distance, e, labels, r, rl)
            loss = ops.triplet_margin_loss(
                x, labels, 0.1, distance=distance, indices_tuple=t, ref_embeddings=y, ref_labels=rl
            )
            loss = loss + ops.contrastive_loss(
                x, labels, 0.9, 0.1, distance=distance, indices_tuple=t, ref_embeddings=y, ref_labels=rl
            )
            if distance == "cosine":  # (the matrix losses: PML's dense masks on a long list)
                kw = dict(indices_tuple=t, ref_embeddings=y, ref_labels=rl)
                loss = loss + ops.supcon_loss(x, labels, **kw) + ops.ntxent_loss(x, labels, **kw)
                loss = loss + ops.multi_similarity_loss(x, labels, miner_epsilon=None, **kw)
            out += [loss, *torch.autograd.grad(loss, [x] if y is None else [x, y])]
        results.append(out)
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * max(1.0, b.abs().max().item()))


@pytest.mark.parametrize("fraction", [0.0, float("inf")])  # (the matrix, the gathered rows)
def test_rows_not_finite(monkeypatch, fraction):
    """A NaN or ∞ row in a listed pair makes the loss NaN (PML drops such terms, see docs); one
    in no listed pair takes no part: the loss and the other rows' gradients are finite, its
    own gradient 0."""
    from torchkit.ops import _listed_pairs

    monkeypatch.setattr(_listed_pairs, "GATHER_FRACTION", fraction)
    e, labels = make((12, 4), seed=17), make_labels(12, 3, seed=17)
    e[10, 1], e[11, 2] = float("nan"), float("inf")
    pairs = (torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5]), torch.tensor([0, 1]), torch.tensor([6, 7]))
    for loss in ("contrastive_loss", "supcon_loss", "triplet_margin_loss"):
        x = e.clone().requires_grad_()
        out = getattr(ops, loss)(x, labels, indices_tuple=pairs)
        (g,) = torch.autograd.grad(out, x)
        assert out.isfinite() and g[:10].isfinite().all() and not g[10:].any(), loss
        for bad in (10, 11):
            listed = (pairs[0], torch.tensor([bad, 4, 5]), *pairs[2:])  # (anchor 0: in a triplet too)
            assert getattr(ops, loss)(e, labels, indices_tuple=listed).isnan(), (loss, bad)
