"""``torch.cuda`` stand-ins with their CPU meaning: :data:`TORCH_CUDA_PATCHES`, applied by
:func:`~.backend.activate`.

Only functions that raise (or silently do nothing) without a device are replaced;
``is_available()`` / ``device_count()`` stay truthful.
"""

from __future__ import annotations

from typing import Any

import torch


class CpuEvent:
    """A CUDA event on a device whose work is always complete when the host reaches it."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass

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
        pass

    def query(self) -> bool:
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
    "current_device": (lambda: 0, "Megatron allocates on device=current_device(); ordinal 0 maps to the CPU"),
    "set_device": (noop, "rank-to-GPU binding has no CPU meaning"),
    "Stream": (CpuStream, "the alltoall dispatcher, DDP and shared experts build side streams; CPU ops run in order"),
    "Event": (CpuEvent, "stream events order work that the CPU already runs in order"),
    "current_stream": (_current_stream, "callers compare and wait on streams; one CPU stream"),
    "default_stream": (_current_stream, "callers compare and wait on streams; one CPU stream"),
    "stream": (_StreamContext, "side-stream scopes are no-ops on the CPU"),
    "set_stream": (noop, "side-stream selection is a no-op on the CPU"),
    "synchronize": (noop, "CPU work is complete when the host reaches the call"),
    "empty_cache": (noop, "no caching allocator to release on the CPU"),
    "get_rng_state": (cpu_get_rng_state, "the CUDA generator is the CPU generator (dropout on CPU draws from it)"),
    "set_rng_state": (_cpu_set_rng_state, "the CUDA generator is the CPU generator (checkpoint resume restores it)"),
    "manual_seed": (_cpu_manual_seed, "the CUDA generator is the CPU generator (seeded by Megatron's RNG set-up)"),
    "memory_allocated": (_zero, "memory reports read CUDA allocator counters; the CPU has none"),
    "max_memory_allocated": (_zero, "memory reports read CUDA allocator counters; the CPU has none"),
    "memory_reserved": (_zero, "memory reports read CUDA allocator counters; the CPU has none"),
    "max_memory_reserved": (_zero, "memory reports read CUDA allocator counters; the CPU has none"),
    "reset_peak_memory_stats": (noop, "memory reports read CUDA allocator counters; the CPU has none"),
    "memory_stats": (lambda *a, **k: {}, "memory reports read CUDA allocator counters; the CPU has none"),
    "is_current_stream_capturing": (lambda: False, "megatron's router tracer (--moe-routing-trace-path) skips CUDA-graph capture; the CPU never captures"),
}
