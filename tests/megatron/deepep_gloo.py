"""A gloo stand-in for DeepEP's intranode dispatch and combine, so that megatron-core's flex token
dispatcher (``_DeepepManager``) runs on CPU ranks.

Follows DeepEP's ``deep_ep/buffer.py`` (``Buffer.dispatch`` / ``Buffer.combine``, intranode) as
megatron-core 0.19.2 wraps it in ``transformer/moe/fused_a2a.py`` (``fused_dispatch``,
``fused_combine``, ``set_deepep_num_sms``; :func:`install` puts these in their place, and
:mod:`hybridep_gloo`'s for HybridEP): a token is sent once to every rank hosting one of its top-k
experts (-1: a masked slot); received rows are ordered by source rank, then token; ``recv_indices``
holds the local expert id or -1, ``recv_probs`` the probability or 0; combine sums the rows each
token sent; each operation's backward is the other (megatron's ``FusedDispatch`` /
``FusedCombine``). DeepEP's dispatch makes the host poll for the received counts: reported to
:data:`on_host_wait`, and the tensors the kernels leave on the GPU to :data:`on_device_outputs`
(``device_reads`` counts them); the gloo bookkeeping is hidden from torch function modes
(:func:`transport`).

Fails (``ValueError``) on inputs the kernels cannot take: shapes that disagree, an expert count not
a multiple of the group size, an expert id out of range, a combine over another group or with
another row count than its dispatch's.

Leaves out: internode (RDMA) and low-latency kernels, dispatch with a cached layout, fp8 dispatch,
``async_finish`` and communication-stream allocation (the exchange is synchronous), the SM budget
(recorded, :data:`NUM_SMS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

#: The last value given to :func:`set_deepep_num_sms` (DeepEP's SM budget; meaningless on a CPU).
NUM_SMS: Optional[int] = None
#: Called with a description where the real library makes the host wait for the GPU (or None).
on_host_wait: Optional[Callable[[str], None]] = None
#: Called with the tensors the real kernels leave in GPU memory (or None).
on_device_outputs: Optional[Callable[..., None]] = None


def host_wait(what: str) -> None:
    if on_host_wait is not None:
        on_host_wait(what)


def on_device(*tensors):
    if on_device_outputs is not None:
        on_device_outputs(*[t for t in tensors if isinstance(t, torch.Tensor)])
    return tensors


def transport():
    """The stand-ins' own bookkeeping, hidden from torch function modes (a host-read counter)."""
    return torch._C.DisableTorchFunction()


@dataclass
class DispatchHandle:
    """Layout of one dispatch, reused by its combine and by both backwards.

    With S rows sent from this rank and R rows received by it (W ranks, K = top-k):

    Attributes:
        group: the process group the rows travel over.
        num_tokens: N, the number of tokens on this (source) rank.
        send_token: [S] int64, source token index of every sent row, in send order (destination
            rank, then token index).
        send_splits: [W] rows sent to each rank.
        recv_splits: [W] rows received from each rank.
        recv_slot_is_local: [R, K] bool, which top-k slots of each received row name an expert of
            this rank (where ``recv_indices != -1``).
    """

    group: dist.ProcessGroup
    num_tokens: int
    send_token: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    recv_slot_is_local: torch.Tensor


def exchange_rows(
    rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """All-to-all of rows: [sum(send_splits), *D] -> [sum(recv_splits), *D], ordered by peer rank."""
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    dist.all_to_all_single(
        out,
        rows.contiguous(),
        output_split_sizes=recv_splits,
        input_split_sizes=send_splits,
        group=group,
    )
    return out


def _rows_to_sources(rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Send received rows back and sum them per source token: [R, *D] -> [N, *D]."""
    returned = exchange_rows(rows, handle.recv_splits, handle.send_splits, handle.group)
    out = rows.new_zeros((handle.num_tokens, *rows.shape[1:]))
    # Why index_add: a token sent to several ranks gets the sum of its rows, as DeepEP's combine.
    return out.index_add_(0, handle.send_token, returned)


def _sources_to_rows(values: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Send each source token's row to every rank it was dispatched to: [N, *D] -> [R, *D]."""
    return exchange_rows(
        values[handle.send_token], handle.send_splits, handle.recv_splits, handle.group
    )


def _dispatch_layout(token_indices: torch.Tensor, num_experts: int, group: dist.ProcessGroup):
    """Where each token goes, and how many rows travel between each pair of ranks.

    Args:
        token_indices: [N, K] int64 global expert ids, -1 for a masked slot.
        num_experts: E, a multiple of the group size W.
        group: the process group.

    Returns:
        ``(send_rank [S], send_token [S], send_splits [W] list, recv_splits [W] list)`` with the S
        sent rows ordered by destination rank, then token index.
    """
    world = group.size()
    num_local_experts = num_experts // world
    num_tokens = token_indices.shape[0]
    valid = token_indices >= 0
    dest = torch.where(valid, token_indices // num_local_experts, 0)
    # [N, W]: does token n have at least one expert on rank w? (a token goes once per rank)
    token_in_rank = torch.zeros(num_tokens, world, dtype=torch.int32, device=token_indices.device)
    token_in_rank.scatter_add_(1, dest, valid.to(torch.int32))
    token_in_rank = token_in_rank > 0
    # Row-major nonzero of the [W, N] transpose = sorted by rank, then by token.
    send_rank, send_token = token_in_rank.t().nonzero(as_tuple=True)
    send_counts = token_in_rank.sum(0).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    return send_rank, send_token, send_counts.tolist(), recv_counts.tolist()


class GlooFusedDispatch(torch.autograd.Function):
    """Dispatch (forward) whose backward is combine; see :func:`fused_dispatch`."""

    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group):
        send_rank, send_token, send_splits, recv_splits = _dispatch_layout(
            token_indices, num_experts, group
        )
        num_local_experts = num_experts // group.size()
        # Per sent row, the top-k slots whose expert lives on its destination rank: [S, K].
        sent_indices = token_indices[send_token]
        slot_is_local = (sent_indices >= 0) & (
            sent_indices // num_local_experts == send_rank.unsqueeze(1)
        )
        local_ids = torch.where(
            slot_is_local, sent_indices - (send_rank * num_local_experts).unsqueeze(1), -1
        )
        local_probs = torch.where(slot_is_local, token_probs[send_token].float(), 0.0)

        recv_x = exchange_rows(x[send_token], send_splits, recv_splits, group)
        recv_indices = exchange_rows(local_ids, send_splits, recv_splits, group)
        recv_probs = exchange_rows(local_probs, send_splits, recv_splits, group)
        recv_slot_is_local = recv_indices >= 0
        # DeepEP returns a per-local-expert list; megatron turns it into a CPU int64 tensor.
        tokens_per_expert = torch.bincount(
            recv_indices[recv_slot_is_local], minlength=num_local_experts
        ).cpu()

        handle = DispatchHandle(
            group=group,
            num_tokens=x.shape[0],
            send_token=send_token,
            send_splits=send_splits,
            recv_splits=recv_splits,
            recv_slot_is_local=recv_slot_is_local,
        )
        ctx.handle = handle
        ctx.probs_dtype = token_probs.dtype
        ctx.mark_non_differentiable(recv_indices, tokens_per_expert)
        return recv_x, recv_indices, recv_probs, tokens_per_expert, handle

    @staticmethod
    def backward(
        ctx, grad_recv_x, grad_recv_indices, grad_recv_probs, grad_tokens_per_expert, grad_handle
    ):
        with transport():
            grads = GlooFusedDispatch._backward(ctx, grad_recv_x, grad_recv_probs)
        on_device(*grads)
        return grads

    @staticmethod
    def _backward(ctx, grad_recv_x, grad_recv_probs):
        handle = ctx.handle
        grad_x = None if grad_recv_x is None else _rows_to_sources(grad_recv_x, handle)
        grad_probs = None
        if grad_recv_probs is not None:
            # Non-local slots were the constant 0, not a copy of token_probs: no gradient there.
            masked = torch.where(handle.recv_slot_is_local, grad_recv_probs.float(), 0.0)
            grad_probs = _rows_to_sources(masked, handle).to(ctx.probs_dtype)
        return grad_x, None, grad_probs, None, None


class GlooFusedCombine(torch.autograd.Function):
    """Combine (forward) whose backward is dispatch with the same handle; see :func:`fused_combine`."""

    @staticmethod
    def forward(ctx, x, handle):
        ctx.handle = handle
        return _rows_to_sources(x, handle)

    @staticmethod
    def backward(ctx, grad_combined):
        with transport():
            grad = _sources_to_rows(grad_combined, ctx.handle)
        on_device(grad)
        return grad, None


def fused_dispatch(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    token_probs: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
):
    """Send each token once to every rank hosting one of its top-k experts (DeepEP semantics).

    Args:
        x: [N, H] tokens of this rank.
        token_indices: [N, K] int64 global expert ids in [0, E), -1 for a masked slot.
        token_probs: [N, K] routing probabilities (float32, as DeepEP requires).
        num_experts: E, a multiple of the group size W; rank r hosts experts
            [r * E / W, (r + 1) * E / W).
        group: process group of the W expert-parallel ranks (gloo).
        async_finish, allocate_on_comm_stream: accepted for API compatibility; ignored (the
            exchange is synchronous).

    Returns:
        ``(recv_x [R, H], recv_indices [R, K] int64 local expert id or -1, recv_probs [R, K]
        float32 (0 where recv_indices is -1), tokens_per_expert [E / W] int64 CPU tensor, handle)``,
        the R received rows ordered by source rank, then source token index. Differentiable in x
        and token_probs.

    Raises:
        ValueError: for shapes that disagree or E not divisible by W.
    """
    del async_finish, allocate_on_comm_stream
    with transport():
        out = _fused_dispatch(x, token_indices, token_probs, num_experts, group)
    # DeepEP's dispatch (no cached handle): the host polls for the received counts.
    host_wait("DeepEP dispatch: the host polls for the received token counts")
    recv_x, recv_indices, recv_probs, tokens_per_expert, handle = out
    on_device(recv_x, recv_indices, recv_probs)  # the counts are a host list in DeepEP
    return out


def _fused_dispatch(x, token_indices, token_probs, num_experts, group):
    if x.dim() != 2 or token_indices.dim() != 2 or token_probs.shape != token_indices.shape:
        raise ValueError(
            f"expected x [N, H], token_indices and token_probs [N, K]; got "
            f"{tuple(x.shape)}, {tuple(token_indices.shape)}, "
            f"{tuple(token_probs.shape)}"
        )
    if token_indices.shape[0] != x.shape[0]:
        raise ValueError(f"{x.shape[0]} tokens but {token_indices.shape[0]} rows of indices")
    if num_experts % group.size() != 0:
        raise ValueError(
            f"num_experts={num_experts} is not a multiple of the group size {group.size()}"
        )
    if token_indices.numel() and int(token_indices.max()) >= num_experts:
        raise ValueError(f"expert id {int(token_indices.max())} >= num_experts={num_experts}")
    return GlooFusedDispatch.apply(
        x.contiguous(), token_indices.long(), token_probs, num_experts, group
    )


def fused_combine(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    handle: DispatchHandle,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
):
    """Return every received row to its source and sum per source token (DeepEP's combine).

    Args:
        x: [R, H] rows in the order :func:`fused_dispatch` received them.
        group: the dispatch's process group (must be the handle's).
        handle: the :class:`DispatchHandle` of that dispatch.
        async_finish, allocate_on_comm_stream: ignored (synchronous exchange).

    Returns:
        ``(combined [N, H], None)``: token n's output is the sum of the rows it sent to each rank.
        Differentiable in x (backward = dispatch of the gradient with the same handle).

    Raises:
        ValueError: when x's row count or group does not match the handle.
    """
    del async_finish, allocate_on_comm_stream
    with transport():
        combined, second = _fused_combine(x, group, handle)
    on_device(combined)
    return combined, second


def _fused_combine(x, group, handle):
    if group is not handle.group:
        raise ValueError("fused_combine must run over the group of the dispatch's handle")
    if x.dim() != 2 or x.shape[0] != sum(handle.recv_splits):
        raise ValueError(f"expected x [{sum(handle.recv_splits)}, H], got {tuple(x.shape)}")
    return GlooFusedCombine.apply(x.contiguous(), handle), None


def set_deepep_num_sms(num_sms: int) -> None:
    """Record DeepEP's SM budget (megatron sets it once per dispatcher); no effect on a CPU."""
    global NUM_SMS
    NUM_SMS = num_sms


def _targets() -> dict:
    import hybridep_gloo  # it builds on this module's transport: imported when installing

    return {
        "fused_dispatch": fused_dispatch,
        "fused_combine": fused_combine,
        "set_deepep_num_sms": set_deepep_num_sms,
        "hybrid_ep_dispatch": hybridep_gloo.hybrid_ep_dispatch,
        "hybrid_ep_combine": hybridep_gloo.hybrid_ep_combine,
    }


def install() -> Callable[[], None]:
    """Make megatron's ``_DeepepManager`` and ``_HybridEPManager`` use this module's dispatch/combine
    and :mod:`hybridep_gloo`'s: ``fused_dispatch``, ``fused_combine``, ``set_deepep_num_sms``,
    ``hybrid_ep_dispatch`` and ``hybrid_ep_combine`` in
    ``megatron.core.transformer.moe.token_dispatcher``, where the managers look them up
    (process-wide). Returns the function that restores the previous values."""
    from megatron.core.transformer.moe import token_dispatcher

    targets = _targets()
    previous = {name: getattr(token_dispatcher, name, None) for name in targets}
    for name, value in targets.items():
        setattr(token_dispatcher, name, value)

    def uninstall() -> None:
        for name, value in previous.items():
            setattr(token_dispatcher, name, value)

    return uninstall
