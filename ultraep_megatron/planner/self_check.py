"""A once-per-process self-check of the device planner: the fused plan op on a device against the
host planner (``fused_plan.host_plan``) on a few probe loads, and the fused reroute against its host
path. For the integration (before a model first plans on a device) and ``tools/gpu_check.sh``; the
result is cached per (device, settings), so a process pays for it once.

    problems = self_check(torch.device("cuda"), config)   # [] when the device agrees
"""

from __future__ import annotations

import torch

from .balancer import BalancerConfig
from .fused_plan import host_plan, plan_invocation
from .fused_reroute import host_reroute, reroute_permute

__all__ = ["self_check", "checked", "probe_loads"]


def _skewed(R: int, E: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    skew = torch.randint(0, 40, (R, E), generator=generator)
    skew[:, : E // R] += 300  # rank 0's experts hot
    return skew.long()


def probe_loads(config: BalancerConfig, shape: tuple[int, int] | None = None) -> list[torch.Tensor]:
    """Host int64 [R, E] loads that exercise the search, the floor, the domains and the trigger:
    a hot expert, a skew over ranks, an even load (below the trigger) and an all-zero one; and a
    skewed load of ``shape`` (a model's R, E: the kernel's sizes there) if given."""
    N = config.domain_size or 4
    R = max(4, 2 * N)
    E = 4 * R
    hot = torch.ones(R, E, dtype=torch.int64)
    hot[:, 1] += 500
    loads = [_skewed(R, E), hot, torch.full((R, E), 7, dtype=torch.int64), torch.zeros(R, E).long()]
    return loads + ([_skewed(*shape, seed=1)] if shape is not None else [])


def _check(
    device: torch.device, config: BalancerConfig, shape: tuple[int, int] | None
) -> tuple[str, ...]:
    problems = []
    for index, load in enumerate(probe_loads(config, shape)):
        R, E = load.shape
        for rank in (0, R - 1):
            fused = plan_invocation(load.to(device), config, rank)
            record, table = host_plan(load, config, rank)
            if not torch.equal(fused.record.cpu(), torch.from_numpy(record)):
                problems.append(
                    f"load {index} rank {rank}: the plan record differs from the host planner's"
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


def self_check(
    device: torch.device, config: BalancerConfig, *, shape: tuple[int, int] | None = None
) -> list[str]:
    """Problems found running the fused plan and reroute on ``device`` against the host planner
    for ``config`` (empty: they agree), a model's ``(R, E)`` among the probes if given; computed
    once per process per (device, config, shape). Reads device memory: for start-up only."""
    key = _key(device, config, shape)
    if key not in OUTCOMES:
        OUTCOMES[key] = _check(*key)
    return list(OUTCOMES[key])


def checked(device: torch.device, config: BalancerConfig, *, shape=None) -> bool:
    """Whether this process ran :func:`self_check` for these already (then it costs nothing)."""
    return _key(device, config, shape) in OUTCOMES


def _key(device, config, shape):
    return (torch.device(device), config, None if shape is None else tuple(shape))


#: The outcomes so far in this process, by (device, config, shape).
OUTCOMES: dict = {}
