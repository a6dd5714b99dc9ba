"""What every subcommand shares (``cli/common.py``): --output-dir is made, or refused in one line,
before any work; a corrupt trace fails in one line."""

from __future__ import annotations

from ultraep_megatron import traces
from ultraep_megatron.cli import main
from ultraep_megatron.cli.common import EXIT_OK, EXIT_USAGE


def test_output_dir_is_made_and_checked_before_the_work(trace_dir, tmp_path, capsys):
    """A missing --output-dir is created and reported; one that cannot be (under a file) fails at
    once, before the replay, in one line; a corrupt trace fails `trace info` in one line."""
    deep = tmp_path / "new" / "plots"
    assert (
        main(
            [
                "replay",
                str(trace_dir),
                "--balancers",
                "none,ultraep",
                "--no-staleness",
                "--no-cost",
                "--output-dir",
                str(deep),
                "--no-progress",
            ]
        )
        == EXIT_OK
    )
    assert f"created --output-dir {deep}" in capsys.readouterr().err
    assert (deep / "replay.json").is_file()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    (tmp_path / "iter_0000002").mkdir()
    for command in (
        ["replay", str(trace_dir)],
        ["advise", str(trace_dir)],
        ["resume-experiment", "--load", str(tmp_path), "--iterations", "1"],
    ):
        launch = (
            ["--", "touch", str(tmp_path / "launched")] if command[0] == "resume-experiment" else []
        )
        assert main([*command, "--output-dir", str(blocker / "plots"), *launch]) == EXIT_USAGE
        printed = capsys.readouterr()
        assert (
            printed.err.strip()
            == f"ultraep {command[0]}: error: --output-dir {blocker / 'plots'}: Not a directory"
        )
        assert "[replay]" not in printed.err and "Sweep" not in printed.out  # nothing ran
    assert not (tmp_path / "launched").exists()
    corrupt = tmp_path / "corrupt.uetrace"
    data = bytearray(traces.trace_path(trace_dir, 0).read_bytes())
    data[len(data) // 2] ^= 0xFF  # a record inside the file, not its tail
    corrupt.write_bytes(bytes(data))
    assert main(["trace", "info", str(corrupt)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert (
        err.startswith("ultraep trace info: error:")
        and "checksum" in err
        and len(err.strip().splitlines()) == 1
    )
