"""Compile every Triton kernel of torchkit for sm_80 and sm_90 without a GPU (make triton-check).

For each kernel module of torchkit.triton (its compile_cases()), each case and configuration:
triton.compile to PTX and cubin, registers and spills from the log of the ptxas -v run that
made the cubin, the shared memory the kernel asks for, and the matrix instruction its tl.dot
became. Each is compiled for its newest architecture first, then for the older ones only where
that build has matrix instructions (mma, wgmma): those are lowered per architecture, while a
kernel without them is the same code for either target (its shared memory is checked against
every architecture's limit). Fails on a compile error, on
spills above --max-spill bytes, on shared memory past the architecture's limit, and where a
case meant for tensor cores has no mma/wgmma. Prints a table. Compiled kernels are cached
under build/triton-cache (TRITON_CACHE_DIR), their ptxas usage beside them (USAGE_DIR), so a
rerun with nothing changed takes seconds.

Each build's facts are recorded in RECORD (committed with a kernel change, as the model's
counts are), under Triton's own cache key of that build: the hash of Triton itself, the
kernel's source with every function it calls and global it reads (and their line numbers,
which the code's debug information holds: an edit above a kernel moves them), the specialisation, the
options, the target with its ptxas, and the environment variables Triton says change code. A
build whose key is recorded is not compiled again: its code would be the same, byte for byte,
as Triton's own cache assumes. So a fresh clone compiles only what changed since the record
(all of it under another Triton), and the rewritten record shows which kernels' registers,
spills or shared memory moved.
Must run without TRITON_INTERPRET (the interpreter replaces @triton.jit).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHS = (80, 90)
# The most shared memory one block may use: 163 KB on sm_80 (A100), 227 KB on sm_90 (H100).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
# Registers and spills of each compiled PTX, by its hash, under the Triton cache: a cache hit
# compiles nothing, so Triton's ptxas log is only there on the first compile.
USAGE_DIR = "torchkit-ptxas-usage"
RECORD = ROOT / "benchmarks" / "results" / "triton-check.json"
FACTS = ("registers", "spill", "shared", "instruction")  # what a build's record keeps
RECORDED: dict[str, dict] = {}  # RECORD's builds by key, in each worker (_read_record)


def _read_record(path: str) -> None:
    if os.path.exists(path):
        with open(path) as f:
            RECORDED.update((row["key"], row) for row in json.load(f)["builds"])


def _write_record(path: Path, rows: list[dict]) -> bool:
    """RECORD rewritten with `rows`' builds (a line each, in the check's order) where that
    changes it; whether it did."""
    import triton

    fields = ("key", "case", "config", "arch", *FACTS)
    builds = [{k: row[k] for k in fields} for row in rows if row.get("key")]
    lines = ",\n".join("  " + json.dumps(build) for build in builds)
    text = f'{{"triton": {json.dumps(triton.__version__)}, "builds": [\n{lines}\n]}}\n'
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


def cache_key(source, target, options) -> str | None:
    """Triton's cache key of compiling `source` for `target` with `options`, as triton.compile
    computes it (the name of that build's directory in Triton's cache); None where this Triton
    computes it otherwise (then the build is compiled, never taken from the record)."""
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.compiler.compiler import make_backend
        from triton.runtime.cache import get_cache_key

        backend = make_backend(target)
        parsed = backend.parse_options(dict(options or {}, **source.parse_options()))
        key = get_cache_key(source, backend, parsed, get_cache_invalidating_env_vars())
    except (ImportError, AttributeError, TypeError):
        return None
    return hashlib.sha256(key.encode()).hexdigest()


def source_of(case, config):
    """What triton.compile builds for `case` with `config`: its ASTSource."""
    from triton.compiler import ASTSource

    fn = case.kernel
    constants = {**case.constexprs, **config.kwargs}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants[name]
        else:
            signature[name] = case.types[name]
            if case.types[name].startswith("*") or name in case.divisible:
                attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations are 16-byte aligned
    return ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)


def compile_one(job):
    """Compile case `index` of module `module` with configuration `c` for `arch` (or take its
    facts from RECORDED): a row of the table, or the error."""
    module, index, c, arch = job
    import triton
    from triton.backends.compiler import GPUTarget

    case = importlib.import_module(module).compile_cases()[index]
    config = case.configs[c]
    row = dict(case=case.name, config=repr(config).removeprefix("Config(").removesuffix(")"), arch=f"sm_{arch}")
    started = time.time()
    # Triton runs ptxas -v to make the cubin and prints its log where asked: the registers and
    # spills of the very build a launch gets, without running ptxas a second time.
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    log = io.StringIO()
    try:
        source = source_of(case, config)
        target = GPUTarget("cuda", arch, 32)
        row["key"] = cache_key(source, target, config.options)
        if row["key"] in RECORDED:
            return {**row, **{k: RECORDED[row["key"]][k] for k in FACTS}, "seconds": None}
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(source, target=target, options=config.options)
    except Exception as err:  # reported in the table, then fails the check
        row["error"] = f"{type(err).__name__}: {err}"
        return row
    ptx = compiled.asm["ptx"]
    row["seconds"] = time.time() - started
    row["shared"] = int(compiled.metadata.shared)
    row["instruction"] = "wgmma" if "wgmma.mma_async" in ptx else ("mma" if re.search(r"\bmma\.sync", ptx) else "fma")
    row.update(usage_of(ptx, arch, log.getvalue()))
    return row


def usage_of(ptx: str, arch: int, log: str) -> dict:
    """Registers and spills of `ptx`: from Triton's ptxas log where it compiled just now (kept
    under USAGE_DIR), else as kept, else from a ptxas run of our own (a kernel Triton's cache
    held before this check first ran)."""
    kept = Path(os.environ["TRITON_CACHE_DIR"], USAGE_DIR, hashlib.sha256(f"{arch} {ptx}".encode()).hexdigest())
    if "Used" in log:
        usage = parse_ptxas_log(log)
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_suffix(f".{os.getpid()}")
        tmp.write_text(json.dumps(usage))
        os.replace(tmp, kept)  # whole, whichever process writes it
        return usage
    if kept.exists():
        return json.loads(kept.read_text())
    return ptxas_usage(ptx, arch)


def parse_ptxas_log(text: str) -> dict:
    registers = max((int(m) for m in re.findall(r"Used (\d+) registers", text)), default=0)
    spills = sum(int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text))
    return {"registers": registers, "spill": spills}


def ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers and spill bytes from `ptxas -v` on the PTX, for the architecture it targets."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(arch)
    except TypeError:  # Triton before 3.5 takes no architecture
        ptxas = get_ptxas()
    ptxas = getattr(ptxas, "path", ptxas)
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        out = subprocess.run(
            [ptxas, "-v", f"-arch={target}", str(src), "-o", str(Path(tmp, "k.cubin"))],
            capture_output=True,
            text=True,
            check=True,
        )
    return parse_ptxas_log(out.stderr + out.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--max-spill",
        type=int,
        default=512,
        help="spill bytes (stores + loads) per kernel above which the check fails (default 512)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--record",
        type=Path,
        default=RECORD,
        help=f"the builds' record, read and rewritten (default {RECORD.relative_to(ROOT)})",
    )
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("triton_check: TRITON_INTERPRET=1 replaces @triton.jit by the interpreter; unset it", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_CACHE_DIR", str(ROOT / "build" / "triton-cache"))
    from torchkit import triton as triton_path

    newest, older = [], []
    for op in triton_path.TRITON_KERNELS:
        module = f"torchkit.triton.{op}"
        for index, case in enumerate(importlib.import_module(module).compile_cases()):
            archs = [arch for arch in ARCHS if arch in case.archs]
            for c in range(len(case.configs)):
                newest.append((module, index, c, archs[-1]))
                older += [(module, index, c, arch) for arch in archs[:-1]]
    started = time.time()
    pool = ProcessPoolExecutor(max_workers=max(1, args.jobs), initializer=_read_record, initargs=(str(args.record),))
    with pool:
        rows = list(pool.map(compile_one, newest))
        matrix = {job[:3] for job, row in zip(newest, rows, strict=True) if row.get("instruction", "fma") != "fma"}
        left_out = len(older)
        older = [job for job in older if job[:3] in matrix]
        left_out -= len(older)
        rows += list(pool.map(compile_one, older))
    jobs = newest + older
    failures = []
    header = (
        f"{'kernel':<34} {'configuration':<58} {'arch':<6} {'regs':>5} {'spill':>6} {'smem':>7} {'instr':<6} {'s':>5}"
    )
    print(header)
    print("-" * len(header))
    for job, row in zip(jobs, rows, strict=True):
        module, index, _, arch = job
        if "error" in row:
            print(f"{row['case']:<34} {row['config']:<58} {row['arch']:<6} ERROR")
            failures.append(f"{row['case']} [{row['config']}] {row['arch']}: {row['error']}")
            continue
        seconds = "rec" if row["seconds"] is None else f"{row['seconds']:.1f}"
        print(
            f"{row['case']:<34} {row['config']:<58} {row['arch']:<6} {row['registers']:>5} {row['spill']:>6} "
            f"{row['shared']:>7} {row['instruction']:<6} {seconds:>5}"
        )
        case = importlib.import_module(module).compile_cases()[index]
        where = f"{row['case']} [{row['config']}] {row['arch']}"
        if row["spill"] > args.max_spill:
            failures.append(f"{where}: {row['spill']} bytes of spills > {args.max_spill}")
        # (a kernel without matrix instructions, compiled for the newest only: every one's limit)
        limit = SHARED_LIMIT[arch] if job[:3] in matrix else min(SHARED_LIMIT[a] for a in case.archs)
        if row["shared"] > limit:
            failures.append(f"{where}: {row['shared']} bytes of shared memory > the {limit} an SM has")
        if case.tensor_cores and row["instruction"] == "fma":
            failures.append(f"{where}: meant for tensor cores, but its PTX has no mma or wgmma")
    recorded = sum(1 for row in rows if "error" not in row and row["seconds"] is None)
    print(
        f"\n{len(rows)} builds in {time.time() - started:.0f} s: {len(rows) - recorded} compiled, "
        f"{recorded} as recorded in {args.record.name} ({left_out} builds for an older architecture left out: "
        f"no matrix instructions; cache: {os.environ['TRITON_CACHE_DIR']})"
    )
    # (not where a build failed, or where this Triton's cache keys are not known: they would be lost)
    if not failures and all(row.get("key") for row in rows) and _write_record(args.record, rows):
        print(f"{args.record} rewritten: commit it with the kernels")
    for failure in failures:
        print("FAIL", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
