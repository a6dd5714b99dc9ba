"""The `ultraep` command as a whole (``cli/__init__.py``): every --help, the exit codes on truncated,
foreign and bad input, and no test importing tools/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ultraep_megatron import traces
from ultraep_megatron.cli import main
from ultraep_megatron.cli.common import EXIT_OK, EXIT_USAGE
from ultraep_megatron.planner.balancer import DEFAULT_NUM_SLOTS

REPO = Path(__file__).resolve().parents[2]
SUBCOMMANDS = (["replay"], ["advise"], ["check-recipe"], ["resume-experiment"], ["trace"], ["trace", "info"],
               ["trace", "convert"], ["trace", "merge"], ["trace", "synth"])


def test_help_of_the_console_command_and_every_subcommand(capsys):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    top = subprocess.run([sys.executable, "-m", "ultraep_megatron.cli", "--help"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert top.returncode == 0, top.stderr
    for name in ("replay", "advise", "check-recipe", "resume-experiment", "trace", "exit status"):
        assert name in top.stdout
    for words in SUBCOMMANDS:
        with pytest.raises(SystemExit) as exc:
            main([*words, "--help"])
        assert exc.value.code == 0, words
        assert "usage: ultraep " + " ".join(words) in capsys.readouterr().out
    # The balancer flags and their defaults are the training ones, from the registry.
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = capsys.readouterr().out
    assert "--moe-balancer-num-slots S" in text and f"Default: {DEFAULT_NUM_SLOTS}." in text
    with pytest.raises(SystemExit) as exc:
        main(["replay"])  # no trace: argparse's usage error
    assert exc.value.code == EXIT_USAGE


def test_exit_codes_on_truncated_foreign_and_bad_input(trace_dir, tmp_path, capsys):
    blob = traces.trace_path(trace_dir, 0).read_bytes()
    torn = tmp_path / "torn.uetrace"
    torn.write_bytes(blob[:-45])
    with pytest.warns(traces.TraceTruncatedWarning):
        code = main(["replay", str(torn), "--balancers", "none,ultraep", "--no-staleness", "--no-cost", "--no-progress"])
    assert code == EXIT_OK
    assert "TRUNCATED tail of" in capsys.readouterr().out
    assert main(["replay", str(torn), "--strict", "--no-cost", "--no-progress"]) == EXIT_USAGE
    assert "is truncated" in capsys.readouterr().err
    foreign = tmp_path / "notes.uetrace"
    foreign.write_text("hello\n")
    for command in ("replay", "advise"):
        assert main([command, str(foreign), "--no-progress"]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert err.startswith(f"ultraep {command}: error:") and "not an UltraEP trace" in err
        assert len(err.strip().splitlines()) == 1  # one line, no traceback
    assert main(["replay", str(tmp_path / "missing")]) == EXIT_USAGE
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(trace_dir), "--balancers", "none,lplb"])
    assert exc.value.code == EXIT_USAGE and "unknown" in capsys.readouterr().err
    assert main(["replay", str(trace_dir), "--moe-balancer-num-slots", "-1", "--no-progress"]) == EXIT_USAGE
    assert "--moe-balancer-num-slots must be >= 0" in capsys.readouterr().err
    assert main(["replay", str(trace_dir), "--num-experts", "8", "--no-progress"]) == EXIT_USAGE
    assert "--num-experts 8 contradicts the trace (16)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["trace", "info", str(trace_dir), "--", "extra"])
    assert exc.value.code == EXIT_USAGE and "takes no arguments after --" in capsys.readouterr().err


def test_no_test_imports_tools_through_sys_path():
    """The tools users run are the package's `ultraep` command; tools/ keeps benchmarks and
    environment scripts, which no test imports."""
    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path == Path(__file__):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if ("sys.path" in line or "import_module" in line) and "tools" in line:
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []
