"""Small-scale variants of the shipped recipes, derived from the recipe files themselves.

A recipe (``recipes/*.sh``) is run, once per ``PRECISION`` preset it lists (:data:`RECIPE_PRESETS`),
with a shim that records its launch (``recipe_check.capture_launch``: nothing is started); every
flag of that launch is then kept as it is, except

* the sizes (:data:`TINY`, :data:`DERIVED`): layers, widths, heads, experts, vocabulary, sequence,
  batch, the parallel sizes (EP 2; PP 2 where the recipe pipelines; expert-data-parallel 2 where
  the recipe's is above 1), so that the model trains on 4-8 CPU ranks;
* the flags a CPU run cannot take (:data:`DROPPED`), each with its reason, which the test prints,
  and the values it cannot take (:data:`REPLACED`: the flex dispatcher runs as alltoall), likewise;
  the fp8 flags are kept where the parameters are fp8 (:data:`FP8_PARAMETER_FLAGS`: megatron's
  fp8-parameter path runs with a stand-in of TE's quantized parameters) and dropped otherwise
  (:data:`FP8_NUMERICS_DROPPED`: fp8 GEMMs alone are TE's kernels);
* megatron's gradient bucket, which the recipes leave at its default, scaled with the expert
  (:func:`scaled_bucket_size`), so experts span buckets as they do at full scale.

A flag added to a recipe therefore reaches its variant unchanged (and a flag no rule knows that the
CPU cannot run makes the variant fail loudly, not vanish). The batch keeps several microbatches per
rank (global batch 16 of micro-batches 2).

Variants run per distinct behaviour (:func:`covering_runs`): what a variant exercises is its
layout and each of its flags, with the value where the value is a word (``softmax``,
``seq_aux_loss``, ``selective``, ``moe``: a choice of code path); numbers (loss coefficients,
epsilons, RoPE bases) and the shrunk sizes tune the same code. A recipe whose every such flag and
layout is already exercised by the variants that run is covered by them and adds no run (an HGX
recipe of a rack recipe's model, say; a recipe's bf16 variant beside its fp8-parameter one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gloo_launch import REPO_ROOT

from ultraep_megatron.megatron.recipe_check import capture_launch

RECIPES = sorted(
    p
    for p in (REPO_ROOT / "recipes").glob("*.sh")
    if p.name not in ("common.sh", "tiny_cpu.sh", "record_trace_kjv.sh")
)

TINY_LAYERS = 4
EP = 2

#: flag -> why a CPU variant runs without it.
DROPPED = {
    "--transformer-impl": "Transformer Engine needs a GPU: the CPU backend runs megatron's local "
    "layers (--transformer-impl local)",
    "--wandb-project": "logging only: the test reads --metrics-jsonl",
    "--wandb-exp-name": "logging only: the test reads --metrics-jsonl",
    "--multi-latent-attention": "megatron-core 0.19's local attention cannot run it (its "
    "DotProductAttention takes no k_channels: MLA needs Transformer "
    "Engine's); the variant runs standard attention",
    "--q-lora-rank": "a multi-latent-attention size (dropped with it)",
    "--kv-lora-rank": "a multi-latent-attention size (dropped with it)",
    "--qk-head-dim": "a multi-latent-attention size (dropped with it)",
    "--qk-pos-emb-head-dim": "a multi-latent-attention size (dropped with it)",
    "--v-head-dim": "a multi-latent-attention size (dropped with it)",
    "--rotary-scaling-factor": "YaRN RoPE scaling, used by multi-latent attention (dropped with it)",
    "--mscale": "YaRN RoPE scaling, used by multi-latent attention (dropped with it)",
    "--mscale-all-dim": "YaRN RoPE scaling, used by multi-latent attention (dropped with it)",
    "--moe-grouped-gemm": "Transformer Engine's grouped-GEMM experts (TEGroupedMLP) need a GPU: "
    "megatron's local spec builds SequentialMLP experts (and its argument check "
    "asks the GPU's compute capability); ultraep with TEGroupedMLP runs in "
    "test_balanced_moe_layer.py's grouped scenario, with torch_grouped_linear "
    "in TE's place",
    "--cuda-graph-impl": "CUDA graphs need a GPU; the modules a balancer accepts and refuses: "
    "tests/megatron/test_capabilities.py's startup acceptance",
    "--cuda-graph-modules": "CUDA graphs need a GPU (dropped with --cuda-graph-impl; "
    "tests/megatron/test_capabilities.py)",
    "--moe-flex-dispatcher-backend": "DeepEP / HybridEP need CUDA; the balanced flex dispatcher runs "
    "over their gloo stand-ins in test_balanced_moe_layer.py's "
    "flex and flex-hybridep scenarios",
    "--delay-wgrad-compute": "megatron delays the weight gradients only of Transformer Engine's linears "
    "(its argument check asserts --transformer-impl transformer_engine); ultraep "
    "with them runs in test_overlapped_schedule.py's delay scenarios (bf16 and "
    "tensorwise fp8), over a stand-in of TE's delayed-wgrad contract",
    "--sequence-parallel": "the variant runs TP 1 (see --tensor-model-parallel-size), where sequence "
    "parallelism has nothing to split",
    "--account-for-embedding-in-pipeline-split": "the variant's 4 layers fill its virtual stages evenly "
    "without counting the embedding (the recipe's 94 + 2 do)",
    "--account-for-loss-in-pipeline-split": "the variant's 4 layers fill its virtual stages evenly without "
    "counting the loss (the recipe's 94 + 2 do)",
    "--moe-balancer-hardware": "its quota floor is in tokens of a full-size expert's GEMM (hundreds), "
    "more than a variant's whole microbatch routes to an expert: "
    "nothing would be replicated; the variant keeps the default floor "
    "(1% of the mean rank load). The preset's floor: test_arguments.py",
}

#: fp8 flags a variant keeps where its parameters are fp8 (``--fp8-param-gather``): the expert
#: weights are then Transformer Engine's quantized parameters, stood in by ``fp8_param_standin``
#: through megatron's own DDP buffers, distributed-optimizer cast and parameter gather (the
#: experts' GEMMs compute on the quantized weights' values; activations stay high precision).
FP8_PARAMETER_FLAGS = (
    "--fp8-format",
    "--fp8-recipe",
    "--fp8-param-gather",
    "--reuse-grad-buf-for-mxfp8-param-ag",
)
#: Why a variant without fp8 parameters drops its fp8 flags.
FP8_NUMERICS_DROPPED = {
    "--fp8-format": "fp8 GEMMs without fp8 parameters: their numerics are Transformer Engine's "
    "kernels' (GPU only), stood in at the layer level by tests/megatron/test_fp8_layer.py "
    "(TE's grouped linear and a current-scaling quantizer); no fp8 parameter goes "
    "through megatron's DDP, so the variant runs as the bf16 one",
    "--fp8-recipe": "an fp8 GEMM setting (dropped with --fp8-format; tests/megatron/test_fp8_layer.py)",
}


def recipe_precisions(recipe: Path) -> list[str]:
    """The ``PRECISION`` presets a recipe runs (its ``PRECISIONS``; recipes/common.sh): bf16 where
    it lists none."""
    found = re.search(r'^PRECISIONS="([^"]*)"', recipe.read_text(), re.MULTILINE)
    return found.group(1).split() if found else ["bf16"]


#: Every recipe with every PRECISION preset it runs: (recipe, precision).
RECIPE_PRESETS = [
    (recipe, precision) for recipe in RECIPES for precision in recipe_precisions(recipe)
]


#: flag -> {a value a CPU run cannot take: (the variant's value, why)}. The variant's value is a word
#: as the recipe's was, so the variant exercises what a recipe that sets it does (covering_runs).
REPLACED = {
    "--moe-token-dispatcher-type": {
        "flex": (
            "alltoall",
            "the flex dispatcher's DeepEP / HybridEP need CUDA: the variant runs "
            "megatron's all-to-all; the balanced flex path runs over their gloo "
            "stand-ins in test_balanced_moe_layer.py's flex and flex-hybridep scenarios",
        ),
    },
}


def _layer_freq(value: str, layers: int) -> str:
    """``([0]*K+[1]*M)`` -> the same kinds in ``layers`` layers: one dense layer first if the
    recipe has any, MoE after."""
    dense = re.match(r"\(?\[0\]\*(\d+)", value.replace(" ", ""))
    first_dense = 1 if dense and int(dense.group(1)) > 0 else 0
    return f"([0]*{first_dense}+[1]*{layers - first_dense})"


@dataclass
class Layout:
    """The recipe's parallel layout at full scale and the variant's."""

    pipeline: int  # the variant's PP
    expert_data: int  # the variant's expert-data-parallel size

    @property
    def world(self) -> int:
        return self.pipeline * EP * self.expert_data


#: Sizes of the variants' model and batch (flag -> value), whatever the recipe's.
TINY = {
    "--num-layers": str(TINY_LAYERS),
    "--hidden-size": "64",
    "--ffn-hidden-size": "128",
    "--num-attention-heads": "4",
    "--num-query-groups": "2",
    "--kv-channels": "16",
    "--max-position-embeddings": "64",
    "--seq-length": "32",
    "--vocab-size": "256",
    "--make-vocab-size-divisible-by": "128",
    "--num-experts": "8",
    "--moe-ffn-hidden-size": "32",
    "--moe-shared-expert-intermediate-size": "32",
    "--moe-router-topk": "2",
    "--moe-router-num-groups": "4",
    "--moe-router-group-topk": "2",
    "--expert-model-parallel-size": str(EP),
    "--micro-batch-size": "2",
    "--global-batch-size": "16",
    "--lr-warmup-iters": "2",
}

#: Flags whose variant value depends on the recipe's value or the variant's layout:
#: flag -> (layout, the recipe's values) -> the variant's value.
DERIVED: dict[str, Callable[[Layout, list[str]], str]] = {
    "--moe-layer-freq": lambda layout, values: _layer_freq(values[0], TINY_LAYERS),
    "--pipeline-model-parallel-size": lambda layout, values: str(layout.pipeline),
    "--decoder-first-pipeline-num-layers": lambda layout, values: str(
        TINY_LAYERS // layout.pipeline
    ),
    "--decoder-last-pipeline-num-layers": lambda layout, values: str(
        TINY_LAYERS // layout.pipeline
    ),
    # Interleaved: one layer per virtual stage (TINY_LAYERS = PP x VPP at PP 2).
    "--num-virtual-stages-per-pipeline-rank": lambda layout, values: str(
        TINY_LAYERS // layout.pipeline
    ),
    # A few CPU ranks: TP 1 (ultraep's experts run at expert-TP 1 whatever the TP size; attention TP
    # is megatron's own code path, not the balanced layer's).
    "--tensor-model-parallel-size": lambda layout, values: "1",
    # The recipes' node-sized domain (8 EP ranks per NVLink domain) becomes the variant's whole EP
    # group: a domain must divide the EP size, and a smaller one (1) would leave no rank to host a
    # replica. Domains smaller than the EP group train in test_domain_training.py.
    "--moe-balancer-domain-size": lambda layout, values: str(EP),
}


#: megatron-core 0.19's default gradient bucket, in elements (the recipes set none).
MEGATRON_BUCKET_SIZE = 40_000_000


def expert_params(hidden: int, ffn: int, gated: bool) -> int:
    """Elements of one routed expert (fc1, doubled by a gated unit, and fc2; no biases)."""
    return hidden * ffn * (3 if gated else 2)


def scaled_bucket_size(flags) -> int:
    """megatron's default bucket scaled as the expert is: a bucket holds the same fraction of an
    expert as at full scale (a DeepSeek-V3 expert, 44M elements, spans two 40M buckets), so the
    variant's experts cross bucket boundaries where the recipe's do."""
    gated = any(f == "--swiglu" for f, _ in flags)
    full = expert_params(
        int(_value(flags, "--hidden-size")), int(_value(flags, "--moe-ffn-hidden-size")), gated
    )
    tiny = expert_params(int(TINY["--hidden-size"]), int(TINY["--moe-ffn-hidden-size"]), gated)
    return max(1, MEGATRON_BUCKET_SIZE * tiny // full)


def parse_flags(argv: list[str]) -> list[tuple[str, list[str]]]:
    """``--flag v1 v2 --switch ...`` -> [(flag, values)], in order."""
    out: list[tuple[str, list[str]]] = []
    for token in argv:
        if token.startswith("--"):
            out.append((token, []))
        elif not out:
            raise ValueError(f"a value before the first flag: {token!r}")
        else:
            out[-1][1].append(token)
    return out


def _value(flags, name, default=None):
    values = [v for f, v in flags if f == name]
    return values[-1][0] if values else default


@dataclass
class Variant:
    """A recipe's small-scale variant in one ``PRECISION`` preset: its launch and the layouts it
    runs in."""

    recipe: Path
    layout: Layout
    args: list[str]
    precision: str = "bf16"
    dropped: dict[str, str] = field(default_factory=dict)
    shrunk: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """``<recipe stem>`` (bf16, the recipes' default) or ``<recipe stem>:<precision>``."""
        return (
            self.recipe.stem if self.precision == "bf16" else f"{self.recipe.stem}:{self.precision}"
        )

    @property
    def fp8_parameters(self) -> bool:
        """Whether its expert weights are fp8 parameters (``--fp8-param-gather`` kept)."""
        return "--fp8-param-gather" in self.args

    @property
    def key(self) -> tuple:
        """What the variant runs: recipes whose variants share it share their runs."""
        return (self.layout.pipeline, self.layout.expert_data, tuple(self.args))

    @property
    def floor_ep(self) -> int:
        """The EP size of the noise-floor partner: the same ranks and PP, another EP (4, or 1 where
        the data-parallel size is below 4), so every expert's gradient is summed over other
        row partitions, as balancing does (the runs share their initial weights through a
        checkpoint)."""
        data_parallel = self.layout.world // self.layout.pipeline
        return 4 if data_parallel % 4 == 0 else 1

    def launch_args(
        self, balancer: str, *, train_iters: int, ep: int = EP, fp8_parameters: bool = True
    ) -> list[str]:
        """The variant's arguments with ``--moe-balancer balancer``, ``train_iters`` and EP ``ep``;
        without its fp8-parameter flags if not ``fp8_parameters`` (the initial checkpoint: the
        stand-in of TE's quantized parameters saves no checkpoint, and megatron loads a
        high-precision one into fp8 parameters by quantizing it)."""
        flags = parse_flags(self.args)
        if not fp8_parameters:
            flags = [(flag, values) for flag, values in flags if flag not in FP8_PARAMETER_FLAGS]
        args = [token for flag, values in flags for token in (flag, *values)]
        for flag, value in (
            ("--moe-balancer", balancer),
            ("--train-iters", str(train_iters)),
            ("--expert-model-parallel-size", str(ep)),
        ):
            args[args.index(flag) + 1] = value
        return args


#: Flags each run of a variant sets itself (``Variant.launch_args``).
PER_RUN = ("--moe-balancer", "--train-iters", "--expert-model-parallel-size")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def behaviour(variant: "Variant") -> frozenset:
    """What a variant exercises: its layout; each flag, with its word values (a size or number
    tunes, a word selects: module docstring); a shrunk flag by its presence. fp8 parameters also
    by the expert-data-parallel size they run at: only above 1 does megatron all-gather the
    quantized bytes (or, with ``--reuse-grad-buf-for-mxfp8-param-ag``, the staged main parameters)
    that other ranks updated, and reduce the scales' amaxes over the group."""
    out = {("layout", f"PP{variant.layout.pipeline} expert-DP{variant.layout.expert_data}")}
    if variant.fp8_parameters:
        recipe = _value(parse_flags(variant.args), "--fp8-recipe")
        out.add(("fp8 parameters", (recipe, f"expert-DP{variant.layout.expert_data}")))
    for flag, values in parse_flags(variant.args):
        if flag in PER_RUN:
            continue
        words = () if flag in variant.shrunk else tuple(v for v in values if not _is_number(v))
        out.add((flag, words))
    return frozenset(out)


def covering_runs(variants: list["Variant"]) -> dict[str, list[str]]:
    """{name of a covered variant: the variants that run what it exercises}; every other variant
    runs. The variants that run are a cheapest set whose behaviours together hold every variant's
    (cost: ranks, what a run's CPU time grows with; then fewer runs; then names), found exactly
    (branching on the behaviour the fewest variants have): e.g. a recipe's bf16 variant is covered
    by its fp8-parameter one, and the recipes' fp8 presets share the runs of their other flags.
    Variants with the same behaviour count once (the first by ranks and name)."""
    behaviours = {v.name: behaviour(v) for v in variants}
    candidates: dict[frozenset, Variant] = {}
    for variant in sorted(variants, key=lambda v: (v.layout.world, v.name)):
        candidates.setdefault(behaviours[variant.name], variant)
    options = list(candidates.values())
    best: list = [None]  # ((ranks, runs), [variants])

    def search(chosen: list, uncovered: frozenset, ranks: int) -> None:
        score = (ranks, len(chosen))
        if best[0] is not None and score >= best[0][0]:
            return
        if not uncovered:
            best[0] = (score, list(chosen))
            return
        item = min(
            uncovered, key=lambda i: (sum(i in behaviours[o.name] for o in options), repr(i))
        )
        for option in options:
            if item in behaviours[option.name]:
                search(
                    [*chosen, option],
                    uncovered - behaviours[option.name],
                    ranks + option.layout.world,
                )

    search([], frozenset().union(*behaviours.values()), 0)
    running = best[0][1]
    covered = {}
    for variant in variants:
        if variant in running:
            continue
        left, by = set(behaviours[variant.name]), []
        while left:  # the running variants that exercise most of what is left, greedily
            most = max(running, key=lambda r: (len(left & behaviours[r.name]), r.name))
            by.append(most.name)
            left -= behaviours[most.name]
        covered[variant.name] = by
    return covered


def small_scale_variant(recipe: Path, precision: str = "bf16") -> Variant:
    """The variant of ``recipe`` with ``PRECISION=precision`` (module docstring)."""
    launch = capture_launch(recipe, env={"PRECISION": precision})
    flags = parse_flags(launch.args)
    fp8_parameters = any(flag == "--fp8-param-gather" for flag, _ in flags)
    pipeline = int(_value(flags, "--pipeline-model-parallel-size", "1"))
    ep = int(_value(flags, "--expert-model-parallel-size", "1"))
    context = int(_value(flags, "--context-parallel-size", "1"))
    expert_data = launch.world_size // (pipeline * ep)  # expert-TP 1: EP x expert-DP = TP x CP x DP
    if context != 1:
        raise ValueError(f"{recipe.name}: CP > 1 has no CPU variant here")
    # megatron's overlapped schedule needs EP > 1, also in the noise floor's partner (Variant.floor_ep):
    # expert-DP 2, so that EP 4 fits on the same ranks.
    overlapped = any(flag == "--overlap-moe-expert-parallel-comm" for flag, _ in flags)
    layout = Layout(
        pipeline=min(pipeline, 2), expert_data=2 if expert_data > 1 or overlapped else 1
    )
    variant = Variant(recipe=recipe, layout=layout, args=[], precision=precision)
    if not any(flag == "--ddp-bucket-size" for flag, _ in flags):
        flags.append(("--ddp-bucket-size", [str(scaled_bucket_size(flags))]))
    for flag, values in flags:
        if flag in DROPPED:
            variant.dropped[flag] = DROPPED[flag]
            continue
        if flag in FP8_NUMERICS_DROPPED and not fp8_parameters:
            variant.dropped[flag] = FP8_NUMERICS_DROPPED[flag]
            continue
        if len(values) == 1 and values[0] in REPLACED.get(flag, {}):
            new, why = REPLACED[flag][values[0]]
            variant.dropped[f"{flag} {values[0]}"] = f"{new} instead: {why}"
            values = [new]
            if _value(parse_flags(variant.args), flag) == new:
                continue  # already the variant's value (megatron takes a flag's last)
        if flag in TINY or flag in DERIVED:
            new = [TINY[flag]] if flag in TINY else [DERIVED[flag](layout, values)]
            variant.shrunk[flag] = (values, new)
            values = new
        else:
            variant.kept.append(flag)
        variant.args += [flag, *values]
    return variant
