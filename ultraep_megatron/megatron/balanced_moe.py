"""UltraEP inside megatron-core's MoE layer: exact-load replication and reroute in the forward,
re-materialization and replica-gradient reduction in the backward (paper §4.1, §4.2, §7).

How it plugs in (no fork of megatron-core):

* ``BalancedMoELayer`` subclasses ``MoELayer`` and is installed through the layer spec with the
  model's ``BalancingContext``. The local main experts stay megatron-core's own experts module
  (parameter names and checkpoint keys unchanged).
* The balanced dispatchers subclass megatron's and work in *physical-slot space*: every EP rank owns
  ``P = G + S`` physical slots (its G main experts, then its S redundant slots), so the parent's
  permutation / all-to-all / chunk-sort machinery runs unchanged on ``R * P`` "experts".

One invocation (a layer on a microbatch), forward:

1. ``plan``: the exact load ``[R, E]`` is gathered (the exchange megatron's dispatcher makes for its
   splits) and crosses to the host once, into pinned memory; the host waits for it at that one
   point. Plan, transfer schedule, all-to-all splits, per-slot counts and telemetry are computed on
   the host (``context.Invocation``); megatron's dispatcher gets host splits, so it copies nothing.
2. reroute on the device: the reroute table (one non-blocking upload from pinned memory) maps each
   (token, expert) pair to its physical slot; megatron permutes the tokens;
3. the layer completes megatron's parameter all-gather of its main experts, if one is in flight
   (``--overlap-param-gather``), then starts the weight distribution into the shared redundant
   slots, asynchronously; megatron dispatches the tokens;
4. the main experts compute; the replica experts wait for the weights, then compute;
5. combine.

The backward, in the order autograd runs it::

    _StartInBackward     (at the layer's output) starts copying this invocation's replicas back into
                         the shared weight buffer, which later layers overwrote (re-materialization)
    combine, its all-to-all and unpermute backward      (overlap the re-materialization)
    replica experts' backward (saved weights resolved against the re-materialized buffer)
    _ReplicaWeights      starts the reduction of the replica weight gradients towards the home
                         ranks, which copies them into the shared fp32 buffer on its stream (on a
                         rank whose redundant slots received no rows, a _StartInBackward starts its
                         part at this point)
    main experts' backward                              (overlaps the reduction)
    chunk sort backward
    _ReduceReplicaGrads  completes the reduction into the main experts' gradients; releases the ring
                         slot. It is an identity on the received tokens whose inputs include the
                         parameters of every local main expert, so it runs after the main experts'
                         backward and before any of their gradient accumulations: Megatron DDP's
                         hook then sees complete grads, at a point and in an order that do not
                         depend on the plan (its bucket collectives stay in step across the
                         expert-data-parallel group)
    dispatch all-to-all backward

Every transfer is collective on the EP group and every rank issues them in the same order; a rank
with nothing to send or receive still takes part.
"""

from __future__ import annotations

import copy
import time
from typing import List, Optional, Sequence

import numpy as np
import torch

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe import token_dispatcher as token_dispatcher_module
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAlltoAllTokenDispatcher,
    MoEFlexTokenDispatcher,
)

from ultraep_megatron.megatron.arguments import unsupported_moe_settings
from ultraep_megatron.megatron.context import BalancingContext, Invocation
from ultraep_megatron.megatron.cpu_backend import native_torch
from ultraep_megatron.megatron.expert_slots import ExpertParamLookup, expert_param_names
from ultraep_megatron.megatron.layer_spec import moe_layer_id


def _in_backward_pass() -> bool:
    """True while autograd's engine is executing a backward (e.g. an activation-recompute replay)."""
    return torch._C._current_graph_task_id() != -1


def _copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """The one device-to-host copy of an invocation: into pinned memory, non-blocking, then one wait
    on an event (megatron's dispatcher waits for its token counts the same way)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    copied.synchronize()
    return host


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
        super().__init__(self.slots_per_rank, local, config=physical_config, pg_collection=pg_collection)

    def plan(self, routing_map: torch.Tensor) -> Invocation:
        """This invocation's plan, from the exact load of the EP group (the one host wait), or the
        stored plan when this is an activation-recompute replay.

        Args:
            routing_map: [T, E] bool, exactly ``topk`` experts per token (dropless).
        """
        layer = self._layer
        balancing: BalancingContext = layer.balancing
        if routing_map.dtype != torch.bool or routing_map.dim() != 2:
            raise ValueError("expected a [tokens, experts] bool routing map")
        if _in_backward_pass():
            invocation = balancing.replay(layer.layer_number)
        else:
            load = _copy_to_host(self._gather_load(routing_map))
            invocation = balancing.plan(layer, load, self.ep_rank, training=layer.training,
                                        grad_enabled=torch.is_grad_enabled())
        self.invocation = invocation
        return invocation

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
        physical_map, physical_probs = self._reroute(routing_map, probs)
        return super().dispatch_preprocess(hidden_states, physical_map, physical_probs)

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

    def combine_preprocess_parts(self, main_out: torch.Tensor, replica_out: torch.Tensor) -> torch.Tensor:
        """``combine_preprocess`` of the main experts' and the redundant slots' outputs, stacked."""
        return self.combine_preprocess(torch.cat([main_out, replica_out]))

    def _check_plan(self, routing_map: torch.Tensor) -> None:
        """With ``--moe-balancer-check-plans`` only (a device read): the routing is the load the
        invocation's plan was solved for."""
        if self._layer.balancing.check_plans and not torch.equal(
                routing_map.sum(dim=0).cpu(), self.invocation.load[self.ep_rank]):
            raise RuntimeError(f"MoE layer {self._layer.layer_number}: the routing differs from the load "
                               "its plan was solved for (not exactly top-k per token, or a recompute "
                               "replay that is not deterministic)")

    def _instances(self, routing_map: torch.Tensor):
        """Each (token, expert) entry's expert-major position and the plan's instance for it (the
        plan check first, with ``--moe-balancer-check-plans``).

        Dense over [T, E], no sort, few ops (host time per layer): a pair's position in the
        expert-major, token-ascending order is the routed tokens of its expert up to it plus the
        expert's offset (from the host load); positions past the last instance hit the sentinel.
        Unrouted entries get a position too (their expert's count so far), which callers mask.

        Returns:
            (reroute table on the device [4, E * R + 1], position [T * E], instance [T * E]).
        """
        self._check_plan(routing_map)
        table = self.invocation.reroute_table.to(routing_map.device, non_blocking=True)
        # The running count scans the [E, T] layout along its last dimension. Scanning [T, E] along
        # dim 0 took 4.8 ms more per layer on an H200 at 16384 tokens and 256 experts
        # (tools/bench_critical_path.py): torch's CUDA scan over an outer dimension is not parallel
        # along it.
        counts = routing_map.t().contiguous().cumsum(dim=1)
        position = (counts + table[2, : self.num_logical_experts].unsqueeze(1)).t().reshape(-1)
        return table, position, torch.searchsorted(table[0], position, right=True)

    @native_torch
    def _reroute(self, routing_map: torch.Tensor, probs: torch.Tensor):
        """Rewrite the routing from logical experts to physical slots, exactly per the plan. Device
        work only: no host read, fixed shapes.

        The plan gives each (expert, instance) a quota of this rank's pairs; pairs of an expert are
        taken in token order (the order megatron's permutation sorts them in), so the pair at
        position ``i`` of the expert-major order goes to the instance whose running quota total
        first exceeds ``i``.

        Args:
            routing_map: [T, E] bool, exactly ``topk`` experts per token.
            probs: [T, E] router probabilities (differentiable).

        Returns:
            (physical_map [T, R * P] bool, physical_probs [T, R * P], differentiable in
            ``probs``).
        """
        t0 = time.perf_counter()
        num_tokens = routing_map.size(0)
        device = routing_map.device
        table, _, instance = self._instances(routing_map)
        num_physical = self.ep_size * self.slots_per_rank
        # index_select, not advanced indexing: the same gather, a fifth of the reroute's host time less.
        instance_slot = table[1].index_select(0, instance).view(num_tokens, self.num_logical_experts)
        # Unrouted (token, expert) entries go to a spare last column, dropped below. Routed pairs
        # of a token land in distinct columns, so the scatters are exact (no masking of probs).
        slot = torch.where(routing_map, instance_slot, num_physical)
        physical_map = torch.zeros(num_tokens, num_physical + 1, dtype=torch.bool, device=device)
        physical_map = physical_map.scatter_(1, slot, routing_map)[:, :num_physical].contiguous()
        physical_probs = torch.zeros(num_tokens, num_physical + 1, dtype=probs.dtype, device=device)
        physical_probs = physical_probs.scatter(1, slot, probs)[:, :num_physical].contiguous()
        self._layer.balancing.overheads.reroute_seconds += time.perf_counter() - t0
        return physical_map, physical_probs


class BalancedAlltoAllDispatcher(_PhysicalSlotRouting, MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher over physical slots, driven by a per-microbatch plan.
    Its ``preprocess`` takes every split from the invocation's host metadata: no communication, no
    device-to-host copy, no host wait (megatron's own sync point stays unset)."""

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """All-to-all metadata from the plan: splits and per-slot row counts, on the host."""
        invocation = self.invocation
        self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
        if self.ep_size > 1:
            self.input_splits = invocation.input_splits
            self.output_splits = invocation.output_splits
            self.output_splits_tp = np.array([invocation.output_splits.sum()])
        # [R_src, P]; megatron's fused chunk sort reads it on the device.
        rows = invocation.rows_per_source_slot
        self.num_global_tokens_per_local_expert = (
            rows.to(routing_map.device, non_blocking=True) if self.config.moe_permute_fusion else rows)
        return invocation.rows_per_slot

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
        (:meth:`_permutation`), so neither the physical map nor the sort is built.

        Args:
            routing_map: [T, E] bool, logical experts, exactly ``topk`` per token.
            probs: [T, E] router probabilities.

        Returns:
            (permuted tokens [N, H], their probabilities [N]), ``N = T * topk``, physical-slot-major
            and token-ascending within a slot, as megatron's permutation of the physical map.
        """
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
        sorted_tokens, permuted_probs = self._permutation(routing_map, probs)
        self.reversed_local_input_permutation_mapping = sorted_tokens
        return hidden_states.index_select(0, sorted_tokens), permuted_probs

    @native_torch
    def _permutation(self, routing_map: torch.Tensor, probs: torch.Tensor):
        """Where each routed (token, expert) pair goes in the all-to-all's send buffer, exactly per
        the plan. Device work only: no host read, fixed shapes, no sort.

        A pair's expert-major position picks its instance (:meth:`_instances`); row 3 of the
        plan's reroute table turns the position into its send-buffer row (the instance's slot's
        first row, plus the pair's rank among the instance's pairs, which the plan hands out in
        token order). Unrouted entries land in a spare row past the buffer, dropped.

        Args:
            routing_map: [T, E] bool, exactly ``topk`` experts per token.
            probs: [T, E] router probabilities (differentiable).

        Returns:
            (sorted_tokens [N] int64: the token of each send-buffer row, permuted_probs [N],
            differentiable in ``probs``), ``N = T * topk``.
        """
        t0 = time.perf_counter()
        num_tokens, num_experts = routing_map.shape
        device = routing_map.device
        table, position, instance = self._instances(routing_map)
        num_rows = self.num_out_tokens
        row = torch.where(routing_map.view(-1), table[3].index_select(0, instance) + position, num_rows)
        # Every row below num_rows is written once; -1 would fail the token gather loudly if the
        # routing ever left one unwritten (a routing other than the plan's load).
        # Not repeat_interleave: without an output size it reads the repeats' sum on the host.
        tokens = torch.arange(num_tokens, device=device).unsqueeze(1).expand(-1, num_experts).reshape(-1)
        sorted_tokens = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=device)
        sorted_tokens = sorted_tokens.scatter_(0, row, tokens)[:num_rows]
        permuted_probs = probs.new_zeros(num_rows + 1).scatter(0, row, probs.reshape(-1))[:num_rows]
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

    Small by design: the fused kernels route on top-k indices, so handing them the physical routing
    is all it takes; they compute their own layout (one small all-gather of the load is added for
    the plan). GPU-only: :func:`flex_backend_problem` says why it cannot run where it cannot.
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection, layer):
        problem = flex_backend_problem(config)
        if problem:
            raise ValueError(f"--moe-balancer {layer.balancer_config.name}: {problem}")
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection, layer)


def flex_backend_problem(config) -> Optional[str]:
    """Why megatron's flex dispatcher cannot run with ``config`` here (``None`` if it can).

    The check is megatron's own: its DeepEP / HybridEP bindings are importable (they need CUDA).
    """
    backend = getattr(config, "moe_flex_dispatcher_backend", None)
    if backend == "deepep":
        available = getattr(token_dispatcher_module, "fused_dispatch", None) is not None
        package = "DeepEP (deep_ep)"
    elif backend == "hybridep":
        available = getattr(token_dispatcher_module, "hybrid_ep_dispatch", None) is not None
        package = "HybridEP (deep_ep's hybrid_ep)"
    else:
        return (f"--moe-flex-dispatcher-backend {backend} is not supported with a balancer; "
                "use deepep or hybridep")
    if not available:
        return (f"--moe-token-dispatcher-type flex with --moe-flex-dispatcher-backend {backend} "
                f"needs {package}, which is not installed (it needs CUDA); use "
                "--moe-token-dispatcher-type alltoall")
    return None


def balanced_dispatcher_class(config):
    """The balanced dispatcher for ``--moe-token-dispatcher-type``."""
    if config.moe_token_dispatcher_type == "flex":
        return BalancedFlexDispatcher
    return BalancedAlltoAllDispatcher


def _keep(ctx, layer, invocation: Invocation) -> None:
    # Only the virtual layer id crosses to the backward when there is one; the ring owns the state.
    ctx.layer, ctx.vid = layer, invocation.vid
    ctx.invocation = invocation if invocation.vid is None else None


def _invocation(ctx) -> Invocation:
    """The forward's invocation: from the virtual-layer ring (training) or kept in ``ctx``."""
    return ctx.layer.balancing.invocation(ctx.vid) if ctx.vid is not None else ctx.invocation


class _StartInBackward(torch.autograd.Function):
    """Identity on a tensor of the layer; its backward starts one of the invocation's transfers
    (``start``, a bound :class:`BalancingContext` method) where the tensor's gradient arrives:

    * ``start_weights`` on the layer's output, the first of the layer's backward: copies this
      invocation's replicated main experts back into the shared weight buffer (later layers
      overwrote it), overlapped with the combine's backward (re-materialization);
    * ``start_reduction`` on the main experts' output of a rank whose redundant slots received no
      rows: its part in the collective reduction starts where a replica's backward would have
      started it (before the main experts' backward), so its peers never wait on it.
    """

    @staticmethod
    def forward(ctx, layer, invocation, start, tensor):
        _keep(ctx, layer, invocation)
        ctx.start = start
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.start(ctx.layer, _invocation(ctx))
        return None, None, None, grad


class _ReduceReplicaGrads(torch.autograd.Function):
    """Identity on the tokens the all-to-all received ``[N, H]`` (before megatron's chunk sort); its
    backward, after the experts' and the sort's, completes the reduction of the replica gradients
    into the main experts' gradients.

    The trainable parameters of *every* local main expert are inputs, whatever the plan, so that
    their gradient accumulation, and so Megatron DDP's hook that marks a parameter ready for its
    (possibly overlapped) bucket reduction, runs after this backward, in the same order on every
    rank. Only the experts with a replica need their reduced gradient; the others are inputs for
    the order: with ``--overlap-grad-reduce`` a bucket's reduce-scatter starts when its last
    parameter is ready, and the ranks of one expert-data-parallel group belong to different EP
    groups with different plans. Were only the replicated experts held back, each rank would
    complete its buckets in an order of its own plan's making and issue the bucket collectives out of
    step: gloo and NCCL match collectives by issue order, so buckets of one rank were reduced with
    other buckets of another (silently wrong where sizes agree, a hang where not). The cost: the
    local experts' weight gradients live until this backward, across megatron's chunk sort backward
    (none with gradient-accumulation fusion, which writes them into ``main_grad`` directly).

    If neither the tokens nor any local expert's parameter needs a gradient (every local expert, the
    router and the layers below frozen), this backward never runs on this rank; megatron's own
    all-to-all backward would not run there either.
    """

    @staticmethod
    def inputs(layer) -> List[torch.Tensor]:
        """The parameters ``apply`` takes after the tokens: every local expert's trainable ones,
        expert-major (plan-independent, see the class docstring)."""
        return [p for expert in layer.main_expert_param_lists() for p in expert if p.requires_grad]

    @staticmethod
    def forward(ctx, layer, invocation, received, *params):
        _keep(ctx, layer, invocation)
        ctx.params = params
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad_received):
        invocation = _invocation(ctx)
        layer = ctx.layer
        reduced = layer.balancing.finish_reduction(layer, invocation)  # [local expert][k]
        layer.balancing.release(invocation)
        by_param = {id(p): g for expert, grads in zip(layer.main_expert_param_lists(), reduced)
                    for p, g in zip(expert, grads)}
        return (None, None, grad_received, *(by_param[id(p)] for p in ctx.params))


class _ReplicaWeights(torch.autograd.Function):
    """The redundant slots' weights as tensors of the layer's autograd graph: views of the shared
    weight buffer, flat (slot-major, ``expert_param_shapes`` order). The forward waits for the
    invocation's weight distribution; the backward, once autograd has every replica weight
    gradient, starts their reduction towards the home ranks with them (which copies them into the
    shared fp32 gradient buffer on its stream; collective, so every rank runs it, with replica rows
    or not).

    The replica experts then run in the layer's graph (:func:`_run_replicas_in_graph`), not in a
    graph of their own differentiated by a nested backward call. Their saved weights are stored as
    (offset, shape, stride) of the buffer instead of being kept alive (saved-tensor hooks), because
    later layers overwrite the buffer; unpacking them waits for its re-materialization, so no replica
    activation is recomputed. ``tokens`` and ``probs`` (the replica rows and their router
    probabilities) get no gradient here: they make the weights need one whenever the replica output
    does. The rows need one whenever a local main expert of this rank is trainable, even with the
    router and the layers below frozen: they come out of :class:`_ReduceReplicaGrads`, whose inputs
    include such a parameter. (With every local expert, the router and the layers below frozen on
    one rank but not on another, megatron's own all-to-all backward would not run on that rank
    either.)

    The weights are returned as aliases of the buffer that autograd does not track as views
    (``detach``): later layers write the buffer in place, and autograd would refuse a tracked view
    of it afterwards (a custom function's view whose base changed), e.g. where a kernel keeps the
    weight tensors for its backward.
    """

    @staticmethod
    def forward(ctx, layer, invocation, tokens, probs):
        _keep(ctx, layer, invocation)
        ctx.set_materialize_grads(False)  # an unused weight's gradient stays None, not a zero tensor
        layer.balancing.wait_weights(invocation)
        return tuple(w.detach() for slot in layer.replica_weight_views() for w in slot)

    @staticmethod
    def backward(ctx, *weight_grads):
        ctx.layer.balancing.start_reduction(ctx.layer, _invocation(ctx), weight_grads)
        return None, None, None, None


def _run_replicas_in_graph(layer, invocation: Invocation, tokens: torch.Tensor, probs: torch.Tensor):
    """Expert compute of this rank's redundant slots, differentiable: ``tokens [N, H]`` (sorted by
    slot) and their ``probs [N]`` -> ``[N, H]``, with the replica weight gradients reduced into the
    main experts' in the backward (:class:`_ReplicaWeights`)."""
    flat = _ReplicaWeights.apply(layer, invocation, tokens, probs)
    per_slot = len(layer.expert_param_shapes)
    weights = [flat[s * per_slot : (s + 1) * per_slot] for s in range(len(flat) // per_slot)]
    buffer = layer.balancing.buffer.replica_weights
    with torch.autograd.graph.saved_tensors_hooks(
        _buffer_packer(buffer), _buffer_unpacker(buffer, layer.balancing, invocation)
    ):
        return layer.run_replicas(weights, tokens, probs, invocation.replica_rows)


def _buffer_packer(buffer: torch.Tensor):
    """Saved-tensor pack hook: a view of ``buffer`` is saved as its geometry, not its storage."""
    storage = buffer.untyped_storage().data_ptr()

    @native_torch  # our code, several times per layer and microbatch: no device mapping needed
    def pack(tensor):
        if tensor.untyped_storage().data_ptr() == storage:
            return ("replica-buffer", tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        return tensor

    return pack


def _buffer_unpacker(buffer: torch.Tensor, balancing: BalancingContext, invocation: Invocation):
    """Saved-tensor unpack hook: a saved view of ``buffer`` is resolved against the buffer once it
    holds ``invocation``'s replicas again (re-materialized; raises if it was not). The first unpack
    of the invocation's backward waits for the transfer; later ones only check the holder."""
    waited = []

    @native_torch
    def unpack(saved):
        if isinstance(saved, tuple):
            if not waited or balancing.holder is not invocation:
                balancing.wait_weights(invocation)
                waited.append(True)
            _, offset, shape, stride = saved
            return buffer.as_strided(shape, stride, offset)
        return saved

    return unpack


class BalancedMoELayer(MoELayer):
    """megatron-core ``MoELayer`` that balances every microbatch on its exact post-gating load.

    Args: as ``MoELayer``, plus ``balancing`` (the model's ``BalancingContext``), passed through the
    layer spec's ``params``.
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *,
                 balancing: BalancingContext, **kwargs):
        problems = unsupported_moe_settings(config)
        if problems:
            raise ValueError(f"--moe-balancer {balancing.config.name}: " + "; ".join(problems))
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, **kwargs)
        self.balancing = balancing
        self.balancer_config = balancing.config
        self.balancer_pg_collection = pg_collection
        self.token_dispatcher = balanced_dispatcher_class(config)(
            self.num_local_experts, self.local_expert_indices, config, pg_collection, self
        )
        # [local expert][k] parameter names; every expert's k-th parameter has the same shape.
        self.expert_param_names = expert_param_names(self.experts, self.num_local_experts)
        self._lookup_main_params = ExpertParamLookup(self.experts, self.expert_param_names)
        first = self._lookup_main_params()[0]
        self.expert_param_shapes = [(n, tuple(p.shape)) for n, p in zip(self.expert_param_names[0], first)]
        self.balancer = balancing.config.build()
        self._main_params: Optional[List[List[torch.Tensor]]] = None
        # The modules holding the main experts' parameters (their forward pre-hooks, see
        # _prepare_main_params).
        self._main_param_owners = [m for m in self.experts.modules()
                                   if next(m.parameters(recurse=False), None) is not None]
        balancing.register(self)

    def set_layer_number(self, layer_number: int) -> None:
        """Megatron's numbering for the router; ``layer_number`` here is the balancer's layer id
        (:func:`~ultraep_megatron.megatron.layer_spec.moe_layer_id`: MTP layers after the
        decoder), by which the ring, telemetry and traces tell layers apart."""
        super().set_layer_number(layer_number)
        self.layer_number = moe_layer_id(self.router)

    def main_expert_param_lists(self) -> List[List[torch.Tensor]]:
        """``[local expert][k]`` parameters, ``k`` in ``expert_param_shapes`` order.

        Looked up once per forward (:meth:`forward`) and used by the invocation's four transfers:
        a forward and its backward see the same parameters (a checkpoint load may replace them
        between iterations).
        """
        if self._main_params is None:
            return self._lookup_main_params()
        return self._main_params

    def replica_weight_views(self) -> List[List[torch.Tensor]]:
        """``[redundant slot][k]`` views of the shared weight buffer, shaped like this layer's experts."""
        buffer = self.balancing.buffer
        return [buffer.weight_views(s) for s in range(buffer.num_slots)]

    def run_replicas(self, slot_weights, tokens, probs, rows_per_slot: Sequence[int]) -> torch.Tensor:
        """Redundant slots' expert compute: [N, H] tokens sorted by slot -> [N, H] outputs."""
        return self.balancing.replica_experts(slot_weights, tokens, rows_per_slot, probs)

    def _prepare_main_params(self) -> None:
        """Run the forward pre-hooks of the modules holding the main experts' parameters, as their
        own forward will right after, before the weight distribution reads those parameters.

        With ``--overlap-param-gather`` Megatron DDP's pre-hook is where a module waits for the
        all-gather of its parameters after the optimizer step (the distributed optimizer updated
        only this rank's shard); the replicas are copied from the main experts before the experts'
        forward runs, so without this they would be copied from weights of the previous step in
        the shards other ranks own. Megatron's hook is idempotent, so the experts' own forward finds
        the gather done. Called in every forward, whatever the plan: the hook also starts the next
        bucket's all-gather, which every rank of the expert-data-parallel group must issue alike.
        """
        for module in self._main_param_owners:
            for hook_id, hook in tuple(module._forward_pre_hooks.items()):
                if hook_id in module._forward_pre_hooks_with_kwargs:
                    hook(module, (), {})
                else:
                    hook(module, ())

    def preprocess(self, hidden_states, probs, routing_map):
        invocation = self.token_dispatcher.plan(routing_map)
        # Reroute and permutation first: the device waits for them after the plan's host wait.
        hidden_states, probs = super().preprocess(hidden_states, probs, routing_map)
        self._prepare_main_params()
        # Overlaps the token all-to-all and the main experts.
        self.balancing.start_weights(self, invocation)
        return hidden_states, probs

    def routed_experts_compute(self, hidden_states, probs):
        dispatcher = self.token_dispatcher
        invocation = dispatcher.invocation
        track = torch.is_grad_enabled()  # a backward will follow: re-materialize and reduce in it
        if track:  # on the received tokens: its backward follows every expert's
            hidden_states = _ReduceReplicaGrads.apply(self, invocation, hidden_states,
                                                      *_ReduceReplicaGrads.inputs(self))
        if sum(invocation.replica_rows) == 0:
            # Nothing for this rank's redundant slots (host metadata): megatron's postprocess, no
            # parts. The backward's transfers wait for this weight distribution first; without a
            # backward, wait here.
            dispatched, rows_per_slot, permuted_probs = dispatcher.dispatch_postprocess(hidden_states, probs)
            main_out, mlp_bias = self.experts(dispatched, rows_per_slot[: self.num_local_experts], permuted_probs)
            if track:
                main_out = _StartInBackward.apply(self, invocation, self.balancing.start_reduction, main_out)
            else:
                self.balancing.wait_weights(invocation)
            return dispatcher.combine_preprocess(main_out), mlp_bias
        main_tokens, replica_tokens, rows_per_slot, main_probs, replica_probs = \
            dispatcher.dispatch_postprocess_parts(hidden_states, probs)
        main_out, mlp_bias = self.experts(main_tokens, rows_per_slot[: self.num_local_experts], main_probs)
        if track:
            replica_out = _run_replicas_in_graph(self, invocation, replica_tokens, replica_probs)
        else:  # eval, or the no-grad first pass of activation recompute
            self.balancing.wait_weights(invocation)
            replica_out = self.run_replicas(self.replica_weight_views(), replica_tokens, replica_probs,
                                            invocation.replica_rows)
        return dispatcher.combine_preprocess_parts(main_out, replica_out), mlp_bias

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        self._main_params = self._lookup_main_params()
        output, mlp_bias = super().forward(hidden_states, intermediate_tensors, padding_mask)
        if torch.is_grad_enabled():
            output = _StartInBackward.apply(self, self.token_dispatcher.invocation,
                                            self.balancing.start_weights, output)
        self.balancing.observe()  # the layer's work is queued: host time is off the critical path
        return output, mlp_bias
