"""torchkit.distributed.knn and the metrics' ``group=`` over 2 and 3 gloo processes: the same
results, bit for bit, as one process on the concatenated data, and the same error on every
rank for arguments one rank refuses or the ranks disagree on."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from ranks import assert_every_rank_raised, save, spawn, split
from testing import DEVICES

import torchkit
from torchkit import metrics, ops


def shard(x: torch.Tensor | None, sizes: list[int], rank: int):
    return None if x is None else x.split(sizes)[rank]


def randn(seed: int, n: int, m: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def knn_cases(world: int) -> dict:
    """name -> (query, gallery or None, k, squared, query sizes, gallery sizes): global data."""
    far = 1e6 + 1e-2 * randn(3, 40, 6)  # one cluster far from the origin, split over the ranks
    ties = torch.randint(0, 2, (24, 3), generator=torch.Generator().manual_seed(4)).float()  # exact ties
    with_nan = randn(5, 17, 5)
    with_nan[3, 2] = float("nan")
    with_nan[12] = float("nan")
    gallery = randn(2, 30, 8, torch.float64)
    return {
        "leave_one_out": (randn(1, 23, 8), None, 9, False, split(23, world), None),
        "query_to_gallery": (randn(1, 11, 8, torch.float64), gallery, 20, False, split(11, world), split(30, world, 0)),
        "empty_first_rank": (randn(6, 19, 4), None, 7, True, split(19, world, 0), None),
        "far_from_origin": (far, None, 5, False, split(40, world), None),
        "ties_leave_one_out": (ties, None, 10, True, split(24, world), None),
        "ties_to_gallery": (ties[:7], ties, 12, False, split(7, world, world - 1), split(24, world)),
        "nan_rows": (with_nan, None, 16, False, split(17, world), None),
        "bfloat16": (randn(7, 21, 16, torch.bfloat16), None, 6, False, split(21, world), None),
        "float16_to_gallery": (
            randn(8, 9, 16, torch.float16),
            randn(9, 14, 16, torch.float16),
            14,
            False,
            split(9, world),
            split(14, world),
        ),
    }


def metric_cases(world: int) -> dict:
    """name -> (embeddings, labels, gallery, gallery_labels, sizes, gallery sizes)."""
    g = torch.Generator().manual_seed(10)
    labels = torch.arange(7).repeat_interleave(5)[torch.randperm(35, generator=g)]
    x = torch.randn(7, 6, generator=g)[labels] + 0.9 * torch.randn(35, 6, generator=g)
    labels[0] = 99  # a label no other row has: left out of MAP@R leave-one-out
    gallery_labels = torch.arange(7).repeat_interleave(4)
    gallery = torch.randn(7, 6, generator=g)[gallery_labels] + 0.9 * torch.randn(28, 6, generator=g)
    return {
        "metrics_leave_one_out": (x, labels, None, None, split(35, world, 1), None),
        "metrics_to_gallery": (x[:12], labels[:12], gallery, gallery_labels, split(12, world), split(28, world, 0)),
    }


def error_cases(world: int, rank: int) -> dict:
    """name -> this rank's keyword arguments of distributed.knn: every rank must raise."""
    x = randn(11, 4 + rank, 8)
    last = rank == world - 1
    return {
        "features_differ": dict(query=randn(11, 3, 8 if rank == 0 else 4)),
        "dtypes_differ": dict(query=x.double() if last else x),
        "gallery_on_one_rank": dict(query=x, gallery=x if last else None),
        "k_differs": dict(query=x, k=1 + rank),
        "squared_differs": dict(query=x, squared=last),
        "k_past_the_union": dict(query=x, k=sum(4 + r for r in range(world))),
        "one_rank_refuses": dict(query=x[0] if last else x),
        "k_not_an_int": dict(query=x, k=1.5),
        "squared_not_a_bool": dict(query=x, squared=None),
    }


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    results = {}
    for name, (q, g, k, squared, q_sizes, g_sizes) in knn_cases(world).items():
        results[name] = torchkit.distributed.knn(shard(q, q_sizes, rank), shard(g, g_sizes, rank), k, squared=squared)
    group = dist.group.WORLD
    for name, (x, y, g, gy, sizes, g_sizes) in metric_cases(world).items():
        local = dict(gallery=shard(g, g_sizes, rank), gallery_labels=shard(gy, g_sizes, rank), group=group)
        results[name] = (
            metrics.recall_at_k(shard(x, sizes, rank), shard(y, sizes, rank), (1, 2, 4, 8), **local),
            metrics.map_at_r(shard(x, sizes, rank), shard(y, sizes, rank), **local),
        )
    for name, kwargs in error_cases(world, rank).items():
        try:
            torchkit.distributed.knn(**kwargs)
            results[name] = None
        except (TypeError, ValueError) as err:
            results[name] = (type(err).__name__, str(err))
    save(results, out_dir, rank)
    dist.barrier()  # no rank tears its connections down while another still talks to it
    dist.destroy_process_group()


WORLDS = [2, 3]


@pytest.fixture(scope="module", params=WORLDS, ids=[f"{w}ranks" for w in WORLDS])
def ranks(request):
    return request.param, spawn(worker, request.param)


def assert_identical(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", list(knn_cases(2)))
def test_knn_equals_one_process(ranks, name):
    world, results = ranks
    q, g, k, squared, _, _ = knn_cases(world)[name]
    expected_d, expected_i = ops.knn(q, g, k, squared=squared)
    got_d = torch.cat([r[name][0] for r in results])
    got_i = torch.cat([r[name][1] for r in results])
    assert got_d.dtype == q.dtype and got_i.dtype == torch.long and not got_d.requires_grad
    assert_identical(got_i, expected_i)
    assert_identical(got_d, expected_d)


@pytest.mark.parametrize("name", list(metric_cases(2)))
def test_metrics_equal_one_process(ranks, name):
    world, results = ranks
    x, y, g, gy, _, _ = metric_cases(world)[name]
    recall = metrics.recall_at_k(x, y, (1, 2, 4, 8), gallery=g, gallery_labels=gy)
    map_r = metrics.map_at_r(x, y, gallery=g, gallery_labels=gy)
    for rank in results:
        assert rank[name][0] == recall  # exact: counts of hits over the same count of queries
        assert rank[name][1] == pytest.approx(map_r, rel=1e-12, abs=0)  # sums of floats, in another order
    assert 0 < map_r < 1 and 0 < recall[1] < 1


ERRORS = {
    "features_differ": (ValueError, r"the ranks disagree on the feature size M: rank 0: 8, rank 1: 4"),
    "dtypes_differ": (ValueError, r"the ranks disagree on the dtype: rank 0: 'torch.float32'"),
    "gallery_on_one_rank": (ValueError, r"the ranks disagree on whether a gallery is given"),
    "k_differs": (ValueError, r"the ranks disagree on k: rank 0: 1, rank 1: 2"),
    "squared_differs": (ValueError, r"the ranks disagree on squared"),
    "k_past_the_union": (ValueError, r"k must be in \[1, \d+\] \(the other rows: leave-one-out\)"),
    "one_rank_refuses": (ValueError, r"query must be \(N, M\), got shape \(8,\) \(on rank \d\)"),
    "k_not_an_int": (TypeError, r"k must be an int, got float 1.5 \(on rank 0\)"),
    "squared_not_a_bool": (TypeError, r"squared must be a bool, got NoneType None \(on rank 0\)"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_every_rank_raises(ranks, name):
    _, results = ranks
    kind, match = ERRORS[name]
    assert_every_rank_raised(results, name, kind, match)
    assert all(rank[name][1].startswith("torchkit.distributed.knn: ") for rank in results)


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialised"):
        torchkit.distributed.knn(torch.zeros(3, 2))


@pytest.mark.bad_input
@pytest.mark.parametrize("group", ["world", 0, [0, 1]])
def test_group_must_be_a_process_group(group):
    pattern = r"must be a torch\.distributed ProcessGroup or None, got " + type(group).__name__
    with pytest.raises(TypeError, match=r"^torchkit\.distributed\.knn: group " + pattern):
        torchkit.distributed.knn(torch.zeros(3, 2), group=group)
    with pytest.raises(TypeError, match=r"^recall_at_k: group " + pattern):
        metrics.recall_at_k(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long), group=group)


@pytest.mark.parametrize("device", DEVICES)
def test_one_rank_in_process(device, tmp_path):
    """World size 1 (no point-to-point traffic, so no NCCL needed): the same code path on
    CPU and CUDA tensors, equal to torchkit.ops.knn, and the metrics equal to one process's."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        for q, g, k, squared, _, _ in knn_cases(1).values():
            q, g = q.to(device), None if g is None else g.to(device)
            expected = ops.knn(q, g, k, squared=squared)
            got = torchkit.distributed.knn(q, g, k, squared=squared)
            assert_identical(got[1], expected[1])
            assert_identical(got[0], expected[0])
        x, y, g, gy, _, _ = metric_cases(1)["metrics_to_gallery"]
        x, y, g, gy = x.to(device), y.to(device), g.to(device), gy.to(device)
        group = dist.group.WORLD
        assert metrics.recall_at_k(x, y, gallery=g, gallery_labels=gy, group=group) == metrics.recall_at_k(
            x, y, gallery=g, gallery_labels=gy
        )
        assert metrics.map_at_r(x, y, group=group) == metrics.map_at_r(x, y)
    finally:
        dist.destroy_process_group()
