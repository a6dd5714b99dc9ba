"""pretrain_gpt.py's startup guardrails (``megatron/startup.py``), on real launches.

* On a machine without CUDA the CPU backend applies the missing CPU flags (``cpu.flags.CPU_FLAGS``)
  with one log line, and refuses a conflicting one (``--transformer-impl transformer_engine``).
* UltraEP's argument problems are reported once, on rank 0, one line each, before Megatron prints
  its argument dump, starts wandb or builds the model, and every rank exits with status 2.
"""


import pytest

from gloo_launch import REPO_ROOT
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
    args = [*tiny_moe_args(ep=2, train_iters=2), "--transformer-impl", "transformer_engine",
            "--moe-balancer", "ultraep", "--moe-balancer-trace-dir", trace_dir]
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
