"""The plan record: the compact int64 array one EP rank's host reads of a plan, at megatron's one
wait, whichever planner made it (the fused device kernel or the host planner), and the reroute
table's shape that stays where the tokens are.

Layout of a record for R ranks, E experts, S redundant slots per rank, P = E // R + S, L int64:

    [0, 16)                 header (the ``H_*`` indices below)
    [16, 16 + R*S)          slot_expert [R, S], -1 for an empty slot
    [.., + R)               input_splits [R]: rows this rank sends to each rank
    [.., + R)               output_splits [R]: rows this rank receives from each rank
    [.., + R*P)             rows_per_source_slot [R, P]: rows each source sends to each of this
                            rank's physical slots (megatron's ``num_global_tokens_per_local_expert``)

L = 16 + R*S + 2*R + R*P: at EP64, E=256, S=2, 656 int64 (5,248 bytes).

The reroute table, int32 [4, C] with C = E + R*S + 1: one column per instance of the plan,
expert-major and instance rank minor, then padding columns up to C - 1, then a sentinel column.
Row 0: running total of the rows this rank sends to the instances (inclusive), the total in the
padding, int32 max in the sentinel. Row 1: the instance's physical slot (R*P, a spare slot, in
padding and sentinel). Row 2: the first E entries the expert-major position of each expert's first
pair of this rank (exclusive running total of its load), then 0. Row 3: the send-buffer row
(physical-slot-major, the all-to-all's input order) of the instance's first pair minus that pair's
expert-major position; in padding and sentinel the rows this rank sends plus one, so a position
past the last instance lands past the buffer. A pair at expert-major position ``i`` goes to column
``k = searchsorted(row0, i, right=True)``, physical slot ``row1[k]``, send-buffer row
``row3[k] + i``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .metrics import max_over_mean

__all__ = [
    "HEADER",
    "H_STATUS",
    "H_THRESHOLD",
    "H_TOTAL",
    "H_BALANCED",
    "H_MAX_BEFORE",
    "H_REPLICAS",
    "H_MAX_PER_EXPERT",
    "H_MAX_PER_HOME",
    "H_CROSS_DOMAIN",
    "H_LOCAL",
    "H_MIN_REPLICA_QUOTA",
    "H_MIN_QUOTA",
    "H_DOMAIN_SIZE",
    "H_RANK",
    "H_SEND_ROWS",
    "H_RESERVED",
    "STATUS_OK",
    "STATUS_NEGATIVE_LOAD",
    "STATUS_INT32_OVERFLOW",
    "STATUS_MEANING",
    "INT32_MAX",
    "record_length",
    "table_columns",
    "PlanRecord",
    "unpack_record",
]

HEADER = 16
H_STATUS = 0  # a STATUS_* code; the rest of the record is valid only for STATUS_OK
H_THRESHOLD = 1  # max rank load under the plan
H_TOTAL = 2  # pairs routed in the EP group
H_BALANCED = 3  # 1 if the trigger fired and the load was solved, 0 for the identity plan
H_MAX_BEFORE = 4  # max rank load with every expert at home
H_REPLICAS = 5  # filled redundant slots
H_MAX_PER_EXPERT = 6  # most replicas of one expert
H_MAX_PER_HOME = 7  # most replicas of one rank's main experts
H_CROSS_DOMAIN = 8  # replicas hosted outside their home's domain
H_LOCAL = 9  # pairs computed on their source rank
H_MIN_REPLICA_QUOTA = 10  # smallest replica quota, -1 without replicas
H_MIN_QUOTA = 11  # the quota floor the plan was solved with
H_DOMAIN_SIZE = 12  # N, ranks per NVLink domain
H_RANK = 13  # the EP rank whose splits and table these are
H_SEND_ROWS = 14  # rows this rank sends (sum of input_splits)
H_RESERVED = 15  # 0; room for one more field

STATUS_OK = 0
STATUS_NEGATIVE_LOAD = 1
STATUS_INT32_OVERFLOW = 2  # the total load does not fit the planner's int32 state
STATUS_MEANING = {
    STATUS_NEGATIVE_LOAD: "a negative entry in the load",
    STATUS_INT32_OVERFLOW: "the load's total exceeds int32",
}

INT32_MAX = 2**31 - 1


def record_length(R: int, E: int, S: int) -> int:
    """L = 16 + R*S + 2*R + R*P int64 entries, P = E // R + S."""
    return HEADER + R * S + 2 * R + R * (E // R + S)


def table_columns(R: int, E: int, S: int) -> int:
    """C = E + R*S + 1: every possible instance (mains and redundant slots) and a sentinel."""
    return E + R * S + 1


@dataclass(frozen=True)
class PlanRecord:
    """Host views of one plan record (int64 [L], :func:`record_length`) for R ranks, E experts and
    S slots: numpy views, no copies. Valid only when ``status == STATUS_OK``."""

    record: np.ndarray
    num_ranks: int
    num_experts: int
    num_slots: int

    def _field(self, index: int) -> int:
        return int(self.record[index])

    @property
    def status(self) -> int:
        return self._field(H_STATUS)

    @property
    def balanced(self) -> bool:
        return bool(self.record[H_BALANCED])

    @property
    def threshold(self) -> int:
        return self._field(H_THRESHOLD)

    @property
    def total(self) -> int:
        return self._field(H_TOTAL)

    @property
    def rank(self) -> int:
        return self._field(H_RANK)

    @property
    def send_rows(self) -> int:
        return self._field(H_SEND_ROWS)

    @property
    def physical_slots_per_rank(self) -> int:
        return self.num_experts // self.num_ranks + self.num_slots

    @cached_property
    def _offsets(self) -> tuple[int, int, int, int, int]:
        R, S, P = self.num_ranks, self.num_slots, self.physical_slots_per_rank
        a = HEADER
        b = a + R * S
        c = b + R
        d = c + R
        return a, b, c, d, d + R * P

    @property
    def slot_expert(self) -> np.ndarray:
        """[R, S] logical expert of each redundant slot, -1 if empty."""
        a, b, *_ = self._offsets
        return self.record[a:b].reshape(self.num_ranks, self.num_slots)

    @property
    def input_splits(self) -> np.ndarray:
        """[R] rows this rank sends to each rank."""
        _, b, c, *_ = self._offsets
        return self.record[b:c]

    @property
    def output_splits(self) -> np.ndarray:
        """[R] rows this rank receives from each rank."""
        _, _, c, d, _ = self._offsets
        return self.record[c:d]

    @property
    def rows_per_source_slot(self) -> np.ndarray:
        """[R, P] rows each source rank sends to each of this rank's physical slots."""
        *_, d, end = self._offsets
        return self.record[d:end].reshape(self.num_ranks, self.physical_slots_per_rank)

    def metrics(self) -> dict:
        """``planner.metrics.metrics(load, plan, domain_size=N)`` of the plan this record was
        packed from (same keys, same values), from the header alone."""
        R, N = self.num_ranks, self._field(H_DOMAIN_SIZE)
        total, replicas = self.total, self._field(H_REPLICAS)
        before = max_over_mean(self._field(H_MAX_BEFORE), total, R)
        after = max_over_mean(self.threshold, total, R)
        local = self._field(H_LOCAL)
        return {
            "imbalance_before": before,
            "imbalance_after": after,
            "memory_spread_before": before,
            "memory_spread_after": after,
            "threshold": self.threshold,
            "lower_bound": -(-total // R),
            "replicas": replicas,
            "max_fanout": 1 + self._field(H_MAX_PER_EXPERT),
            "max_replicas_per_home": self._field(H_MAX_PER_HOME),
            "cross_domain_replicas": 0 if N == R else self._field(H_CROSS_DOMAIN),
            "inflight_ratio": 1.0 - local / total if total else 0.0,
            "min_replica_quota": self._field(H_MIN_REPLICA_QUOTA) if replicas else None,
        }


def unpack_record(record, R: int, E: int, S: int) -> PlanRecord:
    """:class:`PlanRecord` over ``record`` (int64 [L]: a numpy array or a host torch tensor, e.g.
    the pinned copy read at the wait; viewed, not copied)."""
    array = record if isinstance(record, np.ndarray) else record.numpy()
    if array.dtype != np.int64 or array.shape != (record_length(R, E, S),):
        raise ValueError(
            f"a plan record for R={R}, E={E}, S={S} is int64 [{record_length(R, E, S)}], "
            f"got {array.dtype} {array.shape}"
        )
    return PlanRecord(array, R, E, S)
