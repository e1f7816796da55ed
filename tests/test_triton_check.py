"""tools/triton_check.py's record of builds: a build is taken from it only under Triton's own
cache key of that build, which changes with the kernel's source, its options and its target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import triton_testing

ROOT = Path(__file__).resolve().parent.parent

# Run without the interpreter (which replaces @triton.jit), in a process of its own.
SCRIPT = textwrap.dedent(
    """
    import base64, importlib, json, os, sys
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[2], "tools")]
    import triton_check
    from triton.backends.compiler import GPUTarget

    def key(config=0, arch=90):
        case = importlib.import_module("probe").compile_cases()[0]
        config = case.configs[config]
        return triton_check.cache_key(triton_check.source_of(case, config), GPUTarget("cuda", arch, 32), config.options)

    facts = {}
    row = triton_check.compile_one(("probe", 0, 0, 90))
    facts["compiled"] = row["seconds"] is not None and row["registers"] > 0
    directory = base64.b32encode(bytes.fromhex(row["key"])).decode().rstrip("=")  # (how Triton names it)
    facts["is_triton_cache_key"] = directory in os.listdir(os.environ["TRITON_CACHE_DIR"])
    triton_check.RECORDED[row["key"]] = {**row, "registers": -1}
    again = triton_check.compile_one(("probe", 0, 0, 90))
    facts["taken_from_record"] = again["seconds"] is None and again["registers"] == -1
    facts["options_change_it"] = key(config=1) != row["key"]
    facts["target_changes_it"] = key(arch=80) != row["key"]
    path = os.path.join(sys.argv[1], "probe.py")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace("x + 1.0", "x + 2.0"))
    importlib.invalidate_caches()
    sys.modules.pop("probe")
    facts["source_changes_it"] = key() != row["key"]
    with open(path, "w") as f:
        f.write(text.replace("return x + 1.0", "return 1.0 + x"))
    sys.modules.pop("probe")
    facts["a_called_function_changes_it"] = key() != row["key"]
    print(json.dumps(facts))
    """
)

PROBE = textwrap.dedent(
    """
    import triton
    import triton.language as tl
    from torchkit.triton._launch import CompileCase, Config

    @triton.jit
    def _plus(x):
        return x + 1.0

    @triton.jit
    def probe_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out_ptr + i, _plus(tl.load(x_ptr + i)))

    def compile_cases():
        types = {"x_ptr": "*fp32", "out_ptr": "*fp32"}
        configs = (Config(BLOCK=128, num_warps=4), Config(BLOCK=128, num_warps=8))
        return [CompileCase("probe", probe_kernel, types, {}, configs)]
    """
)


@pytest.mark.skipif(triton_testing.available(interpreted=False) is not None, reason="no compilable Triton")
def test_a_build_is_taken_from_the_record_only_under_its_own_cache_key(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), str(ROOT)], env=env, capture_output=True, text=True, check=True
    )
    facts = json.loads(out.stdout.splitlines()[-1])
    assert facts == dict.fromkeys(facts, True) and len(facts) == 7, facts
