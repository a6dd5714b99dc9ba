"""The data plane's one object: :class:`ReplicaBuffer`, the replica state shared by all MoE layers of
a model, and the two transfers that fill and drain it. Both are collective over the
expert-parallel group (every rank calls them with the same schedule, which every rank built from
the same plan; no extra synchronization is exchanged):

* :meth:`ReplicaBuffer.distribute_weights` (:mod:`.distribute`): copy each replicated main expert
  into the replica slots of its hosts (forward, and again in backward to re-materialize the shared
  replica buffer).
* :meth:`ReplicaBuffer.reduce_gradients` (:mod:`.reduce`): add every replica's gradient into its
  main expert's gradient.

Like DeepEP's ``Buffer``, the buffer owns all communication state: the replica buffers, the stream
its transfers run on (:mod:`.handle`), and the sequence numbering its transfers' message tags
(:mod:`.tags`). Each transfer takes ``start_after`` and returns a :class:`~.handle.TransferHandle`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from . import distribute, reduce
from .checks import check_schedule, group_rank
from .handle import HostStreamTransfer, TransferHandle
from .host_stream import HostCommStream
from .pack import ExpertTensors, expert_views
from .schedule import DEFAULT_CHUNK_NUMEL, DEFAULT_RELAY_THRESHOLD, ScheduleCache, TransferSchedule
from .tags import TagSequence, check_tag_space

__all__ = ["ReplicaBuffer"]


class ReplicaBuffer:
    """Replica state shared by all MoE layers of a model, plus the transfers that fill and drain it.

    Owns ``replica_weights`` ``[num_slots, weight_numel]`` (weight dtype) and ``replica_grads``
    ``[num_slots, expert_numel]`` (grad dtype, each hosted slot written by the caller before a
    reduction), and the stream its transfers run on, ``comm_stream`` (on CUDA a stream of its own,
    on the CPU a :class:`HostCommStream`; ``None``: issued from the caller's thread). Typical use per
    MoE layer::

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

    The weights may have a layout of their own (``weight_shapes``, e.g. the bytes of quantized
    weights: fp8 data plus scales, as uint8), distinct from the gradients' (``expert_shapes``, the
    high-precision shapes); by default both are ``expert_shapes``. Schedules are built for the
    gradient layout; :meth:`distribute_weights` moves the weight layout along the same edges.

    Its transfers' message tags carry its own sequence numbers (:mod:`.tags`): on gloo, two buffers
    sharing a group must not have transfers in flight together.
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
        weight_shapes: Sequence[Sequence[int]] | None = None,
    ) -> None:
        if not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots must be a non-negative int, got {num_slots!r}")
        self.expert_shapes = [torch.Size(s) for s in expert_shapes]
        if not self.expert_shapes:
            raise ValueError("expert_shapes must list at least one tensor shape")
        self.expert_numel = sum(s.numel() for s in self.expert_shapes)
        self.weight_shapes = (
            [torch.Size(s) for s in weight_shapes]
            if weight_shapes is not None
            else list(self.expert_shapes)
        )
        if not self.weight_shapes:
            raise ValueError("weight_shapes must list at least one tensor shape")
        self.weight_numel = sum(s.numel() for s in self.weight_shapes)
        self.group = group
        self.chunk_numel = chunk_numel
        self.relay = relay
        self.relay_threshold = relay_threshold
        self._schedules = ScheduleCache(self.SCHEDULE_CACHE_SIZE)
        self._checked_schedules: "weakref.WeakSet[TransferSchedule]" = weakref.WeakSet()
        self._tags = TagSequence()  # numbers this buffer's transfers, in call order
        self.replica_weights = torch.zeros(
            num_slots, self.weight_numel, dtype=weight_dtype, device=device
        )
        self.replica_grads = torch.zeros(
            num_slots, self.expert_numel, dtype=grad_dtype, device=device
        )
        on_cuda = self.replica_weights.is_cuda
        self.comm_stream = (
            torch.cuda.Stream(device=self.replica_weights.device) if on_cuda else HostCommStream()
        )
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
            raise ValueError(
                f"slot_expert has {slot_expert.shape[1]} slots per rank, the buffer {self.num_slots}"
            )
        return self._schedules.get(
            slot_expert,
            num_experts,
            self.expert_numel,
            chunk_numel=self.chunk_numel,
            relay=self.relay,
            relay_threshold=self.relay_threshold,
        )

    def distribute_weights(
        self,
        schedule: TransferSchedule,
        main_weights: ExpertTensors,
        *,
        async_op: bool = False,
        start_after: TransferHandle | None = None,
    ) -> TransferHandle | None:
        """Copy every replicated main expert into its replica slots (bit-identical). Collective.

        Args:
            schedule: from :meth:`schedule` (or :func:`~.schedule.build_schedule`) on the same plan
                on every rank.
            main_weights: this rank's ``E // R`` main experts, each a sequence of tensors (e.g.
                ``[linear_fc1.weight, linear_fc2.weight]``), in local-expert order, in the dtype of
                ``replica_weights`` and shaped as ``weight_shapes``. Slots hosting a replica are
                overwritten, other slots are left alone.
            async_op: return a :class:`~.handle.TransferHandle` instead of waiting. The main
                weights and the slots being written must not be modified, nor the slots read,
                before ``wait()``.
            start_after: a transfer this one must follow (it is waited for first).

        On the CPU (a :class:`HostCommStream`) every call runs whole on the stream's thread, in the
        order of the calls: an asynchronous one returns once handed over, and its bad inputs raise
        in ``wait()`` (still before any communication); elsewhere they raise here. See
        :func:`~.distribute.distribute_weights`."""
        schedule = schedule.with_expert_numel(self.weight_numel)  # the same schedule by default
        if isinstance(self.comm_stream, HostCommStream):
            self._before_hand_over(schedule, start_after, len(self.weight_shapes))
            return self._on_host_stream(
                lambda: distribute.distribute_weights(
                    schedule,
                    main_weights,
                    self.replica_weights,
                    group=self.group,
                    tags=self._tags,
                    async_op=True,
                ).complete(finish=True),
                async_op,
            )
        return distribute.distribute_weights(
            schedule,
            main_weights,
            self.replica_weights,
            group=self.group,
            tags=self._tags,
            async_op=async_op,
            start_after=start_after,
            comm_stream=self.comm_stream,
        )

    def reduce_gradients(
        self,
        schedule: TransferSchedule,
        main_grads: ExpertTensors,
        *,
        async_op: bool = False,
        start_after: TransferHandle | None = None,
        hosted_grads: Mapping[int, Sequence[torch.Tensor] | None] | None = None,
        fold_on_stream: bool = False,
    ) -> TransferHandle | None:
        """Add every replica's gradient into its main expert's gradient. Collective.

        Reads the slots of ``replica_grads`` that host a replica on this rank, which hold those
        replicas' gradients: written by the caller beforehand (:meth:`grad_views`), or by the
        transfer itself from ``hosted_grads``. The sum is bit-identical across runs of the same
        plan (fixed order: :mod:`.reduce`).

        Args:
            schedule: the schedule of this layer's weight distribution.
            main_grads: this rank's ``E // R`` main-expert gradients (e.g. ``param.main_grad``),
                each a sequence of tensors, same layout as the main weights.
            async_op: return a :class:`~.handle.TransferHandle` instead of waiting. Without
                ``fold_on_stream`` the main gradients are read and written only inside ``wait()``;
                ``replica_grads`` must not be touched before ``wait()``, nor another reduction on
                the buffer started.
            start_after: a transfer this one must follow (it is waited for first).
            hosted_grads: ``{slot: tensors}`` for every hosted slot (``None``, or a ``None``
                tensor: zeros), copied into their slots by the transfer, on its stream.
            fold_on_stream: fold on the transfer's stream as soon as the gradients have arrived,
                for a caller that neither reads nor writes ``main_grads`` before ``wait()``.

        See :func:`~.reduce.reduce_gradients` for the details. On the CPU every call runs whole on
        the stream's thread, as :meth:`distribute_weights`; without ``fold_on_stream`` the fold
        still waits for ``wait()``, on the caller's thread."""
        if isinstance(self.comm_stream, HostCommStream):
            self._before_hand_over(schedule, start_after, len(self.expert_shapes))
            return self._on_host_stream(
                lambda: reduce.reduce_gradients(
                    schedule,
                    main_grads,
                    self.replica_grads,
                    group=self.group,
                    tags=self._tags,
                    async_op=True,
                    hosted_grads=hosted_grads,
                ).complete(finish=fold_on_stream),
                async_op,
            )
        return reduce.reduce_gradients(
            schedule,
            main_grads,
            self.replica_grads,
            group=self.group,
            tags=self._tags,
            async_op=async_op,
            start_after=start_after,
            comm_stream=self.comm_stream,
            hosted_grads=hosted_grads,
            fold_on_stream=fold_on_stream,
        )

    def _before_hand_over(
        self,
        schedule: TransferSchedule,
        start_after: TransferHandle | None,
        tensors_per_expert: int,
    ) -> None:
        """Before handing a call to the HostCommStream, on the caller's thread: wait for
        ``start_after``, and refuse a schedule of another group at the call, not in ``wait()``."""
        if start_after is not None:
            start_after.wait()
        if schedule not in self._checked_schedules:  # immutable, and recurring (the schedule cache)
            check_schedule(schedule, group_rank(self.group)[1])
            check_tag_space(schedule, tensors_per_expert)
            self._checked_schedules.add(schedule)

    def _on_host_stream(
        self, call: Callable[[], TransferHandle], async_op: bool
    ) -> TransferHandle | None:
        """Run a transfer's whole call on the buffer's HostCommStream (every transfer of the buffer
        goes through it, synchronous ones too). A reduction whose fold is left to ``wait()`` must be
        waited before the next reduction on the buffer starts (it reads the hosted slots then)."""
        handle = HostStreamTransfer(self.comm_stream, call)
        if async_op:
            return handle
        handle.wait()
        return None

    def weight_views(self, slot: int) -> list[torch.Tensor]:
        """Views of replica slot ``slot`` shaped as ``weight_shapes``."""
        return self._views[0][slot]

    def grad_views(self, slot: int) -> list[torch.Tensor]:
        """Views of replica gradient slot ``slot`` shaped like one expert's tensors."""
        return self._views[1][slot]

    @functools.cached_property
    def _views(self) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        # Made once: the buffers live as long as this object, and every replica forward and
        # backward asks for them.
        return tuple(
            [expert_views(buffer[s], shapes) for s in range(self.num_slots)]
            for buffer, shapes in (
                (self.replica_weights, self.weight_shapes),
                (self.replica_grads, self.expert_shapes),
            )
        )
