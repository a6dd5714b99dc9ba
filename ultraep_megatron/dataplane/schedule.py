"""Transfer planning for expert replication: who sends which expert chunk to whom.

A replication plan is ``slot_expert`` (int64 ``[R, num_slots]``; entry ``e >= 0`` means rank ``r``
hosts a replica of logical expert ``e`` in redundant slot ``s``, ``-1`` an empty slot). Expert ``e``
lives (its *main* copy) on home rank ``e // (E // R)``.

This module turns a plan into a :class:`TransferSchedule`, a rank-independent description of every
point-to-point transfer. It is pure computation (no ``torch.distributed``): every rank derives the
same schedule from the same plan, so execution needs no extra synchronization.

Schedule model (weight direction; gradients flow along the same edges reversed):

* Every remote replica receives its expert exactly once, over one *edge* ``src -> dst``.
* A *direct* expert: the home sends to every replica host (hop 1).
* A *relayed* expert (§6.2 of the UltraEP paper): the home sends to a small relay set
  (hop 1, frontier ``round(sqrt(n))`` for ``n`` remote replicas); each relay is itself a replica host
  and forwards to its leaves (hop 2) from its own replica slot.
* Each edge moves the expert in chunks of ``chunk_numel`` consecutive elements. A hop-2 edge sends
  chunk ``c`` one round after the hop-1 edge delivered it (chunk streaming, no whole-expert barrier).
* A replica placed on its expert's own home rank is filled by a local copy (no edge).

Relay trees (which experts get one, which hosts relay, which leaves each feeds) are chosen in
:mod:`.relay`.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from .relay import RELAY_MODES, relay_trees

__all__ = [
    "Edge",
    "RankTransfers",
    "TransferSchedule",
    "build_schedule",
    "validate_slot_expert",
    "RELAY_MODES",
]

# Defaults; see docs/dataplane.md. 1M elements = 2 MiB in bf16, 4 MiB in fp32.
DEFAULT_CHUNK_NUMEL = 1 << 20
# An expert is relay-eligible when it has more than this many remote replicas.
DEFAULT_RELAY_THRESHOLD = 3


def validate_slot_expert(slot_expert: torch.Tensor, num_experts: int) -> None:
    """Check a plan's slot table; raise ValueError on anything malformed.

    Args:
        slot_expert: int64 ``[R, num_slots]``, entries in ``[-1, num_experts)``.
        num_experts: E, a positive multiple of R.

    Only rank-independent facts are checked, so every rank raises identically.
    """
    if not isinstance(slot_expert, torch.Tensor):
        raise ValueError(f"slot_expert must be a torch.Tensor, got {type(slot_expert).__name__}")
    if slot_expert.dtype != torch.int64:
        raise ValueError(f"slot_expert must be int64, got {slot_expert.dtype}")
    if slot_expert.dim() != 2:
        raise ValueError(
            f"slot_expert must be 2-D [num_ranks, num_slots], got shape {tuple(slot_expert.shape)}"
        )
    num_ranks, num_slots = slot_expert.shape
    if num_ranks < 1:
        raise ValueError("slot_expert must have at least one rank row")
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % num_ranks != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be a positive multiple of the number of ranks ({num_ranks})"
        )
    if slot_expert.numel() == 0:
        return
    table = slot_expert.detach().cpu().numpy()  # host checks in numpy: microseconds, per layer
    lo, hi = int(table.min()), int(table.max())
    if lo < -1 or hi >= num_experts:
        raise ValueError(
            f"slot_expert entries must lie in [-1, {num_experts}), found range [{lo}, {hi}]"
        )
    # No logical expert twice on one rank (the planner's no-duplicate constraint): a duplicate would
    # make the receive side ambiguous and double-count its gradient.
    sorted_rows = np.sort(table, axis=1)
    duplicate = (sorted_rows[:, 1:] == sorted_rows[:, :-1]) & (sorted_rows[:, 1:] >= 0)
    if duplicate.any():
        rank, col = (int(v) for v in np.argwhere(duplicate)[0])
        raise ValueError(
            f"rank {rank} hosts expert {int(sorted_rows[rank, col + 1])} in more than one slot"
        )


class Edge(NamedTuple):
    """One replica edge of a schedule, as seen by the ranks it connects (weight direction).

    ``index`` is its position in canonical order; ``depth`` is 2 when its expert streams through a
    relay tree (then it moves in chunks), 1 otherwise; ``src_slot`` is -1 for a home's main expert.
    """

    index: int
    expert: int
    hop: int
    depth: int
    src: int
    dst: int
    src_slot: int
    dst_slot: int


@dataclass(frozen=True, eq=False)
class TransferSchedule:
    """Rank-independent transfer schedule of one replication plan (the handle passed to execution).

    Edge tensors all have shape ``[N]`` (``N`` = number of remote replicas) and are in canonical order,
    sorted by ``(expert, hop, src, dst)``; both endpoints of every edge issue its chunks in this order.

    Attributes:
        slot_expert: int64 ``[R, num_slots]`` (a CPU copy of the plan).
        num_experts: E.
        expert_numel: elements of one expert's flattened state.
        chunk_numel: elements per chunk (the last chunk of an expert may be shorter).
        edge_expert: int64 ``[N]`` logical expert moved by the edge.
        edge_src: int64 ``[N]`` sender in the weight direction (home for hop 1, a relay for hop 2).
        edge_src_slot: int64 ``[N]`` sender's replica slot for hop 2, ``-1`` for hop 1 (main expert).
        edge_dst: int64 ``[N]`` receiver in the weight direction.
        edge_dst_slot: int64 ``[N]`` receiver's replica slot.
        edge_hop: int64 ``[N]`` 1 (from home) or 2 (from a relay).
        local_expert: int64 ``[n_local]`` experts with a replica on their own home rank.
        local_rank: int64 ``[n_local]`` that home rank.
        local_slot: int64 ``[n_local]`` the replica slot there.
        relayed_experts: int64 ``[K]`` experts distributed through a relay tree.
    """

    slot_expert: torch.Tensor
    num_experts: int
    expert_numel: int
    chunk_numel: int
    edge_expert: torch.Tensor
    edge_src: torch.Tensor
    edge_src_slot: torch.Tensor
    edge_dst: torch.Tensor
    edge_dst_slot: torch.Tensor
    edge_hop: torch.Tensor
    local_expert: torch.Tensor
    local_rank: torch.Tensor
    local_slot: torch.Tensor
    relayed_experts: torch.Tensor
    _rank_transfers: dict = field(default_factory=dict, repr=False, compare=False)
    _resized: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_ranks(self) -> int:
        return self.slot_expert.shape[0]

    @property
    def num_slots(self) -> int:
        return self.slot_expert.shape[1]

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def num_chunks(self) -> int:
        """Chunks per expert: ``ceil(expert_numel / chunk_numel)``."""
        return -(-self.expert_numel // self.chunk_numel)

    @property
    def num_edges(self) -> int:
        return self.edge_expert.numel()

    @cached_property  # read by every transfer of the schedule: computed once
    def uses_relay(self) -> bool:
        return bool((self.edge_hop.numpy() == 2).any())

    @cached_property
    def num_rounds(self) -> int:
        """Communication rounds. Direct edges move whole experts in round 0; only experts streamed
        through a relay are chunked, chunk ``c`` crossing its first hop in round ``c`` and its second
        in round ``c + 1`` (so ``num_chunks + 1`` rounds when a relay tree exists)."""
        if self.num_edges == 0:
            return 0
        return self.num_chunks + 1 if self.uses_relay else 1

    def with_expert_numel(self, expert_numel: int) -> "TransferSchedule":
        """The same edges, relay trees and local copies for an expert state of ``expert_numel``
        elements (e.g. the weights' bytes where they differ from the gradients' layout): chunk
        ranges, rounds and tag counts follow from it. Made once per size and kept on this schedule,
        so every rank (same plan, same sizes) derives the same one."""
        if expert_numel == self.expert_numel:
            return self
        if not isinstance(expert_numel, int) or expert_numel < 1:
            raise ValueError(f"expert_numel must be a positive int, got {expert_numel!r}")
        resized = self._resized.get(expert_numel)
        if resized is None:  # the per-rank edges do not depend on the size: shared
            resized = self._resized[expert_numel] = dataclasses.replace(
                self, expert_numel=expert_numel, _rank_transfers=self._rank_transfers, _resized={}
            )
        return resized

    def home_rank(self, expert: torch.Tensor | int):
        """Home rank(s) of logical expert(s)."""
        return expert // self.experts_per_rank

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        """``[start, end)`` element range of chunk ``chunk`` within an expert."""
        start = chunk * self.chunk_numel
        return start, min(start + self.chunk_numel, self.expert_numel)

    def send_volume(self) -> torch.Tensor:
        """Elements each rank sends in weight distribution, int64 ``[R]``.

        By symmetry this is also what each rank *receives* in gradient reduction (same edges
        reversed), so it measures the fan-in bottleneck there too.
        """
        counts = torch.bincount(self.edge_src, minlength=self.num_ranks)
        return counts * self.expert_numel

    def edge_chunks(self, depth: int) -> list[tuple[int, int]]:
        """``[start, end)`` element ranges an edge of a tree of ``depth`` moves, in round order:
        the whole expert at once for a direct edge (depth 1), ``num_chunks`` chunks when streamed
        through a relay (depth 2)."""
        if depth == 1:
            return [(0, self.expert_numel)]
        return [self.chunk_range(c) for c in range(self.num_chunks)]

    def rank_edges(self, rank: int) -> list["Edge"]:
        """The edges ``rank`` sends or receives, in canonical order."""
        return list(self.rank_transfers(rank).edges)

    def local_copies(self, rank: int) -> tuple[tuple[int, int], ...]:
        """``(expert, replica slot)`` of the replicas ``rank`` hosts of its own main experts,
        ascending expert (no communication: a copy on the home rank)."""
        return self.rank_transfers(rank).local_copies

    def rank_transfers(self, rank: int) -> "RankTransfers":
        """Everything ``rank`` sends, receives, copies and folds in this schedule's transfers
        (:class:`RankTransfers`). Computed once per rank: every transfer of the schedule asks
        (tens of microseconds of numpy and Python each time otherwise)."""
        if rank not in self._rank_transfers:
            self._rank_transfers[rank] = _rank_transfers(self, rank)
        return self._rank_transfers[rank]


@dataclass(frozen=True)
class RankTransfers:
    """One rank's part in a schedule's transfers, derived once per rank
    (:meth:`TransferSchedule.rank_transfers`): every transfer of the schedule on that rank reads it.

    Attributes:
        edges: the edges it sends or receives, canonical order.
        local_copies: ``(expert, replica slot)`` of its replicas of its own main experts.
        replicated_experts: its main experts with a replica, ascending: weight distribution reads
            them (sent over a first hop or copied locally), gradient reduction adds into their
            gradients.
        children: the first-hop edges it sends as a home: in gradient reduction it receives their
            replicas' (or relays' partial) gradients, one staging row each (``staging_row``).
        hosted_slots: its redundant slots hosting a replica, ascending: the reduction sends (or, on
            a relay, accumulates into) their gradients.
    """

    edges: tuple
    local_copies: tuple
    replicated_experts: tuple
    children: tuple
    staging_row: dict
    hosted_slots: tuple


def _rank_transfers(schedule: TransferSchedule, rank: int) -> RankTransfers:
    # The schedule's tensors are host tensors (build_schedule): these reads never touch a device.
    src, dst = schedule.edge_src.numpy(), schedule.edge_dst.numpy()
    mine = np.flatnonzero((src == rank) | (dst == rank))
    relayed = np.isin(schedule.edge_expert.numpy()[mine], schedule.relayed_experts.numpy())
    columns = [
        mine,
        schedule.edge_expert.numpy()[mine],
        schedule.edge_hop.numpy()[mine],
        np.where(relayed, 2, 1),
        src[mine],
        dst[mine],
        schedule.edge_src_slot.numpy()[mine],
        schedule.edge_dst_slot.numpy()[mine],
    ]
    edges = tuple(Edge(*row) for row in zip(*(c.tolist() for c in columns)))
    here = schedule.local_rank.numpy() == rank
    local = tuple(
        sorted(
            zip(
                schedule.local_expert.numpy()[here].tolist(),
                schedule.local_slot.numpy()[here].tolist(),
            )
        )
    )
    children = tuple(edge for edge in edges if edge.hop == 1 and edge.src == rank)
    replicated = tuple(sorted({edge.expert for edge in children} | {e for e, _ in local}))
    return RankTransfers(
        edges=edges,
        local_copies=local,
        replicated_experts=replicated,
        children=children,
        staging_row={edge.index: row for row, edge in enumerate(children)},
        hosted_slots=tuple(
            sorted(
                {edge.dst_slot for edge in edges if edge.dst == rank} | {slot for _, slot in local}
            )
        ),
    )


def build_schedule(
    slot_expert: torch.Tensor,
    num_experts: int,
    expert_numel: int,
    *,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    relay: str = "adaptive",
    relay_threshold: int = DEFAULT_RELAY_THRESHOLD,
) -> TransferSchedule:
    """Compile a replication plan into a transfer schedule.

    Args:
        slot_expert: int64 ``[R, num_slots]``, ``-1`` = empty slot (any device; copied to CPU).
        num_experts: E, a multiple of R; expert ``e``'s home rank is ``e // (E // R)``.
        expert_numel: elements in one expert's flattened state (weights or gradients).
        chunk_numel: elements per transfer chunk.
        relay: ``"off"`` (direct only), ``"adaptive"`` (relay trees only where they lower the
            bottleneck rank's send volume) or ``"always"`` (every eligible expert, for testing).
        relay_threshold: an expert is relay-eligible when it has more than this many remote replicas.

    Returns:
        The :class:`TransferSchedule`, identical on every rank for the same inputs.
    """
    validate_slot_expert(slot_expert, num_experts)
    if not isinstance(expert_numel, int) or expert_numel < 1:
        raise ValueError(f"expert_numel must be a positive int, got {expert_numel!r}")
    if not isinstance(chunk_numel, int) or chunk_numel < 1:
        raise ValueError(f"chunk_numel must be a positive int, got {chunk_numel!r}")
    if relay not in RELAY_MODES:
        raise ValueError(f"relay must be one of {RELAY_MODES}, got {relay!r}")
    if not isinstance(relay_threshold, int) or relay_threshold < 1:
        raise ValueError(f"relay_threshold must be an int >= 1, got {relay_threshold!r}")

    slot_expert = slot_expert.detach().to("cpu", copy=True)
    num_ranks, num_slots = slot_expert.shape
    experts_per_rank = num_experts // num_ranks

    # Host-side planning runs per layer and microbatch: numpy, not torch, for the small arrays.
    rep_rank, rep_slot = np.nonzero(slot_expert.numpy() >= 0)  # row-major: ascending rank
    rep_expert = slot_expert.numpy()[rep_rank, rep_slot]
    rep_home = rep_expert // experts_per_rank
    is_local = rep_rank == rep_home
    local_expert, local_rank, local_slot = (
        rep_expert[is_local],
        rep_rank[is_local],
        rep_slot[is_local],
    )
    rep_expert, rep_rank, rep_slot, rep_home = (
        a[~is_local] for a in (rep_expert, rep_rank, rep_slot, rep_home)
    )

    # Remote replica hosts per expert, ascending rank.
    hosts_of: dict[int, list[tuple[int, int]]] = {}
    for e, r, s in zip(rep_expert.tolist(), rep_rank.tolist(), rep_slot.tolist()):
        hosts_of.setdefault(e, []).append((r, s))

    # Direct-schedule send volume per rank, in experts.
    volume = np.bincount(rep_home, minlength=num_ranks).tolist()

    parent = relay_trees(
        hosts_of, volume, experts_per_rank, relay, relay_threshold
    )  # expert -> {leaf: relay}

    slot_of = {(e, r): s for e, hs in hosts_of.items() for r, s in hs}
    rows = []  # (expert, hop, src, dst, src_slot, dst_slot)
    for e, hs in hosts_of.items():
        home = e // experts_per_rank
        tree = parent.get(e)
        for r, s in hs:
            if tree is None or r not in tree:
                rows.append((e, 1, home, r, -1, s))
            else:
                relay_rank = tree[r]
                rows.append((e, 2, relay_rank, r, slot_of[(e, relay_rank)], s))
    rows.sort(key=lambda row: row[:4])
    edges = torch.from_numpy(np.array(rows, dtype=np.int64).reshape(-1, 6))
    return TransferSchedule(
        slot_expert=slot_expert,
        num_experts=num_experts,
        expert_numel=expert_numel,
        chunk_numel=chunk_numel,
        edge_expert=edges[:, 0].contiguous(),
        edge_hop=edges[:, 1].contiguous(),
        edge_src=edges[:, 2].contiguous(),
        edge_dst=edges[:, 3].contiguous(),
        edge_src_slot=edges[:, 4].contiguous(),
        edge_dst_slot=edges[:, 5].contiguous(),
        local_expert=torch.from_numpy(local_expert.astype(np.int64)),
        local_rank=torch.from_numpy(local_rank.astype(np.int64)),
        local_slot=torch.from_numpy(local_slot.astype(np.int64)),
        relayed_experts=torch.tensor(sorted(parent), dtype=torch.int64),
    )


class ScheduleCache:
    """The schedules of the last ``capacity`` replica layouts: hot experts stay hot for many
    microbatches and layers, so the same ``slot_expert`` recurs, and a schedule is immutable.
    :class:`~ultraep_megatron.dataplane.ReplicaBuffer` keeps one; so does a cost-model replay.

    ``get`` takes :func:`build_schedule`'s arguments; a ``slot_expert`` that is not an int64 [R, S]
    host tensor is built without caching (its bytes would need a device read).
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._schedules: OrderedDict[tuple, TransferSchedule] = OrderedDict()

    def get(
        self, slot_expert: torch.Tensor, num_experts: int, expert_numel: int, **options
    ) -> TransferSchedule:
        cacheable = (
            slot_expert.device.type == "cpu"
            and slot_expert.dtype == torch.int64
            and slot_expert.dim() == 2
        )
        if not cacheable:
            return build_schedule(slot_expert, num_experts, expert_numel, **options)
        key = (
            tuple(slot_expert.shape),
            num_experts,
            expert_numel,
            tuple(sorted(options.items())),
            slot_expert.numpy().tobytes(),
        )
        schedule = self._schedules.get(key)
        if schedule is not None:
            self._schedules.move_to_end(key)
            return schedule
        schedule = self._schedules[key] = build_schedule(
            slot_expert, num_experts, expert_numel, **options
        )
        if len(self._schedules) > self.capacity:
            self._schedules.popitem(last=False)
        return schedule
