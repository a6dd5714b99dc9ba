"""What the tests of the ``ultraep`` command share: PNG checks and running ``ultraep replay``."""

from __future__ import annotations

from pathlib import Path

from ultraep_megatron.cli import main
from ultraep_megatron.cli.common import EXIT_OK

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path):
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000, path


def run_replay(capsys, *argv) -> str:
    """``ultraep replay ARGV --no-progress``, which must succeed; its stdout."""
    code = main(["replay", *map(str, argv), "--no-progress"])
    captured = capsys.readouterr()
    assert code == EXIT_OK, captured.err
    return captured.out
