"""Check a CUDA build on a machine without a GPU: it imports from the CUDA build directory,
reports the CUDA version torch uses, and every torchkit op that takes a tensor has a CUDA
kernel registered with the dispatcher. (Ops without tensor arguments, such as _cuda_version,
cannot dispatch by device and are catch-all kernels.)"""

import sys
from pathlib import Path

import torch

import torchkit

BUILD = Path(__file__).resolve().parent.parent / "build" / "cuda"


def main() -> None:
    info = torchkit.build_info()
    print(f"torchkit from {Path(torchkit.__file__).parent}\n  build_info: {info}")
    if BUILD not in Path(torchkit.__file__).resolve().parents:
        sys.exit(f"FAIL: imported torchkit from {torchkit.__file__}, not from the CUDA build in {BUILD}")
    torch_cuda = ".".join(torch.version.cuda.split(".")[:2])
    if info["cuda"] != torch_cuda:
        sys.exit(f"FAIL: build_info()['cuda'] is {info['cuda']}, torch uses CUDA {torch_cuda}")

    coverage = torchkit.kernels("cuda")
    for name, has in coverage.items():
        if has is None:
            what = "catch-all (no tensor arguments)"
        else:
            what = "yes" if has else ("none yet (CPU_ONLY)" if name in torchkit.CPU_ONLY else "MISSING")
            what = f"CUDA kernel: {what}"
        print(f"  {name:45s} {what}")
    missing = [name for name, has in coverage.items() if has is False and name not in torchkit.CPU_ONLY]
    if missing:
        sys.exit(f"FAIL: no CUDA kernel for {', '.join(missing)}")
    assert torchkit.has_ops("cuda")
    print(f"OK: {len(coverage)} torchkit ops, every tensor op but the CPU_ONLY ones has a CUDA kernel")


if __name__ == "__main__":
    main()
