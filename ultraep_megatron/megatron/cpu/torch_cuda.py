"""``torch.cuda`` stand-ins with their CPU meaning: :data:`TORCH_CUDA_PATCHES`, applied by
:func:`~.backend.activate`.

Only functions that raise (or silently do nothing) without a device are replaced;
``is_available()`` / ``device_count()`` stay truthful.

Stream capture: a CUDA-graph stand-in marks the stretch it captures with :func:`stream_capture`.
Inside it, as on a capturing CUDA stream, waiting on the host (``synchronize`` of the device, a
stream or an event) and polling (``query``) raise, and ``is_current_stream_capturing()`` is True;
recording an event and making a stream wait for one or for another stream are allowed (a graph
captures them as dependencies).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

_CAPTURES = (
    0  # stream captures open in this process (a stand-in graph's capture; nested ones count)
)


@contextlib.contextmanager
def stream_capture():
    """The stretch a CUDA-graph stand-in captures (see the module docstring)."""
    global _CAPTURES
    _CAPTURES += 1
    try:
        yield
    finally:
        _CAPTURES -= 1


def is_capturing() -> bool:
    """Whether a :func:`stream_capture` is open (``torch.cuda.is_current_stream_capturing``)."""
    return _CAPTURES > 0


def refuse_in_capture(what: str) -> None:
    """Raise as CUDA does for a host wait or poll on a capturing stream."""
    if _CAPTURES:
        raise RuntimeError(
            f"{what}: operation not permitted when stream is capturing (a CUDA graph "
            "cannot capture a host wait for the device)"
        )


class CpuEvent:
    """A CUDA event on a device whose work is always complete when the host reaches it."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        refuse_in_capture("torch.cuda.Event.query")
        return True

    def synchronize(self):
        refuse_in_capture("torch.cuda.Event.synchronize")

    def elapsed_time(self, end_event) -> float:
        return 0.0


class CpuStream:
    """A CUDA stream on a device that executes every op synchronously, in program order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else CpuEvent()

    def synchronize(self):
        refuse_in_capture("torch.cuda.Stream.synchronize")

    def query(self) -> bool:
        refuse_in_capture("torch.cuda.Stream.query")
        return True


_DEFAULT_STREAM = CpuStream()


def _current_stream(device=None) -> CpuStream:
    return _DEFAULT_STREAM


class _StreamContext:
    """``torch.cuda.stream(s)``: a no-op scope that, like ``torch.cuda.StreamContext``, can be
    entered more than once (megatron's DDP enters one twice with several distributed-optimizer
    instances)."""

    def __init__(self, stream=None):
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc):
        return False


def noop(*args, **kwargs):
    return None


def record_stream_patch(original):
    """``Tensor.record_stream`` that accepts the CPU stand-in streams.

    On CUDA it tells the caching allocator that another stream still uses the tensor, so that its
    memory is not reused before that stream's queued work is done (megatron's overlapped schedule
    calls it on every input a node frees early, and on every gradient that crossed streams). On the
    CPU every operation is complete when the host issues the next one, so a tensor the host frees
    has no pending reader on any stream: nothing to record. Real streams keep torch's behaviour."""

    def record_stream(self, stream):
        if isinstance(stream, CpuStream):
            return None
        return original(self, stream)

    record_stream.__wrapped__ = original
    return record_stream


def _synchronize(*args, **kwargs) -> None:
    refuse_in_capture("torch.cuda.synchronize")


def _zero(*args, **kwargs) -> int:
    return 0


def cpu_get_rng_state(device="cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device="cuda", *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all (left unpatched: a lazy no-op).
    torch.default_generator.manual_seed(int(seed))


#: torch.cuda attribute -> (replacement, reason).
TORCH_CUDA_PATCHES: dict[str, tuple[Any, str]] = {
    "current_device": (
        lambda: 0,
        "Megatron allocates on device=current_device(); ordinal 0 maps to the CPU",
    ),
    "set_device": (noop, "rank-to-GPU binding has no CPU meaning"),
    "Stream": (
        CpuStream,
        "the alltoall dispatcher, DDP and shared experts build side streams; CPU ops run in order",
    ),
    "Event": (CpuEvent, "stream events order work that the CPU already runs in order"),
    "current_stream": (_current_stream, "callers compare and wait on streams; one CPU stream"),
    "default_stream": (_current_stream, "callers compare and wait on streams; one CPU stream"),
    "stream": (_StreamContext, "side-stream scopes are no-ops on the CPU"),
    "set_stream": (noop, "side-stream selection is a no-op on the CPU"),
    "synchronize": (
        _synchronize,
        "CPU work is complete when the host reaches the call (refused inside a "
        "stand-in graph's capture, as on CUDA)",
    ),
    "empty_cache": (noop, "no caching allocator to release on the CPU"),
    "get_rng_state": (
        cpu_get_rng_state,
        "the CUDA generator is the CPU generator (dropout on CPU draws from it)",
    ),
    "set_rng_state": (
        _cpu_set_rng_state,
        "the CUDA generator is the CPU generator (checkpoint resume restores it)",
    ),
    "manual_seed": (
        _cpu_manual_seed,
        "the CUDA generator is the CPU generator (seeded by Megatron's RNG set-up)",
    ),
    "memory_allocated": (_zero, "memory reports read CUDA allocator counters; the CPU has none"),
    "max_memory_allocated": (
        _zero,
        "memory reports read CUDA allocator counters; the CPU has none",
    ),
    "memory_reserved": (_zero, "memory reports read CUDA allocator counters; the CPU has none"),
    "max_memory_reserved": (_zero, "memory reports read CUDA allocator counters; the CPU has none"),
    "reset_peak_memory_stats": (
        noop,
        "memory reports read CUDA allocator counters; the CPU has none",
    ),
    "memory_stats": (
        lambda *a, **k: {},
        "memory reports read CUDA allocator counters; the CPU has none",
    ),
    "is_current_stream_capturing": (
        is_capturing,
        "megatron's router tracer (--moe-routing-trace-path) skips "
        "CUDA-graph capture; True only inside a stand-in graph's capture",
    ),
}
