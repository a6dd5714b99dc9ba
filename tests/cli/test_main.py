"""The `ultraep` command as a whole (``cli/__init__.py``): every --help, usage errors and warnings in
one line, the exit codes on truncated, foreign and bad input, and no test importing tools/."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ultraep_megatron import traces
from ultraep_megatron.cli import main
from ultraep_megatron.cli.common import EXIT_OK, EXIT_USAGE
from ultraep_megatron.planner.balancer import DEFAULT_NUM_SLOTS

REPO = Path(__file__).resolve().parents[2]
SUBCOMMANDS = (
    ["replay"],
    ["advise"],
    ["check-recipe"],
    ["resume-experiment"],
    ["trace"],
    ["trace", "info"],
    ["trace", "convert"],
    ["trace", "merge"],
    ["trace", "synth"],
)


def test_help_of_the_console_command_and_every_subcommand(capsys):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    top = subprocess.run(
        [sys.executable, "-m", "ultraep_megatron.cli", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
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


# A usage error of each (sub)command: what is missing or wrong.
BAD_USAGE = {
    ("replay",): [],
    ("advise",): ["T", "--slots", "x"],
    ("check-recipe",): ["--rack-size", "q"],
    ("resume-experiment",): ["--iterations", "1"],
    ("trace",): [],
    ("trace", "info"): [],
    ("trace", "convert"): ["DIR"],
    ("trace", "merge"): ["OUT"],
    ("trace", "synth"): ["s.uetrace", "--skew", "x"],
    (): ["bogus"],
}


def test_usage_errors_are_one_line_naming_the_command_and_its_help(capsys):
    """argparse's usage block is not printed before the error: one line, `ultraep CMD: error: ...`,
    with where the help is; exit status 2. Unknown arguments and arguments after -- are the
    subcommand's errors too."""
    assert {words for words in BAD_USAGE if words} == {tuple(words) for words in SUBCOMMANDS}
    cases = [
        *BAD_USAGE.items(),
        (("replay",), ["T", "--bogus"]),
        (("trace", "info"), ["T", "--", "x"]),
    ]
    for words, rest in cases:
        with pytest.raises(SystemExit) as exc:
            main([*words, *rest])
        err = capsys.readouterr().err
        prog = " ".join(["ultraep", *words])
        assert exc.value.code == EXIT_USAGE, words
        assert len(err.splitlines()) == 1 and err.startswith(f"{prog}: error: "), err
        assert err.rstrip().endswith(f"(see {prog} --help)"), err
    assert "error: unrecognized arguments: --bogus (see" in err_of(
        ["replay", "T", "--bogus"], capsys
    )
    assert "error: takes no arguments after -- (see" in err_of(
        ["trace", "info", "T", "--", "x"], capsys
    )


def err_of(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        main(argv)
    return capsys.readouterr().err


def test_warnings_are_one_line_under_the_command(trace_dir, tmp_path, capsys):
    """A truncated trace's warning is one line, `ultraep replay: warning: ...`, not Python's
    `file:line: Category: message` with the source line below it."""
    torn = tmp_path / "torn.uetrace"
    torn.write_bytes(traces.trace_path(trace_dir, 0).read_bytes()[:-45])
    with warnings.catch_warnings():
        warnings.simplefilter(
            "always"
        )  # whatever PYTHONWARNINGS says (tools/run_tests.sh ignores UserWarning)
        assert (
            main(
                [
                    "replay",
                    str(torn),
                    "--balancers",
                    "none",
                    "--no-staleness",
                    "--no-cost",
                    "--no-progress",
                ]
            )
            == EXIT_OK
        )
    err = capsys.readouterr().err
    assert err.splitlines() == [
        line for line in err.splitlines() if line.startswith("ultraep replay: warning: ")
    ]
    assert (
        len(err.splitlines()) == 1 and "torn.uetrace is truncated" in err and "Warning:" not in err
    )


def test_exit_codes_on_truncated_foreign_and_bad_input(trace_dir, tmp_path, capsys):
    blob = traces.trace_path(trace_dir, 0).read_bytes()
    torn = tmp_path / "torn.uetrace"
    torn.write_bytes(blob[:-45])
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        code = main(
            [
                "replay",
                str(torn),
                "--balancers",
                "none,ultraep",
                "--no-staleness",
                "--no-cost",
                "--no-progress",
            ]
        )
    assert code == EXIT_OK
    printed = capsys.readouterr()
    assert "TRUNCATED tail of" in printed.out and "ultraep replay: warning: " in printed.err
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
    assert (
        main(["replay", str(trace_dir), "--moe-balancer-num-slots", "-1", "--no-progress"])
        == EXIT_USAGE
    )
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
