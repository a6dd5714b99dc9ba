"""The virtual-layer-ID ring (paper §7): each in-flight MoE invocation in a ring slot from its
forward to its backward, sized from the pipeline schedule; full is an error, never a reuse.
Recompute replays pop parked ids per layer FIFO across model forwards, LIFO within one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional


class RingFullError(RuntimeError):
    """Raised when an MoE forward needs a ring slot while every slot is still live."""


@dataclass
class RingEntry:
    """One ring slot: the MoE layer's number, the slot's ``generation`` (bumped at every reuse, so
    a stale id is detected) and the ``payload`` (the invocation)."""

    layer: int
    generation: int
    payload: Any


@dataclass
class _ParkedForward:
    """The parked runs of one layer in one model forward: ``ids`` not yet replayed, ``parked`` runs
    in all (the forward is complete at ``runs_per_forward``, however many were replayed since)."""

    ids: List[int] = field(default_factory=list)
    parked: int = 0


@dataclass
class VirtualLayerRing:
    """Table of ``capacity`` slots of in-flight MoE invocations, indexed by virtual layer id."""

    capacity: int
    _entries: List[Optional[RingEntry]] = field(init=False)
    _generations: List[int] = field(init=False)
    _next: int = field(init=False, default=0)
    # layer -> its model forwards with parked runs, oldest first.
    _parked_forwards: Dict[int, Deque[_ParkedForward]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"ring capacity must be >= 1, got {self.capacity}")
        self._entries = [None] * self.capacity
        self._generations = [0] * self.capacity

    @property
    def live(self) -> int:
        """Number of slots currently holding an in-flight invocation."""
        return sum(e is not None for e in self._entries)

    def acquire(self, layer: int) -> int:
        """Take a slot for a new invocation of ``layer`` (its payload is stored with :meth:`store`);
        return its virtual layer id."""
        for step in range(self.capacity):
            slot = (self._next + step) % self.capacity
            if self._entries[slot] is None:
                self._generations[slot] += 1
                self._entries[slot] = RingEntry(layer, self._generations[slot], None)
                self._next = (slot + 1) % self.capacity
                return slot * (1 << 32) + self._generations[slot]
        layers = sorted({e.layer for e in self._entries if e is not None})
        raise RingFullError(
            f"UltraEP virtual-layer ring is full ({self.capacity} in-flight MoE invocations, "
            f"layers {layers}): more microbatches are in flight than the pipeline schedule allows, "
            "or forward passes ran in training mode without a backward. Raise the ring size with "
            "--moe-balancer-ring-size, or run forward-only passes with model.eval()."
        )

    def _slot(self, vid: int) -> RingEntry:
        slot, generation = divmod(vid, 1 << 32)
        entry = self._entries[slot] if 0 <= slot < self.capacity else None
        if entry is None or entry.generation != generation:
            raise KeyError(f"virtual layer id {vid} is not live (released or overwritten)")
        return entry

    def get(self, vid: int) -> Any:
        """The payload stored under ``vid``."""
        return self._slot(vid).payload

    def store(self, vid: int, payload: Any) -> None:
        """Set the payload of the live slot ``vid``."""
        self._slot(vid).payload = payload

    def release(self, vid: int) -> None:
        """Free the slot of ``vid`` (after its backward)."""
        self._slot(vid)
        self._entries[vid >> 32] = None

    # Activation recompute -------------------------------------------------------------------
    def park_for_recompute(self, layer: int, vid: int, runs_per_forward: int = 1) -> None:
        """Remember that ``vid``'s forward ran without autograd and will be replayed.
        ``runs_per_forward``: how many times one model forward runs ``layer`` (its parks are grouped
        by model forward)."""
        forwards = self._parked_forwards.setdefault(layer, deque())
        if not forwards or forwards[-1].parked == runs_per_forward:
            forwards.append(_ParkedForward())
        forwards[-1].ids.append(vid)
        forwards[-1].parked += 1

    def pop_for_recompute(self, layer: int) -> int:
        """The id of the forward of ``layer`` to replay now: from the oldest model forward, its
        latest run (runs of one forward are replayed in reverse)."""
        forwards = self._parked_forwards.get(layer)
        if not forwards:
            raise RuntimeError(
                f"MoE layer {layer} is being recomputed but no checkpointed forward of it is "
                "pending"
            )
        vid = forwards[0].ids.pop()
        if not forwards[0].ids:
            forwards.popleft()
        return vid


def max_inflight_microbatches(
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    vpp_size: Optional[int] = None,
    overlapped: bool = False,
) -> int:
    """Most forward passes of one model chunk whose backward has not run yet, per pipeline schedule:
    1F1B ``pp_size - pp_rank``; interleaved, megatron's warm-up over all chunks plus one (at most
    ``vpp_size`` times too many); ``overlapped`` (combined 1F1B) one more; at most the microbatches.
    """
    extra = 1 if overlapped else 0
    if pp_size <= 1:
        return min(1 + extra, max(num_microbatches, 1))
    if vpp_size is None or vpp_size <= 1:
        return min(pp_size - pp_rank + extra, num_microbatches)
    warmup = (pp_size - pp_rank - 1) * 2 + (vpp_size - 1) * pp_size + extra
    return min(warmup + 1, num_microbatches)


def invocations_per_forward(layer) -> int:
    """How many times one forward of the model runs MoE ``layer``: the MTP block's shared layer
    (``--mtp-use-repeated-layer``) runs once per MTP depth, every other layer once."""
    config = layer.config
    if getattr(layer, "is_mtp_layer", False) and getattr(config, "mtp_use_repeated_layer", False):
        return config.mtp_num_layers
    return 1


def schedule_inflight_microbatches(overlapped: bool = False) -> int:
    """Max in-flight microbatches per MoE layer on this rank, from Megatron's pipeline state
    (``overlapped``: megatron's combined 1F1B schedule)."""
    try:
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        return max_inflight_microbatches(
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank(),
            get_num_microbatches(),
            ps.get_virtual_pipeline_model_parallel_world_size(),
            overlapped=overlapped,
        )
    except Exception:  # outside Megatron's training loop (a bare MoE layer): one microbatch
        return 2 if overlapped else 1


def overlapped_schedule(config) -> bool:
    """Whether megatron runs the layer in its overlapped 1F1B schedule
    (``--overlap-moe-expert-parallel-comm``, ``pipeline_parallel/combined_1f1b.py``): each layer cut
    into nodes (attention and pre-dispatch, dispatch, experts, combine) and one microbatch's forward
    interleaved with another's backward, on a computation and a communication stream."""
    return bool(getattr(config, "overlap_moe_expert_parallel_comm", False))
