"""The rank dispatch: what one EP rank's dispatcher reads from a :class:`Plan`.

    dispatch = rank_dispatch(plan, load, rank)  # splits, per-slot rows, the reroute table
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import _compiled_dispatch as _compiled
from .plan import Plan
from .solve import host_array

__all__ = ["RankDispatch", "rank_dispatch"]


@dataclass(frozen=True)
class RankDispatch:
    """What one EP rank's dispatcher needs from a plan, as host int64 arrays.

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


def rank_dispatch(plan: Plan, load: torch.Tensor, rank: int, *,
                  rows_per_source_slot: np.ndarray | None = None,
                  reroute_table: np.ndarray | None = None) -> RankDispatch:
    """:class:`RankDispatch` of ``plan`` (host tensors) solved for ``load`` int64 [R, E], for
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
    for name, tensor in (("load", load), ("plan.physical_split", plan.physical_split),
                         ("plan.slot_expert", plan.slot_expert)):
        # Host int64 only: a device tensor would be a blocking read here, another dtype a fresh
        # compilation of the kernel.
        if tensor.device.type != "cpu" or tensor.dtype != torch.int64:
            raise ValueError(f"{name} must be an int64 host tensor, got {tensor.dtype} on {tensor.device}")

    def output_array(given, shape):
        if given is None:
            return np.empty(shape, np.int64)
        if given.shape != shape or given.dtype != np.int64 or not given.flags.c_contiguous:
            raise ValueError(f"expected a C-contiguous int64 array of shape {shape}, got "
                             f"{given.dtype} {given.shape}")
        return given

    out = RankDispatch(output_array(rows_per_source_slot, (R, P)), np.empty(P, np.int64),
                       np.empty(R, np.int64), np.empty(R, np.int64),
                       output_array(reroute_table, (4, E * R + 1)))
    _compiled.dispatch_arrays(host_array(plan.physical_split), host_array(plan.slot_expert), host_array(load),
                              rank, out.rows_per_source_slot, out.rows_per_slot, out.input_splits,
                              out.output_splits, out.reroute_table)
    return out
