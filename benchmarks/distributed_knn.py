"""torchkit.distributed.knn on 1 versus 2 processes over the same total data (gloo, this
machine's cores shared out), against gathering every shard onto each rank and ranking there.

    .venv/bin/python benchmarks/distributed_knn.py [--repeats 5] [--quick]

Per configuration: the median wall time of the call (the slowest rank's, after a barrier) and
each rank's peak extra resident memory during the call (the kernel's peak-RSS counter, reset
before the call). Writes benchmarks/results/cpu-distributed.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results"
CASES = {  # name: (queries, gallery rows or None for leave-one-out, M, k)
    "leave-one-out N=20000 M=128 k=8": (20_000, None, 128, 8),
    "query→gallery P=1000 R=100000 M=512 k=100": (1_000, 100_000, 512, 100),
}
QUICK = {"leave-one-out N=5000 M=128 k=8": (5_000, None, 128, 8)}


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident memory of this process, MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def data(n_query: int, n_gallery: int | None, m: int):
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(n_query, m, generator=g), dim=1)
    gal = None if n_gallery is None else torch.nn.functional.normalize(torch.randn(n_gallery, m, generator=g), dim=1)
    return q, gal


def gather_then_rank(query, gallery, k, world):
    """What metric-learning code does today: every shard gathered onto the rank, then ranked."""
    from torchkit import ops

    own = query if gallery is None else gallery
    sizes = [torch.zeros((), dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor(own.shape[0]))
    everything = own.new_empty((sum(int(n) for n in sizes), own.shape[1]))
    dist.all_gather(list(everything.split([int(n) for n in sizes])), own)  # into one buffer: no copy
    if gallery is not None:
        return ops.knn(query, everything, k)
    # Leave-one-out against the gathered set: one more neighbour, then each row itself dropped.
    offset = sum(int(n) for n in sizes[: dist.get_rank()])
    d, i = ops.knn(query, everything, k + 1)
    own = i == torch.arange(offset, offset + query.shape[0]).unsqueeze(1)
    keep = own.to(torch.uint8).sort(dim=1, stable=True).indices[:, :k]
    return d.gather(1, keep), i.gather(1, keep)


def measure(fn, repeats: int, world: int) -> dict:
    times, peaks = [], []
    for _ in range(repeats + 1):  # the first call warms up (thread pools, allocator)
        if world > 1:
            dist.barrier()
        base, _ = rss_mib()
        reset_peak()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor(time.perf_counter() - start)
        if world > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
        peaks.append(rss_mib()[1] - base)
    return {"median_s": statistics.median(times[1:]), "runs_s": times[1:], "peak_extra_mib": max(peaks[1:])}


def worker(rank: int, world: int, init_file: str, out_dir: str, cases: dict, repeats: int) -> None:
    import torchkit
    from torchkit import ops

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for name, (n_query, n_gallery, m, k) in cases.items():
        q, g = data(n_query, n_gallery, m)
        q = q.tensor_split(world)[rank].clone()  # this rank's shards only
        g = None if g is None else g.tensor_split(world)[rank].clone()
        if world == 1:
            results[name] = {"one process (torchkit.ops.knn)": measure(partial(ops.knn, q, g, k), repeats, 1)}
            continue
        results[name] = {
            "ring (torchkit.distributed.knn)": measure(partial(torchkit.distributed.knn, q, g, k), repeats, world),
            "gather, then torchkit.ops.knn": measure(partial(gather_then_rank, q, g, k, world), repeats, world),
        }
    per_rank = Path(out_dir) / f"rank{rank}.json"
    per_rank.write_text(json.dumps(results))
    if world > 1:
        dist.barrier()  # no rank tears its connections down while another still talks to it
        dist.destroy_process_group()


def run(world: int, cases: dict, repeats: int, worker=worker) -> list[dict]:
    """Each rank's results of ``worker`` (this one, or another benchmark's) on `world` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, str(Path(tmp) / "init"), tmp, cases, repeats), nprocs=world, join=True)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per configuration (after one warm-up)")
    parser.add_argument("--quick", action="store_true", help="one small leave-one-out case")
    args = parser.parse_args()
    cases = QUICK if args.quick else CASES
    one, two = run(1, cases, args.repeats), run(2, cases, args.repeats)
    rows, report = [], {"cpu_count": os.cpu_count(), "torch": torch.__version__, "cases": {}}
    for name, (n_query, n_gallery, m, _) in cases.items():
        single = one[0][name]["one process (torchkit.ops.knn)"]
        n = n_query if n_gallery is None else n_gallery
        traffic = (2 - 1) / 2 * n * m * 4 / 2**20  # MiB each rank receives on the ring
        report["cases"][name] = {
            "1 rank": one[0][name],
            "2 ranks": [r[name] for r in two],
            "ring_mib_received": traffic,
        }
        rows.append(
            f"| {name} | 1 process, {os.cpu_count()} threads | {1e3 * single['median_s']:.0f} ms | "
            f"{single['peak_extra_mib']:.1f} MiB | – |"
        )
        for how in ("ring (torchkit.distributed.knn)", "gather, then torchkit.ops.knn"):
            t = two[0][name][how]["median_s"]
            peak = max(r[name][how]["peak_extra_mib"] for r in two)
            rows.append(
                f"| | 2 ranks, {how} | {1e3 * t:.0f} ms ({single['median_s'] / t:.2f}× one process) | "
                f"{peak:.1f} MiB | {traffic:.0f} MiB received |"
            )
    table = "\n".join(
        [
            "| case | configuration | median (slowest rank) | peak extra memory per rank | data moved per rank |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    name = "cpu-distributed-quick" if args.quick else "cpu-distributed"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=1))
    (RESULTS / f"{name}.md").write_text(
        f"# torchkit.distributed.knn, 1 versus 2 ranks (gloo), {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}\n\n"
        f"`.venv/bin/python benchmarks/distributed_knn.py{' --quick' if args.quick else ''}`, "
        f"median of {args.repeats} calls after a warm-up.\n\n{table}\n"
    )
    print(table)


if __name__ == "__main__":
    main()
