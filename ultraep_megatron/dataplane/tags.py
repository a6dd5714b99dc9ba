"""Message tags: how the transfers in flight on a process group keep their messages apart.

Gloo matches point-to-point messages by (peer, tag). Transfers in flight together (waited in any
order, so a relay's later rounds may be issued after another transfer's) must not share tags: the
tag carries the transfer's sequence number, which every rank advances in step (every rank takes
part in every transfer, in the same order). NCCL ignores tags and matches by issue order.

The numbers come from a :class:`TagSequence` owned by the :class:`~.buffer.ReplicaBuffer` whose
transfers they number: each transfer takes one once its inputs passed the checks, and a buffer's
transfers are taken in call order (on the caller's thread, or all on its HostCommStream's, which
runs them in call order), so every rank numbers them alike. Two buffers on one group number theirs
independently: on gloo, transfers of two buffers sharing a group must not be in flight together
(give each buffer a group of its own).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .schedule import Edge, TransferSchedule

_TAG_BITS = 20  # message index within a transfer: edge * parts + part
_SEQUENCES = 1 << (31 - _TAG_BITS)  # tags stay within a C int


class TagSequence:
    """The sequence numbers of one buffer's transfers: 0, 1, 2, ... (modulo the sequences a tag can
    carry), one per transfer."""

    def __init__(self) -> None:
        self._counter = itertools.count()  # next() is atomic under the GIL: no lock needed

    def take(self, schedule: TransferSchedule, tensors_per_expert: int) -> int:
        """The next transfer's sequence number; raises ``ValueError`` (taking none) when its
        messages do not fit the tag space."""
        _check_tag_space(schedule, tensors_per_expert)
        return next(self._counter) % _SEQUENCES


def _tag_parts(schedule: TransferSchedule, tensors_per_expert: int) -> int:
    """Messages one edge may carry in a transfer: its chunks (relayed), or one per expert tensor
    (direct)."""
    return max(schedule.num_chunks, tensors_per_expert)


def _check_tag_space(schedule: TransferSchedule, tensors_per_expert: int) -> None:
    parts = _tag_parts(schedule, tensors_per_expert)
    if schedule.num_edges * parts >= 1 << _TAG_BITS:
        raise ValueError(f"a schedule of {schedule.num_edges} edges x {parts} messages needs "
                         f"more than 2**{_TAG_BITS} message tags; raise the chunk size")


def _tag(sequence: int, edge: Edge, part: int, parts: int) -> int:
    """Unique among the transfers in flight on a group: message ``part`` (a chunk, or an expert
    tensor) of ``edge``, ``parts`` (:func:`_tag_parts`) per edge."""
    return (sequence << _TAG_BITS) | (edge.index * parts + part)


def _whole_expert_ops(op, tensors: Sequence[torch.Tensor], peer: int, edge: Edge, sequence: int, parts: int,
                      group) -> list[dist.P2POp]:
    """A direct edge's operations (``op``: ``dist.isend`` or ``dist.irecv``): one per expert tensor."""
    return [dist.P2POp(op, tensor, group=group, group_peer=peer, tag=_tag(sequence, edge, k, parts))
            for k, tensor in enumerate(tensors)]
