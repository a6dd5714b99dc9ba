"""The policy registry: one place for balancer names, knob defaults and validation, and the per-layer
balancing loop that the runtime, replay, the CLI and Megatron's argument parser all use.

The last test reads the source: no other module of the product defines a balancer name, a list
of them, a knob's default or a ``--moe-balancer-*`` flag."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest
import torch

from ultraep_megatron import planner
from ultraep_megatron.planner import baselines, policy
from ultraep_megatron.planner.policy import BalancerConfig, LayerBalancer
from ultraep_megatron.planner.synthetic import zipf_load

REPO = Path(__file__).resolve().parents[2]
PRODUCT = [*sorted((REPO / "ultraep_megatron").rglob("*.py")), *sorted((REPO / "tools").glob("*.py")),
           REPO / "pretrain_gpt.py"]
REGISTRY = REPO / "ultraep_megatron" / "planner" / "policy.py"


def test_names_defaults_and_the_flags_built_from_them():
    assert policy.MOE_BALANCERS == ("none", "ultraep", "eplb", "eplb-exact")
    assert set(policy.COMPARED) == set(policy.MOE_BALANCERS) | {policy.IDEAL}
    parser = argparse.ArgumentParser()
    policy.add_balancer_arguments(parser)
    args = parser.parse_args([])
    assert args.moe_balancer == "none"
    config = BalancerConfig.from_args(args)
    for knob in policy.KNOBS:  # parser default == dataclass default == the knob's default
        assert getattr(args, knob.dest) == knob.default == getattr(BalancerConfig(), knob.field), knob.flag
    assert config.num_slots == policy.DEFAULT_NUM_SLOTS == 2
    replay_parser = argparse.ArgumentParser()
    policy.add_balancer_arguments(replay_parser, runtime=False, balancer_flag=False)
    flags = {a.option_strings[0] for a in replay_parser._actions if a.option_strings}
    assert "--moe-balancer-trace-dir" not in flags and "--moe-balancer-num-slots" in flags
    # Knobs a parser does not define keep their defaults.
    partial = BalancerConfig.from_args(argparse.Namespace(moe_balancer="eplb", moe_balancer_eplb_window=4))
    assert (partial.name, partial.eplb_window, partial.num_slots) == ("eplb", 4, policy.DEFAULT_NUM_SLOTS)


@pytest.mark.parametrize("changes,flag", [
    ({"name": "lplb"}, "--moe-balancer"),
    ({"num_slots": -1}, "--moe-balancer-num-slots"),
    ({"num_slots": True}, "--moe-balancer-num-slots"),
    ({"min_quota": 0}, "--moe-balancer-min-quota"),
    ({"eplb_window": 0}, "--moe-balancer-eplb-window"),
    ({"eplb_interval": 0}, "--moe-balancer-eplb-interval"),
    ({"ring_size": 0}, "--moe-balancer-ring-size"),
    ({"trigger": 0.9}, "--moe-balancer-trigger"),
    ({"trigger": "1.2"}, "--moe-balancer-trigger"),
    ({"domain_size": 0}, "--moe-balancer-domain-size"),
    ({"hardware": "tpu-pod"}, "--moe-balancer-hardware"),
    ({"name": "none", "trace_dir": "/tmp/x"}, "--moe-balancer-trace-dir"),
])
def test_validation_names_the_flag(changes, flag):
    with pytest.raises(ValueError, match=flag):
        BalancerConfig(**changes)


def test_layer_balancer_plans_each_balancer():
    load = zipf_load(4, 16, 2.0, seed=3)
    assert LayerBalancer(BalancerConfig("ideal")).plan(load) is None
    identity = LayerBalancer(BalancerConfig("none")).plan(load)
    assert identity.num_slots == 0 and torch.equal(identity.quota, baselines.identity_plan(load).quota)
    ultraep = BalancerConfig("ultraep", num_slots=2, min_quota=8).build().plan(load)
    direct = planner.solve(load, 2, min_quota=8)
    assert torch.equal(ultraep.physical_split, direct.physical_split)
    exact = BalancerConfig("eplb-exact", num_slots=1).build().plan(load)
    assert torch.equal(exact.slot_expert, baselines.eplb_exact(load, 1).slot_expert)


def rank_loads_load(rank_loads, experts_per_rank: int = 2) -> torch.Tensor:
    """An int64 [R, R * G] load whose per-rank loads (experts at home) are ``rank_loads``: each
    rank's load split over its G experts and over the R source ranks as evenly as integers allow."""
    R, G = len(rank_loads), experts_per_rank
    per_expert = torch.tensor([[x // G + (j < x % G) for j in range(G)] for x in rank_loads]).view(-1)
    load = per_expert.unsqueeze(0) // R + (torch.arange(R).unsqueeze(1) < (per_expert % R).unsqueeze(0))
    assert load.sum(0).view(R, G).sum(1).tolist() == list(rank_loads)
    return load.to(torch.int64)


def test_trigger_gives_the_identity_plan_below_and_the_usual_plan_above():
    """An explicit trigger X: loads whose rank imbalance (planner.rank_imbalance) is below X get the
    identity plan with the same S slots (no replica, so no transfer at all); the others the planner's
    plan, with the configured floor and domains. eplb-exact ignores it."""
    config = BalancerConfig("ultraep", num_slots=2, min_quota=4, trigger=1.3, domain_size=2)
    balancer = config.build()
    below = rank_loads_load([128, 100, 100, 72])  # max / mean = 1.28
    above = rank_loads_load([132, 100, 100, 68])  # 1.32
    assert planner.rank_imbalance(below) < 1.3 <= planner.rank_imbalance(above)
    assert not balancer.balances(below) and balancer.balances(above)
    skipped = balancer.plan(below)
    identity = baselines.identity_plan(below, 2)
    for name in ("slot_expert", "quota", "physical_split"):
        assert torch.equal(getattr(skipped, name), getattr(identity, name)), name
    assert skipped.num_slots == 2 and not bool((skipped.slot_expert >= 0).any())
    balanced = balancer.plan(above)
    usual = planner.solve(above, 2, min_quota=4, domain_size=2)
    for name in ("slot_expert", "quota", "physical_split"):
        assert torch.equal(getattr(balanced, name), getattr(usual, name)), name
    assert bool((balanced.slot_expert >= 0).any()), "the load above the trigger is really balanced"
    assert planner.metrics(above, balanced, domain_size=2)["cross_domain_replicas"] == 0
    # Not ultraep's: the trigger and the floor are ultraep's knobs.
    exact = BalancerConfig("eplb-exact", num_slots=2, trigger=1.3).build()
    assert exact.balances(below) and torch.equal(exact.plan(below).slot_expert, baselines.eplb_exact(below, 2).slot_expert)


@pytest.mark.parametrize("min_quota,hardware", [(10, None), (None, None), (None, "h100-hgx")])
def test_default_trigger_is_the_floor_over_the_mean_rank_load(min_quota, hardware):
    """By default a load is balanced iff its busiest rank's excess over the mean reaches the quota
    floor q (given, derived from the hardware, or 1 % of the mean rank load): excess q - 1 is
    skipped, q is balanced."""
    from ultraep_megatron.analysis.cost import DEFAULT_SHAPE, hardware_preset, min_quota_from_hardware

    mean = 40_000
    if min_quota is not None:
        q = min_quota
    elif hardware is not None:
        q = min_quota_from_hardware(DEFAULT_SHAPE, hardware_preset(hardware), training=True)
        assert q == 833  # 989 TFLOP/s / (3 x 450 GB/s) + 100 GEMM-overhead tokens
    else:
        q = planner.default_min_quota(4 * mean, 4)  # 1 % of the mean: 400
    balancer = BalancerConfig("ultraep", num_slots=2, min_quota=min_quota, hardware=hardware).build()
    assert balancer.min_quota == (None if min_quota is None and hardware is None else q)
    for excess, balanced in ((q - 1, False), (q, True)):
        load = rank_loads_load([mean + excess, mean, mean, mean - excess])
        assert balancer.balances(load) == balanced, excess
        plan = balancer.plan(load)
        assert bool((plan.slot_expert >= 0).any()) == balanced
    assert not balancer.balances(torch.zeros(4, 8, dtype=torch.int64))  # nothing to balance
    # trigger 1 balances whatever the load
    assert BalancerConfig("ultraep", trigger=1.0).build().balances(rank_loads_load([10, 10, 10, 10]))


def test_hardware_presets_are_named_in_the_flag_help():
    from ultraep_megatron.analysis.cost import HARDWARE_PRESETS

    help_text = next(k.help for k in policy.KNOBS if k.field == "hardware")
    assert all(name in help_text for name in HARDWARE_PRESETS)


@pytest.mark.parametrize("window,interval", [(2, 3), (1, 1), (4, 2)])
def test_eplb_placement_follows_its_history(window, interval):
    """eplb re-plans every `interval` calls from the previous `window` loads (the current one on the
    first call) and spreads the current load round-robin: checked against a re-implementation."""
    loads = [zipf_load(4, 16, 1.5, seed=s) for s in range(9)]
    balancer = BalancerConfig("eplb", num_slots=2, eplb_window=window, eplb_interval=interval).build()
    placement = None
    for call, load in enumerate(loads):
        if call % interval == 0:
            history = loads[max(0, call - window):call] if call else [load]
            placement = baselines.eplb_slots(torch.stack(history).sum((0, 1)), 4, 2)
        plan = balancer.plan(load)
        assert torch.equal(plan.slot_expert, placement), call
        assert torch.equal(plan.physical_split, baselines.round_robin(load, placement).physical_split)


def test_one_imbalance_formula():
    load = torch.tensor([[3, 1, 0, 0], [0, 0, 0, 0]])
    assert planner.load_imbalance(torch.tensor([6.0, 2.0])).item() == 1.5
    assert planner.load_imbalance(torch.zeros(2, 3)).tolist() == [1.0, 1.0]
    m = planner.metrics(load, baselines.identity_plan(load))
    assert m["imbalance_before"] == m["imbalance_after"] == 4 / 2
    from ultraep_megatron.megatron import telemetry

    assert telemetry.load_imbalance is planner.load_imbalance


# ---------------------------------------------------------------------------------------------
# Grep-level: defined in one module
# ---------------------------------------------------------------------------------------------

def _string_constants(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node


def _not_a_name(tree: ast.AST) -> set[int]:
    """Strings that are not balancer names whatever they say: docstrings, ``__all__`` (function
    names) and the command's ``prog``."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            ids.update(id(c) for c in ast.walk(node.value))
        if isinstance(node, ast.keyword) and node.arg == "prog":
            ids.add(id(node.value))
    return ids


def definitions_outside_the_registry(paths) -> list[str]:
    """Where a module other than the registry names a balancer in code, lists balancer names,
    defines a --moe-balancer* flag or gives a knob field a literal default."""
    names = set(policy.MOE_BALANCERS) | {policy.IDEAL}
    distinctive = names - {policy.NONE}  # "none" is also an ordinary word of other flags' values
    knob_fields = {k.field for k in policy.KNOBS}
    found = []
    for path in paths:
        if path == REGISTRY:
            continue
        tree = ast.parse(path.read_text(), str(path))
        ignored = _not_a_name(tree)
        where = lambda node: f"{path.name}:{node.lineno}"  # noqa: E731
        for node in _string_constants(tree):
            if id(node) not in ignored and node.value in distinctive:
                found.append(f"{where(node)}: balancer name {node.value!r}")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in ignored:
                listed = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
                if len(listed) >= 2:
                    found.append(f"{where(node)}: a list of balancer names {listed}")
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value == policy.NONE for c in [node.left, *node.comparators]):
                if "balancer" in ast.unparse(node):
                    found.append(f"{where(node)}: compares a balancer with 'none'")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args \
                    and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("--moe-balancer"):
                found.append(f"{where(node)}: defines {node.args[0].value}")
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id in knob_fields and isinstance(node.value, ast.Constant):
                found.append(f"{where(node)}: a default for knob {node.target.id}")
    return found


def test_balancer_names_and_defaults_are_defined_in_one_module(tmp_path):
    assert definitions_outside_the_registry(PRODUCT) == []
    # Negative control: each kind of duplicate the rule is for is caught.
    duplicate = tmp_path / "duplicate.py"
    duplicate.write_text(
        'BALANCERS = ("none", "ultraep", "eplb")\n'
        'def f(args, parser):\n'
        '    if args.moe_balancer == "none":\n'
        '        return "eplb-exact"\n'
        '    parser.add_argument("--moe-balancer-num-slots", type=int, default=2)\n'
        'class Spec:\n'
        '    num_slots: int = 2\n')
    found = definitions_outside_the_registry([duplicate])
    kinds = " | ".join(found)
    for text in ("a list of balancer names", "compares a balancer with 'none'", "balancer name 'eplb-exact'",
                 "defines --moe-balancer-num-slots", "a default for knob num_slots"):
        assert text in kinds, (text, found)
