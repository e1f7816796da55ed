"""The sdist carries the sources and builds in a fresh virtual environment that has torch."""

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


def test_sdist_installs_in_a_fresh_venv(sdist, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    # "A fresh venv that has torch": this one sees the development environment's torch (and
    # setuptools, ninja) through a .pth file instead of downloading 5 GB again.
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    Path(site, "development_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "TORCHKIT_CUDA": "0", "HOME": str(tmp_path)}
    run(
        [str(python), "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", str(sdist)],
        env=env,
        cwd=tmp_path,
    )
    check = (
        "import json, torch, torchkit; "
        "d = torchkit.ops.cdist(torch.zeros(2, 3), torch.ones(1, 3)); "
        "print(json.dumps(dict(file=torchkit.__file__, version=torchkit.__version__, "
        "info=torchkit.build_info(), d=d.tolist())))"
    )
    result = subprocess.run(
        [str(python), "-c", check], check=True, capture_output=True, text=True, env=env, cwd=tmp_path
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["file"].startswith(str(venv)), report["file"]  # the installed copy, not the checkout
    assert report["version"] == torchkit.__version__
    assert report["info"]["torch"] == torch.__version__  # the torch it was built against
    assert [v for row in report["d"] for v in row] == pytest.approx([3**0.5] * 2, rel=1e-6)
