"""Bad --moe-balancer configurations fail at startup with a message naming the flag.

As in pretrain_gpt.py: UltraEP's startup checks on Megatron's parse of the command line, then
Megatron's own parser and validation (one subprocess for all cases, no distributed setup).
"""

import json
import subprocess
from pathlib import Path

import pytest

from gloo_launch import PYTHON, WORKERS, gloo_env
from megatron_runs import tiny_moe_args

BASE = tiny_moe_args(ep=1, train_iters=2)
ULTRAEP = ["--moe-balancer", "ultraep"]
# Trace directories, made by the fixture under its temporary directory ({tmp} below).
HELD_TRACE = "{tmp}/held/ep_group_0000.uetrace"    # an earlier run's trace
RESUMABLE = "{tmp}/ckpt/latest_checkpointed_iteration.txt"  # a checkpoint to resume
A_FILE = "{tmp}/a_file"

CASES = {
    # name: (extra argv, substring the error must contain; None = must pass)
    "valid_ultraep": (ULTRAEP, None),
    "valid_none": ([], None),
    "valid_eplb": (["--moe-balancer", "eplb", "--moe-balancer-eplb-window", "4"], None),
    "negative_slots": ([*ULTRAEP, "--moe-balancer-num-slots", "-1"], "--moe-balancer-num-slots"),
    "zero_min_quota": ([*ULTRAEP, "--moe-balancer-min-quota", "0"], "--moe-balancer-min-quota"),
    "bad_eplb_window": (["--moe-balancer", "eplb", "--moe-balancer-eplb-window", "0"], "--moe-balancer-eplb-window"),
    "ring_size_zero": ([*ULTRAEP, "--moe-balancer-ring-size", "0"], "--moe-balancer-ring-size"),
    "valid_domain_trigger_hardware": ([*ULTRAEP, "--moe-balancer-domain-size", "1", "--moe-balancer-trigger", "1.2",
                                       "--moe-balancer-hardware", "h100-hgx"], None),
    "domain_not_dividing_ep": ([*ULTRAEP, "--moe-balancer-domain-size", "2"], "--moe-balancer-domain-size 2"),
    "trigger_below_one": ([*ULTRAEP, "--moe-balancer-trigger", "0.5"], "--moe-balancer-trigger"),
    "unknown_hardware": ([*ULTRAEP, "--moe-balancer-hardware", "tpu"], "--moe-balancer-hardware"),
    "unknown_balancer": (["--moe-balancer", "magic"], "--moe-balancer"),
    "capacity_factor": ([*ULTRAEP, "--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor"),
    "allgather": ([*ULTRAEP, "--moe-token-dispatcher-type", "allgather"], "--moe-token-dispatcher-type"),
    # DeepEP / HybridEP are GPU-only: on this machine the flex dispatcher must be refused cleanly.
    "flex_without_deepep": ([*ULTRAEP, "--moe-token-dispatcher-type", "flex",
                             "--moe-flex-dispatcher-backend", "deepep"],
                            "--moe-flex-dispatcher-backend deepep"),
    "flex_ncclep": ([*ULTRAEP, "--moe-token-dispatcher-type", "flex",
                     "--moe-flex-dispatcher-backend", "ncclep"], "--moe-flex-dispatcher-backend ncclep"),
    "te_op_fuser": ([*ULTRAEP, "--use-transformer-engine-op-fuser"], "--use-transformer-engine-op-fuser"),
    # The replica experts share one module across layers: TE's cached fp8 weights would leak.
    "fp8": ([*ULTRAEP, "--fp8-format", "hybrid"], "--fp8-format"),
    # Its saved-tensor hooks would keep the shared replica weights as a later layer leaves them.
    "offload_experts": ([*ULTRAEP, "--fine-grained-activation-offloading", "--offload-modules", "attn_norm",
                         "expert_fc1"], "--offload-modules expert_fc1"),
    # FSDP gathers an expert only in its own hooks; the replica transfers read and write it outside.
    "megatron_fsdp": ([*ULTRAEP, "--use-megatron-fsdp", "--use-distributed-optimizer",
                       "--data-parallel-sharding-strategy", "optim_grads_params"], "--use-megatron-fsdp"),
    "torch_fsdp2": ([*ULTRAEP, "--use-torch-fsdp2", "--no-gradient-accumulation-fusion"], "--use-torch-fsdp2"),
    # What production runs (the distributed optimizer, overlapped reduction and gather, buckets
    # smaller than an expert, several instances) is accepted.
    "valid_production_ddp": ([*ULTRAEP, "--use-distributed-optimizer", "--overlap-grad-reduce",
                              "--overlap-param-gather", "--ddp-bucket-size", "2000",
                              "--ddp-average-in-collective"], None),
    "trace_without_balancer": (["--moe-balancer-trace-dir", "/tmp/x"], "--moe-balancer-trace-dir"),
    "dense_model": (None, "--num-experts"),
    "tensor_parallel_experts": ([*ULTRAEP, "--tensor-model-parallel-size", "2"],
                                "--expert-tensor-parallel-size"),
    "trace_dir_is_a_file": ([*ULTRAEP, "--moe-balancer-trace-dir", A_FILE], "not a directory"),
    "trace_dir_under_a_file": ([*ULTRAEP, "--moe-balancer-trace-dir", A_FILE + "/trace"],
                               "cannot create the directory"),
    "fresh_run_into_a_trace": ([*ULTRAEP, "--moe-balancer-trace-dir", "{tmp}/held"],
                               "already holds a trace (ep_group_0000.uetrace)"),
    "finetune_into_a_trace": ([*ULTRAEP, "--moe-balancer-trace-dir", "{tmp}/held",
                               "--load", "{tmp}/ckpt", "--finetune"], "already holds a trace"),
    "resume_into_its_trace": ([*ULTRAEP, "--moe-balancer-trace-dir", "{tmp}/held",
                               "--load", "{tmp}/ckpt"], None),
    "new_trace_dir": ([*ULTRAEP, "--moe-balancer-trace-dir", "{tmp}/new/trace"], None),
}
# Every case runs at EP=1: a balancer whose flags are valid is warned about it.
WARNED = {"valid_ultraep", "valid_eplb", "valid_domain_trigger_hardware", "valid_production_ddp", *(name for name in CASES if "trace" in name)} - {
    "trace_without_balancer"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases = []
    for name, (extra, _) in CASES.items():
        if extra is None:  # a dense model: drop the MoE flags
            argv = [a for a in BASE]
            for flag in ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                         "--moe-token-dispatcher-type", "--expert-model-parallel-size"):
                i = argv.index(flag)
                del argv[i:i + 2]
            argv += ULTRAEP
        else:
            argv = [*BASE, *extra]
        cases.append({"name": name, "argv": argv})
    tmp = tmp_path_factory.mktemp("args")
    for made in (HELD_TRACE, RESUMABLE, A_FILE):
        made = Path(made.format(tmp=tmp))
        made.parent.mkdir(parents=True, exist_ok=True)
        made.write_text("1")
    for case in cases:
        case["argv"] = [a.format(tmp=tmp) for a in case["argv"]]
    path = tmp / "cases.json"
    path.write_text(json.dumps(cases))
    out = subprocess.run([PYTHON, str(WORKERS / "validate_balancer_args.py"), str(path)],
                         env=gloo_env({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}),
                         capture_output=True, text=True, timeout=300)
    found = {}
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("RESULT "):
            record = json.loads(line[len("RESULT "):])
            found[record["name"]] = record
    assert set(found) == set(CASES), out.stderr[-3000:]
    return found


@pytest.mark.parametrize("name", list(CASES))
def test_configuration(results, name):
    expected, error = CASES[name][1], results[name]["error"]
    if expected is None:
        assert error is None, error
    else:
        assert error is not None, f"{name} was accepted"
        assert expected in error, error
    warnings = results[name]["warnings"]
    if name in WARNED:
        assert len(warnings) == 1 and "--expert-model-parallel-size 1" in warnings[0], warnings
    else:
        assert warnings == [], warnings
