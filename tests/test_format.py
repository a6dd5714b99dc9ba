"""The tree is formatted and linted as pyproject.toml's ``[tool.ruff]`` says (megatron-core's 100
columns): ``ruff format --check`` and ``ruff check`` pass, and a badly formatted file fails them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ruff(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_tree_is_formatted_and_linted():
    formatted = ruff("format", "--check", ".")
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr
    linted = ruff("check", ".")
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_negative_control_unformatted_file_fails(tmp_path):
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text("import os\nx = {  'a':1 }\n")
    assert ruff("format", "--check", ".", cwd=tmp_path).returncode == 1
    assert ruff("check", ".", cwd=tmp_path).returncode == 1  # os imported, unused
