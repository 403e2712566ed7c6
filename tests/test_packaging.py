"""The packages as the image installs them: `pip install /src/plugin /src/model-fetch` builds ordinary wheels, and
only the files their pyproject.toml names go in. The test venv installs the plugin editable (the source tree
itself), so a data file the wheel leaves out (a CUDA header NVRTC reads at load, say) passes every other test
here and fails only in the image. This builds each wheel the same way and checks that every file of the source
package is in it.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROJECTS = {"plugin": "bonsai_vllm", "model-fetch": "bonsai_fetch"}


def package_files(project: str, package: str) -> set[str]:
    """Every file under the source package, as the wheel would name it (compiled caches aside)."""
    root = REPO / project
    return {p.relative_to(root).as_posix() for p in (root / package).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


@pytest.mark.parametrize("project", sorted(PROJECTS))
def test_the_wheel_holds_every_file_of_the_package(project, tmp_path):
    # A copy, so the build's egg-info and build/ folders land outside the checkout.
    src = tmp_path / "src"
    subprocess.run(["cp", "-r", str(REPO / project), str(src)], check=True)
    for leftover in src.rglob("*.egg-info"):
        subprocess.run(["rm", "-rf", str(leftover)], check=True)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    expected = package_files(project, PROJECTS[project])
    assert expected, f"{project}: no files found under {PROJECTS[project]}/"
    missing = sorted(expected - in_wheel)
    assert not missing, (f"{project}'s wheel leaves out {missing}: name them in [tool.setuptools.package-data] of "
                         f"{project}/pyproject.toml")
