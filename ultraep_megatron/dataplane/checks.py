"""Input checks shared by the transfers: every bad input raises ``ValueError`` before any
communication, identically on every rank that got the same inputs."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .pack import ExpertTensors
from .schedule import TransferSchedule

__all__ = ["check_buffer", "check_experts", "check_schedule", "group_rank"]

#: (rank, size) of the process groups transfers ran on: a group's never change, and asking
#: torch.distributed costs a few dozen Python calls per transfer. (Single reads and writes of the
#: map need no lock under the GIL.)
_group_ranks: "weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[int, int]]" = (
    weakref.WeakKeyDictionary()
)


def group_rank(group) -> tuple[int, int]:
    """This process's (rank, world size) in ``group`` (``None``: the default group)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized")
    if group is None:  # the default group may be destroyed and re-created
        return dist.get_rank(), dist.get_world_size()
    known = _group_ranks.get(group)
    if known is None:
        known = _group_ranks[group] = (dist.get_rank(group), dist.get_world_size(group))
    return known


def check_schedule(schedule: TransferSchedule, world_size: int) -> None:
    if not isinstance(schedule, TransferSchedule):
        raise ValueError(f"schedule must be a TransferSchedule, got {type(schedule).__name__}")
    if schedule.num_ranks != world_size:
        raise ValueError(f"the plan has {schedule.num_ranks} ranks, the process group {world_size}")


def check_buffer(name: str, buffer: torch.Tensor, schedule: TransferSchedule) -> None:
    """A replica buffer must be a contiguous ``[num_slots, expert_numel]`` tensor."""
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor")
    expected = (schedule.num_slots, schedule.expert_numel)
    if tuple(buffer.shape) != expected:
        raise ValueError(
            f"{name} has shape {tuple(buffer.shape)}, the plan needs [num_slots, expert_numel] = {list(expected)}"
        )
    if not buffer.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_experts(
    name: str, experts: ExpertTensors, schedule: TransferSchedule, device: torch.device
) -> torch.dtype:
    """Check the local main experts (``E // R`` sequences of tensors); return their common dtype."""
    if len(experts) != schedule.experts_per_rank:
        raise ValueError(
            f"{name} has {len(experts)} local experts, the plan has {schedule.experts_per_rank} per rank "
            f"({schedule.num_experts} experts on {schedule.num_ranks} ranks)"
        )
    first = experts[0]
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in first]
    if None in shapes:
        raise ValueError(
            f"{name}[0] must contain only tensors (got a {type(first[shapes.index(None)]).__name__})"
        )
    numel = sum(torch.Size(s).numel() for s in shapes)
    if numel != schedule.expert_numel:
        raise ValueError(
            f"{name}[0] has {numel} elements in total, the plan's expert_numel is {schedule.expert_numel}"
        )
    dtype = first[0].dtype
    for i, expert in enumerate(experts):
        if [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in expert] != shapes:
            raise ValueError(f"{name}[{i}] shapes differ from {name}[0] ({shapes})")
        for t in expert:
            if t.dtype != dtype:
                raise ValueError(
                    f"{name}[{i}] mixes dtypes ({t.dtype} vs {dtype}); all expert tensors must share one dtype"
                )
            if t.device != device:
                raise ValueError(f"{name}[{i}] is on {t.device}, the replica buffer on {device}")
    return dtype
