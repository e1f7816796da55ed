"""Turn a pytest-benchmark JSON file into the ratio report.

    python benchmarks/report.py benchmarks/results/cpu.json

Prints, per op, one Markdown table: each (case, pass) row gives torchkit's median time, peak
extra memory and throughput (TFLOP/s or GB/s of the work the case cannot avoid), torchkit's
time as a multiple of the roofline's (the machine's own primitive doing that work, timed in
the same run: ≥ 1, and 1 is the limit), and for every peer the ratio peer median / torchkit
median (> 1: torchkit is faster), with accuracy (cdist) and bytes saved for backward
(bilinear_pool) where the benchmark recorded them. Writes the same Markdown next to the JSON
(<name>.md) and one PNG bar chart per op (<name>_<op>.png).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

TORCHKIT = "torchkit"
ROOFLINE = "roofline"  # benchmarks/common.py


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
    """{op: {(case, pass): {impl: (median seconds, extra_info)}}}, in the order the run made them."""
    data = json.loads(path.read_text())
    ops: dict = defaultdict(dict)
    for bench in data["benchmarks"]:
        extra = bench["extra_info"]
        row = ops[extra["op"]].setdefault((extra["case"], extra["pass_"]), {})
        row[extra["impl"]] = (bench["stats"]["median"], extra)
    return ops, data.get("machine_info", {})


def table(op: str, rows: dict) -> tuple[str, list[str], dict]:
    peers = [i for i in dict.fromkeys(i for r in rows.values() for i in r) if i not in (TORCHKIT, ROOFLINE)]
    has_roofline = any(ROOFLINE in r for r in rows.values())
    head = [
        "case",
        "pass",
        "torchkit (median, peak extra memory, throughput)",
        *(["torchkit ÷ roofline (roofline median, throughput)"] if has_roofline else []),
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
                cells.append(f"**{t / rt:.2f}×** ({_time(rt)}{_rate(rt, rextra)})")
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
    labels = [f"{c}\n{p}" for (c, p), i in rows.items() if TORCHKIT in i]
    return "\n".join(lines), labels, ratios


def chart(op: str, labels: list[str], ratios: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4.5))
    width = 0.8 / max(len(ratios), 1)
    for k, (peer, values) in enumerate(ratios.items()):
        xs = [i + k * width for i, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width, label=peer)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks([i + width * (len(ratios) - 1) / 2 for i in range(len(labels))], labels, fontsize=7)
    ax.set_ylabel("speed-up of torchkit (peer time / torchkit time)")
    ax.set_title(f"torchkit.{op}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(path: str) -> None:
    src = Path(path)
    ops, machine = load(src)
    if not ops:
        sys.exit(f"{src}: no benchmarks recorded")
    cpu = machine.get("cpu", {}).get("brand_raw", machine.get("processor", "?"))
    gpu = f"{machine['gpu']}, " if machine.get("gpu") else ""
    torch_version = f", torch {machine['torch']}" if machine.get("torch") else ""
    contended = "; one other CPU-bound process running throughout" if machine.get("contended") else ""
    parts = [
        f"Machine: {gpu}{cpu}, {machine.get('cpu', {}).get('count', '?')} cores{torch_version}{contended}; "
        "ratios are peer time / torchkit time.\n"
    ]
    for op, rows in ops.items():
        md, labels, ratios = table(op, rows)
        parts.append(f"### {op}\n\n{md}\n")
        png = src.with_name(f"{src.stem}_{op}.png")
        chart(op, labels, ratios, png)
        parts.append(f"![{op}]({png.name})\n")
    report = "\n".join(parts)
    src.with_suffix(".md").write_text(report)
    print(report)
    print(f"written: {src.with_suffix('.md')} and {len(ops)} chart(s) next to it")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
