"""Triton probe of the device planner: one program per threshold, each a serial greedy.

It answers a probe as the greedy's specification does (``reference.greedy_replicas``, the same
outputs bit for bit; ``tests/planner/test_device_solve.py`` checks that under ``TRITON_INTERPRET=1``),
in the device's form of it, the step function ``device_solve.lockstep_probe`` runs with torch calls
(same steps, same tie-breaks). Here the state of one probe lives in registers: slack and
free slots as [BLOCK_R] vectors, the current overloaded rank's main load left as [BLOCK_G] and its
replicas as [BLOCK_G, BLOCK_R] (quota and creation order). A scalar read from a register vector is
a masked sum; a scalar write a ``where``. The program loops over the overloaded ranks and, inside,
over the replicas of one rank, with data-dependent trip counts (no host involvement); it writes a
rank's replicas once the rank is done.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NO_REPLICA = torch.iinfo(torch.int64).max


@triton.jit
def _probe_kernel(
    taus_ptr,
    expert_load_ptr,
    rank_load_ptr,
    rank_order_ptr,
    min_quota_ptr,
    success_ptr,
    main_left_ptr,
    rep_quota_ptr,
    rep_order_ptr,
    R,
    E,
    G,
    S,
    N,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
    WRITE_PLAN: tl.constexpr,
):
    BIG: tl.constexpr = 9223372036854775807
    k = tl.program_id(0).to(tl.int64)
    tau = tl.load(taus_ptr + k)
    min_quota = tl.load(min_quota_ptr)
    ar = tl.arange(0, BLOCK_R).to(tl.int64)
    ag = tl.arange(0, BLOCK_G).to(tl.int64)
    in_r = ar < R
    in_g = ag < G
    rank_load = tl.load(rank_load_ptr + ar, mask=in_r, other=0)
    over = in_r & (rank_load > tau)
    slack = tl.where(in_r & (rank_load <= tau), tau - rank_load, 0)
    free = tl.where(in_r, S, 0).to(tl.int64)
    num_over = tl.sum(over.to(tl.int64), axis=0)
    zero = num_over * 0
    failed = zero
    created = zero
    position = zero
    while (position < num_over) & (failed == 0):
        rank = tl.load(rank_order_ptr + position)
        need = tl.load(rank_load_ptr + rank) - tau
        main_left = tl.load(expert_load_ptr + rank * G + ag, mask=in_g, other=-1)
        mine_quota = tl.zeros((BLOCK_G, BLOCK_R), dtype=tl.int64)
        mine_order = tl.full((BLOCK_G, BLOCK_R), BIG, dtype=tl.int64)
        same_domain = (ar // N) == (rank // N)
        while (need > 0) & (failed == 0):
            # 1. Top up one of this rank's replicas: the largest room, ties by creation order.
            has = mine_quota > 0
            room = tl.minimum(tl.minimum(need, slack[None, :]), main_left[:, None])
            room = tl.where(has, room, 0)
            best_room = tl.max(tl.max(room, axis=1), axis=0)
            top_order = tl.min(
                tl.min(tl.where(has & (room == best_room), mine_order, BIG), axis=1), axis=0
            )
            top_cell = has & (mine_order == top_order)
            top_g = tl.sum(tl.sum(tl.where(top_cell, ag[:, None], 0), axis=1), axis=0)
            top_t = tl.sum(tl.sum(tl.where(top_cell, ar[None, :], 0), axis=1), axis=0)
            topping = best_room > 0

            # 2. Else a new replica of the rank's main expert with the most load left.
            cap = tl.max(main_left, axis=0)
            new_g = tl.min(tl.where(main_left == cap, ag, BLOCK_G), axis=0)
            row = tl.sum(tl.where(ag[:, None] == new_g, mine_quota, 0), axis=0)
            hosts = (
                in_r & same_domain & (ar != rank) & (free > 0) & (slack >= min_quota) & (row == 0)
            )
            want = tl.maximum(tl.minimum(need, cap), min_quota)
            fitting = hosts & (slack >= want)
            fit_slack = tl.min(tl.where(fitting, slack, BIG), axis=0)
            fit_t = tl.min(tl.where(fitting & (slack == fit_slack), ar, BLOCK_R), axis=0)
            big_slack = tl.max(tl.where(hosts, slack, -1), axis=0)
            big_t = tl.min(tl.where(hosts & (slack == big_slack), ar, BLOCK_R), axis=0)
            new_t = tl.where(fit_t < BLOCK_R, fit_t, big_t)
            cannot = (cap < min_quota) | (big_t >= BLOCK_R)
            host_slack = tl.sum(tl.where(ar == new_t, slack, 0), axis=0)
            host_free = tl.sum(tl.where(ar == new_t, free, 0), axis=0)
            new_amount = tl.where(
                host_free == 1,
                tl.minimum(host_slack, cap),
                tl.minimum(tl.minimum(tl.maximum(need, min_quota), host_slack), cap),
            )

            creating = (best_room <= 0) & (cannot == 0)
            applying = topping | (cannot == 0)
            failed = tl.where(applying, failed, 1)
            t = tl.where(topping, top_t, new_t)
            g = tl.where(topping, top_g, new_g)
            amount = tl.where(applying, tl.where(topping, best_room, new_amount), 0)
            at_t = ar == t
            at_g = ag == g
            cell = at_g[:, None] & at_t[None, :]
            slack = slack - tl.where(at_t, amount, 0)
            main_left = main_left - tl.where(at_g, amount, 0)
            mine_quota = mine_quota + tl.where(cell, amount, 0)
            mine_order = tl.where(cell & creating, created, mine_order)
            free = free - tl.where(at_t & creating, 1, 0)
            created = created + tl.where(creating, 1, 0)
            overshoot = tl.where(applying & (amount >= need), amount - need, 0)
            slack = slack + tl.where(ar == rank, overshoot, 0)
            need = tl.where(applying, tl.maximum(need - amount, 0), need)
        if WRITE_PLAN:
            rows = rank * G + ag
            tl.store(main_left_ptr + k * E + rows, main_left, mask=in_g)
            offsets = k * E * R + rows[:, None] * R + ar[None, :]
            written = in_g[:, None] & in_r[None, :]
            tl.store(rep_quota_ptr + offsets, mine_quota, mask=written)
            tl.store(rep_order_ptr + offsets, mine_order, mask=written)
        position = position + 1
    tl.store(success_ptr + k, (failed == 0).to(tl.int64))


def num_warps(block_r: int, block_g: int) -> int:
    """One warp per 256 elements of the [BLOCK_G, BLOCK_R] state (1 to 8): a program is one
    serial greedy whose every step is a dozen reductions, cheapest inside one warp (shuffles, no
    barrier). From ptxas register counts for sm_90 (no spills up to 256 elements a warp, e.g.
    64 x 4 at 123 registers), not from timings."""
    return min(8, max(1, block_r * block_g // 256))


def probe(
    taus: torch.Tensor,
    expert_load: torch.Tensor,
    rank_load: torch.Tensor,
    rank_order: torch.Tensor,
    min_quota: torch.Tensor,
    num_slots: int,
    domain_size: int,
    write_plan: bool,
):
    """The probe of K thresholds as one Triton launch of K programs (``device_solve.reference_probe``'s
    contract)."""
    K, R, E = taus.shape[0], rank_load.shape[0], expert_load.shape[0]
    G = E // R
    device = taus.device
    success = torch.empty(K, dtype=torch.int64, device=device)
    if write_plan:
        main_left = expert_load.view(1, E).repeat(K, 1)
        rep_quota = torch.zeros((K, E, R), dtype=torch.int64, device=device)
        rep_order = torch.full((K, E, R), NO_REPLICA, dtype=torch.int64, device=device)
    else:
        main_left = rep_quota = rep_order = torch.empty(1, dtype=torch.int64, device=device)
    block_r, block_g = triton.next_power_of_2(R), triton.next_power_of_2(G)
    _probe_kernel[(K,)](
        taus.contiguous(),
        expert_load.contiguous(),
        rank_load.contiguous(),
        rank_order.contiguous(),
        min_quota.reshape(1),
        success,
        main_left,
        rep_quota,
        rep_order,
        R,
        E,
        G,
        num_slots,
        domain_size,
        BLOCK_R=block_r,
        BLOCK_G=block_g,
        WRITE_PLAN=write_plan,
        num_warps=num_warps(block_r, block_g),
    )
    if not write_plan:
        return success.bool(), None, None, None
    return success.bool(), main_left, rep_quota, rep_order
