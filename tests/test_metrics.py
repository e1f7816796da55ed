"""torchkit.metrics against a direct computation and pytorch-metric-learning."""

import pytest
import torch

from torchkit import metrics, reference


def clustered(n_classes=10, per_class=12, dim=16, spread=0.8, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(n_classes, dim, generator=g)
    labels = torch.arange(n_classes).repeat_interleave(per_class)
    return centres[labels] + spread * torch.randn(len(labels), dim, generator=g), labels


def recall_direct(x, y, ks, gallery=None, gallery_labels=None):
    _, idx = reference.knn(x.double(), None if gallery is None else gallery.double(), max(ks))
    hits = (y if gallery_labels is None else gallery_labels)[idx] == y[:, None]
    return {k: hits[:, :k].any(1).float().mean().item() for k in ks}


def map_at_r_direct(x, y, gallery=None, gallery_labels=None):
    """Musgrave et al.'s definition, one query at a time."""
    ref_labels = y if gallery_labels is None else gallery_labels
    total, count = 0.0, 0
    for q in range(len(y)):
        relevant = int((ref_labels == y[q]).sum()) - (1 if gallery is None else 0)
        if relevant == 0:
            continue
        _, idx = reference.knn(
            x[q : q + 1].double(), (x if gallery is None else gallery).double(), relevant + (gallery is None)
        )
        idx = [j for j in idx[0].tolist() if gallery is not None or j != q][:relevant]
        hits, ap = 0, 0.0
        for rank, j in enumerate(idx, 1):
            if ref_labels[j] == y[q]:
                hits += 1
                ap += hits / rank
        total += ap / relevant
        count += 1
    return total / count


def test_recall_at_k_leave_one_out_and_gallery():
    x, y = clustered()
    assert metrics.recall_at_k(x, y) == pytest.approx(recall_direct(x, y, (1, 2, 4, 8)))
    gx, gy = clustered(seed=1)
    ours = metrics.recall_at_k(x, y, (1, 5), gallery=gx, gallery_labels=gy)
    assert ours == pytest.approx(recall_direct(x, y, (1, 5), gx, gy))
    assert set(ours) == {1, 5}


def test_map_at_r_leave_one_out_and_gallery():
    x, y = clustered(spread=1.2)
    y[:3] = torch.tensor([100, 101, 102])  # unique labels: no relevant item, left out
    assert metrics.map_at_r(x, y) == pytest.approx(map_at_r_direct(x, y))
    gx, gy = clustered(seed=1, spread=1.2)
    assert metrics.map_at_r(x, y, gallery=gx, gallery_labels=gy) == pytest.approx(map_at_r_direct(x, y, gx, gy))


def test_perfect_and_extreme_embeddings():
    y = torch.arange(5).repeat_interleave(4)
    x = torch.nn.functional.one_hot(y).float()
    assert metrics.map_at_r(x, y) == 1.0 and metrics.recall_at_k(x, y, (1,)) == {1: 1.0}
    far = 1e4 + 1e-2 * x  # far from the origin: the exact distances still separate classes
    assert metrics.map_at_r(far, y) == 1.0


def test_agrees_with_pytorch_metric_learning():
    calculators = pytest.importorskip("pytorch_metric_learning.utils.accuracy_calculator")
    x, y = clustered(n_classes=20, per_class=15, spread=1.0)
    calc = calculators.AccuracyCalculator(include=("precision_at_1", "mean_average_precision_at_r"), k="max_bin_count")
    theirs = calc.get_accuracy(x, y, x, y, ref_includes_query=True)
    assert metrics.recall_at_k(x, y, (1,))[1] == pytest.approx(theirs["precision_at_1"], abs=1e-6)
    assert metrics.map_at_r(x, y) == pytest.approx(theirs["mean_average_precision_at_r"], abs=1e-6)
    gx, gy = clustered(n_classes=20, per_class=15, spread=1.0, seed=1)
    theirs = calc.get_accuracy(x, y, gx, gy, ref_includes_query=False)
    assert metrics.recall_at_k(x, y, (1,), gallery=gx, gallery_labels=gy)[1] == pytest.approx(
        theirs["precision_at_1"], abs=1e-6
    )
    assert metrics.map_at_r(x, y, gallery=gx, gallery_labels=gy) == pytest.approx(
        theirs["mean_average_precision_at_r"], abs=1e-6
    )


X, Y = torch.zeros(4, 2), torch.arange(4) % 2
BAD = [
    (lambda: metrics.recall_at_k(torch.zeros(4), Y), ValueError, r"recall_at_k: embeddings must be \(N, M\)"),
    (lambda: metrics.recall_at_k(X.long(), Y), TypeError, r"embeddings must be float32, float64, float16 or bfloat16"),
    (
        lambda: metrics.recall_at_k(X, torch.zeros(3)),
        TypeError,
        r"labels must have an integer dtype, got torch.float32",
    ),
    (lambda: metrics.recall_at_k(X, Y[:3]), ValueError, r"labels must be \(N,\) = \(4,\), one per row of embeddings"),
    (lambda: metrics.recall_at_k(X, [0, 1, 0, 1]), TypeError, r"labels must be a Tensor, got list"),
    (lambda: metrics.recall_at_k(X, Y.bool()), TypeError, r"labels must have an integer dtype, got torch.bool"),
    (lambda: metrics.map_at_r(X, Y.to(torch.complex64)), TypeError, r"map_at_r: labels must have an integer dtype"),
    (lambda: metrics.recall_at_k(X.to("meta"), Y), ValueError, r"embeddings and labels must be on the same device"),
    (
        lambda: metrics.map_at_r(X, Y, gallery=X, gallery_labels=Y.to("meta")),
        ValueError,
        r"gallery and gallery_labels must be on the same device",
    ),
    (lambda: metrics.recall_at_k(X, Y, gallery=torch.zeros(3, 2)), ValueError, "go together"),
    (
        lambda: metrics.recall_at_k(X, Y, gallery=torch.zeros(3, 5), gallery_labels=Y[:3]),
        ValueError,
        r"gallery must be \(R, M\) with M = 2",
    ),
    (
        lambda: metrics.recall_at_k(X, Y, (1, 4)),
        ValueError,
        r"every K in ks must be in \[1, R\], R = 3 \(the other rows of embeddings: leave-one-out\), got 4",
    ),
    (lambda: metrics.recall_at_k(X, Y, (0, 2)), ValueError, r"every K in ks must be in \[1, R\], R = 3 .*got 0"),
    (lambda: metrics.recall_at_k(X, Y, (-1,)), ValueError, r"got -1"),
    (lambda: metrics.recall_at_k(X, Y, (1.7,)), TypeError, r"every K in ks must be an int, got float 1.7"),
    (lambda: metrics.recall_at_k(X, Y, (True, 2)), TypeError, r"every K in ks must be an int, got bool True"),
    (
        lambda: metrics.recall_at_k(X, Y, 4),
        TypeError,
        r"ks must be an iterable of ints such as \(1, 2, 4, 8\), got int 4",
    ),
    (lambda: metrics.recall_at_k(X, Y, ()), ValueError, "at least one K"),
    (
        lambda: metrics.recall_at_k(X, Y, (1,), gallery=X[:0], gallery_labels=Y[:0]),
        ValueError,
        r"R = 0 \(the gallery's rows\), got 1",
    ),
    (lambda: metrics.recall_at_k(X[:0], Y[:0], (1,), gallery=X, gallery_labels=Y), ValueError, "holds no query"),
    (lambda: metrics.map_at_r(X, torch.arange(4)), ValueError, "no query has a relevant item"),
    (lambda: metrics.map_at_r(X, Y, gallery=X[:0], gallery_labels=Y[:0]), ValueError, "no query has a relevant item"),
]


@pytest.mark.bad_input
@pytest.mark.parametrize("call,kind,match", BAD)
def test_bad_input(call, kind, match):
    with pytest.raises(kind, match=match):
        call()


def test_integral_ks_and_labels_of_any_integer_dtype():
    """numpy and 0-d tensor integers are ints (as PyTorch's own ops take them); labels of any
    integer dtype, the gallery's differing from the queries'."""
    np = pytest.importorskip("numpy")
    x, y = clustered()
    expected = metrics.recall_at_k(x, y, (1, 4))
    assert metrics.recall_at_k(x, y, (np.int64(1), torch.tensor(4))) == expected
    assert metrics.recall_at_k(x, y.to(torch.int16), [4, 1, 4]) == expected
    assert metrics.map_at_r(x, y.to(torch.uint8)) == metrics.map_at_r(x, y)
    gx, gy = clustered(seed=1)
    assert metrics.map_at_r(x, y.int(), gallery=gx, gallery_labels=gy.to(torch.int8)) == metrics.map_at_r(
        x, y, gallery=gx, gallery_labels=gy
    )


def test_recall_is_the_exact_fraction():
    """The count of hits over the number of queries, in float64 (not a float32 mean)."""
    x, y = clustered(n_classes=7, per_class=3, spread=2.0, seed=3)
    hits = recall_direct(x, y, (1,))[1] * len(y)
    assert metrics.recall_at_k(x, y, (1,))[1] == round(hits) / len(y)
