"""A once-per-process self-check of the device planner: the fused plan op on a device against the
host planner (``fused_plan.host_plan``) on a few probe loads, and the fused reroute against its host
path. For the integration (before a model first plans on a device) and ``tools/gpu_check.sh``; the
result is cached per (device, settings), so a process pays for it once.

    problems = self_check(torch.device("cuda"), config)   # [] when the device agrees
"""

from __future__ import annotations

import functools

import torch

from .balancer import BalancerConfig
from .fused_plan import host_plan, plan_invocation
from .fused_reroute import host_reroute, reroute_permute

__all__ = ["self_check", "probe_loads"]


def probe_loads(config: BalancerConfig) -> list[torch.Tensor]:
    """Host int64 [R, E] loads that exercise the search, the floor, the domains and the trigger:
    a hot expert, a skew over ranks, an even load (below the trigger) and an all-zero one."""
    N = config.domain_size or 4
    R = max(4, 2 * N)
    E = 4 * R
    generator = torch.Generator().manual_seed(0)
    skew = torch.randint(0, 40, (R, E), generator=generator)
    skew[:, : E // R] += 300  # rank 0's experts hot
    hot = torch.ones(R, E, dtype=torch.int64)
    hot[:, 1] += 500
    return [skew.long(), hot, torch.full((R, E), 7, dtype=torch.int64), torch.zeros(R, E).long()]


@functools.cache
def _check(device: torch.device, config: BalancerConfig) -> tuple[str, ...]:
    problems = []
    for index, load in enumerate(probe_loads(config)):
        R, E = load.shape
        for rank in (0, R - 1):
            fused = plan_invocation(load.to(device), config, rank)
            record, table = host_plan(load, config, rank)
            if not torch.equal(fused.record.cpu(), torch.from_numpy(record)):
                problems.append(
                    f"load {index} rank {rank}: the plan record differs from the host's"
                )
            if not torch.equal(fused.table.cpu(), torch.from_numpy(table)):
                problems.append(f"load {index} rank {rank}: the reroute table differs")
    _check_reroute(device, config, problems)
    return tuple(problems)


def _routed_load(R: int, E: int, T: int = 64, k: int = 2):
    """Every rank's top-k routing [T, k] (distinct experts, skewed to expert 0) and their load."""
    generator = torch.Generator().manual_seed(3)
    weights = torch.ones(E)
    weights[0] = 30.0
    ids = [
        torch.stack([torch.multinomial(weights, k, generator=generator) for _ in range(T)])
        for _ in range(R)
    ]
    return ids, torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])


def _check_reroute(device, config, problems):
    R = max(4, 2 * (config.domain_size or 2))
    E = 4 * R
    ids, load = _routed_load(R, E)
    for rank in (0, R - 1):
        fused = plan_invocation(load.to(device), config, rank)
        _, table = host_plan(load, config, rank)
        T, k = ids[rank].shape
        hidden = torch.randn(T, 8, generator=torch.Generator().manual_seed(1))
        probs = torch.rand(T, k, generator=torch.Generator().manual_seed(2))
        out = reroute_permute(
            ids[rank].to(device), hidden.to(device), probs.to(device), fused.table, num_experts=E
        )
        expected = host_reroute(ids[rank], hidden, probs, torch.from_numpy(table), E)
        got = (out.permuted, out.permuted_probs, out.send_token, out.pair_slot, out.pair_row)
        if not all(torch.equal(a.cpu(), b) for a, b in zip(got, expected)):
            problems.append(f"routed load, rank {rank}: the fused reroute differs from the host's")


def self_check(device: torch.device, config: BalancerConfig) -> list[str]:
    """Problems found running the fused plan and reroute on ``device`` against the host planner
    for ``config`` (empty: they agree); computed once per process per (device, config)."""
    return list(_check(torch.device(device), config))
