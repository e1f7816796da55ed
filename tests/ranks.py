"""Multi-process tests over gloo (tests/test_distributed.py, tests/test_pair_losses_distributed.py):
shard sizes, running a worker on every rank with a deadline, and the checks of errors that
every rank must raise alike."""

from __future__ import annotations

import re
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

TIMEOUT_S = 240  # a rank left waiting fails the test instead of hanging the suite


def split(n: int, world: int, empty: int | None = None) -> list[int]:
    """Uneven shard sizes summing to n: about a third on the first rank, the rest on the
    last, none in between; rank ``empty`` (if given) gets nothing."""
    if world == 1:
        return [n]
    sizes = [0] * world
    sizes[0], sizes[-1] = n // 3, n - n // 3
    if empty is not None:
        sizes[(empty + 1) % world] += sizes[empty]
        sizes[empty] = 0
    return sizes


def spawn(worker, world: int) -> list[dict]:
    """Runs ``worker(rank, world, init_file, out_dir)`` on `world` processes, each of which
    saves its results to ``out_dir/rank{rank}.pt``; each rank's results.

    A rank that dies after every rank has saved its results died in the teardown of
    torch.distributed and the interpreter (gloo's threads at exit), after the work under test
    had finished: that is reported as a warning, not as a failure of torchkit's results. A
    rank that dies or waits before then fails the test."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            worker, args=(world, str(Path(tmp) / "init"), tmp), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + TIMEOUT_S
        saved = [Path(tmp) / f"rank{r}.pt" for r in range(world)]
        try:
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for process in context.processes:
                        process.kill()
                    pytest.fail(f"{world} ranks did not finish in {TIMEOUT_S} s: a rank is waiting on another")
        except mp.ProcessExitedException as died:
            if not all(path.exists() for path in saved):
                raise
            warnings.warn(
                f"{world} ranks: {died} in torch.distributed's teardown, after every rank saved its results",
                stacklevel=2,
            )
        return [torch.load(path) for path in saved]


def save(results: dict, out_dir: str, rank: int) -> None:
    """A worker's results, whole or absent."""
    partial = Path(out_dir) / f"rank{rank}.partial"
    torch.save(results, partial)
    partial.rename(Path(out_dir) / f"rank{rank}.pt")


def assert_every_rank_raised(results: list[dict], name: str, kind: type, match: str) -> None:
    """Case ``name`` raised ``kind`` matching ``match`` on every rank, with one message."""
    for rank in results:
        assert rank[name] is not None, f"{name}: a rank returned instead of raising"
        assert rank[name][0] == kind.__name__
        assert re.search(match, rank[name][1]), rank[name][1]
    assert len({rank[name] for rank in results}) == 1  # the same message everywhere
