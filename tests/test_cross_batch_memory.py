"""torchkit.nn.CrossBatchMemory against pytorch-metric-learning's CrossBatchMemory, step by step
over consecutive batches (the memory filling, wrapping and full), on the CPU kernels and the
Triton kernels; its checks; and the raw backward ops' own_stats that it runs on."""

import itertools

import pytest
import torch
from pytorch_metric_learning import losses, miners
from pytorch_metric_learning.distances import CosineSimilarity
from test_pair_losses import kernels, make, make_labels, raw
from testing import check_opcheck

import torchkit
from torchkit import nn as tnn

LOSSES = {
    "supcon": (lambda: tnn.SupConLoss(0.1), lambda: losses.SupConLoss(0.1), None),
    "ntxent": (lambda: tnn.NTXentLoss(0.07), lambda: losses.NTXentLoss(0.07), None),
    "contrastive": (lambda: tnn.ContrastiveLoss(0.1, 0.8), lambda: losses.ContrastiveLoss(0.1, 0.8), None),
    "triplet": (lambda: tnn.TripletMarginLoss(0.2), lambda: losses.TripletMarginLoss(0.2), None),
    "contrastive-cosine": (
        lambda: tnn.ContrastiveLoss(0.9, 0.1, distance="cosine"),
        lambda: losses.ContrastiveLoss(0.9, 0.1, distance=CosineSimilarity()),
        None,
    ),
    "triplet-batch_hard-cosine": (
        lambda: tnn.TripletMarginLoss(0.2, "batch_hard", distance="cosine"),
        lambda: losses.TripletMarginLoss(0.2, distance=CosineSimilarity()),
        lambda: miners.BatchHardMiner(distance=CosineSimilarity()),
    ),
    "triplet-batch_hard": (
        lambda: tnn.TripletMarginLoss(0.2, "batch_hard"),
        lambda: losses.TripletMarginLoss(0.2),
        miners.BatchHardMiner,
    ),
    "multi_similarity": (lambda: tnn.MultiSimilarityLoss(), lambda: losses.MultiSimilarityLoss(), None),
    "multi_similarity-mined": (
        lambda: tnn.MultiSimilarityLoss(miner_epsilon=0.1),
        lambda: losses.MultiSimilarityLoss(),
        lambda: miners.MultiSimilarityMiner(0.1),
    ),
}
# Five steps; 2 rows of each label in every batch (each anchor has a positive besides its own
# copy: where it has none, PML's miners see that copy, see docs/ops.md).
BATCHES = (6, 8, 4, 10, 6)
# Memories that fill and wrap mid-batch; that the largest batch fills whole (a batch past its
# end wrapping onto its start); that never fills.
MEMORIES = (13, 10, 64)
# How close to PML in float64, and to PML in float64 on the same rounded inputs otherwise
# (float32's and the half types' own rounding of the loss and of its terms).
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def batches(dtype, D=5, seed=0):
    for step, n in enumerate(BATCHES):
        labels = make_labels(n // 2, 4, seed=seed + step).repeat(2)
        yield make((n, D), dtype, seed=seed + step), labels


def step_pairs(name, memory, D=5):
    ours, theirs, miner = LOSSES[name]
    return (
        tnn.CrossBatchMemory(ours(), D, memory_size=memory),
        losses.CrossBatchMemory(theirs(), D, memory_size=memory, miner=miner() if miner else None),
    )


def close(got, want, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("memory", MEMORIES)
@pytest.mark.parametrize("name", list(LOSSES))
def test_matches_pytorch_metric_learning_step_by_step(name, memory):
    """Loss and gradient of every step equal PML's in float64 (its own dtype's arithmetic),
    and within float32's and the half types' rounding of PML's float64 on the same inputs."""
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        ours, theirs = step_pairs(name, memory)
        for e, labels in batches(dtype):
            x, y = e.clone().requires_grad_(), e.double().requires_grad_()
            loss, want = ours(x, labels), theirs(y, labels)
            loss.backward()
            want.backward()
            assert loss.dtype == dtype
            close(loss.detach(), want.detach(), dtype)
            close(x.grad, y.grad, dtype)
        assert ours.queue_idx == theirs.queue_idx and ours.has_been_filled == theirs.has_been_filled
        torch.testing.assert_close(ours.embedding_memory.double(), theirs.embedding_memory, rtol=0, atol=0)


@kernels
@pytest.mark.parametrize("name", ["supcon", "ntxent", "contrastive", "triplet", "multi_similarity-mined"])
def test_each_kernel_matches_pytorch_metric_learning(name, device):
    """The same steps through the CPU kernels and the Triton kernels (the memory wrapping)."""
    ours, theirs = step_pairs(name, 13)
    for e, labels in batches(torch.float64, seed=7):
        x, y = e.clone().requires_grad_(), e.clone().requires_grad_()
        loss, want = ours(x.to(device), labels.to(device)), theirs(y, labels)
        loss.backward()
        want.backward()
        close(loss.detach().cpu(), want.detach(), torch.float64)
        close(x.grad, y.grad, torch.float64)


@pytest.mark.parametrize("name", ["supcon", "contrastive", "triplet", "multi_similarity"])
def test_enqueue_mask_matches_pytorch_metric_learning(name):
    """The rows enqueue_mask marks only join the memory; the others are anchors against all of
    it, none of their pairs left out, and are not enqueued."""
    ours, theirs = step_pairs(name, 11)
    for step, (e, labels) in enumerate(batches(torch.float64, seed=3)):
        mask = torch.arange(e.shape[0]) % 2 == step % 2
        x, y = e.clone().requires_grad_(), e.clone().requires_grad_()
        loss, want = ours(x, labels, enqueue_mask=mask), theirs(y, labels, enqueue_mask=mask)
        loss.backward()
        want.backward()
        close(loss.detach(), want.detach(), torch.float64)
        close(x.grad, y.grad, torch.float64)
        assert not x.grad[mask].any()  # (the enqueued rows take no part in the loss)


def test_the_memory_is_detached_and_follows_the_batch():
    """No gradient reaches a memory row; the memory takes the batch's dtype; reset_queue
    empties it; the state is PML's."""
    ours = tnn.CrossBatchMemory(tnn.ContrastiveLoss(), 4, memory_size=8)
    e = make((4, 4)).requires_grad_()
    ours(e, torch.tensor([0, 0, 1, 1])).backward()
    assert not ours.embedding_memory.requires_grad and ours.embedding_memory.dtype == torch.float64
    assert torch.equal(ours.embedding_memory[:4], e.detach()) and ours.queue_idx == 4
    ours(make((4, 4), torch.float32, seed=1), torch.tensor([0, 1, 0, 1]))
    assert ours.embedding_memory.dtype == torch.float32 and ours.has_been_filled and ours.queue_idx == 0
    ours.reset_queue()
    assert not ours.has_been_filled and ours.queue_idx == 0 and not ours.embedding_memory.any()
    assert "memory_size=8" in repr(ours) and "ContrastiveLoss" in repr(ours)


def test_under_torch_compile():
    """A compiled training step with the memory in it takes the eager steps' losses and
    gradients, the memory's state included."""
    compiled, eager = (tnn.CrossBatchMemory(tnn.SupConLoss(0.1), 5, memory_size=13) for _ in range(2))
    layer = torch.nn.Linear(5, 5).double()
    step = torch.compile(lambda memory, x, labels: memory(layer(x), labels))
    for e, labels in itertools.islice(batches(torch.float64, seed=11), 3):
        got, want = step(compiled, e, labels), eager(layer(e), labels)
        grads = [torch.autograd.grad(loss, layer.weight)[0] for loss in (got, want)]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14)
    assert compiled.queue_idx == eager.queue_idx and torch.equal(compiled.embedding_memory, eager.embedding_memory)


# A PML miner in both wrappers (torchkit's losses then take its tuples: indices_tuple=).
MINED = {
    "contrastive-PairMarginMiner": (
        lambda: tnn.ContrastiveLoss(0.1, 0.8),
        lambda: losses.ContrastiveLoss(0.1, 0.8),
        lambda: miners.PairMarginMiner(0.3, 0.7),
    ),
    "triplet-TripletMarginMiner": (
        lambda: tnn.TripletMarginLoss(0.2),
        lambda: losses.TripletMarginLoss(0.2),
        lambda: miners.TripletMarginMiner(0.2, type_of_triplets="hard"),
    ),
    "triplet-cosine-BatchHardMiner": (
        lambda: tnn.TripletMarginLoss(0.2, distance="cosine"),
        lambda: losses.TripletMarginLoss(0.2, distance=CosineSimilarity()),
        lambda: miners.BatchHardMiner(distance=CosineSimilarity()),
    ),
    "supcon-MultiSimilarityMiner": (
        lambda: tnn.SupConLoss(0.1),
        lambda: losses.SupConLoss(0.1),
        lambda: miners.MultiSimilarityMiner(0.1),
    ),
    "ntxent-BatchEasyHardMiner": (
        lambda: tnn.NTXentLoss(0.1),
        lambda: losses.NTXentLoss(0.1),
        lambda: miners.BatchEasyHardMiner(),
    ),
    "multi_similarity-PairMarginMiner": (
        lambda: tnn.MultiSimilarityLoss(),
        lambda: losses.MultiSimilarityLoss(),
        lambda: miners.PairMarginMiner(0.3, 0.7),
    ),
}


@pytest.mark.parametrize("memory", MEMORIES)
@pytest.mark.parametrize("name", list(MINED))
def test_miners_match_pytorch_metric_learning_step_by_step(name, memory):
    """miner= in both wrappers: the miner's batch × memory tuples less each anchor's own copy,
    step by step, in float64 and float32 (PML in its dtype)."""
    ours, theirs, miner = MINED[name]
    for dtype in (torch.float64, torch.float32):
        a = tnn.CrossBatchMemory(ours(), 5, memory_size=memory, miner=miner())
        b = losses.CrossBatchMemory(theirs(), 5, memory_size=memory, miner=miner())
        for e, labels in batches(dtype):
            x, y = e.clone().requires_grad_(), e.clone().requires_grad_()
            loss, want = a(x, labels), b(y, labels)
            loss.backward()
            want.backward()
            tol = 1e-12 if dtype == torch.float64 else 2e-5
            torch.testing.assert_close(loss, want, rtol=tol, atol=tol)
            torch.testing.assert_close(x.grad, y.grad, rtol=tol, atol=tol)


def test_given_indices_tuple_joins_the_memory_pairs_as_pmls():
    """forward's indices_tuple is appended to the memory's pairs (its positives and negatives
    taken as memory rows, as PML's wrapper does), converted to their form."""
    for tuple_of in (
        lambda n: (torch.arange(n - 1), torch.arange(1, n), torch.arange(n - 1).flip(0)),  # triplets
        lambda n: (torch.arange(n), torch.arange(n).flip(0), torch.tensor([0]), torch.tensor([1])),  # pairs
    ):
        for ours, theirs in (
            (tnn.ContrastiveLoss(0.1, 0.8), losses.ContrastiveLoss(0.1, 0.8)),
            (tnn.TripletMarginLoss(0.2), losses.TripletMarginLoss(0.2)),
        ):
            a, b = tnn.CrossBatchMemory(ours, 5, memory_size=13), losses.CrossBatchMemory(theirs, 5, memory_size=13)
            for e, labels in batches(torch.float64):
                t = tuple_of(len(e))
                torch.testing.assert_close(a(e, labels, t), b(e, labels, t), rtol=1e-12, atol=1e-12)


def test_refuses_what_it_cannot_take():
    loss = tnn.SupConLoss()
    with pytest.raises(TypeError, match=r"loss must be one of torchkit\.nn's SupConLoss"):
        tnn.CrossBatchMemory(tnn.ProxyAnchorLoss(4, 8), 8)
    with pytest.raises(TypeError, match="loss must be one of"):
        tnn.CrossBatchMemory(losses.SupConLoss(), 8)
    with pytest.raises(ValueError, match="memory_size must be > 0, got 0"):
        tnn.CrossBatchMemory(loss, 8, memory_size=0)
    with pytest.raises(ValueError, match="embedding_size must be > 0, got -1"):
        tnn.CrossBatchMemory(loss, -1)
    memory = tnn.CrossBatchMemory(loss, 4, memory_size=4)
    e, labels = make((5, 4)), make_labels(5, 2)
    with pytest.raises(ValueError, match="enqueues at most memory_size = 4 rows, got 5"):
        memory(e, labels)
    with pytest.raises(ValueError, match="embedding_size = 4 features, got shape \\[3, 3\\]"):
        memory(make((3, 3)), make_labels(3, 2))
    with pytest.raises(ValueError, match="labels must be 1-D with one label per row"):
        memory(e[:3], labels)
    with pytest.raises(TypeError, match="enqueue_mask must be a bool Tensor, got"):
        memory(e[:3], labels[:3], enqueue_mask=torch.ones(3))
    with pytest.raises(ValueError, match="enqueue_mask must be 1-D with one entry per row of embeddings \\(3\\)"):
        memory(e[:3], labels[:3], enqueue_mask=torch.ones(4, dtype=torch.bool))
    with pytest.raises(IndexError, match=r"^CrossBatchMemory: indices_tuple\[1\] must index .* \[0, 3\), got 3"):
        memory(e[:3], labels[:3], (torch.arange(2), torch.arange(2, 4), torch.arange(2)))
    with pytest.raises(ValueError, match="indices_tuple and enqueue_mask are mutually exclusive"):
        memory(e[:3], labels[:3], (torch.arange(2),) * 3, enqueue_mask=torch.ones(3, dtype=torch.bool))
    assert memory.queue_idx == 0  # (nothing refused was enqueued)
    with pytest.raises(TypeError, match=r"miner must be a pytorch-metric-learning miner .* got str"):
        tnn.CrossBatchMemory(loss, 4, miner="hard")
    with pytest.raises(ValueError, match="group= is not supported"):
        tnn.CrossBatchMemory(tnn.NTXentLoss(group=object()), 4)


@pytest.mark.parametrize("loss", ["supcon_loss", "ntxent_loss", "contrastive_loss", "multi_similarity_loss"])
def test_own_stats_backward(loss):
    """The raw backward ops' own_stats: a shard's own stats, its anchors' pairs alone (opcheck,
    float32 and float64 grads); refused without a shard of the refs' rows, as the fake kernel
    refuses it."""
    params = {
        "supcon_loss": (0.1,),
        "ntxent_loss": (0.07,),
        "contrastive_loss": (0.0, 1.0, "euclidean"),
        "multi_similarity_loss": (2.0, 50.0, 0.5, 0.1),
    }[loss]
    op, backward = raw(loss)
    refs, ref_labels = make((10, 4), torch.float32), make_labels(10, 3)
    e, labels = refs[3:8].clone(), ref_labels[3:8]
    _, stats = op(e, labels, refs, ref_labels, *params, 3)
    for g in (torch.ones((), dtype=torch.float64), torch.ones(())):
        check_opcheck(backward, (g, e, labels, refs, ref_labels, stats, *params, [True, True], 3, True))
    ge, gr = backward(torch.ones(()), e, labels, refs, ref_labels, stats, *params, [True, True], 3, True)
    assert ge.shape == e.shape and not gr.any()  # (the memory's gradient is not computed)
    for shard in (None, -1):
        args = (torch.ones(()), e, labels, refs, ref_labels, stats, *params, [True, False], shard, True)
        with pytest.raises(ValueError, match=f"own_stats needs shard >= 0 .*got shard = {shard}"):
            backward(*args)
        with pytest.raises(ValueError, match="own_stats needs shard >= 0"):
            backward(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])


def test_module_is_exported():
    assert torchkit.nn.CrossBatchMemory is tnn.CrossBatchMemory and "CrossBatchMemory" in tnn.__all__
