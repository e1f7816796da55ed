"""Turn a pytest-benchmark JSON file into the ratio report, and the latest runs into
benchmarks/RESULTS.md and README's headline table.

    python benchmarks/report.py benchmarks/results/cpu.json   # that run's report, then the page
    python benchmarks/report.py --page                        # the page and README's table only

Prints, per op, one Markdown table: each (case, pass) row gives torchkit's median time, peak
extra memory and throughput (TFLOP/s or GB/s of the work the case cannot avoid), torchkit's
against the roofline's (the machine's own primitive doing that work, timed in the same run)
as roofline median / torchkit median (≤ 1, and 1 is the limit), and for every peer the ratio
peer median / torchkit median (> 1: torchkit is faster), with accuracy (cdist) and bytes saved
for backward (bilinear_pool) where the benchmark recorded them. Every ratio reads the same
way: above 1, torchkit takes less time. Writes the same Markdown next to the JSON (<name>.md)
and one PNG bar chart per op (<name>_<op>.png).

benchmarks/RESULTS.md holds the full tables of the latest full runs (results/cpu.json,
results/cpu-contended.json, results/<gpu>/gpu.json) and the distributed benchmarks' reports
(results/cpu-distributed.md, results/cpu-distributed-losses.md); README's headline table
(between its `headline` markers) holds, per op and machine, the headline cases (those marked
`headline` in benchmarks/, recorded in each entry's extra_info; the op's first case where the
run marked none) against each peer.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker

TORCHKIT = "torchkit"
TRITON = "torchkit (triton)"  # the Triton kernels, timed beside the CUDA C++ ones on a GPU
ROOFLINE = "roofline"  # benchmarks/common.py
BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"
README = BENCHMARKS.parent / "README.md"
HEADLINE_BEGIN = "<!-- headline:begin (benchmarks/report.py writes this table) -->"
HEADLINE_END = "<!-- headline:end -->"
COLUMNS = """Each (case, pass) row gives torchkit's median time, the growth of the process's resident
set (or, on CUDA, of the allocator's peak) during one call, and its throughput; "saves" is
what autograd keeps for backward; "err" is the largest relative error against float64 on
far-from-origin data (1000 + N(0, 1)). The roofline column times the machine's own primitive
for the work the op cannot avoid, in the same run: the GEMMs of the same shapes (`cdist`,
`knn`, `bilinear_pool`, `covariance_pool`), a read of the logits, or a copy into a fresh
gradient (cross-entropy), `x.clone()` (the block shuffle). Every ratio column, the roofline's
included, is other median / torchkit median: above 1, torchkit takes less time. The roofline
ratio is the fraction of that limit torchkit reaches (1 = at the limit); above 1 means that
primitive paid a cost torchkit avoids (first-touch page faults of a fresh buffer; PyTorch's
bfloat16 GEMM on a CPU without bfloat16 units). The CPU machine is shared: single ratios move
by up to ±30 % between runs."""


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.3g} µs"


def _bytes(n) -> str:
    return "–" if n is None else f"{n / 2**20:.1f} MiB"


def _rate(seconds: float, extra: dict) -> str:
    if extra.get("flops"):
        return f", {extra['flops'] / seconds / 1e12:.3g} TFLOP/s"
    if extra.get("bytes"):
        return f", {extra['bytes'] / seconds / 1e9:.3g} GB/s"
    return ""


def _notes(extra: dict) -> str:
    """Op-specific columns folded into the cell: cdist's accuracy, bytes kept for backward."""
    notes = ""
    if "max_rel_error" in extra:
        notes += f", err {extra['max_rel_error']:.1e}"
    if "saved_bytes" in extra:
        notes += f", saves {_bytes(extra['saved_bytes'])}"
    return notes


def load(path: Path) -> dict:
    """{op: {(case, pass): {impl: (median seconds, extra_info)}}}, in the order the run made them.
    An op whose only kernels in the run are Triton's (the pair losses on a GPU) has them as
    torchkit, each marked staged in its extra_info where TORCHKIT_CUDA_KERNELS does not yet
    select them by default."""
    data = json.loads(path.read_text())
    ops: dict = defaultdict(dict)
    for bench in data["benchmarks"]:
        extra = bench["extra_info"]
        row = ops[extra["op"]].setdefault((extra["case"], extra["pass_"]), {})
        row[extra["impl"]] = (bench["stats"]["median"], extra)
    for rows in ops.values():
        if not any(TORCHKIT in impls for impls in rows.values()):
            for impls in rows.values():
                if TRITON in impls:
                    t, extra = impls.pop(TRITON)
                    impls[TORCHKIT] = (t, {**extra, "staged": True})
    return ops, data.get("machine_info", {})


def _staged(rows: dict) -> bool:
    return any(impls[TORCHKIT][1].get("staged") for impls in rows.values() if TORCHKIT in impls)


def table(op: str, rows: dict) -> tuple[str, list[str], dict]:
    peers = [i for i in dict.fromkeys(i for r in rows.values() for i in r) if i not in (TORCHKIT, ROOFLINE)]
    has_roofline = any(ROOFLINE in r for r in rows.values())
    head = [
        "case",
        "pass",
        "torchkit (median, peak extra memory, throughput)",
        *(["vs roofline (roofline median, throughput)"] if has_roofline else []),
        *[f"vs {p}" for p in peers],
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios: dict = {p: [] for p in peers}
    for (case, pass_), impls in rows.items():
        if TORCHKIT not in impls:
            continue
        t, extra = impls[TORCHKIT]
        cells = [case, pass_, f"{_time(t)}, {_bytes(extra.get('peak_bytes'))}{_rate(t, extra)}{_notes(extra)}"]
        if has_roofline:
            if ROOFLINE in impls:
                rt, rextra = impls[ROOFLINE]
                cells.append(f"**{rt / t:.2f}×** ({_time(rt)}{_rate(rt, rextra)})")
            else:
                cells.append("–")
        for peer in peers:
            if peer in impls:
                pt, pextra = impls[peer]
                cells.append(f"**{pt / t:.2f}×** ({_time(pt)}, {_bytes(pextra.get('peak_bytes'))}{_notes(pextra)})")
                ratios[peer].append(pt / t)
            else:
                cells.append("–")
                ratios[peer].append(None)
        lines.append("| " + " | ".join(cells) + " |")
    labels = [f"{c}, {p}" for (c, p), i in rows.items() if TORCHKIT in i]
    return "\n".join(lines), labels, ratios


def chart(op: str, labels: list[str], ratios: dict, out: Path) -> None:
    """Horizontal bars, one group per (case, pass), one bar per peer with its value written at
    its end; the logarithmic axis spans the ratios the peers reached (1× always shown)."""
    values = [v for vs in ratios.values() for v in vs if v is not None]
    if not values:
        return
    height = 0.8 / max(len(ratios), 1)
    bars_height = 0.2 * len(labels) * max(len(ratios), 1)
    fig, ax = plt.subplots(figsize=(9, 1.6 + bars_height))
    for k, (peer, ratio) in enumerate(ratios.items()):
        ys = [i + k * height for i, v in enumerate(ratio) if v is not None]
        shown = [v for v in ratio if v is not None]
        bars = ax.barh(ys, shown, height, label=peer)
        ax.bar_label(bars, [f"{v:.2f}×" for v in shown], padding=2, fontsize=8)
    low, high = min(min(values), 1.0) / 1.25, max(max(values), 1.0) * 1.6  # room for the value labels
    ax.set_xscale("log")
    ax.set_xlim(low, high)
    ticks = [t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if low <= t <= high]
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda t, _: f"{t:g}×"))
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks([i + height * (len(ratios) - 1) / 2 for i in range(len(labels))], labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.1, -0.3)  # the run's order, top to bottom
    ax.set_xlabel("peer time / torchkit time (above 1×, torchkit is faster)")
    ax.set_title(f"torchkit.{op}", pad=24)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=min(len(ratios), 4), frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _machine(machine: dict) -> str:
    cpu = machine.get("cpu", {}).get("brand_raw", machine.get("processor", "?"))
    gpu = f"{machine['gpu']}, " if machine.get("gpu") else ""
    torch_version = f", torch {machine['torch']}" if machine.get("torch") else ""
    contended = "; one other CPU-bound process running throughout" if machine.get("contended") else ""
    return f"{gpu}{cpu}, {machine.get('cpu', {}).get('count', '?')} cores{torch_version}{contended}"


def report(src: Path, image_dir: str = "", heading: str = "###", charts: bool = True) -> str:
    """The Markdown tables of one run, each with its chart (written next to the JSON unless
    `charts` is False) linked through `image_dir`: the charts' folder as seen from the page."""
    ops, machine = load(src)
    parts = [f"Machine: {_machine(machine)}; ratios are peer time / torchkit time.\n"]
    for op, rows in ops.items():
        md, labels, ratios = table(op, rows)
        note = " (torchkit: its staged Triton kernels, `TORCHKIT_CUDA_KERNELS=triton`)" if _staged(rows) else ""
        parts.append(f"{heading} {op}{note}\n\n{md}\n")
        png = src.with_name(f"{src.stem}_{op}.png")
        if charts:
            chart(op, labels, ratios, png)
        parts.append(f"![{op}]({image_dir}{png.name})\n")
    return "\n".join(parts)


def _runs() -> list[tuple[str, Path]]:
    """The latest full runs the page reports: (title, JSON), CPU first."""
    runs = [
        ("CPU", RESULTS / "cpu.json"),
        ("CPU, under contention (`make bench CONTENDED=1`)", RESULTS / "cpu-contended.json"),
    ]
    runs += [(f"GPU ({p.parent.name})", p) for p in sorted(RESULTS.glob("*/gpu.json"))]
    return [(title, path) for title, path in runs if path.exists()]


def headline_cases(rows: dict) -> list[str]:
    """The op's cases marked `headline` in its benchmark file, in the run's order; its first
    case where the run marked none (its GPU cases, or a run from before marks were recorded)."""
    marked = [c for (c, _), impls in rows.items() if any(extra.get("headline") for _, extra in impls.values())]
    return list(dict.fromkeys(marked)) or [next(iter(rows))[0]]


def headline(runs: list[tuple[str, Path]]) -> str:
    """Per op and machine: the run's headline cases of the op, forward+backward where it has
    one, against every peer."""
    lines = ["| op | machine | case | pass | torchkit | speed-up over |", "|---|---|---|---|---|---|"]
    by_op: dict = defaultdict(list)
    for title, path in runs:
        if "contention" in title:
            continue
        ops, machine = load(path)
        cpu = machine.get("cpu", {})
        label = machine.get("gpu") or f"{cpu.get('brand_raw', 'CPU')}, {cpu.get('count', '?')} cores"
        for op, rows in ops.items():
            staged = " (staged Triton)" if _staged(rows) else ""
            for case in headline_cases(rows):
                passes = [p for c, p in rows if c == case and TORCHKIT in rows[(c, p)]]
                pass_ = "forward+backward" if "forward+backward" in passes else passes[0]
                impls = rows[(case, pass_)]
                t = impls[TORCHKIT][0]
                peers = ", ".join(
                    f"{peer} {pt / t:.2f}×" for peer, (pt, _) in impls.items() if peer not in (TORCHKIT, ROOFLINE)
                )
                by_op[op].append(f"| `{op}` | {label} | {case} | {pass_} | {_time(t)}{staged} | {peers} |")
    for op in sorted(by_op):
        lines += by_op[op]
    return "\n".join(lines)


def write_page() -> None:
    """benchmarks/RESULTS.md from the latest runs, and README's headline table."""
    runs = _runs()
    parts = [
        "# Benchmark results\n",
        "Generated by `benchmarks/report.py` from the latest full runs: `make bench` (CPU),",
        "`make bench CONTENDED=1`, `make gpu-check` (GPU), `benchmarks/distributed_knn.py` and",
        "`benchmarks/distributed_pair_losses.py`.",
        "Do not edit by hand.\n",
        COLUMNS + "\n",
        "## Headlines\n",
        headline(runs) + "\n",
    ]
    for title, path in runs:
        image_dir = path.parent.relative_to(BENCHMARKS).as_posix() + "/"
        parts += [f"## {title}\n", report(path, image_dir, heading="###", charts=False)]
    for name in ("cpu-distributed.md", "cpu-distributed-losses.md"):
        distributed = RESULTS / name
        if distributed.exists():
            text = distributed.read_text().split("\n", 1)
            parts += [f"## {text[0].lstrip('# ')}\n", text[1].strip() + "\n"]
    (BENCHMARKS / "RESULTS.md").write_text("\n".join(parts))
    if README.exists():
        text = README.read_text()
        if HEADLINE_BEGIN in text and HEADLINE_END in text:
            before, rest = text.split(HEADLINE_BEGIN, 1)
            after = rest.split(HEADLINE_END, 1)[1]
            README.write_text(f"{before}{HEADLINE_BEGIN}\n{headline(runs)}\n{HEADLINE_END}{after}")
    print(f"written: {BENCHMARKS / 'RESULTS.md'} and README's headline table")


def main(path: str) -> None:
    src = Path(path)
    if not load(src)[0]:
        sys.exit(f"{src}: no benchmarks recorded")
    text = report(src)
    src.with_suffix(".md").write_text(text)
    print(text)
    print(f"written: {src.with_suffix('.md')} and its charts")
    write_page()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    write_page() if sys.argv[1] == "--page" else main(sys.argv[1])
