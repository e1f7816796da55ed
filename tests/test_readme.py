"""README's quick start runs as written, in a fresh interpreter."""

import re
from pathlib import Path

from testing import run_python

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quick_start_runs():
    section = README.read_text().split("## Quick start", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)[1]
    run = run_python(code)
    assert run.returncode == 0, run.stderr[-3000:]
    recall = run.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\{1: [0-9.]+, 2: [0-9.]+, 4: [0-9.]+, 8: [0-9.]+\}", recall), recall
