"""The fused reroute-and-permute: the routed (token, expert) pairs and this rank's reroute table
(``record_layout``, from ``plan_invocation``) -> the token rows in the all-to-all's send order.

    out = reroute_permute(topk_ids, hidden, probs, table, num_experts=E)
    # out.permuted [N, H], out.permuted_probs [N]: send order (physical-slot-major, token-ascending
    # within a slot: megatron's permute of the physical routing map); out.send_token [N] int32,
    # out.pair_slot / out.pair_row [T, K] int32: each pair's physical slot and send row.

Where a pair goes: its expert-major position ``i`` (the table's row 2 at its expert plus its rank
among this rank's pairs of that expert, in token order) selects the table column ``k`` whose
running total first exceeds ``i``; the pair goes to physical slot ``row1[k]`` and send row
``row3[k] + i``. On CUDA (and under ``TRITON_INTERPRET=1``) two Triton launches
(``triton_reroute.py``), replacing megatron's sort and the permutation's ops; on the host the same
definition as a few torch calls. The backward (``ultraep::unpermute_add``, one launch on CUDA) sums
each token's rows in ascending send-row order, as autograd's ``index_add`` of ``index_select``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fused_plan import interpreting

__all__ = ["Rerouted", "reroute_permute", "host_reroute"]


@dataclass(frozen=True)
class Rerouted:
    """The pairs in send order (N = T * K rows), on the pairs' device.

    Attributes:
        permuted: [N, H] hidden rows (differentiable in ``hidden``).
        permuted_probs: [N] probs of the pairs (differentiable in ``probs``).
        send_token: int32 [N] the token of each send row.
        pair_slot: int32 [T, K] physical slot of each pair.
        pair_row: int32 [T, K] send row of each pair.
    """

    permuted: torch.Tensor
    permuted_probs: torch.Tensor
    send_token: torch.Tensor
    pair_slot: torch.Tensor
    pair_row: torch.Tensor


def host_reroute(topk_ids, hidden, probs, table, num_experts):
    T, K = topk_ids.shape
    N = T * K
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # pair index at each expert-major rank
    experts = flat.index_select(0, order)
    counts = torch.bincount(flat, minlength=num_experts)
    start = counts.cumsum(0) - counts
    rank_in = torch.arange(N, device=flat.device) - start.index_select(0, experts)
    position = (table[2].long().index_select(0, experts) + rank_in).to(torch.int32)
    column = torch.searchsorted(table[0], position, right=True)
    slot = table[1].index_select(0, column)
    row = (table[3].index_select(0, column) + position).long()
    pair_slot = torch.empty(N, dtype=torch.int32, device=flat.device).scatter_(0, order, slot)
    pair_row = torch.empty(N, dtype=torch.int32, device=flat.device).scatter_(
        0, order, row.to(torch.int32)
    )
    # A stale table can name rows outside the buffer: they go to a spare row N, dropped (the
    # kernel masks them); unwritten rows then hold token 0.
    spare = torch.where((row >= 0) & (row < N), row, N)
    send_token = torch.zeros(N + 1, dtype=torch.int64, device=flat.device).scatter_(
        0, spare, torch.div(order, K, rounding_mode="floor")
    )[:N]
    permuted = hidden.index_select(0, send_token)
    permuted_probs = torch.zeros(N + 1, dtype=probs.dtype, device=flat.device).scatter_(
        0, spare, probs.reshape(-1).index_select(0, order)
    )[:N]
    return (
        permuted,
        permuted_probs,
        send_token.to(torch.int32),
        pair_slot.view(T, K),
        pair_row.view(T, K),
    )


def _kernels_run(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda or interpreting()


@torch.library.custom_op("ultraep::reroute_permute", mutates_args=())
def _reroute_op(
    topk_ids: torch.Tensor,
    hidden: torch.Tensor,
    probs: torch.Tensor,
    table: torch.Tensor,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _kernels_run(hidden):
        from .triton_reroute import reroute_permute_kernels

        return reroute_permute_kernels(topk_ids, hidden, probs, table, num_experts)
    return host_reroute(topk_ids, hidden, probs, table, num_experts)


@_reroute_op.register_fake
def _(topk_ids, hidden, probs, table, num_experts):
    T, K = topk_ids.shape
    N = T * K
    return (
        hidden.new_empty((N, hidden.shape[1])),
        probs.new_empty(N),
        topk_ids.new_empty(N, dtype=torch.int32),
        topk_ids.new_empty((T, K), dtype=torch.int32),
        topk_ids.new_empty((T, K), dtype=torch.int32),
    )


@torch.library.custom_op("ultraep::unpermute_add", mutates_args=())
def _unpermute_op(
    grad: torch.Tensor,
    grad_probs: torch.Tensor,
    send_token: torch.Tensor,
    pair_row: torch.Tensor,
    hidden_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad [N, H], grad_probs [N]) in send order -> (grad_hidden [T, H], grad_pair_probs [T, K])."""
    if _kernels_run(grad):
        from .triton_reroute import unpermute_kernel

        return unpermute_kernel(grad, grad_probs, pair_row, hidden_dtype)
    T, K = pair_row.shape
    N = grad_probs.shape[0]
    grad_hidden = grad.new_zeros((T, grad.shape[1]), dtype=hidden_dtype)
    grad_hidden.index_add_(0, send_token.long(), grad.to(hidden_dtype))
    # A stale table's pairs past the buffer were dropped in the forward: no gradient (the kernel
    # masks them alike).
    rows = pair_row.reshape(-1).long()
    inside = (rows >= 0) & (rows < N)
    pair_grad = grad_probs.index_select(0, rows.clamp(0, max(N - 1, 0))) * inside
    return grad_hidden, pair_grad.view(T, K)


@_unpermute_op.register_fake
def _(grad, grad_probs, send_token, pair_row, hidden_dtype):
    T, K = pair_row.shape
    return grad.new_empty((T, grad.shape[1]), dtype=hidden_dtype), grad_probs.new_empty((T, K))


def _setup_context(ctx, inputs, output):
    _, hidden, _, _, _ = inputs
    _, _, send_token, _, pair_row = output
    ctx.save_for_backward(send_token, pair_row)
    ctx.hidden_dtype, ctx.hidden_size = hidden.dtype, hidden.shape[1]
    # The integer outputs have no gradient: without this autograd would zero-fill one for each (a
    # launch apiece) before calling the backward.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad, grad_probs, *_):
    send_token, pair_row = ctx.saved_tensors
    N = send_token.shape[0]
    if grad is None:
        grad = torch.zeros((N, ctx.hidden_size), device=send_token.device, dtype=ctx.hidden_dtype)
    if grad_probs is None:
        grad_probs = torch.zeros(N, device=send_token.device)
    grad_hidden, grad_pair_probs = _unpermute_op(
        grad, grad_probs, send_token, pair_row, ctx.hidden_dtype
    )
    return None, grad_hidden, grad_pair_probs, None, None


_reroute_op.register_autograd(_backward, setup_context=_setup_context)


def reroute_permute(
    topk_ids: torch.Tensor,
    hidden: torch.Tensor,
    probs: torch.Tensor,
    table: torch.Tensor,
    *,
    num_experts: int,
) -> Rerouted:
    """The pairs of ``topk_ids`` (int64 [T, K], distinct experts per token) with ``hidden`` [T, H]
    and ``probs`` [T, K] (each pair's prob) in the send order of ``table`` (int32 [4, C], this
    rank's reroute table for the load these pairs count), as one op
    (``torch.ops.ultraep.reroute_permute``), differentiable in ``hidden`` and ``probs``."""
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != 4:
        raise ValueError(f"table must be int32 [4, C], got {table.dtype} {tuple(table.shape)}")
    return Rerouted(*_reroute_op(topk_ids, hidden, probs, table, int(num_experts)))
