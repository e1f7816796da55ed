"""What pip makes of torchkit: the wheel's metadata (the exact torch, extras that keep it,
the license) with the lowest and the newest setuptools of pyproject.toml's range, an isolated
build that stops with the command that works, and the sdist, built in a fresh virtual
environment. pip reaches the package index (PyPI) for setuptools and for the extras'
resolution."""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest
import torch
from testing import torch_only_site

import torchkit

ROOT = Path(__file__).resolve().parent.parent
RELEASE = torch.__version__.split("+")[0]


def run(cmd, **kwargs) -> str:
    """subprocess.run that shows the command's output when it fails."""
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def source_copy(tmp_path: Path) -> Path:
    """What pip reads of a checkout, without a build: a build record or extension in the
    checkout must not leak into what is tested."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("_C*", "_build.py", "__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "torchkit", src / "torchkit", ignore=ignore)
    shutil.copytree(ROOT / "csrc", src / "csrc")
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, src / name)
    return src


def setuptools_bounds() -> tuple[int, int]:
    found = re.search(r'"setuptools>=(\d+),<(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert found, "pyproject.toml's build-system.requires must bound setuptools"
    return int(found[1]), int(found[2])


@pytest.mark.parametrize("which", ["lowest", "newest"])
def test_wheel_metadata(tmp_path, which):
    """With the lowest and the newest setuptools the range admits: no deprecation warning, the
    SPDX license, exactly the torch release the build compiles against, extras whose
    torchvision is the one built for that torch."""
    low, high = setuptools_bounds()
    spec = f"setuptools=={low}.*" if which == "lowest" else f"setuptools<{high}"
    tools = tmp_path / "setuptools"
    run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target", str(tools), spec]
    )
    src = source_copy(tmp_path)
    code = (
        "import sys, setuptools; from setuptools.build_meta import prepare_metadata_for_build_wheel\n"
        "print(setuptools.__version__, prepare_metadata_for_build_wheel(sys.argv[1]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tools)}
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=src, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    version, info = result.stdout.split()[-2:]
    assert low <= int(version.split(".")[0]) < high, version
    assert "Warning" not in result.stderr and "deprecated" not in result.stderr, result.stderr[-3000:]
    metadata = (tmp_path / info / "METADATA").read_text()
    assert "License-Expression: BSD-3-Clause" in metadata
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, re.M)
    assert f"torch=={RELEASE}" in requires
    for extra in ("vision", "example"):
        assert f'torchvision>=0.23; extra == "{extra}"' in requires
    assert 'tqdm; extra == "example"' in requires


def test_isolated_build_stops_with_the_command_that_works(tmp_path):
    """pip's default (isolated) build cannot see the environment's torch: it stops before
    downloading another, says why and what to run."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--disable-pip-version-check",
            str(source_copy(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "torchkit: torch is not importable in this build environment" in output, output[-3000:]
    assert f"This environment has torch {importlib.metadata.version('torch')}" in output
    assert "pip install --no-build-isolation ." in output


def test_vision_extra_keeps_the_torch(tmp_path):
    """pip install --no-build-isolation '.[vision]' resolves to the installed torch's release
    and a torchvision whose own requirement admits it, even when pip may choose every package
    afresh."""
    from packaging.requirements import Requirement

    report = tmp_path / "report.json"
    target = f"{source_copy(tmp_path)}[vision]"
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--disable-pip-version-check"]
    run([*pip, "--no-build-isolation", "--ignore-installed", "--report", str(report), target])
    chosen = {item["metadata"]["name"].lower(): item["metadata"] for item in json.loads(report.read_text())["install"]}
    assert chosen["torch"]["version"].split("+")[0] == RELEASE
    wants = [Requirement(r) for r in chosen["torchvision"].get("requires_dist", [])]
    (torch_requirement,) = [r for r in wants if r.name == "torch" and r.marker is None]
    assert torch_requirement.specifier.contains(RELEASE), (chosen["torchvision"]["version"], str(torch_requirement))


@pytest.fixture(scope="session")  # (its tests share a worker with other modules': built once)
def sdist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out), str(ROOT)])
    (path,) = out.glob("torchkit-*.tar.gz")
    return path


@pytest.mark.slow
def test_sdist_contains_the_sources(sdist):
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    root = names[0].split("/")[0]
    assert root == f"torchkit-{torchkit.__version__}"
    for source in list((ROOT / "csrc").rglob("*")):
        if source.suffix in (".h", ".cpp", ".cu"):
            assert f"{root}/{source.relative_to(ROOT)}" in names, source
    assert f"{root}/setup.py" in names and f"{root}/pyproject.toml" in names
    assert f"{root}/torchkit/_build.py" not in names  # written by each build, beside its extension


@pytest.mark.slow  # builds the extension from the sdist
def test_sdist_installs_in_a_fresh_venv(sdist, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    # Built in a fresh venv that sees the development environment's torch, setuptools and
    # ninja through a .pth file (instead of downloading 5 GB again); then imported and run
    # where only torch and its own requirements are visible.
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    build_path = Path(site, "development.pth")
    build_path.write_text(sysconfig.get_paths()["purelib"] + "\n")
    # FAST_BUILD=1 (-O0, no debug information): what is checked is the sdist, its build and its
    # metadata, not the optimiser, and an -O3 build of every kernel again would take the
    # suite's longest test (make build compiles them at -O3).
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "TORCHKIT_CUDA": "0", "HOME": str(tmp_path), "FAST_BUILD": "1"}
    # A venv of Python < 3.12 carries its own setuptools (65 on 3.11), below the build's range
    # (setup.py stops there): without it, the development environment's is found.
    run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", "setuptools"], env=env)
    run(
        [str(python), "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", str(sdist)],
        env=env,
        cwd=tmp_path,
    )
    build_path.unlink()
    Path(site, "torch_only.pth").write_text(str(torch_only_site(tmp_path / "torch_only")) + "\n")
    check = (
        "import importlib.util, json, torch, torchkit\n"
        "d = torchkit.ops.cdist(torch.zeros(2, 3), torch.ones(1, 3))\n"
        "missing = [m for m in ('torchvision', 'PIL', 'numpy', 'packaging') if importlib.util.find_spec(m)]\n"
        "try:\n"
        "    torchkit.transforms\n"
        "    transforms = 'imported'\n"
        "except ImportError as err:\n"
        "    transforms = str(err)\n"
        "print(json.dumps(dict(file=torchkit.__file__, version=torchkit.__version__, info=torchkit.build_info(),\n"
        "                      d=d.tolist(), visible=missing, transforms=transforms)))\n"
    )
    result = subprocess.run([str(python), "-c", check], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["visible"] == [], report["visible"]  # only torch's own requirements were importable
    assert report["file"].startswith(str(venv)), report["file"]  # the installed copy, not the checkout
    assert report["version"] == torchkit.__version__
    assert report["info"]["torch"] == torch.__version__  # the torch it was built against
    assert [v for row in report["d"] for v in row] == pytest.approx([3**0.5] * 2, rel=1e-6)
    assert "torchkit.transforms needs torchvision" in report["transforms"]
    # Never PyPI's unrelated torchkit; the torch pin keeps pip from replacing the torch.
    assert f"pip install torchvision pillow 'torch=={RELEASE}'" in report["transforms"]
    metadata = run([str(python), "-m", "pip", "show", "torchkit"], env=env, cwd=tmp_path)
    assert "Requires: torch" in metadata
    requires = run([str(python), "-c", "import importlib.metadata as m; print(m.requires('torchkit'))"], env=env)
    assert f"'torch=={RELEASE}'" in requires
