"""The recipe checker's report: :func:`check_launch` runs steps 2-4 on a captured launch,
:func:`format_report` prints the result.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

from ultraep_megatron.megatron.recipe_check.launch import Launch, RecipeError
from ultraep_megatron.megatron.recipe_check.layout import DEFAULT_RACK_SIZE, RankLayout, rank_layout, span
from ultraep_megatron.megatron.recipe_check.memory import MemoryEstimate, estimate_memory
from ultraep_megatron.megatron.recipe_check.model import (
    balanced_moe_layer_ids, built_mtp_layers, flops_per_iteration, moe_layer_pattern,
)
from ultraep_megatron.megatron.recipe_check.validate import quiet_megatron, startup_problems, validate_arguments
from ultraep_megatron.planner.baselines import registry

GIB = 1024 ** 3
MIB = 1024 ** 2


@dataclass
class RecipeReport:
    launch: Launch
    args: argparse.Namespace
    layout: RankLayout
    memory: MemoryEstimate
    flops: float

    def problems(self) -> list[str]:
        return self.layout.problems()


def check_launch(launch: Launch, rack_size: int = DEFAULT_RACK_SIZE) -> RecipeReport:
    """Validate a captured launch and build its layout and memory report.

    Raises:
        RecipeError: when Megatron or UltraEP rejects the arguments or the layout (one problem
            per line).
    """
    args, _ = validate_arguments(launch.args, launch.world_size)
    problems = startup_problems(args)
    if problems:
        raise RecipeError("\n".join(problems))
    with quiet_megatron():
        layout = rank_layout(args, launch.nproc_per_node, rack_size)
        return RecipeReport(launch, args, layout, estimate_memory(args), flops_per_iteration(args))


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= 0.01 * GIB else f"{n / MIB:.2f} MiB"


def _count(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _mib(n: float) -> str:
    return f"{n / MIB:.1f} MiB" if n >= 0.1 * MIB else f"{n / 1024:.1f} KiB"


def format_report(report: RecipeReport) -> str:
    a, layout, mem = report.args, report.layout, report.memory
    ep, pp = a.expert_model_parallel_size, a.pipeline_model_parallel_size
    edp = a.world_size // (ep * (a.expert_tensor_parallel_size or a.tensor_model_parallel_size) * pp)
    racks = -(-a.world_size // layout.rack_size)
    lines = [
        f"== {report.launch.source}",
        f"world size {a.world_size} = {report.launch.nnodes} nodes x "
        f"{report.launch.nproc_per_node} GPUs ({racks} rack(s) of {layout.rack_size}); "
        f"TP{a.tensor_model_parallel_size} PP{pp} EP{ep} expert-DP{edp} "
        f"(attention DP{a.data_parallel_size})",
        "Megatron validate_args + validate_ultraep_args: passed (--moe-balancer "
        f"{a.moe_balancer}" + (f", {a.moe_balancer_num_slots} redundant slots per rank)"
                               if a.moe_balancer != registry.NONE else ")"),
        f"model: {a.num_layers} layers ({sum(moe_layer_pattern(a))} MoE"
        f"{f', + {a.mtp_num_layers} MTP' if a.mtp_num_layers else ''}), hidden {a.hidden_size}, "
        f"{a.num_experts} experts top-{a.moe_router_topk}, expert FFN {a.moe_ffn_hidden_size}; "
        f"{_count(mem.total_params)} parameters, {_count(mem.active_params)} active "
        "(embeddings included, MTP not)",
    ]
    balanced = balanced_moe_layer_ids(a)
    if balanced:
        mtp = [i for i in balanced if i > a.num_layers]
        lines.append(f"balanced MoE layers (--moe-balancer {a.moe_balancer}): "
                     f"{len(balanced) - len(mtp)} decoder{f' + {len(mtp)} MTP' if mtp else ''}, "
                     f"ids {_id_ranges(balanced)}")
    lines += [
        f"model FLOPs per iteration (Megatron's formula, global batch {a.global_batch_size}): "
        f"{report.flops:.3e}",
        "rank layout (global ranks):",
    ]
    for name, groups in (("EP", layout.ep_groups), ("PP", layout.pp_groups),
                         ("expert-DP", layout.expert_dp_groups), ("DP", layout.dp_groups)):
        spans = [len(layout.racks(g)) for g in groups]
        shown = "; ".join(span(g) for g in groups[:3]) + (" ..." if len(groups) > 3 else "")
        lines.append(f"  {len(groups):4d} {name:9s} groups of {len(groups[0]):4d}: {shown}  "
                     f"-> each spans {min(spans)}-{max(spans)} rack(s)")
    problems = report.problems()
    lines.append("  EP groups inside one rack: " + ("yes" if not problems else "NO"))
    lines.append("memory per rank (weights + fp32 main grads + optimizer states; replica slots):")
    mtp_moe = built_mtp_layers(a) * moe_layer_pattern(a)[-1]
    for s in mem.stages:
        mtp_here = mtp_moe if s.stage == len(mem.stages) - 1 else 0
        lines.append(
            f"  stage {s.stage}: layers {s.layers[0]}-{s.layers[-1]} ({s.moe_layers - mtp_here} MoE"
            f"{f' + {mtp_here} MTP' if mtp_here else ''}), {_count(s.dense_params)} dense + "
            f"{_count(s.expert_params)} expert params: model states {_gib(s.model_states)}; "
            f"{s.num_slots} slots {_gib(s.slots_with_reuse)} (without cross-layer reuse "
            f"{_gib(s.slots_without_reuse)}); total {_gib(s.total)}")
    s = max(mem.stages, key=lambda st: st.moe_layers)
    lines.append(
        f"  one redundant slot (§4.1), per rank: {_mib(s.slot_weight_bytes)} weights + "
        f"{_mib(s.slot_grad_bytes)} fp32 grads with cross-layer reuse, vs "
        f"{_gib(s.slot_weight_bytes * s.moe_layers)} + {_gib(s.slot_grad_bytes * s.moe_layers)} "
        f"without ({s.moe_layers} MoE layers on the rank)")
    lines.append("  (activations not included)")
    for problem in problems:
        lines.append(f"  PROBLEM: {problem}")
    return "\n".join(lines)


def _id_ranges(ids: Sequence[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
