"""The pair losses' ``group=`` over 2 and 3 gloo processes: on every rank the loss of the
ranks' batches concatenated, and each rank's gradient its rows of that loss's gradient, as one
process computes them; uneven and empty shards; PML's batch rules on the whole batch; a DDP
step equal to one process's; the same error on every rank for arguments one rank refuses or
the ranks disagree on."""

from __future__ import annotations

import functools
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from ranks import assert_every_rank_raised, save, spawn, split

from torchkit import nn as tnn
from torchkit import ops

LOSSES = {
    "supcon": (ops.supcon_loss, dict(temperature=0.1)),
    "ntxent": (ops.ntxent_loss, dict(temperature=0.2)),
    "contrastive": (ops.contrastive_loss, dict(pos_margin=0.1, neg_margin=0.9)),
    "triplet_all": (ops.triplet_margin_loss, dict(margin=0.3, mining="all")),
    "triplet_semi_hard": (ops.triplet_margin_loss, dict(margin=0.3, mining="semi_hard")),
    "triplet_batch_hard": (ops.triplet_margin_loss, dict(margin=0.3, mining="batch_hard")),
    "contrastive_cosine": (ops.contrastive_loss, dict(pos_margin=0.9, neg_margin=0.1, distance="cosine")),
    "triplet_all_cosine": (ops.triplet_margin_loss, dict(margin=0.2, mining="all", distance="cosine")),
    "multi_similarity": (ops.multi_similarity_loss, dict(miner_epsilon=0.1)),
    "multi_similarity_no_miner": (ops.multi_similarity_loss, dict(miner_epsilon=None)),
}


def data(seed: int, n: int, d: int, classes: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn(classes, d, generator=g, dtype=torch.float64)[labels] + 0.8 * torch.randn(
        n, d, generator=g, dtype=torch.float64
    )
    return x.to(dtype), labels


def cases(world: int) -> dict:
    """name -> (loss, kwargs, embeddings, labels, sizes, refs or None, ref labels, ref sizes)."""
    x, y = data(1, 29, 6, 5)
    out = {}
    for name, (_, kwargs) in LOSSES.items():
        out[name] = (name, kwargs, x, y, split(29, world), None, None, None)
    r, ry = data(2, 17, 6, 5)
    for name in ("supcon", "contrastive", "triplet_semi_hard", "multi_similarity"):
        out[f"{name}_refs"] = (name, LOSSES[name][1], x[:11], y[:11], split(11, world, 0), r, ry, split(17, world))
    # Fewer refs over all ranks than one rank's anchors (a small bank beside a large batch).
    for name in ("supcon", "triplet_batch_hard"):
        out[f"{name}_few_refs"] = (name, LOSSES[name][1], x, y, split(29, world), r[:4], ry[:4], split(4, world))
    out["supcon_empty_rank"] = ("supcon", {}, x, y, split(29, world, world - 1), None, None, None)
    out["triplet_batch_hard_float32"] = (
        "triplet_batch_hard",
        LOSSES["triplet_batch_hard"][1],
        x.float(),
        y,
        split(29, world),
        None,
        None,
        None,
    )
    one = torch.zeros(7, dtype=torch.long)
    out["no_negative_pair"] = ("supcon", {}, x[:7], one, split(7, world), None, None, None)
    # Three rows: one positive pair (both directions) and negatives; PML's rule of at most one
    # pair of each kind holds for the whole batch only with refs.
    out["one_pair_each_contrastive"] = (
        "contrastive",
        {},
        x[:1],
        y[:1],
        [1] + [0] * (world - 1),
        x[1:3],
        torch.stack([y[0], y[0] + 1]),
        split(2, world, 0),
    )
    return out


def local(x, sizes, rank):
    return None if x is None else x.split(sizes)[rank]


def run(name: str, spec, rank: int, group):
    loss_name, kwargs, x, y, sizes, r, ry, r_sizes = spec
    fn = LOSSES[loss_name][0]
    mine = local(x, sizes, rank).clone().requires_grad_()
    refs = None if r is None else local(r, r_sizes, rank).clone().requires_grad_()
    value = fn(
        mine, local(y, sizes, rank), ref_embeddings=refs, ref_labels=local(ry, r_sizes, rank), group=group, **kwargs
    )
    value.backward()
    return value.detach(), mine.grad, None if refs is None else refs.grad


def proxy_cases(world: int) -> dict:
    """name -> (embeddings, labels, proxies, sizes, kwargs): proxy_anchor_loss, every rank
    holding the same proxies."""
    x, y = data(6, 26, 5, 4)
    proxies = torch.randn(6, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with_nan = x.clone()
    with_nan[20, 1] = float("nan")
    return {
        "proxy_anchor": (x, y, proxies, split(26, world), {}),
        "proxy_anchor_empty_rank": (x, y, proxies, split(26, world, 0), dict(margin=0.2, alpha=16.0)),
        "proxy_anchor_float32": (x.float(), y, proxies.float(), split(26, world), {}),
        "proxy_anchor_nan": (with_nan, y, proxies, split(26, world), {}),
    }


def run_proxy(spec, rank: int, group):
    x, y, proxies, sizes, kwargs = spec
    mine = local(x, sizes, rank).clone().requires_grad_()
    p = proxies.clone().requires_grad_()
    value = ops.proxy_anchor_loss(mine, local(y, sizes, rank), p, group=group, **kwargs)
    value.backward()
    return value.detach(), mine.grad, p.grad


def error_cases(world: int, rank: int) -> dict:
    """name -> (loss, this rank's keyword arguments): every rank must raise."""
    x, y = data(3, 4 + rank, 5, 2)
    last = rank == world - 1
    return {
        "features_differ": (ops.supcon_loss, dict(embeddings=x[:, : 5 - last], labels=y)),
        "dtypes_differ": (ops.supcon_loss, dict(embeddings=x.float() if last else x, labels=y)),
        "parameters_differ": (ops.supcon_loss, dict(embeddings=x, labels=y, temperature=0.1 + 0.1 * last)),
        "refs_on_one_rank": (
            ops.contrastive_loss,
            dict(embeddings=x, labels=y, ref_embeddings=x if last else None, ref_labels=y if last else None),
        ),
        "one_rank_refuses": (
            ops.triplet_margin_loss,
            dict(embeddings=x, labels=y, margin=float("nan") if last else 0.1),
        ),
        "labels_of_another_length": (ops.ntxent_loss, dict(embeddings=x, labels=y[:-1] if last else y)),
        "proxies_differ_in_number": (
            ops.proxy_anchor_loss,
            dict(embeddings=x, labels=y, proxies=torch.zeros(2 + last, 5, dtype=torch.float64)),
        ),
        "proxy_label_out_of_range": (
            ops.proxy_anchor_loss,
            dict(embeddings=x, labels=y + 2 * last, proxies=torch.ones(2, 5, dtype=torch.float64)),
        ),
    }


def ddp_step(rank: int, world: int, group, x, y, sizes):
    """One DDP step of a linear embedding under supcon_loss(group=) scaled by the world size
    (DDP averages the ranks' gradients; the loss's are its rows' of the whole loss)."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(6, 4).double())
    criterion = tnn.SupConLoss(temperature=0.1, group=group)
    loss = criterion(model(local(x, sizes, rank)), local(y, sizes, rank))
    (loss * dist.get_world_size(group)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    del model  # before the process group goes (tests/test_ddp.py)
    return loss.detach(), grads


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    group = dist.group.WORLD
    results = {name: run(name, spec, rank, group) for name, spec in cases(world).items()}
    results.update({name: run_proxy(spec, rank, group) for name, spec in proxy_cases(world).items()})
    for name, (fn, kwargs) in error_cases(world, rank).items():
        try:
            fn(**kwargs, group=group)
            results[name] = None
        except (TypeError, ValueError, IndexError) as err:
            results[name] = (type(err).__name__, str(err))
    x, y = data(4, 19, 6, 4)
    results["ddp"] = ddp_step(rank, world, group, x, y, split(19, world))
    save(results, out_dir, rank)
    dist.barrier()
    dist.destroy_process_group()


# The cases the Triton kernels take through group= (under the interpreter, a few: a kernel
# launch is slow there): each engine, with and without refs, and proxy_anchor_loss.
TRITON_CASES = ("supcon", "contrastive_refs", "triplet_batch_hard", "triplet_semi_hard_refs", "multi_similarity")


def triton_worker(rank: int, world: int, init_file: str, out_dir: str, device: str) -> None:
    """worker's loss cases, TRITON_CASES and proxy_anchor, with the Triton kernels in the
    dispatcher's slot for `device` (triton_testing.installed) and the tensors on it: on CUDA,
    every rank on the one visible GPU, over gloo (which carries CUDA tensors)."""
    import triton_testing

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    group = dist.group.WORLD
    move = lambda spec: tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in spec)  # noqa: E731
    home = lambda out: tuple(None if v is None else v.cpu() for v in out)  # noqa: E731
    with triton_testing.installed("pair_losses", device):
        results = {name: home(run(name, move(cases(world)[name]), rank, group)) for name in TRITON_CASES}
        results["proxy_anchor"] = home(run_proxy(move(proxy_cases(world)["proxy_anchor"]), rank, group))
    save(results, out_dir, rank)
    dist.barrier()
    dist.destroy_process_group()


WORLDS = [2, 3]


@pytest.fixture(scope="module", params=WORLDS, ids=[f"{w}ranks" for w in WORLDS])
def ranks(request):
    return request.param, spawn(worker, request.param)


def one_process(spec):
    """The loss and gradients of the concatenated batch in this process."""
    loss_name, kwargs, x, y, _, r, ry, _ = spec
    e = x.clone().requires_grad_()
    refs = None if r is None else r.clone().requires_grad_()
    value = LOSSES[loss_name][0](e, y, ref_embeddings=refs, ref_labels=ry, **kwargs)
    value.backward()
    return value.detach(), e.grad, None if refs is None else refs.grad


@pytest.mark.parametrize("name", list(cases(2)))
def test_loss_and_gradients_equal_one_process(ranks, name):
    world, results = ranks
    spec = cases(world)[name]
    expected, grad, ref_grad = one_process(spec)
    tol = dict(rtol=1e-5, atol=1e-6) if spec[2].dtype == torch.float32 else dict(rtol=1e-9, atol=1e-12)
    for rank in results:
        assert rank[name][0].dtype == spec[2].dtype
        torch.testing.assert_close(rank[name][0], expected, **tol)
    assert len({r[name][0].item() for r in results}) == 1  # the same value on every rank
    torch.testing.assert_close(torch.cat([r[name][1] for r in results]), grad, **tol)
    if ref_grad is not None:
        torch.testing.assert_close(torch.cat([r[name][2] for r in results]), ref_grad, **tol)
    if name in ("no_negative_pair", "one_pair_each_contrastive"):
        assert expected == 0 and not grad.any()  # PML's rules, on the whole batch
    else:
        assert expected != 0 and grad.abs().sum() > 0


@pytest.mark.parametrize("name", list(proxy_cases(2)))
def test_proxy_anchor_equals_one_process(ranks, name):
    """Each rank's embeddings' gradient is theirs; the proxies' gradients sum to theirs."""
    world, results = ranks
    x, y, proxies, _, kwargs = proxy_cases(world)[name]
    e, p = x.clone().requires_grad_(), proxies.clone().requires_grad_()
    expected = ops.proxy_anchor_loss(e, y, p, **kwargs)
    expected.backward()
    tol = dict(rtol=1e-5, atol=1e-6) if x.dtype == torch.float32 else dict(rtol=1e-9, atol=1e-12)
    for rank in results:
        torch.testing.assert_close(rank[name][0], expected.detach(), equal_nan=True, **tol)
    if name == "proxy_anchor_nan":
        assert expected.isnan()
        return
    torch.testing.assert_close(torch.cat([r[name][1] for r in results]), e.grad, **tol)
    torch.testing.assert_close(sum(r[name][2] for r in results), p.grad, **tol)


def test_ddp_step_equals_one_process(ranks):
    _, results = ranks
    x, y = data(4, 19, 6, 4)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4).double()
    loss = ops.supcon_loss(model(x), y, temperature=0.1)
    loss.backward()
    for rank in results:
        got_loss, got_grads = rank["ddp"]
        torch.testing.assert_close(got_loss, loss.detach(), rtol=1e-9, atol=0)
        for got, p in zip(got_grads, model.parameters(), strict=True):
            torch.testing.assert_close(got, p.grad, rtol=1e-9, atol=1e-12)


ERRORS = {
    "features_differ": (ValueError, r"supcon_loss: the ranks disagree on the feature size D: rank 0: 5"),
    "dtypes_differ": (ValueError, r"supcon_loss: the ranks disagree on the dtype: rank 0: 'torch.float64'"),
    "parameters_differ": (ValueError, r"supcon_loss: the ranks disagree on the loss's parameters"),
    "refs_on_one_rank": (ValueError, r"contrastive_loss: the ranks disagree on whether ref_embeddings are given"),
    "one_rank_refuses": (ValueError, r"triplet_margin_loss: margin must be finite, got nan \(on rank \d\)"),
    "labels_of_another_length": (ValueError, r"ntxent_loss: labels must be 1-D with one label per row"),
    "proxies_differ_in_number": (ValueError, r"proxy_anchor_loss: the ranks disagree on the number of proxies C"),
    "proxy_label_out_of_range": (IndexError, r"proxy_anchor_loss: labels must lie in \[0, C\) = \[0, 2\).*on rank"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_every_rank_raises(ranks, name):
    _, results = ranks
    assert_every_rank_raised(results, name, *ERRORS[name])


@pytest.mark.bad_input
@pytest.mark.parametrize("group", ["world", 0])
def test_group_must_be_a_process_group(group):
    x, y = data(5, 6, 3, 2)
    with pytest.raises(TypeError, match=r"^supcon_loss: group must be a torch\.distributed ProcessGroup or None"):
        ops.supcon_loss(x, y, group=group)


@pytest.mark.triton("pair_losses", dispatch=False)  # (the ranks install them)
@pytest.mark.parametrize("device", ["cuda" if torch.cuda.is_available() else "cpu"])
def test_triton_kernels_across_ranks_equal_one_process(device):
    """group= through the losses' Triton kernels (their shards: csrc/pair_losses.h), on CUDA
    tensors where a GPU is visible, else under the interpreter: on 2 ranks, each loss and
    gradient equal to one process's with the CPU kernels (float64)."""
    import triton_testing

    reason = triton_testing.available(interpreted=device == "cpu")
    if reason:
        pytest.skip(reason)
    results = spawn(functools.partial(triton_worker, device=device), 2)
    tol = dict(rtol=1e-9, atol=1e-12)
    for name in TRITON_CASES:
        expected, grad, ref_grad = one_process(cases(2)[name])
        for rank in results:
            torch.testing.assert_close(rank[name][0], expected, **tol)
        torch.testing.assert_close(torch.cat([r[name][1] for r in results]), grad, **tol)
        if ref_grad is not None:
            torch.testing.assert_close(torch.cat([r[name][2] for r in results]), ref_grad, **tol)
    x, y, proxies, _, kwargs = proxy_cases(2)["proxy_anchor"]
    e, p = x.clone().requires_grad_(), proxies.clone().requires_grad_()
    expected = ops.proxy_anchor_loss(e, y, p, **kwargs)
    expected.backward()
    for rank in results:
        torch.testing.assert_close(rank["proxy_anchor"][0], expected.detach(), **tol)
    torch.testing.assert_close(torch.cat([r["proxy_anchor"][1] for r in results]), e.grad, **tol)
    torch.testing.assert_close(sum(r["proxy_anchor"][2] for r in results), p.grad, **tol)
