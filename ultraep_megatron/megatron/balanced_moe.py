"""UltraEP inside megatron-core's MoE layer: exact-load replication and reroute in the forward,
re-materialization and replica-gradient reduction in the backward (paper §4.1, §4.2, §7).

How it plugs in (no fork of megatron-core):

* ``BalancedMoELayer`` subclasses ``MoELayer`` and is installed through the layer spec. The local main
  experts stay megatron-core's own ``SequentialMLP`` (parameter names and checkpoint keys unchanged).
* ``BalancedAlltoAllDispatcher`` subclasses ``MoEAlltoAllTokenDispatcher`` and works in *physical-slot
  space*: every EP rank owns ``P = E/R + num_slots`` physical slots (its main experts, then its
  redundant slots), so the parent's permutation / all-to-all / chunk-sort machinery runs unchanged on
  ``R * P`` "experts". It gathers the exact per-rank load (the exchange Megatron already makes), lets
  the balancer plan on every rank identically, rewrites the routing map from logical experts to
  physical slots and derives every split of the token all-to-all from the plan, with no further
  communication.
* Replica slots compute with the same expert module (``torch.func.functional_call`` on the shared
  replica weight buffer) inside ``_ReplicaExperts``, an autograd function whose inputs include the main
  expert parameters. Its backward re-materializes the replica weights, computes their gradients into
  the shared fp32 gradient buffer and reduces them into the owning main experts' gradients. Since it
  is an input edge of those parameters, autograd runs it before their gradient-accumulation node, i.e.
  before Megatron DDP's hook hands ``main_grad`` to the (possibly overlapped) gradient reduction.
"""

from __future__ import annotations

import copy
import time
from typing import List, Optional, Sequence

import torch

from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe import token_dispatcher as token_dispatcher_module
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAlltoAllTokenDispatcher,
    MoEFlexTokenDispatcher,
)

from ultraep_megatron import planner
from ultraep_megatron.megatron.arguments import unsupported_moe_settings
from ultraep_megatron.megatron.expert_slots import expert_param_names, expert_params, run_replica_experts
from ultraep_megatron.megatron.layer_spec import moe_layer_id
from ultraep_megatron.megatron.runtime import BalancerConfig, InvocationState, get_runtime


def _in_backward_pass() -> bool:
    """True while autograd's engine is executing a backward (e.g. an activation-recompute replay)."""
    return torch._C._current_graph_task_id() != -1


class _PhysicalSlotRouting:
    """What both balanced dispatchers add to megatron's: physical-slot geometry, the exact load of
    the EP group, the plan, and the logical -> physical rewrite of the routing.

    Physical slot ``r * P + j`` is rank ``r``'s main expert ``j`` for ``j < L = E // R`` and its
    redundant slot ``j - L`` otherwise (``P = L + num_slots``). The parent dispatcher is built over
    ``R * P`` "experts", ``P`` of them local, so its permutation and communication run unchanged.
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection, layer):
        """Args: as megatron's dispatcher (logical ``num_local_experts = E // R`` and expert ids,
        the model's config), plus the owning ``layer`` (its layer number and balancer)."""
        ep_size, ep_rank = pg_collection.ep.size(), pg_collection.ep.rank()
        self.num_logical_experts = config.num_moe_experts
        self.num_slots = layer.balancer_config.num_slots
        self.slots_per_rank = num_local_experts + self.num_slots
        physical_config = copy.copy(config)
        physical_config.num_moe_experts = ep_size * self.slots_per_rank
        local = [ep_rank * self.slots_per_rank + j for j in range(self.slots_per_rank)]
        self._layer = layer
        self.state: Optional[InvocationState] = None
        super().__init__(self.slots_per_rank, local, config=physical_config, pg_collection=pg_collection)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        physical_map, physical_probs = self._plan_and_reroute(routing_map, probs)
        return super().dispatch_preprocess(hidden_states, physical_map, physical_probs)

    def _gather_load(self, routing_map: torch.Tensor) -> torch.Tensor:
        """[T, E] bool -> [R, E] int64: exact per-source load of the whole EP group."""
        local = routing_map.sum(dim=0).long()
        if self.ep_size == 1:
            return local.unsqueeze(0)
        # With expert-TP 1 the tp_ep group is the EP group, in EP-rank order. The all-to-all
        # dispatcher makes this exchange anyway for its splits (its ``preprocess`` then reuses it).
        return gather_from_sequence_parallel_region(local, group=self.tp_ep_group).view(
            self.ep_size, self.num_logical_experts
        )

    def _plan_and_reroute(self, routing_map: torch.Tensor, probs: torch.Tensor):
        """Plan on the exact load, distribute replica weights, rewrite the routing to physical slots.

        Args:
            routing_map: [T, E] bool, exactly ``topk`` experts per token (dropless).
            probs: [T, E] router probabilities (differentiable).

        Returns:
            (physical_map [T, R * P] bool, physical_probs [T, R * P], differentiable in ``probs``).
        """
        layer = self._layer
        runtime = get_runtime()
        topk = self.config.moe_router_topk
        if routing_map.dtype != torch.bool or routing_map.dim() != 2:
            raise ValueError("expected a [tokens, experts] bool routing map")
        if _in_backward_pass():
            # Activation-recompute replay: reuse the plan of the checkpointed forward.
            state = runtime.replay_state(layer.layer_number, routing_map.sum(dim=0).long(), self.ep_rank)
        else:
            load = self._gather_load(routing_map)
            state = runtime.plan(layer, load, training=layer.training, grad_enabled=torch.is_grad_enabled())
        self.state = state

        # Reroute: logical (token, expert) pairs -> physical slots, exact per the plan's split.
        t0 = time.perf_counter()
        token_ids, expert_ids = routing_map.nonzero(as_tuple=True)
        num_tokens = routing_map.size(0)
        if token_ids.numel() != num_tokens * topk:
            raise ValueError(
                "UltraEP needs exactly moe_router_topk experts per token (dropless routing); "
                f"got {token_ids.numel()} pairs for {num_tokens} tokens, top-{topk}"
            )
        topk_ids = expert_ids.view(num_tokens, topk)
        physical_ids = planner.assign_tokens(state.plan, self.ep_rank, topk_ids)
        num_physical = self.ep_size * self.slots_per_rank
        physical_map = torch.zeros(num_tokens, num_physical, dtype=torch.bool, device=routing_map.device)
        physical_map.scatter_(1, physical_ids, True)
        # Differentiable in the router's probabilities: gather, then scatter into physical columns.
        physical_probs = torch.zeros(num_tokens, num_physical, dtype=probs.dtype, device=probs.device)
        physical_probs = physical_probs.scatter(1, physical_ids, probs.gather(1, topk_ids))
        runtime.reroute_seconds += time.perf_counter() - t0

        # Forward weight distribution into the shared replica slots (before the token dispatch).
        runtime.materialize(layer, state)
        return physical_map, physical_probs


class BalancedAlltoAllDispatcher(_PhysicalSlotRouting, MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher over physical slots, driven by a per-microbatch plan.
    Its ``preprocess`` takes every split from the plan instead of a second exchange."""

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """All-to-all metadata from the plan (no communication): splits and per-slot token counts."""
        counts = self.state.plan.physical_split  # [R_src, R * P] tokens from each source to each slot
        rank, per_rank = self.ep_rank, self.slots_per_rank
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
        if self.ep_size > 1:
            self.input_splits = counts[rank].view(self.ep_size, per_rank).sum(dim=1)
            self.output_splits = counts[:, mine].sum(dim=1)
            self.output_splits_tp = self.output_splits.sum().view(1)
            self._maybe_update_cuda_sync_point("before_ep_alltoall")
        else:
            self._maybe_update_cuda_sync_point("before_finish")
        # [R_src, P]: tokens each source sends to each of this rank's slots.
        self.num_global_tokens_per_local_expert = counts[:, mine].contiguous()
        if not self.config.moe_permute_fusion:
            self._maybe_update_cuda_sync_point("before_permutation_2")
        return counts[:, mine].sum(dim=0)


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


# The backward of one balanced MoE invocation, in the order autograd runs it (§4.2, Fig. 9):
#
#   combine all-to-all backward
#   _Rematerialize      collective: this invocation's replicas back into the shared weight buffer
#   main experts' backward  |  _ReplicaExperts (local only: replica grads into the fp32 buffer)
#   _ReduceReplicaGrads collective: replica grads into the home ranks' main-expert gradients
#   dispatch all-to-all backward
#
# Both collectives sit next to the layer's all-to-alls, where every EP rank arrives together; none
# sits between one rank's replica compute and another's main-expert compute, which would make the
# ranks wait on each other's compute inside the layer.


def _invocation_state(ctx) -> InvocationState:
    """The forward's state: from the virtual-layer ring (training) or kept in ``ctx`` (no ring)."""
    return get_runtime().state(ctx.vid) if ctx.vid is not None else ctx.state


def _keep_state(ctx, layer, state: InvocationState) -> None:
    # Only the virtual layer id crosses to the backward when there is one; the ring owns the state.
    ctx.layer, ctx.vid = layer, state.vid
    ctx.state = state if state.vid is None else None


class _Rematerialize(torch.autograd.Function):
    """Identity on the experts' output ``[N, H]``; its backward, the first of the experts', copies
    this invocation's replicated main experts back into the shared buffer (later layers
    overwrote it). Collective on the EP group: every rank takes part, with replicas or not."""

    @staticmethod
    def forward(ctx, layer, state, expert_output):
        _keep_state(ctx, layer, state)
        return expert_output.view_as(expert_output)

    @staticmethod
    def backward(ctx, grad_output):
        get_runtime().materialize(ctx.layer, _invocation_state(ctx))
        return None, None, grad_output


class _ReduceReplicaGrads(torch.autograd.Function):
    """Identity on the dispatched tokens ``[N, H]``; its backward, the last of the experts', reduces
    the replica gradient buffer into the main experts (collective on the EP group).

    ``main_params`` (every local main expert's parameter, expert-major) are inputs so that their
    gradient accumulation, and so Megatron DDP's hook that hands ``main_grad`` to the (possibly
    overlapped) bucket reduction, waits for this backward.
    """

    @staticmethod
    def forward(ctx, layer, state, dispatched, *main_params):
        _keep_state(ctx, layer, state)
        return dispatched.view_as(dispatched)

    @staticmethod
    def backward(ctx, grad_dispatched):
        runtime = get_runtime()
        main_param_grads = runtime.reduce_replica_grads(ctx.layer, _invocation_state(ctx))
        runtime.release(ctx.vid)
        return (None, None, grad_dispatched, *main_param_grads)


class _ReplicaExperts(torch.autograd.Function):
    """Expert compute of this rank's redundant slots: ``tokens [N, H]`` (sorted by slot) and their
    ``probs [N]`` -> ``[N, H]``; the backward writes replica weight gradients into the shared fp32
    buffer (no communication).

    The forward keeps its own small autograd graph over leaf views of the shared replica buffer.
    Tensors that graph saves from the buffer (the replica weights) are stored as (offset, shape,
    stride) of the buffer instead of being kept alive (saved-tensor hooks), because later layers
    overwrite the buffer; ``_Rematerialize`` has restored it by the time this backward runs, which
    differentiates the saved graph, so no replica activation is recomputed.
    """

    @staticmethod
    def forward(ctx, layer, state, tokens, probs):
        _keep_state(ctx, layer, state)
        ctx.graph = None
        if tokens.shape[0] == 0:
            return tokens.new_zeros(0, layer.config.hidden_size)
        slots = get_runtime().slots
        leaves = [[w.detach().requires_grad_() for w in slot] for slot in slots.weight_views()]
        tokens_ = tokens.detach().requires_grad_(ctx.needs_input_grad[2])
        probs_ = probs.detach().requires_grad_(ctx.needs_input_grad[3])
        buffer = slots.replica_weights
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
            _buffer_packer(buffer), _buffer_unpacker(buffer, state)
        ):
            out = layer.run_replicas(leaves, tokens_, probs_, state.replica_tokens_per_slot)
        ctx.graph = (out, tokens_, probs_, leaves)
        return out.detach()

    @staticmethod
    def backward(ctx, grad_output):
        grad_tokens = grad_probs = None
        if ctx.graph is not None:
            out, tokens_, probs_, leaves = ctx.graph
            ctx.graph = None
            inputs = [t for t in (tokens_, probs_) if t.requires_grad] + [w for slot in leaves for w in slot]
            grads = list(torch.autograd.grad(out, inputs, grad_output, allow_unused=True))
            if tokens_.requires_grad:
                grad_tokens = grads.pop(0)
            if probs_.requires_grad:
                grad_probs = grads.pop(0)
            slots = get_runtime().slots
            per_slot = len(ctx.layer.expert_param_shapes)
            for s in range(slots.num_slots):
                slots.accumulate_grad(s, grads[s * per_slot : (s + 1) * per_slot])
        return None, None, grad_tokens, grad_probs


def _buffer_packer(buffer: torch.Tensor):
    """Saved-tensor pack hook: a view of ``buffer`` is saved as its geometry, not its storage."""
    storage = buffer.untyped_storage().data_ptr()

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() == storage:
            return ("replica-buffer", tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        return tensor

    return pack


def _buffer_unpacker(buffer: torch.Tensor, state: InvocationState):
    def unpack(saved):
        if isinstance(saved, tuple):
            if get_runtime().slots.holder is not state:
                raise RuntimeError("UltraEP: replica weights used in a backward before re-materialization")
            _, offset, shape, stride = saved
            return buffer.as_strided(shape, stride, offset)
        return saved

    return unpack


class BalancedMoELayer(MoELayer):
    """megatron-core ``MoELayer`` that balances every microbatch on its exact post-gating load.

    Args: as ``MoELayer``, plus ``balancer_config`` (``BalancerConfig``), passed through the layer
    spec's ``params``.
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *,
                 balancer_config: BalancerConfig, **kwargs):
        problems = unsupported_moe_settings(config)
        if problems:
            raise ValueError(f"--moe-balancer {balancer_config.name}: " + "; ".join(problems))
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, **kwargs)
        self.balancer_config = balancer_config
        self.balancer_pg_collection = pg_collection
        self.token_dispatcher = balanced_dispatcher_class(config)(
            self.num_local_experts, self.local_expert_indices, config, pg_collection, self
        )
        # [local expert][k] parameter names; every expert's k-th parameter has the same shape.
        self.expert_param_names = expert_param_names(self.experts, self.num_local_experts)
        first = [self.experts.get_parameter(n) for n in self.expert_param_names[0]]
        self.expert_param_shapes = [(n, tuple(p.shape)) for n, p in zip(self.expert_param_names[0], first)]
        self.balancer = balancer_config.build(self.num_local_experts * pg_collection.ep.size(),
                                              pg_collection.ep.size())
        get_runtime().register_layer(self)
        # Built now, not at the first forward: by then the training loop has hung process-group
        # handles on the config, which the experts' constructor cannot deep-copy.
        get_runtime().replica_experts(self)

    def set_layer_number(self, layer_number: int) -> None:
        """Megatron's numbering for the router; ``layer_number`` here is the balancer's layer id
        (:func:`~ultraep_megatron.megatron.layer_spec.moe_layer_id`: MTP layers after the
        decoder), by which the ring, telemetry and traces tell layers apart."""
        super().set_layer_number(layer_number)
        self.layer_number = moe_layer_id(self.router)

    def main_expert_param_lists(self) -> List[List[torch.Tensor]]:
        """``[local expert][k]`` parameters, ``k`` in ``expert_param_shapes`` order."""
        return expert_params(self.experts, self.expert_param_names)

    def main_expert_params(self) -> List[torch.Tensor]:
        """Every local main expert's parameters, expert-major, in ``expert_param_shapes`` order."""
        return [p for per_expert in self.main_expert_param_lists() for p in per_expert]

    def run_replicas(self, slot_weights, tokens, probs, tokens_per_slot: Sequence[int]) -> torch.Tensor:
        """Redundant slots' expert compute: [N, H] tokens sorted by slot -> [N, H] outputs."""
        module, names = get_runtime().replica_experts(self)
        return run_replica_experts(module, names, slot_weights, tokens, tokens_per_slot, probs)

    def routed_experts_compute(self, hidden_states, probs):
        dispatched, tokens_per_slot, permuted_probs = self.token_dispatcher.dispatch_postprocess(
            hidden_states, probs
        )
        state = self.token_dispatcher.state
        track = torch.is_grad_enabled()  # a backward will follow: re-materialize and reduce in it
        if track:
            dispatched = _ReduceReplicaGrads.apply(self, state, dispatched, *self.main_expert_params())
        num_main = state.main_tokens  # from the plan: no device-to-host read of tokens_per_slot
        main_out, mlp_bias = self.experts(
            dispatched[:num_main], tokens_per_slot[: self.num_local_experts], permuted_probs[:num_main]
        )
        replica_tokens, replica_probs = dispatched[num_main:], permuted_probs[num_main:]
        if track:
            replica_out = _ReplicaExperts.apply(self, state, replica_tokens, replica_probs)
        elif replica_tokens.shape[0] > 0:  # eval, or the no-grad first pass of activation recompute
            replica_out = self.run_replicas(get_runtime().slots.weight_views(), replica_tokens,
                                            replica_probs, state.replica_tokens_per_slot)
        else:
            replica_out = replica_tokens.new_zeros(0, self.config.hidden_size)
        output = torch.cat([main_out, replica_out], dim=0)
        if track:
            output = _Rematerialize.apply(self, state, output)
        return self.token_dispatcher.combine_preprocess(output), mlp_bias
