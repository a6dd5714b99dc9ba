"""The fused reroute-and-permute (``planner/fused_reroute.py``, ``triton_reroute.py``): on every
planned routing its pairs go to the physical slots of the reroute oracle, its rows and probs (and
their gradients) are megatron's permutation of the physical routing map bit for bit; the Triton
kernels under ``TRITON_INTERPRET=1`` give the host path's outputs and gradients bit for bit; a
stale table and a mis-sized quota are caught."""

from __future__ import annotations


import pytest
import torch

from planner_helpers import REPO, assign_tokens, planned_routings, routing_cases, run_interpreted
from ultraep_megatron.planner.fused_plan import host_parts
from ultraep_megatron.planner.fused_reroute import reroute_permute


def table_of(plan, load, rank):
    R = load.shape[0]
    _, table = host_parts(load.numpy(), plan, rank, balanced=True, min_quota=1, domain_size=R)
    return torch.from_numpy(table)


def megatron_permute(plan, ids, hidden, pair_probs, slots):
    """megatron's ``permute`` of the physical routing map ``slots`` [T, k] (R*P experts)."""
    permute = pytest.importorskip("megatron.core.transformer.moe.moe_utils").permute
    T = ids.shape[0]
    num_physical = plan.num_ranks * plan.physical_slots_per_rank
    physical_map = torch.zeros(T, num_physical, dtype=torch.bool).scatter_(1, slots, True)
    physical_probs = pair_probs.new_zeros(T, num_physical).scatter(1, slots, pair_probs)
    tokens, probs, order, *_ = permute(hidden, physical_map, physical_probs, ids.numel())
    return tokens, probs, order


@pytest.mark.parametrize("R,E,S,k,T,seed", list(routing_cases()))
def test_reroute_permute_is_megatrons_permutation_of_the_plan(R, E, S, k, T, seed):
    routings, load, plans = planned_routings(R, E, S, k, T, seed)
    for plan in plans:
        for rank in range(R):
            ids, _, probs = routings[rank]
            table = table_of(plan, load, rank)
            hidden = torch.randn(T, 5, generator=torch.Generator().manual_seed(rank))
            pair_probs = probs.gather(1, ids)
            a_hidden, a_probs = hidden.clone().requires_grad_(), pair_probs.clone().requires_grad_()
            out = reroute_permute(ids, a_hidden, a_probs, table, num_experts=E)
            slots = assign_tokens(plan, rank, ids)
            assert torch.equal(out.pair_slot.long(), slots)
            b_hidden, b_probs = hidden.clone().requires_grad_(), pair_probs.clone().requires_grad_()
            tokens, permuted_probs, order = megatron_permute(plan, ids, b_hidden, b_probs, slots)
            assert torch.equal(out.permuted, tokens)
            assert torch.equal(out.permuted_probs, permuted_probs)
            assert torch.equal(out.send_token.long(), order)
            rows = torch.arange(ids.numel())
            assert torch.equal(out.send_token.long()[out.pair_row.reshape(-1).long()], rows // k)
            weight = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(7))
            for x, p, (hid, pr) in (
                (out.permuted, out.permuted_probs, (a_hidden, a_probs)),
                (tokens, permuted_probs, (b_hidden, b_probs)),
            ):
                ((x * weight).sum() + (p * p).sum()).backward()
            assert torch.equal(a_hidden.grad, b_hidden.grad)
            assert torch.equal(a_probs.grad, b_probs.grad)


def test_a_stale_or_mis_sized_table_is_seen():
    """Controls: the table of another load's plan, and one instance's running total moved by one
    (a mis-sized quota), send some pair elsewhere than the plan's oracle."""
    routings, load, plans = planned_routings(4, 16, 2, 3, 33, 0)
    ids = routings[1][0]
    hidden, probs = torch.randn(33, 4), torch.rand(33, 3)
    slots = assign_tokens(plans[0], 1, ids)
    good = reroute_permute(ids, hidden, probs, table_of(plans[0], load, 1), num_experts=16)
    assert torch.equal(good.pair_slot.long(), slots)
    _, other_load, other_plans = planned_routings(4, 16, 2, 3, 33, 1)
    stale = reroute_permute(
        ids, hidden, probs, table_of(other_plans[0], other_load, 1), num_experts=16
    )
    assert not torch.equal(stale.pair_slot.long(), slots)
    table = table_of(plans[0], load, 1)
    moved = next(c for c in range(table.shape[1]) if 0 < table[0, c] < table[0, -2])
    table[0, moved] -= 1
    sized = reroute_permute(ids, hidden, probs, table, num_experts=16)
    assert not torch.equal(sized.pair_slot.long(), slots)


_TRITON_SCRIPT = r"""
import json, sys
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
from planner_helpers import planned_routings
from ultraep_megatron.planner.fused_plan import host_parts
from ultraep_megatron.planner import fused_reroute

out = {"cases": 0, "mismatches": 0, "stale_mismatches": 0}
for R, E, S, k, T, seed in [(2, 8, 1, 2, 16, 0), (4, 16, 2, 3, 33, 1), (8, 64, 2, 8, 150, 2),
                            (8, 256, 3, 8, 48, 0)]:
    routings, load, plans = planned_routings(R, E, S, k, T, seed)
    for plan in plans[:2]:
        for rank in (0, R - 1):
            ids, _, probs = routings[rank]
            _, table = host_parts(load.numpy(), plan, rank, balanced=True, min_quota=1,
                                  domain_size=R)
            table = torch.from_numpy(table)
            hidden = torch.randn(T, 130, generator=torch.Generator().manual_seed(seed))
            pair_probs = probs.gather(1, ids)
            results = []
            for run in (fused_reroute._reroute_op, fused_reroute.host_reroute):
                h, p = hidden.clone().requires_grad_(), pair_probs.clone().requires_grad_()
                if run is fused_reroute.host_reroute:
                    fused_reroute.interpreting = lambda: False  # the op's host path
                o = fused_reroute.reroute_permute(ids, h, p, table, num_experts=E)
                w = torch.randn(o.permuted.shape, generator=torch.Generator().manual_seed(1))
                ((o.permuted * w).sum() + (o.permuted_probs ** 2).sum()).backward()
                results.append([o.permuted.detach(), o.permuted_probs.detach(), o.send_token,
                                o.pair_slot, o.pair_row, h.grad, p.grad])
                fused_reroute.interpreting = lambda: True
            out["cases"] += 1
            out["mismatches"] += not all(torch.equal(a, b) for a, b in zip(*results))
            stale = table.clone(); stale[0, :-1] = torch.roll(stale[0, :-1], 1)
            o = fused_reroute.reroute_permute(ids, hidden, pair_probs, stale, num_experts=E)
            out["stale_mismatches"] += not torch.equal(o.pair_slot, results[0][3])
print(json.dumps(out))
"""


def test_triton_kernels_match_the_host_path_bit_for_bit():
    """The count, scatter and un-permute kernels under ``TRITON_INTERPRET=1`` (through the op and
    its autograd) against the op's host path: rows, probs, tokens, slots, send rows and both
    gradients equal bit for bit on 16 routings (R 2-8, E <= 256, k <= 8, H = 130: two column
    blocks). Control: a table whose running totals are shifted moves pairs."""
    summary = run_interpreted(_TRITON_SCRIPT, str(REPO / "tests" / "planner"))
    assert summary["cases"] == 16 and summary["mismatches"] == 0
    assert summary["stale_mismatches"] >= 12


def test_the_backward_launches_only_the_unpermute():
    """The backward of ``reroute_permute`` is one ``unpermute_add``: autograd zero-fills no gradient
    for its three integer outputs (one launch each; without ``set_materialize_grads(False)`` this
    test sees three ``zeros``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    R, E, S, k, T, seed = 4, 8, 2, 2, 16, 0
    routings, load, plans = planned_routings(R, E, S, k, T, seed)
    ids, _, probs = routings[0]
    hidden = torch.randn(T, 5, requires_grad=True)
    out = reroute_permute(
        ids, hidden, probs.gather(1, ids), table_of(plans[0], load, 0), num_experts=E
    )
    loss = (out.permuted * out.permuted_probs[:, None]).sum()
    ops = Ops()
    with ops:
        loss.backward()
    names = [name.split(".")[0] for name in ops.names]
    assert "unpermute_add" in names and "zeros" not in names, names
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
