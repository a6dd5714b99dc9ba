"""The fused plan kernel: ultraep's plan of one invocation for one rank in ONE Triton launch of one
program (``fused_plan.plan_invocation``'s device path).

In order, inside the kernel: the exact load's expert and rank totals (int64, checked to fit int32,
then int32 state), the trigger (``LayerBalancer.balances``), the domain lower bound, the rank order
(descending load, ties by rank id), the threshold search of ``reference.search_threshold`` (the
first probe at the lower bound ``ceil(mean)``, the cheapest feasible threshold when the load can
be balanced exactly, then the gallop and bisection, looped here with data-dependent trip counts),
one more probe at the chosen threshold writing its replicas, the plan (slot layout in creation
order per host, quotas, reroute: local first, then sources in rank order fill instances in rank
order, as interval overlaps of running totals), and this rank's record and reroute table
(``record_layout.py``). The greedy probe is ``reference.greedy_replicas`` in the form of state
vectors: slack and free slots [BLOCK_R], the shedding rank's main load left [BLOCK_G] and its
replicas [BLOCK_G, BLOCK_R] (quota and creation order); a scalar read of a vector is a masked sum.

Scratch (one int32 buffer from the caller, no initialization needed) holds what later phases read
at other lanes; ``tl.debug_barrier`` orders the phases within the program.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .record_layout import HEADER, record_length, table_columns

__all__ = ["launch", "scratch_size"]

_BIG = 2**31 - 1


@triton.jit
def _probe(
    tau,
    write,
    el_tile,
    rank_load,
    position,
    min_quota,
    R,
    G,
    S,
    N,
    main_left_ptr,
    piece_expert_ptr,
    piece_rank_ptr,
    piece_quota_ptr,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """``reference.greedy_replicas(tau)``: (feasible, replicas created). With ``write`` it stores
    each shedding rank's main load left and its replicas (expert, host, quota) by creation index."""
    BIG: tl.constexpr = 2147483647
    ar = tl.arange(0, BLOCK_R)
    ag = tl.arange(0, BLOCK_G)
    in_r = ar < R
    in_g = ag < G
    over = in_r & (rank_load > tau)
    slack = tl.where(in_r & (rank_load <= tau), tau - rank_load, 0)
    free = tl.where(in_r, S, 0)
    num_over = tl.sum(over.to(tl.int32), axis=0)
    zero = num_over * 0
    failed = zero
    created = zero
    p = zero
    while (p < num_over) & (failed == 0):
        rank = tl.sum(tl.where(in_r & (position == p), ar, 0), axis=0)
        need = tl.sum(tl.where(ar == rank, rank_load, 0), axis=0) - tau
        main_left = tl.sum(tl.where(ar[:, None] == rank, el_tile, 0), axis=0)
        main_left = tl.where(in_g, main_left, -1)
        mine_quota = tl.zeros((BLOCK_G, BLOCK_R), dtype=tl.int32)
        mine_order = tl.full((BLOCK_G, BLOCK_R), BIG, dtype=tl.int32)
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
            # 2. Else a new replica of the rank's main expert with the most load left, on the
            # best-fitting host (smallest slack >= want), else the one with the largest slack.
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
            slack = slack + tl.where(ar == rank, overshoot, 0)  # over-shed: rank hosts now
            need = tl.where(applying, tl.maximum(need - amount, 0), need)
        if write:
            tl.store(main_left_ptr + rank * G + ag, main_left, mask=in_g)
            has = (mine_quota > 0) & in_g[:, None] & in_r[None, :]
            experts = rank * G + ag[:, None] + ar[None, :] * 0
            hosts_of = ar[None, :] + ag[:, None] * 0
            tl.store(piece_expert_ptr + mine_order, experts, mask=has)
            tl.store(piece_rank_ptr + mine_order, hosts_of, mask=has)
            tl.store(piece_quota_ptr + mine_order, mine_quota, mask=has)
        p = p + 1
    return failed == 0, created


@triton.jit(do_not_specialize=["rank", "floor", "use_trigger", "trigger_bits"])
def _plan_kernel(
    load_ptr,
    record_ptr,
    table_ptr,
    scratch_ptr,
    rank,
    R,
    E,
    G,
    S,
    N,
    floor,
    use_trigger,
    trigger_bits,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_RP: tl.constexpr,
    BLOCK_C: tl.constexpr,
    EB: tl.constexpr,
):
    BIG: tl.constexpr = 2147483647
    HDR: tl.constexpr = 16
    P = G + S
    RP = R * P
    C = E + R * S + 1
    L = HDR + R * S + 2 * R + R * P
    ar = tl.arange(0, BLOCK_R)
    ag = tl.arange(0, BLOCK_G)
    ae = tl.arange(0, BLOCK_E)
    in_r = ar < R
    in_g = ag < G
    in_e = ae < E
    tile_mask = in_r[:, None] & in_g[None, :]
    tile_e = ar[:, None] * G + ag[None, :]  # expert of each (home rank, main index)
    # Scratch layout (int32): main_left [E], pieces 3 x [R*S+1], quota [E*R], instance slot
    # [E*R], sends [R*P], slot first row [R*P].
    ml_ptr = scratch_ptr
    pe_ptr = ml_ptr + E
    pr_ptr = pe_ptr + R * S + 1
    pq_ptr = pr_ptr + R * S + 1
    q_ptr = pq_ptr + R * S + 1
    is_ptr = q_ptr + E * R
    send_ptr = is_ptr + E * R
    row_ptr = send_ptr + RP

    # 1. Totals in int64; a negative entry or a total past int32 is a status, not a plan.
    el64 = tl.zeros((BLOCK_R, BLOCK_G), dtype=tl.int64)
    negative = tl.zeros((BLOCK_R, BLOCK_G), dtype=tl.int32)
    for s in range(R):
        row = tl.load(load_ptr + s * E + tile_e, mask=tile_mask, other=0)
        el64 += row
        negative = negative | (row < 0).to(tl.int32)
    total64 = tl.sum(tl.sum(el64, axis=1), axis=0)
    status = tl.where(tl.max(tl.max(negative, axis=1), axis=0) > 0, 1, 0)
    status = tl.where((status == 0) & (total64 > BIG), 2, status)
    ar_l = tl.arange(0, 1024)
    if status != 0:
        for i in range(0, L, 1024):
            tl.store(record_ptr + i + ar_l, tl.where(i + ar_l == 0, status, 0), mask=i + ar_l < L)
        for i in range(0, 4 * C, 1024):
            tl.store(table_ptr + i + ar_l, 0, mask=i + ar_l < 4 * C)
    else:
        el = el64.to(tl.int32)
        rank_load = tl.sum(el, axis=1)  # [BLOCK_R], 0 past R
        total = tl.sum(rank_load, axis=0)
        highest = tl.max(rank_load, axis=0)
        derived = ((total.to(tl.int64) + 100 * R - 1) // (100 * R)).to(tl.int32)
        min_quota = tl.where(floor > 0, floor, tl.maximum(1, derived))
        # 2. The trigger (float64 max / mean, as on the host) or the floor rule.
        mean = total.to(tl.float64) / R
        trigger = trigger_bits.to(tl.int64).to(tl.float64, bitcast=True)
        imbalance = tl.where(total > 0, highest.to(tl.float64) / mean, 1.0)
        by_floor = (total > 0) & (R * highest.to(tl.int64) - total >= R * min_quota.to(tl.int64))
        balanced = tl.where(use_trigger != 0, imbalance >= trigger, by_floor)
        # 3. Domain lower bound and rank order (descending load, ties by rank id).
        same_d = (ar[:, None] // N) == (ar[None, :] // N)
        domain_total = tl.sum(tl.where(same_d & in_r[None, :], rank_load[None, :], 0), axis=1)
        lower = tl.max(
            tl.where(in_r, ((domain_total.to(tl.int64) + N - 1) // N).to(tl.int32), 0), axis=0
        )
        ahead = (rank_load[None, :] > rank_load[:, None]) | (
            (rank_load[None, :] == rank_load[:, None]) & (ar[None, :] < ar[:, None])
        )
        position = tl.sum((ahead & in_r[None, :]).to(tl.int32), axis=1)
        tl.store(ml_ptr + tile_e, el, mask=tile_mask)

        # 4. The threshold search (reference.search_threshold, _compiled_solve's loop).
        good = highest
        searching = balanced & (S > 0) & (R > 1) & (lower < highest)
        resolution = tl.maximum(1, lower >> 10)
        bad = lower
        tau = lower
        step = resolution * 0
        galloping = tau == tau
        stop = tau != tau
        while searching:
            ok, n = _probe(
                tau, False, el, rank_load, position, min_quota, R, G, S, N,
                ml_ptr, pe_ptr, pr_ptr, pq_ptr, BLOCK_R, BLOCK_G,
            )  # fmt: skip
            next_tau = bad + (good - bad) // 2
            if ok:
                good = tau
                searching = tau != lower
                galloping = stop
            else:
                bad = tau
                if galloping:
                    step = tl.where(
                        step == 0, resolution, tl.where(step >= (1 << 30), BIG, step * 2)
                    )
                    galloping = step < highest - bad
                    next_tau = tl.where(galloping, bad + step, next_tau)
            if searching & (galloping == 0):
                searching = good - bad > resolution
                next_tau = bad + (good - bad) // 2
            tau = next_tau
        n = good * 0
        tl.debug_barrier()
        if good < highest:
            ok, n = _probe(
                good, True, el, rank_load, position, min_quota, R, G, S, N,
                ml_ptr, pe_ptr, pr_ptr, pq_ptr, BLOCK_R, BLOCK_G,
            )  # fmt: skip
        tl.debug_barrier()

        # 5. The plan: quotas and instance slots [E, R] (mains at home, replicas by creation
        # order per host), the slot layout into the record.
        ER = E * R
        for i in range(0, ER, 1024):
            m = i + ar_l < ER
            tl.store(q_ptr + i + ar_l, 0, mask=m)
            tl.store(is_ptr + i + ar_l, -1, mask=m)
        for i in range(0, R * S, 1024):
            tl.store(record_ptr + HDR + i + ar_l, -1, mask=i + ar_l < R * S)
        for i in range(0, RP, 1024):
            tl.store(record_ptr + HDR + R * S + 2 * R + i + ar_l, 0, mask=i + ar_l < RP)
            tl.store(send_ptr + i + ar_l, 0, mask=i + ar_l < RP)
        tl.debug_barrier()
        main_left = tl.load(ml_ptr + ae, mask=in_e, other=0)
        home = ae // G
        tl.store(q_ptr + ae * R + home, main_left, mask=in_e)
        tl.store(is_ptr + ae * R + home, home * P + ae - home * G, mask=in_e)
        used = ar * 0
        for i in range(n):
            e = tl.load(pe_ptr + i)
            t = tl.load(pr_ptr + i)
            j = tl.sum(tl.where(ar == t, used, 0), axis=0)
            used = used + tl.where(ar == t, 1, 0)
            tl.store(q_ptr + e * R + t, tl.load(pq_ptr + i))
            tl.store(is_ptr + e * R + t, t * P + G + j)
            tl.store(record_ptr + HDR + t * S + j, e.to(tl.int64))
        tl.debug_barrier()

        # 6. Reroute per expert chunk: this rank's sends and receives as interval overlaps of
        # running totals (sources in rank order fill instances in rank order), and the metrics.
        rows_base = HDR + R * S + 2 * R
        after = ar * 0
        local_sum = total * 0
        per_home = ar * 0
        max_per_expert = total * 0
        cross = total * 0
        smallest = total * 0 + BIG
        aeb = tl.arange(0, EB)
        for c in range(0, E, EB):
            ec = c + aeb
            m2 = (ec < E)[:, None] & in_r[None, :]
            cell = ec[:, None] * R + ar[None, :]
            q = tl.load(q_ptr + cell, mask=m2, other=0)
            slot = tl.load(is_ptr + cell, mask=m2, other=-1)
            ld = tl.load(load_ptr + ar[None, :] * E + ec[:, None], mask=m2, other=0).to(tl.int32)
            present = slot >= 0
            local = tl.where(present, tl.minimum(ld, q), 0)
            residual = q - local
            demand = ld - local
            D = tl.cumsum(demand, axis=1) - demand
            Q = tl.cumsum(residual, axis=1) - residual
            at_rank = ar[None, :] == rank
            d_lo = tl.sum(tl.where(at_rank, D, 0), axis=1)[:, None]
            d_hi = d_lo + tl.sum(tl.where(at_rank, demand, 0), axis=1)[:, None]
            sends = tl.maximum(tl.minimum(d_hi, Q + residual) - tl.maximum(d_lo, Q), 0)
            sends = sends + tl.where(at_rank, local, 0)
            tl.store(send_ptr + slot, sends, mask=m2 & present)
            q_lo = tl.sum(tl.where(at_rank, Q, 0), axis=1)[:, None]
            q_hi = q_lo + tl.sum(tl.where(at_rank, residual, 0), axis=1)[:, None]
            mine = tl.sum(tl.where(at_rank, slot, 0), axis=1)[:, None]
            has_mine = tl.sum(tl.where(at_rank & present, 1, 0), axis=1)[:, None] > 0
            recv = tl.maximum(tl.minimum(D + demand, q_hi) - tl.maximum(D, q_lo), 0)
            recv = recv + tl.where(at_rank, local, 0)
            tl.store(
                record_ptr + rows_base + ar[None, :] * P + (mine - rank * P),
                recv.to(tl.int64),
                mask=m2 & has_mine,
            )
            after = after + tl.sum(q, axis=0)
            local_sum = local_sum + tl.sum(tl.sum(local, axis=1), axis=0)
            hom = ec // G
            replica = present & (ar[None, :] != hom[:, None])
            count = tl.sum(replica.to(tl.int32), axis=1)
            max_per_expert = tl.maximum(max_per_expert, tl.max(count, axis=0))
            per_home = per_home + tl.sum(
                tl.where(hom[:, None] == ar[None, :], count[:, None], 0), axis=0
            )
            cross = cross + tl.sum(
                tl.sum((replica & ((ar[None, :] // N) != (hom[:, None] // N))).to(tl.int32), 1), 0
            )
            smallest = tl.minimum(smallest, tl.min(tl.min(tl.where(replica, q, BIG), 1), 0))
        tl.debug_barrier()

        # 7. Splits, the send buffer's slot rows, the header.
        arp = tl.arange(0, BLOCK_RP)
        in_rp = arp < RP
        sent = tl.load(send_ptr + arp, mask=in_rp, other=0)
        tl.store(row_ptr + arp, tl.cumsum(sent, axis=0) - sent, mask=in_rp)
        ap = tl.arange(0, BLOCK_P)
        sp_mask = in_r[:, None] & (ap < P)[None, :]
        sent_tile = tl.load(send_ptr + ar[:, None] * P + ap[None, :], mask=sp_mask, other=0)
        tl.store(record_ptr + HDR + R * S + ar, tl.sum(sent_tile, axis=1).to(tl.int64), mask=in_r)
        tl.debug_barrier()
        recv_tile = tl.load(record_ptr + rows_base + ar[:, None] * P + ap[None, :], sp_mask, 0)
        tl.store(record_ptr + HDR + R * S + R + ar, tl.sum(recv_tile, axis=1), mask=in_r)
        sent_total = tl.sum(sent, axis=0)
        threshold = tl.max(after, axis=0)
        header = tl.arange(0, HDR)
        values = tl.where(header == 1, threshold, 0).to(tl.int64)
        values = tl.where(header == 2, total, values)
        values = tl.where(header == 3, balanced.to(tl.int32), values)
        values = tl.where(header == 4, highest, values)
        values = tl.where(header == 5, n, values)
        values = tl.where(header == 6, max_per_expert, values)
        values = tl.where(header == 7, tl.max(per_home, axis=0), values)
        values = tl.where(header == 8, cross, values)
        values = tl.where(header == 9, local_sum, values)
        values = tl.where(header == 10, tl.where(n > 0, smallest, -1), values)
        values = tl.where(header == 11, min_quota, values)
        values = tl.where(header == 12, N, values)
        values = tl.where(header == 13, rank, values)
        values = tl.where(header == 14, sent_total, values)
        tl.store(record_ptr + header, values)

        # 8. The table: instances expert-major, rank minor; then padding and the sentinel.
        base_col = total * 0
        running = total * 0
        for c in range(0, E, EB):
            ec = c + aeb
            m2 = (ec < E)[:, None] & in_r[None, :]
            slot = tl.load(is_ptr + ec[:, None] * R + ar[None, :], mask=m2, other=-1)
            present = slot >= 0
            sends = tl.load(send_ptr + slot, mask=m2 & present, other=0)
            first = tl.load(row_ptr + slot, mask=m2 & present, other=0)
            count = tl.sum(present.to(tl.int32), axis=1)
            col = base_col + tl.cumsum(count, axis=0) - count
            col = col[:, None] + tl.cumsum(present.to(tl.int32), axis=1) - 1
            per_row = tl.sum(sends, axis=1)
            incl = running + (tl.cumsum(per_row, axis=0) - per_row)[:, None]
            incl = incl + tl.cumsum(sends, axis=1)
            keep = m2 & present
            tl.store(table_ptr + col, incl, mask=keep)
            tl.store(table_ptr + C + col, slot, mask=keep)
            tl.store(table_ptr + 3 * C + col, first - (incl - sends), mask=keep)
            base_col = base_col + tl.sum(count, axis=0)
            running = running + tl.sum(per_row, axis=0)
        own = tl.load(load_ptr + rank * E + ae, mask=in_e, other=0).to(tl.int32)
        tl.store(table_ptr + 2 * C + ae, tl.cumsum(own, axis=0) - own, mask=in_e)
        for i in range(0, C, BLOCK_C):
            k = i + tl.arange(0, BLOCK_C)
            pad = (k >= base_col) & (k < C)
            tl.store(table_ptr + k, tl.where(k == C - 1, BIG, running), mask=pad)
            tl.store(table_ptr + C + k, RP, mask=pad)
            tl.store(table_ptr + 3 * C + k, sent_total + 1, mask=pad)
            tl.store(table_ptr + 2 * C + k, 0, mask=(k >= E) & (k < C))


def scratch_size(R: int, E: int, S: int) -> int:
    """int32 entries of the kernel's scratch."""
    P = E // R + S
    return E + 3 * (R * S + 1) + 2 * E * R + 2 * R * P


def launch(
    load: torch.Tensor, rank: int, num_slots: int, min_quota: int, trigger: float, domain_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of the fused plan kernel: load int64 [R, E] -> (record int64 [L], table int32
    [4, C]) on load's device. The op's scalars (``fused_plan.op_arguments``)."""
    R, E = load.shape
    S, G = num_slots, E // R
    N = domain_size or R
    P = G + S
    record = torch.empty(record_length(R, E, S), dtype=torch.int64, device=load.device)
    table = torch.empty((4, table_columns(R, E, S)), dtype=torch.int32, device=load.device)
    scratch = torch.empty(scratch_size(R, E, S), dtype=torch.int32, device=load.device)
    # The trigger travels as its float64 bits (a float scalar would be float32); any trigger >= 1
    # has bits past int32, so Triton types them int64 and never specializes them.
    bits = struct.unpack("<q", struct.pack("<d", trigger if trigger >= 0 else 1.0))[0]
    block_r = triton.next_power_of_2(R)
    _plan_kernel[(1,)](
        load.contiguous(),
        record,
        table,
        scratch,
        rank,
        R,
        E,
        G,
        S,
        N,
        min_quota,
        int(trigger >= 0),
        bits,
        BLOCK_R=block_r,
        BLOCK_G=triton.next_power_of_2(G),
        BLOCK_E=triton.next_power_of_2(E),
        BLOCK_P=triton.next_power_of_2(P),
        BLOCK_RP=triton.next_power_of_2(R * P),
        BLOCK_C=1024,
        EB=max(1, min(triton.next_power_of_2(E), 2048 // block_r)),
        num_warps=4,
    )
    return record, table


assert HEADER == 16  # the kernel's HDR
