"""Provide an nvcc that matches the installed torch, for CUDA builds on machines without a GPU.

Installs NVIDIA's PyPI compiler packages for the CUDA major.minor that torch was built with,
makes `-lcudart` resolve (the runtime wheel ships only libcudart.so.<major>), and prints the
CUDA_HOME to build with. A system toolkit of another minor version fails against torch's
headers ("CUDA compiler and CUDA toolkit headers are incompatible"), so it is never used.
Idempotent: a second run installs nothing.

Each package is taken at the exact version of the CUDA runtime torch was installed with where
NVIDIA published one, otherwise at the newest release of the same major.minor: the packages
are versioned independently (with runtime 13.0.96 there is no nvcc 13.0.96, only 13.0.48 and
13.0.88), and only major.minor must agree with torch's headers.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

from packaging.version import InvalidVersion, Version

# nvcc; its device-code back end; the CUDA C++ headers it includes (crt/); CCCL (libcu++,
# CUB, Thrust), which cuda_fp16.h includes as <nv/target>.
PACKAGES = ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-cccl")


def choose_version(cuda: str, runtime: str | None, available: list[str]) -> str:
    """The version of one package to install: `runtime` itself if it is among `available`,
    otherwise the newest final release of `available` with the major.minor of `cuda`."""
    want = Version(cuda).release[:2]
    if runtime is not None and runtime in available:
        return runtime
    candidates = []
    for v in available:
        try:
            parsed = Version(v)
        except InvalidVersion:
            continue
        if parsed.release[:2] == want and not parsed.is_prerelease:
            candidates.append(parsed)
    if not candidates:
        raise LookupError(f"no release for CUDA {want[0]}.{want[1]} among {', '.join(available) or 'none'}")
    return str(max(candidates))


def available_versions(package: str) -> list[str]:
    """The versions the configured index offers (`pip index versions`)."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", package, "--disable-pip-version-check"],
        capture_output=True,
        text=True,
    )
    match = re.search(r"Available versions:\s*(.+)", out.stdout)
    if out.returncode != 0 or match is None:
        sys.exit(f"cannot list the versions of {package} on the package index:\n{out.stdout}{out.stderr}")
    return [v.strip() for v in match.group(1).split(",")]


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    import torch

    if torch.version.cuda is None:
        sys.exit(f"torch {torch.__version__} is a CPU-only build: install the CUDA build of torch first")
    cuda = Version(torch.version.cuda)
    runtime = installed_version("nvidia-cuda-runtime")
    wanted = []
    for name in PACKAGES:
        have = installed_version(name)
        if have is None or Version(have).release[:2] != cuda.release[:2]:
            wanted.append(f"{name}=={choose_version(torch.version.cuda, runtime, available_versions(name))}")
    if wanted:
        print(f"installing {' '.join(wanted)}", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *wanted],
            check=True,
        )

    import nvidia  # namespace package of the NVIDIA wheels

    cuda_home = next(Path(p) / f"cu{cuda.major}" for p in nvidia.__path__ if (Path(p) / f"cu{cuda.major}").is_dir())
    nvcc = cuda_home / "bin" / "nvcc"
    if not nvcc.exists():
        sys.exit(f"no nvcc at {nvcc} after installing {' '.join(wanted)}")
    lib = cuda_home / "lib"
    runtime_lib = lib / f"libcudart.so.{cuda.major}"
    link = lib / "libcudart.so"
    if not runtime_lib.exists():
        sys.exit(f"no CUDA runtime at {runtime_lib}: is nvidia-cuda-runtime installed?")
    if not link.exists():
        link.symlink_to(runtime_lib.name)
    print(cuda_home)


if __name__ == "__main__":
    main()
