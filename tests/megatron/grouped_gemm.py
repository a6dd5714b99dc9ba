"""The grouped GEMMs of the tests' grouped linears (:mod:`torch_grouped_linear`) in high precision,
without TE: :func:`grouped_matmul` (a loop of per-expert matmuls over contiguous token chunks) and
the delayed weight gradients.

Delayed weight gradients (``config.delay_wgrad_compute``, megatron's ``--delay-wgrad-compute``
in its overlapped 1F1B schedule) follow TE 2.x's contract (in ``transformer_engine/pytorch/``:
``module/grouped_linear.py``, ``module/base.py``, ``module/_common.py``'s ``WeightGradStore``;
megatron-core 0.19.2's ``TEGroupedLinear`` passes ``delay_wgrad_compute`` to TE and calls TE's
``backward_dw`` from its own):

* the module keeps a ``wgrad_store``, a FIFO of stashed weight-gradient computations; its
  parameters are marked ``skip_backward_post_hook`` (so megatron's DDP registers its gradient hook
  with :meth:`TorchGroupedLinear.register_wgrad_accumulation_and_reduce_hooks` instead of on the
  parameter's gradient accumulator);
* the backward computes the input gradient only; the weight gradients' GEMMs go into the store
  with their operands and the output tensors they will write, and those output tensors are what
  the backward returns for the weights (TE: not computed yet; here zeros, so a reader before
  ``backward_dw`` sees a definite wrong value rather than uninitialized memory); bias gradients are
  ``None``;
* the module's ``backward_dw()`` (nothing when the store is empty) pops the oldest computation,
  runs it into those tensors, sets each weight's ``.grad`` to its gradient (and a bias's where it
  has none), and runs the hooks registered with ``register_wgrad_accumulation_and_reduce_hooks``
  (``_trigger_wgrad_accumulation_and_reduce_hooks``), where megatron's DDP adds ``.grad`` to
  ``main_grad`` and marks the parameter ready for its bucket reduction.

Fails as TE does on a pop of an empty store and on a store used without delayed weight gradients.
Under fp8 the stashed GEMMs are ``te_grouped_fp8``'s (quantized operands; the same store and
``backward_dw``). Leaves out: TE's fused gradient accumulation under delay (``main_grad`` written
by ``backward_dw``'s GEMMs; fusion is refused by the grouped linear), ``ub_bulk_wgrad``, the
grouped-tensor path. The products are the undelayed path's (``grad_i^T @ rows_i`` per group),
computed later.
"""

from __future__ import annotations

import queue
from typing import Optional, Sequence

import torch

__all__ = ["grouped_matmul", "WeightGradStore", "DelayedWgradGroupedLinear"]


def grouped_matmul(
    rows: torch.Tensor,
    weights: Sequence[torch.Tensor],
    tokens_per_expert: Sequence[int],
    biases: Optional[Sequence[torch.Tensor]] = None,
) -> torch.Tensor:
    """Rows of expert i times ``weights[i].T`` (plus ``biases[i]``), experts' rows contiguous.

    Args:
        rows: [T, in] rows sorted by expert.
        weights: G tensors [out, in].
        tokens_per_expert: G ints summing to T.
        biases: None or G tensors [out].

    Returns:
        [T, out]; differentiable in rows, weights and biases (an expert with no rows gets
        zero gradients).
    """
    num_biases = len(weights) if biases is None else len(biases)
    if not len(weights) == len(tokens_per_expert) == num_biases:
        raise ValueError(
            f"{len(tokens_per_expert)} token counts, {len(weights)} weights and "
            f"{None if biases is None else len(biases)} biases must agree"
        )
    if sum(tokens_per_expert) != rows.shape[0]:
        raise ValueError(
            f"tokens_per_expert sums to {sum(tokens_per_expert)}, "
            f"but there are {rows.shape[0]} rows"
        )
    chunks = torch.split(rows, list(tokens_per_expert))
    if biases is None:
        outs = [chunk @ weight.t() for chunk, weight in zip(chunks, weights)]
    else:
        outs = [
            torch.addmm(bias, chunk, weight.t())
            for chunk, weight, bias in zip(chunks, weights, biases)
        ]
    return torch.cat(outs)


class WeightGradStore:
    """Transformer Engine's ``WeightGradStore`` (``module/_common.py``): a FIFO of weight-gradient
    computations a module's backward stashed for its ``backward_dw``."""

    def __init__(self, delay_wgrad_compute: bool = False):
        self.enabled = delay_wgrad_compute
        self.context = queue.Queue() if delay_wgrad_compute else None

    def delay_wgrad_compute(self) -> bool:
        return self.enabled

    def put(self, tensor_list, func) -> None:
        assert self.enabled, "delay_wgrad_compute is not enabled"
        self.context.put([tensor_list, func])

    def pop(self):
        """Run the oldest stashed computation: ``(its result, its tensors)``."""
        assert self.enabled, "delay_wgrad_compute is not enabled"
        if self.context.qsize() == 0:
            raise RuntimeError("Pop empty queue.")
        tensor_list, func = self.context.get()
        return func(*tensor_list), tensor_list


class DelayedWgradGroupedLinear(torch.autograd.Function):
    """A grouped linear in high precision whose weight gradients wait for ``backward_dw`` (TE's
    ``_GroupedLinear`` under ``delay_wgrad_compute``; module docstring): the backward computes the
    input gradient and stashes the weight-gradient GEMMs with their operands (the input rows and
    the output gradient of each group, as TE stashes ``inputmats`` and ``grad_output``: not the
    weights) and the tensors they will write, which it returns for the weights (zeros until then);
    ``None`` for biases (their gradients come with the weights')."""

    @staticmethod
    def forward(ctx, rows, store, m_splits, num_weights, *params):
        weights, biases = params[:num_weights], params[num_weights:]
        out = grouped_matmul(
            rows.detach(),
            [w.detach() for w in weights],
            m_splits,
            [b.detach() for b in biases] or None,
        )
        ctx.store, ctx.m_splits, ctx.num_biases = store, tuple(m_splits), len(biases)
        ctx.save_for_backward(rows, *weights)
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, *weights = ctx.saved_tensors
        m_splits = list(ctx.m_splits)
        row_chunks, grad_chunks = torch.split(rows, m_splits), torch.split(grad, m_splits)
        grad_rows = (
            torch.cat([g @ w for g, w in zip(grad_chunks, weights)])
            if ctx.needs_input_grad[0]
            else None
        )
        wgrad_list = [torch.zeros_like(w) for w in weights]  # TE: written by backward_dw's GEMMs

        def weight_gradients(row_chunks, grad_chunks, wgrad_list, num_biases):
            for buffer, x, g in zip(wgrad_list, row_chunks, grad_chunks):
                buffer.copy_(g.t() @ x)
            bias_grads = [g.sum(dim=0) for g in grad_chunks] if num_biases else []
            return wgrad_list, bias_grads

        ctx.store.put([row_chunks, grad_chunks, wgrad_list, ctx.num_biases], weight_gradients)
        return (grad_rows, None, None, None, *wgrad_list, *(None for _ in range(ctx.num_biases)))
