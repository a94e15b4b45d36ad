"""What a fresh clone gives: ``pip`` builds the package from the tracked files alone, with its licence, and the
installed copy imports and registers its strategies."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parents[1]


def _has_backend() -> bool:
    """Whether this environment holds the build backend ``[build-system]`` requires (setuptools >= 77, whose
    ``bdist_wheel`` needs no ``wheel`` package)."""
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 77


@pytest.mark.timeout(300)
def test_the_tracked_files_build_a_wheel_that_installs_and_imports(tmp_path):
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    clone = tmp_path / "clone"
    for name in tracked:  # the tracked files as they are now: what a clone of this commit holds
        source = ROOT / name
        if source.is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, clone / name)
    # the build backend pyproject.toml names, from this environment when it is there (seconds; an isolated build
    # installs it first, half a minute)
    isolation = ["--no-build-isolation"] if _has_backend() else []
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(clone), "--no-deps", "-q", *isolation,
                            "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=280)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    wheel = next((tmp_path / "wheel").glob("lightning_paci-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names[-10:]
    assert "lightning_paci/strategy.py" in names and not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a wheel is installed by unpacking it
    probe = ("import lightning_paci, lightning.pytorch as pl; "
             "print(lightning_paci.__file__); print('paci' in pl.strategies.StrategyRegistry)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    location, registered = out.stdout.split()
    assert Path(location).is_relative_to(site) and registered == "True"
