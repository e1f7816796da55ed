"""Check that every C++ and CUDA source compiles as C++17 against torch 2.8's headers.

torch 2.8, the oldest torch torchkit supports, builds extensions as C++17; later releases build
them as C++20, and their headers refuse C++17. So a C++20 feature in csrc (std::bit_cast,
std::span, designated initialisers...) passes every build with the torch that `make test`
installs and breaks the build for a user of torch 2.8. `make compat TORCH=2.8` finds it by
building and testing everything (about ten minutes, CPU sources only); this check parses each
source without generating code, in a minute or two, .cu files included:

  .cpp  g++ -std=c++17 -fsyntax-only, with the flags setup.py compiles with, after
        csrc/precompiled.h precompiled with the same flags, as setup.py does (a .cpp takes
        5-6 s with it, 15-20 s without; precompiling takes about 40 s, beside the .cu files)
  .cu   nvcc -std=c++17 -cuda (preprocessing and the CUDA front end, which parses host and
        device code; no device code is generated), with the nvcc given by --cuda-home

torch 2.8's headers come from its wheel (pip download, ~900 MB, no dependencies), extracted once
into --cache; the wheel itself is not kept. Exit status 1 if any source fails, with the errors.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
PRECOMPILED = CSRC / "precompiled.h"
FLOOR_TORCH = "2.8"


def setup_py():
    """setup.py as a module: its source list and the flags that change which code is parsed."""
    spec = importlib.util.spec_from_file_location("torchkit_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torch_headers(cache: Path) -> Path:
    """torch 2.8's include directory, downloaded and extracted into `cache` on the first call."""
    include = cache / "torch" / "include"
    if include.is_dir():
        return include
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, "--no-deps", "--only-binary=:all:", "--dest", tmp, f"torch=={FLOOR_TORCH}.*"], check=True)
        (wheel,) = Path(tmp).glob("torch-*.whl")
        staging = Path(tmp) / "headers"
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(staging, [m for m in zf.namelist() if m.startswith("torch/include/")])
        shutil.move(staging / "torch", cache / "torch")
    return include


def commands(include: Path, cuda_home: Path, header: Path) -> tuple[list[str], list[tuple[Path, list[str]]]]:
    """The command that precompiles csrc/precompiled.h as `header` (its .gch beside it), and
    a parse-only compiler command for every source setup.py builds (CPU with AVX2, and CUDA),
    the .cu files first: each takes nvcc 20-25 s where a .cpp takes g++ 5-6 s, so that the
    pool ends on short jobs rather than one core waiting on the last .cu."""
    setup = setup_py()
    facts = setup.build_facts(FLOOR_TORCH, "")
    includes = [f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}"]
    includes += [f"-I{sysconfig.get_paths()['include']}", f"-I{CSRC}"]
    cxx = [os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only", *setup.AVX2_FLAGS, *setup.OPENMP_FLAGS]
    nvcc = [str(cuda_home / "bin" / "nvcc"), "-std=c++17", "-cuda", *setup.NVCC_LANGUAGE_FLAGS]
    nvcc += [f"-I{cuda_home / 'include'}", "-o", os.devnull]
    cuda_cxx = [f"-I{cuda_home / 'include'}"]  # (the CUDA backend's .cpp files: c10/cuda's headers)
    flags = [*facts, *includes, *cuda_cxx]
    precompile = [c for c in cxx if c != "-fsyntax-only"]
    precompile += [*flags, "-x", "c++-header", str(header), "-o", f"{header}.gch"]
    cxx += ["-Winvalid-pch", "-include", str(header)]
    return precompile, [
        (src, [*(nvcc if src.suffix == ".cu" else cxx), *flags, str(src)])
        for src in sorted(setup.sources(use_cuda=True), key=lambda src: src.suffix != ".cu")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=ROOT / "build" / f"torch-{FLOOR_TORCH}-headers")
    parser.add_argument("--cuda-home", type=Path, required=True, help="a CUDA toolkit whose nvcc parses the .cu files")
    args = parser.parse_args()

    include = torch_headers(args.cache.resolve())
    failed = 0
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        header = Path(tmp) / PRECOMPILED.name
        header.write_text(PRECOMPILED.read_text())
        precompile, jobs = commands(include, args.cuda_home, header)
        precompiled = pool.submit(subprocess.run, precompile, capture_output=True, text=True)

        def run(job: tuple[Path, list[str]]) -> tuple[Path, subprocess.CompletedProcess]:
            src, cmd = job
            if src.suffix != ".cu":
                precompiled.result()  # (a failed one is only slower: g++ then parses the header as text)
            return src, subprocess.run(cmd, capture_output=True, text=True)

        for src, result in pool.map(run, jobs):
            name = src.relative_to(ROOT)
            if result.returncode == 0:
                print(f"  C++17 ok   {name}", flush=True)
            else:
                failed += 1
                output = (result.stdout + result.stderr).splitlines()
                print(f"  C++17 FAIL {name}\n    " + "\n    ".join(output[:40]), flush=True)
    if failed:
        sys.exit(f"{failed} of {len(jobs)} sources do not compile as C++17 against torch {FLOOR_TORCH}'s headers")
    print(f"all {len(jobs)} sources compile as C++17 against torch {FLOOR_TORCH}'s headers")


if __name__ == "__main__":
    main()
