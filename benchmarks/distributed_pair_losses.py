"""The pair losses' group= on 1 versus 2 processes over the same global batch (gloo, this
machine's cores shared out), against pytorch-metric-learning's DistributedLossWrapper (every
rank gathers the embeddings and computes the whole N × N loss).

    .venv/bin/python benchmarks/distributed_pair_losses.py [--repeats 5] [--quick]

Per configuration: the median wall time of a forward and backward (the slowest rank's, after a
barrier) and each rank's peak extra resident memory during it (the kernel's peak-RSS counter,
reset before the call); and the collectives of a group= step alone, the most that passing the
embeddings around a ring of the ranks instead could hide. Writes
benchmarks/results/cpu-distributed-losses.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from distributed_knn import measure, run  # benchmarks/ is this script's directory

RESULTS = Path(__file__).resolve().parent / "results"
# name: (loss, its parameters, PML's loss, global batch N, D, samples per class)
CASES = {
    "supcon_loss N=4096 D=128 8/class": ("supcon_loss", {"temperature": 0.1}, "SupConLoss", 4096, 128, 8),
    "triplet_margin_loss batch_hard N=4096 D=128 8/class": (
        "triplet_margin_loss",
        {"margin": 0.05, "mining": "batch_hard"},
        "TripletMarginLoss+BatchHardMiner",
        4096,
        128,
        8,
    ),
}
QUICK = {"supcon_loss N=1024 D=128 8/class": ("supcon_loss", {"temperature": 0.1}, "SupConLoss", 1024, 128, 8)}


def data(n: int, d: int, per_class: int):
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(n) // per_class
    return torch.randn(n, d, generator=g), labels[torch.randperm(n, generator=g)]


def pml_loss(name: str, params: dict):
    """PML's loss (with its miner) wrapped as its users run it across ranks."""
    from pytorch_metric_learning import losses, miners
    from pytorch_metric_learning.utils.distributed import DistributedLossWrapper, DistributedMinerWrapper

    if name == "SupConLoss":
        wrapped = DistributedLossWrapper(losses.SupConLoss(**params))
        return lambda e, y: wrapped(e, y)
    wrapped = DistributedLossWrapper(losses.TripletMarginLoss(margin=params["margin"]))
    miner = DistributedMinerWrapper(miners.BatchHardMiner())
    return lambda e, y: wrapped(e, y, miner(e, y))


def step(fn, x, labels):
    e = x.clone().requires_grad_()
    fn(e, labels).backward()


def exchange(loss: str, x, labels, group) -> None:
    """The collectives of one group= step alone, with their volumes (torchkit/ops/
    _pair_losses_across_ranks.py): the arguments' description, the embeddings and labels
    all-gathered, the parts all-reduced, then every anchor's stats all-gathered (whole_stats) or
    the gathered rows' gradient reduce-scattered. The most a ring of the ranks, which overlaps
    its exchange with the tiles, could take off a step."""
    from torchkit import distributed
    from torchkit.ops._pair_losses_across_ranks import _gather, _reduce_scatter
    from torchkit.ops.pair_losses import SPECS

    sizes = [r["rows"] for r in distributed._all_gather({"rows": x.shape[0]}, group)]
    _gather(x, sizes, group)
    _gather(labels, sizes, group)
    spec = SPECS[loss]
    dist.all_reduce(torch.zeros(spec.parts, dtype=torch.float64), group=group)
    if spec.whole_stats:
        _gather(torch.zeros(x.shape[0], spec.columns, dtype=x.dtype), sizes, group)
    else:
        widest = max(sizes)
        _reduce_scatter(x.new_empty(widest, x.shape[1]), x.new_zeros(len(sizes) * widest, x.shape[1]), group=group)


def worker(rank: int, world: int, init_file: str, out_dir: str, cases: dict, repeats: int) -> None:
    from torchkit import ops

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for name, (loss, params, pml, n, d, per_class) in cases.items():
        x, labels = data(n, d, per_class)
        x, labels = x.tensor_split(world)[rank].clone(), labels.tensor_split(world)[rank].clone()
        fn = getattr(ops, loss)
        if world == 1:
            results[name] = {"one process": measure(partial(step, partial(fn, **params), x, labels), repeats, 1)}
            continue
        group = dist.group.WORLD
        results[name] = {
            "torchkit group=": measure(partial(step, partial(fn, **params, group=group), x, labels), repeats, world),
            "torchkit group=, its exchange alone": measure(partial(exchange, loss, x, labels, group), repeats, world),
            f"pytorch-metric-learning {pml} (DistributedLossWrapper)": measure(
                partial(step, pml_loss(pml, params), x, labels), repeats, world
            ),
        }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--quick", action="store_true", help="one small supcon_loss case")
    args = parser.parse_args()
    cases = QUICK if args.quick else CASES
    one, two = run(1, cases, args.repeats, worker), run(2, cases, args.repeats, worker)
    rows, report = [], {"cpu_count": os.cpu_count(), "torch": torch.__version__, "cases": {}}
    for name, (_, _, _, n, d, _) in cases.items():
        single = one[0][name]["one process"]
        gathered = n * d * 4 / 2**20  # MiB of embeddings each rank holds after the gather
        report["cases"][name] = {"1 rank": one[0][name], "2 ranks": [r[name] for r in two], "gathered_mib": gathered}
        rows.append(
            f"| {name} | 1 process, {os.cpu_count()} threads, torchkit | {1e3 * single['median_s']:.0f} ms | "
            f"{single['peak_extra_mib']:.1f} MiB |"
        )
        step_s = two[0][name]["torchkit group="]["median_s"]
        for how in two[0][name]:
            t = two[0][name][how]["median_s"]
            peak = max(r[name][how]["peak_extra_mib"] for r in two)
            ratio = (
                f"{t / step_s:.0%} of the group= step"
                if how.endswith("alone")
                else f"{single['median_s'] / t:.2f}× one process"
            )
            rows.append(f"| | 2 ranks, {how} | {1e3 * t:.0f} ms ({ratio}) | {peak:.1f} MiB |")
    table = "\n".join(
        [
            "| case | configuration | forward+backward, median (slowest rank) | peak extra memory per rank |",
            "|---|---|---|---|",
            *rows,
        ]
    )
    name = "cpu-distributed-losses-quick" if args.quick else "cpu-distributed-losses"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=1))
    (RESULTS / f"{name}.md").write_text(
        f"# The pair losses' group=, 1 versus 2 ranks (gloo), {os.cpu_count()} CPU cores, torch {torch.__version__}\n\n"
        f"`.venv/bin/python benchmarks/distributed_pair_losses.py{' --quick' if args.quick else ''}`, "
        f"median of {args.repeats} steps after a warm-up; the same global batch in every row.\n\n{table}\n"
    )
    print(table)


if __name__ == "__main__":
    main()
