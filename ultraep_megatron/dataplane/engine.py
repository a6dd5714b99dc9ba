"""Execution of a :class:`TransferSchedule` with torch.distributed point-to-point operations.

Two operations, both collective over the expert-parallel group (every rank calls them with the same
schedule, which every rank built from the same plan; no extra synchronization is exchanged):

* :func:`distribute_weights`: copy each replicated main expert into the replica slots of its hosts
  (forward, and again in backward to re-materialize the shared replica buffer).
* :func:`reduce_gradients`: add every replica's gradient into its main expert's gradient. Each hosted
  slot is written with its replica's gradient beforehand, by the caller or by the transfer itself
  (``hosted_grads``; a copy: no slot has to be kept at zero between uses), and nothing is cleared
  afterwards.

Handles. Both can run asynchronously (``async_op=True``) and return a :class:`TransferHandle`,
like DeepEP's buffer API: the caller keeps computing and calls ``handle.wait()`` where it needs the
result; ``start_after`` orders a transfer after an earlier one. Where the transfer runs depends on
the backend, never its result (bit-identical either way):

* CUDA tensors over NCCL: everything is issued at once on a communication stream of its own, which
  first waits for the caller's stream; a relay's forward of a chunk waits on that chunk's receive
  through stream order, never on the host. ``wait()`` makes the caller's stream wait for an event.
* anything else (gloo on the CPU), with a :class:`HostCommStream` (what :class:`ReplicaBuffer`
  uses): the CPU's stand-in for that communication stream, one thread that packs, issues and
  completes every transfer handed to it, in order, relay rounds after their receives; ``wait()``
  waits for it. Without one, the caller issues the operations at once, except rounds in which a
  relay forwards data it must first receive; ``wait()`` issues those.

Rounds. Direct edges move a whole expert in round 0, one operation per expert tensor, straight from
the tensors themselves: the main expert's weights, the replica's gradients (when given in the
buffer's dtype); nothing is packed for them. Experts streamed through a relay tree are chunked
(from one packed row per expert at the home: chunks cross tensor boundaries): in weight
distribution, an edge of hop ``h`` moves chunk ``c`` in round ``c + h - 1`` (the home streams chunk
``c`` to relays in round ``c``, a relay forwards it in round ``c + 1`` once it has arrived; no
whole-expert barrier). Every op of a round has its data ready when
the round is issued, so a round never waits on a later round: deadlock-free on NCCL too, where a batch
is one kernel that must complete as a whole. Gradient reduction runs the same edges reversed: leaves
send chunk ``c`` to their relay in round ``c``, the relay adds them into its own replica gradient and
sends the partial sum to the home in round ``c + 1``; direct replicas send in round 0.

Deterministic reduction. The home receives its children's gradients into staging rows (one per
incoming edge) while the transfer is in flight, and folds them into the main gradients in
``wait()``, on the caller's stream, so the fold is ordered after the caller's own writes to those
gradients (the main experts' weight gradients); or, with ``fold_on_stream``, on the transfer's
stream as soon as they have arrived, for a caller that does not touch them before ``wait()``. Gradients are accumulated in
``promote_types(main_grad, replica_grad)`` and cast back once. Per element the addition order is
fixed by the plan: at a relay, ``((own + leaf_1) + leaf_2) + ...``; at the home,
``((main + local_replica) + child_1) + child_2 ...`` with leaves and children in ascending rank order
(children are relays for a relayed expert).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from .schedule import (
    DEFAULT_CHUNK_NUMEL,
    DEFAULT_RELAY_THRESHOLD,
    Edge,
    RankTransfers,
    TransferSchedule,
    build_schedule,
)

__all__ = [
    "HostCommStream",
    "TransferHandle",
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


#: (rank, size) of the process groups transfers ran on: a group's never change, and asking
#: torch.distributed costs a few dozen Python calls per transfer. (Single reads and writes of the
#: map need no lock under the GIL.)
_group_ranks: "weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[int, int]]" = weakref.WeakKeyDictionary()


def _group_rank(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized")
    if group is None:  # the default group may be destroyed and re-created
        return dist.get_rank(), dist.get_world_size()
    known = _group_ranks.get(group)
    if known is None:
        known = _group_ranks[group] = (dist.get_rank(group), dist.get_world_size(group))
    return known


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


class HostCommStream:
    """The CPU's stand-in for a CUDA communication stream: one thread that runs the transfers handed
    to it (packing, every point-to-point operation, a relay's later rounds), in the order they were
    handed over, while the caller computes.

    Why: over gloo the caller's thread does an operation's work itself (a send copies the data into
    the socket; a packed expert is a copy), which on a GPU the communication stream and the
    copy engines do beside the compute. Every rank hands its transfers over in the same order, so
    one thread per group keeps the order NCCL needs; folds into the main gradients stay on the
    caller's thread (``wait()``), as on CUDA on the caller's stream, unless a reduction asks for
    them on the stream (``fold_on_stream``).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, issue: Callable[[], None]) -> "_Completion":
        """Run ``issue`` after everything submitted before it; ``result()`` of what this returns
        waits for it and re-raises what it raised."""
        if self._thread is None:
            # A daemon: a transfer a failed rank abandoned must not hold the process at exit. It
            # holds only the queue, and ends once this stream is collected.
            self._thread = threading.Thread(target=_serve, args=(self._queue,), name="ultraep-comm",
                                            daemon=True)
            self._thread.start()
            weakref.finalize(self, self._queue.put, None)
        completion = _Completion()
        self._queue.put((issue, completion))
        return completion


class _Completion:
    """The outcome of one call run on a :class:`HostCommStream`: a lock held from submission until
    the call has returned or raised. Two per layer and microbatch on the caller's critical path, so
    not a ``concurrent.futures.Future`` (a condition, a re-entrant lock and waiter lists per call)."""

    __slots__ = ("_lock", "_done", "_result", "_error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._result = self._error = None

    def _set(self, result=None, error: BaseException | None = None) -> None:
        """On the stream's thread, once: the call's outcome."""
        self._result, self._error = result, error
        self._lock.release()

    def result(self, timeout: float | None = None):
        """Wait for the call (at most ``timeout`` seconds: ``TimeoutError``); return its result or
        re-raise its exception."""
        if not self._done:
            if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError("the HostCommStream call did not finish in time")
            self._done = True
        if self._error is not None:
            raise self._error
        return self._result


def _serve(work: queue.SimpleQueue) -> None:
    """A HostCommStream's thread: run what is queued, in order, until ``None``."""
    while (item := work.get()) is not None:
        issue, completion = item
        try:
            completion._set(issue())
        except BaseException as error:  # handed to the caller's wait()
            completion._set(error=error)
        del item, issue, completion  # drop the transfer's tensors while waiting for the next


class TransferHandle:
    """One weight distribution or gradient reduction in flight.

    Returned by :func:`distribute_weights` and :func:`reduce_gradients` with ``async_op=True``.
    ``wait()`` completes the transfer for the caller (see the module docstring for what that means
    per backend); a second ``wait()`` is a no-op.

    Attributes:
        host_seconds: wall time the calling thread spent issuing and waiting for this transfer. On
            the CPU (gloo) this is the transfer time the caller could not hide; on CUDA it is the
            host's issue cost only.
        host_cpu_seconds: CPU time of the calling thread in the same calls (packing, folding);
            ``host_seconds - host_cpu_seconds`` is the time it was blocked.
    """

    def __init__(self, program: Iterator[list], works: list, *, stream_ordered: bool,
                 comm_stream=None, finish: Callable[[], None] | None = None, finish_on_stream: bool = False,
                 keep=()):
        self._program: Iterator[list] | None = program
        self._issuing: _Completion | None = None  # the HostCommStream running the transfer
        self._works = works
        self._stream_ordered = stream_ordered
        self._comm_stream = comm_stream
        self._finish = finish
        self._finish_on_stream = finish_on_stream  # run ``finish`` on the comm stream, not in wait()
        self._pending: list = []  # receives the program's next round depends on
        self._keep = keep  # tensors the operations in flight read or write
        self._event = None
        self._done = False
        self.host_seconds = self.host_cpu_seconds = 0.0

    @property
    def done(self) -> bool:
        """True once ``wait()`` returned."""
        return self._done

    @torch.no_grad()
    def _issue(self) -> None:
        """Issue operations until one must wait for a receive (gloo) or all are issued (CUDA)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        if self._stream_ordered:
            with torch.cuda.stream(self._comm_stream):
                self._complete_operations()  # NCCL: a wait() makes the comm stream wait, not the host
                if self._finish_on_stream:
                    self._finish()
                self._event = self._comm_stream.record_event()
        else:
            self._pending = next(self._program, None)
            if self._pending is None:
                self._program = None
        self.host_seconds += time.perf_counter() - t0
        self.host_cpu_seconds += time.thread_time() - c0

    @torch.no_grad()
    def _complete_operations(self) -> None:
        """Issue what is left of the program, each round after the receives it depends on (a
        relay's), and wait for every operation: on the comm stream (CUDA), a HostCommStream's thread,
        or the caller's thread, which then blocks."""
        while self._program is not None:
            for work in self._pending:  # the host waits, then issues what depended on it
                work.wait()
            self._pending = next(self._program, None)
            if self._pending is None:
                self._program = None
        for work in self._works:
            work.wait()

    @torch.no_grad()
    def _run_on_host_stream(self) -> None:
        """The whole transfer on a :class:`HostCommStream`'s thread: issue it, wait for every
        operation (the stream's next transfer starts after this one, as on a CUDA stream), and fold
        there when ``finish_on_stream``. The caller's ``wait()`` then only waits for this."""
        self._complete_operations()
        if self._finish_on_stream:
            self._finish()

    @torch.no_grad()
    def wait(self) -> None:
        """Complete the transfer: the replica weights (distribution) or the main gradients and the
        replica gradient slots (reduction) are ready for the caller's next operation."""
        if self._done:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        if self._stream_ordered:
            torch.cuda.current_stream().wait_event(self._event)
            for tensor in self._keep:  # read by the fold below, on the caller's stream
                if isinstance(tensor, torch.Tensor):
                    tensor.record_stream(torch.cuda.current_stream())
        elif self._issuing is not None:
            self._issuing.result()  # complete on the HostCommStream (re-raises what failed there)
        else:
            self._complete_operations()
        if self._finish is not None and not self._finish_on_stream:
            self._finish()
        self._done = True
        self._keep = self._works = self._finish = self._issuing = None
        self.host_seconds += time.perf_counter() - t0
        self.host_cpu_seconds += time.thread_time() - c0


class _HostStreamTransfer(TransferHandle):
    """A transfer whose whole call runs on a :class:`HostCommStream`'s thread: its checks, schedule
    lookups, packing and issuing, and the wait for its operations, so that the caller's thread only
    hands it over (every :meth:`ReplicaBuffer.distribute_weights` /
    :meth:`~ReplicaBuffer.reduce_gradients` on the CPU). ``call`` returns the transfer's own handle,
    its operations complete; ``wait()`` waits for the thread, then completes that handle (a fold left
    to the caller). A failed transfer raises in its first ``wait()`` only."""

    def __init__(self, stream: HostCommStream, call: Callable[[], TransferHandle]):
        super().__init__(iter(()), [], stream_ordered=False)
        self._issuing = stream.submit(call)

    @torch.no_grad()
    def wait(self) -> None:
        if self._done:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        issuing, self._issuing = self._issuing, None
        try:
            transfer = issuing.result()  # re-raises what failed there, bad inputs included
            transfer.wait()
        finally:
            self._done = True
        self.host_seconds += time.perf_counter() - t0
        self.host_cpu_seconds += time.thread_time() - c0


def _completed(transfer: TransferHandle, finish: bool) -> TransferHandle:
    """``transfer`` (issued without a comm stream) with its operations complete, and its ``finish``
    too when asked."""
    if finish:
        transfer.wait()
    else:
        transfer._complete_operations()
    return transfer


def _stream_ordered(device: torch.device, group) -> bool:
    """Whether a transfer runs on a CUDA stream (NCCL's operations are stream-ordered), rather than
    being completed by a host thread (gloo's)."""
    return device.type == "cuda" and dist.get_backend(group) == "nccl"


def _start(program: Iterator[list], works: list, *, device: torch.device, group, comm_stream,
           start_after: "TransferHandle | None", async_op: bool, finish=None, finish_on_stream=False,
           keep=(), stream_reads=()):
    """Run ``program`` (a generator issuing rounds into ``works`` and yielding the receives it must
    wait for) as a transfer; return its handle when ``async_op``, else wait for it.

    ``finish`` runs once the operations are complete: in ``wait()``, or on the comm stream when
    ``finish_on_stream`` (and the stream has one: without, the caller's thread runs everything).
    ``stream_reads``: tensors of the caller's stream that the program reads on the comm stream
    (kept from the allocator until it has).
    """
    if start_after is not None:
        start_after.wait()
    stream_ordered = _stream_ordered(device, group)
    if stream_ordered:
        comm_stream = comm_stream if comm_stream is not None else torch.cuda.current_stream()
        comm_stream.wait_stream(torch.cuda.current_stream())  # see the caller's latest weights/grads
        for tensor in stream_reads:
            tensor.record_stream(comm_stream)
    on_host_stream = not stream_ordered and isinstance(comm_stream, HostCommStream)
    handle = TransferHandle(program, works, stream_ordered=stream_ordered, comm_stream=comm_stream,
                            finish=finish, finish_on_stream=finish_on_stream and (stream_ordered or on_host_stream),
                            keep=keep)
    if on_host_stream:
        handle._issuing = comm_stream.submit(handle._run_on_host_stream)
    else:
        handle._issue()
    if async_op:
        return handle
    handle.wait()
    return None


# Gloo matches point-to-point messages by (peer, tag). Transfers in flight together (waited in any
# order, so a relay's later rounds may be issued after another transfer's) must not share tags:
# the tag carries the transfer's sequence number on its group, which every rank advances in step
# (every rank takes part in every transfer). NCCL ignores tags and matches by issue order.
_TAG_BITS = 20
_SEQUENCES = 1 << (31 - _TAG_BITS)  # tags stay within a C int
_next_sequence: dict[int, int] = {}  # id(process group) -> next transfer's sequence number
_sequence_lock = threading.Lock()  # a HostCommStream's thread and the caller's may both take one


def _tag_parts(schedule: TransferSchedule, tensors_per_expert: int) -> int:
    """Messages one edge may carry in a transfer: its chunks (relayed), or one per expert tensor
    (direct)."""
    return max(schedule.num_chunks, tensors_per_expert)


def _take_sequence(group, schedule: TransferSchedule, tensors_per_expert: int, sequence: int | None = None) -> int:
    """The transfer's sequence number on ``group``: the next one, or ``sequence`` when the caller
    took it already (:meth:`ReplicaBuffer._on_host_stream`, at the call, in call order)."""
    if sequence is not None:
        return sequence
    _check_tag_space(schedule, tensors_per_expert)
    return _next_sequence_on(group)


def _check_tag_space(schedule: TransferSchedule, tensors_per_expert: int) -> None:
    parts = _tag_parts(schedule, tensors_per_expert)
    if schedule.num_edges * parts >= 1 << _TAG_BITS:
        raise ValueError(f"a schedule of {schedule.num_edges} edges x {parts} messages needs "
                         f"more than 2**{_TAG_BITS} message tags; raise the chunk size")


def _next_sequence_on(group) -> int:
    key = id(group if group is not None else dist.group.WORLD)
    with _sequence_lock:
        sequence = _next_sequence.get(key, 0)
        _next_sequence[key] = (sequence + 1) % _SEQUENCES
    return sequence


def _tag(sequence: int, edge: Edge, part: int, parts: int) -> int:
    """Unique among the transfers in flight on a group: message ``part`` (a chunk, or an expert
    tensor) of ``edge``, ``parts`` (:func:`_tag_parts`) per edge."""
    return (sequence << _TAG_BITS) | (edge.index * parts + part)


def _whole_expert_ops(op, tensors: Sequence[torch.Tensor], peer: int, edge: Edge, sequence: int, parts: int,
                      group) -> list[dist.P2POp]:
    """A direct edge's operations (``op``: ``dist.isend`` or ``dist.irecv``): one per expert tensor."""
    return [dist.P2POp(op, tensor, group=group, group_peer=peer, tag=_tag(sequence, edge, k, parts))
            for k, tensor in enumerate(tensors)]


def _distribution_rounds(schedule: TransferSchedule, rank: int, sequence: int, sources: dict, packed: dict,
                         mine: RankTransfers, replica_weights: torch.Tensor, shapes: Sequence[torch.Size],
                         group, works: list):
    """Issue the distribution's rounds into ``works``; yields the receives a relay must have before
    it forwards their chunks.

    A direct edge (depth 1) is one message per expert tensor in round 0, from ``sources[e]`` (the
    main expert's tensors) into views of the replica slot. A relayed expert's edges move chunks of
    its flat row: the home's from ``packed[e]``, a relay's from its own replica slot."""
    edges = mine.edges
    parts = _tag_parts(schedule, len(shapes))
    inbound = {edge.expert: edge.index for edge in edges if edge.hop == 1 and edge.dst == rank}
    arrived: dict[tuple[int, int], _WaitOnce] = {}  # (edge index, chunk) -> receive, relays only
    for round_ in range(schedule.num_rounds):
        ops, received, dependencies = [], [], []
        for edge in edges:
            if edge.depth == 1:  # direct: the whole expert in round 0, straight from its tensors
                if round_ == 0:
                    whole = (_whole_expert_ops(dist.isend, sources[edge.expert], edge.dst, edge, sequence, parts, group)
                             if edge.src == rank else
                             _whole_expert_ops(dist.irecv, expert_views(replica_weights[edge.dst_slot], shapes),
                                               edge.src, edge, sequence, parts, group))
                    ops += whole
                    received += [None] * len(whole)
                continue
            chunks = schedule.edge_chunks(edge.depth)
            chunk = round_ - (edge.hop - 1)
            if not 0 <= chunk < len(chunks):
                continue
            start, end = chunks[chunk]
            tag = _tag(sequence, edge, chunk, parts)
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
        round_works = _launch(ops)
        for key, work in zip(received, round_works):
            if key is not None:
                arrived[key] = work
        works.extend(round_works)


@torch.no_grad()  # pure data movement: parameters may require grad, the buffers never track it
def distribute_weights(
    schedule: TransferSchedule,
    main_weights: ExpertTensors,
    replica_weights: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    async_op: bool = False,
    start_after: TransferHandle | None = None,
    comm_stream=None,
    _sequence: int | None = None,
) -> TransferHandle | None:
    """Copy every replicated main expert into its replica slots (bit-identical). Collective.

    Args:
        schedule: from :func:`build_schedule` on the same plan on every rank.
        main_weights: this rank's ``E // R`` main experts, each a sequence of tensors (e.g.
            ``[linear_fc1.weight, linear_fc2.weight]``), in local-expert order.
        replica_weights: ``[num_slots, expert_numel]`` contiguous, same dtype as ``main_weights``;
            slots hosting a replica are overwritten, other slots are left alone.
        group: the process group of the EP ranks (default: the world).
        async_op: return a :class:`TransferHandle` instead of waiting. The main weights and the
            slots being written must not be modified, nor the slots read, before ``wait()``.
        start_after: a transfer this one must follow (it is waited for first).
        comm_stream: CUDA stream for NCCL transfers (default: the current stream, no overlap), or a
            :class:`HostCommStream` for CPU transfers (default: the caller's thread).

    Raises:
        ValueError: on inputs that do not match the schedule, before any communication.
    """
    rank, world_size = _group_rank(group)
    _check_schedule(schedule, world_size)
    _check_buffer("replica_weights", replica_weights, schedule)
    dtype = _check_experts("main_weights", main_weights, schedule, replica_weights.device)
    if dtype != replica_weights.dtype:
        raise ValueError(f"main_weights are {dtype} but replica_weights is {replica_weights.dtype}; a copy must not cast")

    mine = schedule.rank_transfers(rank)
    first_local = rank * schedule.experts_per_rank
    shapes = [t.shape for t in main_weights[0]]
    works: list = []
    sequence = _take_sequence(group, schedule, len(shapes), _sequence)

    def program():
        # On the transfer's stream. Only an expert streamed through a relay tree is packed (its
        # chunks cross tensor boundaries); direct edges send, and local copies read, the main
        # tensors themselves (a non-contiguous one is packed first: an operation needs dense memory).
        relayed = sorted({edge.expert for edge in mine.children if edge.depth == 2})
        packed = (dict(zip(relayed, pack_experts([main_weights[e - first_local] for e in relayed])))
                  if relayed else {})
        sources = {}
        for edge in mine.children:
            if edge.depth == 1 and edge.expert not in sources:
                tensors = main_weights[edge.expert - first_local]
                if not all(t.is_contiguous() for t in tensors):
                    tensors = expert_views(pack_experts([tensors])[0], shapes)
                sources[edge.expert] = tensors
        for e, slot in mine.local_copies:
            for view, tensor in zip(expert_views(replica_weights[slot], shapes), main_weights[e - first_local]):
                view.copy_(tensor)
        keep.extend([packed, sources])
        yield from _distribution_rounds(schedule, rank, sequence, sources, packed, mine, replica_weights,
                                        shapes, group, works)

    keep: list = [replica_weights]
    return _start(program(), works, device=replica_weights.device, group=group,
                  comm_stream=comm_stream, start_after=start_after, async_op=async_op, keep=keep)


@torch.no_grad()  # pure data movement: parameters may require grad, the buffers never track it
def reduce_gradients(
    schedule: TransferSchedule,
    main_grads: ExpertTensors,
    replica_grads: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    async_op: bool = False,
    start_after: TransferHandle | None = None,
    comm_stream=None,
    hosted_grads: Mapping[int, Sequence[torch.Tensor] | None] | None = None,
    fold_on_stream: bool = False,
    _sequence: int | None = None,
) -> TransferHandle | None:
    """Add every replica's gradient into its main expert's gradient. Collective.

    Reads the slots of ``replica_grads`` that host a replica on this rank
    (``schedule.rank_transfers(rank).hosted_slots``), which hold those replicas' gradients: written
    by the caller beforehand, or by the transfer itself from ``hosted_grads``; a relay also adds its
    leaves' gradients into its own slot, in place, before forwarding the partial sums. Other slots
    are neither read nor written.

    Args:
        schedule: the schedule used for the weight distribution of this layer.
        main_grads: this rank's ``E // R`` main-expert gradients (e.g. ``param.main_grad`` fp32 views
            or ``param.grad``), each a sequence of tensors, same layout as the main weights.
        replica_grads: ``[num_slots, expert_numel]`` contiguous floating tensor (typically fp32);
            communicated in its own dtype.
        group: the process group of the EP ranks (default: the world).
        async_op: return a :class:`TransferHandle` instead of waiting. Without ``fold_on_stream``
            the main gradients are read and written only inside ``wait()`` (on the caller's stream),
            so the caller may keep writing them until then; ``replica_grads`` must not be touched
            before ``wait()``, nor another reduction on it started.
        start_after: a transfer this one must follow (it is waited for first).
        comm_stream: CUDA stream for NCCL transfers (default: the current stream, no overlap), or a
            :class:`HostCommStream` for CPU transfers (default: the caller's thread).
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
    rank, world_size = _group_rank(group)
    _check_schedule(schedule, world_size)
    _check_buffer("replica_grads", replica_grads, schedule)
    if not replica_grads.is_floating_point():
        raise ValueError(f"replica_grads must be floating point, got {replica_grads.dtype}")
    main_dtype = _check_experts("main_grads", main_grads, schedule, replica_grads.device)
    if not main_dtype.is_floating_point:
        raise ValueError(f"main_grads must be floating point, got {main_dtype}")
    acc_dtype = torch.promote_types(main_dtype, replica_grads.dtype)

    mine = schedule.rank_transfers(rank)
    edges, local, children, staging_row = mine.edges, mine.local_copies, mine.children, mine.staging_row
    reduced_here = mine.replicated_experts
    first_local = rank * schedule.experts_per_rank
    shapes = [g.shape for g in main_grads[0]]
    stream_reads = (_check_hosted_grads(hosted_grads, mine.hosted_slots, shapes, replica_grads.device)
                    if hosted_grads is not None else [])
    works: list = []
    parts = _tag_parts(schedule, len(shapes))
    sequence = _take_sequence(group, schedule, len(shapes), _sequence)
    staging = torch.empty(len(children), schedule.expert_numel if children else 0,
                          dtype=replica_grads.dtype, device=replica_grads.device)

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
                if grad is not None and slot in direct and grad.dtype == replica_grads.dtype and grad.is_contiguous():
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
                        whole = (_whole_expert_ops(dist.isend, sources[edge.dst_slot], edge.src, edge, sequence,
                                                   parts, group)
                                 if edge.dst == rank else
                                 _whole_expert_ops(dist.irecv, expert_views(staging[staging_row[edge.index]], shapes),
                                                   edge.dst, edge, sequence, parts, group))
                        ops += whole
                        targets += [None] * len(whole)
                    continue
                chunks = schedule.edge_chunks(edge.depth)
                chunk = round_ - (edge.depth - edge.hop)
                if 0 <= chunk < len(chunks):
                    active.append((edge, chunk, *chunks[chunk]))
            relay_numel = sum(end - start for edge, _, start, end in active if edge.src == rank and edge.hop == 2)
            relay_staging = torch.empty(relay_numel, dtype=replica_grads.dtype, device=replica_grads.device)
            offset = 0
            for edge, chunk, start, end in active:
                tag = _tag(sequence, edge, chunk, parts)
                if edge.dst == rank:  # gradients flow dst -> src
                    ops.append(dist.P2POp(dist.isend, replica_grads[edge.dst_slot, start:end],
                                          group=group, group_peer=edge.src, tag=tag))
                    targets.append(None)
                elif edge.hop == 2:  # a leaf's gradient for this relay's own replica gradient
                    staged = relay_staging[offset : offset + end - start]
                    offset += end - start
                    ops.append(dist.P2POp(dist.irecv, staged, group=group, group_peer=edge.dst, tag=tag))
                    targets.append((staged, replica_grads[edge.src_slot, start:end]))
                else:  # a child's gradient, folded into the main gradient in wait()
                    staged = staging[staging_row[edge.index], start:end]
                    ops.append(dist.P2POp(dist.irecv, staged, group=group, group_peer=edge.dst, tag=tag))
                    targets.append(None)
            round_works = _launch(ops)
            pending = [(work, *target) for work, target in zip(round_works, targets) if target is not None]
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
            _unpack_into([main_grads[e - first_local] for e in reduced_here], acc)

    return _start(program(), works, device=replica_grads.device, group=group,
                  comm_stream=comm_stream, start_after=start_after, async_op=async_op,
                  finish=fold_into_main_grads, finish_on_stream=fold_on_stream,
                  keep=(staging, replica_grads, *stream_reads), stream_reads=stream_reads)


def _check_hosted_grads(hosted_grads, hosted_slots: tuple, shapes, device: torch.device) -> list[torch.Tensor]:
    """``hosted_grads`` names exactly the hosted slots, each with ``None`` or one tensor (or
    ``None``) per expert tensor: of its shape, dense, floating point, on the buffer's device (what
    the copy on the transfer's stream needs: it runs after the peers may have started); returns
    those tensors."""
    if sorted(hosted_grads) != list(hosted_slots):
        raise ValueError(f"hosted_grads has slots {sorted(hosted_grads)}, this rank hosts {list(hosted_slots)}")
    tensors = []
    for slot, grads in hosted_grads.items():
        if grads is None:
            continue
        if len(grads) != len(shapes) or any(
                g is not None and (not isinstance(g, torch.Tensor) or g.shape != shape or g.layout != torch.strided
                                   or not g.is_floating_point() or g.device != device)
                for g, shape in zip(grads, shapes)):
            raise ValueError(f"hosted_grads[{slot}] must be {len(shapes)} dense floating tensors on {device} of "
                             f"shapes {[tuple(s) for s in shapes]} (or None)")
        tensors += [g for g in grads if g is not None]
    return tensors


class ReplicaBuffer:
    """Replica state shared by all MoE layers of a model, plus the transfers that fill and drain it.

    Owns ``replica_weights`` ``[num_slots, expert_numel]`` (weight dtype) and ``replica_grads``
    ``[num_slots, expert_numel]`` (grad dtype, each hosted slot written by the caller before a
    reduction), and the stream its transfers run
    on (on CUDA a stream of its own, on the CPU a :class:`HostCommStream`). Typical use per MoE layer::

        schedule = buffer.schedule(plan.slot_expert, num_experts)            # once per plan
        handle = buffer.distribute_weights(schedule, main_weights, async_op=True)   # forward
        ...                                                                  # other work
        handle.wait(); ...                                                   # replica compute
        buffer.replica_grads[s].copy_(...)                                   # each hosted slot
        buffer.reduce_gradients(schedule, main_grads)                        # backward

    Building it is collective over ``group``: it runs one small all-reduce there, so that the
    group's communicator exists before the first batched point-to-point call (NCCL requires every
    rank of a lazily created communicator to take part in the first batched P2P call, which a
    schedule does not guarantee: ranks without edges skip a round).
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
        self._schedules: OrderedDict[tuple, TransferSchedule] = OrderedDict()
        self._checked_schedules: "weakref.WeakSet[TransferSchedule]" = weakref.WeakSet()
        self.replica_weights = torch.zeros(num_slots, self.expert_numel, dtype=weight_dtype, device=device)
        self.replica_grads = torch.zeros(num_slots, self.expert_numel, dtype=grad_dtype, device=device)
        on_cuda = self.replica_weights.is_cuda
        self.comm_stream = torch.cuda.Stream(device=self.replica_weights.device) if on_cuda else HostCommStream()
        if dist.is_initialized():
            dist.all_reduce(torch.zeros(1, device=self.replica_weights.device), group=group)

    @property
    def num_slots(self) -> int:
        return self.replica_weights.shape[0]

    #: Schedules kept per placement: hot experts stay hot for many microbatches and layers, so the
    #: same ``slot_expert`` recurs, and a schedule (immutable) is rebuilt in ~0.3 ms of host time.
    SCHEDULE_CACHE_SIZE = 256

    def schedule(self, slot_expert: torch.Tensor, num_experts: int) -> TransferSchedule:
        """The transfer schedule of a plan (pure computation, identical on every rank); the
        schedules of the last ``SCHEDULE_CACHE_SIZE`` placements are reused."""
        if slot_expert.dim() == 2 and slot_expert.shape[1] != self.num_slots:
            raise ValueError(f"slot_expert has {slot_expert.shape[1]} slots per rank, the buffer {self.num_slots}")
        key = None
        if slot_expert.device.type == "cpu" and slot_expert.dtype == torch.int64 and slot_expert.dim() == 2:
            key = (tuple(slot_expert.shape), num_experts, self.chunk_numel, self.relay, self.relay_threshold,
                   slot_expert.numpy().tobytes())
            cached = self._schedules.get(key)
            if cached is not None:
                self._schedules.move_to_end(key)
                return cached
        schedule = build_schedule(
            slot_expert,
            num_experts,
            self.expert_numel,
            chunk_numel=self.chunk_numel,
            relay=self.relay,
            relay_threshold=self.relay_threshold,
        )
        if key is not None:
            self._schedules[key] = schedule
            if len(self._schedules) > self.SCHEDULE_CACHE_SIZE:
                self._schedules.popitem(last=False)
        return schedule

    def distribute_weights(self, schedule: TransferSchedule, main_weights: ExpertTensors, *,
                           async_op: bool = False,
                           start_after: TransferHandle | None = None) -> TransferHandle | None:
        """Fill the replica slots from the main experts; see :func:`distribute_weights`.

        On the CPU (a :class:`HostCommStream`) every call runs whole on the stream's thread, in the
        order of the calls: an asynchronous one returns once handed over, and its bad inputs raise
        in ``wait()`` (still before any communication)."""
        if isinstance(self.comm_stream, HostCommStream):
            sequence = self._take_sequence(schedule, start_after)
            return self._on_host_stream(lambda: _completed(distribute_weights(
                schedule, main_weights, self.replica_weights, self.group, async_op=True, _sequence=sequence),
                finish=True), async_op)
        return distribute_weights(schedule, main_weights, self.replica_weights, self.group,
                                  async_op=async_op, start_after=start_after,
                                  comm_stream=self.comm_stream)

    def reduce_gradients(self, schedule: TransferSchedule, main_grads: ExpertTensors, *,
                         async_op: bool = False, start_after: TransferHandle | None = None,
                         hosted_grads: Mapping[int, Sequence[torch.Tensor] | None] | None = None,
                         fold_on_stream: bool = False) -> TransferHandle | None:
        """Reduce the replica gradients into the main gradients; see :func:`reduce_gradients`.

        On the CPU every call runs whole on the stream's thread, as :meth:`distribute_weights`;
        without ``fold_on_stream`` the fold still waits for ``wait()``, on the caller's thread."""
        if isinstance(self.comm_stream, HostCommStream):
            sequence = self._take_sequence(schedule, start_after)
            return self._on_host_stream(lambda: _completed(reduce_gradients(
                schedule, main_grads, self.replica_grads, self.group, async_op=True,
                hosted_grads=hosted_grads, _sequence=sequence), finish=fold_on_stream), async_op)
        return reduce_gradients(schedule, main_grads, self.replica_grads, self.group,
                                async_op=async_op, start_after=start_after,
                                comm_stream=self.comm_stream, hosted_grads=hosted_grads,
                                fold_on_stream=fold_on_stream)

    def _take_sequence(self, schedule: TransferSchedule, start_after: TransferHandle | None) -> int:
        """Before handing a call to the HostCommStream: wait for ``start_after``, and take the
        transfer's message-tag sequence number here, at the call, so that every rank numbers its
        transfers on the group in call order, whichever thread issues them."""
        if start_after is not None:
            start_after.wait()
        if schedule not in self._checked_schedules:  # immutable, and recurring (the schedule cache)
            _check_schedule(schedule, _group_rank(self.group)[1])
            _check_tag_space(schedule, len(self.expert_shapes))
            self._checked_schedules.add(schedule)
        return _next_sequence_on(self.group)

    def _on_host_stream(self, call: Callable[[], TransferHandle], async_op: bool) -> TransferHandle | None:
        """Run a transfer's whole call on the buffer's HostCommStream (every transfer of the buffer
        goes through it, synchronous ones too). A reduction whose fold is left to ``wait()`` must be
        waited before the next reduction on the buffer starts (it reads the hosted slots then)."""
        handle = _HostStreamTransfer(self.comm_stream, call)
        if async_op:
            return handle
        handle.wait()
        return None

    def weight_views(self, slot: int) -> list[torch.Tensor]:
        """Views of replica slot ``slot`` shaped like one expert's tensors."""
        return self._views[0][slot]

    def grad_views(self, slot: int) -> list[torch.Tensor]:
        """Views of replica gradient slot ``slot`` shaped like one expert's tensors."""
        return self._views[1][slot]

    @functools.cached_property
    def _views(self) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        # Made once: the buffers live as long as this object, and every replica forward and
        # backward asks for them.
        return tuple([expert_views(buffer[s], self.expert_shapes) for s in range(self.num_slots)]
                     for buffer in (self.replica_weights, self.replica_grads))
