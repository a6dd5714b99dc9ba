"""Step 3 of the recipe checker: the rank layout, from Megatron's own ``RankGenerator``.

The global ranks of every expert-parallel group, the pipeline and data-parallel groups. A scale-up
domain is the GPUs one NVLink fabric joins, consecutive global ranks: a GB200 NVL72 rack (64 GPUs in
use, :data:`DEFAULT_RACK_SIZE`), an HGX node (8). An EP group either sits inside one domain, or
spans domains with ``--moe-balancer-domain-size`` D set so that every balancer domain (D
consecutive EP ranks, where replicas of its experts live) sits inside one scale-up domain: then no
expert weight or replica gradient crosses the slow network, only tokens do.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional, Sequence

from ultraep_megatron.planner.baselines import registry

#: GPUs in one rack-scale node's scale-up domain (an NVL72 rack with 64 GPUs in use, §8.1).
DEFAULT_RACK_SIZE = 64


@dataclass
class RankLayout:
    """Megatron's process groups for one job, as lists of global ranks."""

    world_size: int
    gpus_per_node: int
    rack_size: int
    ep_groups: list[list[int]]
    expert_dp_groups: list[list[int]]
    pp_groups: list[list[int]]
    dp_groups: list[list[int]]
    tp_groups: list[list[int]]
    balancer_domain: Optional[int] = None  # --moe-balancer-domain-size (None: the whole EP group)
    replicas: bool = True  # the balancer places replicas (not --moe-balancer none)

    def rack(self, rank: int) -> int:
        return rank // self.rack_size

    def racks(self, group: Sequence[int]) -> list[int]:
        return sorted({self.rack(r) for r in group})

    def spans_domains(self) -> bool:
        """Some EP group spans scale-up domains."""
        return any(len(self.racks(g)) > 1 for g in self.ep_groups)

    def balancer_domains(self) -> list[list[int]]:
        """The balancer domains of every EP group: ``--moe-balancer-domain-size`` consecutive EP
        ranks (the whole group without it)."""
        out = []
        for group in self.ep_groups:
            size = self.balancer_domain or len(group)
            out += [group[i : i + size] for i in range(0, len(group), size)]
        return out

    def node_sized_domain(self) -> int:
        """The largest ``--moe-balancer-domain-size`` whose balancer domains all sit inside one
        scale-up domain (a divisor of the EP size; 1 always does)."""
        ep = len(self.ep_groups[0])
        for size in sorted((d for d in range(1, ep + 1) if ep % d == 0), reverse=True):
            if all(
                len(self.racks(g[i : i + size])) == 1
                for g in self.ep_groups
                for i in range(0, ep, size)
            ):
                return size
        return 1

    def problems(self) -> list[str]:
        """Why this layout does not fit (empty when it does)."""
        out = []
        if self.rack_size % self.gpus_per_node:
            out.append(
                f"scale-up domain of {self.rack_size} GPUs (--rack-size) is not a whole number "
                f"of {self.gpus_per_node}-GPU nodes"
            )
        if not self.replicas or not self.spans_domains():
            return out
        group = next(g for g in self.ep_groups if len(self.racks(g)) > 1)
        where = f"scale-up domains {self.racks(group)} ({self.rack_size} GPUs each)"
        if self.balancer_domain is None:
            out.append(
                f"EP group {span(group)} spans {where} and --moe-balancer-domain-size is not "
                f"set: replicas would cross the slow network; add --moe-balancer-domain-size "
                f"{self.node_sized_domain()} (EP ranks per NVLink domain) or keep EP inside "
                "one scale-up domain"
            )
            return out
        bad = next((d for d in self.balancer_domains() if len(self.racks(d)) > 1), None)
        if bad is not None:
            out.append(
                f"--moe-balancer-domain-size {self.balancer_domain}: balancer domain {span(bad)} "
                f"spans scale-up domains {self.racks(bad)} ({self.rack_size} GPUs each); use "
                f"--moe-balancer-domain-size {self.node_sized_domain()} (its EP ranks must sit "
                "in one NVLink domain)"
            )
        return out


def rank_layout(args: argparse.Namespace, gpus_per_node: int, rack_size: int) -> RankLayout:
    """The process groups Megatron's ``initialize_model_parallel`` would build for ``args``.

    Uses megatron-core's ``RankGenerator`` with the rank order Megatron's initialization uses
    (``tp-cp-ep-dp-pp``, or ``tp-cp-ep-pp-dp`` with ``--use-tp-pp-dp-mapping``).
    """
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp"
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    ep = args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    dense = RankGenerator(tp=tp, ep=1, dp=args.data_parallel_size, pp=pp, cp=cp, order=order)
    expert = RankGenerator(
        tp=etp, ep=ep, dp=args.world_size // (etp * ep * pp), pp=pp, cp=1, order=order
    )
    return RankLayout(
        world_size=args.world_size,
        gpus_per_node=gpus_per_node,
        rack_size=rack_size,
        ep_groups=expert.get_ranks("ep"),
        expert_dp_groups=expert.get_ranks("dp"),
        pp_groups=dense.get_ranks("pp"),
        dp_groups=dense.get_ranks("dp"),
        tp_groups=dense.get_ranks("tp"),
        balancer_domain=getattr(args, "moe_balancer_domain_size", None),
        replicas=getattr(args, "moe_balancer", registry.NONE) != registry.NONE,
    )


def span(group: Sequence[int]) -> str:
    """'a-b' for a contiguous group, else the first members."""
    group = list(group)
    if group == list(range(group[0], group[0] + len(group))):
        return f"[{group[0]}-{group[-1]}]" if len(group) > 1 else f"[{group[0]}]"
    head = ", ".join(map(str, group[:4]))
    return (
        f"[{head}, ... {group[-1]}] (stride {group[1] - group[0]})"
        if len(group) > 4
        else f"[{head}]"
    )
