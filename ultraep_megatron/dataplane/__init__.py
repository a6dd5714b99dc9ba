"""Expert-state data plane: replica weight distribution and replica-gradient reduction.

Builds on torch.distributed point-to-point operations only (gloo on CPU, NCCL on GPUs); never imports
Megatron, nor the rest of the package. See docs/dataplane.md. One object, :class:`ReplicaBuffer`,
owns the replica buffers and every transfer's communication state:

    buffer = ReplicaBuffer(num_slots, expert_shapes, weight_dtype, group=ep_group)  # collective
    schedule = buffer.schedule(plan.slot_expert, num_experts)      # pure, same on all ranks
    buffer.distribute_weights(schedule, main_weights)              # home -> replica slots
    buffer.reduce_gradients(schedule, main_grads)                  # replicas -> home

    handle = buffer.distribute_weights(schedule, main_weights, async_op=True)  # a TransferHandle:
    ...                                                                        # overlap, then
    handle.wait()                                                  # ready for the next operation

Modules: ``buffer`` (ReplicaBuffer), ``distribute`` and ``reduce`` (the two transfers), ``handle``
(TransferHandle, where a transfer runs and how its rounds are issued), ``host_stream`` (the CPU's
communication stream), ``tags`` (a transfer's message tags), ``checks`` (input checks), ``pack``
(experts as flat rows), ``schedule`` and ``relay`` (the transfer schedule of a plan). Each module's
public names are what the others use of it; the package re-exports the buffer's surface below.
"""

from .buffer import ReplicaBuffer
from .handle import TransferHandle
from .host_stream import HostCommStream
from .pack import expert_views, pack_experts
from .schedule import RELAY_MODES, TransferSchedule, build_schedule, validate_slot_expert

__all__ = [
    "HostCommStream",
    "RELAY_MODES",
    "ReplicaBuffer",
    "TransferHandle",
    "TransferSchedule",
    "build_schedule",
    "expert_views",
    "pack_experts",
    "validate_slot_expert",
]
