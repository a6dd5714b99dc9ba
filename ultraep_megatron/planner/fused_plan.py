"""ultraep's plan of one invocation as one op: the load of the EP group -> one rank's plan record
(read by its host at megatron's one wait) and reroute table (kept where the tokens are).

    fused = plan_invocation(load, config, rank)    # torch.ops.ultraep.plan_invocation
    record = unpack_record(fused.record.cpu(), R, E, S)   # at the wait: splits, metrics
    rerouted = reroute_permute(topk_ids, hidden, probs, fused.table)   # fused_reroute.py

One specification (``reference.py``), one fast path per device: on CUDA the fused Triton kernel
(``triton_plan.py``, one launch: trigger, threshold search, plan build, record and table); on the
host the compiled solver (``_compiled_solve.py``) and packing (``_compiled_record.py``),
``host_plan``; on CPU tensors with ``TRITON_INTERPRET=1`` set the Triton kernel itself, so the
suite runs the device code. Both write the layout of ``record_layout.py``; the tests check them
equal bit for bit and equal to ``solve``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import numpy as np
import torch

from . import _compiled_record
from . import _compiled_solve
from .balancer import BalancerConfig
from .baselines.registry import ULTRAEP
from .plan import Plan
from .record_layout import (
    H_STATUS,
    INT32_MAX,
    STATUS_INT32_OVERFLOW,
    STATUS_NEGATIVE_LOAD,
    record_length,
    table_columns,
)
from .solve import DEFAULT_MIN_QUOTA_DIVISOR, default_min_quota, host_array, validate_load

__all__ = [
    "OP_NAMESPACE",
    "FusedPlan",
    "plan_invocation",
    "host_plan",
    "host_parts",
    "op_arguments",
    "interpreting",
    "triton_available",
]


#: Pack a host plan into one rank's record and table (``_compiled_record.host_parts``; it lives
#: there so that ``balancer.warm_up`` can load it without importing this module).
host_parts = _compiled_record.host_parts

#: The fused ops' ``torch.library`` namespace (``torch.ops.ultraep``): the balancer's name.
OP_NAMESPACE = ULTRAEP


@dataclass(frozen=True)
class FusedPlan:
    """One invocation's plan for one rank, on the load's device.

    Attributes:
        record: int64 [L] (``record_layout``): header, slot layout, this rank's splits and rows per
            (source, physical slot). Copy it to the host and read it after megatron's wait.
        table: int32 [4, E + R*S + 1], this rank's reroute table (``record_layout``), for
            ``fused_reroute.reroute_permute`` on the same device.
    """

    record: torch.Tensor
    table: torch.Tensor


def triton_available() -> bool:
    """Whether ``triton`` is installed (the fused kernel's CUDA path)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (``TRITON_INTERPRET=1``, read at import by
    Triton): then the CPU implementation of the fused ops runs the Triton kernels."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def op_arguments(config: BalancerConfig) -> tuple[int, int, float, int]:
    """A config as the op's scalars: (num_slots, min_quota or 0 for the default, trigger or -1.0
    for the default, domain_size or 0 for one domain)."""
    if config.name != ULTRAEP:
        raise ValueError(f"plan_invocation plans ultraep, got balancer {config.name!r}")
    return (
        int(config.num_slots),
        int(config.min_quota or 0),
        -1.0 if config.trigger is None else float(config.trigger),
        int(config.domain_size or 0),
    )


def _balances(rank_load: np.ndarray, total: int, min_quota: int, trigger: float) -> bool:
    """``LayerBalancer.balances`` for ultraep from the rank loads."""
    R = rank_load.size
    if trigger >= 0:
        imbalance = int(rank_load.max()) / (total / R) if total > 0 else 1.0
        return imbalance >= trigger
    return total > 0 and R * int(rank_load.max()) - total >= R * min_quota


def _failed(record: np.ndarray, table: np.ndarray, status: int):
    record[:] = 0
    record[H_STATUS] = status
    table[:] = 0
    return record, table


def host_plan(
    load: torch.Tensor,
    config: BalancerConfig,
    rank: int,
    *,
    record: np.ndarray | None = None,
    table: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The host planner's record and table of ``load`` (host int64 [R, E]) for ``rank``: trigger
    as ``LayerBalancer.balances``, the plan as ``solve`` (identity below the trigger), packed by
    :func:`host_parts`. A negative entry or a total above int32 max gives a record whose status
    says so (``record_layout.STATUS_*``) and a zero table."""
    R, E = validate_load(load)
    S, floor, trigger, N = op_arguments(config)
    N = N or R
    array = host_array(load)
    L, C = record_length(R, E, S), table_columns(R, E, S)
    record = np.empty(L, np.int64) if record is None else record
    table = np.empty((4, C), np.int32) if table is None else table
    if (array < 0).any():
        return _failed(record, table, STATUS_NEGATIVE_LOAD)
    total = int(array.sum())
    if total > INT32_MAX:
        return _failed(record, table, STATUS_INT32_OVERFLOW)
    rank_load = array.sum(0).reshape(R, E // R).sum(1)
    min_quota = floor or default_min_quota(total, R)
    balanced = _balances(rank_load, total, min_quota, trigger)
    if balanced:
        _, slot_expert, quota, physical_split, threshold = _compiled_solve.solve_arrays(
            array, S, min_quota, DEFAULT_MIN_QUOTA_DIVISOR, N
        )
        plan = Plan(
            torch.from_numpy(slot_expert),
            torch.from_numpy(quota),
            torch.from_numpy(physical_split),
            int(threshold),
        )
    else:
        from .baselines.fixed_layout import identity_plan

        plan = identity_plan(load.cpu() if load.is_cuda else load, S)
    return host_parts(
        array,
        plan,
        rank,
        balanced=balanced,
        min_quota=min_quota,
        domain_size=N,
        record=record,
        table=table,
    )


# ---- the op -------------------------------------------------------------------------------------


def _plan_on_load_device(load, rank, num_slots, min_quota, trigger, domain_size):
    """The op's body: the fused Triton kernel on CUDA (or interpreted), the host planner on CPU."""
    if load.is_cuda or interpreting():
        from .triton_plan import launch

        return launch(load, rank, num_slots, min_quota, trigger, domain_size)
    config = BalancerConfig(
        ULTRAEP,
        num_slots=num_slots,
        min_quota=min_quota or None,
        trigger=None if trigger < 0 else trigger,
        domain_size=domain_size or None,
    )
    record, table = host_plan(load, config, rank)
    return torch.from_numpy(record), torch.from_numpy(table)


@torch.library.custom_op("ultraep::plan_invocation", mutates_args=())
def _plan_op(
    load: torch.Tensor, rank: int, num_slots: int, min_quota: int, trigger: float, domain_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """load int64 [R, E] -> (record int64 [L], table int32 [4, C]) on load's device."""
    return _plan_on_load_device(load, rank, num_slots, min_quota, trigger, domain_size)


@_plan_op.register_fake
def _(load, rank, num_slots, min_quota, trigger, domain_size):
    R, E = load.shape
    record = load.new_empty(record_length(R, E, num_slots), dtype=torch.int64)
    table = load.new_empty((4, table_columns(R, E, num_slots)), dtype=torch.int32)
    return record, table


def plan_invocation(load: torch.Tensor, config: BalancerConfig, rank: int) -> FusedPlan:
    """ultraep's plan of ``load`` (int64 [R, E], the EP group's exact load, on any device) for
    ``rank``, as one op (``torch.ops.ultraep.plan_invocation``): no host read on a device."""
    R, E = validate_load(load)
    if not 0 <= rank < R:
        raise ValueError(f"rank must be in [0, {R}), got {rank}")
    record, table = _plan_op(load, int(rank), *op_arguments(config))
    return FusedPlan(record, table)
