"""torchkit: fused CPU and CUDA kernels for fine-grained vision and metric learning.

Ops (``torchkit.ops``), their pure-PyTorch references (``torchkit.reference``),
drop-in modules (``torchkit.nn``), torchvision transforms (``torchkit.transforms``), retrieval
metrics (``torchkit.metrics``) and exact k-nearest neighbours across the ranks of a process
group (``torchkit.distributed``).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch

__version__ = "0.1.0"

_REBUILD = f"cd {Path(__file__).resolve().parent.parent} && make build  (or: pip install --no-build-isolation -e .)"


def _load_extension() -> None:
    try:
        from torchkit import _C  # noqa: F401  (registers torch.ops.torchkit.*)
    except ImportError as err:
        raise ImportError(
            f"torchkit's compiled extension torchkit._C could not be loaded: {err}\n"
            f"  installed: torch {torch.__version__} (CUDA {torch.version.cuda}), Python {sys.version.split()[0]}\n"
            "  The extension is missing or was built against another torch/CUDA. Rebuild it with:\n"
            f"    {_REBUILD}"
        ) from err


def _check_cuda_version(built: int, installed_cuda: str | None) -> None:
    """Raise if the extension's CUDA (e.g. 13020) is not the installed torch's (e.g. "13.2")."""
    if built == -1 or installed_cuda is None:
        return
    built_major, built_minor = built // 1000, (built % 1000) // 10
    installed = tuple(int(part) for part in installed_cuda.split(".")[:2])
    if (built_major, built_minor) != installed:
        raise ImportError(
            f"torchkit was compiled with CUDA {built_major}.{built_minor}, but the installed torch "
            f"{torch.__version__} uses CUDA {installed_cuda}. Rebuild it with:\n    {_REBUILD}"
        )


_load_extension()
_check_cuda_version(torch.ops.torchkit._cuda_version(), torch.version.cuda)


def kernels(device: str | torch.device = "cpu") -> dict[str, bool | None]:
    """Each ``torchkit::`` op the dispatcher knows and whether it has a kernel for ``device``'s
    type (None for an op without tensor arguments: one kernel serves every device)."""
    key = torch.device(device).type.upper()
    out: dict[str, bool | None] = {}
    for name in sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("torchkit::")):
        schema = torch._C._get_schema(name, "")
        takes_tensor = any("Tensor" in str(arg.type) for arg in schema.arguments)
        out[name] = torch._C._dispatch_has_kernel_for_dispatch_key(name, key) if takes_tensor else None
    return out


def has_ops(device: str | torch.device = "cpu") -> bool:
    """Whether every torchkit op has a compiled kernel for ``device``'s type: ``has_ops("cuda")``
    is False for a CPU-only build."""
    return all(has is not False for has in kernels(device).values())


def build_info() -> dict:
    """How the loaded extension was built.

    Returns a dict with ``torch`` (the version compiled against), ``cuda`` (e.g. ``"13.2"``,
    or ``None`` for a CPU-only build), ``architectures`` (list of GPU architectures, empty
    for CPU-only), ``compiler`` (the C++ compiler) and ``cuda_compiler`` (nvcc or ``None``).
    """
    raw = json.loads(torch.ops.torchkit._build_info())
    cuda = raw["cuda"]
    return {
        "torch": raw["torch"],
        "cuda": None if cuda == -1 else f"{cuda // 1000}.{(cuda % 1000) // 10}",
        "architectures": [a for a in raw["architectures"].replace(" ", ";").split(";") if a],
        "compiler": raw["compiler"],
        "cuda_compiler": raw["cuda_compiler"] or None,
    }


from torchkit import distributed, metrics, nn, ops, reference  # noqa: E402

__all__ = [
    "__version__",
    "build_info",
    "distributed",
    "has_ops",
    "kernels",
    "metrics",
    "nn",
    "ops",
    "reference",
    "transforms",
]


def __getattr__(name: str):
    """``torchkit.transforms`` on first use: it needs torchvision, which nothing else does."""
    if name != "transforms":
        raise AttributeError(f"module 'torchkit' has no attribute {name!r}")
    try:
        return importlib.import_module("torchkit.transforms")
    except ImportError as err:
        raise ImportError(
            f"torchkit.transforms needs torchvision (and Pillow): {err}. "
            "Install them with: pip install 'torchkit[vision]'"
        ) from err
