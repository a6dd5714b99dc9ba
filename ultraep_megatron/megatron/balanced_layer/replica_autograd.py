"""The autograd functions of a balanced MoE layer, where its backward re-materializes the
invocation's replica weights and reduces their gradients (order: docs/architecture.md).
"""

from __future__ import annotations

from typing import List, NamedTuple

import torch

from ultraep_megatron.megatron.balanced_layer.expert_slots import is_quantized
from ultraep_megatron.megatron.balanced_layer.invocation import BalancedInvocation


class StartInBackward(torch.autograd.Function):
    """Identity on ``tensor``; its backward calls ``start()`` (a bound method of the invocation:
    ``start_weights``, the re-materialization at the layer's output, or ``start_reduction`` on
    the main experts' output of a rank whose redundant slots received no rows, so its peers never
    wait on it) where the tensor's gradient arrives."""

    @staticmethod
    def forward(ctx, start, tensor):
        ctx.start = start
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.start()
        return None, grad


class ReduceReplicaGrads(torch.autograd.Function):
    """Identity on the received tokens ``[N, H]``; its backward, after the experts', completes the
    replica-gradient reduction into the main experts' gradients. Every local main expert's
    trainable parameters are inputs, whatever the plan, so DDP marks them ready in the same order
    on every rank of the expert-data-parallel group (else its bucket collectives go out of step)."""

    @staticmethod
    def inputs(main_params: List[List[torch.Tensor]]) -> List[torch.Tensor]:
        """The parameters ``apply`` takes after the tokens (expert-major, plan-independent)."""
        return [p for expert in main_params for p in expert if p.requires_grad]

    @staticmethod
    def forward(ctx, invocation: BalancedInvocation, received, *params):
        ctx.invocation, ctx.params = invocation, params
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad_received):
        invocation = ctx.invocation
        nones = (None for _ in ctx.params)
        if invocation.experts.delays_wgrad:  # the layer's backward_dw reduces after the wgrads
            invocation.experts.awaiting_dw.append(invocation)
            return (None, grad_received, *nones)
        reduced = invocation.finish_reduction()
        by_param = {
            id(p): g
            for expert, grads in zip(invocation.take_main_params(), reduced)
            for p, g in zip(expert, grads)
        }
        return (None, grad_received, *(by_param[id(p)] for p in ctx.params))


class ReplicaWeights(torch.autograd.Function):
    """The redundant slots' weights in the autograd graph, flat (slot-major): the forward waits
    for their distribution, the backward starts their gradients' reduction (unless the layer's
    ``backward_dw`` does). ``tokens``/``probs`` (no gradient) make the weights need one."""

    @staticmethod
    def forward(ctx, invocation: BalancedInvocation, tokens, probs):
        ctx.invocation = invocation
        ctx.set_materialize_grads(False)  # an unused weight's gradient stays None
        return tuple(w for slot in invocation.replica_weights() for w in slot)

    @staticmethod
    def backward(ctx, *weight_grads):
        if not ctx.invocation.experts.delays_wgrad:
            ctx.invocation.start_reduction(weight_grads)
        return None, None, None


def run_replicas_in_graph(
    invocation: BalancedInvocation, tokens: torch.Tensor, probs: torch.Tensor, rows_per_slot
) -> torch.Tensor:
    """The redundant slots' experts on ``tokens [N, H]`` (sorted by slot, ``rows_per_slot`` host
    ints) with ``probs [N]`` -> ``[N, H]``, differentiable; saved weights are kept as geometry of
    the shared buffer, resolved once it is re-materialized in the backward."""
    flat = ReplicaWeights.apply(invocation, tokens, probs)
    per_slot = len(flat) // invocation.context.config.num_slots
    weights = [flat[s * per_slot : (s + 1) * per_slot] for s in range(len(flat) // per_slot)]
    slots = invocation.context.slots
    with torch.autograd.graph.saved_tensors_hooks(
        _buffer_packer(slots.buffer.replica_weights), _buffer_unpacker(invocation)
    ):
        return invocation.context.replica_experts(weights, tokens, rows_per_slot, probs)


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
    """Pack hook: a view of ``buffer`` is saved as its geometry; a quantized weight as its metadata
    with its storage tensors packed alike."""
    storage = buffer.untyped_storage().data_ptr()

    def pack(tensor):
        if is_quantized(tensor):  # before untyped_storage(): a wrapper subclass has none
            metadata = {
                key: pack(value) if isinstance(value, torch.Tensor) else value
                for key, value in tensor.get_metadata().items()
            }
            return _SavedQuantized(type(tensor), tuple(tensor.shape), tensor.dtype, metadata)
        if tensor.untyped_storage().data_ptr() == storage:
            return _BufferView(
                tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype
            )
        return tensor

    return pack


def _buffer_unpacker(invocation: BalancedInvocation):
    """Unpack hook: a saved view is resolved against the buffer once it holds ``invocation``'s
    replicas again (raises if it does not); a saved quantized weight is rebuilt over such views.
    The first unpack of the backward waits for the re-materialization."""
    slots = invocation.context.slots
    buffer = slots.buffer.replica_weights
    waited: list = []

    def unpack(saved):
        if isinstance(saved, _SavedQuantized):
            parts = {key: unpack(value) for key, value in saved.metadata.items()}
            return saved.cls(shape=saved.shape, dtype=saved.dtype, requires_grad=False, **parts)
        if isinstance(saved, _BufferView):
            if not waited or slots.holder is not invocation:
                slots.wait_filled(invocation)
                waited.append(True)
            return buffer.view(saved.dtype).as_strided(saved.shape, saved.stride, saved.offset)
        return saved

    return unpack
