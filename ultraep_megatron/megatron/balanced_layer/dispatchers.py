"""The balanced token dispatchers: megatron's all-to-all and flex dispatchers run unchanged over
``R * P`` physical slots, with the splits, per-slot counts and reroute taken from the invocation's
plan (``invocation``, set by the layer in ``preprocess``).
"""

from __future__ import annotations

import copy
import time
from typing import List, Optional, Tuple

import torch

from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAlltoAllTokenDispatcher,
    MoEFlexTokenDispatcher,
    _HybridEPManager,
)

from ultraep_megatron.megatron.release.capabilities import flex_backend_problem
from ultraep_megatron.megatron.balanced_layer.invocation import BalancedInvocation, upload
from ultraep_megatron.planner import reroute
from ultraep_megatron.planner.fused_reroute import reroute_permute


def in_backward_pass() -> bool:
    """True while autograd's engine runs a backward (an activation-recompute replay)."""
    return torch._C._current_graph_task_id() != -1


class PhysicalSlots:
    """What both dispatchers add to megatron's: the physical geometry, the EP group's exact load
    and the reroute of the routing."""

    def __init__(self, num_local_experts: int, config, pg_collection, num_slots: int):
        self.ep_size, self.ep_rank = pg_collection.ep.size(), pg_collection.ep.rank()
        self.num_experts, self.num_slots = config.num_moe_experts, num_slots
        self.slots_per_rank = num_local_experts + num_slots  # P
        self.physical_config = copy.copy(config)
        self.physical_config.num_moe_experts = self.ep_size * self.slots_per_rank
        first = self.ep_rank * self.slots_per_rank
        self.local_slots = list(range(first, first + self.slots_per_rank))
        # The pairs are sorted by expert on the narrowest integer that holds an expert id.
        self.sort_key = (
            torch.int16 if self.num_experts <= torch.iinfo(torch.int16).max else torch.int32
        )

    def gather_load(self, routing_map: torch.Tensor, tp_ep_group) -> torch.Tensor:
        """[T, E] bool -> [R, E] int64 on the device: the exact load of the EP group (the exchange
        megatron's dispatcher makes for its splits; counts need no autograd)."""
        local = routing_map.sum(dim=0)
        if self.ep_size == 1:
            return local.unsqueeze(0)
        gathered = local.new_empty(self.ep_size * self.num_experts)
        torch.distributed.all_gather_into_tensor(gathered, local, group=tp_ep_group)
        return gathered.view(self.ep_size, self.num_experts)

    def physical_ids(self, invocation: BalancedInvocation) -> torch.Tensor:
        """[T, k] int64: the physical slot of each routed pair, exactly per the plan."""
        topk_ids = invocation.topk_ids
        order, _, instance = reroute.expert_major_pairs(
            topk_ids, invocation.reroute_table, self.sort_key
        )
        return reroute.physical_slot_ids(invocation.reroute_table, order, instance).view_as(
            topk_ids
        )

    def physical_routing(self, invocation, probs: torch.Tensor):
        """The routing rewritten from logical experts to physical slots: ``(map [T, R * P] bool,
        probs [T, R * P])``, differentiable in ``probs`` [T, E]. A token's pairs land in distinct
        slots, so the scatters are exact."""
        ids = self.physical_ids(invocation)
        T, num_physical = ids.size(0), self.ep_size * self.slots_per_rank
        physical_map = torch.zeros(T, num_physical, dtype=torch.bool, device=ids.device)
        physical_map.scatter_(1, ids, True)
        physical_probs = probs.new_zeros(T, num_physical).scatter(
            1, ids, probs.gather(1, invocation.topk_ids)
        )
        return physical_map, physical_probs

    def check_plan(self, invocation: BalancedInvocation, routing_map: torch.Tensor) -> None:
        """``--moe-balancer-check-plans`` (device reads): the pairs are the routing map's, and the
        routing is the load the plan was solved for."""
        pairs = torch.zeros_like(routing_map).scatter_(1, invocation.topk_ids, True)
        if not torch.equal(pairs, routing_map):
            raise RuntimeError(
                f"MoE layer {invocation.layer_number}: the router's top-k indices are not its "
                "routing map's (not exactly top-k distinct experts per token)"
            )
        plan = invocation.plan
        if plan is not None and not torch.equal(routing_map.sum(0).cpu(), plan.load[self.ep_rank]):
            raise RuntimeError(
                f"MoE layer {invocation.layer_number}: the routing differs from the load its plan "
                "was solved for (not exactly top-k per token, or a recompute replay that is not "
                "deterministic)"
            )

    def parts(self, tokens: torch.Tensor, probs: torch.Tensor, main_rows: int, past_rows: int = 0):
        """Dispatched rows split into the main experts', the redundant slots' and (a kernel's
        over-allocation) the rest: one split, whose backward concatenates once. Returns
        ``(main, replica, main_probs, replica_probs)``."""
        sizes = [main_rows, tokens.shape[0] - main_rows - past_rows, past_rows]
        main, replica, _ = torch.split(tokens, sizes)
        main_probs, replica_probs, _ = torch.split(probs, sizes)
        return main, replica, main_probs, replica_probs


class BalancedAlltoAllDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher over ``R * P`` physical slots. Splits and per-slot counts
    come from the plan, at the all-to-all (:meth:`token_dispatch`): no exchange, no host wait
    beyond the plan's."""

    def __init__(
        self, num_local_experts, local_expert_indices, config, pg_collection, *, num_slots
    ):
        self.slots = slots = PhysicalSlots(num_local_experts, config, pg_collection, num_slots)
        super().__init__(
            slots.slots_per_rank, slots.local_slots, slots.physical_config, pg_collection
        )
        self.invocation: Optional[BalancedInvocation] = None
        # The device plan's record: a graph output when megatron captures the preprocessing
        # (--cuda-graph-modules moe_preprocess sets it from the graph's outputs at each replay).
        self.plan_record: Optional[torch.Tensor] = None
        self.cudagraph_attrs = [*self.cudagraph_attrs, "plan_record"]
        # Permutation and chunk sort from the plan, or megatron's on the rerouted map (fused).
        self.expert_major: Optional[torch.Tensor] = None  # a host plan's pairs before it arrived
        self.permutes_from_plan = not (
            config.moe_permute_fusion
            or self.drop_and_pad
            or self.tp_size > 1
            or config.moe_router_padding_for_quantization
        )
        # A host plan may wait for the dispatch node where the plan permutes.
        self.defers_host_plans = self.permutes_from_plan

    def preprocess(self, routing_map: torch.Tensor) -> Optional[torch.Tensor]:
        """megatron's metadata step, from the plan: the rows this rank sends; splits and counts
        follow at the all-to-all. megatron's fused chunk sort reads the per-slot counts on the
        device: a device plan has them there; a host plan's start uploading (pinned)."""
        self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
        self.input_splits = self.output_splits = self.output_splits_tp = None
        invocation = self.invocation
        if self.config.moe_permute_fusion:
            if invocation.plan is None:  # a device plan: its counts are on the device
                self.num_global_tokens_per_local_expert = invocation.device_rows
            else:
                rows = invocation.plan.rows_per_source_slot
                device = invocation.topk_ids.device
                self.num_global_tokens_per_local_expert = upload(rows, device)
        return None

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """megatron's on the rerouted map where its kernels permute; else from the plan (no
        physical map), or before a host plan arrived expert-major (:meth:`planned_inputs`).
        Returns (tokens [N, H], probs [N]) in send order, ``N = T * topk``."""
        invocation = self.invocation
        if not self.permutes_from_plan:
            physical_map, physical_probs = self.slots.physical_routing(invocation, probs)
            return super().dispatch_preprocess(hidden_states, physical_map, physical_probs)
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = None  # never the logical map in the physical one's place
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.hidden_shape_before_permute = hidden_states.shape
        self.tokens_per_expert = self.preprocess(routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        return self.permute(hidden_states, probs)

    def permute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The tokens ``[T, H]`` and their probabilities (``[T, E]``, differentiable) in send order
        per the invocation's plan (one op, ``torch.ops.ultraep.reroute_permute``), or expert-major
        before a host plan arrived."""
        invocation = self.invocation
        t0 = time.perf_counter()
        topk_ids, topk = invocation.topk_ids, invocation.topk_ids.size(1)
        if invocation.reroute_table is None:
            self.expert_major = order = reroute.expert_major_order(topk_ids, self.slots.sort_key)
            tokens = torch.div(order, topk, rounding_mode="floor")
            pair_probs = probs.gather(1, topk_ids).reshape(-1)
            return hidden_states.index_select(0, tokens), pair_probs.index_select(0, order)
        rerouted = reroute_permute(
            topk_ids,
            hidden_states,
            probs.gather(1, topk_ids),
            invocation.reroute_table,
            num_experts=self.slots.num_experts,
        )
        # megatron's unpermute scatters with it: int64.
        self.reversed_local_input_permutation_mapping = rerouted.send_token.long()
        invocation.context.overheads.reroute_seconds += time.perf_counter() - t0
        return rerouted.permuted, rerouted.permuted_probs

    def planned_inputs(self, hidden_states, probs):
        """In the dispatch node, once a host plan arrived: the pre-dispatch node's expert-major rows
        moved to their instances' send rows (the send row of position ``i`` is ``table[3]`` at its
        instance plus ``i``); a permutation, so the gathers' backward scatters exactly."""
        invocation, order = self.invocation, self.expert_major
        if order is None:  # nothing waited for the plan
            return hidden_states, probs
        self.expert_major = None
        table = invocation.reroute_table
        positions = torch.arange(order.numel(), device=order.device)
        instance = reroute.instances_of_positions(table[0], positions, binary_search=order.is_cuda)
        source = torch.empty_like(positions).scatter_(
            0, table[3].index_select(0, instance) + positions, positions
        )
        tokens = torch.div(order, invocation.topk_ids.size(1), rounding_mode="floor")
        self.reversed_local_input_permutation_mapping = tokens.index_select(0, source)
        return hidden_states.index_select(0, source), probs.index_select(0, source)

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        """megatron's all-to-all with the plan's splits and per-slot counts (host integers)."""
        plan = self.invocation.wait()  # waited already: the one wait comes before the dispatch
        if self.ep_size > 1:
            self.input_splits, self.output_splits = plan.input_splits, plan.output_splits
            self.output_splits_tp = plan.output_splits.sum(keepdims=True)
        if not self.config.moe_permute_fusion:
            self.num_global_tokens_per_local_expert = plan.rows_per_source_slot
        self.tokens_per_expert = plan.rows_per_slot
        return super().token_dispatch(permutated_local_input_tokens, permuted_probs)

    def _chunk_sizes(self) -> Optional[Tuple[List[int], int, int, int]]:
        """``(rows [R * P] source-major, R, G, P)`` of the unfused chunk sort, which the parts
        methods run directly; ``None`` where megatron's sort runs (fused, one slot per rank)."""
        if not self.permutes_from_plan or self.num_local_experts == 1:
            return None
        rows = self.invocation.plan.rows_per_source_slot
        R, P = rows.shape
        return rows.reshape(-1).tolist(), R, P - self.slots.num_slots, P

    def dispatch_postprocess_parts(self, hidden_states, probs):
        """``dispatch_postprocess`` split into the main experts' and the redundant slots' rows:
        ``(main [M, H], replica [N, H], rows_per_slot [P], main_probs [M], replica_probs [N])``."""
        plan = self.invocation.plan
        sizes = self._chunk_sizes()
        if sizes is None:
            tokens, rows_per_slot, permuted_probs = self.dispatch_postprocess(hidden_states, probs)
            main, replica, main_probs, replica_probs = self.slots.parts(
                tokens, permuted_probs, plan.main_rows
            )
            return main, replica, rows_per_slot, main_probs, replica_probs
        rows, R, G, P = sizes
        parts = []
        for tensor in (hidden_states, probs):
            chunks = tensor.split(rows)
            for slots in (range(G), range(G, P)):
                parts.append(torch.cat([chunks[r * P + p] for p in slots for r in range(R)]))
        self.tokens_per_expert = None  # as megatron's postprocess leaves it
        main, replica, main_probs, replica_probs = parts
        return main, replica, plan.rows_per_slot, main_probs, replica_probs

    def combine_preprocess_parts(self, main_out, replica_out):
        """``combine_preprocess`` of the main and the redundant slots' outputs, without stacking
        them first (the unfused sort takes its chunks from the two parts)."""
        sizes = self._chunk_sizes()
        if sizes is None:
            return self.combine_preprocess(torch.cat([main_out, replica_out]))
        rows, R, G, P = sizes
        by_slot = [rows[r * P + p] for p in range(P) for r in range(R)]  # slot-major
        chunks = [*main_out.split(by_slot[: G * R]), *replica_out.split(by_slot[G * R :])]
        return torch.cat([chunks[p * R + r] for r in range(R) for p in range(P)])

    def replica_rows(self) -> Tuple[int, ...]:
        """Rows each redundant slot's experts compute (the plan's)."""
        return self.invocation.plan.replica_rows


class BalancedFlexDispatcher(MoEFlexTokenDispatcher):
    """megatron's flex dispatcher (DeepEP / HybridEP) on the rerouted map; HybridEP gets the
    plan's row counts (no GPU wait), DeepEP polls. GPU-only: :func:`flex_backend_problem`."""

    def __init__(
        self, num_local_experts, local_expert_indices, config, pg_collection, *, num_slots
    ):
        problem = flex_backend_problem(config)
        if problem:
            raise ValueError(f"--moe-balancer: {problem}")
        self.slots = slots = PhysicalSlots(num_local_experts, config, pg_collection, num_slots)
        super().__init__(
            slots.slots_per_rank, slots.local_slots, slots.physical_config, pg_collection
        )
        self.invocation: Optional[BalancedInvocation] = None
        self.plan_record: Optional[torch.Tensor] = None
        self.cudagraph_attrs = [*self.cudagraph_attrs, "plan_record"]
        self.permutes_from_plan = False
        self.defers_host_plans = True  # the fused dispatch permutes, in the dispatch node
        self._replica_rows: Tuple[int, ...] = ()  # per redundant slot, as dispatched
        self._rows_past_slots = 0  # dispatched rows past the last local slot
        self._deferred = None  # the layer's [S, B, H] while a host plan is on its way

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """megatron's on the rerouted map; before a host plan arrived (the overlapped schedule's
        pre-dispatch node) the tokens go on as they are and :meth:`planned_inputs` reroutes."""
        if self.invocation.reroute_table is None:
            self._deferred = hidden_states.shape
            return hidden_states.view(-1, hidden_states.shape[-1]), probs
        physical_map, physical_probs = self.slots.physical_routing(self.invocation, probs)
        return super().dispatch_preprocess(hidden_states, physical_map, physical_probs)

    def planned_inputs(self, hidden_states, probs):
        """In the dispatch node, once a host plan arrived: megatron's ``dispatch_preprocess`` on the
        rerouted map (the layer's ``[S, B, H]`` shape kept for the combine)."""
        if self._deferred is None:  # nothing waited for the plan
            return hidden_states, probs
        shape, self._deferred = self._deferred, None
        physical_map, physical_probs = self.slots.physical_routing(self.invocation, probs)
        hidden_states, token_probs = super().dispatch_preprocess(
            hidden_states, physical_map, physical_probs
        )
        self.hidden_shape = shape
        return hidden_states, token_probs

    def token_dispatch(
        self, hidden_states, probs=None, async_finish=True, allocate_on_comm_stream=True
    ):
        """megatron's fused dispatch; HybridEP gets the permuted size and per-slot counts from the
        plan (host integers: megatron's manager reads the GPU only where they are None)."""
        manager = self._comm_manager
        if not isinstance(manager, _HybridEPManager):
            return super().token_dispatch(
                hidden_states, probs, async_finish, allocate_on_comm_stream
            )
        align = (
            get_align_size_for_quantization(self.config)
            if self.config.fp8 or self.config.fp4
            else manager.pad_multiple or 1
        )
        rows = self.invocation.wait().rows_per_slot
        padded = (rows + align - 1) // align * align
        manager.num_permuted_tokens = int(padded.sum())
        dispatched = super().token_dispatch(
            hidden_states, probs, async_finish, allocate_on_comm_stream
        )
        manager.tokens_per_expert = padded
        return dispatched

    def dispatch_postprocess_parts(self, hidden_states, probs):
        """``dispatch_postprocess`` split into main and redundant slots' rows as dispatched (with
        padding); rows past the last slot are kept aside and get zero outputs."""
        tokens, rows_per_slot, permuted_probs = self.dispatch_postprocess(hidden_states, probs)
        dispatched = [int(n) for n in rows_per_slot.tolist()]  # host tensor
        G = self.slots.slots_per_rank - self.slots.num_slots
        self._replica_rows = tuple(dispatched[G:])
        main_rows = sum(dispatched[:G])
        self._rows_past_slots = tokens.shape[0] - main_rows - sum(self._replica_rows)
        main, replica, main_probs, replica_probs = self.slots.parts(
            tokens, permuted_probs, main_rows, self._rows_past_slots
        )
        return main, replica, rows_per_slot, main_probs, replica_probs

    def combine_preprocess_parts(self, main_out, replica_out):
        pieces = [main_out, replica_out]
        if self._rows_past_slots:
            pieces.append(main_out.new_zeros((self._rows_past_slots, main_out.shape[1])))
        return self.combine_preprocess(torch.cat(pieces))

    def replica_rows(self) -> Tuple[int, ...]:
        """Rows of each redundant slot as dispatched (padding included)."""
        return self._replica_rows


def balanced_dispatcher_class(config):
    """The balanced dispatcher for ``--moe-token-dispatcher-type``."""
    if config.moe_token_dispatcher_type == "flex":
        return BalancedFlexDispatcher
    return BalancedAlltoAllDispatcher
