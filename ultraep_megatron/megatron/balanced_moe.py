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
from torch.func import functional_call

from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from ultraep_megatron.megatron.arguments import unsupported_moe_settings
from ultraep_megatron.megatron.runtime import BalancerConfig, InvocationState, get_runtime


def _in_backward_pass() -> bool:
    """True while autograd's engine is executing a backward (e.g. an activation-recompute replay)."""
    return torch._C._current_graph_task_id() != -1


class BalancedAlltoAllDispatcher(MoEAlltoAllTokenDispatcher):
    """All-to-all dispatcher over physical slots, driven by a per-microbatch balancing plan.

    Args:
        num_local_experts: main experts per EP rank, ``L = E // R``.
        local_expert_indices: the logical ids of this rank's main experts.
        config: the model's TransformerConfig (logical ``num_moe_experts``).
        pg_collection: Megatron's process groups.
        layer: the owning MoELayer (for its layer number and balancer).
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection, layer):
        ep_size = pg_collection.ep.size()
        num_slots = layer.balancer_config.num_slots
        self.num_logical_experts = config.num_moe_experts
        self.num_main_local = num_local_experts
        self.num_slots = num_slots
        self.slots_per_rank = num_local_experts + num_slots
        ep_rank = pg_collection.ep.rank()
        # The parent sees R * P physical "experts"; its own config copy carries that count.
        physical_config = copy.copy(config)
        physical_config.num_moe_experts = ep_size * self.slots_per_rank
        super().__init__(
            self.slots_per_rank,
            [ep_rank * self.slots_per_rank + j for j in range(self.slots_per_rank)],
            config=physical_config,
            pg_collection=pg_collection,
        )
        self._layer = layer
        self.state: Optional[InvocationState] = None

    # -- planning -------------------------------------------------------------------------------
    def _gather_load(self, routing_map: torch.Tensor) -> torch.Tensor:
        """[T, E] bool -> [R, E] int64: exact per-source load of the whole EP group."""
        local = routing_map.sum(dim=0).long()
        if self.ep_size == 1:
            return local.unsqueeze(0)
        # Same exchange megatron's dispatcher makes for its splits; with expert-TP 1 the tp_ep group is
        # the EP group, in EP-rank order.
        return gather_from_sequence_parallel_region(local, group=self.tp_ep_group).view(
            self.ep_size, self.num_logical_experts
        )

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """Plan on the exact load, distribute replica weights, reroute to physical slots, permute."""
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
        plan = state.plan

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
        physical_ids = runtime.assign_tokens(plan, self.ep_rank, topk_ids)
        num_physical = self.ep_size * self.slots_per_rank
        physical_map = torch.zeros(num_tokens, num_physical, dtype=torch.bool, device=routing_map.device)
        physical_map.scatter_(1, physical_ids, True)
        # Differentiable in the router's probabilities: gather, then scatter into physical columns.
        physical_probs = torch.zeros(num_tokens, num_physical, dtype=probs.dtype, device=probs.device)
        physical_probs = physical_probs.scatter(1, physical_ids, probs.gather(1, topk_ids))
        runtime.reroute_seconds += time.perf_counter() - t0

        # Forward weight distribution into the shared replica slots (before the token dispatch).
        runtime.materialize(layer, state)
        return super().dispatch_preprocess(hidden_states, physical_map, physical_probs)

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


class _ReplicaExperts(torch.autograd.Function):
    """Expert compute of the redundant slots, with re-materialization and gradient reduction.

    Inputs: ``(layer, state, tokens [N, H], probs [N], *main_params)``; ``tokens`` are this rank's
    replica tokens sorted by slot. ``main_params`` (every local main expert's parameters, expert-major)
    are inputs only so that their gradient accumulation waits for this backward.
    """

    @staticmethod
    def forward(ctx, layer, state, tokens, probs, *main_params):
        # Only the virtual layer id crosses to the backward; the ring owns the state until then.
        ctx.layer, ctx.vid = layer, state.vid
        ctx.save_for_backward(tokens, probs)
        weights = get_runtime().slots.weight_views()
        return _run_replicas(layer, weights, tokens, probs, state.replica_tokens_per_slot)

    @staticmethod
    def backward(ctx, grad_output):
        layer, vid = ctx.layer, ctx.vid
        runtime = get_runtime()
        state = runtime.state(vid)
        tokens, probs = ctx.saved_tensors
        runtime.materialize(layer, state)  # the shared buffer may hold a later layer's replicas
        slots = runtime.slots
        leaf_weights = [[w.detach().requires_grad_() for w in slot] for slot in slots.weight_views()]
        tokens_ = tokens.detach().requires_grad_(ctx.needs_input_grad[2])
        probs_ = probs.detach().requires_grad_(ctx.needs_input_grad[3])
        grad_tokens = torch.zeros_like(tokens) if ctx.needs_input_grad[2] else None
        grad_probs = torch.zeros_like(probs) if ctx.needs_input_grad[3] else None
        slot_grads = [None] * sum(len(slot) for slot in leaf_weights)
        if tokens.shape[0] > 0:
            # Recompute this rank's replica experts with the re-materialized weights.
            with torch.enable_grad():
                out = _run_replicas(layer, leaf_weights, tokens_, probs_, state.replica_tokens_per_slot)
                inputs = [t for t in (tokens_, probs_) if t.requires_grad]
                inputs += [w for slot in leaf_weights for w in slot]
                grads = list(torch.autograd.grad(out, inputs, grad_output, allow_unused=True))
            if tokens_.requires_grad:
                grad_tokens = grads.pop(0)
            if probs_.requires_grad:
                grad_probs = grads.pop(0)
            slot_grads = grads
        # Replica weight gradients into the shared fp32 buffer, then reduce into the main experts.
        per_slot = len(layer.expert_param_shapes)
        for s in range(slots.num_slots):
            slots.accumulate_grad(s, slot_grads[s * per_slot : (s + 1) * per_slot])
        main_param_grads = runtime.reduce_replica_grads(layer, state)
        runtime.release(vid)
        return (None, None, grad_tokens, grad_probs, *main_param_grads)


def _run_replicas(layer, slot_weights, tokens, probs, tokens_per_slot: Sequence[int]):
    """Apply each redundant slot's expert (weights ``slot_weights[s]``) to its chunk of tokens."""
    template = layer.experts.local_experts[0]
    names = [name for name, _ in layer.expert_param_shapes]
    outputs: List[torch.Tensor] = []
    start = 0
    for s, count in enumerate(tokens_per_slot):
        if count == 0:
            continue
        params = dict(zip(names, slot_weights[s]))
        out, _ = functional_call(template, params, (tokens[start : start + count], probs[start : start + count]))
        outputs.append(out)
        start += count
    if not outputs:
        return tokens.new_zeros(0, layer.config.hidden_size)
    return torch.cat(outputs, dim=0)


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
        super().__init__(config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, **kwargs)
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        self.balancer_config = balancer_config
        self.token_dispatcher = BalancedAlltoAllDispatcher(
            self.num_local_experts, self.local_expert_indices, config, pg_collection, self
        )
        template = self.experts.local_experts[0]
        # (name, shape) of one expert's parameters; every local expert has the same.
        self.expert_param_shapes = [(n, tuple(p.shape)) for n, p in template.named_parameters()]
        self.balancer = balancer_config.build(self.num_local_experts * pg_collection.ep.size(),
                                              pg_collection.ep.size())
        get_runtime().register_layer(self)

    def main_expert_params(self) -> List[torch.Tensor]:
        """Every local main expert's parameters, expert-major, in ``expert_param_shapes`` order."""
        return [p for expert in self.experts.local_experts for p in expert.parameters()]

    def routed_experts_compute(self, hidden_states, probs):
        dispatched, tokens_per_slot, permuted_probs = self.token_dispatcher.dispatch_postprocess(
            hidden_states, probs
        )
        state = self.token_dispatcher.state
        num_main = int(tokens_per_slot[: self.num_local_experts].sum())
        main_out, mlp_bias = self.experts(
            dispatched[:num_main], tokens_per_slot[: self.num_local_experts], permuted_probs[:num_main]
        )
        replica_out = _ReplicaExperts.apply(
            self, state, dispatched[num_main:], permuted_probs[num_main:], *self.main_expert_params()
        )
        output = torch.cat([main_out, replica_out], dim=0)
        return self.token_dispatcher.combine_preprocess(output), mlp_bias
