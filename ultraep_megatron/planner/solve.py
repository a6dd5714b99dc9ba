"""The solve: the exact load of one MoE layer-microbatch -> a replication and reroute :class:`Plan`.

``solve`` runs the quota-driven search of docs/planner.md in one compiled pass (``_compiled_solve``), or
in the plain-Python ``reference`` that gives the same plan bit for bit. Every EP rank calls it on the
same gathered load and gets the same plan, with no communication.

    plan = solve(load, num_slots)                 # load int64 [R, E]
    plan = solve(load, num_slots, domain_size=8)  # replicas stay inside 8-rank NVLink domains
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from . import _compiled_solve as _compiled, reference
from .plan import Plan

__all__ = [
    "solve",
    "validate_load",
    "validate_domain_size",
    "default_min_quota",
    "domain_lower_bound",
    "host_array",
    "DEFAULT_MIN_QUOTA_DIVISOR",
]

# Default quota floor: 1 % of the mean per-rank load. A replica costs a weight transfer (and a
# gradient reduction in backward) whatever it carries; one carrying less than 1 % of a rank's
# work is not worth it, and forbidding it also keeps the replica count down (docs/planner.md).
DEFAULT_MIN_QUOTA_DIVISOR = 100


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view of a host tensor (a copy only if it is not contiguous or on a
    device)."""
    if tensor.is_cpu and not tensor.requires_grad:  # the per-invocation case: two torch calls less
        return np.ascontiguousarray(tensor.numpy())
    return np.ascontiguousarray(tensor.detach().cpu().numpy())


def validate_load(load: torch.Tensor, name: str = "load") -> tuple[int, int]:
    """Check ``load`` is an int64 [R, E] tensor with E % R == 0; return (R, E).

    Negative values are checked by the caller (in the compiled pass for ``solve``)."""
    if not isinstance(load, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(load).__name__}")
    if load.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {load.dtype}")
    if load.dim() != 2:
        raise ValueError(f"{name} must be [R, E], got shape {tuple(load.shape)}")
    R, E = load.shape
    if R == 0 or E == 0 or E % R != 0:
        raise ValueError(f"{name} has R={R} ranks and E={E} experts; need R >= 1 and E % R == 0")
    return R, E


def default_min_quota(total_load: int, num_ranks: int) -> int:
    """``max(1, ceil(total_load / (100 * num_ranks)))``: 1 % of the mean rank load, at least 1."""
    return max(1, -(-int(total_load) // (DEFAULT_MIN_QUOTA_DIVISOR * num_ranks)))


def validate_domain_size(domain_size, num_ranks: int) -> int:
    """``domain_size`` (None: one domain of all ``num_ranks``) as an int that divides R."""
    if domain_size is None:
        return num_ranks
    if (
        isinstance(domain_size, bool)
        or not isinstance(domain_size, (int, np.integer))
        or domain_size < 1
        or num_ranks % domain_size
    ):
        raise ValueError(
            f"domain_size must be an int >= 1 dividing the number of EP ranks "
            f"R={num_ranks} (EP ranks per NVLink domain), got {domain_size!r}"
        )
    return int(domain_size)


def validate_solve_args(
    load: torch.Tensor, num_slots, min_quota, domain_size
) -> tuple[int, int, int, int | None, int]:
    """The arguments a planner (``solve``, ``plan_invocation``) takes, checked: (R, E, S, min_quota or
    None, N); ``domain_size`` None becomes R (one domain)."""
    R, E = validate_load(load)
    if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)) or num_slots < 0:
        raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")
    domain_size = validate_domain_size(domain_size, R)
    if min_quota is not None and (
        isinstance(min_quota, bool) or not isinstance(min_quota, (int, np.integer)) or min_quota < 1
    ):
        raise ValueError(f"min_quota must be an int >= 1 or None, got {min_quota!r}")
    return R, E, int(num_slots), None if min_quota is None else int(min_quota), domain_size


def domain_lower_bound(load: torch.Tensor, domain_size: int | None = None) -> int:
    """``max_d ceil(total_d / N)`` for ``load`` int64 [R, E]: no plan whose replicas stay inside
    their home's domain of N = ``domain_size`` ranks has a lower max rank load (domain d's experts'
    load stays on its N ranks). ``ceil(total / R)`` for one domain."""
    R, E = validate_load(load)
    N = validate_domain_size(domain_size, R)
    per_domain = load.sum(0).view(R // N, N * (E // R)).sum(1)  # [R / N]
    return int((-(-per_domain // N)).max())


def solve(
    load: torch.Tensor,
    num_slots: int,
    *,
    min_quota: int | None = None,
    domain_size: int | None = None,
    implementation: Literal["compiled", "reference"] = "compiled",
) -> Plan:
    """Replication and reroute plan for the exact load of one MoE layer.

    Args:
        load: int64 [R, E]; ``load[s, e]`` = (token, expert) pairs on source rank s routed to
            logical expert e. Expert e's main instance lives on rank ``e // (E // R)``.
        num_slots: S, redundant slots per rank (>= 0).
        min_quota: every replica (a filled redundant slot) carries at least this many tokens
            (>= 1). ``None``: ``default_min_quota`` = 1 % of the mean rank load. Main instances
            are exempt (0 .. their expert's load). The floor never makes a plan infeasible: a rank
            whose last bit of excess is below it sheds ``min_quota`` tokens anyway and ends below
            the threshold (docs/planner.md).
        domain_size: N, EP ranks per NVLink domain (ranks ``[d*N, (d+1)*N)`` form domain d); must
            divide R. A replica of expert e is hosted only in its home's domain
            (``t // N == home(e) // N``), so no weight or replica gradient crosses a domain; tokens
            still go anywhere. The max rank load is then at least ``domain_lower_bound``.
            ``None`` or R: one domain, the plain planner (same plans bit for bit).
        implementation: "compiled" (numba, the default) or "reference" (plain Python, slow;
            returns the same plan bit for bit).

    Returns:
        A ``Plan`` whose tensors live on ``load``'s device.
    """
    R, E, num_slots, min_quota, domain_size = validate_solve_args(
        load, num_slots, min_quota, domain_size
    )
    device = load.device
    array = host_array(load)

    if implementation == "compiled":
        # min_quota 0: the kernel derives the default from the total it computes anyway.
        status, slot_expert, quota, physical_split, threshold = _compiled.solve_arrays(
            array,
            int(num_slots),
            0 if min_quota is None else int(min_quota),
            DEFAULT_MIN_QUOTA_DIVISOR,
            domain_size,
        )
        if status == _compiled.NEGATIVE_LOAD:
            raise ValueError("load has negative entries")
    elif implementation == "reference":
        if (array < 0).any():
            raise ValueError("load has negative entries")
        if min_quota is None:
            min_quota = default_min_quota(int(array.sum()), R)
        slot_expert, quota, physical_split, threshold = reference.solve_arrays(
            array, int(num_slots), int(min_quota), domain_size
        )
    else:
        raise ValueError(
            f"implementation must be 'compiled' or 'reference', got {implementation!r}"
        )

    slot_expert, quota, physical_split = (
        torch.from_numpy(slot_expert),
        torch.from_numpy(quota),
        torch.from_numpy(physical_split),
    )
    if device.type != "cpu":
        slot_expert, quota, physical_split = (
            slot_expert.to(device),
            quota.to(device),
            physical_split.to(device),
        )
    return Plan(slot_expert, quota, physical_split, int(threshold))
