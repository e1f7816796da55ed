"""tools/cuda_toolkit.py's choice of NVIDIA compiler packages (no network: fed version lists)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "cuda_toolkit", Path(__file__).resolve().parent.parent / "tools" / "cuda_toolkit.py"
)
cuda_toolkit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cuda_toolkit)
choose_version = cuda_toolkit.choose_version

# What PyPI offered for torch 2.14.1's CUDA 13.0 (runtime 13.0.96) and torch 2.15's 13.2.
NVCC = ["12.9.86", "13.0.48", "13.0.88", "13.1.80", "13.2.51", "13.2.78"]
CCCL = ["12.9.27", "13.0.50", "13.0.85", "13.1.78", "13.2.27"]


def test_exact_runtime_version_where_published():
    assert choose_version("13.2", "13.2.78", NVCC) == "13.2.78"


def test_newest_of_the_same_minor_where_the_runtime_version_is_not_published():
    # torch 2.14.1: runtime 13.0.96, and no nvcc or cccl of that version.
    assert choose_version("13.0", "13.0.96", NVCC) == "13.0.88"
    assert choose_version("13.0", "13.0.96", CCCL) == "13.0.85"


def test_never_another_minor_or_a_prerelease():
    assert choose_version("13.1", None, ["13.0.88", "13.1.80", "13.1.99rc1", "13.2.78"]) == "13.1.80"
    assert choose_version("12.9", "12.9.79", NVCC) == "12.9.86"


def test_no_release_of_the_minor_is_a_clear_error():
    with pytest.raises(LookupError, match=r"no release for CUDA 13\.3 among 12\.9\.86, 13\.0\.48"):
        choose_version("13.3", "13.3.10", NVCC)


def test_unparsable_versions_are_skipped():
    assert choose_version("13.0", None, ["latest", "13.0.88"]) == "13.0.88"
