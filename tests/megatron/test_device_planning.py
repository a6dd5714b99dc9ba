"""``device_planning.self_check`` and the hand-over it guards: the device planner compiles and checks
itself against the host references at the first layer's registration, and a model whose check
fails plans on the host, with one warning line.

On the CPU the device planner runs its lockstep torch calls (fixed step counts, as a device
without Triton would), and the self-check compares them with the greedy's specification, the host
trigger and the host's ``rank_reroute``: the same comparison a GPU makes against its Triton kernel. The
faults are ``workers/pretrain_grad_dump.py``'s (every way the tests break the balancer, in one
place): a kernel returning a wrong plan, and one raising. The multi-rank hand-over (a failure on one
rank of the EP group) runs in ``test_balanced_moe_layer.py``'s ``device_planner_fallback``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import types
from pathlib import Path

import pytest
import torch

from ultraep_megatron import planner
from ultraep_megatron.megatron.balanced_layer import device_planning
from ultraep_megatron.megatron.balanced_layer.context import BalancingContext
from ultraep_megatron.planner import BalancerConfig

CPU = torch.device("cpu")


def _worker_faults() -> dict:
    path = Path(__file__).resolve().parent / "workers" / "pretrain_grad_dump.py"
    spec = importlib.util.spec_from_file_location("pretrain_grad_dump", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FAULTS


FAULTS = _worker_faults()
# (R, E, S, NVLink domain size, min quota, trigger): what the probe loads depend on.
CONFIGS = [
    (2, 8, 2, None, None, 1.5),
    (4, 8, 1, None, 1, None),
    (4, 16, 2, 2, None, None),
    (8, 64, 2, None, None, None),
    (8, 64, 4, 4, 300, None),
    (16, 64, 1, 8, None, 1.2),
    (8, 32, 0, None, None, None),
]


def config_of(S, N, min_quota, trigger) -> BalancerConfig:
    return BalancerConfig(
        "ultraep", num_slots=S, domain_size=N, min_quota=min_quota, trigger=trigger
    )


@pytest.mark.parametrize("R,E,S,N,min_quota,trigger", CONFIGS)
def test_the_self_check_passes_on_probe_loads_that_replicate(R, E, S, N, min_quota, trigger):
    """The device path (the torch calls here) agrees with the references for every rank's reroute
    table; the skewed probe load fires the host trigger and replicates wherever S and the domains
    leave room (in every domain); the uniform one does not fire it."""
    config = config_of(S, N, min_quota, trigger)
    skewed, uniform = device_planning.probe_loads(R, E, config)
    host = config.build()
    assert host.balances(skewed) and not host.balances(uniform)
    for rank in sorted(
        {0, R // 2, R - 1}
    ):  # the reroute tables of the first, a middle and the last
        check = device_planning.self_check(config, R, E, CPU, rank)
        assert check.failure is None, check.failure
        assert check.implementation == "torch" and check.seconds > 0
    domains, domain_size = R // (N or R), N or R
    assert check.replicas >= (domains if S > 0 and domain_size > 1 else 0), check
    assert check.replicas == 0 or S > 0


@pytest.mark.parametrize(
    "fault,message",
    [
        ("device_planner_wrong_plan", "differs from the reference in: "),
        ("device_planner_raises", "RuntimeError: triton compilation failed"),
    ],
)
def test_negative_control_a_broken_kernel_fails_the_self_check(fault, message):
    """The kernel returning a wrong plan (every threshold infeasible), or raising: the check fails
    and says why in one line; the references (the specification, the host planner) are untouched by
    the fault."""
    config = config_of(2, None, None, None)
    with FAULTS[fault]():
        check = device_planning.self_check(config, 8, 64, CPU, 3)
        reference = planner.device_solve(
            device_planning.probe_loads(8, 64, config)[0], 2, implementation="reference"
        )
    assert check.failure is not None and message in check.failure, check.failure
    assert "\n" not in check.failure
    assert int((reference.slot_expert >= 0).sum()) > 0  # the reference still replicates


def fake_layer(R, E):
    """What ``BalancingContext._check_device_planner`` reads of a layer's registration (no
    torch.distributed)."""
    return types.SimpleNamespace(
        ep_size=R, ep_rank=0, ep_group=None, num_experts=E, device=CPU, preprocess_graphed=False
    )


@pytest.mark.parametrize("fault", [None, "device_planner_wrong_plan", "device_planner_raises"])
def test_the_context_hands_over_to_the_host_planner_with_one_warning(fault, capsys):
    """A model built with ``--moe-balancer-planner device``: with a working kernel it keeps the
    device planner and prints its ready time once; with a broken one it plans on the host and prints
    exactly one line, a warning that says why and names ``--moe-balancer-planner host``."""
    balancing = BalancingContext(config_of(2, None, None, None), planner="device")
    assert balancing.plans_on_device
    capsys.readouterr()
    with FAULTS[fault]() if fault else contextlib.nullcontext():
        balancing._check_device_planner(fake_layer(8, 64))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    print(lines[0])
    if fault is None:
        assert balancing.plans_on_device and balancing.planner == "device"
        assert lines[0].startswith("ultraep: device planner ready in ")
        assert balancing.device_planner_check.seconds > 0
        return
    assert not balancing.plans_on_device and balancing.planner == "host"
    assert lines[0].startswith(
        "ultraep: warning: the device planner failed its self-check (torch): "
    )
    assert lines[0].endswith(
        "planning on the host for this model "
        "(--moe-balancer-planner host skips the check and this warning)"
    )
