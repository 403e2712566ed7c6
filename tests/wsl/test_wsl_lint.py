"""Every script in wsl/ passes shellcheck and follows the house rules (shebang, strict mode, --help)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from wslfakes import WSL_DIR

SCRIPTS = sorted(p for p in WSL_DIR.iterdir() if p.is_file())


def test_there_are_scripts():
    assert {p.name for p in SCRIPTS} >= {"doctor", "setup-host", "lan"}


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck is not installed (apt-get install -y shellcheck)")
def test_shellcheck_clean():
    proc = subprocess.run(["shellcheck", "--shell=bash", "--severity=style", *map(str, SCRIPTS)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_house_rules(script):
    text = script.read_text()
    lines = text.splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert lines[1].startswith(f"# wsl/{script.name} - "), "header comment says what the script does"
    assert "set -euo pipefail" in lines[:20]
    assert script.stat().st_mode & 0o111, "executable"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0 and proc.stdout.startswith("Usage: ")
