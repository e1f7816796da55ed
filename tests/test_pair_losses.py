"""The pair losses (supcon_loss, ntxent_loss, contrastive_loss, triplet_margin_loss with each
mining) against pytorch-metric-learning (the oracle, with its miners), the float64 references
(torchkit.reference) and their own edge cases."""

import os
import subprocess
import sys

import pytest
import torch
from pytorch_metric_learning import losses, miners
from pytorch_metric_learning.distances import CosineSimilarity
from testing import (
    check_compile,
    check_compiled_refuses_like_eager,
    check_gradcheck,
    check_meta_refuses_like_eager,
    check_opcheck,
    compiled,
)

import torchkit
from torchkit import ops, reference

# loss -> stats columns per anchor (csrc/pair_losses.h)
COLUMNS = {
    "supcon_loss": 2,
    "ntxent_loss": 3,
    "contrastive_loss": 2,
    "triplet_margin_loss": 3,
    "multi_similarity_loss": 5,
}
NAMES = list(COLUMNS)
# Each loss with its default parameters, the triplet loss with each mining, and the Euclidean
# losses with distance="cosine" (before their defaults: dict(VARIANTS)[loss] is the last).
VARIANTS = [
    ("supcon_loss", {"temperature": 0.1}),
    ("ntxent_loss", {"temperature": 0.07}),
    ("contrastive_loss", {"pos_margin": 1.0, "neg_margin": 0.0, "distance": "cosine"}),
    ("contrastive_loss", {"pos_margin": 0.0, "neg_margin": 1.0, "distance": "euclidean"}),
    ("triplet_margin_loss", {"margin": 0.05, "mining": "semi_hard", "distance": "cosine"}),
    ("triplet_margin_loss", {"margin": 0.05, "mining": "all", "distance": "euclidean"}),
    ("triplet_margin_loss", {"margin": 0.05, "mining": "semi_hard", "distance": "euclidean"}),
    ("triplet_margin_loss", {"margin": 0.05, "mining": "batch_hard", "distance": "euclidean"}),
    ("multi_similarity_loss", {"alpha": 2.0, "beta": 50.0, "base": 0.5, "miner_epsilon": 0.1}),
]


def _variant_id(loss, params):
    name = loss if loss != "triplet_margin_loss" else f"triplet-{params['mining']}"
    return f"{name}-cosine" if params.get("distance") == "cosine" else name


VARIANT_IDS = [_variant_id(*v) for v in VARIANTS]
# ... and with other parameters, for the comparisons with PML.
CONFIGS = [
    *VARIANTS,
    ("supcon_loss", {"temperature": 0.5}),
    ("ntxent_loss", {"temperature": 0.5}),
    ("contrastive_loss", {"pos_margin": 0.3, "neg_margin": 1.2, "distance": "euclidean"}),
    ("contrastive_loss", {"pos_margin": 0.8, "neg_margin": 0.3, "distance": "cosine"}),
    ("contrastive_loss", {"pos_margin": 0.0, "neg_margin": 1.0, "distance": "cosine"}),
    ("triplet_margin_loss", {"margin": 0.3, "mining": "all", "distance": "euclidean"}),
    ("triplet_margin_loss", {"margin": 0.3, "mining": "semi_hard", "distance": "euclidean"}),
    ("triplet_margin_loss", {"margin": 0.0, "mining": "batch_hard", "distance": "euclidean"}),
    ("triplet_margin_loss", {"margin": 0.2, "mining": "all", "distance": "cosine"}),
    ("triplet_margin_loss", {"margin": 0.1, "mining": "batch_hard", "distance": "cosine"}),
    ("triplet_margin_loss", {"margin": -0.05, "mining": "semi_hard", "distance": "cosine"}),
    ("multi_similarity_loss", {"alpha": 2.0, "beta": 50.0, "base": 0.5, "miner_epsilon": None}),
    ("multi_similarity_loss", {"alpha": 1.0, "beta": 10.0, "base": 0.2, "miner_epsilon": 0.5}),
]
CONFIG_IDS = ["-".join([loss.removesuffix("_loss"), *map(str, p.values())]) for loss, p in CONFIGS]
variants = pytest.mark.parametrize("loss,params", VARIANTS, ids=VARIANT_IDS)
configs = pytest.mark.parametrize("loss,params", CONFIGS, ids=CONFIG_IDS)

# The losses with Triton kernels (torchkit/triton/pair_losses.py): the tests taking a `device`
# run them too, under Triton's interpreter on CPU tensors ("triton"; skipped where a GPU is
# visible, where test_triton_on_cuda_matches_the_cpu_kernel runs them compiled).
TRITON = ("supcon_loss", "ntxent_loss", "contrastive_loss", "multi_similarity_loss")  # and proxy_anchor_loss
TRITON_MINING = ("all", "semi_hard", "batch_hard")  # triplet_margin_loss's minings that have them
TRITON_MARK = pytest.mark.triton("pair_losses")


def has_triton(loss, params=None):
    if params is not None and params.get("distance", "euclidean") != "euclidean":
        return False  # (the CPU kernel's alone: test_triton_refuses_the_cosine_distance)
    return loss in TRITON or (loss == "triplet_margin_loss" and params["mining"] in TRITON_MINING)


def with_kernels(cases, ids, names="loss,params,device", triton=lambda *case: True):
    """Each (loss, params, ...) case on the CPU kernel, and again through the Triton kernels for
    the losses that have them where `triton(*case)` says so: a test whose cases only vary what
    the configuration tests below already cover (float64 values, ragged shapes, refs) runs one
    slice of them through the interpreter, not all of them again."""
    out = [pytest.param(*case, "cpu", id=i) for case, i in zip(cases, ids, strict=True)]
    out += [
        pytest.param(*case, "cpu", id=f"{i}-triton", marks=TRITON_MARK)
        for case, i in zip(cases, ids, strict=True)
        if has_triton(*case[:2]) and triton(*case)
    ]
    return pytest.mark.parametrize(names, out)


variants_k = with_kernels(VARIANTS, VARIANT_IDS)
# A test of one loss that has Triton kernels, on each kernel.
kernels = pytest.mark.parametrize(
    "device", [pytest.param("cpu", id="cpu"), pytest.param("cpu", id="triton", marks=TRITON_MARK)]
)


def raw(loss):
    return getattr(torch.ops.torchkit, loss).default, getattr(torch.ops.torchkit, f"_{loss}_backward").default


def make(shape, dtype=torch.float64, seed=0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (offset + torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)


def make_labels(n, classes, seed=0, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed + 100)
    return torch.randint(classes, (n,), generator=g).to(dtype)


def pml(loss, params):
    """PML's loss (with the miner the parameters name) as a function of the inputs."""

    distance = {"distance": CosineSimilarity()} if params.get("distance") == "cosine" else {}

    def fn(embeddings, labels, ref=None, ref_labels=None):
        kw = dict(ref_emb=ref, ref_labels=ref_labels)
        if loss == "supcon_loss":
            return losses.SupConLoss(**params)(embeddings, labels, **kw)
        if loss == "ntxent_loss":
            return losses.NTXentLoss(**params)(embeddings, labels, **kw)
        if loss == "contrastive_loss":
            margins = {k: v for k, v in params.items() if k != "distance"}
            return losses.ContrastiveLoss(**margins, **distance)(embeddings, labels, **kw)
        if loss == "multi_similarity_loss":
            ms = losses.MultiSimilarityLoss(alpha=params["alpha"], beta=params["beta"], base=params["base"])
            if params["miner_epsilon"] is None:
                return ms(embeddings, labels, **kw)
            miner = miners.MultiSimilarityMiner(epsilon=params["miner_epsilon"])
            return ms(embeddings, labels, miner(embeddings, labels, ref, ref_labels), **kw)
        margin, mining = params["margin"], params["mining"]
        triplet = losses.TripletMarginLoss(margin=margin, **distance)
        if mining == "all":
            return triplet(embeddings, labels, **kw)
        miner = (
            miners.BatchHardMiner(**distance)
            if mining == "batch_hard"
            else miners.TripletMarginMiner(margin=margin, type_of_triplets="semihard", **distance)
        )
        return triplet(embeddings, labels, miner(embeddings, labels, ref, ref_labels), **kw)

    return fn


def loss_and_grads(fn, e, labels, ref=None, ref_labels=None):
    leaves = [t.detach().clone().requires_grad_() for t in (e, ref) if t is not None]
    out = fn(leaves[0], labels, *(leaves[1:2] or [None]), ref_labels)
    grads = torch.autograd.grad(out, leaves, allow_unused=True) if out.requires_grad else [None] * len(leaves)
    return out.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)]


def ours(loss, params):
    def fn(e, labels, ref=None, ref_labels=None):
        return getattr(ops, loss)(e, labels, **params, ref_embeddings=ref, ref_labels=ref_labels)

    return fn


def ref_fn(loss, params):
    def fn(e, labels, ref=None, ref_labels=None):
        return getattr(reference, loss)(e, labels, **params, ref_embeddings=ref, ref_labels=ref_labels)

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


# Through the Triton kernels, every configuration in float32 on the first case: the configuration
# tests compare them with the CPU kernel in float64 at 1e-12 on ragged shapes, with and without
# refs, and the CPU kernel meets PML on every case here.
@with_kernels(
    [(*config, dtype, *case) for config in CONFIGS for dtype in (torch.float64, torch.float32) for case in CASES],
    [
        f"{i}-{dtype}-{'-'.join(map(str, case))}"
        for i in CONFIG_IDS
        for dtype in ("float64", "float32")
        for case in CASES
    ],
    "loss,params,dtype,N,C,D,M,device",
    triton=lambda loss, params, dtype, *case: dtype == torch.float32 and case == CASES[0],
)
def test_matches_pytorch_metric_learning(loss, params, dtype, N, C, D, M, device):
    e = make((N, D), dtype, seed=1)
    labels = make_labels(N, C)
    ref = None if M is None else make((M, D), dtype, seed=2)
    ref_labels = None if M is None else make_labels(M, C, seed=3)
    got, got_grads = loss_and_grads(ours(loss, params), e, labels, ref, ref_labels)
    exp, exp_grads = loss_and_grads(pml(loss, params), e, labels, ref, ref_labels)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got, exp, **tol)
    for a, b in zip(got_grads, exp_grads, strict=True):
        torch.testing.assert_close(a, b, **tol)


@with_kernels(
    [(*v, M) for v in VARIANTS for M in (None, 90)],
    [f"{i}-{M}" for i in VARIANT_IDS for M in (None, 90)],
    "loss,params,M,device",
    # Through Triton: with refs, and for the triplet band kernel with semi-hard mining only
    # (all triplets run the same kernel, one condition fewer).
    triton=lambda loss, params, M: M is not None and params.get("mining") != "all",
)
def test_float32_is_within_1e5_of_float64(loss, params, M, device):
    """Loss and gradients of float32 inputs against the float64 reference on the same values,
    relative to the largest gradient entry (through the Triton kernels with refs, the anchors'
    own pairs in float32 being test_matches_pytorch_metric_learning's)."""
    e = make((200, 64), torch.float32, seed=4, offset=0.3)
    labels = make_labels(200, 10)
    ref = None if M is None else make((M, 64), torch.float32, seed=5)
    ref_labels = None if M is None else make_labels(M, 10, seed=6)
    got, got_grads = loss_and_grads(ours(loss, params), e, labels, ref, ref_labels)
    exp, exp_grads = loss_and_grads(
        ref_fn(loss, params), e.double(), labels, None if ref is None else ref.double(), ref_labels
    )
    assert abs(got.double() - exp).item() <= 1e-5 * exp.abs().item()
    for a, b in zip(got_grads, exp_grads, strict=True):
        assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max()


# Through Triton, the triplet band kernel with semi-hard mining only (as above).
@with_kernels(VARIANTS, VARIANT_IDS, triton=lambda loss, params: params.get("mining") != "all")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_accumulates_in_float32(loss, params, dtype, device):
    e = make((100, 32), torch.float64, seed=7).to(dtype)
    labels = make_labels(100, 8)
    got, (g,) = loss_and_grads(ours(loss, params), e, labels)
    exp, (g64,) = loss_and_grads(ref_fn(loss, params), e.double(), labels)
    assert got.dtype == g.dtype == dtype
    eps = torch.finfo(dtype).eps
    assert abs(got.double() - exp).item() <= 2 * eps * exp.abs().item()
    assert (g.double() - g64).abs().max() <= 4 * eps * g64.abs().max()


@variants
def test_real_embeddings(loss, params):
    """sklearn's digits (64 pixel features, 10 classes) as embeddings, against PML (NT-Xent and
    all triplets on fewer: PML's (positive pairs × negative pairs) matrix for 600 digits is
    46 GB, and its N×N×N triplet mask 216 MB). The CPU kernel only: the Triton kernels meet it
    in the configuration tests, ties between exact distances included."""
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    few = loss == "ntxent_loss" or params.get("mining") in ("all", "semi_hard")
    n = 150 if few else 600
    e = torch.tensor(digits.data[:n], dtype=torch.float32)
    labels = torch.tensor(digits.target[:n])
    for ref_rows in (None, slice(n, n + n // 2)):
        ref = None if ref_rows is None else torch.tensor(digits.data[ref_rows], dtype=torch.float32)
        ref_labels = None if ref_rows is None else torch.tensor(digits.target[ref_rows])
        got, got_grads = loss_and_grads(ours(loss, params), e, labels, ref, ref_labels)
        exp, exp_grads = loss_and_grads(pml(loss, params), e, labels, ref, ref_labels)
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)
        for a, b in zip(got_grads, exp_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@with_kernels(
    [
        ("contrastive_loss", {"pos_margin": 0.0, "neg_margin": 1.0}),
        ("triplet_margin_loss", {"margin": 1.0, "mining": "all"}),
        ("triplet_margin_loss", {"margin": 0.1, "mining": "batch_hard"}),
    ],
    ["contrastive", "triplet-all", "triplet-batch_hard"],
)
def test_near_duplicates_far_from_the_origin(loss, params, device):
    """Tight clusters (spread 1e-4 around 8 far-apart centres): the normalised rows' distances
    come from their differences, where PML's torch.cdist takes |a|² + |b|² − 2a·b and loses
    them to cancellation (its float32 loss is off by a factor of 3 here); torchkit's float32
    loss and gradients are float64's."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(8, 64, generator=g, dtype=torch.float64).repeat_interleave(8, 0)
    x = centres + 1e-4 * torch.randn(64, 64, generator=g, dtype=torch.float64)
    labels = torch.arange(8).repeat_interleave(8)
    e = x.float()
    got, (g32,) = loss_and_grads(ours(loss, params), e, labels)
    exp, (g64,) = loss_and_grads(ref_fn(loss, params), e.double(), labels)
    assert abs(got.double() - exp).item() <= 1e-5 * exp.abs().item()
    assert (g32.double() - g64).abs().max() <= 1e-5 * g64.abs().max()
    if loss == "contrastive_loss":  # PML's float32 value, wrong
        assert abs(pml(loss, params)(e, labels).double() - exp).item() > 0.5 * exp.abs().item()


@with_kernels(
    [
        ("contrastive_loss", {"pos_margin": 0.0, "neg_margin": 1.0}),
        ("triplet_margin_loss", {"margin": 0.2, "mining": "all"}),
        ("triplet_margin_loss", {"margin": 0.2, "mining": "semi_hard"}),
        ("triplet_margin_loss", {"margin": 0.2, "mining": "batch_hard"}),
    ],
    ["contrastive", "triplet-all", "triplet-semi_hard", "triplet-batch_hard"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_feature_rows_lie_at_0_and_2_exactly(loss, params, dtype, device):
    """With D = 1, F.normalize's rows are exactly ±1: rows of one sign lie at distance 0 and
    opposite ones at 2, also in the exact recomputations (x·(1/|x|) is 1 − ulp for many x: a
    positive pair at 1e-16 counts as a non-zero term of contrastive_loss at pos_margin = 0 and
    makes a negative semi-hard). Rows of every scale, the clamped ones (|x| < 1e-12) apart."""
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        e = torch.randn(17, 1, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-6, 7, (17, 1), generator=g)
        e = e.to(dtype)
        labels = torch.randint(0, 3, (17,), generator=g)
        got = ours(loss, params)(e, labels)
        torch.testing.assert_close(got, pml(loss, params)(e, labels), rtol=1e-6, atol=1e-7)


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_multi_similarity_one_feature_cosines_are_exactly_1_and_minus_1(dtype, device):
    """With D = 1 the cosines are exactly ±1: with miner_epsilon = 0 the miner keeps no pair of
    cosines equal to the anchor's hardest (x·(1/|x|) rounded below 1 kept them). The loss is
    the one of the exact cosines, sign(x_i)·sign(x_j)."""
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(10, 1, generator=g, dtype=torch.float64) * 3).to(dtype)
        labels = torch.randint(0, 3, (10,), generator=g)
        got = ops.multi_similarity_loss(x, labels, miner_epsilon=0.0).double()
        s = torch.sign(x.double()) @ torch.sign(x.double()).T
        same = labels[:, None] == labels[None, :]
        positive, negative = same & ~torch.eye(10, dtype=torch.bool), ~same
        hard_negative = torch.where(negative, s, -torch.inf).amax(1, keepdim=True)
        hard_positive = torch.where(positive, s, torch.inf).amin(1, keepdim=True)
        kept_p, kept_n = positive & (s < hard_negative), negative & (s > hard_positive)
        lp = torch.log1p(torch.where(kept_p, torch.exp(-2.0 * (s - 0.5)), 0.0).sum(1)) / 2.0
        ln = torch.log1p(torch.where(kept_n, torch.exp(50.0 * (s - 0.5)), 0.0).sum(1)) / 50.0
        some = kept_p.sum() > 1 or kept_n.sum() > 1
        torch.testing.assert_close(got, (lp + ln).mean() if some else got.new_zeros(()), rtol=1e-6, atol=0)


@variants_k
def test_any_integer_label_dtype(loss, params, device):
    e = make((40, 6), torch.float32)
    labels = make_labels(40, 5)
    fn = getattr(ops, loss)
    expected = fn(e, labels, **params)
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32):
        assert torch.equal(fn(e, labels.to(dtype), **params), expected), dtype


@variants_k
@pytest.mark.parametrize(
    "labels,why",
    [
        (torch.arange(6), "no positive pair"),
        (torch.zeros(6, dtype=torch.long), "no negative pair"),
        (torch.tensor([0]), "one embedding"),
        (torch.zeros(0, dtype=torch.long), "an empty batch"),
    ],
)
def test_no_pairs_of_one_kind_is_pmls_value(loss, params, labels, why, device):
    """PML's convention: 0 with zero gradients (its zero_losses), not NaN; the contrastive loss's
    other kind of pair still counts."""
    e = make((len(labels), 4)).requires_grad_()
    out = getattr(ops, loss)(e, labels, **params)
    if len(labels) == 0 and params.get("mining") == "batch_hard":
        with pytest.raises(IndexError):  # PML's BatchHardMiner fails on an empty batch
            pml(loss, params)(e, labels)
        exp = torch.zeros((), dtype=e.dtype)
    else:
        exp = pml(loss, params)(e, labels)
    torch.testing.assert_close(out.detach(), exp.detach(), rtol=1e-12, atol=0)
    if exp.item() == 0:
        (g,) = torch.autograd.grad(out, e, allow_unused=True, materialize_grads=True)
        assert torch.equal(g, torch.zeros_like(e)), why


@with_kernels(
    [("supcon_loss",), ("ntxent_loss",), ("contrastive_loss",)], ["supcon", "ntxent", "contrastive"], "loss,device"
)
def test_one_positive_and_one_negative_pair_is_zero_as_in_pml(loss, device):
    """PML's pair losses return 0 when every index list has at most one entry: one anchor, two
    refs, one of each kind. The gradients are then 0, a NaN row's too (the rule looks at the
    pairs, not their values)."""
    e, labels = make((1, 4)), torch.tensor([0])
    ref, ref_labels = make((2, 4), seed=1), torch.tensor([0, 1])
    params = dict(VARIANTS)[loss]
    assert getattr(ops, loss)(e, labels, **params, ref_embeddings=ref, ref_labels=ref_labels).item() == 0
    assert pml(loss, params)(e, labels, ref, ref_labels).item() == 0
    ref[1, 0] = float("nan")
    e, ref = e.requires_grad_(), ref.requires_grad_()
    out = getattr(ops, loss)(e, labels, **params, ref_embeddings=ref, ref_labels=ref_labels)
    assert out.item() == 0
    for g, x in zip(torch.autograd.grad(out, (e, ref)), (e, ref), strict=True):
        assert torch.equal(g, torch.zeros_like(x)), g


@kernels
def test_supcon_anchor_without_positives_adds_nothing(device):
    """Labels 0, 0, 1: the lone 1 is nobody's positive but everyone's negative; the mean is over
    the two anchors with a positive."""
    e = make((3, 4))
    labels = torch.tensor([0, 0, 1])
    torch.testing.assert_close(ops.supcon_loss(e, labels), pml("supcon_loss", {"temperature": 0.1})(e, labels))
    x = torch.nn.functional.normalize(e, dim=1)
    s = x @ x.T / 0.1
    per = [torch.logsumexp(s[i, [j for j in range(3) if j != i]], 0) - s[i, 1 - i] for i in (0, 1)]
    torch.testing.assert_close(ops.supcon_loss(e, labels), (per[0] + per[1]) / 2)


@kernels
def test_ntxent_each_positive_pair_against_its_anchors_negatives(device):
    """Labels 0, 0, 0, 1: six positive pairs, each a softmax of its similarity against its
    anchor's one negative (row 3); the mean is over the pairs."""
    e = make((4, 5), seed=3)
    labels = torch.tensor([0, 0, 0, 1])
    x = torch.nn.functional.normalize(e, dim=1)
    s = x @ x.T / 0.2
    pairs = [(i, p) for i in range(3) for p in range(3) if i != p]
    expected = torch.stack([torch.logaddexp(s[i, p], s[i, 3]) - s[i, p] for i, p in pairs]).mean()
    torch.testing.assert_close(ops.ntxent_loss(e, labels, 0.2), expected)


@kernels
def test_ntxent_a_pair_loss_is_bounded_as_in_pml(device):
    """PML adds its small_val (the smallest normal) inside the log: a pair whose softmax
    underflows costs −log(tiny), about 87.3 in float32, not ∞."""
    e = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [1.0, 0.0]])  # the positive pair is opposite
    labels = torch.tensor([0, 0, 1])
    got = ops.ntxent_loss(e, labels, 0.01)
    exp = pml("ntxent_loss", {"temperature": 0.01})(e, labels)
    torch.testing.assert_close(got, exp)
    assert torch.isfinite(got)


@kernels
def test_contrastive_each_kind_is_a_mean_of_its_terms_above_zero(device):
    """Four points on a line: the positive pairs' d − 0.1 and the negative pairs' 1 − d that are
    > 0, each kind averaged on its own, then added."""
    e = torch.tensor([[1.0, 0.0], [1.0, 0.2], [1.0, 0.5], [1.0, 3.0]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 1])
    x = torch.nn.functional.normalize(e, dim=1)
    d = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist")
    pos = torch.stack([d[0, 1], d[1, 0], d[2, 3], d[3, 2]]) - 0.1
    neg = 1 - torch.stack([d[i, j] for i in range(4) for j in range(4) if (i < 2) != (j < 2)])
    expected = pos[pos > 0].mean() + neg[neg > 0].mean()
    torch.testing.assert_close(ops.contrastive_loss(e, labels, 0.1, 1.0), expected)


def test_triplet_minings_pick_pmls_triplets():
    """Five points on a circle's arc, two classes: every triplet by hand, then the semi-hard ones
    (d_ap < d_an < d_ap + margin) and the batch-hard one per anchor (farthest positive, nearest
    negative)."""
    angles = torch.tensor([0.0, 0.3, 0.5, 0.9, 1.6], dtype=torch.float64)
    e = torch.stack([angles.cos(), angles.sin()], 1)
    labels = torch.tensor([0, 1, 0, 1, 0])
    d = torch.cdist(e, e)
    margin = 0.4
    triplets = [
        (a, p, n)
        for a in range(5)
        for p in range(5)
        for n in range(5)
        if a != p and labels[a] == labels[p] and labels[a] != labels[n]
    ]

    def mean_of(ts):
        v = torch.stack([d[a, p] - d[a, n] + margin for a, p, n in ts])
        return v[v > 0].mean()

    torch.testing.assert_close(ops.triplet_margin_loss(e, labels, margin), mean_of(triplets))
    semi = [(a, p, n) for a, p, n in triplets if d[a, p] < d[a, n] < d[a, p] + margin]
    torch.testing.assert_close(ops.triplet_margin_loss(e, labels, margin, mining="semi_hard"), mean_of(semi))
    hard = []
    for a in range(5):
        pos = [j for j in range(5) if j != a and labels[j] == labels[a]]
        neg = [j for j in range(5) if labels[j] != labels[a]]
        hard.append((a, max(pos, key=lambda j: d[a, j]), min(neg, key=lambda j: d[a, j])))
    torch.testing.assert_close(ops.triplet_margin_loss(e, labels, margin, mining="batch_hard"), mean_of(hard))


def exact_distances(e, r):
    """The float64 distances of F.normalize's rows, per pair as Σ(e_i − e_j)²: a pair of equal
    rows is at exactly the same distance from every row; a zero row (F.normalize leaves it 0)
    at exactly 1 from a row of norm > eps."""
    x, y = (torch.nn.functional.normalize(t.double(), dim=1) for t in (e, r))
    d = (x[:, None, :] - y[None, :, :]).pow(2).sum(-1).sqrt()
    zero_e, zero_r = (e == 0).all(1), (r == 0).all(1)
    unit_e, unit_r = e.double().norm(dim=1) > 1e-12, r.double().norm(dim=1) > 1e-12
    d[(zero_e[:, None] & unit_r[None, :]) | (unit_e[:, None] & zero_r[None, :])] = 1.0
    return d


def exact_pair_loss(loss, params, e, labels):
    """contrastive_loss or triplet_margin_loss ("all", "semi_hard") on exact_distances, as PML
    defines them: the means of the terms > 0. distance="cosine": the float64 reference, whose
    similarities are exact at these ties (0 with a zero row, 1 between equal rows)."""
    if params.get("distance") == "cosine":
        return ref_fn(loss, params)(e.double(), labels)
    d = exact_distances(e, e)
    same = labels[:, None] == labels[None, :]
    positive = same & ~torch.eye(len(labels), dtype=torch.bool)

    def mean_above_0(terms):
        terms = terms[terms > 0]
        return terms.mean() if terms.numel() else terms.new_zeros(())

    if loss == "contrastive_loss":
        return mean_above_0(d[positive] - params["pos_margin"]) + mean_above_0(params["neg_margin"] - d[~same])
    term = d[:, :, None] - d[:, None, :] + params["margin"]  # [a, p, n]
    kept = positive[:, :, None] & ~same[:, None, :]
    if params["mining"] == "semi_hard":
        kept &= d[:, :, None] < d[:, None, :]
    return mean_above_0(term[kept])


def triplets_counted(e, labels, margin, mining):
    """Per anchor, its triplets with d_ap − d_an + margin > 0 (semi_hard: and d_ap < d_an), on
    exact distances: the stats' third column."""
    d = exact_distances(e, e)
    same = labels[:, None] == labels[None, :]
    positive = same & ~torch.eye(len(labels), dtype=torch.bool)
    term = d[:, :, None] - d[:, None, :] + margin  # [a, p, n]
    hit = (term > 0) & positive[:, :, None] & ~same[:, None, :]
    if mining == "semi_hard":
        hit &= d[:, :, None] < d[:, None, :]
    return hit.sum((1, 2))


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("margin,mining", [(0.0, "all"), (0.05, "semi_hard"), (0.0, "semi_hard")])
def test_triplet_ties_are_decided_on_exact_distances(dtype, margin, mining, device):
    """A negative row bit-identical to a positive (d_an = d_ap exactly) is no semi-hard
    triplet, and with margin 0 no term > 0: the triplets counted are the exact distances'
    (positives' distances rounded to float32 counted about half of them)."""
    for seed in range(4):
        e, labels = make((10, 8), dtype, seed=seed), make_labels(10, 3, seed=seed)
        i, j = 2 * seed, 2 * seed + 1
        e[j] = e[i]
        labels[j] = (labels[i] + 1) % 3
        _, stats = raw("triplet_margin_loss")[0](e, labels, None, None, margin, mining)
        assert torch.equal(stats[:, 2], triplets_counted(e, labels, margin, mining)), seed


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_zero_row_lies_at_exactly_1_from_every_row(dtype, device):
    """F.normalize leaves a zero row 0, at distance exactly 1 from every normalised row: no
    negative pair there counts at contrastive_loss's neg_margin = 1, no triplet at margin 0
    (rounded to 1 − 1e-16 they added spurious terms to the mean)."""
    for seed in range(4):
        e, labels = make((12, 4), dtype, seed=seed), make_labels(12, 3, seed=seed)
        e[3 * seed] = 0
        d = exact_distances(e, e)
        negative = labels[:, None] != labels[None, :]
        _, stats = raw("contrastive_loss")[0](e, labels, None, None, 0.0, 1.0)
        assert round(1 / stats[0, 1].item()) == ((1 - d)[negative] > 0).sum(), seed
        for mining in ("all", "semi_hard"):
            _, stats = raw("triplet_margin_loss")[0](e, labels, None, None, 0.0, mining)
            assert torch.equal(stats[:, 2], triplets_counted(e, labels, 0.0, mining)), (seed, mining)


def collapsed(n, dtype, seed, zero=True):
    """n rows drawn from 3 points (and 0, with either sign of its entries, where `zero`; else
    twice a point, equal once normalised), as a collapsed model gives them; row 5 a copy of row
    4 but for one entry, 2^-12 apart, under its label: near, yet no copy (pos_margin = 0 counts
    its distance; its gradient's direction, a difference of rows 1e-4 apart, is rounded to
    ~1e-12 in float64)."""
    g = torch.Generator().manual_seed(seed)
    points = torch.randn(4, 16, generator=g, dtype=torch.float64).to(dtype)
    points[3] = 0 if zero else points[0] * 2
    e = points[torch.randint(4, (n,), generator=g)]
    e[4] = points[1]
    e[5] = e[4]
    e[5, 7] *= 1 + 2**-12
    e[(e == 0).all(1).nonzero()[::2, 0]] *= -1  # −0 rows
    labels = make_labels(n, 3, seed=seed)
    labels[5] = labels[4]
    return e, labels


# Through Triton in float32 (its groups of equal rows are dtype-blind: test_triton_groups_of_equal_rows).
@with_kernels(
    [(*v, dtype) for v in VARIANTS for dtype in (torch.float64, torch.float32)],
    [f"{i}-{dtype}" for i in VARIANT_IDS for dtype in ("float64", "float32")],
    "loss,params,dtype,device",
    triton=lambda loss, params, dtype: dtype == torch.float32,
)
def test_collapsed_batches(loss, params, dtype, device):
    """Equal rows are one group (csrc/cpu/pair_losses_cpu.h's equal_rows), their distances 0
    and cosines one value without a computation: with refs holding copies of the anchors, the
    loss and gradients are the float64 reference's; a row one ulp from another is no copy; with
    zero rows (±0), the exact distances' loss (PML's rounding breaks their ties at 1)."""
    tol, grad_tol = (1e-12, 1e-10) if dtype == torch.float64 else (1e-5, 1e-5)
    for seed in range(2):
        e, labels = collapsed(24, dtype, seed, zero=False)
        ref, ref_labels = collapsed(20, dtype, seed + 10, zero=False)
        ref[:6], ref_labels[:6] = e[:6], labels[:6]
        for r, rl in ((None, None), (ref, ref_labels)):
            got, got_grads = loss_and_grads(ours(loss, params), e, labels, r, rl)
            exp, exp_grads = loss_and_grads(
                ref_fn(loss, params), e.double(), labels, None if r is None else r.double(), rl
            )
            assert abs(got.double() - exp).item() <= tol * max(exp.abs().item(), 1e-3), (seed, r is None)
            for a, b in zip(got_grads, exp_grads, strict=True):
                assert (a.double() - b).abs().max() <= grad_tol * max(b.abs().max(), 1e-3), (seed, r is None)
        if loss in ("contrastive_loss", "triplet_margin_loss") and params.get("mining") != "batch_hard":
            e, labels = collapsed(24, dtype, seed)
            exp = exact_pair_loss(loss, params, e, labels)
            assert abs(ours(loss, params)(e, labels).double() - exp).item() <= tol * exp.abs().item(), seed
            if loss == "contrastive_loss":  # the positive pair one ulp apart counts at pos_margin 0
                _, stats = raw(loss)[0](e, labels, None, None, 0.0, 1.0)
                d = exact_distances(e, e)
                positive = (labels[:, None] == labels[None, :]) & ~torch.eye(24, dtype=torch.bool)
                assert round(1 / stats[4, 0].item()) == (d[positive] > 0).sum() > 0, seed


# distance="cosine" (PML's CosineSimilarity()): its configurations meet PML in float64 and float32
# in test_matches_pytorch_metric_learning; here the half types, and the choices on adversarial data.
COSINE = [pytest.param(loss, p, id=i) for (loss, p), i in zip(CONFIGS, CONFIG_IDS, strict=True) if "cosine" in i]


@pytest.mark.parametrize("loss,params", COSINE)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cosine_half_types_match_pytorch_metric_learning(loss, params, dtype):
    """float16 and bfloat16 inputs (float32 accumulation) against PML in float64 on the same
    rounded values, with and without refs: within the type's rounding of the result."""
    e, labels = make((60, 16), seed=3).to(dtype), make_labels(60, 6)
    ref, ref_labels = make((25, 16), seed=4).to(dtype), make_labels(25, 6, seed=5)
    eps = torch.finfo(dtype).eps
    for r, rl in ((None, None), (ref, ref_labels)):
        got, got_grads = loss_and_grads(ours(loss, params), e, labels, r, rl)
        exp, exp_grads = loss_and_grads(pml(loss, params), e.double(), labels, None if r is None else r.double(), rl)
        assert got.dtype == dtype
        assert abs(got.double() - exp).item() <= 2 * eps * exp.abs().item()  # (0 for the semi-hard margin < 0)
        for a, b in zip(got_grads, exp_grads, strict=True):
            assert a.dtype == dtype and (a.double() - b).abs().max() <= 4 * eps * b.abs().max()


def quarter_turns(n, D, seed):
    """n float32 rows in one plane turned into D dimensions, at angles k·π/2 + ε (k = i mod 4,
    |ε| <= 5e-7), labels k mod 2: positives at cosine about ±1, negatives about 0: near
    neg_margin = 0, and pos_margin = 1 or a triplet margin of 1, within float32's error of a
    product of D terms (a tile's: ~(D + 4)·6e-8), where only the exact cosine decides. The
    float64 reference on the same float32 values gives those exact cosines."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    k = torch.arange(n) % 4
    theta = k * torch.pi / 2 + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 1e-6
    plane = torch.stack([theta.cos(), theta.sin()], 1) * (1 + torch.rand(n, 1, generator=g, dtype=torch.float64))
    return (plane @ q[:2]).float(), k % 2


@pytest.mark.parametrize("seed", [0, 1])
def test_cosine_contrastive_counts_the_exact_similarities(seed):
    """Which terms count (stats: 1/count of each kind) is the float64 reference's on every pair
    of quarter_turns, and so is the loss."""
    e, labels = quarter_turns(64, 24, seed)
    params = {"pos_margin": 1.0, "neg_margin": 0.0, "distance": "cosine"}
    _, stats = raw("contrastive_loss")[0](e, labels, None, None, *params.values())
    s = -reference._distances(e.double(), labels, None, None, "cosine")[0]
    same = labels[:, None] == labels[None, :]
    positive = same & ~torch.eye(64, dtype=torch.bool)
    pos, neg = (1.0 - s[positive] > 0).sum().item(), (s[~same] - 0.0 > 0).sum().item()
    near = (s[~same].abs() < 1.5e-6).sum().item()
    assert near == (~same).sum().item()  # (every negative pair within float32's tile error of 0)
    assert 0 < neg < near and pos > 0
    assert (round(1 / stats[0, 0].item()), round(1 / stats[0, 1].item())) == (pos, neg)
    exp = reference.contrastive_loss(e.double(), labels, **params)
    torch.testing.assert_close(ops.contrastive_loss(e, labels, **params).double(), exp, rtol=1e-6, atol=0)


@pytest.mark.parametrize("mining", ["all", "semi_hard"])
def test_cosine_triplets_count_the_exact_similarities(mining):
    """Per anchor, its triplets counted (stats' third column) are those with s_an − s_ap + 1 > 0
    (semi_hard: and s_ap > s_an) on the exact cosines: at margin 1 the near-duplicate
    positives' triplets hinge on the sign of s_an ≈ 0."""
    e, labels = quarter_turns(48, 16, 2)
    _, stats = raw("triplet_margin_loss")[0](e, labels, None, None, 1.0, mining, "cosine")
    s = -reference._distances(e.double(), labels, None, None, "cosine")[0]
    same = labels[:, None] == labels[None, :]
    positive = same & ~torch.eye(48, dtype=torch.bool)
    hit = (s[:, None, :] - s[:, :, None] + 1 > 0) & positive[:, :, None] & ~same[:, None, :]  # [a, p, n]
    if mining == "semi_hard":
        hit &= s[:, :, None] > s[:, None, :]
    term = s[:, None, :] - s[:, :, None] + 1
    near = (term.abs() < 1.5e-6) & positive[:, :, None] & ~same[:, None, :]
    assert 0 < (hit & near).sum() < near.sum()  # (the tiles cannot tell these)
    assert torch.equal(stats[:, 2], hit.sum((1, 2)))


@kernels
def test_triplet_batch_hard_ties_go_to_the_lower_index(device):
    """Anchor 0's positives 1 and 2 coincide, as do its negatives 3 and 4: the gradient reaches
    rows 1 and 3 only (refs 0 and 2)."""
    e = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.6, 0.8], [0.6, 0.8]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 0, 1, 1])
    ref = e[1:].clone().requires_grad_()  # anchor 0 against the other four
    out = ops.triplet_margin_loss(
        e[:1], labels[:1], 1.0, mining="batch_hard", ref_embeddings=ref, ref_labels=labels[1:]
    )
    (g,) = torch.autograd.grad(out, ref)
    assert g[0].abs().sum() > 0 and g[2].abs().sum() > 0
    assert g[1].abs().sum() == 0 and g[3].abs().sum() == 0


def positive_at(eps, s_n, side):
    """A float32 unit-ish row whose exact cosine with (1, 0) is s_n + eps + δ, 0 < |δ| < 2e-9
    with δ's sign `side`: far below float32's resolution of the cosine."""
    c = s_n + eps
    base = torch.tensor([c, (1 - c * c) ** 0.5], dtype=torch.float32)
    for i in range(-30, 31):
        for j in range(-30, 31):
            p = base + torch.tensor([i * 6e-8, j * 6e-8], dtype=torch.float32)
            delta = (p[0].double() / p.double().norm()).item() - eps - s_n
            if 0 < side * delta < 2e-9:
                return p
    raise AssertionError("no such row")


@kernels
@pytest.mark.parametrize("side", [1, -1])
def test_multi_similarity_miner_decides_on_exact_cosines(side, device):
    """A positive whose cosine minus ε lies within 2e-9 of its anchor's hardest negative's: the
    miner keeps it exactly when the float64 cosines say so (PML on float64 values), though
    float32 products cannot tell (δ's sign decides)."""
    n = torch.tensor([0.5403023, 0.84147096], dtype=torch.float32)
    s_n = (n[0].double() / n.double().norm()).item()
    e = torch.stack([torch.tensor([1.0, 0.0]), positive_at(0.1, s_n, side), n, torch.tensor([-1.0, 0.3])])
    labels = torch.tensor([0, 0, 1, 1])
    params = {"alpha": 2.0, "beta": 50.0, "base": 0.5, "miner_epsilon": 0.1}
    got = ops.multi_similarity_loss(e, labels, **params)
    exp = pml("multi_similarity_loss", params)(e.double(), labels)
    torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-6)


@kernels
@pytest.mark.parametrize("refs", [False, True])
@pytest.mark.parametrize("side", [1, -1])
def test_multi_similarity_miner_decides_on_exact_cosines_among_many(side, refs, device):
    """As above, with the near positive among 17 rows, past its anchor's own column (or the
    first nine rows against the others as refs, where there is none): its choice (loss and
    gradients against PML in float64) is the float64 cosines' wherever the pair lies in a row."""
    n = torch.tensor([0.5403023, 0.84147096], dtype=torch.float32)
    s_n = (n[0].double() / n.double().norm()).item()
    far = torch.tensor([[-1.0, 0.1 * k] for k in range(1, 9)])  # (cosines with the anchor < 0)
    e = torch.cat([torch.tensor([[1.0, 0.0]]), far, positive_at(0.1, s_n, side)[None], n[None], far[:6]])
    labels = torch.tensor([0] + [1] * 8 + [0, 1] + [2] * 6)
    params = {"alpha": 2.0, "beta": 50.0, "base": 0.5, "miner_epsilon": 0.1}
    args = (e[:9], labels[:9], e[9:], labels[9:]) if refs else (e, labels)
    leaves = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
    got = ops.multi_similarity_loss(
        leaves[0], leaves[1], **params, **(dict(ref_embeddings=leaves[2], ref_labels=leaves[3]) if refs else {})
    )
    grads = torch.autograd.grad(got, [x for x in leaves if x.is_floating_point()])
    exp_leaves = [a.double().clone().requires_grad_() if a.is_floating_point() else a for a in args]
    exp = pml("multi_similarity_loss", params)(*exp_leaves)
    exp_grads = torch.autograd.grad(exp, [x for x in exp_leaves if x.is_floating_point()])
    torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-6)
    for g, x in zip(grads, exp_grads, strict=True):
        torch.testing.assert_close(g.double(), x, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("miner_epsilon", [0.1, None])
def test_multi_similarity_on_refs_past_one_strip(miner_epsilon):
    """Eight anchors against 140,000 refs: more than the CPU kernel keeps of a block's cosines
    at once (2^20), so that its two passes (the miner's thresholds, then the terms) form the
    tiles twice; loss and gradients as the float64 reference's."""
    e, labels = make((8, 3), seed=1), make_labels(8, 50, seed=1)
    refs, ref_labels = make((140_000, 3), seed=2), make_labels(140_000, 50, seed=2)
    params = dict(miner_epsilon=miner_epsilon, ref_labels=ref_labels)
    grads = []
    for fn in (ops.multi_similarity_loss, reference.multi_similarity_loss):
        x, r = e.clone().requires_grad_(), refs.clone().requires_grad_()
        out = fn(x, labels, ref_embeddings=r, **params)
        grads.append((out, *torch.autograd.grad(out, (x, r))))
    for got, exp in zip(*grads, strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)


@kernels
def test_triplet_batch_hard_picks_the_exact_hardest_positive(device):
    """Two positives 1e-7 apart (their float32 distances tie within rounding): the one the
    gradient reaches is the float64 reference's farthest, for each of 60 anchors (one batch:
    each anchor's class holds its two positives only, beside 120 shared negatives)."""
    n = 60
    g = torch.Generator().manual_seed(0)
    anchors, p1, negatives = (torch.randn(k, 16, generator=g, dtype=torch.float64) for k in (n, n, 2 * n))
    p2 = p1 + 1e-7 * torch.randn(n, 16, generator=g, dtype=torch.float64)
    anchors, refs = anchors.float(), torch.cat([p1, p2, negatives]).float()
    labels = torch.arange(n)
    ref_labels = torch.cat([labels, labels, torch.full((2 * n,), n)])
    reached = []
    for fn, x, r in (
        (ops.triplet_margin_loss, anchors, refs),
        (reference.triplet_margin_loss, anchors.double(), refs.double()),
    ):
        r = r.clone().requires_grad_()
        out = fn(x, labels, 1.0, mining="batch_hard", ref_embeddings=r, ref_labels=ref_labels)
        (gr,) = torch.autograd.grad(out, r)
        reached.append((gr[: 2 * n].abs().sum(1) > 0).view(2, n))
    assert reached[1].any(0).all()  # (every anchor's triplet is active)
    assert torch.equal(reached[0], reached[1]), (reached[0] != reached[1]).any(0).nonzero().flatten().tolist()


@variants_k
def test_nan_embedding_makes_the_loss_nan(loss, params, device):
    """A NaN embedding among pairs of anchors with positives: NaN, never a finite value computed
    without it (PML's AvgNonZeroReducer drops NaN terms)."""
    e = make((20, 5))
    labels = make_labels(20, 3)
    e[4, 2] = float("nan")
    assert getattr(ops, loss)(e, labels, **params).isnan()
    assert getattr(reference, loss)(e, labels, **params).isnan()


@variants_k
def test_zero_embedding_is_normalised_as_f_normalize(loss, params, device):
    """An all-zero row stays 0 after F.normalize's clamp, as PML computes. Its distance to
    every other row is then exactly 1: the Euclidean losses meet ties there, on their margins
    and between candidates, which PML's rounding breaks (counting 1 − 1e-16 at neg_margin = 1,
    taking a tie for semi-hard): contrastive_loss and semi_hard triplets are compared with the
    exact distances' loss, and only values are compared."""
    e = make((12, 4))
    e[3] = 0
    labels = make_labels(12, 3)
    got, (g,) = loss_and_grads(ours(loss, params), e, labels)
    exp, (g_exp,) = loss_and_grads(pml(loss, params), e, labels)
    if loss == "contrastive_loss" or params.get("mining") == "semi_hard":
        exp = exact_pair_loss(loss, params, e, labels)
    torch.testing.assert_close(got, exp)
    if loss in ("supcon_loss", "ntxent_loss", "multi_similarity_loss"):
        torch.testing.assert_close(g, g_exp)


def on_threads(fn, counts=(1, 2, 3, 4)) -> list:
    """fn() on each number of threads."""
    results, before = [], torch.get_num_threads()
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            results.append(fn())
    finally:
        torch.set_num_threads(before)
    return results


def same_bits(results) -> bool:
    first = results[0]
    return all(torch.equal(first[0], r[0]) and all(map(torch.equal, first[1], r[1])) for r in results[1:])


@variants
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_deterministic_on_any_number_of_threads(loss, params, dtype):
    """The same bits on 1 to 4 threads: 300 rows (several tasks), and 40 anchors against 300
    refs (one block of a side, whose GEMMs MKL would otherwise split by the thread count)."""
    e, labels = make((300, 40), dtype, seed=8), make_labels(300, 12)
    assert same_bits(on_threads(lambda: loss_and_grads(ours(loss, params), e, labels)))
    refs, ref_labels = make((300, 40), dtype, seed=9), make_labels(300, 12, seed=9)
    args = (e[:40], labels[:40], refs, ref_labels)
    assert same_bits(on_threads(lambda: loss_and_grads(ours(loss, params), *args)))


# The CPU kernel only: the Triton kernels' backward equals the CPU kernel's in float64 at 1e-12
# (test_triton_every_configuration_matches_the_cpu_kernel, with and without refs).
@variants
@pytest.mark.parametrize("M", [None, 5])
def test_gradcheck(loss, params, M):
    fn = getattr(ops, loss)
    if loss == "supcon_loss" or loss == "ntxent_loss":
        params = {"temperature": 0.5}
    e = make((7, 3), seed=9).requires_grad_()
    labels = torch.tensor([0, 1, 0, 2, 1, 0, 2])
    if M is None:
        check_gradcheck(lambda a: fn(a, labels, **params), (e,))
    else:
        ref = make((M, 3), seed=10).requires_grad_()
        ref_labels = torch.tensor([1, 0, 2, 2, 0])
        check_gradcheck(lambda a, b: fn(a, labels, **params, ref_embeddings=b, ref_labels=ref_labels), (e, ref))


@with_kernels(
    [(*v, dtype) for v in VARIANTS for dtype in (torch.float32, torch.bfloat16)],
    [f"{i}-{dtype}" for i in VARIANT_IDS for dtype in ("float32", "bfloat16")],
    "loss,params,dtype,device",
    triton=lambda loss, params, dtype: dtype == torch.float32,
)
def test_opcheck(loss, params, dtype, device):
    op, backward = raw(loss)
    values = list(params.values())
    e = make((10, 4), dtype).requires_grad_()
    labels = make_labels(10, 3)
    ref = make((6, 4), dtype, seed=1).requires_grad_()
    ref_labels = make_labels(6, 3, seed=1)
    check_opcheck(op, (e, labels, None, None, *values))
    check_opcheck(op, (e, labels, ref, ref_labels, *values))
    value, stats = op(e.detach(), labels, ref.detach(), ref_labels, *values)
    g = torch.ones_like(value)
    check_opcheck(backward, (g, e.detach(), labels, ref.detach(), ref_labels, stats, *values, [True, True]))
    _, stats = op(e.detach(), labels, None, None, *values)
    check_opcheck(backward, (g, e.detach(), labels, None, None, stats, *values, [True, False]))


@variants
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shard_opcheck(loss, params, dtype):
    """The raw ops as the losses across ranks call them: a shard of the rows (its own rows
    left out of its pairs) and a shard of separate refs, as many as the anchors or fewer; the
    backward with a float64 grad (and, of a shard of the rows, the whole problem's stats where
    the loss takes them)."""
    spec = ops.pair_losses.SPECS[loss]
    op, backward = raw(loss)
    values = list(params.values())
    rows, labels = make((10, 4), dtype), make_labels(10, 3)
    apart, apart_labels = make((12, 4), dtype, seed=2), make_labels(12, 3, 2)
    cases = [(3, rows[3:8], labels[3:8], rows, labels), (-1, apart[:4], apart_labels[:4], rows, labels)]
    cases.append((-1, apart, apart_labels, rows[:3], labels[:3]))  # fewer refs than anchors
    for shard, e, e_labels, refs, ref_labels in cases:
        e, refs = e.clone().requires_grad_(), refs.clone().requires_grad_()
        check_opcheck(op, (e, e_labels, refs, ref_labels, *values, shard))
        parts, stats = op(e.detach(), e_labels, refs.detach(), ref_labels, *values, shard)
        assert parts.dtype == torch.float64 and parts.shape == (spec.parts,)
        if shard >= 0 and spec.whole_stats:
            stats = op(rows, labels, None, None, *values)[1]
        for g in (torch.ones((), dtype=torch.float64), torch.ones((), dtype=dtype)):
            args = (g, e.detach(), e_labels, refs.detach(), ref_labels, stats, *values, [True, True], shard)
            check_opcheck(backward, args)


@variants
def test_shards_make_the_whole_loss(loss, params):
    """What group= does, in one process: the parts of two shards of the anchors against every
    row, summed, give the loss, and their backwards the gradient: each shard's rows' whole
    gradient from the whole problem's stats (a loss whose spec says whole_stats), or its rows'
    as anchors and every row's as its anchors' refs (tests/test_pair_losses_distributed.py runs
    it across processes)."""
    from torchkit.ops._pair_losses_across_ranks import _whole, _whole_stats

    op, backward = raw(loss)
    values = list(params.values())
    rows, labels = make((13, 5), seed=3), make_labels(13, 3, seed=3)
    x = rows.clone().requires_grad_()
    expected = getattr(ops, loss)(x, labels, **params)
    expected.backward()
    shards = [(0, 5), (5, 13)]
    results = [op(rows[a:b], labels[a:b], rows, labels, *values, a) for a, b in shards]
    total = sum(parts for parts, _ in results)
    wholes = [_whole(loss, parts, total, stats) for parts, stats in results]
    for value, _, _ in wholes:
        torch.testing.assert_close(value, expected.detach(), rtol=1e-12, atol=0)
    whole_stats = torch.cat([_whole_stats(loss, stats, scale) for _, scale, stats in wholes])
    grad = torch.zeros_like(rows)
    for (a, b), (_, scale, stats) in zip(shards, wholes, strict=True):
        if ops.pair_losses.SPECS[loss].whole_stats:
            g = torch.ones((), dtype=torch.float64)
            ge, gr = backward(g, rows[a:b], labels[a:b], rows, labels, whole_stats, *values, [True, True], a)
            assert not gr.any()  # (the refs' gradient is not computed: zeros)
        else:
            ge, gr = backward(scale, rows[a:b], labels[a:b], rows, labels, stats, *values, [True, True], a)
            grad += gr
        grad[a:b] += ge
    torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-13)


@pytest.mark.bad_input
@variants
def test_shard_is_checked(loss, params):
    op, backward = raw(loss)
    values = list(params.values())
    rows, labels = make((6, 3)), make_labels(6, 2)
    bad = [
        ((rows, labels, None, None, *values, 0), r"shard needs ref_embeddings"),
        ((rows[:2], labels[:2], rows, labels, *values, 5), r"shard must be -1 .* in \[0, M - N\] = \[0, 4\], got 5"),
        ((rows[:2], labels[:2], rows, labels, *values, -2), r"shard must be -1 .*, got -2"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=rf"^{loss}: {match}"):
            op(*args)
        with pytest.raises(ValueError, match=rf"^{loss}: {match}"):  # the fake kernel
            op(*(a.to("meta") if torch.is_tensor(a) else a for a in args))
    # -1 takes any refs, fewer than the anchors or none: one such shard is the whole loss.
    from torchkit.ops._pair_losses_across_ranks import _whole

    for refs in (rows[:2], rows[:0]):
        args = (rows, labels, refs, labels[: len(refs)], *values)
        parts, stats = op(*args, -1)
        op(*(a.to("meta") if torch.is_tensor(a) else a for a in args), -1)
        torch.testing.assert_close(_whole(loss, parts, parts, stats)[0], op(*args)[0], rtol=1e-12, atol=0)
    other = labels.clone()
    other[3] += 1
    with pytest.raises(
        ValueError, match=rf"^{loss}: with shard = 2, labels must equal ref_labels\[shard:shard \+ N\].* anchor 1$"
    ):
        op(rows[2:4], other[2:4], rows, labels, *values, 2)
    moved = rows.clone()
    moved[3, 1] = -moved[3, 1]
    with pytest.raises(
        ValueError,
        match=rf"^{loss}: with shard = 2, embeddings must equal ref_embeddings\[shard:shard \+ N\].* anchor 1$",
    ):
        op(moved[2:4], labels[2:4], rows, labels, *values, 2)
    _, stats = op(rows[2:4], labels[2:4], rows, labels, *values, 2)
    g = torch.ones((), dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"^{loss}: shard must be -1"):
        backward(g, rows[2:4], labels[2:4], rows, labels, stats, *values, [True, True], 5)
    # A shard of the rows: the whole problem's stats where the loss takes them, else its own.
    if ops.pair_losses.SPECS[loss].whole_stats:
        match = rf"^{loss}: backward: stats must be \(M, {stats.shape[1]}\) = \(6, .* the whole problem's\), got \[2, "
    else:
        stats, match = op(rows, labels, None, None, *values)[1], rf"^{loss}: backward: stats must be \(N, .*, got \[6, "
    with pytest.raises(ValueError, match=match):
        backward(g, rows[2:4], labels[2:4], rows, labels, stats, *values, [True, True], 2)


# Under torch.compile the op is opaque: graphs, guards and recompilation come from its fake
# kernels, the same whichever kernel runs. Through Triton, one loss of each kernel family
# (log-sum-exp rows, Euclidean margins) checks that its kernels take what compile passes.
@with_kernels(VARIANTS, VARIANT_IDS, triton=lambda loss, params: loss in ("supcon_loss", "contrastive_loss"))
def test_compile_dynamic(loss, params, device):
    # (the losses share their Python functions' code objects: each variant's guards would count
    # toward Dynamo's recompile limit of those of the variants before it on this worker)
    torch._dynamo.reset()
    fn = getattr(ops, loss)
    for N in (20, 33):
        e = make((N, 8), torch.float32).requires_grad_()
        labels = make_labels(N, 4)
        check_compile(lambda a, lab: fn(a, lab, **params), e, labels)
        ref = make((N + 3, 8), torch.float32, seed=1).requires_grad_()
        check_compile(
            lambda a, b, lab, rl: fn(a, lab, **params, ref_embeddings=b, ref_labels=rl),
            e,
            ref,
            labels,
            make_labels(N + 3, 4, seed=1),
        )


MODULES = {
    "supcon_loss": "SupConLoss",
    "ntxent_loss": "NTXentLoss",
    "contrastive_loss": "ContrastiveLoss",
    "triplet_margin_loss": "TripletMarginLoss",
    "multi_similarity_loss": "MultiSimilarityLoss",
}
OTHER_PARAMS = {
    "supcon_loss": {"temperature": 0.2},
    "ntxent_loss": {"temperature": 0.2},
    "contrastive_loss": {"pos_margin": 0.1, "neg_margin": 0.8, "distance": "cosine"},
    "triplet_margin_loss": {"margin": 0.2, "mining": "semi_hard", "distance": "cosine"},
    "multi_similarity_loss": {"alpha": 1.0, "beta": 20.0, "base": 0.3, "miner_epsilon": None},
}


def test_multi_similarity_module_defaults_to_pmls_module():
    """torchkit.nn.MultiSimilarityLoss() is PML's MultiSimilarityLoss(), which has no miner:
    every pair (the function's default mines with ε = 0.1, as its docstring says)."""
    e, labels = make((40, 8)), make_labels(40, 4)
    got = torchkit.nn.MultiSimilarityLoss()(e, labels)
    torch.testing.assert_close(got, losses.MultiSimilarityLoss()(e, labels), rtol=1e-12, atol=1e-12)
    assert got.item() == ops.multi_similarity_loss(e, labels, miner_epsilon=None).item()
    assert got.item() != ops.multi_similarity_loss(e, labels).item()


@configs
def test_ref_labels_that_are_labels_count_every_pair(loss, params):
    """PML leaves out each anchor's pair with the ref row of its index when ref_labels is the
    labels tensor itself; torchkit counts every (anchor, ref) pair whatever object the labels
    are (docs/ops.md): PML's value with a copy of the labels."""
    e, labels = make((12, 6)), make_labels(12, 3)
    ref = make((12, 6), seed=1)
    got = ours(loss, params)(e, labels, ref, labels)
    torch.testing.assert_close(got, pml(loss, params)(e, labels, ref, labels.clone()), rtol=1e-12, atol=1e-12)
    assert got.item() == ours(loss, params)(e, labels, ref, labels.clone()).item()


# PML's parameters of either sign (its own miner test takes margin −0.05).
NEGATIVE = [
    ("contrastive_loss", {"pos_margin": -0.1, "neg_margin": 0.5, "distance": "euclidean"}),
    ("contrastive_loss", {"pos_margin": 0.2, "neg_margin": -0.3, "distance": "euclidean"}),
    ("triplet_margin_loss", {"margin": -0.05, "mining": "all", "distance": "euclidean"}),
    ("triplet_margin_loss", {"margin": -0.05, "mining": "semi_hard", "distance": "euclidean"}),
    ("triplet_margin_loss", {"margin": -0.05, "mining": "batch_hard", "distance": "euclidean"}),
    ("multi_similarity_loss", {"alpha": 2.0, "beta": 50.0, "base": 0.5, "miner_epsilon": -0.05}),
]
NEGATIVE_IDS = ["-".join([loss.removesuffix("_loss"), *map(str, p.values())]) for loss, p in NEGATIVE]


@pytest.mark.parametrize("loss,params", NEGATIVE, ids=NEGATIVE_IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_negative_margins_are_pmls(loss, params, dtype):
    """Negative margins and miner ε are PML's (values and gradients, with and without refs):
    float64 and float32 against PML; float16 and bfloat16 (PML computes in them, torchkit in
    float32) against the float64 reference on the same values."""
    e = make((40, 8), seed=3).to(dtype)
    labels = make_labels(40, 4, seed=3)
    ref, ref_labels = make((30, 8), seed=4).to(dtype), make_labels(30, 4, seed=4)
    for r, rl in ((None, None), (ref, ref_labels)):
        got, got_grads = loss_and_grads(ours(loss, params), e, labels, r, rl)
        if dtype in (torch.float64, torch.float32):
            exp, exp_grads = loss_and_grads(pml(loss, params), e, labels, r, rl)
            tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, exp, **tol)
            for a, b in zip(got_grads, exp_grads, strict=True):
                torch.testing.assert_close(a, b, **tol)
        else:
            exp, exp_grads = loss_and_grads(
                ref_fn(loss, params), e.double(), labels, None if r is None else r.double(), rl
            )
            eps = torch.finfo(dtype).eps
            assert abs(got.double() - exp).item() <= 2 * eps * max(exp.abs().item(), 1e-3)
            for a, b in zip(got_grads, exp_grads, strict=True):
                assert (a.double() - b).abs().max() <= 4 * eps * max(b.abs().max(), 1e-3)
    if params.get("mining") == "semi_hard":  # PML's miner takes no triplet below margin 0
        assert got.item() == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_proxy_anchor_negative_margin_is_pmls(dtype):
    e, labels, proxies = make((30, 8), dtype, seed=6), make_labels(30, 5, seed=6), make((5, 8), dtype, seed=7)
    got, got_grads = proxy_loss_and_grads(lambda *a: ops.proxy_anchor_loss(*a, margin=-0.1), e, labels, proxies)
    exp, exp_grads = proxy_loss_and_grads(pml_proxy_anchor(margin=-0.1), e, labels, proxies)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, exp, **tol)
    for a, b in zip(got_grads, exp_grads, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("loss", NAMES)
def test_module(loss):
    module, params = MODULES[loss], OTHER_PARAMS[loss]
    m = getattr(torchkit.nn, module)(**params)
    e, labels = make((10, 4)), make_labels(10, 3)
    ref, ref_labels = make((7, 4), seed=1), make_labels(7, 3, seed=1)
    fn = getattr(ops, loss)
    assert m(e, labels).item() == fn(e, labels, **params).item()
    assert (
        m(e, labels, ref, ref_labels).item()
        == fn(e, labels, **params, ref_embeddings=ref, ref_labels=ref_labels).item()
    )
    assert repr(m) == f"{module}({', '.join(f'{k}={v!r}' for k, v in params.items())})"
    # The defaults: the function's, but for MultiSimilarityLoss, which is PML's module (no miner).
    defaults = {"multi_similarity_loss": {"miner_epsilon": None}}.get(loss, {})
    assert getattr(torchkit.nn, module)()(e, labels).item() == fn(e, labels, **defaults).item()
    name = next(iter(params))
    bad = 0.0 if name in ("temperature", "alpha") else float("nan")
    with pytest.raises(ValueError, match=f"{module}: {name} must be finite"):
        getattr(torchkit.nn, module)(**{**params, name: bad})


@variants
def test_saved_for_backward_is_inputs_and_a_few_numbers_per_anchor(loss, params):
    e = make((64, 16), torch.float32).requires_grad_()
    labels = make_labels(64, 4)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        getattr(ops, loss)(e, labels, **params)
    total = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}.values())
    assert total <= e.nbytes + labels.nbytes + COLUMNS[loss] * 8 * 64


def peak_growth_mib(call: str, N: int, D: int, classes: int) -> float:
    """Peak resident-set growth of one forward and backward of ``ops.<call>`` (a loss and its
    keyword arguments) in a fresh process (allocator caches and thread pools warmed on a small
    batch first), in MiB."""
    loss, _, kwargs = call.partition("(")
    args = f"(e, labels{', ' + kwargs.rstrip(')') if kwargs.rstrip(')') else ''})"
    code = (
        "import torch, torchkit\n"
        "from torchkit import ops\n"
        "def status(key):\n"
        "    with open('/proc/self/status') as f:\n"
        "        return next(int(l.split()[1]) for l in f if l.startswith(key)) / 1024\n"
        "g = torch.Generator().manual_seed(0)\n"
        f"E = torch.randn({N}, {D}, generator=g).requires_grad_()\n"
        f"L = torch.randint({classes}, ({N},), generator=g)\n"
        f"P = torch.randn({classes}, {D}, generator=g).requires_grad_()  # proxies, one per class\n"
        "e, labels = E[:300], L[:300]\n"
        f"ops.{loss}{args}.backward()\n"
        "E.grad = None\n"
        "e, labels = E, L\n"
        "base = status('VmRSS:')\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        f"ops.{loss}{args}.backward()\n"
        "print(status('VmHWM:') - base)\n"
    )
    # glibc's dynamic mmap threshold would keep a freed buffer resident (the next one of its
    # size then comes from the heap), so that the peak depended on the order of earlier frees
    # by up to 2 MiB: pinned, every large buffer is mapped and unmapped, and the peak is the
    # call's own.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@variants
def test_memory_is_linear_in_the_batch(loss, params):
    """N = 8192, D = 128 float32, 100 classes (82 samples each: 0.7 million positive pairs, 5
    billion triplets), forward and backward: the peak resident set grows by less than 16 MiB
    (the gradient itself is 4), 20 for the triplets of "all" and "semi_hard" (their 12 bytes
    per positive pair, the exact distance and a count, are 8), where one N×N float32 matrix
    is 256 MiB."""
    kwargs = ", ".join(f"{k}={v!r}" for k, v in params.items())
    growth = peak_growth_mib(f"{loss}({kwargs})", 8192, 128, 100)
    per_positive_pair = loss == "triplet_margin_loss" and params["mining"] != "batch_hard"
    assert growth < (20 if per_positive_pair else 16), f"peak grew by {growth:.1f} MiB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_ntxent_at_pml_547s_batch_needs_under_8_mib():
    """PML #547: NT-Xent at N = 1,200 with 10 classes asked for 120 GB there (its (positive pairs
    × negative pairs) matrix)."""
    growth = peak_growth_mib("ntxent_loss()", 1200, 128, 10)
    assert growth < 8, f"peak grew by {growth:.1f} MiB"


e4 = make((6, 4), torch.float32)
l6 = torch.tensor([0, 1, 0, 1, 2, 2])


def bad_cases(loss):
    fn = getattr(ops, loss)
    cases = [
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
    if loss in ("supcon_loss", "ntxent_loss"):
        for value, shown in ((0.0, "0"), (-0.1, "-0.1"), (float("inf"), "inf"), (float("nan"), "nan")):
            cases.append(
                (lambda v=value: fn(e4, l6, v), ValueError, rf"temperature must be finite and > 0, got {shown}")
            )
        return cases
    if loss == "multi_similarity_loss":
        for name in ("alpha", "beta"):
            for value, shown in ((0.0, "0"), (-1.0, "-1"), (float("inf"), "inf"), (float("nan"), "nan")):
                cases.append(
                    (
                        lambda n=name, v=value: fn(e4, l6, **{n: v}),
                        ValueError,
                        rf"{name} must be finite and > 0, got {shown}",
                    )
                )
        for value, shown in ((float("inf"), "inf"), (float("nan"), "nan")):
            cases.append((lambda v=value: fn(e4, l6, base=v), ValueError, rf"base must be finite, got {shown}"))
        for value, shown in ((float("inf"), "inf"), (float("nan"), "nan")):
            cases.append(
                (
                    lambda v=value: fn(e4, l6, miner_epsilon=v),
                    ValueError,
                    rf"miner_epsilon must be finite, got {shown}",
                )
            )
        return cases
    names = ("pos_margin", "neg_margin") if loss == "contrastive_loss" else ("margin",)
    for name in names:
        for value, shown in ((float("-inf"), "-inf"), (float("inf"), "inf"), (float("nan"), "nan")):
            cases.append(
                (
                    lambda n=name, v=value: fn(e4, l6, **{n: v}),
                    ValueError,
                    rf"{name} must be finite, got {shown}",
                )
            )
    if loss == "triplet_margin_loss":
        cases.append(
            (
                lambda: fn(e4, l6, mining="hard"),
                ValueError,
                r"mining must be 'all', 'batch_hard' or 'semi_hard', got 'hard'",
            )
        )
    cases.append(
        (
            lambda: fn(e4, l6, distance="manhattan"),
            ValueError,
            r"distance must be 'euclidean' or 'cosine', got 'manhattan'",
        )
    )
    return cases


def proxy_bad_cases():
    fn, p3 = ops.proxy_anchor_loss, make((3, 4), torch.float32, seed=5)
    cases = [
        (lambda: fn(e4[0], l6, p3), ValueError, r"embeddings must be 2-D \(N, D\), got shape \[4\]"),
        (lambda: fn(e4.long(), l6, p3), TypeError, r"embeddings must be float32, float64, float16 or bfloat16"),
        (lambda: fn(e4, l6.float(), p3), TypeError, r"labels must have an integer dtype, got Float"),
        (lambda: fn(e4, l6[:5], p3), ValueError, r"labels must be 1-D with one label per row of embeddings \(6\)"),
        (
            lambda: fn(e4, l6, p3.double()),
            TypeError,
            r"embeddings and proxies must have the same dtype, got Float and Double",
        ),
        (lambda: fn(e4, l6, p3[:, :3]), ValueError, r"proxies must be 2-D \(C, D\) with embeddings' D"),
        (lambda: fn(e4, l6, p3[0]), ValueError, r"proxies must be 2-D \(C, D\) with embeddings' D"),
    ]
    for value, shown in ((float("-inf"), "-inf"), (float("inf"), "inf"), (float("nan"), "nan")):
        cases.append((lambda v=value: fn(e4, l6, p3, margin=v), ValueError, rf"margin must be finite, got {shown}"))
    for value, shown in ((0.0, "0"), (float("inf"), "inf")):
        cases.append(
            (lambda v=value: fn(e4, l6, p3, alpha=v), ValueError, rf"alpha must be finite and > 0, got {shown}")
        )
    return cases


BAD = [pytest.param(loss, *case, id=f"{loss}-{i}") for loss in NAMES for i, case in enumerate(bad_cases(loss))] + [
    pytest.param("proxy_anchor_loss", *case, id=f"proxy_anchor_loss-{i}") for i, case in enumerate(proxy_bad_cases())
]


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
    if loss == "proxy_anchor_loss":

        def call_raw(e, labels, proxies, margin=0.1, alpha=32.0):
            return op(e, labels, proxies, margin, alpha)

        monkeypatch.setattr(ops, loss, call_raw)
        with pytest.raises(exc, match=match):
            call()
        return
    defaults = dict(dict(VARIANTS)[loss])

    def call_raw(e, labels, *args, ref_embeddings=None, ref_labels=None, **kwargs):
        params = {**defaults, **dict(zip(defaults, args, strict=False)), **kwargs}
        return op(e, labels, ref_embeddings, ref_labels, *params.values())

    monkeypatch.setattr(ops, loss, call_raw)
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.bad_input
@pytest.mark.parametrize("loss", NAMES)
def test_a_0d_meta_tensor_parameter_is_refused_naming_it(loss):
    name = next(iter(dict(VARIANTS)[loss]))
    with pytest.raises(TypeError, match=rf"^{loss}: {name} must be a float, got a meta tensor, which holds no value"):
        getattr(ops, loss)(e4, l6, **{name: torch.tensor(0.5, device="meta")})


# A finite parameter whose loss lies past the embeddings' dtype: the loss is ±inf, as PML's
# float32 arithmetic gives, not an error naming neither the op nor the argument.
OVERFLOWING = [
    ("contrastive_loss", {"pos_margin": 0.0, "neg_margin": 1e39}),
    ("triplet_margin_loss", {"margin": 1e39, "mining": "all"}),
    ("multi_similarity_loss", {"alpha": 2.0, "beta": 50.0, "base": -1e300, "miner_epsilon": None}),
]


@with_kernels(OVERFLOWING, [loss for loss, _ in OVERFLOWING])
def test_a_loss_past_the_dtypes_range_is_inf(loss, params, device):
    from pytorch_metric_learning import losses as pml

    x, labels = make((8, 4), torch.float32), make_labels(8, 3)
    got = getattr(ops, loss)(x.requires_grad_(), labels, **params)
    assert got.isinf() and got > 0
    pml_loss = {
        "contrastive_loss": lambda: pml.ContrastiveLoss(0.0, 1e39),
        "triplet_margin_loss": lambda: pml.TripletMarginLoss(1e39),
        "multi_similarity_loss": lambda: pml.MultiSimilarityLoss(2.0, 50.0, -1e300),
    }[loss]()
    assert pml_loss(x.detach(), labels) == got
    if loss == "contrastive_loss":  # each term's gradient is finite: PML's, and float64's
        got.backward()
        y = x.detach().double().requires_grad_()
        getattr(ops, loss)(y, labels, **params).backward()
        torch.testing.assert_close(x.grad, y.grad.float(), rtol=1e-5, atol=1e-6)


def test_proxy_anchor_parameters_past_the_dtypes_range():
    x, labels, proxies = make((8, 4), torch.float32), make_labels(8, 3), make((3, 4), torch.float32, seed=2)
    assert ops.proxy_anchor_loss(x, labels, proxies, margin=0.1, alpha=1e300).isinf()
    assert ops.proxy_anchor_loss(x, labels, proxies, margin=1e39, alpha=1.0).isinf()


@pytest.mark.bad_input
@pytest.mark.parametrize("loss", NAMES)
def test_raw_op_refuses_a_bool_parameter(loss):
    op, _ = raw(loss)
    name, *others = dict(VARIANTS)[loss].items()
    with pytest.raises(TypeError, match=rf"{loss}: {name[0]} must be a float, got bool True"):
        op(e4, l6, None, None, True, *(value for _, value in others))


@pytest.mark.bad_input
def test_mining_must_be_a_string():
    with pytest.raises(
        TypeError,
        match=r"triplet_margin_loss: mining must be a str, one of 'all', 'batch_hard', 'semi_hard'; got int 1",
    ):
        ops.triplet_margin_loss(e4, l6, mining=1)


@pytest.mark.bad_input
@pytest.mark.parametrize("loss", ["contrastive_loss", "triplet_margin_loss"])
def test_distance_is_checked(loss):
    """A string, as the raw op's schema takes it (not PML's distance objects, which the message
    names the strings of), refused eagerly, by the raw op, its fake kernel and the module."""
    fn, op = getattr(ops, loss), raw(loss)[0]
    with pytest.raises(TypeError, match=rf"^{loss}: distance must be a str, one of 'euclidean', 'cosine'; got int 1"):
        fn(e4, l6, distance=1)
    params = [v if k != "distance" else "dot" for k, v in dict(VARIANTS)[loss].items()]
    for device in ("cpu", "meta"):
        with pytest.raises(ValueError, match=rf"^{loss}: distance must be 'euclidean' or 'cosine', got 'dot'"):
            op(e4.to(device), l6.to(device), None, None, *params)
    module = {"contrastive_loss": torchkit.nn.ContrastiveLoss, "triplet_margin_loss": torchkit.nn.TripletMarginLoss}
    with pytest.raises(ValueError, match=r"distance must be 'euclidean' or 'cosine', got 'dot'"):
        module[loss](distance="dot")


def backward_bad_cases(loss):
    """(arguments of the raw backward op, exception, message) for each kind of bad input."""
    columns = COLUMNS[loss]
    values = list(dict(VARIANTS)[loss].values())
    _, stats = raw(loss)[0](e4, l6, None, None, *values)
    g, mask = torch.ones(()), [True, False]
    kind = {"triplet_margin_loss": "Long", "multi_similarity_loss": "Double"}.get(loss, "Float")
    bad_param = {
        "multi_similarity_loss": (0, 0.0, r"alpha must be finite and > 0, got 0"),
        "contrastive_loss": (1, float("inf"), r"neg_margin must be finite, got inf"),
        "triplet_margin_loss": (0, float("nan"), r"margin must be finite, got nan"),
    }.get(loss, (0, 0.0, r"temperature must be finite and > 0, got 0"))
    at, value, rule = bad_param
    bad_values = [*values[:at], value, *values[at + 1 :]]
    return [
        ((torch.ones(2), e4, l6, None, None, stats, *values, mask), ValueError, r"backward: grad must be a scalar"),
        (
            (g, e4, l6, None, None, stats.new_zeros(6, 7), *values, mask),
            ValueError,
            rf"backward: stats must be \(N, {columns}\) = \(6, {columns}\) of {kind}, got \[6, 7\] of {kind}",
        ),
        (
            (g, e4, l6, None, None, stats.to(torch.float16), *values, mask),
            ValueError,
            rf"backward: stats must be .* of {kind}, got \[6, {columns}\] of Half",
        ),
        (
            (g.double(), e4, l6, None, None, stats, *values, mask),
            TypeError,
            r"embeddings and grad must have the same dtype",
        ),
        (
            (g, e4.unsqueeze(0), l6, None, None, stats, *values, mask),
            ValueError,
            r"embeddings must be 2-D \(N, D\), got shape \[1, 6, 4\]",
        ),
        (
            (g, e4, l6[:5], None, None, stats, *values, mask),
            ValueError,
            r"labels must be 1-D with one label per row of embeddings \(6\), got shape \[5\]",
        ),
        ((g, e4, l6, None, None, stats, *bad_values, mask), ValueError, rule),
    ]


@pytest.mark.bad_input
@pytest.mark.parametrize("loss", NAMES)
def test_backward_checks_its_inputs(loss):
    """The backward op and its fake kernel (meta tensors: what torch.compile runs) refuse the
    same bad input with the same message."""
    _, backward = raw(loss)
    for args, exc, match in backward_bad_cases(loss):
        with pytest.raises(exc, match=rf"^{loss}: {match}") as eager:
            backward(*args)
        with pytest.raises(exc) as fake:
            backward(*(a.to("meta") if torch.is_tensor(a) else a for a in args))
        assert str(fake.value) == str(eager.value)


@pytest.mark.bad_input
def test_proxy_anchor_backward_checks_its_inputs():
    op, backward = torch.ops.torchkit.proxy_anchor_loss, torch.ops.torchkit._proxy_anchor_loss_backward
    p3 = make((3, 4), torch.float32, seed=5)
    labels = l6 % 3
    _, stats = op(e4, labels, p3, 0.1, 32.0)
    g, mask = torch.ones(()), [True, True]
    cases = [
        ((torch.ones(2), e4, labels, p3, stats, 0.1, 32.0, mask), ValueError, r"backward: grad must be a scalar"),
        (
            (g, e4, labels, p3, stats[:2], 0.1, 32.0, mask),
            ValueError,
            r"backward: stats must be \(N, 4\) = \(3, 4\) of Float, got \[2, 4\] of Float",
        ),
        ((g, e4, labels, p3[:, :3], stats, 0.1, 32.0, mask), ValueError, r"proxies must be 2-D \(C, D\)"),
        ((g, e4, labels[:5], p3, stats, 0.1, 32.0, mask), ValueError, r"labels must be 1-D with one label per row"),
        ((g, e4, labels, p3, stats, 0.1, 0.0, mask), ValueError, r"alpha must be finite and > 0, got 0"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=rf"^proxy_anchor_loss: {match}") as eager:
            backward(*args)
        with pytest.raises(exc) as fake:
            backward(*(a.to("meta") if torch.is_tensor(a) else a for a in args))
        assert str(fake.value) == str(eager.value)


@pytest.mark.bad_input
@kernels
def test_triplet_backward_refuses_stats_pointing_outside_the_rows(device):
    """batch_hard's stats hold row indices the backward reads embeddings at: checked."""
    op, backward = raw("triplet_margin_loss")
    value, stats = op(e4, l6, None, None, 0.05, "batch_hard")
    bad = stats.clone()
    bad[0] = torch.tensor([6, 1, 1])
    with pytest.raises(ValueError, match=r"backward: stats row 0 is not the forward's .* got \[6, 1, 1\]"):
        backward(torch.ones_like(value), e4, l6, None, None, bad, 0.05, "batch_hard", "euclidean", [True, False])


def triton_module():
    import triton_testing

    reason = triton_testing.available()
    if reason:
        pytest.skip(reason)
    from torchkit.triton import pair_losses

    return pair_losses


# The configuration tests call the Triton kernels directly: under the interpreter on CPU
# tensors, compiled on CUDA tensors where a GPU is visible (conftest.py).
TRITON_DEVICE = pytest.mark.parametrize("device", ["cuda" if torch.cuda.is_available() else "cpu"])


def on(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


def test_triton_kernels_round_as_the_cpu_kernels():
    """Every launch configuration of the pair losses' Triton kernels keeps the compiler from
    fusing a product and a sum into an FMA, which the CPU kernels never do (setup.py builds
    them with -ffp-contract=off): with it, a zero row's exact distances to normalised rows
    (all 1 within an ulp) round otherwise, and batch_hard chose another nearest negative than
    the CPU kernel on an H200. The tensor-core tile kernels (their contract is a bound against
    float64, with which multi-similarity, contrastive_loss and the triplets decide on exact
    values near a threshold or a tie) may fuse;
    the per-row kernels, which form the norms as the CPU kernels do, and the exact cosines may
    not."""
    tp = triton_module()
    configs = [c for name in dir(tp) if name.endswith("_CONFIGS") for c in getattr(tp, name)]
    configs += (*tp.lse.ROW_CONFIGS, *tp.ms.EXACT_CONFIGS, tp.ms.PAIRS_CONFIG, *tp.euclid.EXACT_CONFIGS)
    configs += (tp.euclid.PAIRS_CONFIG, *tp.triplets.EXACT_CONFIGS)
    fused = (tp.lse.rows_kernel, tp.lse.grad_kernel, tp.ms.ms_rows_kernel, tp.ms.ms_grad_kernel)
    fused += (tp.euclid.contrastive_rows_kernel, tp.euclid.contrastive_grad_kernel, tp.triplets.hard_rows_kernel)
    fused += (tp.triplets.triplet_rows_kernel, tp.triplets.band_grad_kernel)
    configs += [c for case in tp.compile_cases() if case.kernel not in fused for c in case.configs]
    assert configs and all(c.launch["enable_fp_fusion"] is False for c in configs)


def test_triton_log_sum_exp_launches_are_compiled_for_their_architecture(monkeypatch):
    """The log-sum-exp engine's default launches at the headline's 128 features, forward and
    backward, for each scheme on sm_80 and sm_90 (the TF32 pair's rows held whole in the
    backward on sm_90 only: they spill sm_80's registers) are among the compile check's cases
    for that architecture, so that no launch a GPU makes went unchecked."""
    lse = triton_module().lse
    cases = lse.compile_cases()
    cpu = torch.device("cpu")

    def compiled(kernel, scheme, block_d, config, arch, **constexprs):
        return any(
            case.kernel is kernel
            and arch in case.archs
            and case.constexprs["SCHEME"].value == scheme
            and case.constexprs["BLOCK_D"] == block_d
            and all(case.constexprs[k] == v for k, v in constexprs.items())
            and repr(config) in map(repr, case.configs)
            for case in cases
        )

    held_on = {}
    for arch in (80, 90):
        monkeypatch.setattr(lse, "_arch", lambda device, arch=arch: arch)
        for scheme in (lse.TF32X3.value, lse.TF32.value, lse.HALF.value):
            held = lse._grad_held(128, scheme, cpu)
            held_on[arch, scheme] = held
            config = lse._grad_config(lse._grad_default(torch.float32, scheme, held), 128, held)
            assert compiled(lse.grad_kernel, scheme, held, config, arch, LOSS=lse.LOSS_SUPCON, SELF=True), (
                arch,
                scheme,
            )
            block_d = lse._rows_held(128, scheme, lse.SUPCON)
            rows = lse._rows_default(torch.float32, scheme, block_d)
            assert compiled(lse.rows_kernel, scheme, block_d, rows, arch, MODE=lse.SUPCON, SELF=True), (arch, scheme)
    assert held_on[90, lse.TF32X3.value] == 128 and held_on[80, lse.TF32X3.value] == 0


def supcon_batch_rules(lse, possum, npos, pairs, shard, dtype):
    """SupCon's batch rules as supcon_forward in pair_losses_cpu.cpp applies them, in float64:
    AvgNonZero over the anchors' terms, PML's condition for a loss at all (pairs: each
    anchor's)."""
    has = npos > 0
    loss = torch.where(has, lse.double() - possum.double() / npos.clamp(min=1).double(), 0.0)
    kept = (loss > 0) | loss.isnan()
    counted = kept.sum()
    positives = npos.sum()
    negatives = pairs * npos.numel() - positives
    use = counted > 0
    if shard is None:
        use &= (positives > 0) & (negatives > 0) & ((positives > 1) | (negatives > 1))
    total = torch.where(use, torch.where(kept, loss, 0.0).sum(), 0.0)
    w = torch.where(use & kept, 1.0 / (npos.clamp(min=1).double() * counted.clamp(min=1).double()), 0.0)
    stats = torch.stack([lse, w.to(lse.dtype)], dim=1)
    if shard is not None:
        return torch.stack([total, counted.double(), positives.double(), negatives.double()]), stats
    return (total / counted.clamp(min=1).double()).to(dtype), stats


def ntxent_batch_rules(log_s, log_r, loss, npos, pairs, shard, dtype):
    """NT-Xent's batch rules as ntxent_forward in pair_losses_cpu.cpp applies them, in float64."""
    has = npos > 0
    positives = npos.sum()
    negatives = pairs * npos.numel() - positives
    use = (positives > 0) & (negatives > 0)
    if shard is None:
        use &= (positives > 1) | (negatives > 1)
    total = torch.where(use, torch.where(has, loss.double(), 0.0).sum(), 0.0)
    share = torch.where(use, 1.0 / positives.clamp(min=1).double(), 0.0).to(log_s.dtype)
    log_r = torch.where(has, log_r, float("-inf"))
    stats = torch.where(use, torch.stack([log_s, log_r, share.expand(npos.numel())], dim=1), 0.0)
    if shard is not None:
        return torch.stack([total, positives.double(), negatives.double()]), stats
    return (total / positives.clamp(min=1).double()).to(dtype), stats


def proxy_batch_rules(ln, lp, npos, alpha, dtype):
    """Proxy-anchor's batch rules as proxy_anchor_forward in pair_losses_cpu.cpp applies them,
    in float64: PML's DivisorReducer, the positive terms over the P proxies with a positive
    pair, the negative ones over all C."""
    C = npos.numel()
    P = (npos > 0).sum()
    total = torch.where(P > 0, lp.double().sum() / P.clamp(min=1).double(), 0.0) + ln.double().sum() / max(C, 1)
    share = torch.where(P > 0, alpha / P.clamp(min=1).double(), 0.0).to(ln.dtype).expand(C)
    per_proxy = torch.full((C,), alpha / max(C, 1), dtype=torch.float64).to(ln.dtype)
    return total.to(dtype), torch.stack([lp, ln, share, per_proxy], dim=1)


@pytest.mark.triton("pair_losses", dispatch=False)
@TRITON_DEVICE
def test_triton_batch_rules_and_the_loss_cast(device):
    """The log-sum-exp engine's last two kernels (terms_kernel, loss_kernel) apply PML's batch
    rules to SupCon's, NT-Xent's and proxy-anchor's per anchor outputs as the CPU kernels do
    (proxy-anchor's with an α past float32's range too), on batches chosen
    for them: no anchor with a positive pair, one positive pair alone, no negative pair,
    AvgNonZero's zero terms, NaN and ±∞ terms, more anchors than a block holds; and cast the loss
    as PyTorch does (float64 to float32, then to the dtype: bfloat16 by rounding to nearest even,
    where the interpreter's conversion truncates), a shard's parts staying float64."""
    lse = triton_module().lse
    gen = torch.Generator().manual_seed(5)
    block = lse.BATCH_CONFIG.kwargs["BLOCK_ROWS"]
    # (anchors, positive pairs per anchor or None for random ones, pairs per anchor, terms' value or None)
    batches = [
        (4, [0, 0, 0, 0], 3, None),  # no positive pair
        (2, [1, 0], 1, None),  # one positive pair, one negative
        (3, [2, 2, 2], 2, None),  # no negative pair
        (4, [1, 1, 1, 1], 3, 1.01171875),  # a float32 value halfway between two bfloat16 ones
        (4, [1, 2, 0, 3], 3, float("nan")),
        (4, [1, 2, 0, 3], 3, float("inf")),
        (5, [1, 1, 2, 0, 1], 4, 0.0),  # AvgNonZero counts no anchor
        (2 * block + 7, None, 50, None),
        (0, [], 0, None),
    ]
    for N, npos, pairs, value in batches:
        npos = torch.randint(0, 4, (N,), generator=gen) if npos is None else torch.tensor(npos, dtype=torch.int64)
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            a, b, c = (torch.rand(N, generator=gen, dtype=torch.float64).to(acc) * 3 for _ in range(3))
            if value is not None:  # SupCon's terms and NT-Xent's sums all `value`
                a, b, c = torch.full_like(a, value), torch.zeros_like(b), torch.full_like(c, value)
            a[: N // 3] -= 4  # (some of SupCon's terms negative: AvgNonZero leaves them out)
            npos32 = npos.to(torch.int32).to(device)
            for shard in (None, 0):
                got = lse._loss(lse.LOSS_SUPCON, *on(device, a, b), npos32, None, N * pairs, shard, dtype, acc)
                want = supcon_batch_rules(a, b, npos, pairs, shard, dtype)
                for g, w in zip(got, want, strict=True):
                    assert g.dtype == w.dtype and g.shape == w.shape
                    torch.testing.assert_close(g.cpu(), w, rtol=1e-15, atol=0, equal_nan=True)
                got = lse._loss(lse.LOSS_NTXENT, *on(device, b, c), npos32, a.to(device), N * pairs, shard, dtype, acc)
                want = ntxent_batch_rules(a, b, c, npos, pairs, shard, dtype)
                for g, w in zip(got, want, strict=True):
                    assert g.dtype == w.dtype and g.shape == w.shape
                    torch.testing.assert_close(g.cpu(), w, rtol=1e-15, atol=0, equal_nan=True)
            for alpha in (32.0, 1e300):  # (proxy-anchor: no shard here; its anchors the proxies)
                got = lse._loss(lse.LOSS_PROXY, *on(device, a, c), npos32, None, 0, None, dtype, acc, alpha)
                want = proxy_batch_rules(a, c, npos, alpha, dtype)
                for g, w in zip(got, want, strict=True):
                    assert g.dtype == w.dtype and g.shape == w.shape
                    torch.testing.assert_close(g.cpu(), w, rtol=1e-15, atol=0, equal_nan=True)


@pytest.mark.triton("pair_losses", dispatch=False)
@TRITON_DEVICE
def test_triton_label_ids(device, monkeypatch):
    """_label_ids (each side sorted, then ids_kernel's 9-ary searches): a label's id is its rank
    among both sides' labels, compared as the CPU kernels compare them (int64), so equal labels
    share an id and unequal ones never do, and each anchor's positive pairs are the refs of its
    label, less one with self_ (the anchor itself): every integer dtype at its extremes, two sides
    of different dtypes, a strided side, empty sides, more labels than a block holds."""
    lse = triton_module().lse
    gen = torch.Generator().manual_seed(3)
    block = lse.IDS_CONFIG.kwargs["BLOCK_ROWS"]
    dtypes = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64)
    batches = []
    for dtype in dtypes:
        info = torch.iinfo(torch.int64 if dtype == torch.uint64 else dtype)
        ends = torch.tensor([info.min, info.min + 1, -1 if info.min < 0 else 0, 0, 1, info.max - 1, info.max] * 2)
        # (uint64's: int64's bits, 2^63 to 2^64 - 1 as the negative ones)
        batches.append((ends.view(dtype) if dtype == torch.uint64 else ends.to(dtype), None))
        few = torch.randint(0, 5, (2 * block + 3,), generator=gen).to(dtype)
        batches.append((few, torch.randint(0, 7, (9,), generator=gen).to(dtype)))
        batches.append((few[::3], few[1:200]))  # (strided)
    batches.append((torch.tensor([2**40, -1, 7]), torch.tensor([7, 3, -1], dtype=torch.int8)))
    batches.append((torch.tensor([-1, 255, 1], dtype=torch.int32), torch.tensor([255, 1], dtype=torch.uint8)))
    batches.append((torch.zeros(0, dtype=torch.int64), torch.tensor([4, 4, 2])))
    batches.append((torch.tensor([4, 4, 2]), torch.zeros(0, dtype=torch.int64)))
    batches.append((torch.randperm(729, generator=gen), None))  # (9^3 labels: a level more than 9^3 - 1)
    batches.append((torch.zeros(0, dtype=torch.int32), None))
    # And searches deeper than the labels need (tools/gpu_model.py counts the headline's depth).
    for i, (labels, ref_labels) in enumerate(batches + batches[-6:]):
        if i == len(batches):
            monkeypatch.setattr(lse, "_search_levels", lambda n: 10)  # (9^10 > 2^31 labels)
        sides = (labels,) if ref_labels is None else (labels, ref_labels)
        every = torch.cat([v.to(torch.int64) for v in sides])
        want = (every[None, :] < every[:, None]).sum(1).to(torch.int32)  # the rank, O(n²)
        anchors, refs = sides[0].to(torch.int64), sides[-1].to(torch.int64)
        equal = (anchors[:, None] == refs[None, :]).sum(1).to(torch.int32)
        for self_ in (False, True):
            got, npos = lse._label_ids(*(v.to(device) for v in sides), self_=self_)
            assert [g.dtype for g in got] == [torch.int32] * len(sides) and npos.dtype == torch.int32
            torch.testing.assert_close(torch.cat([g.cpu() for g in got]), want, rtol=0, atol=0)
            torch.testing.assert_close(npos.cpu(), equal - int(self_), rtol=0, atol=0)


@pytest.mark.triton("pair_losses", dispatch=False)
@TRITON_DEVICE
def test_triton_groups_of_equal_rows(device):
    """_equal_rows: each row's group is the lowest number (anchors, then refs) of a row equal
    to it, entry by entry with ±0 alike; rows holding NaN or ±∞ are alone; rows one ulp apart,
    or equal but for the order of their entries, are not equal."""
    tp = triton_module()
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        _check_groups(tp, dtype, device)


def _check_groups(tp, dtype, device):
    g = torch.Generator().manual_seed(0)
    points = torch.randn(5, 6, generator=g).to(dtype)
    points[1] = 0
    points[2] = points[0].flip(0)
    points[3] = points[0]
    points[3, 2] = torch.nextafter(points[3, 2].float(), torch.tensor(9.0)).to(dtype)
    points[4, 1] = float("nan")
    pick = torch.tensor([0, 1, 2, 3, 4, 0, 1, 4, 2, 0])
    x = points[pick]
    x[6] = -x[6]  # −0 entries
    x[7] = x[7].nan_to_num(nan=float("inf"))
    x[8, 0] = float("-inf")
    x[9] = x[9]  # (an equal row after several others)
    config = tp.ROW_CONFIGS[-1]
    for split in (None, 4):
        rows = [x] if split is None else [x[:split], x[split:]]
        sides = [
            tp._Side(r.to(device), torch.zeros(len(r), dtype=torch.long, device=device), dtype, config, False)
            for r in rows
        ]
        got = torch.cat(list(tp._equal_rows(sides[0], sides[-1], config)[: len(sides)])).cpu()
        finite = x.isfinite().all(1)
        want = [
            next(j for j in range(len(x)) if finite[i] and (x[j] == x[i]).all()) if finite[i] else i
            for i in range(len(x))
        ]
        assert got.tolist() == want, split


@pytest.mark.triton("pair_losses", dispatch=False)  # (the ops: the CPU kernels)
@TRITON_DEVICE
@pytest.mark.parametrize(
    "loss,params",
    [("contrastive_loss", (0.0, 1.0, "euclidean")), ("triplet_margin_loss", (0.05, "batch_hard", "euclidean"))],
)
def test_triton_breaks_a_zero_rows_ties_as_the_cpu_kernel(loss, params, device):
    """A zero row's distances to the normalised rows are 1 within an ulp: on neg_margin = 1 and
    between candidates, the choice is the rounding's, so the Triton kernels must round as the
    CPU kernels, which are compiled without FMA contraction (setup.py). These seeds meet such
    ties: a kernel that fuses products and sums gives another contrastive loss or another
    batch-hard negative."""
    tp = triton_module()
    forward_t = getattr(tp, f"{loss.removesuffix('_loss')}_forward")
    for seed in (4, 6, 11):
        e, labels = make((24, 9), seed=seed), make_labels(24, 3, seed=seed)
        e[3] = 0
        value, stats = raw(loss)[0](e, labels, None, None, *params)
        got, got_stats = forward_t(*on(device, e, labels), None, None, *params)
        torch.testing.assert_close(got.cpu(), value, rtol=1e-12, atol=1e-12)
        assert torch.equal(got_stats.cpu(), stats)


@pytest.mark.triton("pair_losses", dispatch=False)  # (the ops: the CPU kernels)
@TRITON_DEVICE
@pytest.mark.parametrize(
    "params",
    [
        (0.0, 1.0, "euclidean"),
        (0.2, "all", "euclidean"),
        (0.2, "semi_hard", "euclidean"),
        (0.2, "batch_hard", "euclidean"),
    ],
    ids=lambda p: str(p[1]),
)
def test_triton_one_feature_rows_as_the_cpu_kernel(params, device):
    """At D = 1 the exact distances divide (rows exactly ±1, x/eps where clamped): the Triton
    kernels' choices and loss are the CPU kernel's, with and without refs, and so are the
    gradients, within float64's rounding of their scale 1/max(|x|, eps) (the normalisation's
    Jacobian vanishes at D = 1 but for the clamped rows: the others' gradients are rounding
    noise, of either kernel)."""
    loss = "contrastive_loss" if params[1] == 1.0 else "triplet_margin_loss"
    tp = triton_module()
    op, backward = raw(loss)
    name = loss.removesuffix("_loss")
    forward_t, backward_t = getattr(tp, f"{name}_forward"), getattr(tp, f"{name}_backward")
    g = torch.Generator().manual_seed(5)
    e = torch.randn(30, 1, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-14, 7, (30, 1), generator=g)
    e[4] = 0
    labels = make_labels(30, 3, seed=5)
    for ref, ref_labels in ((None, None), (e[:11].flip(0) * 3, labels[:11])):
        value, stats = op(e, labels, ref, ref_labels, *params)
        inputs = on(device, e, labels, ref, ref_labels)
        got, got_stats = forward_t(*inputs, *params)
        torch.testing.assert_close(got.cpu(), value, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_stats.cpu(), stats, rtol=1e-12, atol=1e-12)
        grad, mask = torch.tensor(0.7, dtype=e.dtype), [True, ref is not None]
        exp = backward(grad, e, labels, ref, ref_labels, stats, *params, mask)
        out = backward_t(*on(device, grad), *inputs, got_stats, *params, mask)
        for a, b, x in zip(out, exp, (e, ref if ref is not None else e[:0]), strict=True):
            scale = 1 / x.abs().clamp_min(1e-12)
            assert ((a.cpu() - b).abs() <= 1e-12 * b.abs() + 1e-15 * scale).all()


def triton_problems():
    """Ragged sizes around every configuration's blocks: without refs, with refs, and a batch
    with a zero row and one whose positives are all in the refs."""
    e, labels = make((45, 19), seed=21), make_labels(45, 6)
    ref, ref_labels = make((51, 19), seed=22), make_labels(51, 6, seed=2)
    z = make((9, 7), seed=23)
    z[2] = 0
    yield e, labels, None, None
    yield e, labels, ref, ref_labels
    yield z, torch.arange(9) % 4, make((5, 7), seed=24), torch.tensor([0, 1, 2, 3, 0])


# Parameters of the configuration test per loss: the schema's, after the tensors.
TRITON_PARAMS = [
    ("supcon_loss", (0.3,)),
    ("ntxent_loss", (0.3,)),
    ("contrastive_loss", (0.3, 1.2, "euclidean")),
    ("triplet_margin_loss", (0.05, "batch_hard", "euclidean")),
    ("triplet_margin_loss", (0.05, "all", "euclidean")),
    ("triplet_margin_loss", (0.3, "semi_hard", "euclidean")),
    ("multi_similarity_loss", (2.0, 50.0, 0.5, 0.1)),
    ("multi_similarity_loss", (1.0, 10.0, 0.2, None)),
]


@pytest.mark.triton("pair_losses", dispatch=False)  # (the ops: the CPU kernels)
@TRITON_DEVICE
@pytest.mark.parametrize("loss,params", TRITON_PARAMS)
@pytest.mark.parametrize("which", [0, 1, 2])
def test_triton_every_configuration_matches_the_cpu_kernel(loss, params, which, device):
    """Each launch configuration of each kernel (configuration `which` of each, the last one
    where a kernel has fewer), in float64, against the CPU kernel: loss, stats, and each
    backward from the other's stats."""
    tp = triton_module()
    op, backward = raw(loss)
    name = loss.removesuffix("_loss")
    forward_t, backward_t = getattr(tp, f"{name}_forward"), getattr(tp, f"{name}_backward")
    pick = lambda configs: configs[min(which, len(configs) - 1)]  # noqa: E731
    exact = loss != "supcon_loss" and loss != "ntxent_loss"  # float64 tiles beside ACC's
    hard = loss == "triplet_margin_loss" and params[1] == "batch_hard"
    triplets = loss == "triplet_margin_loss" and not hard  # all, semi_hard
    engine = {"multi_similarity_loss": tp.ms, "contrastive_loss": tp.euclid}.get(loss, tp.triplets if hard else None)
    rows = pick(tp.triplets.ALL_ROWS_CONFIGS if triplets else engine.ROWS_CONFIGS if engine else tp.lse.ROWS_CONFIGS)
    grad = pick(
        tp.HARD_GRAD_CONFIGS
        if hard
        else tp.triplets.BAND_GRAD_CONFIGS
        if triplets
        else engine.GRAD_CONFIGS
        if engine
        else tp.lse.GRAD_CONFIGS
    )
    row = pick(tp.ROW_CONFIGS if exact else tp.lse.ROW_CONFIGS)
    more = dict(rows_config=rows) if triplets else {}
    exact_configs = tp.triplets.ALL_EXACT_CONFIGS if triplets else engine.EXACT_CONFIGS if engine else None
    forward_more = dict(exact_config=pick(exact_configs)) if exact_configs else {}
    for e, labels, ref, ref_labels in triton_problems():
        value, stats = op(e, labels, ref, ref_labels, *params)
        inputs = on(device, e, labels, ref, ref_labels)
        got, got_stats = forward_t(*inputs, *params, config=rows, row_config=row, **forward_more)
        torch.testing.assert_close(got.cpu(), value, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_stats.cpu(), stats, rtol=1e-12, atol=1e-12)
        g = torch.tensor(0.7, dtype=e.dtype)
        mask = [True, ref is not None]
        exp = backward(g, e, labels, ref, ref_labels, stats, *params, mask)
        (st,) = on(device, stats)
        out = backward_t(*on(device, g), *inputs, st, *params, mask, config=grad, row_config=row, **more)
        for a, b in zip(out, exp, strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-12, atol=1e-13)
        for a, b in zip(backward(g, e, labels, ref, ref_labels, got_stats.cpu(), *params, mask), exp, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.triton("pair_losses", dispatch=False)  # (the ops: the CPU kernels)
@TRITON_DEVICE
@pytest.mark.parametrize("mining", ["all", "semi_hard"])
def test_triton_triplets_in_chunks_of_positives_and_bands_of_anchors(monkeypatch, mining, device):
    """Two classes: each anchor's positives span several of triplet_rows_kernel's chunks, past
    those whose distances positives_kernel keeps; a band of 2^6 pairs: the backward takes its
    anchors a block at a time."""
    tp = triton_module()
    monkeypatch.setattr(tp, "BAND_PAIRS", 64)
    monkeypatch.setattr(tp.triplets, "POS_CAP", 8)
    op, backward = raw("triplet_margin_loss")
    e, labels = make((40, 6), seed=25), make_labels(40, 2)
    ref, ref_labels = make((23, 6), seed=26), make_labels(23, 2, seed=4)
    for r, rl in ((None, None), (ref, ref_labels)):
        value, stats = op(e, labels, r, rl, 0.2, mining, "euclidean")
        inputs = on(device, e, labels, r, rl)
        got, got_stats = tp.triplet_margin_forward(*inputs, 0.2, mining, "euclidean")
        torch.testing.assert_close(got.cpu(), value, rtol=1e-12, atol=1e-12)
        assert torch.equal(got_stats.cpu(), stats)
        g, mask = torch.tensor(0.7, dtype=e.dtype), [True, r is not None]
        exp = backward(g, e, labels, r, rl, stats, 0.2, mining, "euclidean", mask)
        out = tp.triplet_margin_backward(*on(device, g), *inputs, got_stats, 0.2, mining, "euclidean", mask)
        for a, b in zip(out, exp, strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-12, atol=1e-13)


@pytest.mark.triton("pair_losses")
@pytest.mark.parametrize("loss,params", list(dict(TRITON_PARAMS).items()))  # one case per loss
def test_triton_backward_checks_its_inputs(loss, params):
    tp = triton_module()
    name = loss.removesuffix("_loss")
    columns = COLUMNS[loss]
    kind = {"triplet_margin_loss": "Long", "multi_similarity_loss": "Double"}.get(loss, "Float")
    _, stats = raw(loss)[0](e4, l6, None, None, *params)
    backward_t = getattr(tp, f"{name}_backward")
    with pytest.raises(ValueError, match=r"backward: grad must be a scalar"):
        backward_t(torch.ones(2), e4, l6, None, None, stats, *params, [True, False])
    with pytest.raises(ValueError, match=rf"backward: stats must be \(N, {columns}\) = \(6, {columns}\) of {kind}"):
        backward_t(torch.ones(()), e4, l6, None, None, stats.new_zeros(6, 7), *params, [True, False])
    with pytest.raises(TypeError, match=r"embeddings and grad must have the same dtype"):
        backward_t(torch.ones((), dtype=torch.float64), e4, l6, None, None, stats, *params, [True, False])
    name_, bad, rule = {
        "multi_similarity_loss": ("alpha", (0.0, *params[1:]), "finite and > 0"),
        "contrastive_loss": ("neg_margin", (0.0, float("nan"), "euclidean"), "finite,"),
        "triplet_margin_loss": ("margin", (float("inf"), "batch_hard", "euclidean"), "finite,"),
    }.get(loss, ("temperature", (0.0,), "finite and > 0"))
    with pytest.raises(ValueError, match=rf"{name_} must be {rule}"):
        getattr(tp, f"{name}_forward")(e4, l6, None, None, *bad)


@pytest.mark.triton("pair_losses", dispatch=False)  # (the ops: the CPU kernels)
@TRITON_DEVICE
@pytest.mark.parametrize("loss,params", TRITON_PARAMS)
def test_triton_shards_match_the_cpu_kernel(loss, params, device):
    """The raw ops as group= calls them, in float64 against the CPU kernel: shards of the rows
    (one empty, one of a single row) and shards of separate refs (more than the anchors, and
    fewer); parts and stats, and each backward with a float64 grad: a shard of the rows' from
    the whole problem's stats where the loss takes them (its rows' whole gradient), else from
    its own."""
    from torchkit.ops._pair_losses_across_ranks import _whole, _whole_stats

    tp = triton_module()
    op, backward = raw(loss)
    name = loss.removesuffix("_loss")
    forward_t, backward_t = getattr(tp, f"{name}_forward"), getattr(tp, f"{name}_backward")
    rows, labels = make((41, 19), seed=27), make_labels(41, 6, seed=5)
    labels[25] = 6  # alone in its class: no positive but itself
    shards = [(0, 0), (0, 17), (17, 18), (18, 41)]
    results = [op(rows[a:b], labels[a:b], rows, labels, *params, a) for a, b in shards]
    total = sum(parts for parts, _ in results)
    whole_stats = torch.cat(
        [_whole_stats(loss, s, scale) for _, scale, s in (_whole(loss, p, total, s) for p, s in results)]
    )
    g, mask = torch.tensor(0.7, dtype=torch.float64), [True, True]
    on_device = on(device, rows, labels, g)
    for (a, b), (parts, stats) in zip(shards, results, strict=True):
        e, e_labels, refs, ref_labels, g_ = (*on(device, rows[a:b], labels[a:b]), *on_device)
        got, got_stats = forward_t(e, e_labels, refs, ref_labels, *params, a)
        torch.testing.assert_close(got.cpu(), parts, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_stats.cpu(), stats, rtol=1e-12, atol=1e-12)
        st = whole_stats if ops.pair_losses.SPECS[loss].whole_stats else stats
        exp = backward(g, rows[a:b], labels[a:b], rows, labels, st, *params, mask, a)
        out = backward_t(g_, e, e_labels, refs, ref_labels, *on(device, st), *params, mask, a)
        for x, y in zip(out, exp, strict=True):
            torch.testing.assert_close(x.cpu(), y, rtol=1e-12, atol=1e-13)
    e, e_labels = make((13, 19), seed=28), make_labels(13, 6, seed=6)
    for refs, ref_labels in ((rows, labels), (rows[:5], labels[:5])):  # (the second: fewer than the anchors)
        parts, stats = op(e, e_labels, refs, ref_labels, *params, -1)
        inputs = on(device, e, e_labels, refs, ref_labels)
        got, got_stats = forward_t(*inputs, *params, -1)
        torch.testing.assert_close(got.cpu(), parts, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_stats.cpu(), stats, rtol=1e-12, atol=1e-12)
        exp = backward(g, e, e_labels, refs, ref_labels, stats, *params, mask, -1)
        out = backward_t(*on(device, g), *inputs, got_stats, *params, mask, -1)
        for x, y in zip(out, exp, strict=True):
            torch.testing.assert_close(x.cpu(), y, rtol=1e-12, atol=1e-13)


@pytest.mark.triton("pair_losses", dispatch=False)
@TRITON_DEVICE
def test_triton_refuses_the_cosine_distance(device):
    """distance="cosine" has the CPU kernel alone: the Triton kernels (the CUDA ones) refuse it
    by name, forward and backward, after the distance's own check."""
    tp = triton_module()
    e, labels = on(device, e4, l6)
    stats = torch.zeros(6, 3, dtype=torch.int64, device=e.device)
    g, mask = torch.ones((), device=e.device), [True, False]
    calls = [
        lambda d: tp.contrastive_forward(e, labels, None, None, 1.0, 0.0, d),
        lambda d: tp.contrastive_backward(g, e, labels, None, None, stats[:, :2].float(), 1.0, 0.0, d, mask),
        lambda d: tp.triplet_margin_forward(e, labels, None, None, 0.1, "all", d),
        lambda d: tp.triplet_margin_backward(g, e, labels, None, None, stats, 0.1, "all", d, mask),
    ]
    for call in calls:
        with pytest.raises(NotImplementedError, match=r"^\w+: distance='cosine' has no CUDA kernel yet"):
            call("cosine")
        with pytest.raises(ValueError, match=r"^\w+: distance must be 'euclidean' or 'cosine', got 'l1'"):
            call("l1")


@pytest.mark.triton("pair_losses")
@pytest.mark.parametrize("loss,params", list(dict(TRITON_PARAMS).items()))  # one case per loss
def test_triton_shard_is_checked(loss, params):
    """test_shard_is_checked's refusals, from the Triton kernels."""
    tp = triton_module()
    name = loss.removesuffix("_loss")
    forward_t, backward_t = getattr(tp, f"{name}_forward"), getattr(tp, f"{name}_backward")
    rows, labels = make((6, 3)), make_labels(6, 2)
    with pytest.raises(ValueError, match=rf"^{loss}: shard needs ref_embeddings"):
        forward_t(rows, labels, None, None, *params, 0)
    with pytest.raises(ValueError, match=rf"^{loss}: shard must be -1 .* in \[0, M - N\] = \[0, 4\], got 5"):
        forward_t(rows[:2], labels[:2], rows, labels, *params, 5)
    # The shard before the parameters' values, in the CPU kernel's order (the fake kernels' too).
    worse = (float("nan"), *params[1:])
    for fn in (forward_t, raw(loss)[0]):
        with pytest.raises(ValueError, match=rf"^{loss}: shard must be -1 .*, got 5"):
            fn(rows[:2], labels[:2], rows, labels, *worse, 5)
    other = labels.clone()
    other[3] += 1
    with pytest.raises(
        ValueError, match=rf"^{loss}: with shard = 2, labels must equal ref_labels\[shard:shard \+ N\].* anchor 1$"
    ):
        forward_t(rows[2:4], other[2:4], rows, labels, *params, 2)
    moved = rows.clone()
    moved[3, 1] = -moved[3, 1]
    with pytest.raises(
        ValueError,
        match=rf"^{loss}: with shard = 2, embeddings must equal ref_embeddings\[shard:shard \+ N\].* anchor 1$",
    ):
        forward_t(moved[2:4], labels[2:4], rows, labels, *params, 2)
    _, stats = raw(loss)[0](rows[2:4], labels[2:4], rows, labels, *params, 2)
    g = torch.ones((), dtype=torch.float64)
    columns = stats.shape[1]
    if ops.pair_losses.SPECS[loss].whole_stats:  # a shard of the rows' backward takes the whole problem's stats
        rule, bad = rf"\(M, {columns}\) = \(6, .* whole problem's\)", stats
    else:  # its own
        rule, bad = rf"\(N, {columns}\) = \(2, {columns}\)", stats.repeat(3, 1)
    with pytest.raises(ValueError, match=rf"^{loss}: backward: stats must be {rule}"):
        backward_t(g, rows[2:4], labels[2:4], rows, labels, bad, *params, [True, True], 2)
    with pytest.raises(TypeError, match=r"embeddings and grad must have the same dtype"):  # float64: a shard's only
        backward_t(g.float(), rows[2:4], labels[2:4], rows, labels, stats, *params, [True, True], -1)


@pytest.mark.triton("pair_losses", dispatch=False)  # (the ops: the CPU kernels)
@TRITON_DEVICE
def test_proxy_anchor_triton_shard_matches_the_cpu_kernel(device):
    """proxy_anchor_loss's shard (group=): per proxy the two log-sums without the 1 and whether
    it has positives, from the Triton kernel against the CPU kernel's, in float64; a proxy
    without positives (−∞), a shard of no embeddings, and shard = 0 refused."""
    tp = triton_module()
    op, _ = raw("proxy_anchor_loss")
    e, labels, proxies = make((45, 19), seed=29), make_labels(45, 6, seed=7), make((8, 19), seed=30)
    for a, b in ((0, 45), (0, 0), (7, 20)):
        parts, stats = op(e[a:b], labels[a:b], proxies, 0.1, 32.0, -1)
        got, got_stats = tp.proxy_anchor_forward(*on(device, e[a:b], labels[a:b], proxies), 0.1, 32.0, -1)
        assert torch.isneginf(parts[6:, 0]).all()  # labels < 6: proxies 6 and 7 have no positives
        torch.testing.assert_close(got.cpu(), parts, rtol=1e-12, atol=1e-12)
        assert got_stats.shape == stats.shape and got_stats.dtype == stats.dtype
    with pytest.raises(ValueError, match=r"^proxy_anchor_loss: shard must be -1 .*, got 0$"):
        tp.proxy_anchor_forward(e, labels, proxies, 0.1, 32.0, 0)


@pytest.mark.cuda
@pytest.mark.parametrize("loss,params", TRITON_PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_triton_on_cuda_matches_the_cpu_kernel(loss, params, dtype):
    """The Triton kernels compiled, on CUDA tensors, against the CPU kernel on the same values,
    with refs and without; no host synchronisation."""
    tp = triton_module()
    name = loss.removesuffix("_loss")
    op, backward = raw(loss)
    # bfloat16: one rounding of the output apart
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype]
    e, labels = make((300, 64), dtype, seed=31), make_labels(300, 20)
    ref, ref_labels = make((170, 64), dtype, seed=32), make_labels(170, 20, seed=3)
    for r, rl in ((None, None), (ref, ref_labels)):
        value, stats = op(e, labels, r, rl, *params)
        g = torch.tensor(0.5, dtype=dtype)
        mask = [True, r is not None]
        exp = backward(g, e, labels, r, rl, stats, *params, mask)
        inputs, g_cuda = on("cuda", e, labels, r, rl), g.cuda()  # (a copy from the host synchronises)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got, got_stats = getattr(tp, f"{name}_forward")(*inputs, *params)
            out = getattr(tp, f"{name}_backward")(g_cuda, *inputs, got_stats, *params, mask)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.testing.assert_close(got.cpu(), value, rtol=tol, atol=tol)
        torch.testing.assert_close(got_stats.cpu(), stats, rtol=tol, atol=tol)
        for a, b in zip(out, exp, strict=True):
            scale = b.abs().max().double().clamp(min=1e-30)
            assert (a.cpu().double() - b.double()).abs().max() <= tol * scale * 4


@pytest.mark.cuda
@pytest.mark.parametrize("loss,params", TRITON_PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_shards_on_cuda_match_the_cpu_kernel(loss, params, dtype):
    """The shards' Triton kernels compiled, on CUDA tensors, against the CPU kernel: a shard of
    the rows (its backward from the whole problem's stats where the loss takes them) and a
    shard of separate refs, with a float64 grad; no host synchronisation."""
    from torchkit.ops._pair_losses_across_ranks import _whole, _whole_stats

    tp = triton_module()
    name = loss.removesuffix("_loss")
    op, backward = raw(loss)
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype]
    rows, labels = make((300, 64), dtype, seed=33), make_labels(300, 20)
    e, e_labels = make((90, 64), dtype, seed=34), make_labels(90, 20, seed=4)
    shards = [(0, 120), (120, 300)]
    results = [op(rows[a:b], labels[a:b], rows, labels, *params, a) for a, b in shards]
    total = sum(parts for parts, _ in results)
    wholes = (_whole(loss, p, total, s) for p, s in results)
    whole_stats = torch.cat([_whole_stats(loss, s, scale) for _, scale, s in wholes])
    g, mask = torch.tensor(0.5, dtype=torch.float64), [True, True]
    whole = whole_stats if ops.pair_losses.SPECS[loss].whole_stats else None  # (None: the shard's own)
    cases = [(rows[a:b], labels[a:b], whole, a) for a, b in shards] + [(e, e_labels, None, -1)]
    for x, x_labels, stats, shard in cases:
        parts, own_stats = op(x, x_labels, rows, labels, *params, shard)
        stats = own_stats if stats is None else stats
        exp = backward(g, x, x_labels, rows, labels, stats, *params, mask, shard)
        inputs = on("cuda", x, x_labels, rows, labels, stats, g)  # (a copy from the host synchronises)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got, got_stats = getattr(tp, f"{name}_forward")(*inputs[:4], *params, shard)
            out = getattr(tp, f"{name}_backward")(inputs[5], *inputs[:4], inputs[4], *params, mask, shard)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.testing.assert_close(got.cpu(), parts, rtol=tol, atol=tol)
        torch.testing.assert_close(got_stats.cpu(), own_stats, rtol=tol, atol=tol)
        for a, b in zip(out, exp, strict=True):
            scale = b.abs().max().double().clamp(min=1e-30)
            assert (a.cpu().double() - b.double()).abs().max() <= tol * scale * 4


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_proxy_anchor_triton_on_cuda_matches_the_cpu_kernel(dtype):
    tp = triton_module()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype]
    e, labels, proxies = make((300, 64), dtype, seed=43), make_labels(300, 90), make((100, 64), dtype, seed=44)
    value, stats = torch.ops.torchkit.proxy_anchor_loss(e, labels, proxies, 0.1, 32.0)
    g = torch.tensor(0.5, dtype=dtype)
    exp = torch.ops.torchkit._proxy_anchor_loss_backward(g, e, labels, proxies, stats, 0.1, 32.0, [True, True])
    inputs, g_cuda = on("cuda", e, labels, proxies), g.cuda()  # (a copy from the host synchronises)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got, got_stats = tp.proxy_anchor_forward(*inputs, 0.1, 32.0)
        out = tp.proxy_anchor_backward(g_cuda, *inputs, got_stats, 0.1, 32.0, [True, True])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(got.cpu(), value, rtol=tol, atol=tol)
    torch.testing.assert_close(got_stats.cpu(), stats, rtol=tol, atol=tol)
    for a, b in zip(out, exp, strict=True):
        assert (a.cpu().double() - b.double()).abs().max() <= 4 * tol * b.abs().max().double()


@pytest.mark.parametrize("loss", NAMES)
def test_cuda_tensors_are_refused_with_a_reason(loss):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with pytest.raises(NotImplementedError, match=rf"{loss}: no cuda kernel yet"):
        getattr(ops, loss)(e4.cuda(), l6.cuda())


@configs
def test_reference_is_pml(loss, params):
    e, labels = make((30, 6)), make_labels(30, 4)
    ref, ref_labels = make((11, 6), seed=1), make_labels(11, 4, seed=1)
    fn = ref_fn(loss, params)
    torch.testing.assert_close(fn(e, labels), pml(loss, params)(e, labels))
    torch.testing.assert_close(fn(e, labels, ref, ref_labels), pml(loss, params)(e, labels, ref, ref_labels))


def test_ntxent_anchor_without_negatives_counts_zero_pairs():
    """Refs all of anchor 0's label: its two positive pairs cost 0 and count in the mean (PML);
    anchor 1 has no positives, but gives the batch its negative pairs."""
    e, labels = make((2, 3)), torch.tensor([0, 1])
    ref, ref_labels = make((2, 3), seed=1), torch.tensor([0, 0])
    got = ops.ntxent_loss(e, labels, 0.1, ref_embeddings=ref, ref_labels=ref_labels)
    torch.testing.assert_close(got, pml("ntxent_loss", {"temperature": 0.1})(e, labels, ref, ref_labels))
    assert abs(got.item()) < 1e-300


# Through the Triton kernels, one loss per kernel: NT-Xent shares SupCon's, semi-hard triplets
# all triplets'.
@with_kernels(
    VARIANTS,
    VARIANT_IDS,
    triton=lambda loss, params: loss != "ntxent_loss" and params.get("mining") != "semi_hard",
)
@pytest.mark.parametrize(
    "dtype,scales", [(torch.float32, (1e-11, 1e20, 1e30, 1e38)), (torch.float64, (1e-11, 1e200, 1e300))]
)
def test_the_whole_finite_range(loss, params, dtype, scales, device):
    """Normalised rows do not see a row's scale: above F.normalize's clamp (norms >= 1e-12) the
    loss is the unit rows' and the gradient scales as 1/scale, where the embeddings' squares
    overflow (F.normalize divides by ∞ there, and PML returns a constant); below it, the
    clamp's own result, as the float64 reference computes it."""
    e, labels = make((40, 6), dtype, seed=11), make_labels(40, 4)
    ref, ref_labels = make((17, 6), dtype, seed=12), make_labels(17, 4, seed=1)
    for r in (None, ref):
        rl = None if r is None else ref_labels
        base, (g_base, *_) = loss_and_grads(ours(loss, params), e, labels, r, rl)
        for scale in scales:
            got, (g, *_) = loss_and_grads(ours(loss, params), e * scale, labels, None if r is None else r * scale, rl)
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got, base, **tol)
            torch.testing.assert_close(g.double() * scale, g_base.double(), **tol)
    for scale in (1e-20, 1e-30) if dtype == torch.float32 else (1e-200, 1e-300):
        x = e * scale
        got, (g,) = loss_and_grads(ours(loss, params), x, labels)
        exp, (g64,) = loss_and_grads(ref_fn(loss, params), x.double(), labels)
        torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g.double(), g64, rtol=1e-5, atol=1e-6 * g64.abs().max().item())


@variants_k
def test_non_finite_embedding_makes_the_loss_nan(loss, params, device):
    e, labels = make((20, 5)), make_labels(20, 3)
    e[7, 1] = float("inf")
    assert getattr(ops, loss)(e, labels, **params).isnan()


# The losses where an anchor without positives among the refs has no term at all.
WITHOUT_POSITIVES = [
    (case, i)
    for case, i in zip(VARIANTS, VARIANT_IDS, strict=True)
    if case[0] in ("supcon_loss", "ntxent_loss", "triplet_margin_loss")
]


@with_kernels([case for case, _ in WITHOUT_POSITIVES], [i for _, i in WITHOUT_POSITIVES])
def test_a_non_finite_anchor_without_positives_keeps_to_its_own_terms(loss, params, device, request):
    """It adds nothing to the loss, so nothing to any other row's gradient: the loss and the
    other rows' gradients are those of the batch without it (NaN, inf or -inf). (Its own
    gradient is F.normalize's of a non-finite row: NaN.) 70 anchors and 300 refs cross the CPU
    kernels' tiles; 70 refs the Triton kernels' (of 64 refs; fewer anchors: the interpreter is
    slow)."""
    fn = getattr(ops, loss)
    N, M = (12, 70) if request.node.get_closest_marker("triton") else (70, 300)
    e, refs = make((N, 6), torch.float32), make((M, 6), torch.float32, seed=1)
    labels, ref_labels = make_labels(N, 4), make_labels(M, 4, seed=1)
    bad = N - 5
    keep = torch.arange(N) != bad
    x0, r0 = e[keep].clone().requires_grad_(), refs.clone().requires_grad_()
    expected = fn(x0, labels[keep], **params, ref_embeddings=r0, ref_labels=ref_labels)
    expected.backward()
    labels[bad] = 9
    for value in (float("nan"), float("inf"), -float("inf")):
        e[bad, 2] = value
        x, r = e.clone().requires_grad_(), refs.clone().requires_grad_()
        got = fn(x, labels, **params, ref_embeddings=r, ref_labels=ref_labels)
        got.backward()
        msg = lambda m, value=value: f"{value} in the row: {m}"  # noqa: E731
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7, msg=msg)
        torch.testing.assert_close(r.grad, r0.grad, rtol=1e-5, atol=1e-7, msg=msg)
        torch.testing.assert_close(x.grad[keep], x0.grad, rtol=1e-5, atol=1e-7, msg=msg)


@variants_k
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 1e300])
def test_inputs_are_never_written(loss, params, dtype, scale, device):
    """Rows of the accumulation type are read in place (no copy): the kernels must not write
    into them, on the ordinary path nor where rows are normalised first."""
    e = (make((30, 5)) * min(scale, torch.finfo(dtype).max / 10)).to(dtype).requires_grad_()
    ref = make((9, 5), dtype, seed=1).requires_grad_()
    labels, ref_labels = make_labels(30, 3), make_labels(9, 3, seed=1)
    before = e.detach().clone(), ref.detach().clone()
    getattr(ops, loss)(e, labels, **params, ref_embeddings=ref, ref_labels=ref_labels).backward()
    getattr(ops, loss)(e, labels, **params).backward()
    assert torch.equal(e.detach(), before[0]) and torch.equal(ref.detach(), before[1])


# ---------------------------------------------------------------------------- proxy_anchor_loss


def pml_proxy_anchor(margin=0.1, alpha=32.0):
    """PML's ProxyAnchorLoss holding the given proxies, as fn(embeddings, labels, proxies)."""

    def fn(embeddings, labels, proxies):
        loss = losses.ProxyAnchorLoss(len(proxies), proxies.shape[1], margin=margin, alpha=alpha).to(proxies.dtype)
        del loss.proxies
        loss.proxies = proxies  # a leaf of the caller's: its gradient lands there
        return loss(embeddings, labels)

    return fn


def proxy_loss_and_grads(fn, e, labels, proxies):
    leaves = [e.detach().clone().requires_grad_(), proxies.detach().clone().requires_grad_()]
    out = fn(leaves[0], labels, leaves[1])
    grads = torch.autograd.grad(out, leaves, allow_unused=True) if out.requires_grad else [None, None]
    return out.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)]


@pytest.mark.parametrize(
    "dtype,device",
    [
        pytest.param(torch.float64, "cpu", id="float64"),
        pytest.param(torch.float32, "cpu", id="float32"),
        pytest.param(torch.float32, "cpu", id="float32-triton", marks=TRITON_MARK),
    ],
)
@pytest.mark.parametrize("N,C,D", [(50, 5, 16), (160, 40, 33), (129, 300, 65), (9, 1, 5), (0, 3, 4), (70, 70, 8)])
@pytest.mark.parametrize("margin,alpha", [(0.1, 32.0), (0.0, 4.0)])
def test_proxy_anchor_matches_pytorch_metric_learning(dtype, N, C, D, margin, alpha, device):
    """Values and the gradients of the embeddings and the proxies; classes without samples
    (C = 300 > N) count only in the negative term, as PML's divisors have it. Through the
    Triton kernels in float32: their float64 values are the configuration test's, against the
    CPU kernel at 1e-12."""
    e, labels, proxies = make((N, D), dtype, seed=1), make_labels(N, C), make((C, D), dtype, seed=2)
    got, got_grads = proxy_loss_and_grads(
        lambda a, lab, p: ops.proxy_anchor_loss(a, lab, p, margin, alpha), e, labels, proxies
    )
    exp, exp_grads = proxy_loss_and_grads(pml_proxy_anchor(margin, alpha), e, labels, proxies)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, exp, **tol)
    for a, b in zip(got_grads, exp_grads, strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_proxy_anchor_reference_is_pml():
    e, labels, proxies = make((30, 6)), make_labels(30, 8), make((8, 6), seed=1)
    torch.testing.assert_close(
        reference.proxy_anchor_loss(e, labels, proxies, 0.2, 16.0), pml_proxy_anchor(0.2, 16.0)(e, labels, proxies)
    )


@kernels
def test_proxy_anchor_float32_is_within_1e5_of_float64(device):
    e, labels, proxies = (
        make((300, 64), torch.float32, seed=3, offset=0.3),
        make_labels(300, 20),
        make((20, 64), torch.float32, seed=4),
    )
    fn = ops.proxy_anchor_loss
    got, got_grads = proxy_loss_and_grads(fn, e, labels, proxies)
    exp, exp_grads = proxy_loss_and_grads(reference.proxy_anchor_loss, e.double(), labels, proxies.double())
    assert abs(got.double() - exp).item() <= 1e-5 * exp.abs().item()
    for a, b in zip(got_grads, exp_grads, strict=True):
        assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max()


@kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_proxy_anchor_reduced_precision_accumulates_in_float32(dtype, device):
    e, labels, proxies = make((100, 32), dtype, seed=7), make_labels(100, 8), make((8, 32), dtype, seed=8)
    got, (g, gp) = proxy_loss_and_grads(
        lambda a, lab, p: ops.proxy_anchor_loss(a, lab, p, 0.1, 8.0), e, labels, proxies
    )
    exp, (g64, gp64) = proxy_loss_and_grads(
        lambda a, lab, p: reference.proxy_anchor_loss(a, lab, p, 0.1, 8.0), e.double(), labels, proxies.double()
    )
    eps = torch.finfo(dtype).eps
    assert got.dtype == g.dtype == gp.dtype == dtype
    assert abs(got.double() - exp).item() <= 2 * eps * exp.abs().item()
    assert (g.double() - g64).abs().max() <= 4 * eps * g64.abs().max()
    assert (gp.double() - gp64).abs().max() <= 4 * eps * gp64.abs().max()


@kernels
def test_proxy_anchor_real_embeddings(device):
    """sklearn's digits as embeddings, 10 random proxies, against PML."""
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    e = torch.tensor(digits.data[:600], dtype=torch.float32)
    labels = torch.tensor(digits.target[:600])
    proxies = make((10, 64), torch.float32, seed=9)
    got, got_grads = proxy_loss_and_grads(ops.proxy_anchor_loss, e, labels, proxies)
    exp, exp_grads = proxy_loss_and_grads(pml_proxy_anchor(), e, labels, proxies)
    torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, exp_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@kernels
@pytest.mark.parametrize("dtype,scales", [(torch.float32, (1e-11, 1e20, 1e38)), (torch.float64, (1e-11, 1e300))])
def test_proxy_anchor_the_whole_finite_range(dtype, scales, device):
    e, labels, proxies = make((40, 6), dtype, seed=11), make_labels(40, 5), make((5, 6), dtype, seed=12)
    base, (g_base, gp_base) = proxy_loss_and_grads(ops.proxy_anchor_loss, e, labels, proxies)
    # (float32: each term's exponent α·s, α = 32, carries a cosine's rounding 32-fold: an
    # element of 0.09 in a gradient whose largest is ~4 moves by ~2e-6 between scales whose
    # cosines round differently)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for scale in scales:
        got, (g, gp) = proxy_loss_and_grads(ops.proxy_anchor_loss, e * scale, labels, proxies * scale)
        torch.testing.assert_close(got, base, **tol)
        torch.testing.assert_close(g.double() * scale, g_base.double(), **tol)
        torch.testing.assert_close(gp.double() * scale, gp_base.double(), **tol)


@kernels
@pytest.mark.parametrize("where", ["embeddings", "proxies"])
def test_proxy_anchor_nan_makes_the_loss_nan(where, device):
    e, labels, proxies = make((20, 5)), make_labels(20, 3), make((3, 5), seed=1)
    (e if where == "embeddings" else proxies)[1, 2] = float("nan")
    assert ops.proxy_anchor_loss(e, labels, proxies).isnan()


@pytest.mark.parametrize("nan", [False, True])
@pytest.mark.parametrize("N,C,D", [(300, 40, 8), (40, 300, 8), (1100, 1100, 512)])
def test_proxy_anchor_both_gradients_from_either_side(N, C, D, nan):
    """The CPU kernel forms both gradients in one pass over the tiles with the embeddings as
    their rows (few classes), with the proxies as their rows (few embeddings), or apart where
    neither side's partial gradients fit (here 8 slots of 1,100 × 512): each as the float64
    reference's; a NaN embedding makes every gradient NaN in each."""
    e, proxies = make((N, D), seed=5), make((C, D), seed=6)
    labels = make_labels(N, C, seed=5)
    if nan:
        e[N // 2, 0] = float("nan")
    got, got_grads = proxy_loss_and_grads(ops.proxy_anchor_loss, e, labels, proxies)
    exp, exp_grads = proxy_loss_and_grads(reference.proxy_anchor_loss, e, labels, proxies)
    torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12, equal_nan=True)
    for a, b in zip(got_grads, exp_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, equal_nan=True)
        assert a.isnan().all() == nan


def test_proxy_anchor_shard_sums_of_no_pairs_are_minus_infinity():
    """A shard (group=) whose embeddings are all of class 0: proxy 0 has no negative pairs and
    proxy 1 no positive ones, so those log-sums (without the 1) are −∞, whichever tiles and
    threads summed the others; the others equal the float64 sums of the shard's terms."""
    op, _ = raw("proxy_anchor_loss")
    e, proxies = make((40, 5), seed=3), make((3, 5), seed=4)
    labels = torch.tensor([0] * 30 + [2] * 10)
    parts, _ = op(e, labels, proxies, 0.1, 32.0, -1)
    assert torch.isneginf(parts[1, 0]) and not torch.isneginf(parts[0, 1])
    only = op(e[:30], labels[:30], proxies, 0.1, 32.0, -1)[0]
    assert torch.isneginf(only[0, 1]) and torch.isneginf(only[1:, 0]).all()
    s = torch.nn.functional.normalize(proxies) @ torch.nn.functional.normalize(e).T
    pos = labels[None, :] == torch.arange(3)[:, None]
    lp = torch.where(pos, 32.0 * (0.1 - s), -torch.inf).logsumexp(1)
    ln = torch.where(~pos, 32.0 * (s + 0.1), -torch.inf).logsumexp(1)
    torch.testing.assert_close(parts[:, :2], torch.stack([lp, ln], 1), rtol=1e-12, atol=1e-12)


@kernels
def test_proxy_anchor_empty_batch_is_zero_with_zero_gradients(device):
    e = make((0, 4)).requires_grad_()
    proxies = make((3, 4)).requires_grad_()
    out = ops.proxy_anchor_loss(e, torch.zeros(0, dtype=torch.long), proxies)
    assert out.item() == 0
    (gp,) = torch.autograd.grad(out, proxies, allow_unused=True, materialize_grads=True)
    assert torch.equal(gp, torch.zeros_like(proxies))


@kernels
@pytest.mark.bad_input
@pytest.mark.parametrize("bad", [5, -1])
def test_proxy_anchor_labels_must_name_a_proxy(bad, device):
    """Read by the kernel (a host check on CPU tensors): the same IndexError eagerly, through the
    raw op and compiled."""
    labels = torch.tensor([0, 1, 2, bad, 0, 1])
    proxies = make((5, 4), torch.float32)
    pattern = rf"proxy_anchor_loss: labels must lie in \[0, C\) = \[0, 5\) \(a row of proxies each\), got {bad}"
    with pytest.raises(IndexError, match=pattern):
        ops.proxy_anchor_loss(e4, labels, proxies)
    with pytest.raises(IndexError, match=pattern):
        torch.ops.torchkit.proxy_anchor_loss(e4, labels, proxies, 0.1, 32.0)
    with pytest.raises(Exception, match=pattern):
        compiled(ops.proxy_anchor_loss)(e4, labels, proxies)


@kernels
@pytest.mark.parametrize("with_proxies", [False, True])
def test_proxy_anchor_gradcheck(with_proxies, device):
    e = make((7, 3), seed=9).requires_grad_()
    labels = torch.tensor([0, 1, 0, 2, 1, 0, 2])
    proxies = make((4, 3), seed=10).requires_grad_(with_proxies)
    check_gradcheck(lambda a, p: ops.proxy_anchor_loss(a, labels, p, 0.1, 4.0), (e, proxies))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_proxy_anchor_shard(dtype):
    """The raw op as proxy_anchor_loss(group=) calls it: per proxy its two log-sums without the
    1 and whether it has positives; two shards of the embeddings merge into the whole's."""
    op, _ = raw("proxy_anchor_loss")
    e, labels, proxies = make((10, 4), dtype).requires_grad_(), make_labels(10, 4), make((5, 4), dtype, seed=1)
    check_opcheck(op, (e, labels, proxies, 0.1, 32.0, -1))
    whole, _ = op(e.detach(), labels, proxies, 0.1, 32.0, -1)
    halves = [op(e.detach()[a:b], labels[a:b], proxies, 0.1, 32.0, -1)[0] for a, b in ((0, 4), (4, 10))]
    assert whole.shape == (5, 3) and whole.dtype == torch.float64
    assert torch.equal(whole[:, 2], (labels.unsqueeze(1) == torch.arange(5)).any(0).double())
    assert torch.isneginf(whole[4, 0])  # no positives: log of an empty sum
    merged = torch.logaddexp(halves[0][:, :2], halves[1][:, :2])
    torch.testing.assert_close(merged, whole[:, :2], rtol=1e-6, atol=0)  # float32 exponentials
    with pytest.raises(ValueError, match=r"^proxy_anchor_loss: shard must be -1 .*, got 0$"):
        op(e.detach(), labels, proxies, 0.1, 32.0, 0)
    with pytest.raises(ValueError, match=r"^proxy_anchor_loss: shard must be -1 .*, got 0$"):
        op(e.detach().to("meta"), labels.to("meta"), proxies.to("meta"), 0.1, 32.0, 0)


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_proxy_anchor_opcheck(dtype, device):
    op, backward = raw("proxy_anchor_loss")
    e, labels, proxies = (
        make((10, 4), dtype).requires_grad_(),
        make_labels(10, 3),
        make((3, 4), dtype, seed=1).requires_grad_(),
    )
    check_opcheck(op, (e, labels, proxies, 0.1, 32.0))
    value, stats = op(e.detach(), labels, proxies.detach(), 0.1, 32.0)
    check_opcheck(
        backward, (torch.ones_like(value), e.detach(), labels, proxies.detach(), stats, 0.1, 32.0, [True, True])
    )
    check_opcheck(
        backward, (torch.ones_like(value), e.detach(), labels, proxies.detach(), stats, 0.1, 32.0, [False, True])
    )


@kernels
def test_proxy_anchor_compile_dynamic(device):
    for N in (20, 33):
        e = make((N, 8), torch.float32).requires_grad_()
        proxies = make((5, 8), torch.float32, seed=1).requires_grad_()
        check_compile(lambda a, lab, p: ops.proxy_anchor_loss(a, lab, p), e, make_labels(N, 5), proxies)


@pytest.mark.parametrize("C", [5, 30, 70])
def test_proxy_anchor_deterministic_on_any_number_of_threads(C):
    e, labels, proxies = (
        make((300, 40), torch.float32, seed=8),
        make_labels(300, C),
        make((C, 40), torch.float32, seed=9),
    )
    assert same_bits(on_threads(lambda: proxy_loss_and_grads(ops.proxy_anchor_loss, e, labels, proxies)))


@kernels
def test_proxy_anchor_inputs_are_never_written(device):
    e, proxies = make((30, 5)).requires_grad_(), make((4, 5), seed=1).requires_grad_()
    before = e.detach().clone(), proxies.detach().clone()
    ops.proxy_anchor_loss(e, make_labels(30, 4), proxies).backward()
    assert torch.equal(e.detach(), before[0]) and torch.equal(proxies.detach(), before[1])


@kernels
def test_proxy_anchor_module(device):
    torch.manual_seed(0)
    m = torchkit.nn.ProxyAnchorLoss(5, 8, margin=0.2, alpha=16.0)
    assert repr(m) == "ProxyAnchorLoss(num_classes=5, embedding_size=8, margin=0.2, alpha=16.0)"
    assert [name for name, _ in m.named_parameters()] == ["proxies"] and m.proxies.shape == (5, 8)
    e, labels = make((12, 8), torch.float32), make_labels(12, 5)
    assert m(e, labels).item() == ops.proxy_anchor_loss(e, labels, m.proxies, 0.2, 16.0).item()
    m(e, labels).backward()
    assert m.proxies.grad is not None and m.proxies.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"ProxyAnchorLoss: alpha must be finite and > 0, got 0"):
        torchkit.nn.ProxyAnchorLoss(5, 8, alpha=0)
    with pytest.raises(ValueError, match=r"ProxyAnchorLoss: num_classes and embedding_size must be >= 1"):
        torchkit.nn.ProxyAnchorLoss(0, 8)


@pytest.mark.triton("pair_losses", dispatch=False)  # (the ops: the CPU kernels)
@TRITON_DEVICE
def test_triton_lse_tiles_inside_the_problem_as_on_its_edges(device):
    """SupCon's and NT-Xent's tiles wholly inside the problem and off the diagonal fold
    without masks, the others with them: in float64 against the CPU kernel, at sizes of
    several blocks of each of the first two configurations (ragged ends), without refs, with
    refs, and a shard whose anchors start inside the refs (the diagonal moved by its offset)."""
    tp = triton_module()
    e, labels = make((150, 19), seed=31), make_labels(150, 9, seed=31)
    ref, ref_labels = make((140, 19), seed=32), make_labels(140, 9, seed=32)
    g = torch.tensor(0.7, dtype=torch.float64)
    for loss, params in (("supcon_loss", (0.3,)), ("ntxent_loss", (0.3,))):
        op, backward = raw(loss)
        name = loss.removesuffix("_loss")
        forward_t, backward_t = getattr(tp, f"{name}_forward"), getattr(tp, f"{name}_backward")
        problems = (
            (e, labels, None, None, None),
            (e, labels, ref, ref_labels, None),
            (e[70:], labels[70:], e, labels, 70),
        )
        for which in (0, 1):
            rows, grad = tp.lse.ROWS_CONFIGS[which], tp.lse.GRAD_CONFIGS[which]
            for x, lab, r, r_lab, shard in problems:
                extra = () if shard is None else (shard,)
                value, stats = op(x, lab, r, r_lab, *params, *extra)
                inputs = on(device, x, lab, r, r_lab)
                got, got_stats = forward_t(*inputs, *params, *extra, config=rows)
                torch.testing.assert_close(got.cpu(), value, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(got_stats.cpu(), stats, rtol=1e-12, atol=1e-12)
                want = [True, r is not None]
                # (a shard's backward takes the whole problem's)
                if shard is not None and ops.pair_losses.SPECS[loss].whole_stats:
                    stats = op(e, labels, None, None, *params)[1]
                exp = backward(g, x, lab, r, r_lab, stats, *params, want, *extra)
                out = backward_t(*on(device, g), *inputs, *on(device, stats), *params, want, *extra, config=grad)
                for a, b in zip(out, exp, strict=True):
                    torch.testing.assert_close(a.cpu(), b, rtol=1e-12, atol=1e-13)


# (dtype, fp32-matmul setting, the tiles' error of a cosine)
MS_SCHEMES = [
    (torch.float32, "highest", 1e-6),
    (torch.float32, "high", 3e-3),
    (torch.float32, "medium", 3e-2),
    (torch.bfloat16, "highest", 1e-6),
    (torch.float16, "highest", 1e-6),
]


def ms_problems(dtype):
    """(name, embeddings, labels, refs, ref labels, params) on which multi-similarity's miner
    meets the tiles' error: random rows (several blocks, ragged); rows of two directions
    jittered by about an ulp of float32 (their choices all within the tiles' error:
    candidates past the lists' size, 16 in the test, anchors taken whole; equal rows in
    bfloat16 and float16) beside random ones (chosen on the tiles), with ε = 0 (each positive
    against a threshold its exact cosine may tie); a collapsed batch (one row repeated, and a
    zero row: equal rows, never listed)."""
    e, labels = make((90, 19), seed=41), make_labels(90, 9, seed=41)
    ref, ref_labels = make((70, 19), seed=42), make_labels(70, 9, seed=42)
    yield "random", e.to(dtype), labels, ref.to(dtype), ref_labels, (2.0, 50.0, 0.5, 0.1)
    directions = make((2, 19), seed=43)
    e, ref = make((48, 19), seed=44), make((44, 19), seed=45)
    e[:40] = directions[torch.arange(40) % 2] + 1e-7 * e[:40]
    ref[:34] = directions[torch.arange(34) % 2] + 1e-7 * ref[:34]
    e_labels, ref_labels = make_labels(48, 4, seed=44), make_labels(44, 4, seed=45)
    yield "ties", e.to(dtype), e_labels, ref.to(dtype), ref_labels, (2.0, 50.0, 0.5, 0.0)
    e = directions[:1].expand(40, 19).clone()
    e[7] = 0
    ref_labels = make_labels(30, 3, seed=47)
    yield "collapsed", e.to(dtype), make_labels(40, 3, seed=46), e[:30].to(dtype), ref_labels, (2.0, 50.0, 0.5, 0.1)


@pytest.mark.triton("pair_losses", dispatch=False)
@TRITON_DEVICE
def test_triton_multi_similarity_chooses_as_float64_on_tensor_core_tiles(monkeypatch, device):
    """Multi-similarity's tiles under every product scheme, its choices on exact cosines where
    they lie within the tiles' error: the thresholds (stats) are the CPU kernel's to the bit,
    the kept pairs of each kind its count (a shard's parts), without refs (the pairs of a row
    and itself left out) and with; the loss within the scheme's error of the cosines (each
    log-sum over α or β moves by at most α or β times it; and the output's rounding); the
    backward's gradients (at the default setting, and of bfloat16 and float16), its choices
    remade on its own tiles, within the scheme's error of the CPU kernel's from the same stats
    (a term moves by a factor up to e^{β·error})."""
    tp = triton_module()
    monkeypatch.setattr(tp.ms, "CAPS", dict.fromkeys(tp.ms.CAPS, 16))  # (smaller problems pass it)
    monkeypatch.setattr(tp.ms, "CAP_ROUNDED", 16)
    for dtype, setting, tol in MS_SCHEMES:
        _check_ms_choices(dtype, setting, tol, device)


def _check_ms_choices(dtype, setting, tol, device):
    tp = triton_module()
    op, backward = raw("multi_similarity_loss")
    rounding = torch.finfo(dtype).eps
    before = torch.get_float32_matmul_precision()
    for name, e, labels, ref, ref_labels, params in ms_problems(dtype):
        for r, r_lab, shard in ((None, None, None), (ref, ref_labels, -1)):
            extra = () if shard is None else (shard,)
            value, stats = op(e, labels, r, r_lab, *params, *extra)  # (IEEE products)
            g, want = torch.ones((), dtype=value.dtype), [True, r is not None]
            inputs = on(device, e, labels, r, r_lab)
            exp, grads = (), ()
            try:
                torch.set_float32_matmul_precision(setting)
                got, got_stats = tp.multi_similarity_forward(*inputs, *params, *extra)
                if setting == "highest":  # (the backward's choices are made as the forward's)
                    args = (*on(device, g), *inputs, *on(device, stats), *params, want, *extra)
                    grads = tp.multi_similarity_backward(*args)
            finally:
                torch.set_float32_matmul_precision(before)
            if grads:
                exp = backward(g, e, labels, r, r_lab, stats, *params, want, *extra)
            # (a term e^{β(s − base)} moves by a factor e^{β·tol}: relative to the largest entry)
            grad_tol = 2 * params[1] * tol + 4 * rounding
            for a, b in zip(grads, exp, strict=True):
                finite = b.double()[b.isfinite()]  # (a zero row's float16 gradient overflows)
                scale = finite.abs().amax().item() if finite.numel() else 0.0
                torch.testing.assert_close(a.cpu().double(), b.double(), rtol=0, atol=grad_tol * scale)
            assert torch.equal(got_stats[:, :2].cpu(), stats[:, :2]), (name, shard, dtype, setting)
            if shard is None:
                atol = 2 * tol + 2 * rounding * value.abs().item()
                torch.testing.assert_close(got.cpu().double(), value.double(), rtol=0, atol=atol)
            else:  # (total, anchors, kept negatives, kept positives)
                assert torch.equal(got[1:].cpu(), value[1:]), (name, dtype, setting)
                torch.testing.assert_close(got[0].cpu(), value[0], rtol=0, atol=(2 * tol + 1e-5) * e.shape[0])


def contrastive_problems(dtype):
    """(name, embeddings, labels, refs, ref labels, margins) on which contrastive_loss's terms
    meet the tiles' error: random rows (several blocks, ragged); rows of two directions
    jittered by about an ulp of float32 (near-duplicates: their expansions cancel, lists past
    the test's 16 slots, anchors taken whole; equal rows in bfloat16 and float16) beside random
    ones, with margins at the float64 distances of a positive and a negative pair (terms that
    tie their margin) and at 0 and 1 (a near-duplicate positive counts, a tie does not); a
    collapsed batch (one row repeated, and a zero row: at distance exactly 1 from the others,
    a tie with neg_margin = 1)."""
    e, labels = make((90, 19), seed=41), make_labels(90, 9, seed=41)
    ref, ref_labels = make((70, 19), seed=42), make_labels(70, 9, seed=42)
    yield "random", e.to(dtype), labels, ref.to(dtype), ref_labels, (0.3, 1.2, "euclidean")
    directions = make((2, 19), seed=43)
    e, ref = make((64, 19), seed=44), make((56, 19), seed=45)
    e[:50] = directions[torch.arange(50) % 2] + 1e-7 * e[:50]
    ref[:40] = directions[torch.arange(40) % 2] + 1e-7 * ref[:40]
    e, ref = e.to(dtype), ref.to(dtype)
    e_labels, ref_labels = make_labels(64, 4, seed=44), make_labels(56, 4, seed=45)
    x = torch.nn.functional.normalize(e.double(), dim=1)
    pos = next(j for j in range(51, 64) if e_labels[j] == e_labels[50])
    neg = next(j for j in range(51, 64) if e_labels[j] != e_labels[50])
    margins = ((x[50] - x[pos]).norm().item(), (x[50] - x[neg]).norm().item(), "euclidean")
    yield "ties", e, e_labels, ref, ref_labels, margins
    yield "near-duplicates", e, e_labels, ref, ref_labels, (0.0, 1.0, "euclidean")
    e = directions[:1].expand(40, 19).clone()
    e[7] = 0
    ref_labels = make_labels(30, 3, seed=47)
    yield "collapsed", e.to(dtype), make_labels(40, 3, seed=46), e[:30].to(dtype), ref_labels, (0.0, 1.0, "euclidean")


@pytest.mark.triton("pair_losses", dispatch=False)
@TRITON_DEVICE
def test_triton_contrastive_counts_as_float64_on_tensor_core_tiles(monkeypatch, device):
    """contrastive_loss's tiles under every product scheme, its terms counted on exact
    distances where they lie within the tiles' error of their margin: the stats (1/terms of
    each kind) are the CPU kernel's to the bit, and a shard's counts, without refs and with;
    the loss within the scheme's error of a distance (each term moves by at most that; and
    the output's rounding), a shard's sums within it per term; the backward's gradients (at
    the default setting, and of bfloat16), its choices remade on its own tiles, within a few
    times it (w = 1/d moves with d) and the output's rounding."""
    tp = triton_module()
    monkeypatch.setattr(tp.ms, "CAPS", dict.fromkeys(tp.ms.CAPS, 16))  # (smaller problems pass it)
    monkeypatch.setattr(tp.ms, "CAP_ROUNDED", 16)
    op, backward = raw("contrastive_loss")
    before = torch.get_float32_matmul_precision()
    # (float16 rows' points are float32, as bfloat16 rows': one of them)
    for dtype, setting, tol in [scheme for scheme in MS_SCHEMES if scheme[0] != torch.float16]:
        rounding = torch.finfo(dtype).eps
        for name, e, labels, ref, ref_labels, margins in contrastive_problems(dtype):
            for r, r_lab, shard in ((None, None, None), (ref, ref_labels, -1)):
                extra = () if shard is None else (shard,)
                value, stats = op(e, labels, r, r_lab, *margins, *extra)  # (IEEE products)
                g, want = torch.ones((), dtype=value.dtype), [True, r is not None]
                inputs = on(device, e, labels, r, r_lab)
                grads = ()
                try:
                    torch.set_float32_matmul_precision(setting)
                    got, got_stats = tp.contrastive_forward(*inputs, *margins, *extra)
                    if shard is None and setting == "highest":  # (its choices are made as the forward's)
                        grads = tp.contrastive_backward(*on(device, g), *inputs, *on(device, stats), *margins, want)
                finally:
                    torch.set_float32_matmul_precision(before)
                where = (name, dtype, setting, shard)
                assert torch.equal(got_stats.cpu(), stats), where
                if shard is None:
                    atol = 2 * tol + 2 * rounding * value.abs().item()
                    torch.testing.assert_close(got.cpu().double(), value.double(), rtol=0, atol=atol)
                    exp = backward(g, e, labels, r, r_lab, stats, *margins, want) if grads else ()
                    for a, b in zip(grads, exp, strict=True):
                        scale = b.double().abs().amax().item() if b.numel() else 0.0
                        atol = (4 * tol + 2 * rounding) * scale
                        torch.testing.assert_close(a.cpu().double(), b.double(), rtol=0, atol=atol)
                else:  # (positive sum, terms, negative sum, terms, pairs of each kind)
                    assert torch.equal(got[1::2].cpu(), value[1::2]), where
                    for k in (0, 2):
                        atol = (tol + 1e-6) * value[k + 1].item()
                        torch.testing.assert_close(got[k].cpu(), value[k], rtol=0, atol=atol)


def batch_hard_problems(dtype):
    """(name, embeddings, labels, refs, ref labels) on which batch_hard's choices meet the
    tiles' error: contrastive_problems' rows (random; near-duplicates, whose lists pass the
    test's 16 slots: anchors taken whole; a collapsed batch with a zero row); and rows whose
    features past the first are permutations of one of three rows, beside anchors along the
    first axis: each such anchor's pairs with a family tie in exact arithmetic, and the float64
    sums in feature order break the ties by an ulp or leave them (to the lower row)."""
    problems = {
        name: (e, labels, ref, ref_labels) for name, e, labels, ref, ref_labels, _ in contrastive_problems(dtype)
    }
    yield "random", *problems["random"]
    yield "near-duplicates", *problems["near-duplicates"]
    yield "collapsed", *problems["collapsed"]
    base = make((3, 19), seed=48)
    perms = torch.stack([torch.randperm(18, generator=torch.Generator().manual_seed(k)) + 1 for k in range(60)])
    x = base[torch.arange(60) % 3]
    x[:, 1:] = torch.gather(x[:, 1:], 1, perms - 1)
    axis = torch.zeros(6, 19)
    axis[:, 0] = torch.tensor([1.0, 2.0, 3.0, 0.5, 7.0, 1e-3])
    e, labels = torch.cat([axis, x[:30]]), torch.cat([torch.arange(6) % 2, make_labels(30, 2, seed=49)])
    yield "permutations", e.to(dtype), labels, x[30:].to(dtype), make_labels(30, 2, seed=50)


@pytest.mark.triton("pair_losses", dispatch=False)
@TRITON_DEVICE
def test_triton_batch_hard_chooses_as_float64_on_tensor_core_tiles(monkeypatch, device):
    """batch_hard's tiles under every product scheme, its choices on exact distances wherever
    the tiles' bounds leave more than one pair: the stats (each anchor's farthest positive and
    nearest negative) are the CPU kernel's to the bit, without refs and with, and so is the
    loss (from the chosen pairs' exact distances), a shard's parts included."""
    tp = triton_module()
    monkeypatch.setattr(tp.ms, "CAPS", dict.fromkeys(tp.ms.CAPS, 16))  # (smaller problems pass it)
    monkeypatch.setattr(tp.ms, "CAP_ROUNDED", 16)
    op, _ = raw("triplet_margin_loss")
    before = torch.get_float32_matmul_precision()
    for dtype, setting, _ in [scheme for scheme in MS_SCHEMES if scheme[0] != torch.float16]:
        for name, e, labels, ref, ref_labels in batch_hard_problems(dtype):
            for r, r_lab, shard in ((None, None, None), (ref, ref_labels, -1)):
                extra = () if shard is None else (shard,)
                value, stats = op(e, labels, r, r_lab, 0.05, "batch_hard", "euclidean", *extra)
                try:
                    torch.set_float32_matmul_precision(setting)
                    got, got_stats = tp.triplet_margin_forward(
                        *on(device, e, labels, r, r_lab), 0.05, "batch_hard", "euclidean", *extra
                    )
                finally:
                    torch.set_float32_matmul_precision(before)
                where = (name, dtype, setting, shard)
                assert torch.equal(got_stats.cpu(), stats), where
                torch.testing.assert_close(got.cpu(), value, rtol=1e-12, atol=0, equal_nan=True, msg=str(where))


@pytest.mark.triton("pair_losses", dispatch=False)  # (the ops: the CPU kernels)
@TRITON_DEVICE
@pytest.mark.parametrize("which", [0, 1, 2])
def test_proxy_anchor_triton_every_configuration_matches_the_cpu_kernel(which, device):
    """test_triton_every_configuration_matches_the_cpu_kernel's, for proxy_anchor_loss: ragged
    sizes, a proxy without positives, a zero embedding."""
    tp = triton_module()
    pick = lambda configs: configs[min(which, len(configs) - 1)]  # noqa: E731
    rows, grad, row = pick(tp.lse.ROWS_CONFIGS), pick(tp.lse.GRAD_CONFIGS), pick(tp.lse.ROW_CONFIGS)
    e, labels, proxies = make((45, 19), seed=41), make_labels(45, 30), make((37, 19), seed=42)
    e[3] = 0
    for margin, alpha in ((0.1, 32.0), (0.0, 4.0)):
        value, stats = torch.ops.torchkit.proxy_anchor_loss(e, labels, proxies, margin, alpha)
        inputs = on(device, e, labels, proxies)
        got, got_stats = tp.proxy_anchor_forward(*inputs, margin, alpha, config=rows, row_config=row)
        torch.testing.assert_close(got.cpu(), value, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_stats.cpu(), stats, rtol=1e-12, atol=1e-12)
        g = torch.tensor(0.7, dtype=e.dtype)
        exp = torch.ops.torchkit._proxy_anchor_loss_backward(g, e, labels, proxies, stats, margin, alpha, [True, True])
        out = tp.proxy_anchor_backward(
            *on(device, g), *inputs, got_stats, margin, alpha, [True, True], config=grad, row_config=row
        )
        for a, b in zip(out, exp, strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-12, atol=1e-13)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_proxy_anchor_memory_is_linear():
    """N = 8192, D = 128, 100 proxies, forward and backward: under 16 MiB more (the N×C matrix
    would be 3 MiB here, but it is never formed: at C = 11,000 it would be 350 MiB)."""
    growth = peak_growth_mib("proxy_anchor_loss(P)", 8192, 128, 100)
    assert growth < 16, f"peak grew by {growth:.1f} MiB"


@pytest.mark.triton("pair_losses", dispatch=False)  # (the ops: the CPU kernels)
@TRITON_DEVICE
def test_triton_parameters_of_any_sign_and_size_as_the_cpu_kernel(device):
    """NEGATIVE (and proxy-anchor's margin −0.1) through the Triton kernels, in float64, with
    refs: the CPU kernel's loss, stats and gradients; and proxy-anchor's α past float32's
    range, whose products overflow: ∞, as the CPU kernel and PML (α·s + α·margin gave ∞ − ∞)."""
    tp = triton_module()
    e, labels = make((24, 6), seed=8), make_labels(24, 3, seed=8)
    ref, ref_labels = make((20, 6), seed=9), make_labels(20, 3, seed=9)
    cases = [(loss, tuple(params.values())) for loss, params in NEGATIVE]
    for loss, params in cases:
        op, backward = raw(loss)
        name = loss.removesuffix("_loss")
        forward_t, backward_t = getattr(tp, f"{name}_forward"), getattr(tp, f"{name}_backward")
        value, stats = op(e, labels, ref, ref_labels, *params)
        got, got_stats = forward_t(*on(device, e, labels, ref, ref_labels), *params)
        torch.testing.assert_close(got.cpu(), value, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_stats.cpu(), stats, rtol=1e-12, atol=1e-12)
        g = torch.ones((), dtype=torch.float64)
        exp = backward(g, e, labels, ref, ref_labels, stats, *params, [True, True])
        out = backward_t(*on(device, g, e, labels, ref, ref_labels, stats), *params, [True, True])
        for x, y in zip(out, exp, strict=True):
            torch.testing.assert_close(x.cpu(), y, rtol=1e-12, atol=1e-13)
    proxies = make((3, 6), seed=10)
    value, stats = torch.ops.torchkit.proxy_anchor_loss(e, labels, proxies, -0.1, 32.0)
    got, got_stats = tp.proxy_anchor_forward(*on(device, e, labels, proxies), -0.1, 32.0)
    torch.testing.assert_close(got.cpu(), value, rtol=1e-12, atol=1e-12)
    x, p = e.float(), proxies.float()
    for margin, alpha in ((0.1, 1e300), (1e39, 1.0)):
        value, _ = torch.ops.torchkit.proxy_anchor_loss(x, labels, p, margin, alpha)
        got, _ = tp.proxy_anchor_forward(*on(device, x, labels, p), margin, alpha)
        assert value.isinf() and got.cpu().isinf() and got > 0, (margin, alpha)


# The CUDA precision contract of the log-sum-exp engine (supcon_loss, ntxent_loss and
# proxy_anchor_loss's Triton kernels: docs/ops.md), float32 inputs by PyTorch's fp32-matmul
# setting: (loss, gradients) relative to float64 on the same values, at most; and at least,
# for the reduced schemes, so that a scheme not applied fails too.
FLOAT32_PRODUCTS = {
    "highest": ((1e-6, 1e-5), (0.0, 0.0)),
    "high": ((1e-4, 5e-3), (1e-7, 1e-5)),
    "medium": ((2e-2, 1e-1), (1e-5, 1e-3)),
}


def lse_engine_errors(tp, x, labels, proxies, temperature=0.1, reference=torch.float64):
    """Each LSE-engine loss's (loss error, gradient error) through the Triton kernels at x's
    dtype against the CPU kernel in the reference dtype on the same values (the gradients'
    relative to their largest entry)."""
    out = []
    for loss in ("supcon", "ntxent", "proxy"):
        runs = []
        for kernels, v, p, lab in (
            ("triton", x, proxies, labels),
            ("cpu", *(t.cpu().to(reference) for t in (x, proxies)), labels.cpu()),
        ):
            if loss == "proxy":
                op, backward = (
                    raw("proxy_anchor_loss")
                    if kernels == "cpu"
                    else (tp.proxy_anchor_forward, tp.proxy_anchor_backward)
                )
                value, stats = op(v, lab, p, 0.1, 32.0)
                grads = backward(torch.ones((), dtype=value.dtype), v, lab, p, stats, 0.1, 32.0, [True, True])
            else:
                op, backward = (
                    raw(f"{loss}_loss")
                    if kernels == "cpu"
                    else (getattr(tp, f"{loss}_forward"), getattr(tp, f"{loss}_backward"))
                )
                value, stats = op(v, lab, None, None, temperature)
                args = (torch.ones((), dtype=value.dtype), v, lab, None, None, stats, temperature, [True, False])
                grads = backward(*args)[:1]
            runs.append((value.cpu(), [g.cpu() for g in grads]))
        (value, grads), (value64, grads64) = runs
        grad_err = max(
            ((g.double() - h).abs().max() / h.abs().max()).item() for g, h in zip(grads, grads64, strict=True)
        )
        out.append((loss, abs(value.double() - value64).item() / abs(value64).item(), grad_err))
    return out


@pytest.mark.triton("pair_losses", dispatch=False)
@TRITON_DEVICE
@pytest.mark.parametrize("setting", list(FLOAT32_PRODUCTS))
def test_triton_float32_products_follow_the_fp32_matmul_setting(setting, device):
    """float32 rows' products on tensor cores as PyTorch's setting selects them (the operands
    are rounded to TF32 or bfloat16 before the products, so that the interpreter's products
    are the tensor cores'): within the scheme's error of the CPU kernel's float64 (D of 8 and
    384, held whole and a slice at a time), and the reduced schemes measurably reduced."""
    tp = triton_module()
    (loss_tol, grad_tol), (loss_floor, grad_floor) = FLOAT32_PRODUCTS[setting]
    before = torch.get_float32_matmul_precision()
    worst = [0.0, 0.0]
    try:
        torch.set_float32_matmul_precision(setting)
        for D in (8, 384):
            x = make((40, D), torch.float32, seed=D)
            labels = make_labels(40, 5, seed=D)
            proxies = make((5, D), torch.float32, seed=D + 1)
            for loss, loss_err, grad_err in lse_engine_errors(tp, *on(device, x, labels, proxies)):
                assert loss_err <= loss_tol and grad_err <= grad_tol, (loss, D, loss_err, grad_err)
                worst = [max(worst[0], loss_err), max(worst[1], grad_err)]
    finally:
        torch.set_float32_matmul_precision(before)
    assert worst[0] >= loss_floor and worst[1] >= grad_floor, worst


@pytest.mark.triton("pair_losses", dispatch=False)
@TRITON_DEVICE
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_inputs_on_tensor_cores_as_given(dtype, device):
    """bfloat16 and float16 rows multiplied as given (exact products), the backward's
    ∂loss/∂s as a pair hi + lo of their type: within a few of their own ulp of float64 on the
    same values; and of float32 (the same accumulation type: NT-Xent's tiny is its) at a
    temperature whose ∂loss/∂s passes float16's range (scaled by a power of two first)."""
    tp = triton_module()
    eps = torch.finfo(dtype).eps
    x = make((40, 24), dtype, seed=3)
    labels = make_labels(40, 5, seed=3)
    proxies = make((5, 24), dtype, seed=4)
    for temperature, against in ((0.1, torch.float64), (1e-4, torch.float32)):
        errors = lse_engine_errors(tp, *on(device, x, labels, proxies), temperature, against)
        for loss, loss_err, grad_err in errors:
            assert loss_err <= 2 * eps and grad_err <= 4 * eps, (loss, temperature, loss_err, grad_err)


@pytest.mark.triton("pair_losses", dispatch=False)
@TRITON_DEVICE
def test_triton_float16_zero_row_spoils_no_other_gradient(device):
    """A row of zeros among float16 rows: its normalisation factor (1e12 where F.normalize's
    clamp holds) never meets ∂loss/∂s in float16, where it overflowed and met the row's zero
    operand as NaN in every row paired with it. The other rows' gradients are the CPU kernel's
    within float16's rounding (the zero row's own overflows float16 on both)."""
    tp = triton_module()
    x = make((12, 8), torch.float16, seed=5)
    x[3] = 0
    labels = torch.arange(12) % 3
    for loss in ("supcon_loss", "ntxent_loss", "multi_similarity_loss"):
        op, backward = raw(loss)
        name = loss.removesuffix("_loss")
        params = (0.1,) if loss != "multi_similarity_loss" else (2.0, 50.0, 0.5, 0.1)
        value, stats = op(x, labels, None, None, *params)
        g = torch.ones((), dtype=value.dtype)
        (exp,) = backward(g, x, labels, None, None, stats, *params, [True, False])[:1]
        forward_t, backward_t = getattr(tp, f"{name}_forward"), getattr(tp, f"{name}_backward")
        _, got_stats = forward_t(*on(device, x, labels), None, None, *params)
        (got,) = backward_t(*on(device, g, x, labels), None, None, got_stats, *params, [True, False])[:1]
        others = torch.arange(12) != 3
        assert not got.cpu()[others].isnan().any(), loss
        scale = exp[others].double().abs().amax().item()
        torch.testing.assert_close(got.cpu()[others].double(), exp[others].double(), rtol=0, atol=4e-3 * scale)
