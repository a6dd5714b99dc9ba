"""A gloo stand-in for HybridEP's fused dispatch and combine (``moe_flex_dispatcher_backend=
"hybridep"``, megatron's ``_HybridEPManager``), over :mod:`deepep_gloo`'s transport and host-wait
hooks; :func:`deepep_gloo.install` installs it.

Follows the contract of megatron-core 0.19.2's ``transformer/moe/fused_a2a.py``
(``hybrid_ep_dispatch`` / ``hybrid_ep_combine``, over DeepEP's ``HybridEPBuffer``
``dispatch_with_permute`` / ``combine_with_unpermute``): a ``[N, W * L]`` bool routing map and
float32 probabilities in; the received rows out permuted, local-expert-major (within an expert:
source rank, then token), each expert's rows padded with zero rows to ``pad_multiple``;
``num_permuted_tokens`` rows when given, else HybridEP reads the permuted size from the GPU, a host
wait (reported to ``deepep_gloo.on_host_wait``); ``tokens_per_expert`` stays on the device. Combine
sums each token's rows back at its source; each operation's backward is the other.

Fails (``ValueError``) on what HybridEP cannot take: a routing map or probabilities of another
shape, non-float32 probabilities, ``num_permuted_tokens`` below the permuted rows, a combine whose
rows are not its dispatch's.

Leaves out: the SM and block counts and ``fused`` (tuning of the real kernels: ignored), more than
one node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepep_gloo import exchange_rows, host_wait, on_device, transport


@dataclass
class HybridHandle:
    """Layout of one HybridEP dispatch, reused by its combine and by both backwards.

    With S rows sent from this rank, R received by it, M permuted rows out (padding included),
    W ranks and L local experts:

    Attributes:
        group, num_tokens, send_token [S], send_rank [S], send_splits, recv_splits: as
            :class:`deepep_gloo.DispatchHandle` (a token travels once to each rank hosting one of its experts).
        num_local_experts: L.
        permuted_row: [M] int64, the received row each permuted row copies, -1 for padding.
        permuted_expert: [M] int64, its local expert (0 for padding).
    """

    group: dist.ProcessGroup
    num_tokens: int
    send_token: torch.Tensor
    send_rank: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    num_local_experts: int
    permuted_row: torch.Tensor
    permuted_expert: torch.Tensor


def _permuted_from_rows(rows: torch.Tensor, handle: HybridHandle) -> torch.Tensor:
    """[R, *D] received rows -> [M, *D] permuted rows (zero padding rows)."""
    padded = torch.cat([rows, rows.new_zeros((1, *rows.shape[1:]))])
    return padded[torch.where(handle.permuted_row >= 0, handle.permuted_row, rows.shape[0])]


def _rows_from_permuted(
    permuted: torch.Tensor, handle: HybridHandle, num_rows: int
) -> torch.Tensor:
    """[M, *D] permuted rows -> [R, *D] received rows, summing each row's experts (padding dropped)."""
    valid = handle.permuted_row >= 0
    out = permuted.new_zeros((num_rows, *permuted.shape[1:]))
    return out.index_add_(0, handle.permuted_row[valid], permuted[valid])


def _hybrid_combine(x: torch.Tensor, handle: HybridHandle) -> torch.Tensor:
    """[M, H] permuted expert outputs -> [N, H]: every token's rows summed, back at its source."""
    rows = _rows_from_permuted(x, handle, sum(handle.recv_splits))
    returned = exchange_rows(rows, handle.recv_splits, handle.send_splits, handle.group)
    return x.new_zeros((handle.num_tokens, x.shape[1])).index_add_(0, handle.send_token, returned)


def _hybrid_dispatch_rows(x: torch.Tensor, handle: HybridHandle) -> torch.Tensor:
    """[N, H] -> [M, H]: each token's row to every rank it goes to, permuted there."""
    rows = exchange_rows(x[handle.send_token], handle.send_splits, handle.recv_splits, handle.group)
    return _permuted_from_rows(rows, handle)


class GlooHybridDispatch(torch.autograd.Function):
    """HybridEP's dispatch-with-permute (forward) whose backward is combine; see
    :func:`hybrid_ep_dispatch`."""

    @staticmethod
    def forward(
        ctx, x, routing_map, probs, group, num_local_experts, num_permuted_tokens, pad_multiple
    ):
        world, num_tokens = group.size(), x.shape[0]
        local_map = routing_map.view(num_tokens, world, num_local_experts)
        token_in_rank = local_map.any(dim=2)  # [N, W]
        send_rank, send_token = token_in_rank.t().nonzero(as_tuple=True)  # by rank, then token
        send_counts = token_in_rank.sum(0).to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        exchange = lambda t: exchange_rows(t, send_splits, recv_splits, group)  # noqa: E731
        recv_x = exchange(x[send_token])
        recv_map = exchange(local_map[send_token, send_rank].to(torch.int8)).bool()  # [R, L]
        recv_probs = exchange(
            probs.view(num_tokens, world, num_local_experts)[send_token, send_rank].float()
        )
        # Local-expert-major, rows in received order within an expert; each expert padded up.
        expert, row = recv_map.t().nonzero(as_tuple=True)
        counts = recv_map.sum(0).tolist()
        align = pad_multiple or 1
        padded = [-(-c // align) * align for c in counts]
        needed = sum(padded)
        if num_permuted_tokens is not None and num_permuted_tokens < needed:
            raise ValueError(f"num_permuted_tokens={num_permuted_tokens} < {needed} permuted rows")
        size = needed if num_permuted_tokens is None else num_permuted_tokens
        permuted_row = torch.full((size,), -1, dtype=torch.int64)
        permuted_expert = torch.zeros(size, dtype=torch.int64)
        start, taken = 0, 0
        for e, (c, p) in enumerate(zip(counts, padded)):
            permuted_row[start : start + c] = row[taken : taken + c]
            permuted_expert[start : start + p] = e
            start, taken = start + p, taken + c
        handle = HybridHandle(
            group=group,
            num_tokens=num_tokens,
            send_token=send_token,
            send_rank=send_rank,
            send_splits=send_splits,
            recv_splits=recv_splits,
            num_local_experts=num_local_experts,
            permuted_row=permuted_row,
            permuted_expert=permuted_expert,
        )
        dispatched = _permuted_from_rows(recv_x, handle)
        row_probs = _permuted_from_rows(recv_probs, handle)  # [M, L]
        dispatched_probs = row_probs.gather(1, permuted_expert.unsqueeze(1)).squeeze(1)
        dispatched_probs = torch.where(permuted_row >= 0, dispatched_probs, 0.0)
        ctx.handle, ctx.probs_shape = handle, probs.shape
        tokens_per_expert = torch.tensor(padded, dtype=torch.int32)
        ctx.mark_non_differentiable(tokens_per_expert)
        return dispatched, dispatched_probs, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_dispatched, grad_probs, grad_tokens_per_expert, grad_handle):
        with transport():
            handle = ctx.handle
            grad_x = None if grad_dispatched is None else _hybrid_combine(grad_dispatched, handle)
            grad_routing_probs = None
            if grad_probs is not None:
                valid = handle.permuted_row >= 0
                num_rows = sum(handle.recv_splits)
                per_row = grad_probs.new_zeros(
                    (num_rows, handle.num_local_experts), dtype=torch.float32
                )
                per_row[handle.permuted_row[valid], handle.permuted_expert[valid]] = grad_probs[
                    valid
                ].float()
                returned = exchange_rows(
                    per_row, handle.recv_splits, handle.send_splits, handle.group
                )
                world = handle.group.size()
                grad_routing_probs = returned.new_zeros(
                    (handle.num_tokens, world, handle.num_local_experts)
                )
                grad_routing_probs[handle.send_token, handle.send_rank] = returned
                grad_routing_probs = grad_routing_probs.view(ctx.probs_shape)
        on_device(grad_x, grad_routing_probs)
        return grad_x, None, grad_routing_probs, None, None, None, None


class GlooHybridCombine(torch.autograd.Function):
    """HybridEP's combine-with-unpermute (forward) whose backward is dispatch with the same handle."""

    @staticmethod
    def forward(ctx, x, handle):
        ctx.handle = handle
        return _hybrid_combine(x, handle)

    @staticmethod
    def backward(ctx, grad_combined):
        with transport():
            grad = _hybrid_dispatch_rows(grad_combined, ctx.handle)
        on_device(grad)
        return grad, None


def hybrid_ep_dispatch(
    x,
    routing_map,
    probs,
    group,
    num_local_experts,
    num_sms_dispatch_api=None,
    num_sms_combine_api=None,
    num_blocks_permute=None,
    num_blocks_unpermute=None,
    fused=False,
    num_permuted_tokens=None,
    pad_multiple=None,
    num_sms_preprocessing_api=108,
):
    """HybridEP's permute + dispatch + permute (megatron's ``fused_a2a.hybrid_ep_dispatch``).

    Args:
        x: [N, H] tokens of this rank.
        routing_map: [N, W * L] bool, token n goes to local expert l of rank w.
        probs: [N, W * L] float32 routing probabilities.
        group: the W ranks (gloo); num_local_experts: L.
        num_permuted_tokens: rows of the output (at least the permuted rows with padding); given,
            the dispatch is non-blocking, else HybridEP reads the size from the GPU (a host wait).
        pad_multiple: pad each local expert's rows with zero rows up to a multiple of it.
        The SM / block counts and ``fused`` only tune the real kernels: ignored.

    Returns:
        ``(dispatched [M, H], dispatched_probs [M] float32, None, tokens_per_expert [L] int32 on the
        device (padded counts), handle)``; differentiable in x and probs.
    """
    del num_sms_dispatch_api, num_sms_combine_api, num_blocks_permute, num_blocks_unpermute, fused
    del num_sms_preprocessing_api
    if (
        routing_map.shape != probs.shape
        or routing_map.shape[0] != x.shape[0]
        or routing_map.shape[1] != group.size() * num_local_experts
    ):
        raise ValueError(
            f"expected routing_map and probs [N, W * L] for x [N, H]; got "
            f"{tuple(routing_map.shape)}, {tuple(probs.shape)}, {tuple(x.shape)}"
        )
    if probs.dtype != torch.float32:
        raise ValueError(f"HybridEP takes float32 probs, got {probs.dtype}")
    with transport():
        dispatched, dispatched_probs, tokens_per_expert, handle = GlooHybridDispatch.apply(
            x.contiguous(),
            routing_map.bool(),
            probs,
            group,
            num_local_experts,
            num_permuted_tokens,
            pad_multiple,
        )
    if num_permuted_tokens is None:
        host_wait("HybridEP dispatch without num_permuted_tokens: the host reads the permuted size")
    on_device(dispatched, dispatched_probs, tokens_per_expert)
    return dispatched, dispatched_probs, None, tokens_per_expert, handle


def hybrid_ep_combine(x, handle, num_permuted_tokens, pad_multiple, fused=False):
    """HybridEP's unpermute + combine + unpermute: [M, H] permuted expert outputs -> [N, H], every
    token's rows summed (padding rows dropped). Differentiable in x."""
    del pad_multiple, fused
    if not isinstance(handle, HybridHandle) or x.shape[0] != handle.permuted_row.shape[0]:
        raise ValueError(
            f"expected x [{getattr(handle, 'permuted_row', torch.empty(0)).shape[0]}, H] "
            f"for the dispatch's handle, got {tuple(x.shape)}"
        )
    with transport():  # megatron hands over a device scalar when it read the size itself
        if num_permuted_tokens is not None and int(num_permuted_tokens) != x.shape[0]:
            raise ValueError(
                f"num_permuted_tokens={int(num_permuted_tokens)} but x has {x.shape[0]} rows"
            )
        combined = GlooHybridCombine.apply(x.contiguous(), handle)
    on_device(combined)
    return combined
