"""pretrain_gpt.py's startup guardrails, on real launches.

* On a machine without CUDA the CPU backend applies the missing CPU flags (``cpu_backend.CPU_FLAGS``)
  with one log line, and refuses a conflicting one (``--transformer-impl transformer_engine``).
* UltraEP's argument problems are reported once, on rank 0, one line each, before Megatron prints
  its argument dump, starts wandb or builds the model, and every rank exits with status 2.
* When a balancer is selected, an MoE layer built without it (here: the MTP block left to
  Megatron's own spec, a fault of workers/pretrain_grad_dump.py) stops training at startup, named.
"""


import pytest

from gloo_launch import REPO_ROOT, WORKERS, gloo_env, run_process_group, torchrun_command
from megatron_runs import recipe_moe_args, tiny_moe_args

from ultraep_megatron.megatron.cpu_backend import CPU_FLAGS
from ultraep_megatron.traces import TRACE_SUFFIX

pytestmark = pytest.mark.slow

ARGUMENT_DUMP = "------------------------ arguments ------------------------"


def torchrun(script, nproc, args, env=None, timeout_s=300):
    """(exit status, combined output) of ``script`` on ``nproc`` gloo ranks."""
    completed = run_process_group(torchrun_command(script, nproc, args), cwd=REPO_ROOT, env=gloo_env(env),
                                  timeout_s=timeout_s)
    return completed.returncode, completed.stdout + completed.stderr


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


def test_an_unbalanced_moe_layer_stops_training_naming_it(tmp_path):
    """The MTP block built from Megatron's own spec (fault ``unbalanced_mtp_layer``) at EP=1,
    which also draws the nothing-to-balance warning."""
    args = [*recipe_moe_args(ep=1, train_iters=1), "--moe-balancer", "ultraep"]
    status, output = torchrun(WORKERS / "pretrain_grad_dump.py", 1, args, env={
        "ULTRAEP_GRAD_DUMP_DIR": str(tmp_path), "ULTRAEP_FAULTS": "unbalanced_mtp_layer"})
    assert status != 0
    assert "these MoE layers were built without the balancer: " \
           "mtp.layers.0.mtp_model_layer.mlp (MoELayer)" in output, output[-3000:]
    assert "decoder.layers" not in output.split("built without the balancer:")[1].splitlines()[0]
    warnings = [line for line in output.splitlines() if line.startswith("pretrain_gpt.py: warning:")]
    assert len(warnings) == 1 and "--expert-model-parallel-size 1" in warnings[0], warnings
    assert " iteration        1/" not in output, "training must not start"
