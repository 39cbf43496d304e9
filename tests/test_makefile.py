"""The Makefile's install steps, read from ``make --dry-run`` on a fresh venv path: the demo
installs the package without the torch extra (about 900 MB it does not use); the tests and the
torch demo install it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def package_installs(target: str, venv: Path) -> list[str]:
    """The ``pip install -e`` commands ``make TARGET`` runs on a venv that does not exist."""
    dry_run = subprocess.run(
        ["make", "--dry-run", "--always-make", target, f"VENV={venv}"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return [
        line for line in dry_run.stdout.splitlines() if "pip install" in line and " -e " in line
    ]


def test_make_demo_installs_the_package_without_the_torch_extra(tmp_path):
    installs = package_installs("demo", tmp_path / "venv")
    assert installs and not any("torch" in line for line in installs), installs


@pytest.mark.parametrize("target", ["test", "demo-torch", "install"])
def test_tests_and_the_torch_demo_install_the_torch_extra(tmp_path, target):
    installs = package_installs(target, tmp_path / "venv")
    assert any("torch" in line for line in installs), installs
