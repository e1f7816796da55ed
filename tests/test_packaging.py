"""The sdist carries the sources and builds in a fresh virtual environment that has torch."""

import importlib.metadata
import json
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest
import torch

import torchkit

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # builds the extension from the sdist: full suite (make test) only


def run(cmd, **kwargs) -> str:
    """subprocess.run that shows the command's output when it fails."""
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out), str(ROOT)])
    (path,) = out.glob("torchkit-*.tar.gz")
    return path


def test_sdist_contains_the_sources(sdist):
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    root = names[0].split("/")[0]
    assert root == f"torchkit-{torchkit.__version__}"
    for source in list((ROOT / "csrc").rglob("*")):
        if source.suffix in (".h", ".cpp", ".cu"):
            assert f"{root}/{source.relative_to(ROOT)}" in names, source
    assert f"{root}/setup.py" in names and f"{root}/pyproject.toml" in names


def torch_only_site(target: Path) -> Path:
    """A folder of links to torch and what torch itself requires (its install_requires
    closure, markers evaluated), nothing else of the development environment: no numpy,
    torchvision, Pillow or packaging."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    target.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    seen, stack = set(), ["torch"]
    while stack:
        name = canonicalize_name(stack.pop())
        if name in seen:
            continue
        seen.add(name)
        dist = importlib.metadata.distribution(name)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                stack.append(requirement.name)
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if top != "__pycache__" and (site / top).exists() and not (target / top).exists():
                (target / top).symlink_to(site / top)
    return target


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
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "TORCHKIT_CUDA": "0", "HOME": str(tmp_path)}
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
    assert "pip install 'torchkit[vision]'" in report["transforms"]
