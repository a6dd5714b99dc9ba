"""What both balanced token dispatchers add to megatron's: :class:`PhysicalSlotRouting`.

Every EP rank owns ``P = G + S`` physical slots (its G main experts, then its S redundant slots), so
the parent dispatcher's permutation / all-to-all / chunk-sort machinery runs unchanged on ``R * P``
"experts". What is added here: the exact load ``[R, E]`` of the EP group, the invocation's plan
(made on the host from the load after its one host wait, ``BalancingContext.plan_on_host``, or on
the device, its host half crossing once the permutation is queued,
``BalancingContext.plan_on_device``), and the logical -> physical rewrite of the routed ``[T, k]``
(token, expert) pairs, on the device (the reroute: :func:`instances_of_positions` and the
``_pairs`` / ``_expert_major_order`` / ``physical_topk_ids`` methods).

The dispatcher holds the current invocation's record (:class:`~.invocation.InvocationState`,
``state``), as megatron's dispatchers hold their per-call metadata: the layer hands it in at
:meth:`PhysicalSlotRouting.begin_invocation`, and every later stage reads it there. The dispatcher
knows its model's context and the layer's balancer, never the layer.

The two dispatchers over it are in ``dispatchers``. Vocabulary (docs/glossary.md): R EP ranks, E
experts, G = E // R main experts per rank, S redundant slots per rank, P = G + S physical slots per
rank.
"""

from __future__ import annotations

import copy
import time
from typing import Optional

import torch

from ultraep_megatron.megatron.balanced_layer.context import BalancingContext
from ultraep_megatron.megatron.balanced_layer.invocation import Invocation, InvocationState
from ultraep_megatron.megatron.balanced_layer.native_torch import native_torch
from ultraep_megatron.megatron.balanced_layer.router_topk import topk_indices
from ultraep_megatron.planner import LayerBalancer, reroute


def _in_backward_pass() -> bool:
    """True while autograd's engine is executing a backward (e.g. an activation-recompute replay)."""
    return torch._C._current_graph_task_id() != -1


def _copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """The one device-to-host copy of an invocation: into pinned memory, non-blocking, then one wait
    on an event (megatron's dispatcher waits for its token counts the same way)."""
    host, copied = _start_copy_to_host(tensor)
    _wait_for_host_copy(copied)
    return host


def _wait_for_host_copy(copied) -> None:
    """The invocation's one host wait: for the load (host planner) or the plan's host half (device
    planner) to have crossed, where megatron's dispatcher waits for its token counts."""
    copied.synchronize()


def _start_copy_to_host(tensor: torch.Tensor, stream=None):
    """Start the copy of ``tensor`` into pinned host memory: (host tensor, event to wait on).

    With ``stream`` (CUDA) the copy runs there, after what the current stream queued so far, so its
    wait ends when ``tensor`` is ready, not when work queued after it (the token permutation) is done:
    megatron copies its token counts on a side stream the same way."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    copied = torch.cuda.Event()
    if stream is None:
        host.copy_(tensor, non_blocking=True)
        copied.record()
        return host, copied
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # the caller's stream may free it before the copy ran
        copied.record(stream)
    return host, copied


def instances_of_positions(
    running: torch.Tensor, positions: torch.Tensor, *, binary_search: bool
) -> torch.Tensor:
    """The reroute table column of each expert-major position (``planner.reroute.instances_of_positions``)."""
    return reroute.instances_of_positions(running, positions, binary_search=binary_search)


class PhysicalSlotRouting:
    """What both balanced dispatchers add to megatron's: physical-slot geometry, the exact load of
    the EP group, the invocation's record and plan, and the logical -> physical rewrite of the
    routing.

    Physical slot ``r * P + j`` (``P = G + S``) is rank ``r``'s main expert ``j`` for
    ``j < G = E // R`` and its redundant slot ``j - G`` otherwise. The parent dispatcher is built
    over ``R * P`` "experts", ``P`` of them local, so its permutation and communication run unchanged.
    """

    def __init__(
        self,
        num_local_experts,
        local_expert_indices,
        config,
        pg_collection,
        *,
        balancing: BalancingContext,
        balancer: LayerBalancer,
    ):
        """Args: as megatron's dispatcher (logical ``num_local_experts = G`` and expert ids, the
        model's config), plus the model's context (``balancing``: planning, the host copy stream)
        and the layer's ``balancer`` (its plans; its settings give ``S``)."""
        ep_size, ep_rank = pg_collection.ep.size(), pg_collection.ep.rank()
        self.balancing = balancing
        self.balancer = balancer
        self.num_logical_experts = config.num_moe_experts
        self.num_slots = balancer.config.num_slots
        self.slots_per_rank = num_local_experts + self.num_slots  # P = G + S physical slots
        physical_config = copy.copy(config)
        physical_config.num_moe_experts = ep_size * self.slots_per_rank
        local = [ep_rank * self.slots_per_rank + j for j in range(self.slots_per_rank)]
        # The current invocation's record (begin_invocation): its routed pairs, plan, reroute
        # table, and what is still crossing to the host.
        self.state: Optional[InvocationState] = None
        # The device plan's host half (int64, on the device): a graph output when megatron captures
        # the preprocessing (--cuda-graph-modules moe_preprocess: it is in cudagraph_attrs, and
        # megatron sets it from the graph's outputs at each replay), crossing after the graph.
        self.plan_host_half: Optional[torch.Tensor] = None
        # Sorting the pairs by expert on the narrowest integer that holds an expert id: the radix
        # sort's passes are over the key's bytes (CPU and CUDA).
        self._sort_key_dtype = (
            torch.int16 if config.num_moe_experts <= torch.iinfo(torch.int16).max else torch.int32
        )
        super().__init__(
            self.slots_per_rank, local, config=physical_config, pg_collection=pg_collection
        )
        self.cudagraph_attrs = [*self.cudagraph_attrs, "plan_host_half"]

    # The record's fields the stages read, under the names megatron's dispatcher code and the
    # reroute use.
    @property
    def invocation(self) -> Optional[Invocation]:
        """The current invocation's plan on the host (``None`` while it is on its way)."""
        return self.state.invocation

    @invocation.setter
    def invocation(self, invocation: Optional[Invocation]) -> None:
        self.state.invocation = invocation

    @property
    def topk_ids(self) -> Optional[torch.Tensor]:
        """[T, k] int64: the current invocation's routed pairs (logical experts)."""
        return self.state.topk_ids

    @topk_ids.setter
    def topk_ids(self, topk_ids: torch.Tensor) -> None:
        self.state.topk_ids = topk_ids

    @property
    def _table(self) -> Optional[torch.Tensor]:
        """The current invocation's reroute table on the device."""
        return self.state.reroute_table

    @_table.setter
    def _table(self, table: Optional[torch.Tensor]) -> None:
        self.state.reroute_table = table

    @property
    def deferred(self) -> Optional[str]:
        """What the dispatch node completes (:attr:`InvocationState.deferred`), or ``None``."""
        return self.state.deferred if self.state is not None else None

    def begin_invocation(
        self,
        state: InvocationState,
        routing_map: torch.Tensor,
        *,
        defer: bool = False,
        captured: bool = False,
    ) -> InvocationState:
        """Begin planning the invocation ``state`` describes (its routed pairs in
        ``state.topk_ids``) from the exact load of the EP group, or, in an activation-recompute
        replay, take the record its checkpointed forward stored. Returns the current record.

        ``defer`` (megatron's overlapped schedule, from its pre-dispatch node): the host wait moves
        to the dispatch node (:meth:`complete_deferred_plan`), where megatron's own dispatcher
        waits for its splits, so the host queues the other microbatch's backward of the experts
        before it waits. With the host planner the load then only starts crossing here.

        With the host planner (and in a replay) the load crosses to the host here, the host waits
        for it (the invocation's one host wait) and the record's invocation is set. With the device
        planner the plan and the reroute table are queued on the device: the host half of the plan
        crosses once the reroute and permutation are queued (:meth:`_complete_plan`), or, while the
        preprocessing is being captured into a CUDA graph that ends after it (``captured``:
        ``BalancedMoELayer.preprocess_captured_in_cuda_graph``), after each replay of the graph
        (:meth:`complete_plan_after_graph`): nothing here then reads the device on the host (the
        host planner cannot be captured: it reads the load).

        Args:
            state: the new record (the layer's mode, its routed pairs: ``[T, k]`` int64, or
                ``None``: taken from ``routing_map``).
            routing_map: [T, E] bool, exactly ``topk`` experts per token (dropless).
        """
        balancing = self.balancing
        if routing_map.dtype != torch.bool or routing_map.dim() != 2:
            raise ValueError("expected a [tokens, experts] bool routing map")
        if state.topk_ids is None:
            state.topk_ids = topk_indices(None, routing_map, self.config.moe_router_topk)
        self.plan_host_half = None
        if _in_backward_pass():
            replayed = balancing.replay(state.layer_number)
            replayed.topk_ids = state.topk_ids  # this replay's routing (the same pairs)
            self.state = state = replayed
        elif balancing.plans_on_device:
            self.state = state
            state.device_plan = balancing.plan_on_device(
                state, self._gather_load(routing_map), self.ep_rank
            )
            self.plan_host_half = state.device_plan.host_half
            state.reroute_table = state.device_plan.reroute_table
            if captured:
                # The host half crosses after each replay of the graph; --moe-balancer-check-plans
                # (device reads) does not check a plan made inside one.
                return state
            # The host half starts crossing now, beside the reroute and permutation queued next.
            state.crossing = _start_copy_to_host(
                state.device_plan.host_half, balancing.host_copy_stream(routing_map.device)
            )
            state.deferred = "device" if defer else None
            self._check_plan(routing_map)
            return state
        elif defer:
            # The load starts crossing now; the plan is made in the dispatch node, after the wait.
            self.state = state
            state.crossing = _start_copy_to_host(
                self._gather_load(routing_map), balancing.host_copy_stream(routing_map.device)
            )
            state.routing_map = routing_map
            state.deferred = "host"
            return state
        else:
            self.state = state
            load = _copy_to_host(self._gather_load(routing_map))
            balancing.plan_on_host(state, self.balancer, load, self.ep_rank)
        state.reroute_table = state.invocation.reroute_table.to(
            routing_map.device, non_blocking=True
        )
        self._check_plan(routing_map)
        return state

    def _complete_plan(self) -> None:
        """With the device planner, once the reroute and permutation are queued: the plan's host
        half crosses in one device-to-host copy and one wait (where megatron's dispatcher waits for
        its splits), and becomes the invocation. Nothing to do otherwise."""
        state = self.state
        if state.device_plan is None or state.crossing is None:
            return  # nothing pending, or its host half crosses after a graph
        device_plan, state.device_plan = state.device_plan, None
        host_half, copied = state.crossing
        state.crossing = None
        _wait_for_host_copy(copied)
        self._complete_device_plan(host_half, device_plan.plan_seconds)

    def _complete_device_plan(self, host_half: torch.Tensor, plan_seconds: float) -> None:
        self.balancing.complete_device_plan(
            self.state,
            host_half,
            ep_rank=self.ep_rank,
            ep_size=self.ep_size,
            num_experts=self.num_logical_experts,
            plan_seconds=plan_seconds,
        )
        self._take_invocation(self.state.invocation)

    def complete_plan_after_graph(self, state: Optional[InvocationState] = None) -> None:
        """After a replay of a CUDA graph of the preprocessing (device planner): the plan's host
        half, which megatron set from the graph's outputs (:attr:`plan_host_half`), crosses in one
        device-to-host copy and one wait, and becomes the invocation of ``state`` (the replay's new
        record; ``None``: the current one, deferred to the dispatch node). Nothing the capture ran
        on the host is used: a replay runs none of it (the graph ran this invocation's load gather,
        plan, reroute and permutation on the device)."""
        if state is not None:
            self.state = state
        if self.plan_host_half is None:
            raise RuntimeError(
                f"MoE layer {self.state.layer_number}: a graph of the preprocessing was "
                "replayed without the device plan's host half among its outputs (the "
                "preprocessing graph needs --moe-balancer-planner device)"
            )
        self.state.device_plan = None
        host_half, copied = _start_copy_to_host(
            self.plan_host_half, self.balancing.host_copy_stream(self.plan_host_half.device)
        )
        _wait_for_host_copy(copied)
        self._complete_device_plan(host_half, 0.0)

    def _take_invocation(self, invocation: Invocation) -> None:
        """Hook: the host metadata of a plan that arrived after the permutation was queued."""

    def defer_after_graph(self, state: InvocationState) -> None:
        """After a replay of a CUDA graph of the preprocessing, under the overlapped schedule: the
        plan's host half crosses in the dispatch node (:meth:`complete_deferred_plan`) into
        ``state``, the replay's new record."""
        self.state = state
        state.deferred = "graph"

    def can_defer(self) -> bool:
        """Whether the plan can be completed in the dispatch node (each dispatcher says): not
        where megatron's fused permutation (Transformer Engine's kernel over the physical routing
        map) runs in the pre-dispatch node on a plan made on the host, which that node must then
        wait for."""
        raise NotImplementedError

    @native_torch
    def complete_deferred_plan(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """In megatron's dispatch node (overlapped schedule), before the all-to-all: the one host
        wait of the invocation, for the load (host planner: the plan is made now) or the device
        plan's host half, where megatron's own dispatcher waits for its splits; then what needs
        the plan before the tokens move. Returns the tokens and probabilities to dispatch."""
        state = self.state
        deferred, state.deferred = state.deferred, None
        if deferred == "device":
            self._complete_plan()
        elif deferred == "graph":
            self.complete_plan_after_graph()
        elif deferred == "host":
            routing_map, state.routing_map = state.routing_map, None
            host_load, copied = state.crossing
            state.crossing = None
            _wait_for_host_copy(copied)
            self.balancing.plan_on_host(state, self.balancer, host_load, self.ep_rank)
            state.reroute_table = state.invocation.reroute_table.to(
                routing_map.device, non_blocking=True
            )
            self._check_plan(routing_map)
            return self._dispatch_inputs_of_plan(hidden_states, probs, routing_map)
        return hidden_states, probs

    def _dispatch_inputs_of_plan(self, hidden_states, probs, routing_map):
        """A deferred host plan's dispatch inputs from the pre-dispatch node's outputs (each
        dispatcher: :meth:`_deferred_dispatch_preprocess`)."""
        raise NotImplementedError

    @native_torch
    def _gather_load(self, routing_map: torch.Tensor) -> torch.Tensor:
        """[T, E] bool -> [R, E] int64 on the device: exact per-source load of the whole EP group."""
        local = routing_map.sum(dim=0)
        if self.ep_size == 1:
            return local.unsqueeze(0)
        # With expert-TP 1 the tp_ep group is the EP group, in EP-rank order. The all-to-all
        # dispatcher makes this exchange anyway for its splits (its ``preprocess`` then reuses it).
        # Counts need no autograd: the collective itself, not megatron's differentiable gather.
        gathered = local.new_empty(self.ep_size * self.num_logical_experts)
        torch.distributed.all_gather_into_tensor(gathered, local, group=self.tp_ep_group)
        return gathered.view(self.ep_size, self.num_logical_experts)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        if self.deferred == "host":
            return self._deferred_dispatch_preprocess(hidden_states, routing_map, probs)
        physical_map, physical_probs = self._reroute(routing_map, probs)
        out = super().dispatch_preprocess(hidden_states, physical_map, physical_probs)
        if self.deferred is None:
            self._complete_plan()
        return out

    def _deferred_dispatch_preprocess(self, hidden_states, routing_map, probs):
        """The pre-dispatch node's part of a deferred host plan: what needs no plan."""
        raise NotImplementedError

    def dispatch_postprocess_parts(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """``dispatch_postprocess`` with its rows split into the main experts' and the redundant
        slots' parts.

        Returns:
            (main_tokens [M, H], replica_tokens [N, H], rows_per_slot (megatron's tokens per local
            expert, ``P`` physical slots), main_probs [M], replica_probs [N]); ``M`` is the
            invocation's ``main_rows``.
        """
        tokens, rows_per_slot, permuted_probs = self.dispatch_postprocess(hidden_states, probs)
        # A split, not two slices: the backward of two slices zero-fills and adds two full-size
        # gradients, a split's concatenates once.
        rows = [self.invocation.main_rows, tokens.shape[0] - self.invocation.main_rows]
        main_tokens, replica_tokens = torch.split(tokens, rows)
        main_probs, replica_probs = torch.split(permuted_probs, rows)
        return main_tokens, replica_tokens, rows_per_slot, main_probs, replica_probs

    @property
    def replica_rows(self):
        """Rows each redundant slot's experts compute in this invocation (host ints): the plan's."""
        return self.invocation.replica_rows

    def combine_preprocess_parts(
        self, main_out: torch.Tensor, replica_out: torch.Tensor
    ) -> torch.Tensor:
        """``combine_preprocess`` of the main experts' and the redundant slots' outputs, stacked."""
        return self.combine_preprocess(torch.cat([main_out, replica_out]))

    def _check_plan(self, routing_map: torch.Tensor) -> None:
        """With ``--moe-balancer-check-plans`` only (device reads): the top-k pairs are the routing
        map's, and the routing is the load the invocation's plan was solved for (a plan made on the
        device is solved for this very routing's load)."""
        if not self.balancing.check_plans:
            return
        pairs = torch.zeros_like(routing_map).scatter_(1, self.topk_ids, True)
        if not torch.equal(pairs, routing_map):
            raise RuntimeError(
                f"MoE layer {self.state.layer_number}: the router's top-k indices are not "
                "its routing map's (not exactly top-k distinct experts per token)"
            )
        if self.invocation is not None and not torch.equal(
            routing_map.sum(dim=0).cpu(), self.invocation.load[self.ep_rank]
        ):
            raise RuntimeError(
                f"MoE layer {self.state.layer_number}: the routing differs from the load "
                "its plan was solved for (not exactly top-k per token, or a recompute "
                "replay that is not deterministic)"
            )

    def _pairs(self):
        """The invocation's routed pairs in the expert-major order, and each one's instance in the
        reroute table (``planner.reroute.expert_major_pairs``). Nothing over ``[T, E]``, no host
        read, fixed shapes.

        Returns:
            (order [N]: the row-major pair index at each expert-major position, positions [N]
            (``arange``), instance [N]: the reroute table column of each position).
        """
        return reroute.expert_major_pairs(self.topk_ids, self._table, self._sort_key_dtype)

    def _expert_major_order(self) -> torch.Tensor:
        """[N] the row-major pair index at each expert-major position (:meth:`_pairs`); needs no
        plan."""
        return reroute.expert_major_order(self.topk_ids, self._sort_key_dtype)

    @native_torch
    def physical_topk_ids(self) -> torch.Tensor:
        """[T, k] int64: the physical slot of each routed pair, exactly per the plan (the pairs of
        :attr:`topk_ids`, rewritten from logical experts to physical slots)."""
        order, _, instance = self._pairs()
        return reroute.physical_slot_ids(self._table, order, instance).view_as(self.topk_ids)

    @native_torch
    def _reroute(self, routing_map: torch.Tensor, probs: torch.Tensor):
        """Rewrite the routing from logical experts to physical slots, exactly per the plan. Device
        work only: no host read, fixed shapes.

        The plan gives each (expert, instance) a quota of this rank's pairs; pairs of an expert are
        taken in token order (the order megatron's permutation sorts them in), so the pair at
        position ``i`` of the expert-major order goes to the instance whose running quota total
        first exceeds ``i`` (:meth:`_pairs`).

        Args:
            routing_map: [T, E] bool, exactly ``topk`` experts per token (the pairs of
                :attr:`topk_ids`).
            probs: [T, E] router probabilities (differentiable).

        Returns:
            (physical_map [T, R * P] bool, physical_probs [T, R * P], differentiable in
            ``probs``).
        """
        t0 = time.perf_counter()
        num_tokens = routing_map.size(0)
        num_physical = self.ep_size * self.slots_per_rank
        physical_ids = self.physical_topk_ids()
        # A token's pairs land in distinct slots: the scatters are exact.
        physical_map = torch.zeros(
            num_tokens, num_physical, dtype=torch.bool, device=routing_map.device
        )
        physical_map.scatter_(1, physical_ids, True)
        physical_probs = probs.new_zeros(num_tokens, num_physical).scatter(
            1, physical_ids, probs.gather(1, self.topk_ids)
        )
        self.balancing.add_reroute_seconds(time.perf_counter() - t0)
        return physical_map, physical_probs
