"""Weight distribution: copy each replicated main expert into the replica slots of its hosts
(forward, and again in backward to re-materialize the shared replica buffer). Collective over the
expert-parallel group: every rank calls it with the same schedule, which every rank built from the
same plan; no extra synchronization is exchanged.

Rounds. Direct edges move a whole expert in round 0, one operation per expert tensor, straight from
the main expert's tensors themselves; nothing is packed for them. Experts streamed through a relay
tree are chunked (from one packed row per expert at the home: chunks cross tensor boundaries): an
edge of hop ``h`` moves chunk ``c`` in round ``c + h - 1`` (the home streams chunk ``c`` to relays
in round ``c``, a relay forwards it in round ``c + 1`` once it has arrived; no whole-expert
barrier). Every op of a round has its data ready when the round is issued, so a round never waits
on a later round: deadlock-free on NCCL too, where a batch is one kernel that must complete as a
whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .checks import check_buffer, check_experts, check_schedule, group_rank
from .handle import TransferHandle, WaitOnce, launch_round, start_transfer
from .pack import ExpertTensors, expert_views, pack_experts
from .schedule import RankTransfers, TransferSchedule
from .tags import TagSequence, TransferTags

__all__ = ["distribute_weights"]


def _distribution_rounds(
    schedule: TransferSchedule,
    rank: int,
    tags: TransferTags,
    sources: dict,
    packed: dict,
    mine: RankTransfers,
    replica_weights: torch.Tensor,
    shapes: Sequence[torch.Size],
    group,
    works: list,
):
    """Issue the distribution's rounds into ``works``; yields the receives a relay must have before
    it forwards their chunks.

    A direct edge (depth 1) is one message per expert tensor in round 0, from ``sources[e]`` (the
    main expert's tensors) into views of the replica slot. A relayed expert's edges move chunks of
    its flat row: the home's from ``packed[e]``, a relay's from its own replica slot."""
    edges = mine.edges
    inbound = {edge.expert: edge.index for edge in edges if edge.hop == 1 and edge.dst == rank}
    arrived: dict[tuple[int, int], WaitOnce] = {}  # (edge index, chunk) -> receive, relays only
    for round_ in range(schedule.num_rounds):
        ops, received, dependencies = [], [], []
        for edge in edges:
            if edge.depth == 1:  # direct: the whole expert in round 0, straight from its tensors
                if round_ == 0:
                    whole = (
                        tags.whole_expert_ops(
                            dist.isend, sources[edge.expert], edge.dst, edge, group
                        )
                        if edge.src == rank
                        else tags.whole_expert_ops(
                            dist.irecv,
                            expert_views(replica_weights[edge.dst_slot], shapes),
                            edge.src,
                            edge,
                            group,
                        )
                    )
                    ops += whole
                    received += [None] * len(whole)
                continue
            chunks = schedule.edge_chunks(edge.depth)
            chunk = round_ - (edge.hop - 1)
            if not 0 <= chunk < len(chunks):
                continue
            start, end = chunks[chunk]
            tag = tags.tag(edge, chunk)
            if edge.src == rank:
                if edge.hop == 1:
                    buf = packed[edge.expert][start:end]
                else:  # stream: forward the chunk as soon as it has arrived from the home
                    dependencies.append(arrived[(inbound[edge.expert], chunk)])
                    buf = replica_weights[edge.src_slot, start:end]
                ops.append(dist.P2POp(dist.isend, buf, group=group, group_peer=edge.dst, tag=tag))
                received.append(None)
            else:
                buf = replica_weights[edge.dst_slot, start:end]
                ops.append(dist.P2POp(dist.irecv, buf, group=group, group_peer=edge.src, tag=tag))
                received.append((edge.index, chunk))
        if dependencies:
            yield dependencies
        round_works = launch_round(ops)
        for key, work in zip(received, round_works):
            if key is not None:
                arrived[key] = work
        works.extend(round_works)


@torch.no_grad()  # pure data movement: parameters may require grad, the buffers never track it
def distribute_weights(
    schedule: TransferSchedule,
    main_weights: ExpertTensors,
    replica_weights: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    tags: TagSequence,
    async_op: bool = False,
    start_after: TransferHandle | None = None,
    comm_stream=None,
) -> TransferHandle | None:
    """Copy every replicated main expert into its replica slots (bit-identical). Collective.

    Args:
        schedule: from :func:`~.schedule.build_schedule` on the same plan on every rank.
        main_weights: this rank's ``E // R`` main experts, each a sequence of tensors (e.g.
            ``[linear_fc1.weight, linear_fc2.weight]``), in local-expert order.
        replica_weights: ``[num_slots, expert_numel]`` contiguous, same dtype as ``main_weights``;
            slots hosting a replica are overwritten, other slots are left alone.
        group: the process group of the EP ranks (``None``: the world).
        tags: the sequence that numbers this transfer's message tags (its owner's), taken once
            the inputs passed the checks: every rank takes the same numbers in the same order.
        async_op: return a :class:`TransferHandle` instead of waiting. The main weights and the
            slots being written must not be modified, nor the slots read, before ``wait()``.
        start_after: a transfer this one must follow (it is waited for first).
        comm_stream: CUDA stream for NCCL transfers (default: the current stream, no overlap), or a
            :class:`~.host_stream.HostCommStream` for CPU transfers (default: the caller's thread).

    Raises:
        ValueError: on inputs that do not match the schedule, before any communication.
    """
    rank, world_size = group_rank(group)
    check_schedule(schedule, world_size)
    check_buffer("replica_weights", replica_weights, schedule)
    dtype = check_experts("main_weights", main_weights, schedule, replica_weights.device)
    if dtype != replica_weights.dtype:
        raise ValueError(
            f"main_weights are {dtype} but replica_weights is {replica_weights.dtype}; a copy must not cast"
        )

    mine = schedule.rank_transfers(rank)
    first_local = rank * schedule.experts_per_rank
    shapes = [t.shape for t in main_weights[0]]
    works: list = []
    transfer_tags = tags.take(schedule, len(shapes))

    def program():
        # On the transfer's stream. Only an expert streamed through a relay tree is packed (its
        # chunks cross tensor boundaries); direct edges send, and local copies read, the main
        # tensors themselves (a non-contiguous one is packed first: an operation needs dense memory).
        relayed = sorted({edge.expert for edge in mine.children if edge.depth == 2})
        packed = (
            dict(zip(relayed, pack_experts([main_weights[e - first_local] for e in relayed])))
            if relayed
            else {}
        )
        sources = {}
        for edge in mine.children:
            if edge.depth == 1 and edge.expert not in sources:
                tensors = main_weights[edge.expert - first_local]
                if not all(t.is_contiguous() for t in tensors):
                    tensors = expert_views(pack_experts([tensors])[0], shapes)
                sources[edge.expert] = tensors
        for e, slot in mine.local_copies:
            for view, tensor in zip(
                expert_views(replica_weights[slot], shapes), main_weights[e - first_local]
            ):
                view.copy_(tensor)
        keep.extend([packed, sources])
        yield from _distribution_rounds(
            schedule,
            rank,
            transfer_tags,
            sources,
            packed,
            mine,
            replica_weights,
            shapes,
            group,
            works,
        )

    keep: list = [replica_weights]
    return start_transfer(
        program(),
        works,
        device=replica_weights.device,
        group=group,
        comm_stream=comm_stream,
        start_after=start_after,
        async_op=async_op,
        keep=keep,
    )
