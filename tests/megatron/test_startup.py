"""pretrain_gpt.py's startup guardrails (``megatron/run/startup.py``), on real launches.

* On a machine without CUDA the CPU backend applies the missing CPU flags (``cpu.flags.CPU_FLAGS``)
  with one log line, and refuses a conflicting one (``--transformer-impl transformer_engine``).
* UltraEP's argument problems are reported once, on rank 0, one line each, before Megatron prints
  its argument dump, starts wandb or builds the model, and every rank exits with status 2.
* Every problem found is reported (CPU-flag conflicts, unknown flags, every balancer knob and
  setting), not only the first; a value Megatron's parser refuses is one line and a pointer to
  ``--help``, not argparse's whole usage (~750 lines).
"""

import subprocess

import pytest

from gloo_launch import REPO_ROOT, gloo_env, run_python
from megatron_runs import tiny_moe_args, torchrun

from ultraep_megatron.megatron.cpu.flags import CPU_FLAGS
from ultraep_megatron.traces import TRACE_SUFFIX

pytestmark = pytest.mark.slow

ARGUMENT_DUMP = "------------------------ arguments ------------------------"


def test_missing_cpu_flags_are_applied_with_one_log_line(initial_checkpoint):
    """The initial-checkpoint run was launched without any of the CPU flags, and trained."""
    checkpoint, run = initial_checkpoint
    notes = [line for line in run.log.splitlines() if "the CPU backend applied" in line]
    assert len(notes) == 1, notes
    for flag, (value, why) in CPU_FLAGS.items():
        assert f"{flag}{'' if value is None else ' ' + value} ({why})" in notes[0]
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_argument_problems_are_one_line_each_on_rank_zero_before_megatron_starts(tmp_path):
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    (trace_dir / f"ep_group_0000{TRACE_SUFFIX}").write_bytes(b"an earlier run's trace")
    args = [
        *tiny_moe_args(ep=2, train_iters=2),
        "--transformer-impl",
        "transformer_engine",
        "--moe-balancer",
        "ultraep",
        "--moe-balancer-trace-dir",
        trace_dir,
    ]
    status, output = torchrun(REPO_ROOT / "pretrain_gpt.py", 2, args)
    errors = [line for line in output.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert status != 0
    assert len(errors) == 2, output[-3000:]  # two problems, rank 0 only
    assert "--transformer-impl transformer_engine" in errors[0]
    assert "pass --transformer-impl local" in errors[0]
    assert f"--moe-balancer-trace-dir {trace_dir} already holds a trace" in errors[1]
    assert "exitcode  : 2" in output  # argparse's status (torchrun stops the other rank)
    for later in (ARGUMENT_DUMP, "> initializing torch distributed"):
        assert later not in output, later
    # The only traceback is torchrun's own failure summary, none from a rank.
    assert 'pretrain_gpt.py", line' not in output and "ultraep_megatron/" not in output


def _pretrain_gpt_alone(args: list[str]) -> subprocess.CompletedProcess:
    """pretrain_gpt.py as one process (rank 0 of no launcher): what a user types first."""
    env = gloo_env(
        {"PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    )  # the CPU backend's checks too
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return run_python(REPO_ROOT / "pretrain_gpt.py", args, env=env)


def _our_lines(completed: subprocess.CompletedProcess) -> list[str]:
    """pretrain_gpt.py's own lines (the CPU backend's banner and Megatron's import noise aside)."""
    return [line for line in completed.stderr.splitlines() if line.startswith("pretrain_gpt.py:")]


def test_a_value_the_parser_refuses_is_one_line_and_a_pointer_to_help():
    completed = _pretrain_gpt_alone(["--moe-balancer", "foo"])
    assert completed.returncode == 2, completed.stderr[-3000:]
    lines = _our_lines(completed)
    assert len(lines) == 2, completed.stderr[-3000:]
    assert lines[0].startswith(
        "pretrain_gpt.py: error: argument --moe-balancer: invalid choice: 'foo'"
    )
    assert lines[1] == "pretrain_gpt.py: `pretrain_gpt.py --help` lists every argument"
    # Not Megatron's whole usage: argparse printed ~750 lines before the error.
    assert "usage:" not in completed.stderr and "usage:" not in completed.stdout
    assert len(completed.stderr.splitlines()) < 60, len(completed.stderr.splitlines())


def test_every_startup_problem_is_reported_one_line_each():
    """Seven problems of four kinds at once: seven lines (the README's promise), then the pointer to
    --help for the unknown flag; no argument dump, status 2."""
    args = [
        *tiny_moe_args(ep=4, train_iters=2),
        "--num-experts",
        "6",
        "--distributed-backend",
        "nccl",
        "--transformer-impl",
        "transformer_engine",
        "--moe-balancer",
        "ultraep",
        "--moe-balancer-num-slot",
        "3",
        "--moe-balancer-num-slots",
        "-1",
        "--moe-balancer-trigger",
        "0.5",
        "--moe-token-dispatcher-type",
        "allgather",
    ]
    completed = _pretrain_gpt_alone(args)
    assert completed.returncode == 2, completed.stderr[-3000:]
    errors = [line for line in _our_lines(completed) if line.startswith("pretrain_gpt.py: error: ")]
    expected = [
        "--distributed-backend nccl cannot run without a CUDA device",
        "--transformer-impl transformer_engine cannot run without a CUDA device",
        "unrecognized arguments: --moe-balancer-num-slot 3 (--moe-balancer-num-slot: did you mean "
        "--moe-balancer-num-slots?)",
        "--num-experts 6 is not a multiple of --expert-model-parallel-size 4",
        "--moe-balancer-num-slots must be >= 0, got -1",
        "--moe-balancer-trigger must be >= 1.0, got 0.5",
        "--moe-token-dispatcher-type allgather is not supported",
    ]
    assert len(errors) == len(expected), completed.stderr[-3000:]
    for line, needle in zip(errors, expected):
        assert needle in line, (needle, line)
    assert (
        _our_lines(completed)[-1]
        == "pretrain_gpt.py: `pretrain_gpt.py --help` lists every argument"
    )
    assert ARGUMENT_DUMP not in completed.stdout and "Traceback" not in completed.stderr
