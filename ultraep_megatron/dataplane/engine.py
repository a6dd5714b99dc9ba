"""Execution of a :class:`TransferSchedule` with torch.distributed point-to-point operations.

Two operations, both collective over the expert-parallel group (every rank calls them with the same
schedule, which every rank built from the same plan; no extra synchronization is exchanged):

* :func:`distribute_weights`: copy each replicated main expert into the replica slots of its hosts
  (forward, and again in backward to re-materialize the shared replica buffer).
* :func:`reduce_gradients`: add every replica's gradient into its main expert's gradient, then zero the
  replica gradient buffer.

Rounds. Communication runs in ``schedule.num_rounds`` rounds, one ``batch_isend_irecv`` per round
per rank. In weight distribution, an edge of hop ``h`` moves chunk ``c`` in round ``c + h - 1``: the
home streams chunk ``c`` to relays in round ``c`` and a relay forwards it in round ``c + 1``, right
after waiting on that chunk's receive (chunk streaming; no whole-expert barrier). Every op of a round
has its data ready when the round is issued, so a round never waits on a later round: this keeps the
schedule deadlock-free on NCCL too, where a batch is one kernel that must complete as a whole.
Gradient reduction runs the same edges reversed: leaves send chunk ``c`` to their relay in round
``c``, the relay adds them into its own replica gradient and sends the partial sum to the home in
round ``c + 1``; direct replicas send chunk ``c`` in round ``c``.

Deterministic reduction. Gradients are accumulated in ``promote_types(main_grad, replica_grad)`` and
cast back once. Per element the addition order is fixed by the plan: at a relay,
``((own + leaf_1) + leaf_2) + ...``; at the home, ``((main + local_replica) + child_1) + child_2 ...``
with leaves and children in ascending rank order (children are relays for a relayed expert).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .schedule import (
    DEFAULT_CHUNK_NUMEL,
    DEFAULT_RELAY_THRESHOLD,
    TransferSchedule,
    build_schedule,
)

__all__ = [
    "distribute_weights",
    "reduce_gradients",
    "pack_experts",
    "expert_views",
    "ReplicaBuffer",
]

ExpertTensors = Sequence[Sequence[torch.Tensor]]


@torch.no_grad()
def pack_experts(experts: ExpertTensors, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Flatten experts into rows.

    Args:
        experts: ``n`` experts, each a sequence of tensors (same shapes for every expert).
        dtype: output dtype (default: the tensors' dtype).

    Returns:
        ``[n, expert_numel]`` contiguous tensor; row ``i`` is expert ``i``'s tensors flattened and
        concatenated in order.
    """
    if len(experts) == 0:
        raise ValueError("pack_experts needs at least one expert")
    first = experts[0]
    dtype = dtype or first[0].dtype
    numel = sum(t.numel() for t in first)
    out = torch.empty(len(experts), numel, dtype=dtype, device=first[0].device)
    for row, expert in zip(out, experts):
        offset = 0
        for t in expert:  # one pass per tensor: copy and cast together
            row[offset : offset + t.numel()].view(t.shape).copy_(t)
            offset += t.numel()
    return out


def expert_views(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of a flat ``[expert_numel]`` row as tensors of ``shapes`` (inverse of one packed row)."""
    sizes = [torch.Size(s).numel() for s in shapes]
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise ValueError(f"flat must be 1-D with {sum(sizes)} elements, got shape {tuple(flat.shape)}")
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]


def _unpack_into(experts: Sequence[Sequence[torch.Tensor]], rows: torch.Tensor) -> None:
    """Copy ``rows`` (``[n, expert_numel]``) back into the per-expert tensors, casting to their dtype."""
    for expert, row in zip(experts, rows):
        offset = 0
        for t in expert:
            t.copy_(row[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()


def _group_rank(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized")
    return dist.get_rank(group), dist.get_world_size(group)


def _check_buffer(name: str, buffer: torch.Tensor, schedule: TransferSchedule) -> None:
    """A replica buffer must be a contiguous ``[num_slots, expert_numel]`` tensor."""
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor")
    expected = (schedule.num_slots, schedule.expert_numel)
    if tuple(buffer.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(buffer.shape)}, the plan needs [num_slots, expert_numel] = {list(expected)}")
    if not buffer.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_experts(name: str, experts: ExpertTensors, schedule: TransferSchedule, device: torch.device) -> torch.dtype:
    """Check the local main experts (``E // R`` sequences of tensors); return their common dtype."""
    if len(experts) != schedule.experts_per_rank:
        raise ValueError(
            f"{name} has {len(experts)} local experts, the plan has {schedule.experts_per_rank} per rank "
            f"({schedule.num_experts} experts on {schedule.num_ranks} ranks)"
        )
    first = experts[0]
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in first]
    if None in shapes:
        raise ValueError(f"{name}[0] must contain only tensors (got a {type(first[shapes.index(None)]).__name__})")
    numel = sum(torch.Size(s).numel() for s in shapes)
    if numel != schedule.expert_numel:
        raise ValueError(f"{name}[0] has {numel} elements in total, the plan's expert_numel is {schedule.expert_numel}")
    dtype = first[0].dtype
    for i, expert in enumerate(experts):
        if [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in expert] != shapes:
            raise ValueError(f"{name}[{i}] shapes differ from {name}[0] ({shapes})")
        for t in expert:
            if t.dtype != dtype:
                raise ValueError(f"{name}[{i}] mixes dtypes ({t.dtype} vs {dtype}); all expert tensors must share one dtype")
            if t.device != device:
                raise ValueError(f"{name}[{i}] is on {t.device}, the replica buffer on {device}")
    return dtype


def _check_schedule(schedule: TransferSchedule, world_size: int) -> None:
    if not isinstance(schedule, TransferSchedule):
        raise ValueError(f"schedule must be a TransferSchedule, got {type(schedule).__name__}")
    if schedule.num_ranks != world_size:
        raise ValueError(f"the plan has {schedule.num_ranks} ranks, the process group {world_size}")


class _WaitOnce:
    """A work handle that may be waited on more than once.

    Why: gloo's recv ``Work.wait()`` waits for one *more* message each call, so a second wait on the
    same handle hangs; a coalesced (NCCL) batch returns one handle shared by all its ops.
    """

    __slots__ = ("work", "done")

    def __init__(self, work) -> None:
        self.work = work
        self.done = False

    def wait(self) -> None:
        if not self.done:
            self.work.wait()
            self.done = True


def _launch(ops: list[dist.P2POp]) -> list[_WaitOnce]:
    """Issue one round as one batch; return one handle per op."""
    if not ops:
        return []
    works = [_WaitOnce(w) for w in dist.batch_isend_irecv(ops)]
    if len(works) != len(ops):  # coalescing backend: one handle covers the whole batch
        works = [works[-1]] * len(ops)
    return works


def _rank_edges(schedule: TransferSchedule, rank: int) -> list[tuple[int, ...]]:
    """This rank's edges in canonical order as ``(index, expert, hop, depth, src, dst, src_slot, dst_slot)``.

    Cached on the schedule: the forward, the backward re-distribution and the reduction reuse it.
    """
    key = ("edges", rank)
    if key not in schedule._rank_cache:
        idx = ((schedule.edge_src == rank) | (schedule.edge_dst == rank)).nonzero().flatten()
        cols = [idx, schedule.edge_expert[idx], schedule.edge_hop[idx], schedule.edge_depth()[idx],
                schedule.edge_src[idx], schedule.edge_dst[idx], schedule.edge_src_slot[idx], schedule.edge_dst_slot[idx]]
        schedule._rank_cache[key] = list(zip(*(c.tolist() for c in cols)))
    return schedule._rank_cache[key]


@torch.no_grad()  # pure data movement: parameters may require grad, the buffers never track it
def distribute_weights(
    schedule: TransferSchedule,
    main_weights: ExpertTensors,
    replica_weights: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Copy every replicated main expert into its replica slots (bit-identical). Collective.

    Args:
        schedule: from :func:`build_schedule` on the same plan on every rank.
        main_weights: this rank's ``E // R`` main experts, each a sequence of tensors (e.g.
            ``[linear_fc1.weight, linear_fc2.weight]``), in local-expert order.
        replica_weights: ``[num_slots, expert_numel]`` contiguous, same dtype as ``main_weights``;
            slots hosting a replica are overwritten, other slots are left alone.
        group: the expert-parallel process group (default: the world).
    """
    rank, world_size = _group_rank(group)
    _check_schedule(schedule, world_size)
    _check_buffer("replica_weights", replica_weights, schedule)
    dtype = _check_experts("main_weights", main_weights, schedule, replica_weights.device)
    if dtype != replica_weights.dtype:
        raise ValueError(f"main_weights are {dtype} but replica_weights is {replica_weights.dtype}; a copy must not cast")

    edges = _rank_edges(schedule, rank)
    first_local = rank * schedule.experts_per_rank
    local_here = (schedule.local_rank == rank).nonzero().flatten().tolist()
    sent_from_main = sorted(
        {e for _, e, hop, _, src, *_ in edges if hop == 1 and src == rank}
        | {int(schedule.local_expert[i]) for i in local_here}
    )
    row_of = {e: i for i, e in enumerate(sent_from_main)}
    packed = pack_experts([main_weights[e - first_local] for e in sent_from_main]) if sent_from_main else None
    for i in local_here:
        replica_weights[int(schedule.local_slot[i])].copy_(packed[row_of[int(schedule.local_expert[i])]])

    num_chunks = schedule.num_chunks
    incoming_edge = {e: idx for idx, e, hop, _, _, dst, *_ in edges if hop == 1 and dst == rank}
    arrived: dict[tuple[int, int], object] = {}  # (edge, chunk) -> recv work, for chunks this rank relays
    works_all = []
    for round_ in range(schedule.num_rounds):
        ops = []
        relay_input_keys = []
        for idx, e, hop, _, src, dst, src_slot, dst_slot in edges:
            chunk = round_ - (hop - 1)
            if not 0 <= chunk < num_chunks:
                continue
            start, end = schedule.chunk_range(chunk)
            tag = idx * num_chunks + chunk
            if src == rank:
                if hop == 1:
                    buf = packed[row_of[e], start:end]
                else:
                    # Stream: forward this chunk as soon as it has arrived from the home.
                    arrived[(incoming_edge[e], chunk)].wait()
                    buf = replica_weights[src_slot, start:end]
                ops.append(dist.P2POp(dist.isend, buf, group=group, group_peer=dst, tag=tag))
                relay_input_keys.append(None)
            else:
                buf = replica_weights[dst_slot, start:end]
                ops.append(dist.P2POp(dist.irecv, buf, group=group, group_peer=src, tag=tag))
                relay_input_keys.append((idx, chunk))
        works = _launch(ops)
        for key, work in zip(relay_input_keys, works):
            if key is not None:
                arrived[key] = work
        works_all.extend(works)
    for work in works_all:
        work.wait()


@torch.no_grad()  # pure data movement: parameters may require grad, the buffers never track it
def reduce_gradients(
    schedule: TransferSchedule,
    main_grads: ExpertTensors,
    replica_grads: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Add every replica's gradient into its main expert's gradient, then zero ``replica_grads``. Collective.

    Args:
        schedule: the schedule used for the weight distribution of this layer.
        main_grads: this rank's ``E // R`` main-expert gradients (e.g. ``param.main_grad`` fp32 views
            or ``param.grad``), each a sequence of tensors, same layout as the main weights.
        replica_grads: ``[num_slots, expert_numel]`` contiguous floating tensor (typically fp32);
            communicated in its own dtype, all of it zeroed on return.
        group: the expert-parallel process group (default: the world).

    The sum is accumulated in ``promote_types(main dtype, replica dtype)`` in the fixed order given in
    the module docstring, so it is bit-identical across runs of the same plan.
    """
    rank, world_size = _group_rank(group)
    _check_schedule(schedule, world_size)
    _check_buffer("replica_grads", replica_grads, schedule)
    if not replica_grads.is_floating_point():
        raise ValueError(f"replica_grads must be floating point, got {replica_grads.dtype}")
    main_dtype = _check_experts("main_grads", main_grads, schedule, replica_grads.device)
    if not main_dtype.is_floating_point:
        raise ValueError(f"main_grads must be floating point, got {main_dtype}")
    acc_dtype = torch.promote_types(main_dtype, replica_grads.dtype)

    edges = _rank_edges(schedule, rank)
    first_local = rank * schedule.experts_per_rank
    local_here = sorted(
        (int(schedule.local_expert[i]), int(schedule.local_slot[i]))
        for i in (schedule.local_rank == rank).nonzero().flatten().tolist()
    )
    reduced_here = sorted({e for _, e, hop, _, src, *_ in edges if hop == 1 and src == rank} | {e for e, _ in local_here})
    row_of = {e: i for i, e in enumerate(reduced_here)}
    acc = pack_experts([main_grads[e - first_local] for e in reduced_here], acc_dtype) if reduced_here else None
    for e, slot in local_here:
        acc[row_of[e]] += replica_grads[slot].to(acc_dtype)

    num_chunks = schedule.num_chunks
    # Receives of the last round issued, as (work, staged chunk, target), split by consumer.
    relay_pending: list[tuple] = []
    home_pending: list[tuple] = []
    works_all = []

    def fold(pending: list[tuple]) -> None:
        for work, staged, target in pending:  # canonical edge order = ascending sender rank
            work.wait()
            target += staged.to(target.dtype) if staged.dtype != target.dtype else staged

    for round_ in range(schedule.num_rounds + 1):
        # Relays add their leaves' chunks of the previous round before forwarding the partial sums.
        fold(relay_pending)
        relay_pending = []
        previous_home, home_pending = home_pending, []
        if round_ < schedule.num_rounds:
            ops = []
            consumers = []
            # Gradient direction: a tree of depth 2 sends leaf chunks in round c, partial sums in c + 1.
            active = []
            for idx, e, hop, depth, src, dst, src_slot, dst_slot in edges:
                chunk = round_ - (depth - hop)
                if 0 <= chunk < num_chunks:
                    start, end = schedule.chunk_range(chunk)
                    active.append((idx, e, hop, src, dst, src_slot, dst_slot, chunk, start, end))
            recv_numel = sum(end - start for (_, _, _, src, _, _, _, _, start, end) in active if src == rank)
            # Fresh staging per round: at most two rounds of receives are alive at a time.
            staging = torch.empty(recv_numel, dtype=replica_grads.dtype, device=replica_grads.device)
            offset = 0
            for idx, e, hop, src, dst, src_slot, dst_slot, chunk, start, end in active:
                tag = idx * num_chunks + chunk
                if dst == rank:  # gradient flows dst -> src
                    buf = replica_grads[dst_slot, start:end]
                    ops.append(dist.P2POp(dist.isend, buf, group=group, group_peer=src, tag=tag))
                    consumers.append(None)
                else:
                    buf = staging[offset : offset + end - start]
                    offset += end - start
                    ops.append(dist.P2POp(dist.irecv, buf, group=group, group_peer=dst, tag=tag))
                    if hop == 2:  # a leaf's gradient into this relay's own replica gradient
                        consumers.append((relay_pending, replica_grads[src_slot, start:end]))
                    else:  # a child's gradient (or partial sum) into the main gradient
                        consumers.append((home_pending, acc[row_of[e], start:end]))
            works = _launch(ops)
            for consumer, op, work in zip(consumers, ops, works):
                if consumer is not None:
                    consumer[0].append((work, op.tensor, consumer[1]))
            works_all.extend(works)
        # The home folds the previous round's chunks while this round is in flight.
        fold(previous_home)
    for work in works_all:
        work.wait()
    if reduced_here:
        _unpack_into([main_grads[e - first_local] for e in reduced_here], acc)
    replica_grads.zero_()


class ReplicaBuffer:
    """Replica state shared by all MoE layers of a model, plus the transfers that fill and drain it.

    Owns ``replica_weights`` ``[num_slots, expert_numel]`` (weight dtype) and ``replica_grads``
    ``[num_slots, expert_numel]`` (grad dtype, zero between uses). Typical use per MoE layer::

        schedule = buffer.schedule(plan.slot_expert, num_experts)      # once per plan (the handle)
        buffer.distribute_weights(schedule, local_expert_weights)      # forward (and backward again)
        ...                                                            # replica compute
        buffer.reduce_gradients(schedule, local_expert_main_grads)     # backward
    """

    def __init__(
        self,
        num_slots: int,
        expert_shapes: Sequence[Sequence[int]],
        weight_dtype: torch.dtype,
        *,
        grad_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        relay: str = "adaptive",
        relay_threshold: int = DEFAULT_RELAY_THRESHOLD,
    ) -> None:
        if not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots must be a non-negative int, got {num_slots!r}")
        self.expert_shapes = [torch.Size(s) for s in expert_shapes]
        if not self.expert_shapes:
            raise ValueError("expert_shapes must list at least one tensor shape")
        self.expert_numel = sum(s.numel() for s in self.expert_shapes)
        self.group = group
        self.chunk_numel = chunk_numel
        self.relay = relay
        self.relay_threshold = relay_threshold
        self.replica_weights = torch.zeros(num_slots, self.expert_numel, dtype=weight_dtype, device=device)
        self.replica_grads = torch.zeros(num_slots, self.expert_numel, dtype=grad_dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.replica_weights.shape[0]

    def schedule(self, slot_expert: torch.Tensor, num_experts: int) -> TransferSchedule:
        """Build the transfer schedule of a plan (pure computation, identical on every rank)."""
        if slot_expert.dim() == 2 and slot_expert.shape[1] != self.num_slots:
            raise ValueError(f"slot_expert has {slot_expert.shape[1]} slots per rank, the buffer {self.num_slots}")
        return build_schedule(
            slot_expert,
            num_experts,
            self.expert_numel,
            chunk_numel=self.chunk_numel,
            relay=self.relay,
            relay_threshold=self.relay_threshold,
        )

    def distribute_weights(self, schedule: TransferSchedule, main_weights: ExpertTensors) -> None:
        """Fill the replica slots from the main experts; see :func:`distribute_weights`."""
        distribute_weights(schedule, main_weights, self.replica_weights, self.group)

    def reduce_gradients(self, schedule: TransferSchedule, main_grads: ExpertTensors) -> None:
        """Reduce replica gradients into the main gradients and zero them; see :func:`reduce_gradients`."""
        reduce_gradients(schedule, main_grads, self.replica_grads, self.group)

    def weight_views(self, slot: int) -> list[torch.Tensor]:
        """Views of replica slot ``slot`` shaped like one expert's tensors."""
        return expert_views(self.replica_weights[slot], self.expert_shapes)

    def grad_views(self, slot: int) -> list[torch.Tensor]:
        """Views of replica gradient slot ``slot`` shaped like one expert's tensors."""
        return expert_views(self.replica_grads[slot], self.expert_shapes)
