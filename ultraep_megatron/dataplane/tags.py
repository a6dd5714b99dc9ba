"""Message tags: how the transfers in flight on a process group keep their messages apart.

Gloo matches point-to-point messages by (peer, tag). Transfers in flight together (waited in any
order, so a relay's later rounds may be issued after another transfer's) must not share tags: the
tag carries the transfer's sequence number, which every rank advances in step (every rank takes
part in every transfer, in the same order). NCCL ignores tags and matches by issue order.

The numbers come from a :class:`TagSequence` owned by the :class:`~.buffer.ReplicaBuffer` whose
transfers they number: each transfer takes one once its inputs passed the checks (its
:class:`TransferTags`, which tag its messages), and a buffer's
transfers are taken in call order (on the caller's thread, or all on its HostCommStream's, which
runs them in call order), so every rank numbers them alike. Two buffers on one group number theirs
independently: on gloo, transfers of two buffers sharing a group must not be in flight together
(give each buffer a group of its own).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .schedule import Edge, TransferSchedule

__all__ = ["TagSequence", "TransferTags", "check_tag_space"]

_TAG_BITS = 20  # message index within a transfer: edge * parts + part
_SEQUENCES = 1 << (31 - _TAG_BITS)  # tags stay within a C int


class TagSequence:
    """The sequence numbers of one buffer's transfers: 0, 1, 2, ... (modulo the sequences a tag can
    carry), one per transfer."""

    def __init__(self) -> None:
        self._counter = itertools.count()  # next() is atomic under the GIL: no lock needed

    def take(self, schedule: TransferSchedule, tensors_per_expert: int) -> "TransferTags":
        """The next transfer's tags; raises ``ValueError`` (taking no number) when its messages do
        not fit the tag space."""
        check_tag_space(schedule, tensors_per_expert)
        return TransferTags(next(self._counter) % _SEQUENCES, _parts(schedule, tensors_per_expert))


@dataclass(frozen=True)
class TransferTags:
    """The message tags of one transfer: its sequence number, and the messages each edge may carry
    in it (``parts``: its chunks when relayed, or one per expert tensor when direct)."""

    sequence: int
    parts: int

    def tag(self, edge: Edge, part: int) -> int:
        """Unique among the transfers in flight on a group: message ``part`` (a chunk, or an expert
        tensor) of ``edge``."""
        return (self.sequence << _TAG_BITS) | (edge.index * self.parts + part)

    def whole_expert_ops(
        self, op, tensors: Sequence[torch.Tensor], peer: int, edge: Edge, group
    ) -> list[dist.P2POp]:
        """A direct edge's operations (``op``: ``dist.isend`` or ``dist.irecv``): one per expert
        tensor."""
        return [
            dist.P2POp(op, tensor, group=group, group_peer=peer, tag=self.tag(edge, k))
            for k, tensor in enumerate(tensors)
        ]


def _parts(schedule: TransferSchedule, tensors_per_expert: int) -> int:
    """Messages one edge may carry in a transfer: its chunks (relayed), or one per expert tensor
    (direct)."""
    return max(schedule.num_chunks, tensors_per_expert)


def check_tag_space(schedule: TransferSchedule, tensors_per_expert: int) -> None:
    """``ValueError`` if a transfer on ``schedule`` has more messages than its tags can number."""
    parts = _parts(schedule, tensors_per_expert)
    if schedule.num_edges * parts >= 1 << _TAG_BITS:
        raise ValueError(
            f"a schedule of {schedule.num_edges} edges x {parts} messages needs "
            f"more than 2**{_TAG_BITS} message tags; raise the chunk size"
        )
