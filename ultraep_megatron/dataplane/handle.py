"""Transfer handles: where a transfer runs beside the caller, and how the caller waits for it.

Both transfers of a :class:`~.buffer.ReplicaBuffer` can run asynchronously (``async_op=True``)
and return a :class:`TransferHandle`, like DeepEP's buffer API: the caller keeps computing and calls
``handle.wait()`` where it needs the result; ``start_after`` orders a transfer after an earlier
one. Where the transfer runs depends on the backend, never its result (bit-identical either way):

* CUDA tensors over NCCL: everything is issued at once on a communication stream of its own, which
  first waits for the caller's stream; a relay's forward of a chunk waits on that chunk's receive
  through stream order, never on the host. ``wait()`` makes the caller's stream wait for an event.
* anything else (gloo on the CPU), with a :class:`~.host_stream.HostCommStream` (what
  :class:`~.buffer.ReplicaBuffer` uses): the CPU's stand-in for that communication stream, one
  thread that packs, issues and completes every transfer handed to it, in order, relay rounds after
  their receives; ``wait()`` waits for it. Without one, the caller issues the operations at once,
  except rounds in which a relay forwards data it must first receive; ``wait()`` issues those.

A transfer is a *program*: a generator that issues its rounds (:func:`launch_round`) into a list of
works and yields the receives its next round depends on (a relay's). The handle drives it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from .host_stream import HostCommStream, Completion

__all__ = ["HostStreamTransfer", "TransferHandle", "WaitOnce", "launch_round", "start_transfer"]


class WaitOnce:
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


def launch_round(ops: list[dist.P2POp]) -> list[WaitOnce]:
    """Issue one round as one batch; return one handle per op."""
    if not ops:
        return []
    works = [WaitOnce(w) for w in dist.batch_isend_irecv(ops)]
    if len(works) != len(ops):  # coalescing backend: one handle covers the whole batch
        works = [works[-1]] * len(ops)
    return works


class TransferHandle:
    """One weight distribution or gradient reduction in flight.

    Returned by :meth:`~.buffer.ReplicaBuffer.distribute_weights` and
    :meth:`~.buffer.ReplicaBuffer.reduce_gradients` with ``async_op=True``. ``wait()`` completes the
    transfer for the caller (see the module docstring for what that means per backend); a second
    ``wait()`` is a no-op; ``done()`` says whether ``wait()`` has returned.

    Read-only timing, for the caller's overhead accounting:
        host_seconds: wall time the calling thread spent issuing and waiting for this transfer. On
            the CPU (gloo) this is the transfer time the caller could not hide; on CUDA it is the
            host's issue cost only.
        host_cpu_seconds: CPU time of the calling thread in the same calls (packing, folding);
            ``host_seconds - host_cpu_seconds`` is the time it was blocked.
    """

    def __init__(
        self,
        program: Iterator[list],
        works: list,
        *,
        stream_ordered: bool,
        comm_stream=None,
        finish: Callable[[], None] | None = None,
        finish_on_stream: bool = False,
        keep=(),
    ):
        self._program: Iterator[list] | None = program
        self._issuing: Completion | None = None  # the HostCommStream running the transfer
        self._works = works
        self._stream_ordered = stream_ordered
        self._comm_stream = comm_stream
        self._finish = finish
        self._finish_on_stream = (
            finish_on_stream  # run ``finish`` on the comm stream, not in wait()
        )
        self._pending: list = []  # receives the program's next round depends on
        self._keep = keep  # tensors the operations in flight read or write
        self._event = None
        self._done = False
        self._host_seconds = self._host_cpu_seconds = 0.0

    def done(self) -> bool:
        """True once ``wait()`` returned."""
        return self._done

    @property
    def host_seconds(self) -> float:
        return self._host_seconds

    @property
    def host_cpu_seconds(self) -> float:
        return self._host_cpu_seconds

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
        self._host_seconds += time.perf_counter() - t0
        self._host_cpu_seconds += time.thread_time() - c0

    def _begin(self, host_stream: HostCommStream | None) -> None:
        """Start the transfer: whole on ``host_stream``'s thread, or issued from this thread."""
        if host_stream is not None:
            self._issuing = host_stream.submit(self._run_on_host_stream)
        else:
            self._issue()

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
        self._host_seconds += time.perf_counter() - t0
        self._host_cpu_seconds += time.thread_time() - c0

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

    def complete(self, finish: bool) -> "TransferHandle":
        """This transfer (issued without a comm stream) with its operations complete, and its
        ``finish`` too when asked; for the thread that runs a whole transfer
        (:class:`HostStreamTransfer`), whose caller's ``wait()`` does the rest."""
        if finish:
            self.wait()
        else:
            self._complete_operations()
        return self


class HostStreamTransfer(TransferHandle):
    """A transfer whose whole call runs on a :class:`HostCommStream`'s thread: its checks, schedule
    lookups, packing and issuing, and the wait for its operations, so that the caller's thread only
    hands it over (every :meth:`~.buffer.ReplicaBuffer.distribute_weights` /
    :meth:`~.buffer.ReplicaBuffer.reduce_gradients` on the CPU). ``call`` returns the transfer's own
    handle, its operations complete; ``wait()`` waits for the thread, then completes that handle (a
    fold left to the caller). A failed transfer raises in its first ``wait()`` only."""

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
        self._host_seconds += time.perf_counter() - t0
        self._host_cpu_seconds += time.thread_time() - c0


def _stream_ordered(device: torch.device, group) -> bool:
    """Whether a transfer runs on a CUDA stream (NCCL's operations are stream-ordered), rather than
    being completed by a host thread (gloo's)."""
    return device.type == "cuda" and dist.get_backend(group) == "nccl"


def start_transfer(
    program: Iterator[list],
    works: list,
    *,
    device: torch.device,
    group,
    comm_stream,
    start_after: TransferHandle | None,
    async_op: bool,
    finish=None,
    finish_on_stream=False,
    keep=(),
    stream_reads=(),
) -> TransferHandle | None:
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
        comm_stream.wait_stream(
            torch.cuda.current_stream()
        )  # see the caller's latest weights/grads
        for tensor in stream_reads:
            tensor.record_stream(comm_stream)
    on_host_stream = not stream_ordered and isinstance(comm_stream, HostCommStream)
    handle = TransferHandle(
        program,
        works,
        stream_ordered=stream_ordered,
        comm_stream=comm_stream,
        finish=finish,
        finish_on_stream=finish_on_stream and (stream_ordered or on_host_stream),
        keep=keep,
    )
    handle._begin(comm_stream if on_host_stream else None)
    if async_op:
        return handle
    handle.wait()
    return None
