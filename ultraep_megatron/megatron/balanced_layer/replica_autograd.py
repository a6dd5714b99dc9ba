"""The autograd functions of a balanced MoE layer: where its backward starts and completes the
invocation's replica transfers (the order autograd runs them: ``balanced_moe``'s docstring).

* :class:`StartInBackward`: an identity whose backward starts a transfer (the re-materialization of
  the replica weights at the layer's output; a replica-less rank's part of the gradient reduction);
* :class:`ReplicaWeights` / :func:`run_replicas_in_graph`: the redundant slots' weights in the
  layer's graph, saved as geometry of the shared buffer; its backward starts the reduction;
* :class:`ReduceReplicaGrads`: completes the reduction into the main experts' gradients, in a
  plan-independent order for Megatron DDP;
* :func:`gradient_targets` / :func:`hosted_grads`: what the reduction reads and writes, as tensors
  (the context's ``start_reduction`` takes them, never the layer).

Only the virtual layer id crosses to the backward when there is one (the ring carries the
invocation's record, :class:`~.invocation.InvocationState`).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ultraep_megatron.megatron.balanced_layer.context import BalancingContext
from ultraep_megatron.megatron.balanced_layer.expert_slots import is_quantized
from ultraep_megatron.megatron.balanced_layer.invocation import Invocation, InvocationState
from ultraep_megatron.megatron.balanced_layer.native_torch import native_torch


def _keep(ctx, layer, state: InvocationState) -> None:
    # Only the virtual layer id crosses to the backward when there is one; the ring owns the record.
    ctx.layer, ctx.vid = layer, state.invocation.vid
    ctx.state = state if state.invocation.vid is None else None


def _state(ctx) -> InvocationState:
    """The forward's record: from the virtual-layer ring (training) or kept in ``ctx``."""
    return ctx.layer.balancing.record(ctx.vid) if ctx.vid is not None else ctx.state


def gradient_targets(
    main_params: List[List[torch.Tensor]],
    invocation: Invocation,
    *,
    gradient_accumulation_fusion: bool,
) -> Tuple[List[List[torch.Tensor]], Optional[List[bool]], bool]:
    """Where the replica gradients of ``invocation`` are reduced into, per ``[local expert][k]``
    main parameter: ``(targets, has_replica, fold_on_stream)``.

    With Megatron DDP (every parameter has a ``main_grad``) the targets are the fp32 ``main_grad``
    buffers and ``has_replica`` is ``None`` (nothing to hand back). Until the reduction completes
    nothing touches them (the experts' gradient accumulation waits for it), unless the main
    experts' weight-gradient kernels write them directly (``gradient_accumulation_fusion``): only
    then the fold waits for the completion instead of running on the transfer's stream. Without
    it: fresh fp32 gradients for the experts with a replica, a zero view (never written) for the
    others."""
    if all(getattr(p, "main_grad", None) is not None for ps in main_params for p in ps):
        return (
            [[p.main_grad for p in ps] for ps in main_params],
            None,
            not gradient_accumulation_fusion,
        )
    replicated = set(invocation.replicated_local_experts)
    has_replica = [g in replicated for g in range(len(main_params))]
    zero = torch.zeros((), dtype=torch.float32, device=main_params[0][0].device)
    targets = [
        [
            torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            if has
            else zero.expand(p.shape)
            for p in ps
        ]
        for ps, has in zip(main_params, has_replica)
    ]
    return targets, has_replica, True


def hosted_grads(
    invocation: Invocation,
    weight_grads: Optional[Sequence[Optional[torch.Tensor]]],
    params_per_expert: int,
) -> Dict[int, Optional[list]]:
    """What each redundant slot this rank hosts reduces: its replica's weight gradients (from
    ``weight_grads``, flat, slot-major, ``params_per_expert`` per slot; ``None`` where no replica
    backward ran), or zeros (``None``) where it received no rows; an unset gradient is zeros too (an
    expert kernel may leave an empty group's gradient unwritten). The transfer copies them into the
    shared fp32 buffer on its own stream."""
    hosted = {}
    for s in invocation.schedule.rank_transfers(invocation.ep_rank).hosted_slots:
        hosted[s] = (
            weight_grads[s * params_per_expert : (s + 1) * params_per_expert]
            if weight_grads is not None and invocation.replica_rows[s] > 0
            else None
        )
    return hosted


def reduced_grads(
    main_params: List[List[torch.Tensor]], state: InvocationState, balancing: BalancingContext
) -> List[List[Optional[torch.Tensor]]]:
    """Complete ``state``'s reduction (started by the layer's ``start_reduction``); return
    ``[local expert][k]`` the gradient each main parameter gains from its replicas: ``None`` for an
    expert without a replica, and for every expert where the reduction went into ``main_grad``."""
    reduction, state.reduction = state.reduction, None
    balancing.wait(reduction.handle)
    if reduction.has_replica is None:
        return [[None] * len(expert) for expert in main_params]
    return [
        [g.to(p.dtype) for p, g in zip(expert, grads)] if has else [None] * len(expert)
        for expert, grads, has in zip(main_params, reduction.targets, reduction.has_replica)
    ]


class StartInBackward(torch.autograd.Function):
    """Identity on a tensor of the layer; its backward starts one of the invocation's transfers
    (``start``, a bound method of the layer taking the invocation's record) where the tensor's
    gradient arrives:

    * ``start_rematerialization`` on the layer's output, the first of the layer's backward: copies
      this invocation's replicated main experts back into the shared weight buffer (later layers
      overwrote it), overlapped with the combine's backward (re-materialization);
    * ``start_reduction`` on the main experts' output of a rank whose redundant slots received no
      rows: its part in the collective reduction starts where a replica's backward would have
      started it (before the main experts' backward), so its peers never wait on it.
    """

    @staticmethod
    def forward(ctx, layer, state, start, tensor):
        _keep(ctx, layer, state)
        ctx.start = start
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.start(_state(ctx))
        return None, None, None, grad


class ReduceReplicaGrads(torch.autograd.Function):
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
    def forward(ctx, layer, state, received, *params):
        _keep(ctx, layer, state)
        ctx.params = params
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad_received):
        state = _state(ctx)
        layer = ctx.layer
        if layer.delays_wgrad:  # --delay-wgrad-compute: the layer's backward_dw comes next
            layer.await_backward_dw(state)
        if layer.reduces_after_dw:  # the weight gradients do not exist yet: backward_dw reduces
            return (None, None, grad_received, *(None for _ in ctx.params))
        reduced = layer.finish_reduction(state)  # [local expert][k]
        layer.balancing.release(state.invocation)
        by_param = {
            id(p): g
            for expert, grads in zip(layer.main_expert_param_lists(), reduced)
            for p, g in zip(expert, grads)
        }
        return (None, None, grad_received, *(by_param[id(p)] for p in ctx.params))


class ReplicaWeights(torch.autograd.Function):
    """The redundant slots' weights as tensors of the layer's autograd graph: views of the shared
    weight buffer, or quantized tensors over its bytes with ``--fp8-param-gather``
    (``BalancedMoELayer.replica_weight_views``), flat (slot-major, ``expert_param_shapes`` order).
    Their gradients have the high-precision shapes. The forward waits for the
    invocation's weight distribution; the backward, once autograd has every replica weight
    gradient, starts their reduction towards the home ranks with them (which copies them into the
    shared fp32 gradient buffer on its stream; collective, so every rank runs it, with replica rows
    or not).

    The replica experts then run in the layer's graph (:func:`run_replicas_in_graph`), not in a
    graph of their own differentiated by a nested backward call. Their saved weights are stored as
    (offset, shape, stride, dtype) of the buffer (a quantized one as its metadata over such views)
    instead of being kept alive (saved-tensor hooks), because
    later layers overwrite the buffer; unpacking them waits for its re-materialization, so no replica
    activation is recomputed. ``tokens`` and ``probs`` (the replica rows and their router
    probabilities) get no gradient here: they make the weights need one whenever the replica output
    does. The rows need one whenever a local main expert of this rank is trainable, even with the
    router and the layers below frozen: they come out of :class:`ReduceReplicaGrads`, whose inputs
    include such a parameter. (With every local expert, the router and the layers below frozen on
    one rank but not on another, megatron's own all-to-all backward would not run on that rank
    either.)

    The weights are returned as aliases of the buffer that autograd does not track as views
    (``detach``, or quantized tensors built over it): later layers write the buffer in place, and autograd would refuse a tracked view
    of it afterwards (a custom function's view whose base changed), e.g. where a kernel keeps the
    weight tensors for its backward.
    """

    @staticmethod
    def forward(ctx, layer, state, tokens, probs):
        _keep(ctx, layer, state)
        ctx.set_materialize_grads(
            False
        )  # an unused weight's gradient stays None, not a zero tensor
        layer.balancing.wait_weights(state.invocation)
        return tuple(w for slot in layer.replica_weight_views() for w in slot)

    @staticmethod
    def backward(ctx, *weight_grads):
        # With --delay-wgrad-compute the replica experts' linears hand autograd gradients they
        # have not computed yet (Transformer Engine fills them in backward_dw): the layer's
        # backward_dw reduces what that computes.
        if not ctx.layer.reduces_after_dw:
            ctx.layer.start_reduction(_state(ctx), weight_grads)
        return None, None, None, None


def run_replicas_in_graph(
    layer, state: InvocationState, tokens: torch.Tensor, probs: torch.Tensor, rows_per_slot
):
    """Expert compute of this rank's redundant slots, differentiable: ``tokens [N, H]`` (sorted by
    slot, ``rows_per_slot`` host ints: the plan's rows, or as the dispatcher padded them) and their
    ``probs [N]`` -> ``[N, H]``, with the replica weight gradients reduced into the main experts' in
    the backward (:class:`ReplicaWeights`)."""
    flat = ReplicaWeights.apply(layer, state, tokens, probs)
    per_slot = len(layer.expert_param_shapes)
    weights = [flat[s * per_slot : (s + 1) * per_slot] for s in range(len(flat) // per_slot)]
    buffer = layer.balancing.weight_buffer()
    with torch.autograd.graph.saved_tensors_hooks(
        _buffer_packer(buffer), _buffer_unpacker(buffer, layer.balancing, state.invocation)
    ):
        return layer.run_replicas(weights, tokens, probs, rows_per_slot)


class _BufferView(NamedTuple):
    """A saved view of the replica weight buffer, as its geometry (in elements of its dtype)."""

    offset: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype


class _SavedQuantized(NamedTuple):
    """A saved quantized weight (``--fp8-param-gather``; a wrapper without storage of its own): its
    class, shape, dtype and ``get_metadata()``, storage tensors packed."""

    cls: type
    shape: tuple
    dtype: torch.dtype
    metadata: dict


def _buffer_packer(buffer: torch.Tensor):
    """Saved-tensor pack hook: a view of ``buffer`` is saved as its geometry, not its storage; a
    quantized weight as its metadata with its storage tensors packed alike."""
    storage = buffer.untyped_storage().data_ptr()

    @native_torch  # our code, several times per layer and microbatch: no device mapping needed
    def pack(tensor):
        if is_quantized(tensor):  # before untyped_storage(): a wrapper subclass has none
            return _SavedQuantized(
                type(tensor),
                tuple(tensor.shape),
                tensor.dtype,
                {
                    key: pack(value) if isinstance(value, torch.Tensor) else value
                    for key, value in tensor.get_metadata().items()
                },
            )
        if tensor.untyped_storage().data_ptr() == storage:
            return _BufferView(
                tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype
            )
        return tensor

    return pack


def _buffer_unpacker(buffer: torch.Tensor, balancing: BalancingContext, invocation: Invocation):
    """Saved-tensor unpack hook: a saved view of ``buffer`` is resolved against the buffer once it
    holds ``invocation``'s replicas again (re-materialized; raises if it was not), a saved quantized
    weight rebuilt over such views. The first unpack of the invocation's backward waits for the
    transfer; later ones only check the holder."""
    waited = []

    @native_torch
    def unpack(saved):
        if isinstance(saved, _SavedQuantized):
            return saved.cls(
                shape=saved.shape,
                dtype=saved.dtype,
                requires_grad=False,
                **{key: unpack(value) for key, value in saved.metadata.items()},
            )
        if isinstance(saved, _BufferView):
            if not waited or not balancing.holds(invocation):
                balancing.wait_weights(invocation)
                waited.append(True)
            return buffer.view(saved.dtype).as_strided(saved.shape, saved.stride, saved.offset)
        return saved

    return unpack
