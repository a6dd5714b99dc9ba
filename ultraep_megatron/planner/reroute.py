"""One rank's reroute of a plan: its host int64 reroute table (``rank_reroute``: the planner's and
the tests' oracle; the layers use the compact int32 table of ``record_layout``), and the routed
(token, expert) pairs mapped through either table to their instances and physical slots.

    reroute = rank_reroute(plan, load, rank)          # host: splits, rows per slot, reroute table
    order, positions, instance = expert_major_pairs(topk_ids, table, key_dtype)
    slots = physical_slot_ids(table, order, instance)  # [N] physical slot of each pair, row-major

``rank_reroute`` is one compiled pass (``_compiled_reroute``). The pairs' functions are torch calls
on the pairs' device: no host read, fixed shapes, nothing over ``[T, k]`` but a sort.

Shapes (docs/glossary.md): R ranks, E experts, G = E // R, S redundant slots per rank, P = G + S
physical slots per rank; T tokens, k experts per token, N = T * k routed pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import _compiled_reroute as _compiled
from .plan import Plan
from .solve import host_array

__all__ = [
    "RankReroute",
    "rank_reroute",
    "instances_of_positions",
    "expert_major_order",
    "expert_major_pairs",
    "physical_slot_ids",
]


@dataclass(frozen=True)
class RankReroute:
    """What one EP rank reads from a plan to reroute and send its tokens, as host int64 arrays.

    Attributes:
        rows_per_source_slot: [R, P] rows each source rank sends to each of this rank's physical
            slots (megatron's ``num_global_tokens_per_local_expert``).
        rows_per_slot: [P] rows each of this rank's physical slots receives.
        input_splits / output_splits: [R] rows this rank sends to / receives from each rank (the
            token all-to-all's splits).
        reroute_table: [4, E * R + 1], this rank as a source: row 0 is the running total of the
            rows it sends to the instances of each expert (expert-major, instance rank minor), then
            a sentinel above every position (int64 max); row 1 the physical slot of that instance
            (0 where there is none: such an entry sends no row), then ``R * P``, a spare column
            past the last physical slot; row 2's first E entries the expert-major position of each
            expert's first pair, minus one (exclusive running total of this rank's load), then 0;
            row 3 the row of this rank's send buffer (physical-slot-major, the all-to-all's input
            order) of the instance's first pair minus that pair's expert-major position, then
            ``N + 1`` (``N`` the rows this rank sends: a position past the last instance lands past
            the buffer and a spare row). A pair at expert-major position ``i`` goes to the instance
            ``k`` of the first entry of row 0 above ``i`` (``searchsorted(row0, i, right=True)``),
            to its physical slot ``row1[k]`` and to send-buffer row ``row3[k] + i``.
    """

    rows_per_source_slot: np.ndarray
    rows_per_slot: np.ndarray
    input_splits: np.ndarray
    output_splits: np.ndarray
    reroute_table: np.ndarray


def rank_reroute(
    plan: Plan,
    load: torch.Tensor,
    rank: int,
    *,
    rows_per_source_slot: np.ndarray | None = None,
    reroute_table: np.ndarray | None = None,
) -> RankReroute:
    """:class:`RankReroute` of ``plan`` (host tensors) solved for ``load`` int64 [R, E], for
    ``rank``: one compiled pass, a few microseconds (it runs per layer and microbatch between the
    load's arrival on the host and the reroute, where the device waits).

    ``rows_per_source_slot`` ([R, P]) and ``reroute_table`` ([4, E * R + 1]), if given, are
    C-contiguous int64 arrays to fill (e.g. views of pinned host tensors to upload from).
    """
    R, E = plan.num_ranks, plan.num_experts
    P = plan.physical_slots_per_rank
    if tuple(load.shape) != (R, E):
        raise ValueError(f"load has shape {tuple(load.shape)}, the plan is for {(R, E)}")
    if not 0 <= rank < R:
        raise ValueError(f"rank must be in [0, {R}), got {rank}")
    for name, tensor in (
        ("load", load),
        ("plan.physical_split", plan.physical_split),
        ("plan.slot_expert", plan.slot_expert),
    ):
        # Host int64 only: a device tensor would be a blocking read here, another dtype a fresh
        # compilation of the kernel.
        if tensor.device.type != "cpu" or tensor.dtype != torch.int64:
            raise ValueError(
                f"{name} must be an int64 host tensor, got {tensor.dtype} on {tensor.device}"
            )

    def output_array(given, shape):
        if given is None:
            return np.empty(shape, np.int64)
        if given.shape != shape or given.dtype != np.int64 or not given.flags.c_contiguous:
            raise ValueError(
                f"expected a C-contiguous int64 array of shape {shape}, got "
                f"{given.dtype} {given.shape}"
            )
        return given

    out = RankReroute(
        output_array(rows_per_source_slot, (R, P)),
        np.empty(P, np.int64),
        np.empty(R, np.int64),
        np.empty(R, np.int64),
        output_array(reroute_table, (4, E * R + 1)),
    )
    _compiled.reroute_arrays(
        host_array(plan.physical_split),
        host_array(plan.slot_expert),
        host_array(load),
        rank,
        out.rows_per_source_slot,
        out.rows_per_slot,
        out.input_splits,
        out.output_splits,
        out.reroute_table,
    )
    return out


def instances_of_positions(
    running: torch.Tensor, positions: torch.Tensor, *, binary_search: bool
) -> torch.Tensor:
    """The reroute table column of each expert-major position: the first whose running total
    (``running``, the table's row 0, int64 [E * R + 1] ending in a sentinel) exceeds it.

    ``positions`` is ``arange(N)``, ``N`` the pairs the plan hands out. ``binary_search`` (CUDA):
    one binary search per position, all in parallel, O(N log(E * R)). Otherwise (CPU, where each
    search misses the cache and costs ~3x more): instance ``k`` repeated for its count of
    positions, O(N + E * R); its output size makes it a device op (without one it reads the
    counts' sum). The same columns either way.
    """
    if binary_search:  # the table may be the compact int32 one (``record_layout``)
        return torch.searchsorted(running, positions.to(running.dtype), right=True)
    counts = torch.diff(running[:-1], prepend=running.new_zeros(1))
    return torch.repeat_interleave(
        torch.arange(running.numel() - 1, device=running.device),
        counts,
        output_size=positions.numel(),
    )


def expert_major_order(topk_ids: torch.Tensor, key_dtype: torch.dtype) -> torch.Tensor:
    """[N] the row-major pair index at each expert-major position of ``topk_ids`` [T, k] int64 (the
    routed pairs' logical experts); needs no plan.

    A pair's expert-major position (expert-major, token-ascending: the order megatron's
    permutation sorts them in, the plan's quotas are handed out in) is its rank in a stable sort of
    the pairs by expert: pairs of one token have distinct experts, so among an expert's pairs the
    row-major order is the token order. ``key_dtype``: the narrowest integer that holds an expert
    id (the radix sort's passes are over the key's bytes, on CPU and CUDA).
    """
    return torch.sort(topk_ids.reshape(-1).to(key_dtype), stable=True).indices


def expert_major_pairs(
    topk_ids: torch.Tensor, reroute_table: torch.Tensor, key_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed pairs ``topk_ids`` [T, k] in the expert-major order (:func:`expert_major_order`),
    and each one's instance in ``reroute_table`` [4, E * R + 1] (on the pairs' device): the first
    column whose running quota total (row 0) exceeds the pair's position. Binary search on CUDA,
    a repeat elsewhere (:func:`instances_of_positions`).

    Returns:
        (order [N]: the row-major pair index at each expert-major position, positions [N]
        (``arange``), instance [N]: the reroute table column of each position).
    """
    order = expert_major_order(topk_ids, key_dtype)
    positions = torch.arange(order.numel(), device=order.device)
    instance = instances_of_positions(reroute_table[0], positions, binary_search=order.is_cuda)
    return order, positions, instance


def physical_slot_ids(
    reroute_table: torch.Tensor, order: torch.Tensor, instance: torch.Tensor
) -> torch.Tensor:
    """[N] int64: the physical slot of each routed pair, in row-major pair order (view it as the
    ``[T, k]`` pairs), from :func:`expert_major_pairs`' ``order`` and ``instance``: row 1 of
    ``reroute_table`` at the pair's instance."""
    slot = reroute_table[1].index_select(0, instance).to(order.dtype)
    return torch.empty_like(order).scatter_(0, order, slot)
