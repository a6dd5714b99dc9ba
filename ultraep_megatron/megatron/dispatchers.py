"""The balanced token dispatchers: megatron's own, working in *physical-slot space*.

Every EP rank owns ``P = G + S`` physical slots (its G main experts, then its S redundant slots), so
the parent dispatcher's permutation / all-to-all / chunk-sort machinery runs unchanged on ``R * P``
"experts". What the balanced dispatchers add (:class:`_PhysicalSlotRouting`): the exact load ``[R, E]``
of the EP group, the invocation's plan (made on the host from the load after its one host wait,
``BalancingContext.plan``, or on the device, its host half crossing once the permutation is queued,
``BalancingContext.plan_on_device``), and the logical -> physical rewrite of the routed ``[T, k]``
(token, expert) pairs, on the device.

* :class:`BalancedAlltoAllDispatcher`: megatron's all-to-all dispatcher; splits and per-slot counts
  come from the host plan, and its unfused permutation and chunk sort are computed from the plan;
* :class:`BalancedFlexDispatcher`: megatron's flex dispatcher (DeepEP / HybridEP), GPU-only.

Vocabulary (docs/glossary.md): R EP ranks, E experts, G = E // R main experts per rank, S redundant
slots per rank, P = G + S physical slots per rank.
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAlltoAllTokenDispatcher,
    MoEFlexTokenDispatcher,
    _HybridEPManager,
)

from ultraep_megatron.megatron.capabilities import flex_backend_problem
from ultraep_megatron.megatron.device_planning import DevicePlanned
from ultraep_megatron.megatron.invocation import Invocation
from ultraep_megatron.megatron.router_topk import topk_indices
from ultraep_megatron.megatron.native_torch import native_torch
from ultraep_megatron.planner import reroute

if TYPE_CHECKING:
    from ultraep_megatron.megatron.context import BalancingContext


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


def instances_of_positions(running: torch.Tensor, positions: torch.Tensor, *, binary_search: bool) -> torch.Tensor:
    """The reroute table column of each expert-major position (``planner.reroute.instances_of_positions``)."""
    return reroute.instances_of_positions(running, positions, binary_search=binary_search)


class _PhysicalSlotRouting:
    """What both balanced dispatchers add to megatron's: physical-slot geometry, the exact load of
    the EP group, the invocation's plan, and the logical -> physical rewrite of the routing.

    Physical slot ``r * P + j`` (``P = G + S``) is rank ``r``'s main expert ``j`` for
    ``j < G = E // R`` and its redundant slot ``j - G`` otherwise. The parent dispatcher is built
    over ``R * P`` "experts", ``P`` of them local, so its permutation and communication run unchanged.
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection, layer):
        """Args: as megatron's dispatcher (logical ``num_local_experts = G`` and expert ids, the
        model's config), plus the owning ``layer`` (its layer number, balancer and context)."""
        ep_size, ep_rank = pg_collection.ep.size(), pg_collection.ep.rank()
        self.num_logical_experts = config.num_moe_experts
        self.num_slots = layer.balancer_config.num_slots
        self.slots_per_rank = num_local_experts + self.num_slots  # P = G + S physical slots
        physical_config = copy.copy(config)
        physical_config.num_moe_experts = ep_size * self.slots_per_rank
        local = [ep_rank * self.slots_per_rank + j for j in range(self.slots_per_rank)]
        self._layer = layer
        self.invocation: Optional[Invocation] = None
        # The invocation's routed pairs, [T, k] logical experts, and the reroute table on the device.
        self.topk_ids: Optional[torch.Tensor] = None
        self._table: Optional[torch.Tensor] = None
        # A plan made on the device whose host half has not crossed yet (--moe-balancer-planner device).
        self._pending: Optional[DevicePlanned] = None
        # Under megatron's overlapped schedule the plan is completed in the dispatch node, where
        # megatron's dispatcher waits for its splits (:meth:`complete_deferred_plan`): what is left
        # to complete there ("host": the load is crossing, "device": the device plan's host half,
        # "graph": the host half a replayed graph produced), or None.
        self.deferred: Optional[str] = None
        self._load_copy = None  # (pinned host copy of the load, its event) of a deferred host plan
        self._deferred_inputs = None  # (routing_map, training, grad_enabled, hidden_shape) of a deferred host plan
        self._expert_major: Optional[torch.Tensor] = None  # the deferred host plan's pair order
        self._pending_host = None  # (pinned host copy of the device plan's host half, its event)
        # The device plan's host half (int64, on the device): a graph output when megatron captures
        # the preprocessing (--cuda-graph-modules moe_preprocess: it is in cudagraph_attrs, and
        # megatron sets it from the graph's outputs at each replay), crossing after the graph.
        self.plan_host_half: Optional[torch.Tensor] = None
        # Sorting the pairs by expert on the narrowest integer that holds an expert id: the radix
        # sort's passes are over the key's bytes (CPU and CUDA).
        self._sort_key_dtype = torch.int16 if config.num_moe_experts <= torch.iinfo(torch.int16).max else torch.int32
        super().__init__(self.slots_per_rank, local, config=physical_config, pg_collection=pg_collection)
        self.cudagraph_attrs = [*self.cudagraph_attrs, "plan_host_half"]

    def plan(self, routing_map: torch.Tensor, topk_ids: Optional[torch.Tensor] = None, *,
             defer: bool = False) -> Optional[Invocation]:
        """Plan this invocation from the exact load of the EP group, or take the stored plan when
        this is an activation-recompute replay.

        ``defer`` (megatron's overlapped schedule, from its pre-dispatch node): the host wait moves
        to the dispatch node (:meth:`complete_deferred_plan`), where megatron's own dispatcher
        waits for its splits, so the host queues the other microbatch's backward of the experts
        before it waits. With the host planner the load then only starts crossing here.

        With the host planner (and in a replay) the load crosses to the host here, the host waits
        for it (the invocation's one host wait) and the invocation is returned. With the device
        planner the plan and the reroute table are queued on the device and ``None`` is returned:
        the host half of the plan crosses once the reroute and permutation are queued
        (:meth:`_complete_plan`), or, while the preprocessing is being captured into a CUDA graph
        that ends after it (``BalancedMoELayer.preprocess_captured_in_cuda_graph``), after each
        replay of the graph (:meth:`complete_plan_after_graph`): nothing here then reads the device
        on the host (the host planner cannot be captured: it reads the load).

        Args:
            routing_map: [T, E] bool, exactly ``topk`` experts per token (dropless).
            topk_ids: [T, k] int64, its experts (the router's top-k indices); ``None``: taken from
                ``routing_map``.
        """
        layer = self._layer
        balancing: BalancingContext = layer.balancing
        if routing_map.dtype != torch.bool or routing_map.dim() != 2:
            raise ValueError("expected a [tokens, experts] bool routing map")
        self.topk_ids = topk_ids if topk_ids is not None else topk_indices(None, routing_map, self.config.moe_router_topk)
        self._pending = self._pending_host = self.plan_host_half = None
        self.deferred = self._load_copy = self._deferred_inputs = self._expert_major = None
        if _in_backward_pass():
            invocation = balancing.replay(layer.layer_number)
        elif balancing.plans_on_device:
            self.invocation = None
            self._pending = balancing.plan_on_device(layer, self._gather_load(routing_map), self.ep_rank,
                                                     training=layer.training, grad_enabled=torch.is_grad_enabled())
            self.plan_host_half = self._pending.host_half
            self._table = self._pending.reroute_table
            if layer.preprocess_captured_in_cuda_graph():
                # The host half crosses after each replay of the graph; --moe-balancer-check-plans
                # (device reads) does not check a plan made inside one.
                return None
            # The host half starts crossing now, beside the reroute and permutation queued next.
            self._pending_host = _start_copy_to_host(self._pending.host_half,
                                                     balancing.host_copy_stream(routing_map.device))
            self.deferred = "device" if defer else None
            self._check_plan(routing_map)
            return None
        elif defer:
            # The load starts crossing now; the plan is made in the dispatch node, after the wait.
            self.invocation = None
            self._load_copy = _start_copy_to_host(self._gather_load(routing_map),
                                                  balancing.host_copy_stream(routing_map.device))
            self._deferred_inputs = (routing_map, layer.training, torch.is_grad_enabled())
            self.deferred = "host"
            return None
        else:
            load = _copy_to_host(self._gather_load(routing_map))
            invocation = balancing.plan(layer, load, self.ep_rank, training=layer.training,
                                        grad_enabled=torch.is_grad_enabled())
        self.invocation = invocation
        self._table = invocation.reroute_table.to(routing_map.device, non_blocking=True)
        self._check_plan(routing_map)
        return invocation

    def _complete_plan(self) -> None:
        """With the device planner, once the reroute and permutation are queued: the plan's host
        half crosses in one device-to-host copy and one wait (where megatron's dispatcher waits for
        its splits), and becomes the invocation. Nothing to do otherwise."""
        if self._pending_host is None:  # nothing pending, or its host half crosses after a graph
            return
        pending, self._pending = self._pending, None
        host_half, copied = self._pending_host
        self._pending_host = None
        _wait_for_host_copy(copied)
        self.invocation = self._layer.balancing.complete_device_plan(
            self._layer, host_half, training=pending.training, grad_enabled=pending.grad_enabled,
            plan_seconds=pending.plan_seconds)
        self._take_invocation(self.invocation)

    def complete_plan_after_graph(self) -> None:
        """After a replay of a CUDA graph of the preprocessing (device planner): the plan's host
        half, which megatron set from the graph's outputs (:attr:`plan_host_half`), crosses in one
        device-to-host copy and one wait, and becomes the invocation. Nothing the capture ran on the
        host is used: a replay runs none of it (the graph ran this invocation's load gather, plan,
        reroute and permutation on the device)."""
        if self.plan_host_half is None:
            raise RuntimeError(f"MoE layer {self._layer.layer_number}: a graph of the preprocessing was "
                               "replayed without the device plan's host half among its outputs (the "
                               "preprocessing graph needs --moe-balancer-planner device)")
        layer = self._layer
        self._pending = None
        host_half, copied = _start_copy_to_host(self.plan_host_half,
                                                layer.balancing.host_copy_stream(self.plan_host_half.device))
        _wait_for_host_copy(copied)
        self.invocation = layer.balancing.complete_device_plan(
            layer, host_half, training=layer.training, grad_enabled=torch.is_grad_enabled(), plan_seconds=0.0)
        self._take_invocation(self.invocation)

    def _take_invocation(self, invocation: Invocation) -> None:
        """Hook: the host metadata of a plan that arrived after the permutation was queued."""

    def defer_after_graph(self) -> None:
        """After a replay of a CUDA graph of the preprocessing, under the overlapped schedule: the
        plan's host half crosses in the dispatch node (:meth:`complete_deferred_plan`)."""
        self.deferred = "graph"

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
        deferred, self.deferred = self.deferred, None
        if deferred == "device":
            self._complete_plan()
        elif deferred == "graph":
            self.complete_plan_after_graph()
        elif deferred == "host":
            routing_map, training, grad_enabled = self._deferred_inputs
            self._deferred_inputs = None
            host_load, copied = self._load_copy
            self._load_copy = None
            _wait_for_host_copy(copied)
            layer = self._layer
            self.invocation = layer.balancing.plan(layer, host_load, self.ep_rank, training=training,
                                                   grad_enabled=grad_enabled)
            self._table = self.invocation.reroute_table.to(routing_map.device, non_blocking=True)
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

    def combine_preprocess_parts(self, main_out: torch.Tensor, replica_out: torch.Tensor) -> torch.Tensor:
        """``combine_preprocess`` of the main experts' and the redundant slots' outputs, stacked."""
        return self.combine_preprocess(torch.cat([main_out, replica_out]))

    def _check_plan(self, routing_map: torch.Tensor) -> None:
        """With ``--moe-balancer-check-plans`` only (device reads): the top-k pairs are the routing
        map's, and the routing is the load the invocation's plan was solved for (a plan made on the
        device is solved for this very routing's load)."""
        if not self._layer.balancing.check_plans:
            return
        pairs = torch.zeros_like(routing_map).scatter_(1, self.topk_ids, True)
        if not torch.equal(pairs, routing_map):
            raise RuntimeError(f"MoE layer {self._layer.layer_number}: the router's top-k indices are not "
                               "its routing map's (not exactly top-k distinct experts per token)")
        if self.invocation is not None and not torch.equal(
                routing_map.sum(dim=0).cpu(), self.invocation.load[self.ep_rank]):
            raise RuntimeError(f"MoE layer {self._layer.layer_number}: the routing differs from the load "
                               "its plan was solved for (not exactly top-k per token, or a recompute "
                               "replay that is not deterministic)")

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
        physical_map = torch.zeros(num_tokens, num_physical, dtype=torch.bool, device=routing_map.device)
        physical_map.scatter_(1, physical_ids, True)
        physical_probs = probs.new_zeros(num_tokens, num_physical).scatter(
            1, physical_ids, probs.gather(1, self.topk_ids))
        self._layer.balancing.overheads.reroute_seconds += time.perf_counter() - t0
        return physical_map, physical_probs


class BalancedAlltoAllDispatcher(_PhysicalSlotRouting, MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher over physical slots, driven by a per-microbatch plan.
    Its ``preprocess`` takes every split from the invocation's host metadata: no communication, no
    device-to-host copy, no host wait (megatron's own sync point stays unset)."""

    def preprocess(self, routing_map: torch.Tensor) -> Optional[torch.Tensor]:
        """All-to-all metadata from the plan: splits and per-slot row counts, on the host. A plan
        still on the device (device planner) leaves them to :meth:`_take_invocation`; only the fused
        chunk sort's device counts are there already."""
        self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
        if self.invocation is None:
            self.input_splits = self.output_splits = self.output_splits_tp = None
            self.num_global_tokens_per_local_expert = (
                self._pending.rows_per_source_slot if self.config.moe_permute_fusion else None)
            return None
        self._take_splits(self.invocation, upload=True)
        return self.invocation.rows_per_slot

    def _take_splits(self, invocation: Invocation, *, upload: bool) -> None:
        if self.ep_size > 1:
            self.input_splits = invocation.input_splits
            self.output_splits = invocation.output_splits
            self.output_splits_tp = np.array([invocation.output_splits.sum()])
        # [R_src, P]; megatron's fused chunk sort reads it on the device.
        rows = invocation.rows_per_source_slot
        if not self.config.moe_permute_fusion:
            self.num_global_tokens_per_local_expert = rows
        elif upload:
            self.num_global_tokens_per_local_expert = rows.to(self._table.device, non_blocking=True)

    def _take_invocation(self, invocation: Invocation) -> None:
        self._take_splits(invocation, upload=False)
        self.tokens_per_expert = invocation.rows_per_slot

    def can_defer(self) -> bool:
        """A host plan can wait for the dispatch node where the permutation is computed from the
        plan (:meth:`_deferred_dispatch_preprocess`), not by megatron's fused kernel; a device plan
        always can."""
        return self._permutes_from_plan() or self._layer.balancing.plans_on_device

    def _permutes_from_plan(self) -> bool:
        """Whether :meth:`dispatch_preprocess` permutes the tokens straight from the plan: megatron's
        unfused permutation, which it replaces (the fused one, TE's kernels on the physical map,
        stays megatron's)."""
        return not (self.config.moe_permute_fusion or self.drop_and_pad or self.tp_size > 1
                    or self.config.moe_router_padding_for_quantization)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """megatron's ``dispatch_preprocess`` (the same dispatcher state, its shared-expert and sync
        hooks), with the permutation computed from the plan instead of from a physical routing map.

        megatron's unfused permutation argsorts the whole ``[T, R * P]`` physical map to sort the
        (token, slot) pairs slot-major; the plan already says where each pair goes
        (:meth:`_permutation`), so neither the physical map nor that sort is built.

        Args:
            routing_map: [T, E] bool, logical experts, exactly ``topk`` per token.
            probs: [T, E] router probabilities.

        Returns:
            (permuted tokens [N, H], their probabilities [N]), ``N = T * topk``, physical-slot-major
            and token-ascending within a slot, as megatron's permutation of the physical map.
        """
        if self.deferred == "host":
            return self._deferred_dispatch_preprocess(hidden_states, routing_map, probs)
        if not self._permutes_from_plan():
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        # Read only by megatron's fused or drop-and-pad unpermute, neither of which runs here; None
        # so that nothing can mistake the logical map for the physical one.
        self.routing_map = None
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = hidden_states.shape
        sorted_tokens, permuted_probs = self._permutation(probs)
        self.reversed_local_input_permutation_mapping = sorted_tokens
        permuted = hidden_states.index_select(0, sorted_tokens)
        if self.deferred is None:
            self._complete_plan()
        return permuted, permuted_probs

    def _deferred_dispatch_preprocess(self, hidden_states, routing_map, probs):
        """A deferred host plan's pre-dispatch part (overlapped schedule): the routed pairs sorted
        expert-major by *logical* expert, which needs no plan (megatron's permutation of the
        logical routing, computed as :meth:`_permutation` computes the physical one), so megatron
        can free this node's outputs after the dispatch as it frees its own permuted tokens. The
        dispatch node then moves each expert's run of pairs to its instances' rows
        (:meth:`_dispatch_inputs_of_plan`).

        Returns:
            (tokens [N, H] and their probabilities [N], expert-major), ``N = T * topk``.
        """
        if not self._permutes_from_plan():
            raise RuntimeError("a deferred plan needs the permutation from the plan (can_defer)")
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = None  # as in dispatch_preprocess: never the logical map for the physical
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.hidden_shape_before_permute = hidden_states.shape
        self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
        self.input_splits = self.output_splits = self.output_splits_tp = None
        self._expert_major = order = self._expert_major_order()
        topk = self.topk_ids.size(1)
        tokens = hidden_states.index_select(0, torch.div(order, topk, rounding_mode="floor"))
        pair_probs = probs.gather(1, self.topk_ids).reshape(-1).index_select(0, order)
        return tokens, pair_probs

    @native_torch
    def _dispatch_inputs_of_plan(self, hidden_states, probs, routing_map):
        """The all-to-all's send buffer from the expert-major pairs, exactly per the plan: the same
        rows :meth:`dispatch_preprocess` builds without deferral (the send row of expert-major
        position ``i`` is row 3 of the reroute table at its instance, plus ``i``)."""
        self._take_invocation(self.invocation)
        order, self._expert_major = self._expert_major, None
        positions = torch.arange(order.numel(), device=order.device)
        instance = instances_of_positions(self._table[0], positions, binary_search=order.is_cuda)
        row = self._table[3].index_select(0, instance) + positions
        # position of each send row: a permutation, so the gathers' backward scatters exactly
        source = torch.empty_like(row).scatter_(0, row, positions)
        topk = self.topk_ids.size(1)
        self.reversed_local_input_permutation_mapping = torch.div(order, topk, rounding_mode="floor").index_select(0, source)
        return hidden_states.index_select(0, source), probs.index_select(0, source)

    @native_torch
    def _permutation(self, probs: torch.Tensor):
        """Where each routed (token, expert) pair goes in the all-to-all's send buffer, exactly per
        the plan. Device work only: no host read, fixed shapes, nothing over ``[T, E]`` but the
        gather of the pairs' probabilities.

        A pair's expert-major position picks its instance (:meth:`_pairs`); row 3 of the plan's
        reroute table turns the position into its send-buffer row (the instance's slot's first
        row, plus the pair's rank among the instance's pairs, which the plan hands out in token
        order).

        Args:
            probs: [T, E] router probabilities (differentiable).

        Returns:
            (sorted_tokens [N] int64: the token of each send-buffer row, permuted_probs [N],
            differentiable in ``probs``), ``N = T * topk``.
        """
        t0 = time.perf_counter()
        topk = self.topk_ids.size(1)
        order, positions, instance = self._pairs()
        row = self._table[3].index_select(0, instance) + positions
        # Every row is written once; -1 would fail the token gather loudly if the routing ever
        # left one unwritten (a routing other than the plan's load).
        sorted_tokens = torch.full_like(order, -1).scatter_(0, row, torch.div(order, topk, rounding_mode="floor"))
        pair_probs = probs.gather(1, self.topk_ids).reshape(-1).index_select(0, order)
        permuted_probs = pair_probs.new_zeros(pair_probs.shape).scatter(0, row, pair_probs)
        self._layer.balancing.overheads.reroute_seconds += time.perf_counter() - t0
        return sorted_tokens, permuted_probs

    def _sorts_chunks_on_host(self) -> bool:
        """Whether megatron's chunk sort here is the unfused split-and-concatenate over (physical
        slot, source rank) chunks, which the two ``*_parts`` methods reproduce directly. Other paths
        (fused sort, expert TP, capacity padding, one slot per rank) go through megatron's."""
        # Capacity padding and expert TP are refused at startup (unsupported_moe_settings); tested
        # here as well, so that lifting a refusal cannot silently take the wrong chunk order.
        return not (self.config.moe_permute_fusion or self.drop_and_pad or self.tp_size > 1
                    or self.num_local_experts == 1)

    def dispatch_postprocess_parts(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """``dispatch_postprocess`` split into main and replica parts, concatenating each part's
        chunks directly (unfused sort).

        megatron's unfused sort splits the all-to-all output into (source rank, physical slot)
        chunks and concatenates them slot-major; concatenating the main slots' and the redundant
        slots' chunks separately gives the two parts with the same copy, and no split whose backward
        copies the whole gradient once more. Chunk sizes and order come from the host plan.
        """
        if not self._sorts_chunks_on_host():
            return super().dispatch_postprocess_parts(hidden_states, probs)
        rows = self.invocation.rows_per_source_slot.numpy()  # [R_src, P], host
        R, P = rows.shape
        G = P - self.num_slots
        sizes = rows.ravel().tolist()  # source-major: source r, slot p
        parts = []
        for tensor in (hidden_states, probs):
            chunks = tensor.split(sizes)
            parts.append([torch.cat([chunks[r * P + p] for p in slots for r in range(R)])
                          for slots in (range(G), range(G, P))])
        (main_tokens, replica_tokens), (main_probs, replica_probs) = parts
        self.tokens_per_expert = None  # as megatron's postprocess leaves it
        return main_tokens, replica_tokens, self.invocation.rows_per_slot, main_probs, replica_probs

    def combine_preprocess_parts(self, main_out: torch.Tensor, replica_out: torch.Tensor) -> torch.Tensor:
        """``combine_preprocess`` of the main experts' and the redundant slots' outputs stacked
        (``[main rows + replica rows, H]``), without stacking them first (unfused sort).

        megatron's unfused chunk sort splits its input into (physical slot, source rank) chunks and
        concatenates them source-major; taking the chunks from the two parts directly makes one
        copy of the expert outputs instead of two. Chunk sizes and order come from the host plan.
        """
        if not self._sorts_chunks_on_host():
            return super().combine_preprocess_parts(main_out, replica_out)
        rows = self.invocation.rows_per_source_slot.numpy()  # [R_src, P], host
        R, P = rows.shape
        G = P - self.num_slots
        chunks = [*main_out.split(rows[:, :G].T.ravel().tolist()),  # slot-major: slot p, source r
                  *replica_out.split(rows[:, G:].T.ravel().tolist())]
        return torch.cat([chunks[p * R + r] for r in range(R) for p in range(P)])


class BalancedFlexDispatcher(_PhysicalSlotRouting, MoEFlexTokenDispatcher):
    """megatron's flex dispatcher (DeepEP / HybridEP fused all-to-all) over physical slots.

    The fused kernels route on the physical routing as they would on the logical one; what is added
    is what the plan already knows. HybridEP gets every local slot's row count from the host plan
    (``num_permuted_tokens`` and the per-slot counts), so its dispatch does not wait for the GPU and
    the experts get host counts: the layer's one host wait is the plan's. DeepEP's dispatch (megatron's
    ``fused_dispatch``, DeepEP's normal kernels) polls for its received counts on the host itself,
    whatever it is told: one wait more. GPU-only: :func:`flex_backend_problem` says why it cannot run
    where it cannot.

    When the fused kernels pad each local slot's rows (HybridEP under fp8 / fp4, to the quantization
    alignment; DeepEP's fused permute-and-pad), the main experts and the redundant slots take their
    padded rows alike, as megatron's experts do.
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection, layer):
        problem = flex_backend_problem(config)
        if problem:
            raise ValueError(f"--moe-balancer {layer.balancer_config.name}: {problem}")
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection, layer)
        self._replica_rows: tuple = ()  # per redundant slot, as dispatched (padding included)
        self._rows_past_slots = 0       # dispatched rows past the last local slot

    def can_defer(self) -> bool:
        """The fused dispatch permutes: a plan can always wait for the dispatch node."""
        return True

    def _deferred_dispatch_preprocess(self, hidden_states, routing_map, probs):
        """A deferred host plan's pre-dispatch part (overlapped schedule): nothing that needs the
        plan. The fused dispatch permutes, so the tokens go on as they are (megatron keeps the
        flex dispatcher's dispatch inputs for the backward) and the router's probabilities are
        rerouted in the dispatch node (:meth:`_dispatch_inputs_of_plan`)."""
        self._deferred_hidden_shape = hidden_states.shape
        return hidden_states.view(-1, hidden_states.shape[-1]), probs

    def _dispatch_inputs_of_plan(self, hidden_states, probs, routing_map):
        """The fused dispatch's inputs per the plan: megatron's ``dispatch_preprocess`` on the
        rerouted (physical) routing map and probabilities, in the dispatch node."""
        physical_map, physical_probs = self._reroute(routing_map, probs)
        hidden_states, token_probs = super(_PhysicalSlotRouting, self).dispatch_preprocess(
            hidden_states, physical_map, physical_probs)
        self.hidden_shape = self._deferred_hidden_shape  # the layer's [S, B, H], for the combine
        return hidden_states, token_probs

    def _hybridep_alignment(self) -> int:
        """The multiple HybridEP pads each local slot's rows to: megatron's ``pad_multiple`` rule (the
        quantization alignment under fp8 / fp4), 1 for none."""
        if self.config.fp8 or self.config.fp4:
            return get_align_size_for_quantization(self.config)
        return self._comm_manager.pad_multiple or 1

    def token_dispatch(self, hidden_states, probs=None, async_finish=True, allocate_on_comm_stream=True):
        """megatron's fused dispatch; HybridEP is told the permuted size and per-slot counts from
        the plan (host integers), so it neither waits for the GPU nor returns device counts."""
        manager = self._comm_manager
        if not isinstance(manager, _HybridEPManager):
            return super().token_dispatch(hidden_states, probs, async_finish, allocate_on_comm_stream)
        align = self._hybridep_alignment()
        rows = self.invocation.rows_per_slot  # [P] int64, host
        padded = (rows + align - 1) // align * align
        # megatron's manager reads the size from the GPU only when it is None (and then sets the
        # counts from the device); it is reset after every combine.
        manager.num_permuted_tokens = int(padded.sum())
        dispatched = super().token_dispatch(hidden_states, probs, async_finish, allocate_on_comm_stream)
        manager.tokens_per_expert = padded
        return dispatched

    def dispatch_postprocess_parts(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """``dispatch_postprocess`` split into the main experts' rows and the redundant slots' rows,
        each as dispatched: where the kernels pad every local slot's rows (HybridEP under fp8 /
        fp4, to the GEMM alignment), the replica experts take their slots' padded rows as the main
        experts take theirs (built from the layer's config, they skip their own padding as the main
        experts do, and fp8 GEMMs need aligned row counts); padding rows are zero and carry
        probability 0. Rows past the last slot (a kernel's over-allocation) are kept aside and get
        zero outputs in :meth:`combine_preprocess_parts`. Sizes from host counts only (HybridEP: the
        plan's, handed over in :meth:`token_dispatch`; DeepEP: its own host list)."""
        tokens, rows_per_slot, permuted_probs = self.dispatch_postprocess(hidden_states, probs)
        dispatched = [int(n) for n in rows_per_slot.tolist()]  # host tensor
        G = self.slots_per_rank - self.num_slots
        main_rows, replica_rows = sum(dispatched[:G]), sum(dispatched[G:])
        self._replica_rows = tuple(dispatched[G:])
        self._rows_past_slots = tokens.shape[0] - main_rows - replica_rows
        sizes = [main_rows, replica_rows, self._rows_past_slots]
        (main_tokens, replica_tokens, _), (main_probs, replica_probs, _) = (
            torch.split(tokens, sizes), torch.split(permuted_probs, sizes))
        return main_tokens, replica_tokens, rows_per_slot, main_probs, replica_probs

    @property
    def replica_rows(self):
        """Rows of each redundant slot as dispatched (padding included), from the latest
        :meth:`dispatch_postprocess_parts`."""
        return self._replica_rows

    def combine_preprocess_parts(self, main_out: torch.Tensor, replica_out: torch.Tensor) -> torch.Tensor:
        """``combine_preprocess`` of the main experts' and the redundant slots' outputs in the
        dispatched layout (zero rows past the last slot)."""
        pieces = [main_out, replica_out]
        if self._rows_past_slots:
            pieces.append(main_out.new_zeros((self._rows_past_slots, main_out.shape[1])))
        return self.combine_preprocess(torch.cat(pieces))


def balanced_dispatcher_class(config):
    """The balanced dispatcher for ``--moe-token-dispatcher-type``."""
    if config.moe_token_dispatcher_type == "flex":
        return BalancedFlexDispatcher
    return BalancedAlltoAllDispatcher
