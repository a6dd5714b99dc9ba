"""UltraEP inside megatron-core's MoE layer: exact-load replication and reroute in the forward,
re-materialization and replica-gradient reduction in the backward (paper §4.1, §4.2, §7).

How it plugs in (no fork of megatron-core):

* ``BalancedMoELayer`` (here) subclasses ``MoELayer`` and is installed through the layer spec
  (``layer_spec``) with the model's ``BalancingContext`` (``context``). The local main experts stay
  megatron-core's own experts module (parameter names and checkpoint keys unchanged).
* The balanced dispatchers (``dispatchers``, over ``physical_routing``) subclass megatron's and work
  in *physical-slot space*: every EP rank owns ``P = G + S`` physical slots (its G main experts,
  then its S redundant slots), so the parent's permutation / all-to-all / chunk-sort machinery runs
  unchanged on ``R * P`` "experts".
* Explicit state: megatron's stages (``route``, ``preprocess``, ``dispatch``,
  ``routed_experts_compute``, ``combine``, ``postprocess``, the backward and ``backward_dw``) hand
  one record per invocation (``invocation.InvocationState``) from stage to stage: the layer makes it
  in ``preprocess``, the dispatcher holds it as megatron's dispatchers hold their per-call metadata,
  the ring carries it to the backward. The layer registers with the context by its data
  (``context.LayerRegistration``) and hands the context tensors (its main experts' weights, the
  gradient targets, the replicas' gradients), never itself.
* The autograd functions that start and complete the replica transfers in the backward:
  ``replica_autograd``.

One invocation (a layer on a microbatch), forward:

1. ``begin_invocation``: the exact load ``[R, E]`` is gathered (the exchange megatron's dispatcher
   makes for its splits) and crosses to the host once, into pinned memory; the host waits for it at
   that one point. Plan, transfer schedule, all-to-all splits, per-slot counts and telemetry are computed on
   the host (``invocation.Invocation``); megatron's dispatcher gets host splits, so it copies nothing.
2. reroute on the device: the reroute table (one non-blocking upload from pinned memory) maps each
   (token, expert) pair to its physical slot; megatron permutes the tokens;
3. the layer completes megatron's parameter all-gather of its main experts, if one is in flight
   (``--overlap-param-gather``), then starts the weight distribution into the shared redundant
   slots, asynchronously; megatron dispatches the tokens;
4. the main experts compute; the replica experts wait for the weights, then compute;
5. combine.

The backward, in the order autograd runs it::

    StartInBackward     (at the layer's output) starts copying this invocation's replicas back into
                        the shared weight buffer, which later layers overwrote (re-materialization)
    combine, its all-to-all and unpermute backward      (overlap the re-materialization)
    replica experts' backward (saved weights resolved against the re-materialized buffer)
    ReplicaWeights      starts the reduction of the replica weight gradients towards the home
                        ranks, which copies them into the shared fp32 buffer on its stream (on a
                        rank whose redundant slots received no rows, a StartInBackward starts its
                        part at this point)
    main experts' backward                              (overlaps the reduction)
    chunk sort backward
    ReduceReplicaGrads  completes the reduction into the main experts' gradients; releases the ring
                        slot. It is an identity on the received tokens whose inputs include the
                        parameters of every local main expert, so it runs after the main experts'
                        backward and before any of their gradient accumulations: Megatron DDP's
                        hook then sees complete grads, at a point and in an order that do not
                        depend on the plan (its bucket collectives stay in step across the
                        expert-data-parallel group)
    dispatch all-to-all backward

Every transfer is collective on the EP group and every rank issues them in the same order; a rank
with nothing to send or receive still takes part.

Under Transformer Engine's per-layer CUDA graphs (``--cuda-graph-impl transformer_engine``,
megatron's ``TECudaGraphHelper``): while megatron captures ``moe_router`` its early-return signal
ends the layer's forward after the router (``forward`` returns megatron's list of graph outputs),
and at each replay megatron hands the layer the graph's routing through its tensor store; steps 1-5
then run as above. With ``moe_preprocess`` as well (device planner only) the graph also holds the
load gather, the device plan, the reroute and the permutation; the plan's host half is one of the
graph's outputs (the dispatcher's ``cudagraph_attrs``), and after each replay it crosses to the
host, the layer's one host wait, and becomes the invocation (``preprocess``). Nothing the capture
computed on the host is reused by a replay.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from typing import Deque, List, Optional, Sequence

import torch

from megatron.core.transformer.cuda_graphs import is_graph_capturing
from megatron.core.transformer.enums import CudaGraphModule
from megatron.core.transformer.moe.moe_layer import MoELayer

from ultraep_megatron.megatron.balanced_layer.capabilities import (
    preprocess_graphed,
    unsupported_moe_settings,
)
from ultraep_megatron.megatron.balanced_layer.context import BalancingContext, LayerRegistration
from ultraep_megatron.megatron.balanced_layer.dispatchers import balanced_dispatcher_class
from ultraep_megatron.megatron.balanced_layer.expert_slots import (
    ExpertParamLookup,
    ExpertWeightLayout,
    build_replica_experts,
    expert_param_names,
)
from ultraep_megatron.megatron.balanced_layer.invocation import InvocationState, Reduction
from ultraep_megatron.megatron.balanced_layer.layer_ids import moe_layer_id
from ultraep_megatron.megatron.balanced_layer.replica_autograd import (
    ReduceReplicaGrads,
    StartInBackward,
    gradient_targets,
    hosted_grads,
    reduced_grads,
    run_replicas_in_graph,
)
from ultraep_megatron.megatron.balanced_layer.ring import (
    invocations_per_forward,
    overlapped_schedule,
)
from ultraep_megatron.megatron.balanced_layer.router_topk import install_topk_tap, topk_indices


class BalancedMoELayer(MoELayer):
    """megatron-core ``MoELayer`` that balances every microbatch on its exact post-gating load.

    Args: as ``MoELayer``, plus ``balancing`` (the model's ``BalancingContext``), passed through the
    layer spec's ``params``.
    """

    def __init__(
        self,
        config,
        submodules=None,
        layer_number=None,
        pg_collection=None,
        *,
        balancing: BalancingContext,
        **kwargs,
    ):
        problems = unsupported_moe_settings(config, planner=balancing.planner)
        if problems:
            raise ValueError(f"--moe-balancer {balancing.config.name}: " + "; ".join(problems))
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        super().__init__(
            config,
            submodules=submodules,
            layer_number=layer_number,
            pg_collection=pg_collection,
            **kwargs,
        )
        self.balancing = balancing
        self.balancer_config = balancing.config
        self.balancer_pg_collection = pg_collection
        self.balancer = balancing.config.build()
        self.token_dispatcher = balanced_dispatcher_class(config)(
            self.num_local_experts,
            self.local_expert_indices,
            config,
            pg_collection,
            balancing=balancing,
            balancer=self.balancer,
        )
        # The router's [T, k] top-k indices: the reroute and permutation work on the routed pairs.
        self._topk_tap = install_topk_tap(self.router)
        # [local expert][k] parameter names; every expert's k-th parameter has the same shape.
        self.expert_param_names = expert_param_names(self.experts, self.num_local_experts)
        self._lookup_main_params = ExpertParamLookup(self.experts, self.expert_param_names)
        first = self._lookup_main_params()[0]
        # The high-precision shapes: the replica gradients' layout, and the weights' unless the
        # parameters are quantized (--fp8-param-gather), whose bytes move instead (the layout).
        self.expert_param_shapes = [
            (n, tuple(p.shape)) for n, p in zip(self.expert_param_names[0], first)
        ]
        self.expert_weight_layout = ExpertWeightLayout(first)
        self._main_params: Optional[List[List[torch.Tensor]]] = None
        # The modules holding the main experts' parameters (their forward pre-hooks, see
        # _prepare_main_params).
        self._main_param_owners = [
            m for m in self.experts.modules() if next(m.parameters(recurse=False), None) is not None
        ]
        # True inside forward(); megatron's overlapped schedule (--overlap-moe-expert-parallel-comm)
        # calls the layer's parts from its nodes instead (see "Overlapped schedule" above).
        self._whole_forward = False
        # --delay-wgrad-compute: the experts' weight gradients are computed in backward_dw(), and
        # so are the replicas'; their reduction follows it. The invocations whose experts'
        # backward ran and whose backward_dw has not, oldest first.
        self.delays_wgrad = bool(getattr(config, "delay_wgrad_compute", False))
        self.reduces_after_dw = self.delays_wgrad
        self._awaiting_dw: Deque[InvocationState] = deque()
        self._runs_per_forward = invocations_per_forward(self)
        dispatcher = self.token_dispatcher
        balancing.register(
            LayerRegistration(
                expert_shapes=[shape for _, shape in self.expert_param_shapes],
                weight_layout=self.expert_weight_layout,
                device=first[0].device,
                ep_group=dispatcher.ep_group,
                ep_rank=dispatcher.ep_rank,
                ep_size=dispatcher.ep_size,
                num_experts=config.num_moe_experts,
                model_config=config,
                runs_per_forward=self._runs_per_forward,
                overlapped=overlapped_schedule(config),
                preprocess_graphed=preprocess_graphed(config),
                build_replica_experts=functools.partial(build_replica_experts, self),
            )
        )

    def set_layer_number(self, layer_number: int) -> None:
        """Megatron's numbering for the router; ``layer_number`` here is the balancer's layer id
        (:func:`~ultraep_megatron.megatron.balanced_layer.layer_ids.moe_layer_id`: MTP layers after the
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

    def main_expert_weights(self) -> List[List[torch.Tensor]]:
        """``[local expert][part]`` what the weight distribution moves: the parameters, or the bytes
        of quantized ones (:class:`~ultraep_megatron.megatron.balanced_layer.expert_slots.ExpertWeightLayout`)."""
        layout = self.expert_weight_layout
        return [layout.main_weights(params) for params in self.main_expert_param_lists()]

    def replica_weight_views(self) -> List[List[torch.Tensor]]:
        """``[redundant slot][k]`` the replica experts' weights over the shared weight buffer, not
        tracked by autograd as its views: the buffer's views shaped like this layer's experts, or
        quantized parameters rebuilt over the bytes the slot holds."""
        balancing, layout = self.balancing, self.expert_weight_layout
        like = self.main_expert_param_lists()[0] if layout.quantized else None
        return [
            layout.replica_weights(balancing.replica_weight_views(s), like)
            for s in range(self.balancer_config.num_slots)
        ]

    def run_replicas(
        self, slot_weights, tokens, probs, rows_per_slot: Sequence[int]
    ) -> torch.Tensor:
        """Redundant slots' expert compute: [N, H] tokens sorted by slot -> [N, H] outputs."""
        return self.balancing.run_replicas(slot_weights, tokens, rows_per_slot, probs)

    # -- the invocation's transfers: the layer hands the context tensors ----------------------------
    def start_weights(self, state: InvocationState) -> None:
        """Start the weight distribution of ``state``'s replicas from this layer's main experts
        (forward; in the backward, :meth:`start_rematerialization`)."""
        if self.balancing.needs_weights(state.invocation):
            self.balancing.start_weights(state.invocation, self.main_expert_weights())

    def start_rematerialization(self, state: InvocationState) -> None:
        """The backward's copy of ``state``'s replicas back into the shared weight buffer."""
        if self.balancing.needs_weights(state.invocation):
            self.balancing.start_rematerialization(state.invocation, self.main_expert_weights())

    def start_reduction(self, state: InvocationState, weight_grads=None) -> None:
        """Start reducing ``state``'s replica gradients into this layer's main experts (collective
        on the EP group); its record keeps the reduction (:class:`Reduction`) for
        :meth:`finish_reduction`. ``weight_grads``: the replica weights' gradients, flat
        (slot-major, ``expert_param_shapes`` order; ``None`` where unset), or ``None`` where no
        replica backward ran (a rank whose redundant slots received no rows, or replica weights
        that needed no gradient)."""
        invocation = state.invocation
        if invocation.schedule_builder is None or state.reduction is not None:
            return
        targets, has_replica, fold_on_stream = gradient_targets(
            self.main_expert_param_lists(),
            invocation,
            gradient_accumulation_fusion=self.config.gradient_accumulation_fusion,
        )
        handle = self.balancing.start_reduction(
            invocation,
            targets,
            hosted_grads(invocation, weight_grads, len(self.expert_param_shapes)),
            fold_on_stream=fold_on_stream,
        )
        state.reduction = Reduction(handle, targets, has_replica)

    def finish_reduction(self, state: InvocationState):
        """Complete ``state``'s reduction; ``[local expert][k]`` the gradient each main expert
        parameter gains from its replicas (``None``: none, or folded into ``main_grad``)."""
        main_params = self.main_expert_param_lists()
        if state.invocation.schedule_builder is None:
            return [[None] * len(expert) for expert in main_params]
        self.start_reduction(state)  # if the replicas' backward did not start it
        return reduced_grads(main_params, state, self.balancing)

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

    def route(self, hidden_states, padding_mask=None):
        if self._topk_tap is not None:
            self._topk_tap.indices = None  # only this routing's indices count
        return super().route(hidden_states, padding_mask)

    def preprocess(self, hidden_states, probs, routing_map):
        dispatcher = self.token_dispatcher
        # Called from megatron's pre-dispatch node (overlapped schedule): the plan's host wait and
        # the weight distribution wait for the dispatch node (:meth:`dispatch`).
        in_nodes = not self._whole_forward
        if in_nodes:
            self._main_params = self._lookup_main_params()
        if self._preprocess_replayed():
            # A Transformer Engine graph of the preprocessing ran it (megatron's moe_preprocess
            # graph, device planner only): its outputs are in the tensor store, and the plan's host
            # half, a graph output too, is in the dispatcher (its cudagraph_attrs). It crosses now,
            # or in the dispatch node.
            hidden_states, probs = super().preprocess(hidden_states, probs, routing_map)
            if in_nodes:
                dispatcher.defer_after_graph(self._new_state(None))
            else:
                dispatcher.complete_plan_after_graph(self._new_state(None))
        else:
            topk_ids = topk_indices(self._topk_tap, routing_map, self.config.moe_router_topk)
            dispatcher.begin_invocation(
                self._new_state(topk_ids),
                routing_map,
                defer=in_nodes and dispatcher.can_defer(),
                captured=self.preprocess_captured_in_cuda_graph(),
            )
            # Reroute and permutation first: with the host planner the device waits for them after
            # the plan's host wait; with the device planner the host waits once, after they are
            # queued. While megatron captures the preprocessing, its signal leaves from here: the
            # rest runs after each replay of the graph.
            hidden_states, probs = super().preprocess(hidden_states, probs, routing_map)
        self._prepare_main_params()
        if not in_nodes:
            # Overlaps the token all-to-all and the main experts.
            self.start_weights(dispatcher.state)
        return hidden_states, probs

    def _new_state(self, topk_ids) -> InvocationState:
        """The record of a new invocation of this layer, in its current mode."""
        return InvocationState(
            layer_number=self.layer_number,
            runs_per_forward=self._runs_per_forward,
            training=self.training,
            grad_enabled=torch.is_grad_enabled(),
            topk_ids=topk_ids,
        )

    def dispatch(self, hidden_states, probs):
        """megatron's dispatch; in its overlapped schedule's dispatch node, first the plan's one
        host wait (where megatron's own dispatcher waits for its splits, after the other
        microbatch's experts backward is queued) and what needs the plan: the tokens' rows per
        instance, and the weight distribution (on the data plane's stream: it overlaps the token
        all-to-all and the main experts)."""
        dispatcher = self.token_dispatcher
        if not self._whole_forward:
            if dispatcher.deferred is not None:
                hidden_states, probs = dispatcher.complete_deferred_plan(hidden_states, probs)
            # Here, not in the pre-dispatch node: the other microbatch's experts backward, queued
            # between the two, reads its re-materialized replicas from the same buffer.
            self.start_weights(dispatcher.state)
        return super().dispatch(hidden_states, probs)

    def preprocess_captured_in_cuda_graph(self) -> bool:
        """Whether this preprocessing is being captured into a Transformer Engine graph that ends
        after it (megatron's ``maybe_skip_or_early_return_by_cudagraph("preprocess")`` condition:
        warm-up and capture of ``--cuda-graph-modules moe_preprocess``): then its plan's host half
        crosses after each replay of the graph, not here."""
        config = self.config
        return (
            config.cuda_graph_impl == "transformer_engine"
            and self.training
            and is_graph_capturing()
            and CudaGraphModule.moe_preprocess in config.cuda_graph_modules
        )

    def _preprocess_replayed(self) -> bool:
        """Whether a replayed graph already ran the preprocessing: megatron's tensor store holds its
        outputs (the same condition under which its ``preprocess`` returns them)."""
        store = self.cudagraph_tensor_store
        return (
            self.config.cuda_graph_impl == "transformer_engine"
            and not store.is_empty()
            and store.routing_map is None
        )

    def routed_experts_compute(self, hidden_states, probs):
        dispatcher = self.token_dispatcher
        state = dispatcher.state
        invocation = state.invocation
        track = torch.is_grad_enabled()  # a backward will follow: re-materialize and reduce in it
        if track:  # on the received tokens: its backward follows every expert's
            hidden_states = ReduceReplicaGrads.apply(
                self, state, hidden_states, *ReduceReplicaGrads.inputs(self)
            )
        if sum(invocation.replica_rows) == 0:
            # Nothing for this rank's redundant slots (host metadata): megatron's postprocess, no
            # parts. The backward's transfers wait for this weight distribution first; without a
            # backward, wait here.
            dispatched, rows_per_slot, permuted_probs = dispatcher.dispatch_postprocess(
                hidden_states, probs
            )
            main_out, mlp_bias = self.experts(
                dispatched, rows_per_slot[: self.num_local_experts], permuted_probs
            )
            if track and not self.reduces_after_dw:  # (else backward_dw starts it)
                main_out = StartInBackward.apply(self, state, self.start_reduction, main_out)
            else:
                self.balancing.wait_weights(invocation)
            return dispatcher.combine_preprocess(main_out), mlp_bias
        main_tokens, replica_tokens, rows_per_slot, main_probs, replica_probs = (
            dispatcher.dispatch_postprocess_parts(hidden_states, probs)
        )
        main_out, mlp_bias = self.experts(
            main_tokens, rows_per_slot[: self.num_local_experts], main_probs
        )
        if track:
            replica_out = run_replicas_in_graph(
                self, state, replica_tokens, replica_probs, dispatcher.replica_rows
            )
        else:  # eval, or the no-grad first pass of activation recompute
            self.balancing.wait_weights(invocation)
            replica_out = self.run_replicas(
                self.replica_weight_views(), replica_tokens, replica_probs, dispatcher.replica_rows
            )
        return dispatcher.combine_preprocess_parts(main_out, replica_out), mlp_bias

    def postprocess(self, output, shared_expert_output):
        output = super().postprocess(output, shared_expert_output)
        if not self._whole_forward:  # megatron's combine node: the layer's last part
            if torch.is_grad_enabled():  # the first of the layer's backward (its combine node's)
                output = StartInBackward.apply(
                    self, self.token_dispatcher.state, self.start_rematerialization, output
                )
            self.balancing.observe()
        return output

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        self._main_params = self._lookup_main_params()
        self._whole_forward = True
        try:
            outputs = super().forward(hidden_states, intermediate_tensors, padding_mask)
        finally:
            self._whole_forward = False
        if isinstance(outputs, list):
            # megatron's early return while capturing a partial Transformer Engine graph of the
            # layer (--cuda-graph-modules moe_router / moe_preprocess): the graph's outputs, which
            # the rest of this forward takes from its store after each replay.
            return outputs
        output, mlp_bias = outputs
        if torch.is_grad_enabled():
            output = StartInBackward.apply(
                self, self.token_dispatcher.state, self.start_rematerialization, output
            )
        self.balancing.observe()  # the layer's work is queued: host time is off the critical path
        return output, mlp_bias

    def await_backward_dw(self, state: InvocationState) -> None:
        """The experts' backward of ``state``'s invocation ran with their weight gradients delayed
        (``--delay-wgrad-compute``): its :meth:`backward_dw` comes next."""
        self._awaiting_dw.append(state)

    def backward_dw(self, routed_experts: bool = True, shared_experts: bool = False):
        """megatron's delayed weight gradients (``--delay-wgrad-compute``, called by its
        overlapped schedule right after the experts' backward), and the replicas' with them.

        In order, for the invocation whose experts' backward ran last: the replicas' weight
        gradients (the replica experts' own delayed computation), the start of their reduction
        towards the home ranks (on the data plane's stream), the main experts' weight gradients
        (megatron's, which the reduction overlaps), the reduction's completion into the main
        experts' gradients, and only then Megatron DDP's hooks of the experts' linears, in the
        order the linears ran them: a parameter is marked ready for its (possibly overlapped)
        bucket reduction with its replicas' gradients in it, in an order that does not depend on
        the plan (the production-DDP rule of :class:`ReduceReplicaGrads`, for hooks that fire here
        instead of in autograd)."""
        if not (routed_experts and self.delays_wgrad):
            return super().backward_dw(routed_experts, shared_experts)
        state = self._awaiting_dw.popleft()
        balancing = self.balancing
        weight_grads = None
        if (
            sum(state.invocation.replica_rows) > 0
        ):  # the replica experts ran: their delayed computation
            weight_grads = balancing.replica_delayed_weight_grads()
        if (
            not self.reduces_after_dw
        ):  # reduced in the backward already (a negative control's fault)
            return super().backward_dw(routed_experts, shared_experts)
        self.start_reduction(state, weight_grads)
        with _deferred_wgrad_hooks(self.experts.modules()) as fired:
            super().backward_dw(routed_experts, shared_experts)
        reduced = self.finish_reduction(state)
        balancing.release(state.invocation)
        for expert, grads in zip(self.main_expert_param_lists(), reduced):
            for param, grad in zip(expert, grads):
                if grad is not None:  # without Megatron DDP: into the gradient the linear set
                    param.grad = grad if param.grad is None else param.grad + grad
        for module in fired:
            module._trigger_wgrad_accumulation_and_reduce_hooks()


@contextlib.contextmanager
def _deferred_wgrad_hooks(modules):
    """Hold back the weight-gradient hooks Transformer Engine's linears run at the end of their
    ``backward_dw`` (``_trigger_wgrad_accumulation_and_reduce_hooks``: where Megatron DDP, under
    ``--delay-wgrad-compute``, adds the gradient to ``main_grad`` and marks the parameter ready):
    yields the list of the linears that would have run them, in order, for the caller to run them
    later."""
    fired, held = [], []
    for module in modules:
        if callable(getattr(module, "_trigger_wgrad_accumulation_and_reduce_hooks", None)):
            module._trigger_wgrad_accumulation_and_reduce_hooks = functools.partial(
                fired.append, module
            )
            held.append(module)
    try:
        yield fired
    finally:
        for module in held:
            del module._trigger_wgrad_accumulation_and_reduce_hooks
