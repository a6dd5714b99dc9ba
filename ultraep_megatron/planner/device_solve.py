"""``device_solve``: the plan of a load that stays on its device.

# TEMPORARY stand-in, replaced at merge (the device planner is written in another branch): it
# solves on the host (``solve`` on ``load.cpu()``, a blocking read) and moves the plan back, so that
# the integration's device-planner path runs and is tested end to end. Same contract: the Plan's
# tensors on ``load``'s device, ``threshold`` a 0-dim int64 tensor there.
"""

from __future__ import annotations

import torch

from .plan import Plan
from .solve import solve

__all__ = ["device_solve", "STAND_IN"]

#: True while this module is the host stand-in (tests discount its one blocking read).
STAND_IN = True


def device_solve(load: torch.Tensor, num_slots: int, *, min_quota: int | None = None,
                 domain_size: int | None = None, implementation: str = "auto") -> Plan:
    """``solve(load, num_slots, ...)`` with the plan on ``load``'s device (TEMPORARY stand-in)."""
    del implementation
    plan = solve(load.to("cpu", copy=True), num_slots, min_quota=min_quota, domain_size=domain_size)
    device = load.device
    return Plan(plan.slot_expert.to(device), plan.quota.to(device), plan.physical_split.to(device),
                torch.tensor(plan.threshold, dtype=torch.int64, device=device))
