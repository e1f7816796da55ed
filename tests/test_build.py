"""The extension itself: it loads, reports how it was built, and fails loudly when it cannot."""

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from testing import run_python

import torchkit

REPO = Path(__file__).resolve().parent.parent


def test_has_ops():
    """Every op has a CPU kernel; CUDA kernels exactly where the build has CUDA."""
    coverage = torchkit.kernels("cpu")
    assert "torchkit::cdist" in coverage and "torchkit::_cdist_backward" in coverage
    assert coverage["torchkit::_cuda_version"] is None  # no tensor argument: one kernel for all
    assert torchkit.has_ops() and torchkit.has_ops(torch.device("cpu"))
    assert torchkit.has_ops("cuda") == (torchkit.build_info()["cuda"] is not None)
    assert not torchkit.has_ops("mps")
    assert hasattr(torch.ops.torchkit, "_build_info")


def test_version():
    assert Version(torchkit.__version__) >= Version("0.1.0")


def test_build_info_describes_this_build():
    info = torchkit.build_info()
    assert set(info) == {"torch", "cuda", "architectures", "compiler", "cuda_compiler"}
    assert Version(info["torch"]).release[:2] == Version(torch.__version__).release[:2]
    assert info["compiler"].split()[0] in {"gcc", "clang"}
    if info["cuda"] is None:
        assert info["architectures"] == [] and info["cuda_compiler"] is None
    else:
        assert info["cuda_compiler"].startswith("nvcc ") and info["architectures"]


def test_cuda_version_agrees_with_build_info():
    built = torch.ops.torchkit._cuda_version()
    info = torchkit.build_info()
    if info["cuda"] is None:
        assert built == -1
    else:
        assert f"{built // 1000}.{built % 1000 // 10}" == info["cuda"]
        assert info["cuda"] == ".".join(torch.version.cuda.split(".")[:2])


@pytest.mark.skipif(os.environ.get("TORCHKIT_EXPECT_CUDA_BUILD") != "1", reason="only under make cuda-build")
def test_this_is_the_cuda_build():
    assert torchkit.build_info()["cuda"] is not None


def test_cuda_version_mismatch_is_a_clear_error():
    with pytest.raises(ImportError, match=r"compiled with CUDA 12\.4, but the installed torch .* uses CUDA 13\.2"):
        torchkit._check_cuda_version(12040, "13.2")
    torchkit._check_cuda_version(13020, "13.2")  # same major.minor: fine
    torchkit._check_cuda_version(-1, "13.2")  # CPU-only build: fine
    torchkit._check_cuda_version(13020, None)  # CPU-only torch: the CUDA kernels are never reached


def test_import_from_outside_the_repo(tmp_path):
    run = run_python("import torchkit; print(torchkit.build_info()['torch'])", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == torchkit.build_info()["torch"]


def test_missing_extension_is_an_actionable_import_error(tmp_path):
    # sys.modules[name] = None makes `import name` raise ImportError, as a missing .so does.
    run = run_python("import sys; sys.modules['torchkit._C'] = None; import torchkit", cwd=tmp_path)
    assert run.returncode != 0
    assert "torchkit's compiled extension torchkit._C could not be loaded" in run.stderr
    assert f"installed: torch {torch.__version__}" in run.stderr
    assert "make build" in run.stderr


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_extension_uses_the_process_cpp_runtime():
    # A toolchain that links its own static libstdc++ into the extension gives it a second C++
    # runtime beside the one torch uses: the first exception thrown across the two (any input
    # check) crashes the process. std::ostream::operator<<(long) must come from outside.
    import torchkit._C

    symbols = subprocess.run(
        ["nm", "--defined-only", torchkit._C.__file__], capture_output=True, text=True, check=True
    ).stdout
    assert "_ZNSo9_M_insertIlEERSoT_" not in symbols, (
        f"{torchkit._C.__file__} carries its own copy of libstdc++: rebuild with the compiler that "
        "matches the system's libstdc++ (e.g. CXX=/usr/bin/g++)"
    )


def test_import_needs_torch_alone():
    """import torchkit loads neither torchvision nor Pillow nor packaging; torchkit.transforms
    loads torchvision on first use (where it is installed)."""
    vision = importlib.util.find_spec("torchvision") is not None
    code = (
        "import sys, torchkit; "
        "before = sorted(m for m in ('torchvision', 'PIL', 'packaging') if m in sys.modules); "
        + ("torchkit.transforms.RandomRegionConfusion; " if vision else "")
        + "print(before, 'torchvision' in sys.modules)"
    )
    run = run_python(code)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == f"[] {vision}"
