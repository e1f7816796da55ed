"""torchkit: fused CPU and CUDA kernels for fine-grained vision and metric learning.

Ops (``torchkit.ops``), their pure-PyTorch references (``torchkit.reference``),
drop-in modules (``torchkit.nn``), torchvision transforms (``torchkit.transforms``), retrieval
metrics (``torchkit.metrics``) and exact k-nearest neighbours across the ranks of a process
group (``torchkit.distributed``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import torch

__version__ = "0.1.0"

_PACKAGE = Path(__file__).resolve().parent


def _installed_elsewhere() -> Path | None:
    """Another torchkit package on sys.path than this one (an installed copy that this one,
    found first, shadows), or None."""
    for entry in sys.path:
        candidate = Path(entry or ".", "torchkit", "__init__.py")
        if candidate.is_file() and candidate.resolve().parent != _PACKAGE:
            return candidate.parent
    return None


def _not_built() -> str:
    """Why there is no extension to load, and what builds it."""
    root = _PACKAGE.parent
    other = _installed_elsewhere()
    if other is not None:
        return (
            f"torchkit: this import found the source tree's torchkit ({_PACKAGE}), which is not built, before "
            f"the installed one ({other}): Python looks in the current directory first. Run from another "
            f"directory, or build the source tree in place:\n    cd {root} && pip install --no-build-isolation -e ."
        )
    if (root / "setup.py").is_file():
        return (
            f"torchkit: its compiled extension is not built in {_PACKAGE}. Build it in place with\n"
            f"    cd {root} && pip install --no-build-isolation -e .     (or make build, which makes .venv too)"
        )
    return f"torchkit: its compiled extension is missing from {_PACKAGE}: reinstall torchkit from its source"


def _rebuild_command(record) -> str:
    """The one command that gives the installed torch a matching torchkit."""
    python = sys.executable or "python"
    source = Path(record.SOURCE)
    if record.IN_PLACE and (source / "setup.py").is_file():
        return f"cd {source} && {python} -m pip install --no-build-isolation -e ."
    if (source / "setup.py").is_file():
        return f"{python} -m pip install --no-build-isolation --no-deps --force-reinstall {source}"
    # Built from a copy that is gone (pip's temporary directory): the torch it was built for.
    return f"{python} -m pip install 'torch=={_release(record.TORCH)}'   (or rebuild torchkit from its source)"


def _release(version: str) -> str:
    return version.split("+")[0]


def _check_torch_version(record, installed: str) -> None:
    """Raise if the extension was compiled against another torch release than ``installed``:
    loading it would fail with an undefined C++ symbol (or, worse, load)."""
    if _release(record.TORCH) != _release(installed):
        raise ImportError(
            f"torchkit was built against torch {record.TORCH}, but torch {installed} is installed; its compiled "
            "extension works only with the torch it was built against. Rebuild it against the installed "
            f"torch:\n    {_rebuild_command(record)}"
        )


def _load_extension():
    """Check the build record (a plain Python file, so before any C++ is loaded), load the
    extension, and return the record."""
    if importlib.util.find_spec("torchkit._build") is None:
        raise ImportError(_not_built())
    from torchkit import _build

    _check_torch_version(_build, torch.__version__)
    try:
        from torchkit import _C  # noqa: F401  (registers torch.ops.torchkit.*)
    except ImportError as err:
        raise ImportError(
            f"torchkit's compiled extension torchkit._C could not be loaded: {err}\n"
            f"  built for torch {_build.TORCH}; installed: torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"Python {sys.version.split()[0]}\n"
            f"  Rebuild it with:\n    {_rebuild_command(_build)}"
        ) from err
    return _build


def _check_cuda_version(built: int, installed_cuda: str | None) -> None:
    """Raise if the extension's CUDA (e.g. 13020) is not the installed torch's (e.g. "13.2")."""
    if built == -1 or installed_cuda is None:
        return
    built_major, built_minor = built // 1000, (built % 1000) // 10
    installed = tuple(int(part) for part in installed_cuda.split(".")[:2])
    if (built_major, built_minor) != installed:
        raise ImportError(
            f"torchkit was compiled with CUDA {built_major}.{built_minor}, but the installed torch "
            f"{torch.__version__} uses CUDA {installed_cuda}. Rebuild it with:\n    {_rebuild_command(_BUILD)}"
        )


_BUILD = _load_extension()
_check_cuda_version(torch.ops.torchkit._cuda_version(), torch.version.cuda)

from torchkit import triton as _triton_path  # noqa: E402  (needs the ops registered above)

_triton_path.register()


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


# Ops with CPU kernels only, so far: their GPU kernels are still to be written. has_ops()
# leaves them out for other devices, kernels() reports them as they are, and their Python
# functions refuse CUDA tensors with a message saying so.
CPU_ONLY = frozenset(
    f"torchkit::{name}"
    for op in (
        "supcon_loss",
        "ntxent_loss",
        "contrastive_loss",
        "triplet_margin_loss",
        "multi_similarity_loss",
        "proxy_anchor_loss",
    )
    for name in (op, f"_{op}_backward")
)


def has_ops(device: str | torch.device = "cpu") -> bool:
    """Whether every torchkit op has a compiled kernel for ``device``'s type (``CPU_ONLY`` ops
    left out off the CPU): ``has_ops("cuda")`` is False for a CPU-only build."""
    cpu = torch.device(device).type == "cpu"
    return all(has is not False for name, has in kernels(device).items() if cpu or name not in CPU_ONLY)


def build_info() -> dict:
    """How the loaded extension was built.

    Returns a dict with ``torch`` (the version compiled against), ``cuda`` (e.g. ``"13.2"``,
    or ``None`` for a CPU-only build), ``architectures`` (list of GPU architectures, empty
    for CPU-only), ``compiler`` (the C++ compiler), ``cuda_compiler`` (nvcc or ``None``) and
    ``cuda_kernels``: each op → what serves its CUDA tensors, ``"cuda"`` (the build's CUDA C++
    kernel), ``"triton"`` (a Triton kernel: see ``TORCHKIT_CUDA_KERNELS`` in README) or ``None``;
    ``cuda_float32_products``: the products PyTorch's fp32-matmul setting selects now for
    float32 inputs of the Triton kernels under the CUDA precision contract (docs/ops.md):
    ``"3xTF32"`` (the default), ``"TF32"`` or ``"bfloat16"``.
    """
    raw = json.loads(torch.ops.torchkit._build_info())
    cuda = raw["cuda"]
    return {
        "torch": raw["torch"],
        "cuda": None if cuda == -1 else f"{cuda // 1000}.{(cuda % 1000) // 10}",
        "architectures": [a for a in raw["architectures"].replace(" ", ";").split(";") if a],
        "compiler": raw["compiler"],
        "cuda_compiler": raw["cuda_compiler"] or None,
        "cuda_kernels": _triton_path.serving(kernels("cuda")),
        "cuda_float32_products": _triton_path.float32_products(),
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
            f"torchkit.transforms needs torchvision (and Pillow): {err}. Install them beside this torch with: "
            f"pip install torchvision pillow 'torch=={_release(torch.__version__)}' (the torch pin stops pip from "
            "replacing it; for a CPU-only torch, add its index: --index-url https://download.pytorch.org/whl/cpu)"
        ) from err
