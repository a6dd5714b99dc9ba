"""The balanced dispatchers' reroute and permutation over the routed (token, expert) pairs.

``PhysicalSlots.physical_routing`` and ``BalancedAlltoAllDispatcher.permute`` work on the
``[T, k]`` top-k pairs (a stable sort by expert and a search into the plan's reroute table). The
reference is the implementation they replaced, kept here: dense over the ``[T, E]`` routing map (a
running count per expert over the tokens, a search per map entry). Both must give bit-identical
dispatched tokens, probabilities and physical maps, over random routings and plans of several
R / E / S / k. A device plan's record must cross to the host as the host planner makes it. The
reroute table and the pairs' instances themselves are tested in ``tests/planner/test_reroute.py``
and ``tests/planner/test_fused_plan.py``.
"""

import types

import pytest
import torch

from planner_helpers import (
    assign_tokens,
    host_balancer_cases,
    planned_routings,
    random_routing,
    routing_cases,
)
from ultraep_megatron.megatron.balanced_layer.context import BalancingContext, Overheads
from ultraep_megatron.megatron.balanced_layer.dispatchers import (
    BalancedAlltoAllDispatcher,
    PhysicalSlots,
)
from ultraep_megatron.megatron.balanced_layer.invocation import HostPlan
from ultraep_megatron.planner import BalancerConfig, fused_reroute
from ultraep_megatron.planner.fused_plan import host_parts
from ultraep_megatron.planner.record_layout import unpack_record
from ultraep_megatron.planner.solve import host_array


def stand_in(R, E, S, plan, load, rank, topk_ids):
    """The balanced all-to-all dispatcher's state its reroute and permutation read, with the
    invocation of ``plan`` on ``rank``: ``(dispatcher, invocation)``."""
    record, table = host_parts(
        host_array(load), plan, rank, balanced=True, min_quota=0, domain_size=R
    )
    planned = HostPlan(
        unpack_record(record, R, E, S), load, plan, torch.from_numpy(table), None, 0.0
    )
    slots = object.__new__(PhysicalSlots)
    slots.ep_size, slots.slots_per_rank, slots.sort_key = R, E // R + S, torch.int16
    slots.num_experts = E
    d = object.__new__(BalancedAlltoAllDispatcher)
    d.slots, d.num_out_tokens = slots, topk_ids.numel()
    d.invocation = types.SimpleNamespace(
        topk_ids=topk_ids,
        reroute_table=planned.table,
        plan=planned,
        context=types.SimpleNamespace(overheads=Overheads()),
    )
    return d, d.invocation


def permuted(d, probs):
    """``d.permute`` of the tokens ``arange(T)``: (sorted tokens [N], permuted probs [N])."""
    T = d.invocation.topk_ids.size(0)
    rows, permuted_probs = d.permute(torch.arange(T).view(T, 1), probs)
    assert torch.equal(rows.view(-1), d.reversed_local_input_permutation_mapping)
    return d.reversed_local_input_permutation_mapping, permuted_probs


def dense_reference(d, routing_map, probs):
    """The replaced implementation: (physical_map, physical_probs, sorted_tokens, permuted_probs)."""
    num_tokens, num_experts = routing_map.shape
    table = d.invocation.reroute_table
    counts = routing_map.t().contiguous().cumsum(dim=1)
    # Row 2 of the compact table (planner.record_layout): each expert's first position.
    position = (counts - 1 + table[2, :num_experts].unsqueeze(1)).t().reshape(-1)
    instance = torch.searchsorted(table[0], position, right=True)
    num_physical = d.slots.ep_size * d.slots.slots_per_rank
    instance_slot = table[1].index_select(0, instance).view(num_tokens, num_experts)
    slot = torch.where(routing_map, instance_slot, num_physical)
    physical_map = torch.zeros(num_tokens, num_physical + 1, dtype=torch.bool)
    physical_map = physical_map.scatter_(1, slot, routing_map)[:, :num_physical].contiguous()
    physical_probs = torch.zeros(num_tokens, num_physical + 1, dtype=probs.dtype)
    physical_probs = physical_probs.scatter(1, slot, probs)[:, :num_physical].contiguous()
    num_rows = d.num_out_tokens
    row = torch.where(routing_map.view(-1), table[3].index_select(0, instance) + position, num_rows)
    tokens = torch.arange(num_tokens).unsqueeze(1).expand(-1, num_experts).reshape(-1)
    sorted_tokens = torch.full((num_rows + 1,), -1, dtype=torch.int64).scatter_(0, row, tokens)[
        :num_rows
    ]
    permuted_probs = probs.new_zeros(num_rows + 1).scatter(0, row, probs.reshape(-1))[:num_rows]
    return physical_map, physical_probs, sorted_tokens, permuted_probs


@pytest.mark.parametrize("R,E,S,k,T,seed", list(routing_cases()))
def test_pairs_match_the_dense_implementation_bit_for_bit(R, E, S, k, T, seed):
    routings, load, plans = planned_routings(R, E, S, k, T, seed)
    replicated = 0
    for plan in plans:
        replicated += int((plan.slot_expert >= 0).sum())
        for rank, (ids, routing_map, probs) in enumerate(routings):
            # The router's indices come in any order within a token.
            shuffled = ids.gather(
                1,
                torch.argsort(
                    torch.rand(ids.shape, generator=torch.Generator().manual_seed(rank)), 1
                ),
            )
            d, invocation = stand_in(R, E, S, plan, load, rank, shuffled)
            probs = probs.clone().requires_grad_(True)
            physical_map, physical_probs = d.slots.physical_routing(invocation, probs)
            sorted_tokens, permuted_probs = permuted(d, probs)
            reference = dense_reference(d, routing_map, probs)
            for name, got, want in zip(
                ("physical map", "physical probs", "sorted tokens", "permuted probs"),
                (physical_map, physical_probs, sorted_tokens, permuted_probs),
                reference,
            ):
                assert got.dtype == want.dtype and torch.equal(got.detach(), want.detach()), (
                    f"rank {rank}: {name} differs"
                )
            # The same gradient in probs, through both differentiable outputs.
            generator = torch.Generator().manual_seed(seed)
            for got, want in ((physical_probs, reference[1]), (permuted_probs, reference[3])):
                upstream = torch.rand(got.shape, generator=generator)
                assert torch.equal(
                    torch.autograd.grad(got, probs, upstream)[0],
                    torch.autograd.grad(want, probs, upstream)[0],
                )
            assert torch.equal(
                d.slots.physical_ids(invocation).sort(1).values,
                assign_tokens(plan, rank, ids).sort(1).values,
            )
    if S > 0 and E > 4:
        assert replicated > 0, "the routings must make some plan replicate"


def test_negative_control_token_descending_order_differs(monkeypatch):
    """Pairs of an expert taken in token-descending order (an unstable order) must fail the
    comparison: it depends on the order the plan hands quotas out in."""
    routings, load, plans = planned_routings(4, 16, 2, 3, 33, 0)
    ids, routing_map, probs = routings[0]
    d, _ = stand_in(4, 16, 2, plans[0], load, 0, ids)
    ascending = fused_reroute.host_reroute

    def token_descending(topk_ids, hidden, probs, table, num_experts):
        # The pairs taken with the tokens reversed, then named by their own index again.
        T = topk_ids.shape[0]
        permuted_, permuted_probs, send_token, slot, row = ascending(
            topk_ids.flip(0), hidden.flip(0), probs.flip(0), table, num_experts
        )
        return permuted_, permuted_probs, (T - 1 - send_token).int(), slot.flip(0), row.flip(0)

    monkeypatch.setattr(fused_reroute, "host_reroute", token_descending)
    sorted_tokens, _ = permuted(d, probs)
    assert not torch.equal(sorted_tokens, dense_reference(d, routing_map, probs)[2])


def test_device_plan_crosses_to_the_host_intact():
    """A device plan's record (and, where the observers need it, the load) crosses to the host
    intact: at the wait its :class:`HostPlan` holds the host planner's record for the same load
    bit for bit (figures included), on both sides of the trigger; its negative control, another
    rank's record, differs."""
    config = BalancerConfig("ultraep", num_slots=2)
    schedule = types.SimpleNamespace(buffer=types.SimpleNamespace(schedule=print))
    contexts = {}
    for planner in ("device", "host"):
        contexts[planner] = context = BalancingContext(config, planner=planner, check_plans=True)
        context.ep_rank, context.slots = 1, schedule
    balancer, seen = config.build(), set()
    for candidate, balanced, expected in host_balancer_cases(config):
        seen.add(balanced)
        got = contexts["device"].start_plan(candidate, balancer).wait()
        want = contexts["host"].start_plan(candidate, balancer).wait()
        assert torch.equal(got.load, candidate) and got.balanced == balanced
        assert got.plan is None and got.table is None  # the device keeps its table
        assert (got.record.record == want.record.record).all()
        assert got.metrics() == want.metrics() and got.record.threshold == expected.threshold
        assert torch.equal(got.slot_expert, expected.slot_expert)
        contexts["host"].ep_rank = 2
        other = contexts["host"].start_plan(candidate, balancer).wait()
        contexts["host"].ep_rank = 1
        assert not (other.record.record == got.record.record).all()
    assert seen == {True, False}, "the loads must fall on both sides of the trigger"


def test_top_k_indices_from_the_tap_or_the_routing_map():
    """The tap hands over the indices megatron's top-k selected (or its RouterReplay's), once; a
    routing that never asked the hook gets them from the routing map."""
    from ultraep_megatron.megatron.balanced_layer.router_topk import TopKIndicesTap, topk_indices

    ids, routing_map, _ = random_routing(9, 16, 3, [0], torch.Generator().manual_seed(0))
    scores = torch.rand(9, 16)

    def compute_topk(scores, topk, num_groups=None, group_topk=None):
        return torch.topk(scores, k=topk, dim=1)

    tap = TopKIndicesTap()
    tap.layer_number = 5
    values, picked = tap.get_replay_topk(scores, 3, None, None, compute_topk)
    assert torch.equal(picked, scores.topk(3, dim=1).indices) and tap.layer_number == 5
    assert (
        topk_indices(tap, torch.zeros(9, 16, dtype=torch.bool).scatter_(1, picked, True), 3)
        is picked
    )
    assert tap.indices is None  # used once: the next routing must bring its own
    from_map = topk_indices(tap, routing_map, 3)
    assert torch.equal(from_map.sort(1).values, ids.sort(1).values)

    class Replay:  # megatron's RouterReplay, replaying recorded indices
        layer_number = None

        def get_replay_topk(self, scores, topk, num_groups, group_topk, default_compute_topk):
            return scores.gather(1, ids), ids

    replaying = TopKIndicesTap(Replay())
    replaying.layer_number = 7
    assert replaying.get_replay_topk(scores, 3, None, None, compute_topk)[1] is ids
    assert replaying.indices is ids and replaying.replay.layer_number == 7
