"""tools/uv_sources.py: pip's package sources carried over to uv (make env), in pip's order of precedence."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("uv_sources", ROOT / "tools" / "uv_sources.py")
uv_sources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(uv_sources)


def test_sources_in_pips_order():
    listing = "\n".join([
        "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
        "global.find-links='/opt/wheels'",
        "global.constraint='/etc/pip/constraints.txt'",
        "global.cert='/etc/ssl/certs/ca.crt'",  # not a source: left out
        "install.find-links='/opt/install-wheels'",
        ":env:.find-links='/opt/env-wheels /opt/more'",  # the environment wins over the files
        "global.index-url='https://mirror.example/simple'",
        "not a setting",
    ])
    values = uv_sources.parse(listing)
    assert values == {"index-url": ["https://mirror.example/simple"],
                      "extra-index-url": ["file:///opt/a/simple", "file:///opt/b/simple"],
                      "find-links": ["/opt/env-wheels", "/opt/more"],
                      "constraint": ["/etc/pip/constraints.txt"]}
    assert uv_sources.arguments(values) == [
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///opt/a/simple", "--extra-index-url", "file:///opt/b/simple",
        "--find-links", "/opt/env-wheels", "--find-links", "/opt/more",
        "--constraint", "/etc/pip/constraints.txt"]


def test_nothing_configured_prints_nothing(tmp_path):
    env = {"PIP_CONFIG_FILE": "/dev/null", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "uv_sources.py")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == ""
    assert uv_sources.arguments(uv_sources.parse("")) == []


def test_a_pip_that_fails_is_named(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "uv_sources.py"), str(tmp_path / "python")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "pip config list` failed" in run.stderr
