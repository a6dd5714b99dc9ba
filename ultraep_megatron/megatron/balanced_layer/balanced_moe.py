"""UltraEP inside megatron-core's MoE layer (paper §4, §7): :class:`BalancedMoELayer`, which
makes one :class:`~.invocation.BalancedInvocation` per microbatch in ``preprocess`` and runs it
through megatron's stages (docs/architecture.md); its one host wait is where megatron's dispatcher
waits for its splits.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from megatron.core.transformer.cuda_graphs import is_graph_capturing
from megatron.core.transformer.enums import CudaGraphModule
from megatron.core.transformer.moe.moe_layer import MoELayer

from ultraep_megatron.megatron.release.capabilities import (
    preprocess_graphed,
    unsupported_moe_settings,
)
from ultraep_megatron.megatron.balanced_layer.context import BalancingContext, LayerRegistration
from ultraep_megatron.megatron.balanced_layer.dispatchers import (
    balanced_dispatcher_class,
    in_backward_pass,
)
from ultraep_megatron.megatron.balanced_layer.expert_slots import (
    ExpertParamLookup,
    ExpertWeightLayout,
    LayerExperts,
    build_replica_experts,
    expert_param_names,
)
from ultraep_megatron.megatron.balanced_layer.invocation import BalancedInvocation
from ultraep_megatron.megatron.balanced_layer.layer_ids import moe_layer_id
from ultraep_megatron.megatron.balanced_layer.replica_autograd import (
    ReduceReplicaGrads,
    StartInBackward,
    run_replicas_in_graph,
)
from ultraep_megatron.megatron.balanced_layer.ring import (
    invocations_per_forward,
    overlapped_schedule,
)
from ultraep_megatron.megatron.balanced_layer.router_topk import install_topk_tap, topk_indices


class BalancedMoELayer(MoELayer):
    """megatron-core's ``MoELayer``, balanced on every microbatch's exact post-gating load;
    ``balancing``: the model's context (the layer spec's ``params``)."""

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
        self.balancer = balancing.config.build()
        self.token_dispatcher = balanced_dispatcher_class(config)(
            self.num_local_experts,
            self.local_expert_indices,
            config,
            pg_collection,
            num_slots=balancing.config.num_slots,
        )
        self._topk_tap = install_topk_tap(self.router)
        lookup = ExpertParamLookup(
            self.experts, expert_param_names(self.experts, self.num_local_experts)
        )
        first = lookup()[0]
        self.layer_experts = LayerExperts(
            lookup,
            ExpertWeightLayout(first),
            gradient_accumulation_fusion=bool(config.gradient_accumulation_fusion),
            delays_wgrad=bool(getattr(config, "delay_wgrad_compute", False)),
        )
        # The modules holding the main experts' parameters (their pre-hooks: _prepare_main_params).
        self._main_param_owners = [
            m for m in self.experts.modules() if next(m.parameters(recurse=False), None) is not None
        ]
        # forward() runs the stages whole; megatron's overlapped schedule calls them from its nodes.
        self._whole_forward = False
        self._runs_per_forward = invocations_per_forward(self)
        dispatcher = self.token_dispatcher
        balancing.register(
            LayerRegistration(
                expert_shapes=[tuple(p.shape) for p in first],
                weight_layout=self.layer_experts.layout,
                device=first[0].device,
                ep_group=dispatcher.ep_group,
                ep_rank=dispatcher.ep_rank,
                ep_size=dispatcher.ep_size,
                num_experts=config.num_moe_experts,
                model_config=config,
                runs_per_forward=self._runs_per_forward,
                overlapped=overlapped_schedule(config),
                preprocess_graphed=preprocess_graphed(config),
                build_replica_experts=functools.partial(
                    build_replica_experts, self.submodules.experts, config, pg_collection
                ),
            )
        )

    def set_layer_number(self, layer_number: int) -> None:
        """Megatron's numbering for the router; ``layer_number`` here is the balancer's layer id
        (``layer_ids.moe_layer_id``: MTP layers after the decoder)."""
        super().set_layer_number(layer_number)
        self.layer_number = moe_layer_id(self.router)

    def route(self, hidden_states, padding_mask=None):
        if self._topk_tap is not None:
            self._topk_tap.indices = None  # only this routing's indices count
        return super().route(hidden_states, padding_mask)

    def preprocess(self, hidden_states, probs, routing_map):
        dispatcher = self.token_dispatcher
        if self._preprocess_replayed():
            # A graph of the preprocessing ran it: its outputs are in megatron's tensor store, the
            # plan's record in the dispatcher (its cudagraph_attrs).
            hidden_states, probs = super().preprocess(hidden_states, probs, routing_map)
            record = dispatcher.plan_record
            if record is None:
                raise RuntimeError(
                    f"MoE layer {self.layer_number}: a graph of the preprocessing was replayed "
                    "without the device plan's record among its outputs (the preprocessing "
                    "graph needs --moe-balancer-planner device)"
                )
            dispatcher.invocation = self._invocation(
                None, self.balancing.unpack_graphed_plan(record)
            )
        else:
            dispatcher.invocation = invocation = self._begin(routing_map)
            if invocation.reroute_table is None and (
                self._whole_forward or not dispatcher.defers_host_plans
            ):
                invocation.wait()  # host planner: the reroute reads the plan's table
            # While megatron captures the preprocessing, its signal leaves from here: the rest
            # runs after each replay of the graph.
            hidden_states, probs = super().preprocess(hidden_states, probs, routing_map)
            if self.balancing.check_plans:
                dispatcher.slots.check_plan(invocation, routing_map)
        self._prepare_main_params()
        if self._whole_forward:
            invocation = dispatcher.invocation
            invocation.wait()  # device planner: once the reroute and permutation are queued
            invocation.start_weights()  # overlaps the token all-to-all and the main experts
        return hidden_states, probs

    def _begin(self, routing_map: torch.Tensor) -> BalancedInvocation:
        """This routing's invocation, its plan started; in an activation-recompute replay the
        checkpointed forward's (the same routing)."""
        if routing_map.dtype != torch.bool or routing_map.dim() != 2:
            raise ValueError("expected a [tokens, experts] bool routing map")
        topk_ids = topk_indices(self._topk_tap, routing_map, self.config.moe_router_topk)
        if in_backward_pass():
            ring = self.balancing.ring
            invocation = ring.get(ring.pop_for_recompute(self.layer_number))
            invocation.topk_ids = topk_ids  # the replay's routing: the same pairs, if deterministic
            return invocation
        dispatcher = self.token_dispatcher
        load = dispatcher.slots.gather_load(routing_map, dispatcher.tp_ep_group)
        captured = self.preprocess_captured_in_cuda_graph()
        handle = self.balancing.start_plan(load, self.balancer, captured=captured)
        if handle.table is not None:  # a device plan: its record is a graph output when captured
            dispatcher.plan_record = handle.crossing
        return self._invocation(topk_ids, handle)

    def _invocation(self, topk_ids, handle):
        return BalancedInvocation(
            layer_number=self.layer_number,
            context=self.balancing,
            experts=self.layer_experts,
            topk_ids=topk_ids,
            training=self.training,
            grad_enabled=torch.is_grad_enabled(),
            runs_per_forward=self._runs_per_forward,
            handle=handle,
        )

    def _prepare_main_params(self) -> None:
        """Run the main experts' modules' forward pre-hooks before the weight distribution reads
        their parameters (``--overlap-param-gather``: DDP's wait for their all-gather). Idempotent;
        run in every forward whatever the plan, as it also starts the next bucket's all-gather."""
        for module in self._main_param_owners:
            for hook_id, hook in tuple(module._forward_pre_hooks.items()):
                if hook_id in module._forward_pre_hooks_with_kwargs:
                    hook(module, (), {})
                else:
                    hook(module, ())

    def dispatch(self, hidden_states, probs):
        """megatron's dispatch; in its overlapped schedule's dispatch node first the host wait, the
        rows a host plan moves and the weight distribution (not in the pre-dispatch node: the other
        microbatch's backward reads its re-materialized replicas from the same buffer)."""
        if not self._whole_forward:
            invocation = self.token_dispatcher.invocation
            invocation.wait()
            hidden_states, probs = self.token_dispatcher.planned_inputs(hidden_states, probs)
            invocation.start_weights()
        return super().dispatch(hidden_states, probs)

    def preprocess_captured_in_cuda_graph(self) -> bool:
        """Whether this preprocessing is being captured into a Transformer Engine graph that ends
        after it (megatron's ``maybe_skip_or_early_return_by_cudagraph("preprocess")``)."""
        config = self.config
        return (
            config.cuda_graph_impl == "transformer_engine"
            and self.training
            and is_graph_capturing()
            and CudaGraphModule.moe_preprocess in config.cuda_graph_modules
        )

    def _preprocess_replayed(self) -> bool:
        """Whether a replayed graph already ran the preprocessing (megatron's tensor store holds
        its outputs: when its ``preprocess`` returns them)."""
        store = self.cudagraph_tensor_store
        return (
            self.config.cuda_graph_impl == "transformer_engine"
            and not store.is_empty()
            and store.routing_map is None
        )

    def routed_experts_compute(self, hidden_states, probs):
        dispatcher = self.token_dispatcher
        invocation = dispatcher.invocation
        G = self.num_local_experts
        track = torch.is_grad_enabled()  # a backward follows: re-materialize and reduce in it
        if track:  # on the received tokens: its backward follows every expert's
            params = ReduceReplicaGrads.inputs(invocation.take_main_params())
            hidden_states = ReduceReplicaGrads.apply(invocation, hidden_states, *params)
        if sum(invocation.plan.replica_rows) == 0:
            # Nothing for this rank's redundant slots: megatron's postprocess; its part of the
            # reduction starts where a replica's backward would have (before the main experts').
            tokens, rows_per_slot, permuted_probs = dispatcher.dispatch_postprocess(
                hidden_states, probs
            )
            main_out, mlp_bias = self.experts(tokens, rows_per_slot[:G], permuted_probs)
            if track and not self.layer_experts.delays_wgrad:
                main_out = StartInBackward.apply(invocation.start_reduction, main_out)
            else:  # the backward's transfers would wait for the distribution first
                self.balancing.slots.wait_filled(invocation)
            return dispatcher.combine_preprocess(main_out), mlp_bias
        main, replica, rows_per_slot, main_probs, replica_probs = (
            dispatcher.dispatch_postprocess_parts(hidden_states, probs)
        )
        main_out, mlp_bias = self.experts(main, rows_per_slot[:G], main_probs)
        if track:
            replica_out = run_replicas_in_graph(
                invocation, replica, replica_probs, dispatcher.replica_rows()
            )
        else:  # eval, or the no-grad first pass of activation recompute
            weights = invocation.replica_weights()
            replica_out = self.balancing.replica_experts(
                weights, replica, dispatcher.replica_rows(), replica_probs
            )
        return dispatcher.combine_preprocess_parts(main_out, replica_out), mlp_bias

    def postprocess(self, output, shared_expert_output):
        output = super().postprocess(output, shared_expert_output)
        if not self._whole_forward:  # megatron's combine node: the layer's last part
            output = self._rematerialize_in_backward(output)
            self.balancing.observe()
        return output

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        self._whole_forward = True
        try:
            outputs = super().forward(hidden_states, intermediate_tensors, padding_mask)
        finally:
            self._whole_forward = False
        if isinstance(outputs, list):
            # megatron's early return while capturing a partial graph of the layer: the graph's
            # outputs, which the rest of the forward takes from its store after each replay.
            return outputs
        output, mlp_bias = outputs
        output = self._rematerialize_in_backward(output)
        self.balancing.observe()  # the layer's work is queued: host time off the critical path
        return output, mlp_bias

    def _rematerialize_in_backward(self, output):
        """The layer's output; the first of its backward re-materializes the replicas."""
        if not torch.is_grad_enabled():
            return output
        return StartInBackward.apply(self.token_dispatcher.invocation.start_weights, output)

    def backward_dw(self, routed_experts: bool = True, shared_experts: bool = False):
        """megatron's delayed weight gradients (``--delay-wgrad-compute``) and the replicas', for
        the oldest invocation awaiting them: replica wgrads, reduction started, main wgrads, the
        reduction completed, then DDP's hooks of the linears in their order (plan-independent)."""
        experts = self.layer_experts
        if not (routed_experts and experts.delays_wgrad):
            return super().backward_dw(routed_experts, shared_experts)
        invocation = experts.awaiting_dw.popleft()
        weight_grads = None
        if sum(invocation.plan.replica_rows) > 0:  # the replica experts' delayed computation
            weight_grads = self.balancing.replica_experts.delayed_weight_grads()
        invocation.start_reduction(weight_grads)
        with _deferred_wgrad_hooks(self.experts.modules()) as fired:
            super().backward_dw(routed_experts, shared_experts)
        reduced = invocation.finish_reduction()
        for expert, grads in zip(invocation.take_main_params(), reduced):
            for param, grad in zip(expert, grads):
                if grad is not None:  # without Megatron DDP: into the gradient the linear set
                    param.grad = grad if param.grad is None else param.grad + grad
        for module in fired:
            module._trigger_wgrad_accumulation_and_reduce_hooks()


@contextlib.contextmanager
def _deferred_wgrad_hooks(modules):
    """Hold back TE linears' ``_trigger_wgrad_accumulation_and_reduce_hooks`` (DDP's gradient
    add and ready mark) during ``backward_dw``; yields the linears that fired them, in order."""
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
