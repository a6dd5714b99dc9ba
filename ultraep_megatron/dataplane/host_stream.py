"""The CPU's stand-in for a CUDA communication stream (:class:`HostCommStream`).

Over gloo the caller's thread does an operation's work itself (a send copies the data into the
socket; a packed expert is a copy), which on a GPU the communication stream and the copy engines do
beside the compute. A :class:`HostCommStream` is one thread that packs, issues and completes every
transfer handed to it, in order, relay rounds after their receives, while the caller computes; a
transfer handle's ``wait()`` waits for it.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable

__all__ = ["Completion", "HostCommStream"]


class HostCommStream:
    """The CPU's stand-in for a CUDA communication stream: one thread that runs the transfers handed
    to it (packing, every point-to-point operation, a relay's later rounds), in the order they were
    handed over, while the caller computes.

    Every rank hands its transfers over in the same order, so one thread per buffer keeps the order
    NCCL needs; folds into the main gradients stay on the caller's thread (``wait()``), as on CUDA
    on the caller's stream, unless a reduction asks for them on the stream (``fold_on_stream``).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, issue: Callable[[], object]) -> "Completion":
        """Run ``issue`` after everything submitted before it; ``result()`` of what this returns
        waits for it and re-raises what it raised."""
        if self._thread is None:
            # A daemon: a transfer a failed rank abandoned must not hold the process at exit. It
            # holds only the queue, and ends once this stream is collected.
            self._thread = threading.Thread(
                target=_serve, args=(self._queue,), name="ultraep-comm", daemon=True
            )
            self._thread.start()
            weakref.finalize(self, self._queue.put, None)
        completion = Completion()
        self._queue.put((issue, completion))
        return completion


class Completion:
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
