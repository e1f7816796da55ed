"""torchkit's ops under DistributedDataParallel: 2 processes (gloo, loopback) give the same
gradients as one process on the same global batch, eagerly and under torch.compile."""

import faulthandler
import gc
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torchkit import ops

GLOBAL_BATCH, WORLD = 8, 2
pytestmark = pytest.mark.slow  # spawns processes and compiles: full suite (make test) only


class Model(nn.Module):
    """Every op on the path of the loss: block shuffle, bilinear pooling, the loss, cdist."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.head = nn.Linear(36, 5)
        self.centres = nn.Parameter(torch.randn(5, 36) * 0.1)

    def forward(self, x, permutation, labels):
        x = ops.permute_blocks(x, permutation, 4)
        z = ops.bilinear_pool(torch.relu(self.conv(x)))
        loss = ops.label_smoothing_cross_entropy(self.head(z), labels, label_smoothing=0.1)
        return loss + 0.1 * ops.cdist(z, self.centres).mean()


def batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 3, 16, 16, generator=g)
    perm = torch.stack([torch.randperm(16, generator=g) for _ in range(GLOBAL_BATCH)])
    labels = torch.randint(5, (GLOBAL_BATCH,), generator=g)
    return x, perm, labels


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def worker(rank, init_file, out_dir, compile_):
    # Where a rank dies of a signal, its Python stacks at that moment (see run()).
    crash_log = open(Path(out_dir) / f"rank{rank}.stacks", "w")  # noqa: SIM115  (open until the process ends)
    faulthandler.enable(crash_log, all_threads=True)
    if compile_:
        # Each rank compiles in its own process, without Inductor's pool of compile workers:
        # two ranks each starting one on a 2-core machine only contend.
        torch._inductor.config.compile_threads = 1
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    model = nn.parallel.DistributedDataParallel(Model())
    net = torch.compile(model) if compile_ else model
    x, perm, labels = (t.chunk(WORLD)[rank] for t in batch())
    net(x, perm, labels).backward()
    if rank == 0:
        torch.save(grads(model.module), Path(out_dir) / "grads.pt")
    dist.barrier()  # no rank tears its connections down while another still talks to it
    # DDP's reducer holds the process group: freed here, its gloo threads end while the
    # interpreter is alive rather than in its finalisation, where an abort ("terminate called
    # without an active exception") can follow (pytorch/pytorch#179291).
    del net, model
    gc.collect()
    dist.destroy_process_group()


def run(compile_):
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(worker, args=(str(Path(tmp) / "init"), tmp, compile_), nprocs=WORLD, join=True)
        except mp.ProcessExitedException as err:
            stacks = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(Path(tmp).glob("*.stacks")))
            raise AssertionError(f"{err}\nthe ranks' Python stacks at the signal:\n{stacks}") from err
        return torch.load(Path(tmp) / "grads.pt")


def single_process():
    model = Model()
    model(*batch()).backward()
    return grads(model)


def test_ddp_matches_single_process():
    expected = single_process()
    got = run(compile_=False)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_ddp_with_compile_matches_single_process():
    expected = single_process()
    got = run(compile_=True)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
