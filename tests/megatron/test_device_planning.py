"""The device planner's self-check (``planner.self_check``) at a model's registration and the
hand-over it guards: the fused plan op checks itself against the host planner once per process and
model shape, and a model whose check fails plans on the host, with one warning line.

On the CPU the op runs the host code (the Triton kernel itself runs under ``TRITON_INTERPRET=1`` in
``tests/planner/test_fused_plan.py``); the faults are ``workers/pretrain_grad_dump.py``'s (every
way the tests break the balancer, in one place): the op returning a wrong plan, and one raising.
The multi-rank hand-over (a failure on one rank of the EP group) runs in
``test_balanced_moe_layer.py``'s ``device_planner_fallback``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import types
from pathlib import Path

import pytest
import torch

from ultraep_megatron.megatron.balanced_layer.context import BalancingContext
from ultraep_megatron.planner import BalancerConfig, self_check

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
    (4, 16, 2, 2, None, None),
    (8, 64, 4, 4, 300, None),
    (16, 64, 1, 8, None, 1.2),
    (8, 32, 0, None, None, None),
]


def config_of(S, N, min_quota, trigger) -> BalancerConfig:
    return BalancerConfig(
        "ultraep", num_slots=S, domain_size=N, min_quota=min_quota, trigger=trigger
    )


@pytest.mark.parametrize("R,E,S,N,min_quota,trigger", CONFIGS)
def test_the_self_check_passes_at_the_models_shape_once(R, E, S, N, min_quota, trigger):
    """The probes include the model's (R, E); the outcome is kept for the process."""
    config = config_of(S, N, min_quota, trigger)
    loads = self_check.probe_loads(config, (R, E))
    assert tuple(loads[-1].shape) == (R, E)
    self_check.OUTCOMES.clear()
    assert not self_check.checked(CPU, config, shape=(R, E))
    assert self_check.self_check(CPU, config, shape=(R, E)) == []
    assert self_check.checked(CPU, config, shape=(R, E))


@pytest.mark.parametrize("fault", ["device_planner_wrong_plan", "device_planner_raises"])
def test_negative_control_a_broken_op_fails_the_self_check(fault):
    config = config_of(2, None, None, None)
    with (
        FAULTS[fault](),
        pytest.raises(RuntimeError) if "raises" in fault else (contextlib.nullcontext()),
    ):
        problems = self_check.self_check(CPU, config, shape=(8, 64))
        assert problems and all("differs from the host planner's" in p for p in problems)
    self_check.OUTCOMES.clear()


def fake_layer(R, E):
    """What ``BalancingContext._check_device_planner`` reads of a layer's registration (no
    torch.distributed)."""
    return types.SimpleNamespace(
        ep_size=R, ep_rank=0, ep_group=None, num_experts=E, device=CPU, preprocess_graphed=False
    )


@pytest.mark.parametrize("fault", [None, "device_planner_wrong_plan", "device_planner_raises"])
def test_the_context_hands_over_to_the_host_planner_with_one_warning(fault, capsys):
    """A model built with ``--moe-balancer-planner device``: with a working op it keeps the
    device planner and prints its ready time once; with a broken one it plans on the host and prints
    exactly one line, a warning that says why and names ``--moe-balancer-planner host``."""
    self_check.OUTCOMES.clear()
    balancing = BalancingContext(config_of(2, None, None, None), planner="device")
    assert balancing.plans_on_device
    capsys.readouterr()
    with FAULTS[fault]() if fault else contextlib.nullcontext():
        balancing._check_device_planner(fake_layer(8, 64))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    if fault is None:
        assert balancing.plans_on_device and balancing.planner == "device"
        assert lines[0].startswith("ultraep: device planner ready in ")
        again = BalancingContext(config_of(2, None, None, None), planner="device")
        again._check_device_planner(fake_layer(8, 64))
        assert capsys.readouterr().out == ""  # checked once per process and shape
        return
    print(lines[0])
    assert not balancing.plans_on_device and balancing.planner == "host"
    assert lines[0].startswith("ultraep: warning: the device planner failed its self-check: ")
    assert lines[0].endswith(
        "planning on the host for this model "
        "(--moe-balancer-planner host skips the check and this warning)"
    )
