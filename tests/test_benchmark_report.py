"""benchmarks/report.py: every ratio reads the same way, headline cases come from the marks."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the report draws charts (requirements-dev.txt)")
REPORT = Path(__file__).resolve().parent.parent / "benchmarks" / "report.py"


def load_report():
    spec = importlib.util.spec_from_file_location("benchmark_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def entry(op, case, pass_, impl, median, headline=None):
    extra = {"op": op, "case": case, "pass_": pass_, "impl": impl, "peak_bytes": 0}
    if headline is not None:
        extra["headline"] = headline
    return {"stats": {"median": median}, "extra_info": extra}


def write_run(path: Path, benchmarks: list) -> Path:
    path.write_text(json.dumps({"benchmarks": benchmarks, "machine_info": {"cpu": {"brand_raw": "CPU", "count": 2}}}))
    return path


def test_ratios_and_headlines(tmp_path):
    report = load_report()
    marked = write_run(
        tmp_path / "cpu.json",
        [
            entry("ce", "big", "forward+backward", "torchkit", 2.0, True),
            entry("ce", "big", "forward+backward", "peer", 6.0, True),
            entry("ce", "big", "forward+backward", "roofline", 1.0, True),
            entry("ce", "odd", "forward+backward", "torchkit", 1.0, False),
            entry("ce", "odd", "forward+backward", "peer", 1.0, False),
            entry("ce", "small", "forward", "torchkit", 1.0, True),
            entry("ce", "small", "forward", "peer", 0.5, True),
        ],
    )
    ops, _ = report.load(marked)
    md, labels, ratios = report.table("ce", ops["ce"])
    row = md.splitlines()[2]
    assert "**0.50×** (1 s" in row.replace("1e+03 ms", "1 s")  # roofline / torchkit, like the peers
    assert "**3.00×**" in row  # peer / torchkit
    assert labels == ["big, forward+backward", "odd, forward+backward", "small, forward"]
    assert ratios == {"peer": [3.0, 1.0, 0.5]}
    table = report.headline([("CPU", marked)])
    assert [line.split(" | ")[2] for line in table.splitlines()[2:]] == ["big", "small"]
    assert "peer 3.00×" in table and "peer 0.50×" in table and "roofline" not in table
    report.chart("ce", labels, ratios, tmp_path / "ce.png")
    assert (tmp_path / "ce.png").stat().st_size > 0
    # A run from before the marks were recorded: its first case.
    unmarked = write_run(tmp_path / "old.json", [entry("ce", "first", "forward", "torchkit", 1.0)])
    assert report.headline([("CPU", unmarked)]).splitlines()[2].split(" | ")[2] == "first"


def test_an_op_with_only_triton_kernels_is_reported_through_them(tmp_path):
    """A GPU run of the pair losses times their staged Triton kernels, not torchkit's (their
    only CUDA kernels): those are the op's row, marked staged; where torchkit has its own, the
    Triton kernels stay a column beside it."""
    report = load_report()
    run = write_run(
        tmp_path / "gpu.json",
        [
            entry("loss", "big", "forward+backward", "torchkit (triton)", 2.0, True),
            entry("loss", "big", "forward+backward", "peer", 4.0, True),
            entry("dist", "big", "forward", "torchkit", 1.0, True),
            entry("dist", "big", "forward", "torchkit (triton)", 3.0, True),
        ],
    )
    ops, _ = report.load(run)
    assert "**2.00×**" in report.table("loss", ops["loss"])[0].splitlines()[2]
    assert "**3.00×**" in report.table("dist", ops["dist"])[0].splitlines()[2]
    text = report.report(run, charts=False)
    assert "### loss (torchkit: its staged Triton kernels" in text and "### dist\n" in text
    table = report.headline([("GPU", run)])
    assert "2 s (staged Triton) | peer 2.00×" in table.replace("2e+03 ms", "2 s")
    assert "torchkit (triton) 3.00×" in table
