"""Step 3 of the recipe checker: the rank layout, from Megatron's own ``RankGenerator``.

The global ranks of every expert-parallel group (each must sit inside one rack's scale-up domain),
the pipeline and data-parallel groups (which span racks).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

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

    def rack(self, rank: int) -> int:
        return rank // self.rack_size

    def racks(self, group: Sequence[int]) -> list[int]:
        return sorted({self.rack(r) for r in group})

    def problems(self) -> list[str]:
        """Why this layout does not fit rack-scale EP (empty when it does)."""
        out = []
        if self.rack_size % self.gpus_per_node:
            out.append(f"rack size {self.rack_size} is not a whole number of "
                       f"{self.gpus_per_node}-GPU nodes")
        for group in self.ep_groups:
            if len(self.racks(group)) > 1:
                out.append(f"EP group {span(group)} spans racks {self.racks(group)}: expert "
                           "parallelism must stay inside one rack's scale-up domain")
                break
        return out


def rank_layout(args: argparse.Namespace, gpus_per_node: int, rack_size: int) -> RankLayout:
    """The process groups Megatron's ``initialize_model_parallel`` would build for ``args``.

    Uses megatron-core's ``RankGenerator`` with the rank order Megatron's initialization uses
    (``tp-cp-ep-dp-pp``, or ``tp-cp-ep-pp-dp`` with ``--use-tp-pp-dp-mapping``).
    """
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp"
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    ep = args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    dense = RankGenerator(tp=tp, ep=1, dp=args.data_parallel_size, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=args.world_size // (etp * ep * pp), pp=pp, cp=1,
                           order=order)
    return RankLayout(
        world_size=args.world_size, gpus_per_node=gpus_per_node, rack_size=rack_size,
        ep_groups=expert.get_ranks("ep"), expert_dp_groups=expert.get_ranks("dp"),
        pp_groups=dense.get_ranks("pp"), dp_groups=dense.get_ranks("dp"),
        tp_groups=dense.get_ranks("tp"),
    )


def span(group: Sequence[int]) -> str:
    """'a-b' for a contiguous group, else the first members."""
    group = list(group)
    if group == list(range(group[0], group[0] + len(group))):
        return f"[{group[0]}-{group[-1]}]" if len(group) > 1 else f"[{group[0]}]"
    head = ", ".join(map(str, group[:4]))
    return f"[{head}, ... {group[-1]}] (stride {group[1] - group[0]})" if len(group) > 4 else f"[{head}]"
