"""The extension itself: it loads, reports how it was built, and fails loudly when it cannot."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from packaging.version import Version
from testing import run_python, torch_only_site

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
    assert set(info) == {
        "torch",
        "cuda",
        "architectures",
        "compiler",
        "cuda_compiler",
        "cuda_kernels",
        "cuda_float32_products",
    }
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
    assert "pip install --no-build-isolation" in run.stderr


def record(torch_version: str, source: Path, in_place: bool) -> SimpleNamespace:
    return SimpleNamespace(TORCH=torch_version, SOURCE=str(source), IN_PLACE=in_place)


def test_build_record_describes_this_build():
    """setup.py writes torchkit/_build.py beside the extension: the torch it compiled against."""
    from torchkit import _build

    assert torchkit.build_info()["torch"] == _build.TORCH
    assert Path(_build.__file__).parent == Path(torchkit._C.__file__).parent


def test_torch_version_mismatch_names_both_and_the_command(tmp_path):
    (tmp_path / "setup.py").write_text("")
    built = record("2.8.0+cu128", tmp_path, in_place=True)
    with pytest.raises(ImportError) as err:
        torchkit._check_torch_version(built, "2.14.1+cpu")
    message = str(err.value)
    assert "built against torch 2.8.0+cu128, but torch 2.14.1+cpu is installed" in message
    assert f"cd {tmp_path} && {sys.executable} -m pip install --no-build-isolation -e ." in message
    torchkit._check_torch_version(built, "2.8.0")  # the same release under another local label: fine
    # Installed from a source tree (not in place): reinstall from it; from a copy that is gone
    # (pip's temporary directory): the torch it was built against.
    assert f"--no-deps --force-reinstall {tmp_path}" in torchkit._rebuild_command(record("2.8.0", tmp_path, False))
    gone = record("2.8.0+cu128", tmp_path / "gone", in_place=False)
    assert "pip install 'torch==2.8.0'" in torchkit._rebuild_command(gone)


def source_tree(tmp_path: Path, build_record: str | None) -> Path:
    """A checkout's torchkit/ (the Python files, no extension) beside a setup.py, with the
    given build record."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("_C*", "_build.py", "__pycache__")
    shutil.copytree(Path(torchkit.__file__).parent, src / "torchkit", ignore=ignore)
    (src / "setup.py").write_text("")
    if build_record is not None:
        (src / "torchkit" / "_build.py").write_text(build_record)
    return src


def import_in(src: Path, tmp_path: Path, *extra_path: Path) -> subprocess.CompletedProcess:
    """`import torchkit` from `src`, with no site-packages (python -S): only torch and its own
    requirements, and `extra_path`, are importable beside the working directory."""
    path = [str(torch_only_site(tmp_path / "torch_only")), *map(str, extra_path)]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": os.pathsep.join(path)}
    code = "import torchkit"
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=src, env=env, capture_output=True, text=True)


def test_torch_version_is_checked_before_loading_the_extension(tmp_path):
    """A record of another torch stops the import before any C++ is loaded (here there is
    none: a load would fail differently), naming both versions and the rebuild command."""
    src = source_tree(tmp_path, f"TORCH = '2.8.0'\nSOURCE = {str(tmp_path / 'src')!r}\nIN_PLACE = True\n")
    run = import_in(src, tmp_path)
    assert run.returncode != 0
    assert f"torchkit was built against torch 2.8.0, but torch {torch.__version__} is installed" in run.stderr
    assert f"cd {src} && " in run.stderr and "pip install --no-build-isolation -e ." in run.stderr
    assert "circular import" not in run.stderr and "_C" not in run.stderr


def test_unbuilt_source_tree_says_how_to_build_it(tmp_path):
    run = import_in(source_tree(tmp_path, None), tmp_path)
    assert run.returncode != 0
    assert f"torchkit: its compiled extension is not built in {tmp_path / 'src' / 'torchkit'}" in run.stderr
    assert f"cd {tmp_path / 'src'} && pip install --no-build-isolation -e ." in run.stderr
    assert "circular import" not in run.stderr


def test_source_tree_shadowing_the_installed_package_says_so(tmp_path):
    """Run from a checkout's root, Python finds its unbuilt torchkit/ before the installed one."""
    installed = tmp_path / "site"
    (installed / "torchkit").mkdir(parents=True)
    (installed / "torchkit" / "__init__.py").write_text("")
    run = import_in(source_tree(tmp_path, None), tmp_path, installed)
    assert run.returncode != 0
    assert f"found the source tree's torchkit ({tmp_path / 'src' / 'torchkit'}), which is not built" in run.stderr
    assert f"before the installed one ({installed / 'torchkit'})" in run.stderr
    assert "Run from another directory" in run.stderr


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


@pytest.mark.parametrize("module", ["ops", "nn", "metrics", "distributed", "reference"])
def test_public_names_are_the_api(module):
    """What a module defines without a leading underscore is in its __all__: helpers shared
    between modules (distributed's ring, shards and argument agreement) stay private."""
    mod = getattr(torchkit, module)
    defined = {n for n, v in vars(mod).items() if getattr(v, "__module__", None) == mod.__name__}
    public = {n for n in defined if not n.startswith("_")}
    assert public <= set(mod.__all__), sorted(public - set(mod.__all__))


def test_build_info_names_the_float32_products_of_the_fp32_matmul_setting():
    """PyTorch's fp32-matmul setting, read at each call, picks the products of float32 inputs
    under the CUDA precision contract: three TF32 products by default, TF32 or bfloat16."""
    before = torch.get_float32_matmul_precision()
    try:
        for setting, products in (("highest", "3xTF32"), ("high", "TF32"), ("medium", "bfloat16")):
            torch.set_float32_matmul_precision(setting)
            assert torchkit.build_info()["cuda_float32_products"] == products
    finally:
        torch.set_float32_matmul_precision(before)
