"""Which kernel serves each op's CUDA tensors: the build's CUDA C++ kernel or a Triton kernel.

An op with Triton kernels has a module here named after it (``torchkit/triton/cdist.py``) or
its family (the package ``pair_losses/``), imported only when a tensor reaches one of its kernels: torch
alone still imports torchkit, and Triton is needed only where it runs. The schema, the CPU
kernel and autograd stay in C++ (or Python, for the pair losses); a Triton kernel is registered
from Python as the op's CUDA kernel, and the autograd kernel redispatches into it.

A Python kernel registered for a dispatch key silently replaces a C++ one, so which kernel
holds the CUDA slot is decided here, once, at import:

- ``TORCHKIT_CUDA_KERNELS`` unset (or ``auto``): the CUDA C++ kernel of the build, except for
  the ops in ``MEASURED``, whose Triton kernels a recorded GPU run (``benchmarks/results/<gpu>/``)
  showed correct and at least as fast. A Triton kernel that has never run on a GPU is staged:
  it serves nothing by default, not even in a build without CUDA C++ kernels, where such an
  op's CUDA tensors then have no kernel (the dispatcher says so).
- ``TORCHKIT_CUDA_KERNELS=triton``: the Triton kernel wherever an op has one (staged or not);
  the other ops keep the build's CUDA C++ kernels.
- ``TORCHKIT_CUDA_KERNELS=cuda``: the build's CUDA C++ kernels only.

``torchkit.build_info()["cuda_kernels"]`` reports the outcome per op.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

VARIABLE = "TORCHKIT_CUDA_KERNELS"
CHOICES = ("auto", "triton", "cuda")

# op (or family of ops) -> its module here, and the ops whose CUDA kernels that module provides
# with the module function of each (forward and backward; a family's prefixed by the op).
TRITON_KERNELS: dict[str, dict[str, str]] = {
    "cdist": {"torchkit::cdist": "forward", "torchkit::_cdist_backward": "backward"},
    "bilinear_pool": {"torchkit::bilinear_pool": "forward", "torchkit::_bilinear_pool_backward": "backward"},
    "pair_losses": {
        "torchkit::supcon_loss": "supcon_forward",
        "torchkit::_supcon_loss_backward": "supcon_backward",
        "torchkit::ntxent_loss": "ntxent_forward",
        "torchkit::_ntxent_loss_backward": "ntxent_backward",
        "torchkit::contrastive_loss": "contrastive_forward",
        "torchkit::_contrastive_loss_backward": "contrastive_backward",
        "torchkit::triplet_margin_loss": "triplet_margin_forward",
        "torchkit::_triplet_margin_loss_backward": "triplet_margin_backward",
        "torchkit::multi_similarity_loss": "multi_similarity_forward",
        "torchkit::_multi_similarity_loss_backward": "multi_similarity_backward",
        "torchkit::proxy_anchor_loss": "proxy_anchor_forward",
        "torchkit::_proxy_anchor_loss_backward": "proxy_anchor_backward",
    },
}

# Ops whose Triton kernels a recorded GPU run measured correct and at least as fast as their
# CUDA C++ kernels (none yet: cdist's, bilinear_pool's and the pair losses' wait for a GPU
# session).
MEASURED: frozenset[str] = frozenset()

# The oldest Triton the kernels ran with compiled on a GPU: torch 2.11's 3.6 (the H200 run in
# benchmarks/results/h200/). Below it TORCHKIT_CUDA_KERNELS=triton is refused; the CUDA C++
# kernels serve every supported torch.
MIN_TRITON = (3, 6)
# The oldest Triton whose interpreter runs the kernels in the tests: torch 2.14's 3.8. The
# interpreters of Triton 3.4 to 3.6 (torch 2.8 to 2.11) fail with numpy >= 2.3 ("only
# 0-dimensional arrays can be converted to Python scalars"); below it the interpreted Triton
# tests skip.
MIN_TRITON_INTERPRETER = (3, 8)

_library: torch.library.Library | None = None
_serving: dict[str, str | None] = {}


def choice() -> str:
    """TORCHKIT_CUDA_KERNELS's value, checked."""
    value = os.environ.get(VARIABLE, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(
            f"torchkit: {VARIABLE} must be one of {', '.join(CHOICES)} (or unset), got {os.environ[VARIABLE]!r}"
        )
    return value


def triton_version() -> tuple[int, ...] | None:
    """The installed Triton's version as a tuple, or None if Triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("triton")
    except PackageNotFoundError:
        return None
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def decide(op: str, has_cuda_cpp: bool, selected: str) -> str | None:
    """What serves ``op``'s CUDA tensors: "triton", "cuda" (the C++ kernel) or None."""
    cpp = "cuda" if has_cuda_cpp else None
    if op not in TRITON_KERNELS or selected == "cuda":
        return cpp
    if selected == "triton" or op in MEASURED:
        return "triton"
    return cpp


def _kernel(op: str, function: str):
    """The CUDA kernel for the dispatcher: imports the op's Triton module on the first call."""

    def kernel(*args):
        module = importlib.import_module(f"torchkit.triton.{op}")
        return getattr(module, function)(*args)

    kernel.__name__ = f"{op}_{function}_triton"
    return kernel


def register() -> None:
    """Decide each op's CUDA kernel and register the Triton ones (torchkit's import calls it)."""
    global _library
    selected = choice()
    chosen = {}
    for op, names in TRITON_KERNELS.items():
        has_cpp = all(torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA") for name in names)
        chosen[op] = decide(op, has_cpp, selected)
    if any(v == "triton" for v in chosen.values()):
        found = triton_version()
        if found is None or found < MIN_TRITON:
            have = "not installed" if found is None else ".".join(map(str, found))
            raise ImportError(
                f"torchkit: {VARIABLE}={os.environ.get(VARIABLE, 'auto')} selects Triton kernels, which need "
                f"triton >= {'.'.join(map(str, MIN_TRITON))} (installed: {have}). pip install 'triton>="
                f"{'.'.join(map(str, MIN_TRITON))}', or unset {VARIABLE}."
            )
        _library = torch.library.Library("torchkit", "IMPL")
        for op, names in TRITON_KERNELS.items():
            if chosen[op] == "triton":
                for name, function in names.items():
                    _library.impl(name.split("::")[1], _kernel(op, function), "CUDA")
    _serving.clear()
    _serving.update(chosen)


def serving(has_cuda_kernel: dict[str, bool | None]) -> dict[str, str | None]:
    """What serves each op's CUDA tensors: "triton", "cuda" (the build's CUDA C++ kernel) or
    None, from torchkit.kernels("cuda") (ops without tensor arguments are left out)."""
    out = {}
    for name, has in has_cuda_kernel.items():
        if has is None:
            continue
        op = next((o for o, names in TRITON_KERNELS.items() if name in names), None)
        out[name] = _serving.get(op) if op is not None else ("cuda" if has else None)
    return out


# The products of float32 inputs in the Triton kernels under the CUDA precision contract (the
# pair losses' log-sum-exp engine: docs/ops.md), by PyTorch's fp32-matmul setting.
FLOAT32_PRODUCTS = {"highest": "3xTF32", "high": "TF32", "medium": "bfloat16"}


def float32_products() -> str:
    """Which products PyTorch's fp32-matmul setting selects for float32 inputs now, read as
    matmuls read it: ``torch.backends.cuda.matmul.fp32_precision`` where set ("ieee": the
    default's; "tf32"), else ``torch.get_float32_matmul_precision()``: "3xTF32" (three TF32
    products of each row's TF32 pair hi + lo: about float32's accuracy, on tensor cores) for
    the default "highest", "TF32" for "high", "bfloat16" for "medium"."""
    cuda = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # both APIs were used (torch refuses to answer): the new one decides
        legacy = None
    if cuda == "ieee":
        return FLOAT32_PRODUCTS["highest"]
    if legacy == "medium":
        return FLOAT32_PRODUCTS["medium"]
    if cuda == "tf32" or legacy == "high":
        return FLOAT32_PRODUCTS["high"]
    return FLOAT32_PRODUCTS["highest"]
