"""Bad --moe-balancer configurations fail at startup with a message naming the flag.

Megatron's own parser and validation run (one subprocess, no distributed setup), then
``validate_ultraep_args`` as in pretrain_gpt.py.
"""

import json
import subprocess

import pytest

from gloo_launch import PYTHON, WORKERS, gloo_env
from megatron_runs import tiny_moe_args

BASE = tiny_moe_args(ep=1, train_iters=2)
ULTRAEP = ["--moe-balancer", "ultraep"]

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
    "trace_without_balancer": (["--moe-balancer-trace-dir", "/tmp/x"], "--moe-balancer-trace-dir"),
    "dense_model": (None, "--num-experts"),
}


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
    path = tmp_path_factory.mktemp("args") / "cases.json"
    path.write_text(json.dumps(cases))
    out = subprocess.run([PYTHON, str(WORKERS / "validate_balancer_args.py"), str(path)],
                         env=gloo_env({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}),
                         capture_output=True, text=True, timeout=300)
    found = {}
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("RESULT "):
            record = json.loads(line[len("RESULT "):])
            found[record["name"]] = record["error"]
    assert set(found) == set(CASES), out.stderr[-3000:]
    return found


@pytest.mark.parametrize("name", list(CASES))
def test_configuration(results, name):
    expected = CASES[name][1]
    if expected is None:
        assert results[name] is None, results[name]
    else:
        assert results[name] is not None, f"{name} was accepted"
        assert expected in results[name], results[name]
