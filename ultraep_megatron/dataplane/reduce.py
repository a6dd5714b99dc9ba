"""Gradient reduction: add every replica's gradient into its main expert's gradient. Collective over
the expert-parallel group, like the weight distribution (:mod:`.distribute`), whose edges it runs
reversed. Each hosted slot is written with its replica's gradient beforehand, by the caller or by
the transfer itself (``hosted_grads``; a copy: no slot has to be kept at zero between uses), and
nothing is cleared afterwards.

Rounds. Direct replicas send their whole gradient to the home in round 0, one operation per tensor,
straight from the replica's gradients when given in the buffer's dtype. Through a relay tree,
leaves send chunk ``c`` to their relay in round ``c``; the relay adds them into its own replica
gradient and sends the partial sum to the home in round ``c + 1``.

Deterministic reduction. The home receives its children's gradients into staging rows (one per
incoming edge) while the transfer is in flight, and folds them into the main gradients in
``wait()``, on the caller's stream, so the fold is ordered after the caller's own writes to those
gradients (the main experts' weight gradients); or, with ``fold_on_stream``, on the transfer's
stream as soon as they have arrived, for a caller that does not touch them before ``wait()``.
Gradients are accumulated in ``promote_types(main_grad, replica_grad)`` and cast back once. Per
element the addition order is fixed by the plan: at a relay, ``((own + leaf_1) + leaf_2) + ...``;
at the home, ``((main + local_replica) + child_1) + child_2 ...`` with leaves and children in
ascending rank order (children are relays for a relayed expert).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from .checks import check_buffer, check_experts, check_schedule, group_rank
from .handle import TransferHandle, launch_round, start_transfer
from .pack import ExpertTensors, expert_views, pack_experts, unpack_experts
from .schedule import TransferSchedule
from .tags import TagSequence

__all__ = ["reduce_gradients"]


@torch.no_grad()  # pure data movement: parameters may require grad, the buffers never track it
def reduce_gradients(
    schedule: TransferSchedule,
    main_grads: ExpertTensors,
    replica_grads: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    tags: TagSequence,
    async_op: bool = False,
    start_after: TransferHandle | None = None,
    comm_stream=None,
    hosted_grads: Mapping[int, Sequence[torch.Tensor] | None] | None = None,
    fold_on_stream: bool = False,
) -> TransferHandle | None:
    """Add every replica's gradient into its main expert's gradient. Collective.

    Reads the slots of ``replica_grads`` that host a replica on this rank
    (``schedule.rank_transfers(rank).hosted_slots``), which hold those replicas' gradients: written
    by the caller beforehand, or by the transfer itself from ``hosted_grads``; a relay also adds its
    leaves' gradients into its own slot, in place, before forwarding the partial sums. Other slots
    are neither read nor written.

    Args:
        schedule: the schedule used for the weight distribution of this invocation.
        main_grads: this rank's ``E // R`` main-expert gradients (e.g. ``param.main_grad`` fp32 views
            or ``param.grad``), each a sequence of tensors, same layout as the main weights.
        replica_grads: ``[num_slots, expert_numel]`` contiguous floating tensor (typically fp32);
            communicated in its own dtype.
        group: the process group of the EP ranks (``None``: the world).
        tags: the sequence that numbers this transfer's message tags (its owner's), taken once
            the inputs passed the checks: every rank takes the same numbers in the same order.
        async_op: return a :class:`TransferHandle` instead of waiting. Without ``fold_on_stream``
            the main gradients are read and written only inside ``wait()`` (on the caller's stream),
            so the caller may keep writing them until then; ``replica_grads`` must not be touched
            before ``wait()``, nor another reduction on it started.
        start_after: a transfer this one must follow (it is waited for first).
        comm_stream: CUDA stream for NCCL transfers (default: the current stream, no overlap), or a
            :class:`~.host_stream.HostCommStream` for CPU transfers (default: the caller's thread).
        hosted_grads: ``{slot: tensors}`` for every hosted slot: the replica's gradient, shaped like
            the main gradients of one expert (``None``, or a ``None`` tensor: zeros, e.g. a replica
            that received no rows).
            Sent as they are over a direct edge when dense and in ``replica_grads``' dtype;
            otherwise copied into their slot (cast to its dtype) on the transfer's stream, first
            (the caller's thread copies nothing). The tensors must not change before ``wait()``.
        fold_on_stream: fold into ``main_grads`` on the transfer's stream as soon as the gradients
            have arrived (overlapping the caller's work) instead of in ``wait()``. Only where the
            caller neither reads nor writes ``main_grads`` before ``wait()`` (e.g. not with Megatron's
            gradient-accumulation fusion, whose weight-gradient kernels write ``main_grad``).

    The sum is accumulated in ``promote_types(main dtype, replica dtype)`` in the fixed order given in
    the module docstring, so it is bit-identical across runs of the same plan, synchronous or not.

    Raises:
        ValueError: on inputs that do not match the schedule, before any communication.
    """
    rank, world_size = group_rank(group)
    check_schedule(schedule, world_size)
    check_buffer("replica_grads", replica_grads, schedule)
    if not replica_grads.is_floating_point():
        raise ValueError(f"replica_grads must be floating point, got {replica_grads.dtype}")
    main_dtype = check_experts("main_grads", main_grads, schedule, replica_grads.device)
    if not main_dtype.is_floating_point:
        raise ValueError(f"main_grads must be floating point, got {main_dtype}")
    acc_dtype = torch.promote_types(main_dtype, replica_grads.dtype)

    mine = schedule.rank_transfers(rank)
    edges, local, children, staging_row = (
        mine.edges,
        mine.local_copies,
        mine.children,
        mine.staging_row,
    )
    reduced_here = mine.replicated_experts
    first_local = rank * schedule.experts_per_rank
    shapes = [g.shape for g in main_grads[0]]
    stream_reads = (
        _check_hosted_grads(hosted_grads, mine.hosted_slots, shapes, replica_grads.device)
        if hosted_grads is not None
        else []
    )
    works: list = []
    transfer_tags = tags.take(schedule, len(shapes))
    staging = torch.empty(
        len(children),
        schedule.expert_numel if children else 0,
        dtype=replica_grads.dtype,
        device=replica_grads.device,
    )

    def program():
        # A replica sent to its home over a direct edge sends each gradient tensor as it is, if it
        # travels in the buffer's dtype; every other hosted gradient (a relay tree's chunks cross
        # tensor boundaries, a local replica is folded from the buffer, zeros, a cast) goes through
        # its slot, written here, on the transfer's stream: the caller's thread copies nothing.
        direct = {edge.dst_slot for edge in edges if edge.dst == rank and edge.depth == 1}
        # What each direct slot's edge sends, per expert tensor: the slot itself when the caller wrote it.
        sources = {slot: expert_views(replica_grads[slot], shapes) for slot in direct}
        for slot, grads in (hosted_grads or {}).items():
            views = sources.get(slot) or expert_views(replica_grads[slot], shapes)
            sent = []
            for view, grad in zip(views, grads or [None] * len(views)):
                if (
                    grad is not None
                    and slot in direct
                    and grad.dtype == replica_grads.dtype
                    and grad.is_contiguous()
                ):
                    sent.append(grad)
                    continue
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
                sent.append(view)
            if slot in direct:
                sources[slot] = sent
        pending: list[tuple] = []  # a relay's receives of the last round: (work, staged, own chunk)
        for round_ in range(schedule.num_rounds):
            if pending:  # a relay adds its leaves' chunks before forwarding the partial sums
                yield [work for work, _, _ in pending]
                for _, staged, own in pending:  # canonical order = ascending leaf rank
                    own += staged
                pending = []
            ops, targets, active = [], [], []
            for edge in edges:
                if edge.depth == 1:  # direct: the whole expert in round 0, one message per tensor
                    if round_ == 0:  # a child's gradient lands in its staging row, folded in wait()
                        whole = (
                            transfer_tags.whole_expert_ops(
                                dist.isend, sources[edge.dst_slot], edge.src, edge, group
                            )
                            if edge.dst == rank
                            else transfer_tags.whole_expert_ops(
                                dist.irecv,
                                expert_views(staging[staging_row[edge.index]], shapes),
                                edge.dst,
                                edge,
                                group,
                            )
                        )
                        ops += whole
                        targets += [None] * len(whole)
                    continue
                chunks = schedule.edge_chunks(edge.depth)
                chunk = round_ - (edge.depth - edge.hop)
                if 0 <= chunk < len(chunks):
                    active.append((edge, chunk, *chunks[chunk]))
            relay_numel = sum(
                end - start for edge, _, start, end in active if edge.src == rank and edge.hop == 2
            )
            relay_staging = torch.empty(
                relay_numel, dtype=replica_grads.dtype, device=replica_grads.device
            )
            offset = 0
            for edge, chunk, start, end in active:
                tag = transfer_tags.tag(edge, chunk)
                if edge.dst == rank:  # gradients flow dst -> src
                    ops.append(
                        dist.P2POp(
                            dist.isend,
                            replica_grads[edge.dst_slot, start:end],
                            group=group,
                            group_peer=edge.src,
                            tag=tag,
                        )
                    )
                    targets.append(None)
                elif edge.hop == 2:  # a leaf's gradient for this relay's own replica gradient
                    staged = relay_staging[offset : offset + end - start]
                    offset += end - start
                    ops.append(
                        dist.P2POp(dist.irecv, staged, group=group, group_peer=edge.dst, tag=tag)
                    )
                    targets.append((staged, replica_grads[edge.src_slot, start:end]))
                else:  # a child's gradient, folded into the main gradient in wait()
                    staged = staging[staging_row[edge.index], start:end]
                    ops.append(
                        dist.P2POp(dist.irecv, staged, group=group, group_peer=edge.dst, tag=tag)
                    )
                    targets.append(None)
            round_works = launch_round(ops)
            pending = [
                (work, *target) for work, target in zip(round_works, targets) if target is not None
            ]
            works.extend(round_works)

    def fold_into_main_grads():
        if reduced_here and acc_dtype == main_dtype:
            # In place, tensor by tensor, in the same order: no packed copy of the main gradients.
            for e in reduced_here:
                grads = main_grads[e - first_local]
                addends = [replica_grads[slot] for e_, slot in local if e_ == e]
                addends += [staging[row] for row, edge in enumerate(children) if edge.expert == e]
                for addend in addends:  # canonical order: local replica, then ascending child
                    for grad, piece in zip(grads, expert_views(addend, [g.shape for g in grads])):
                        grad += piece
        elif reduced_here:
            row_of = {e: i for i, e in enumerate(reduced_here)}
            acc = pack_experts([main_grads[e - first_local] for e in reduced_here], acc_dtype)
            for e, slot in local:
                acc[row_of[e]] += replica_grads[slot].to(acc_dtype)
            for row, edge in enumerate(children):  # canonical order: ascending child per expert
                acc[row_of[edge.expert]] += staging[row].to(acc_dtype)
            unpack_experts([main_grads[e - first_local] for e in reduced_here], acc)

    return start_transfer(
        program(),
        works,
        device=replica_grads.device,
        group=group,
        comm_stream=comm_stream,
        start_after=start_after,
        async_op=async_op,
        finish=fold_into_main_grads,
        finish_on_stream=fold_on_stream,
        keep=(staging, replica_grads, *stream_reads),
        stream_reads=stream_reads,
    )


def _check_hosted_grads(
    hosted_grads, hosted_slots: tuple, shapes, device: torch.device
) -> list[torch.Tensor]:
    """``hosted_grads`` names exactly the hosted slots, each with ``None`` or one tensor (or
    ``None``) per expert tensor: of its shape, dense, floating point, on the buffer's device (what
    the copy on the transfer's stream needs: it runs after the peers may have started); returns
    those tensors."""
    if sorted(hosted_grads) != list(hosted_slots):
        raise ValueError(
            f"hosted_grads has slots {sorted(hosted_grads)}, this rank hosts {list(hosted_slots)}"
        )
    tensors = []
    for slot, grads in hosted_grads.items():
        if grads is None:
            continue
        if len(grads) != len(shapes) or any(
            g is not None
            and (
                not isinstance(g, torch.Tensor)
                or g.shape != shape
                or g.layout != torch.strided
                or not g.is_floating_point()
                or g.device != device
            )
            for g, shape in zip(grads, shapes)
        ):
            raise ValueError(
                f"hosted_grads[{slot}] must be {len(shapes)} dense floating tensors on {device} of "
                f"shapes {[tuple(s) for s in shapes]} (or None)"
            )
        tensors += [g for g in grads if g is not None]
    return tensors
