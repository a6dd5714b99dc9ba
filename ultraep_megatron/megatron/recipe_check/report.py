"""The recipe checker's report: :func:`check_launch` runs steps 2-4 on a captured launch,
:func:`format_report` prints the result.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from ultraep_megatron.megatron.recipe_check.activations import RUNTIME_RESERVE_GIB
from ultraep_megatron.megatron.recipe_check.launch import Launch, RecipeError
from ultraep_megatron.megatron.recipe_check.layout import RankLayout, rank_layout, span
from ultraep_megatron.megatron.recipe_check.memory import MemoryEstimate, estimate_memory
from ultraep_megatron.megatron.recipe_check.model import (
    balanced_moe_layer_ids,
    built_mtp_layers,
    flops_per_iteration,
    moe_layer_pattern,
)
from ultraep_megatron.megatron.recipe_check.validate import (
    environment_notes,
    quiet_megatron,
    startup_problems,
    validate_arguments,
)
from ultraep_megatron.planner.baselines import registry

GIB = 1024**3
MIB = 1024**2


@dataclass
class RecipeReport:
    launch: Launch
    args: argparse.Namespace
    layout: RankLayout
    memory: MemoryEstimate
    flops: float
    gpu_memory_gb: float = 186.0  # the budget a rank's peak must fit, GiB
    memory_source: str = ""  # where the budget comes from (for the report)
    domain_source: str = ""  # where the scale-up domain comes from
    hardware_problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the GPU nodes need, not this machine
    assumed: list[str] = field(
        default_factory=list
    )  # hardware the checker was not told and assumed
    hardware_named: Optional[str] = None  # --moe-balancer-hardware, if given
    domain_known: bool = True  # the scale-up domain was named, not assumed
    checks: str = "Megatron validate_args + validate_ultraep_args"  # what checked the arguments
    header: list[str] = field(default_factory=list)  # lines after the source (a Bridge recipe's)
    #: names each flag in a problem or note line as what sets it (a Bridge recipe's config field)
    rename: Optional[Callable[[str], str]] = None

    @property
    def budget_bytes(self) -> int:
        return int(self.gpu_memory_gb * GIB)

    def margin_bytes(self) -> int:
        """Budget less the largest stage's estimated peak (negative: it does not fit)."""
        return self.budget_bytes - max(s.peak for s in self.memory.stages)

    def memory_problems(self) -> list[str]:
        out = []
        for s in self.memory.stages:
            if s.peak > self.budget_bytes:
                out.append(
                    f"stage {s.stage}: estimated peak {_gib(s.peak)} per rank exceeds the "
                    f"{self.gpu_memory_gb:g} GiB budget ({self.memory_source}) by "
                    f"{_gib(s.peak - self.budget_bytes)}: model states {_gib(s.model_states)}, slots "
                    f"{_gib(s.slots_with_reuse)}, activations {_gib(s.activations)}; use activation "
                    "recompute, more pipeline stages or expert-data parallelism, or a smaller micro batch"
                )
        return out

    def problems(self) -> list[str]:
        layout = self.layout.problems()
        if not self.domain_known and self.hardware_problems:  # EP across nodes of unknown hardware:
            layout = [p for p in layout if "spans scale-up domains" not in p]  # said once, above
        out = self.launch.problems + self.hardware_problems + layout + self.memory_problems()
        return [self.rename(p) for p in out] if self.rename else out


#: Memory per GPU assumed when no hardware is named: an H100's, the smallest GPU the recipes target.
ASSUMED_GPU_MEMORY_GB = 80.0
#: What to name when the hardware is not named (the assumption line and the EP-across-nodes problem).
NAME_THE_HARDWARE = (
    "name it: --moe-balancer-hardware h100-hgx, h200-hgx or paper-rack (a GB200 NVL72 "
    "rack, 64 GPUs in use), or check-recipe's --rack-size GPUS and --gpu-memory-gb GIB"
)


def check_launch(
    launch: Launch, rack_size: Optional[int] = None, gpu_memory_gb: Optional[float] = None
) -> RecipeReport:
    """Validate a launch and build its layout and memory report.

    Args:
        launch: the launch read from a recipe (or bare arguments).
        rack_size: GPUs per scale-up (NVLink) domain, consecutive global ranks. ``None``: the
            recipe's ``--moe-balancer-hardware`` preset's domain (``h100-hgx``, ``h200-hgx``: 8, the
            node; ``paper-rack``: 64, a GB200 rack). With neither, the hardware is not named: the
            domain is assumed to end at the node, said loudly in the report, and an EP group
            spanning nodes is a problem (over a network the checker was not told about).
        gpu_memory_gb: GiB per GPU the estimated peak of a rank must fit. ``None``: the hardware
            preset's memory, else :data:`ASSUMED_GPU_MEMORY_GB` (assumed, said in the report).

    Raises:
        RecipeError: when Megatron or UltraEP rejects the arguments or the layout (one problem
            per line).
    """
    args, _ = validate_arguments(launch.args, launch.world_size)
    problems = startup_problems(args)
    if problems:
        raise RecipeError("\n".join(problems))
    return report_for_args(launch, args, rack_size, gpu_memory_gb)


def report_for_args(
    launch: Launch,
    args: argparse.Namespace,
    rack_size: Optional[int] = None,
    gpu_memory_gb: Optional[float] = None,
) -> RecipeReport:
    """Steps 3-4 of :func:`check_launch` (hardware, rank layout, memory) on arguments already
    checked: Megatron's validated namespace, or one read from a Megatron-Bridge
    ``ConfigContainer`` (:mod:`.bridge_recipe`)."""
    from ultraep_megatron.settings.hardware import hardware_preset

    name = getattr(args, "moe_balancer_hardware", None)
    hardware = hardware_preset(name) if name else None
    hardware_problems, assumed = [], []
    domain_known = rack_size is not None or (
        hardware is not None and bool(hardware.scale_up_domain)
    )
    if rack_size is not None:
        domain_source = "--rack-size"
        if (
            hardware is not None
            and hardware.scale_up_domain
            and rack_size != hardware.scale_up_domain
        ):
            hardware_problems.append(
                f"--rack-size {rack_size} contradicts --moe-balancer-hardware {name} (NVLink domains "
                f"of {hardware.scale_up_domain} GPUs)"
            )
    elif domain_known:
        rack_size, domain_source = hardware.scale_up_domain, f"--moe-balancer-hardware {name}"
    else:
        rack_size, domain_source = launch.nproc_per_node, "ASSUMED: the node"
        assumed.append(
            f"NVLink domains of one node ({_plural(rack_size, 'GPU')}, nothing faster than "
            "the network between nodes)"
        )
    if launch.gpus_per_node_assumed:
        assumed.insert(0, f"{_plural(launch.nproc_per_node, 'GPU')} per node (--gpus-per-node)")
    if (
        hardware is not None
        and hardware.scale_up_domain == hardware.gpus_per_node
        and launch.nproc_per_node != hardware.gpus_per_node
    ):
        hardware_problems.append(
            f"--moe-balancer-hardware {name}: the NVLink domain is one node of "
            f"{hardware.gpus_per_node} GPUs, but the launch runs {launch.nproc_per_node} processes per "
            f"node; launch {hardware.gpus_per_node} per node (GPUS_PER_NODE={hardware.gpus_per_node})"
        )
    if gpu_memory_gb is not None:
        memory_source = "--gpu-memory-gb"
    elif hardware is not None:
        gpu_memory_gb, memory_source = hardware.memory_gb, f"--moe-balancer-hardware {name}"
    else:
        gpu_memory_gb, memory_source = ASSUMED_GPU_MEMORY_GB, "ASSUMED: an H100's"
        assumed.append(f"{ASSUMED_GPU_MEMORY_GB:g} GiB per GPU (an H100's)")
    with quiet_megatron():
        layout = rank_layout(args, launch.nproc_per_node, rack_size)
        if not domain_known and layout.spans_domains():
            group = next(g for g in layout.ep_groups if len(layout.racks(g)) > 1)
            hardware_problems.append(
                f"EP group {span(group)} spans nodes {layout.racks(group)} and no hardware is named: the "
                "checker cannot tell whether the nodes share an NVLink domain (a GB200 NVL72 rack) or "
                "only a network (HGX H100/H200 nodes over InfiniBand, where replicas must stay in the "
                f"node); {NAME_THE_HARDWARE}"
            )
        return RecipeReport(
            launch,
            args,
            layout,
            estimate_memory(args),
            flops_per_iteration(args),
            gpu_memory_gb=gpu_memory_gb,
            memory_source=memory_source,
            domain_source=domain_source,
            hardware_problems=hardware_problems,
            notes=[*launch.notes, *environment_notes(args)],
            assumed=assumed,
            hardware_named=name,
            domain_known=domain_known,
        )


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= 0.01 * GIB else f"{n / MIB:.2f} MiB"


def _count(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _mib(n: float) -> str:
    return f"{n / MIB:.1f} MiB" if n >= 0.1 * MIB else f"{n / 1024:.1f} KiB"


def format_report(report: RecipeReport) -> str:
    a, layout, mem = report.args, report.layout, report.memory
    ep, pp = a.expert_model_parallel_size, a.pipeline_model_parallel_size
    edp = a.world_size // (
        ep * (a.expert_tensor_parallel_size or a.tensor_model_parallel_size) * pp
    )
    racks = -(-a.world_size // layout.rack_size)
    launch = report.launch
    nodes = f"{_plural(launch.nnodes, 'node')} x {_plural(launch.nproc_per_node, 'GPU')}"
    lines = [f"== {launch.source}", *report.header]
    if launch.launcher:
        lines.append(
            f"launch (read from the recipe, not run): {launch.launcher} {Path(launch.script).name} "
            f"-> {nodes}"
        )
    lines.append(hardware_line(report))
    lines += [
        f"world size {a.world_size} = {nodes} in {_plural(racks, 'scale-up domain')} of "
        f"{_plural(layout.rack_size, 'GPU')}; "
        f"TP{a.tensor_model_parallel_size} PP{pp} EP{ep} expert-DP{edp} "
        f"(attention DP{a.data_parallel_size})",
        f"precision: {precision_text(a)}",
        f"{report.checks}: passed (--moe-balancer "
        f"{a.moe_balancer}"
        + (
            f", {a.moe_balancer_num_slots} redundant slots per rank)"
            if a.moe_balancer != registry.NONE
            else ")"
        ),
        f"model: {a.num_layers} layers ({sum(moe_layer_pattern(a))} MoE"
        f"{f', + {a.mtp_num_layers} MTP' if a.mtp_num_layers else ''}), hidden {a.hidden_size}, "
        f"{a.num_experts} experts top-{a.moe_router_topk}, expert FFN {a.moe_ffn_hidden_size}; "
        f"{_count(mem.total_params)} parameters, {_count(mem.active_params)} active "
        "(embeddings included, MTP not)",
    ]
    balanced = balanced_moe_layer_ids(a)
    if balanced:
        mtp = [i for i in balanced if i > a.num_layers]
        lines.append(
            f"balanced MoE layers (--moe-balancer {a.moe_balancer}): "
            f"{len(balanced) - len(mtp)} decoder{f' + {len(mtp)} MTP' if mtp else ''}, "
            f"ids {_id_ranges(balanced)}"
        )
    lines += [
        f"model FLOPs per iteration (Megatron's formula, global batch {a.global_batch_size}): "
        f"{report.flops:.3e}",
        "rank layout (global ranks):",
    ]
    for name, groups in (
        ("EP", layout.ep_groups),
        ("PP", layout.pp_groups),
        ("expert-DP", layout.expert_dp_groups),
        ("DP", layout.dp_groups),
    ):
        spans = [len(layout.racks(g)) for g in groups]
        shown = "; ".join(span(g) for g in groups[:3]) + (" ..." if len(groups) > 3 else "")
        lines.append(
            f"  {len(groups):4d} {name:9s} groups of {len(groups[0]):4d}: {shown}  "
            f"-> {_domains_spanned(min(spans), max(spans))}"
        )
    problems = report.problems()
    layout_ok = not layout.problems()
    if not layout.spans_domains():
        lines.append("  EP groups inside one scale-up domain: " + ("yes" if layout_ok else "NO"))
    elif not layout.replicas:
        lines.append(
            "  EP groups span scale-up domains (no replicas with --moe-balancer none): "
            + ("yes" if layout_ok else "NO")
        )
    elif layout.balancer_domain is None:
        lines.append(
            "  EP groups span scale-up domains, without --moe-balancer-domain-size: "
            + ("yes" if layout_ok else "NO")
        )
    else:
        lines.append(
            f"  EP groups span scale-up domains; balancer domains of "
            f"--moe-balancer-domain-size {layout.balancer_domain} inside one: "
            + ("yes" if layout_ok else "NO")
        )
    weights = (
        "weights (linear layers' as two fp8 copies: --fp8-param-gather)"
        if getattr(a, "fp8_param_gather", False)
        else "weights (+ two cached fp8 copies of the linear layers': fp8)"
        if getattr(a, "fp8", None)
        else "weights"
    )
    lines.append(
        f"memory per rank ({weights} + fp32 main grads + optimizer states; replica slots; "
        "activations):"
    )
    mtp_moe = built_mtp_layers(a) * moe_layer_pattern(a)[-1]
    for s in mem.stages:
        mtp_here = mtp_moe if s.stage == len(mem.stages) - 1 else 0
        lines.append(
            f"  stage {s.stage}: layers {layer_ranges(s.layers)} ({s.moe_layers - mtp_here} MoE"
            f"{f' + {mtp_here} MTP' if mtp_here else ''}), {_count(s.dense_params)} dense + "
            f"{_count(s.expert_params)} expert params: model states {_gib(s.model_states)}; "
            f"{s.num_slots} slots {_gib(s.slots_with_reuse)} (without cross-layer reuse "
            f"{_gib(s.slots_without_reuse)}); activations {_gib(s.activations)}; peak {_gib(s.peak)}"
        )
    s = max(mem.stages, key=lambda st: st.moe_layers)
    lines.append(
        f"  one redundant slot, per rank: {_mib(s.slot_weight_bytes)} weights + "
        f"{_mib(s.slot_grad_bytes)} fp32 grads, one buffer shared by the rank's {s.moe_layers} MoE layers "
        f"(cross-layer reuse, UltraEP paper §4.1); {_gib(s.slot_weight_bytes * s.moe_layers)} + "
        f"{_gib(s.slot_grad_bytes * s.moe_layers)} if every layer had its own"
    )
    act = mem.activations[0] if mem.activations else None
    if act is not None:
        recompute = (
            f"full recompute ({a.recompute_method}, {a.recompute_num_layers} layer(s))"
            if a.recompute_granularity == "full"
            else f"selective recompute of {', '.join(a.recompute_modules or [])}"
            if a.recompute_granularity == "selective"
            else "no recompute"
        )
        sp = ", sequence parallel" if a.sequence_parallel else ""
        lines.append(
            f"  activations: sequence {a.seq_length} x micro batch {a.micro_batch_size}, TP{a.tensor_model_parallel_size}"
            f" CP{a.context_parallel_size}{sp}, {recompute}; stage 0 holds {act.in_flight:g} "
            f"microbatch{'' if act.in_flight == 1 else 'es'} of {_gib(act.per_microbatch)}; last stage's logits "
            f"{_gib(mem.activations[-1].logits)}; + {RUNTIME_RESERVE_GIB:g} GiB runtime allowance per rank"
        )
    peak = max(mem.stages, key=lambda st: st.peak)
    margin = report.margin_bytes()
    lines.append(
        f"  budget {report.gpu_memory_gb:g} GiB per GPU ({report.memory_source}): largest peak "
        f"{_gib(peak.peak)} (stage {peak.stage}), margin "
        f"{'-' if margin < 0 else ''}{_gib(abs(margin))}: "
        + ("fits" if margin >= 0 else "DOES NOT FIT")
    )
    for note in [*report.notes, *batch_notes(report)]:
        lines.append(f"  NOTE: {report.rename(note) if report.rename else note}")
    for problem in problems:
        lines.append(f"  PROBLEM: {problem}")
    if report.rename:  # a Bridge recipe: its fields and enable_ultraep's arguments, not flags
        lines = [report.rename(line) for line in lines]
    return "\n".join(lines)


def layer_ranges(layers) -> str:
    """The layers a stage holds as runs: ``1-3`` for one chunk, ``1-2, 25-27, 49-51`` for the
    chunks of virtual pipeline stages (a first-last span would read as every layer between)."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def _domains_spanned(low: int, high: int) -> str:
    if high == 1:
        return "each inside one scale-up domain"
    if low == high:
        return f"each spans {low} scale-up domains"
    return f"each spans {low} to {high} scale-up domains"


def hardware_line(report: RecipeReport) -> str:
    """What hardware the recipe is checked for: named (the preset, or the checker's options), or,
    loudly, what was assumed and how to name it."""
    domain = f"NVLink domains of {_plural(report.layout.rack_size, 'GPU')}"
    memory = f"{report.gpu_memory_gb:g} GiB per GPU"
    preset = f"--moe-balancer-hardware {report.hardware_named}" if report.hardware_named else None
    if report.domain_source != preset:
        domain += f" ({report.domain_source})"
    if report.memory_source != preset:
        memory += f" ({report.memory_source})"
    if report.assumed and not preset:
        given = [
            text
            for text, source in ((domain, report.domain_source), (memory, report.memory_source))
            if not source.startswith("ASSUMED")
        ]
        return (
            "hardware: "
            + "".join(f"{text}, " for text in given)
            + f"NOT NAMED, ASSUMED {'; '.join(report.assumed)}; {NAME_THE_HARDWARE}"
        )
    if preset:
        from ultraep_megatron.settings.hardware import hardware_preset

        hw = hardware_preset(report.hardware_named)
        return (
            f"hardware: {report.hardware_named} ({preset.split()[0]}): {domain}, {memory}, "
            f"{hw.peak_tflops:g} TFLOP/s bf16, {hw.hbm_tbps:g} TB/s HBM"
        )
    return f"hardware: {domain}, {memory}"


def precision_text(a: argparse.Namespace) -> str:
    """The training precision in words: bf16 / fp16 / fp32, or fp8 with its format and recipe."""
    base = "bf16" if a.bf16 else "fp16" if a.fp16 else "fp32"
    if not getattr(a, "fp8", None):
        return base
    recipe = getattr(getattr(a, "fp8_recipe", None), "value", getattr(a, "fp8_recipe", None))
    params = (
        "fp8 parameters (--fp8-param-gather)"
        if getattr(a, "fp8_param_gather", False)
        else f"{base} parameters"
    )
    return f"fp8 GEMMs (--fp8-format {a.fp8}, --fp8-recipe {recipe}), {params}, {base} elsewhere"


#: Microbatches per data-parallel rank and iteration above which the report notes the batch.
MANY_MICROBATCHES = 256


def batch_notes(report: RecipeReport) -> list[str]:
    """A note when the global batch makes one iteration very long for the job's size: many
    microbatches per data-parallel rank (a rack-scale batch on a few nodes)."""
    a = report.args
    per_rank = a.global_batch_size // (a.micro_batch_size * a.data_parallel_size)
    if per_rank <= MANY_MICROBATCHES:
        return []
    return [
        f"global batch {a.global_batch_size} on {_plural(report.launch.nnodes, 'node')} is {per_rank} "
        f"microbatches of {a.micro_batch_size} per data-parallel rank in every iteration (the rack "
        "recipes' batch); for a first run set a smaller one, GLOBAL_BATCH_SIZE=... (recipes) or "
        "--global-batch-size"
    ]


def _id_ranges(ids: Sequence[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
