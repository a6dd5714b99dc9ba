"""What a replay or the advisor needs, resolved from the user's choices: the hardware (a preset with
figures given on top), the quota floor (``"hw"``: from the hardware), the balancers compared with
EPLB's staleness sweep, and the peers. The ``ultraep`` command passes its flags' values here."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.planner.baselines import registry
from ultraep_megatron.settings.hardware import (
    ExpertShape,
    Hardware,
    hardware_preset,
    min_quota_from_hardware,
)

from .peers import PeerConfig

__all__ = ["peer_configs", "replay_balancers", "resolve_hardware", "resolve_min_quota"]


def resolve_hardware(
    preset: Optional[str], overrides: Mapping[str, object], domain_size: Optional[int] = None
) -> Hardware:
    """The hardware preset ``preset`` (``--moe-balancer-hardware``; ``None``: the paper's rack) with
    ``overrides`` (:class:`Hardware` field -> value) on top. Without a preset and a scale-up domain
    of its own it takes ``domain_size`` (``--moe-balancer-domain-size``)."""
    hardware = hardware_preset(preset) if preset else Hardware()
    given = dict(overrides)
    if "scale_up_domain" not in given and not preset and domain_size is not None:
        given["scale_up_domain"] = domain_size
    return dataclasses.replace(hardware, **given)


def resolve_min_quota(
    value,
    shape: ExpertShape,
    hardware: Hardware,
    *,
    training: bool = True,
    from_hardware: bool = False,
) -> Optional[int]:
    """A ``--moe-balancer-min-quota`` value: 'hw' (or, with ``from_hardware``, no value: a
    ``--moe-balancer-hardware`` run's default) derives it from the hardware."""
    if value == "hw" or (value is None and from_hardware):
        return min_quota_from_hardware(shape, hardware, training=training)
    return value


def replay_balancers(
    names: Sequence[str],
    base: BalancerConfig,
    staleness_intervals: Sequence[int],
    staleness_window: Optional[int] = None,
) -> tuple[dict, dict]:
    """(the compared balancers, the extra EPLB configurations of the staleness sweep), label ->
    config: every balancer of ``names`` with ``base``'s settings, and EPLB re-planned every
    interval of ``staleness_intervals`` from a history of ``staleness_window`` (default: = interval)."""
    main = {name: base.replace(name=name) for name in names}
    sweep = {}
    for interval in staleness_intervals:
        if interval < 1:
            raise ValueError("--staleness-intervals must be >= 1")
        window = staleness_window or interval
        sweep[f"{registry.EPLB}/i={interval}/w={window}"] = base.replace(
            name=registry.EPLB, eplb_window=window, eplb_interval=interval
        )
    return main, sweep


def peer_configs(
    names: Sequence[str],
    *,
    num_slots: int,
    capacity_factor: float,
    min_tokens_per_gemm: int,
    trigger: Optional[float],
    node_size: Optional[int] = None,
) -> list[PeerConfig]:
    """The peers to replay: each of ``names``, and DeepSeek's hierarchical policy over NVLink domains
    of ``node_size`` ranks when there are several (``node_size`` given)."""
    out = []
    for name in names:
        config = PeerConfig(
            name,
            num_slots=num_slots,
            capacity_factor=capacity_factor,
            min_tokens_per_gemm=min_tokens_per_gemm,
            imbalance_trigger=trigger,
        )
        out.append(config)
        if name == registry.DEEPSEEK_EPLB and node_size:
            out.append(dataclasses.replace(config, node_size=node_size))
    return out
