"""Build torchkit._C: one extension holding every op's CPU (and optionally CUDA) kernels.

Environment:
  TORCHKIT_CUDA=1        force a CUDA build (works without a GPU, given a CUDA toolkit)
  TORCHKIT_CUDA=0        force a CPU-only build
  (unset)                CUDA when torch.cuda.is_available() and a toolkit is found
  TORCH_CUDA_ARCH_LIST   GPU architectures; a forced build defaults to "8.0;9.0"
  DEBUG=1                -O0 -g
  FAST_BUILD=1           -O0 without debug information: the quickest build (the packaging
                         test's, which checks the sdist and its build, not the optimiser)
  SANITIZE=address       AddressSanitizer in the C++ code (run with libasan preloaded:
                         make asan)
  MAX_JOBS               parallel compile jobs (torch's default: every core)

The extension is compiled against the torch of the environment it is built in and works
only with that torch: the wheel requires exactly that release, and a build that cannot see
the user's torch (pip's build isolation) stops here with the command that works.
"""

import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent  # absolute: ninja compiles from the build directory
LIBRARY = "torchkit"


def setuptools_range() -> tuple[int, int]:
    """The setuptools majors [low, high) of pyproject.toml's build-system.requires."""
    found = re.search(r'"setuptools\s*>=\s*(\d+)[^"]*<\s*(\d+)"', (ROOT / "pyproject.toml").read_text())
    if found is None:
        raise RuntimeError("pyproject.toml: build-system.requires must bound setuptools as >=LOW,<HIGH")
    return int(found[1]), int(found[2])


def _torch_outside_isolation() -> str | None:
    """The torch version of this interpreter's own environment, or None. Under pip's build
    isolation the environment is hidden behind PYTHONPATH; ``python -I`` ignores it."""
    code = "import importlib.metadata as m; print(m.version('torch'))"
    try:
        found = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return (found.stdout.strip() or None) if found.returncode == 0 else None


def _no_torch() -> str:
    """Why the build stops when torch is not importable, and the command that works."""
    outside = _torch_outside_isolation()
    low, high = setuptools_range()
    first = (
        f"This environment has torch {outside}, which an isolated build cannot see (pip would otherwise\n"
        "download another torch, compile against it, and the installed torchkit would not load)."
        if outside
        else "Install the torch you will use first (https://pytorch.org/get-started/locally/), e.g. pip install torch."
    )
    return (
        "torchkit: torch is not importable in this build environment. torchkit compiles against the torch it\n"
        f"will run with. {first}\nThen build without isolation, in the environment that holds that torch:\n"
        f"    pip install 'setuptools>={low},<{high}' ninja\n"
        "    pip install --no-build-isolation .        (python -m build --no-isolation for a wheel or sdist)"
    )


try:
    import torch
    from torch.utils import cpp_extension
except ImportError:
    sys.exit(_no_torch())

from setuptools import __version__ as SETUPTOOLS_VERSION  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402


def _check_setuptools() -> str:
    """A build without isolation uses the environment's setuptools: stop below the range (it
    rejects the SPDX license field), say so above it (untested, usually fine)."""
    low, high = setuptools_range()
    major = int(SETUPTOOLS_VERSION.split(".")[0])
    wanted = f"setuptools>={low},<{high}"
    if major < low:
        sys.exit(
            f"torchkit: building needs {wanted}, this environment has {SETUPTOOLS_VERSION}: pip install '{wanted}'"
        )
    return SETUPTOOLS_VERSION + ("" if major < high else f" (newer than the tested {wanted})")


def torch_release(version: str) -> str:
    """A torch version without its local label: "2.14.1+cu130" -> "2.14.1"."""
    return version.split("+")[0]


def build_record(torch_version: str, in_place: bool) -> str:
    """torchkit/_build.py, written beside the extension: what torchkit/__init__.py checks
    before loading it (a mismatched torch fails there with an undefined symbol)."""
    return (
        '"""How the extension beside this file was built; written by setup.py with it."""\n\n'
        f"TORCH = {torch_version!r}\n"
        f"SOURCE = {str(ROOT)!r}\n"
        f"IN_PLACE = {in_place!r}  # an editable (in-place) build of SOURCE\n"
    )


def _cuda_wanted() -> tuple[bool, str]:
    flag = os.environ.get("TORCHKIT_CUDA")
    if flag == "1":
        if cpp_extension.CUDA_HOME is None:
            raise RuntimeError("TORCHKIT_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME")
        return True, "TORCHKIT_CUDA=1"
    if flag == "0":
        return False, "TORCHKIT_CUDA=0"
    if flag not in (None, ""):
        raise RuntimeError(f"TORCHKIT_CUDA must be 0, 1 or unset, got {flag!r}")
    found = torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None
    return found, f"auto: torch.cuda.is_available()={torch.cuda.is_available()}, CUDA_HOME={cpp_extension.CUDA_HOME}"


def _nvcc_version() -> str:
    nvcc = Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def _c_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension (ninja, its default), compiling into build/temp instead of a
    throw-away directory, and writing the build record beside the extension.

    pip's editable install compiles into a fresh temporary directory every time, so every
    `make build` would recompile everything; a fixed directory lets ninja skip what is
    up to date. An explicit --build-temp (as `make cuda-build` gives) is kept.
    """

    def finalize_options(self):
        super().finalize_options()
        # pip's throw-away directory: in the temporary directory and outside the source tree
        # (a checkout may itself live in the temporary directory, with --build-temp inside it).
        temp = Path(self.build_temp).resolve()
        if temp.is_relative_to(Path(tempfile.gettempdir()).resolve()) and not temp.is_relative_to(ROOT):
            self.build_temp = str(ROOT / "build" / "temp")

    def build_extension(self, ext):
        header = self._precompiled_header(ext)
        cxx = ext.extra_compile_args["cxx"]
        if header is not None:  # (for this build only: a later one precompiles with the flags as given)
            # (-fpch-deps: each object depends on the headers in it, as when it parsed them)
            ext.extra_compile_args["cxx"] = [*cxx, "-Winvalid-pch", "-fpch-deps", "-include", str(header)]
        try:
            super().build_extension(ext)
        finally:
            ext.extra_compile_args["cxx"] = cxx

    def _precompiled_header(self, ext) -> Path | None:
        """PRECOMPILED compiled by GCC into build_temp with the sources' own flags (through the
        same compiler wrapper and ninja, which keeps it up to date with its dependencies),
        beside the copy of it that the sources are then compiled after (-include): GCC reads
        X.h.gch for X.h when it was compiled with compatible flags, else X.h as text
        (-Winvalid-pch says so). None (nothing precompiled) for another compiler."""
        try:
            version = subprocess.run([self.compiler.compiler_so[0], "--version"], capture_output=True, text=True).stdout
        except OSError:  # (no such compiler: the build itself says so)
            return None
        if "Free Software Foundation" not in version or "clang" in version:
            return None
        out = Path(self.build_temp).resolve() / "precompiled"
        out.mkdir(parents=True, exist_ok=True)
        text = PRECOMPILED.read_text()
        header, source = out / PRECOMPILED.name, out / (PRECOMPILED.stem + ".cpp")  # (a C++ source to distutils)
        for path in (header, source):
            if not path.exists() or path.read_text() != text:  # (rewritten only when changed: ninja's mtimes)
                path.write_text(text)
        [compiled] = self.compiler.compile(
            [str(source)],
            output_dir=str(out),
            macros=ext.define_macros,
            include_dirs=ext.include_dirs,
            debug=self.debug,
            extra_preargs=["-x", "c++-header"],
            extra_postargs=ext.extra_compile_args,
        )
        link = out / (PRECOMPILED.name + ".gch")
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(compiled)
        return header

    def run(self):
        in_place = self.inplace  # setuptools' run() builds into build_lib, then copies in place
        super().run()
        record = build_record(torch.__version__, in_place)
        package = Path(self.build_lib) / LIBRARY
        package.mkdir(parents=True, exist_ok=True)
        (package / "_build.py").write_text(record)
        if in_place:
            (ROOT / LIBRARY / "_build.py").write_text(record)


# The flags below change which code the compiler sees; tools/cxx17_check.py parses the sources
# with them too.
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"]
# at::parallel_for is a header template: without OpenMP in this build it runs every loop
# on the calling thread. torch's own libgomp.so.1, already loaded, serves the pragmas.
OPENMP_FLAGS = ["-fopenmp"] if platform.system() == "Linux" else []
NVCC_LANGUAGE_FLAGS = ["--expt-relaxed-constexpr"]
# The torch headers most sources include, precompiled by GCC (BuildExtension._precompiled_header).
PRECOMPILED = ROOT / "csrc" / "precompiled.h"


def sources(use_cuda: bool) -> list[Path]:
    """Every C++ source, and the CUDA backend's for a CUDA build: no registration beyond the
    file. A CUDA backend without kernels of its own (cuBLAS through ATen) is a .cpp, compiled
    by the host compiler with the precompiled header: nvcc parses torch's headers four times
    a file (about 45 s of a .cu's 55 at -O0)."""
    found = sorted((ROOT / "csrc").glob("*.cpp")) + sorted((ROOT / "csrc" / "cpu").glob("*.cpp"))
    cuda = ROOT / "csrc" / "cuda"
    return found + (sorted(cuda.glob("*.cpp")) + sorted(cuda.glob("*.cu")) if use_cuda else [])


def build_facts(torch_version: str, archs: str) -> list[str]:
    """Build facts that torchkit.build_info() reports; compiled in so they travel with the .so."""
    return [f"-DTORCHKIT_BUILD_TORCH={_c_string(torch_version)}", f"-DTORCHKIT_BUILD_ARCHS={_c_string(archs)}"]


def _cpu_isa_flags() -> tuple[list[str], str]:
    """Vector ISA of the CPU kernels: at::vec picks its implementation at compile time.

    TORCHKIT_CPU_ISA=avx2 (the default where the build machine has AVX2 and FMA) or
    TORCHKIT_CPU_ISA=default (portable SSE2 code, for a binary that must run on any x86-64).
    """
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    isa = os.environ.get("TORCHKIT_CPU_ISA") or ("avx2" if {"avx2", "fma", "f16c"} <= flags else "default")
    if isa == "avx2":
        return AVX2_FLAGS, isa
    if isa != "default":
        raise RuntimeError(f"TORCHKIT_CPU_ISA must be avx2 or default, got {isa!r}")
    return [], isa


def make_extension():
    use_cuda, why = _cuda_wanted()
    debug = os.environ.get("DEBUG") == "1"
    fast = os.environ.get("FAST_BUILD") == "1"
    if use_cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST") and os.environ.get("TORCHKIT_CUDA") == "1":
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "native") if use_cuda else ""
    compiler = os.environ.get("CXX", "c++")
    cuda_compiler = _nvcc_version() if use_cuda else ""

    srcs = [str(p.relative_to(ROOT)) for p in sources(use_cuda)]

    # The C++ standard is left to torch: 2.8 builds with C++17, later releases with C++20.
    opt = ["-O0", "-g"] if debug else (["-O0"] if fast else ["-O3"])
    isa_flags, isa = _cpu_isa_flags()
    sanitize = os.environ.get("SANITIZE", "")
    # Python's own CFLAGS carry -g, and debug information is about 45 % of the compile time of
    # a file holding torch's headers: kept for DEBUG and for a sanitizer (its reports' line
    # numbers), dropped otherwise.
    debug_info = ["-g"] if debug or sanitize else ["-g0"]
    sanitizer_flags = [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer"] if sanitize else []
    info = build_facts(torch.__version__, archs)
    # -ffp-contract=off: the CPU kernels round as their source says, whatever the ISA and the
    # optimiser (GCC otherwise fuses a·b + c into an FMA where -mfma allows it, and differently
    # under -fsanitize); explicit at::vec::fmadd stays fused. The pair losses' Triton kernels,
    # compiled without FMA fusion, then round as they do: a zero row's distances to normalised
    # rows are 1 within an ulp, and rounding decides margins and candidates there.
    cxx = [
        *opt,
        *debug_info,
        "-ffp-contract=off",
        "-fdiagnostics-color=always",
        *isa_flags,
        *info,
        *sanitizer_flags,
        *OPENMP_FLAGS,
    ]
    extra_compile_args = {"cxx": cxx}
    if use_cuda:
        extra_compile_args["nvcc"] = [*opt, *NVCC_LANGUAGE_FLAGS, "-lineinfo"]

    setuptools_version = _check_setuptools()
    print(
        "torchkit build configuration:\n"
        f"  torch          {torch.__version__} (CUDA {torch.version.cuda}; the wheel requires it)\n"
        f"  setuptools     {setuptools_version}\n"
        f"  CUDA kernels   {'yes' if use_cuda else 'no'} ({why})\n"
        f"  CUDA_HOME      {cpp_extension.CUDA_HOME if use_cuda else '-'}\n"
        f"  nvcc           {cuda_compiler or '-'}\n"
        f"  architectures  {archs or '-'}\n"
        f"  C++ compiler   {compiler}\n"
        f"  CPU ISA        {isa}\n"
        f"  optimisation   {' '.join([*opt, *debug_info])}\n"
        f"  sanitizer      {sanitize or '-'}\n"
        f"  sources        {len(srcs)}",
        flush=True,
    )
    extension = cpp_extension.CUDAExtension if use_cuda else cpp_extension.CppExtension
    return extension(
        f"{LIBRARY}._C",
        srcs,
        include_dirs=[str(ROOT / "csrc")],
        extra_compile_args=extra_compile_args,
        extra_link_args=([] if debug else ["-Wl,-O1"]) + sanitizer_flags + OPENMP_FLAGS,
        py_limited_api=True,
    )


# Guarded so that tools/cxx17_check.py can import the flags; setuptools runs this as __main__.
if __name__ == "__main__":
    setup(
        name=LIBRARY,
        # Exactly the torch release the extension is compiled against: its C++ ABI changes from
        # one release to the next. The extras' torchvision (pyproject.toml) follows from it.
        install_requires=[f"torch=={torch_release(torch.__version__)}"],
        packages=find_packages(include=[LIBRARY, f"{LIBRARY}.*"]),
        package_data={LIBRARY: ["py.typed"]},
        ext_modules=[make_extension()],
        cmdclass={"build_ext": BuildExtension},
        # One abi3 (limited-API) wheel for every Python ≥ 3.10: the extension never touches
        # Python objects.
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
        platforms=[platform.system()],
    )
