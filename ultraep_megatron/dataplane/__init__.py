"""Expert-state data plane: replica weight distribution and replica-gradient reduction.

Builds on torch.distributed point-to-point operations only (gloo on CPU, NCCL on GPUs); never imports
Megatron. See docs/dataplane.md.

    schedule = build_schedule(plan.slot_expert, num_experts, expert_numel)   # pure, same on all ranks
    distribute_weights(schedule, main_weights, replica_weights, group)       # home -> replica slots
    reduce_gradients(schedule, main_grads, replica_grads, group)             # replicas -> home

    handle = distribute_weights(..., async_op=True)   # returns a TransferHandle; overlap, then
    handle.wait()                                       # ready for the caller's next operation
"""

from .engine import (
    HostCommStream,
    ReplicaBuffer,
    TransferHandle,
    distribute_weights,
    expert_views,
    pack_experts,
    reduce_gradients,
)
from .schedule import RELAY_MODES, TransferSchedule, build_schedule, validate_slot_expert

__all__ = [
    "HostCommStream",
    "RELAY_MODES",
    "ReplicaBuffer",
    "TransferHandle",
    "TransferSchedule",
    "build_schedule",
    "distribute_weights",
    "expert_views",
    "pack_experts",
    "reduce_gradients",
    "validate_slot_expert",
]
