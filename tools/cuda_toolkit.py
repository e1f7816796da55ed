"""Provide an nvcc that matches the installed torch, for CUDA builds on machines without a GPU.

Installs NVIDIA's PyPI compiler packages pinned to the CUDA runtime that torch depends on,
makes `-lcudart` resolve (the runtime wheel ships only libcudart.so.<major>), and prints the
CUDA_HOME to build with. A system toolkit of another minor version fails against torch's
headers ("CUDA compiler and CUDA toolkit headers are incompatible"), so it is never used.
Idempotent: a second run installs nothing.
"""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import torch
from packaging.version import Version

PACKAGES = ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt")


def main() -> None:
    if torch.version.cuda is None:
        sys.exit(f"torch {torch.__version__} is a CPU-only build: install the CUDA build of torch first")
    cuda = Version(torch.version.cuda)
    # The exact runtime version torch was installed with (e.g. 13.2.86); its major.minor otherwise.
    try:
        pin = "==" + importlib.metadata.version("nvidia-cuda-runtime")
    except importlib.metadata.PackageNotFoundError:
        pin = f"=={cuda.major}.{cuda.minor}.*"
    wanted = [name + pin for name in PACKAGES]
    installed = []
    for name in PACKAGES:
        try:
            installed.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            installed.append(None)
    if any(have is None or Version(have.split("==")[1]).release[:2] != cuda.release[:2] for have in installed):
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
    runtime = lib / f"libcudart.so.{cuda.major}"
    link = lib / "libcudart.so"
    if not runtime.exists():
        sys.exit(f"no CUDA runtime at {runtime}: is nvidia-cuda-runtime installed?")
    if not link.exists():
        link.symlink_to(runtime.name)
    print(cuda_home)


if __name__ == "__main__":
    main()
