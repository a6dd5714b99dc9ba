"""Triton kernels of the fused reroute-and-permute (``fused_reroute.py``): two forward launches, one
backward.

1. ``_count_kernel``: per block of BLOCK routed pairs (row-major), how many go to each expert
   (``counts`` int32 [B, E]).
2. ``_scatter_kernel``: per block, the expert-major position of each pair (the table's row 2, the
   counts of the blocks before, and the pair's rank among its block's pairs of the same expert,
   in SUB-pair chunks), its instance (binary search of the table's row 0), physical slot and send
   row; then the hidden row, the prob and the token written at the send row.
3. ``_unpermute_kernel`` (backward): per token, the sum of its K rows' gradients, and each pair's
   prob gradient (a gather: deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["reroute_permute_kernels", "unpermute_kernel", "BLOCK", "SUB"]

BLOCK = 1024  # pairs per program (at most)
SUB = 64  # pairs ranked against each other at once ([SUB, SUB] comparisons)


@triton.jit
def _count_kernel(
    topk_ptr,
    counts_ptr,
    num_pairs,
    E,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    b = tl.program_id(0)
    ae = tl.arange(0, BLOCK_E)
    acc = tl.zeros((BLOCK_E,), dtype=tl.int32)
    asub = tl.arange(0, CHUNK)
    for c in range(0, BLOCK, CHUNK):
        idx = b * BLOCK + c + asub
        e = tl.load(topk_ptr + idx, mask=idx < num_pairs, other=-1).to(tl.int32)
        acc += tl.sum((e[:, None] == ae[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + b * E + ae, acc, mask=ae < E)


@triton.jit
def _scatter_kernel(
    topk_ptr,
    hidden_ptr,
    probs_ptr,
    table_ptr,
    counts_ptr,
    offsets_ptr,
    out_ptr,
    out_probs_ptr,
    send_token_ptr,
    pair_slot_ptr,
    pair_row_ptr,
    num_pairs,
    K,
    E,
    C,
    H,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LOG_C: tl.constexpr,
):
    b = tl.program_id(0)
    ae = tl.arange(0, BLOCK_E)
    in_e = ae < E
    base = tl.load(table_ptr + 2 * C + ae, mask=in_e, other=0)  # expert-major start of e
    for prev in range(0, b):
        base += tl.load(counts_ptr + prev * E + ae, mask=in_e, other=0)
    tl.store(offsets_ptr + b * E + ae, base, mask=in_e)
    tl.debug_barrier()
    asub = tl.arange(0, SUB)
    ah = tl.arange(0, BLOCK_H)
    for c in range(0, BLOCK, SUB):
        idx = b * BLOCK + c + asub
        valid = idx < num_pairs
        e = tl.load(topk_ptr + idx, mask=valid, other=-1).to(tl.int32)
        valid = valid & (e >= 0) & (e < E)  # a bad id is dropped, never an address
        same = (e[:, None] == e[None, :]) & valid[None, :]
        before = asub[None, :] < asub[:, None]
        rank_in = tl.sum((same & before).to(tl.int32), axis=1)
        last = tl.sum((same & (asub[None, :] > asub[:, None])).to(tl.int32), axis=1) == 0
        start = tl.load(offsets_ptr + b * E + e, mask=valid, other=0)
        tl.debug_barrier()  # every lane read the running offsets before they move
        position = start + rank_in
        tl.store(offsets_ptr + b * E + e, position + 1, mask=valid & last)
        tl.debug_barrier()
        # The instance: the first table column whose running total exceeds the position.
        lo = tl.zeros((SUB,), dtype=tl.int32)
        hi = tl.zeros((SUB,), dtype=tl.int32) + (C - 1)
        for _ in range(LOG_C):
            mid = (lo + hi) >> 1
            above = tl.load(table_ptr + mid) > position
            hi = tl.where(above, mid, hi)
            lo = tl.where(above, lo, mid + 1)
        slot = tl.load(table_ptr + C + lo)
        row = tl.load(table_ptr + 3 * C + lo) + position
        token = idx // K
        tl.store(pair_slot_ptr + idx, slot, mask=valid)
        tl.store(pair_row_ptr + idx, row, mask=valid)
        # A table of another load (stale) can name rows past the buffer: those writes are
        # dropped (the rows stay unwritten), never out of bounds.
        inside = valid & (row >= 0) & (row < num_pairs)
        tl.store(send_token_ptr + row, token, mask=inside)
        prob = tl.load(probs_ptr + idx, mask=inside)
        tl.store(out_probs_ptr + row, prob, mask=inside)
        for h in range(0, H, BLOCK_H):
            cols = h + ah
            m = inside[:, None] & (cols < H)[None, :]
            values = tl.load(hidden_ptr + token[:, None].to(tl.int64) * H + cols[None, :], mask=m)
            tl.store(out_ptr + row[:, None].to(tl.int64) * H + cols[None, :], values, mask=m)


@triton.jit
def _unpermute_kernel(
    grad_ptr,
    grad_probs_ptr,
    pair_row_ptr,
    grad_hidden_ptr,
    grad_pair_probs_ptr,
    T,
    K,
    H,
    N,
    TOKENS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    at = pid * TOKENS + tl.arange(0, TOKENS)
    ak = tl.arange(0, BLOCK_K)
    ah = tl.arange(0, BLOCK_H)
    in_t = at < T
    pair_mask = in_t[:, None] & (ak < K)[None, :]
    pairs = at[:, None] * K + ak[None, :]
    rows = tl.load(pair_row_ptr + pairs, mask=pair_mask, other=2147483647)
    in_pairs = pair_mask
    pair_mask = pair_mask & (rows >= 0) & (rows < N)
    # A stale table's pairs past the buffer (dropped in the forward) get a zero gradient.
    pair_grad = tl.load(grad_probs_ptr + rows, mask=pair_mask, other=0)
    tl.store(grad_pair_probs_ptr + pairs, pair_grad, mask=in_pairs)
    # A token's K rows summed one by one in ascending row order, in the gradient's dtype: the
    # additions (and roundings) of autograd's index_add over the send rows on the host.
    order = tl.sum((rows[:, None, :] < rows[:, :, None]).to(tl.int32), axis=2)  # rank of each row
    for h in range(0, H, BLOCK_H):
        cols = h + ah
        m = in_t[:, None] & (cols < H)[None, :]
        acc = tl.zeros((TOKENS, BLOCK_H), dtype=grad_hidden_ptr.dtype.element_ty)
        for j in range(K):
            row = tl.sum(tl.where((order == j) & pair_mask, rows, 0), axis=1)
            g = tl.load(grad_ptr + row[:, None].to(tl.int64) * H + cols[None, :], mask=m, other=0)
            acc = acc + g.to(acc.dtype)
        tl.store(grad_hidden_ptr + at[:, None].to(tl.int64) * H + cols[None, :], acc, mask=m)


def reroute_permute_kernels(topk_ids, hidden, probs, table, num_experts: int):
    """Two launches: (permuted [N, H], permuted_probs [N], send_token [N] int32, pair_slot [T, K]
    int32, pair_row [T, K] int32) for ``fused_reroute.reroute_permute``."""
    T, K = topk_ids.shape
    H = hidden.shape[1]
    N, C = T * K, table.shape[1]
    E = num_experts
    device = hidden.device
    # Small routings get one smaller block (fewer idle lanes; one compilation per shape).
    block = max(SUB, min(BLOCK, triton.next_power_of_2(max(N, 1))))
    blocks = triton.cdiv(N, block)
    counts = torch.empty((blocks, E), dtype=torch.int32, device=device)
    offsets = torch.empty((blocks, E), dtype=torch.int32, device=device)
    out = torch.empty((N, H), dtype=hidden.dtype, device=device)
    out_probs = torch.empty(N, dtype=probs.dtype, device=device)
    send_token = torch.empty(N, dtype=torch.int32, device=device)
    pair_slot = torch.empty((T, K), dtype=torch.int32, device=device)
    pair_row = torch.empty((T, K), dtype=torch.int32, device=device)
    if N == 0:
        return out, out_probs, send_token, pair_slot, pair_row
    topk = topk_ids.contiguous()
    block_e = triton.next_power_of_2(E)
    _count_kernel[(blocks,)](
        topk, counts, N, E, BLOCK=block, CHUNK=min(block, 256), BLOCK_E=block_e
    )
    _scatter_kernel[(blocks,)](
        topk,
        hidden.contiguous(),
        probs.contiguous(),
        table,
        counts,
        offsets,
        out,
        out_probs,
        send_token,
        pair_slot,
        pair_row,
        N,
        K,
        E,
        C,
        H,
        BLOCK=block,
        SUB=SUB,
        BLOCK_E=block_e,
        BLOCK_H=min(128, triton.next_power_of_2(H)),
        LOG_C=max(1, (C - 1).bit_length()),
    )
    return out, out_probs, send_token, pair_slot, pair_row


def unpermute_kernel(grad, grad_probs, pair_row, hidden_dtype):
    """One launch: (grad_hidden [T, H], grad_pair_probs [T, K]) from the send-order gradients."""
    T, K = pair_row.shape
    H = grad.shape[1]
    grad_hidden = torch.empty((T, H), dtype=hidden_dtype, device=grad.device)
    grad_pair_probs = torch.empty((T, K), dtype=grad_probs.dtype, device=grad.device)
    if T == 0:
        return grad_hidden, grad_pair_probs
    tokens = 16
    _unpermute_kernel[(triton.cdiv(T, tokens),)](
        grad.contiguous(),
        grad_probs.contiguous(),
        pair_row,
        grad_hidden,
        grad_pair_probs,
        T,
        K,
        H,
        grad.shape[0],
        TOKENS=tokens,
        BLOCK_K=triton.next_power_of_2(K),
        BLOCK_H=min(64, triton.next_power_of_2(H)),
    )
    return grad_hidden, grad_pair_probs
