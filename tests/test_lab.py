"""`make lab`'s JupyterLab renders the chapters' MyST (``{exercise}``, ``{term}``, ``{prf:...}``, math): the
jupyterlab-myst extension is pinned with JupyterLab in the requirements and the lock file that the venv is
built from (`make env`), and installed there as a prebuilt extension that JupyterLab finds."""

from __future__ import annotations

import json
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pins(path: Path) -> dict[str, str]:
    """``{normalised name: version}`` of the ``name==version`` lines of a requirements file."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def test_jupyterlab_myst_is_pinned_with_jupyterlab():
    direct, lock = _pins(ROOT / "requirements.txt"), _pins(ROOT / "requirements.lock")
    for name in ("jupyterlab", "jupyterlab-myst", "jupytext"):
        assert name in direct and direct[name] == lock.get(name), f"{name}: pinned alike in both files"
    assert "-r requirements.lock" in (ROOT / "environment.yml").read_text(), "Binder installs the same pins"


def test_the_venv_has_the_pinned_extension():
    try:
        installed = metadata.version("jupyterlab_myst")
    except metadata.PackageNotFoundError:
        pytest.skip("jupyterlab-myst is not installed in this environment (`make env` installs it)")
    assert installed == _pins(ROOT / "requirements.lock")["jupyterlab-myst"]
    ext = Path(sys.prefix) / "share/jupyter/labextensions/jupyterlab-myst/package.json"
    assert ext.is_file(), "the prebuilt extension, where JupyterLab looks for it"
    assert json.loads(ext.read_text())["version"] == installed
