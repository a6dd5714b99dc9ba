"""Check a launch recipe on this machine, without GPUs: arguments, rank layout, memory per rank.

For each recipe (a bash script under ``recipes/`` that ends in ``python -m torch.distributed.run
... pretrain_gpt.py ARGS``):

1. the launch is captured, not run: the recipe is executed with ``ULTRAEP_PYTHON`` pointing at a
   shim that records torchrun's command line and exits, so world size = nodes x processes per node
   and ARGS are exactly what the cluster would get (a file without a ``#!`` line that launches
   nothing, like ``recipes/common.sh``, is a library the recipes source: skipped);
2. Megatron's own argument parser and ``validate_args`` run on ARGS for that world size (``RANK=0``,
   ``WORLD_SIZE=N`` in the environment, no process group, no device), then UltraEP's
   ``validate_ultraep_args``, then what Megatron checks only when it starts: the world size
   against the expert grid (ETP x EP x PP x expert-DP, ``initialize_model_parallel``) and the
   global batch against micro batch x DP (the microbatch calculator);
3. the rank layout is printed from Megatron's own ``RankGenerator``: the global ranks of every
   expert-parallel group (each must sit inside one rack), the pipeline and data-parallel groups
   (which span racks);
4. memory per rank and pipeline stage is estimated: bf16 weights, fp32 main gradients, the
   distributed optimizer's fp32 master weights and Adam moments (sharded over data parallelism,
   expert parameters over expert data parallelism), and UltraEP's redundant expert slots with
   cross-layer buffer reuse (one weight + fp32 gradient buffer per slot for all MoE layers, no
   optimizer state; paper §4.1) against the same slots without reuse (one per MoE layer).

Activations are not estimated (they depend on recomputation and the pipeline schedule).
The command line is ``ultraep check-recipe`` (``ultraep_megatron/cli/check_recipe.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence
from unittest import mock

from ultraep_megatron.planner import policy

#: GPUs in one rack-scale node's scale-up domain (an NVL72 rack with 64 GPUs in use, §8.1).
DEFAULT_RACK_SIZE = 64
#: What validation on a machine without a GPU answers when Megatron asks the device's compute
#: capability (``--moe-grouped-gemm`` needs >= 8): a Hopper GPU's, the oldest the recipes target.
TARGET_CAPABILITY = (9, 0)
GIB = 1024 ** 3
MIB = 1024 ** 2


class RecipeError(Exception):
    """A recipe that cannot launch as written (bad arguments, layout or launch line).

    Args:
        problem: one line saying what is wrong (the checker prints it as a PROBLEM line).
        details: what the recipe or Megatron printed around it, if that helps (shown indented).
    """

    def __init__(self, problem: str, details: str = ""):
        super().__init__(problem)
        self.problem, self.details = problem, details


class NotARecipe(RecipeError):
    """A file that launches nothing and is not meant to: a library the recipes source."""


# ----------------------------------------------------------------------------------------------
# 1. Capturing the launch line
# ----------------------------------------------------------------------------------------------

_SHIM = """#!{python}
# Stands in for python in a recipe: records the torchrun command line instead of running it.
# Other python calls of the recipe (data preparation, ...) are skipped.
import json, os, sys
if sys.argv[1:3] == ["-m", "torch.distributed.run"]:
    with open(os.environ["ULTRAEP_CAPTURE_FILE"], "w") as handle:
        json.dump(sys.argv[1:], handle)
"""


@dataclass
class Launch:
    """A captured launch: torchrun's process layout and the training script's arguments."""

    nproc_per_node: int
    nnodes: int
    script: str
    args: list[str]
    source: str = "<arguments>"

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def parse_torchrun_command(argv: Sequence[str], source: str = "<arguments>") -> Launch:
    """A :class:`Launch` from ``python``'s argv, which must be ``-m torch.distributed.run ...``.

    torchrun's own parser reads its options, so every spelling it accepts works.
    """
    argv = list(argv)
    if argv[:2] != ["-m", "torch.distributed.run"]:
        raise RecipeError(f"{source}: expected `python -m torch.distributed.run ...`, got {argv[:4]}")
    from torch.distributed.run import get_args_parser

    options = get_args_parser().parse_args(argv[2:])
    nnodes = "1" if options.standalone else str(options.nnodes)
    if ":" in nnodes:
        raise RecipeError(f"{source}: elastic --nnodes {nnodes} has no fixed world size")
    try:
        nproc = int(options.nproc_per_node)
    except ValueError:
        raise RecipeError(f"{source}: --nproc-per-node {options.nproc_per_node!r} is not a number "
                          "of processes") from None
    return Launch(nproc_per_node=nproc, nnodes=int(nnodes), script=options.training_script,
                  args=list(options.training_script_args), source=source)


def capture_launch(recipe: str | Path, env: dict[str, str] | None = None,
                   timeout_s: float = 60.0) -> Launch:
    """Run ``recipe`` with a python shim that records its torchrun line; nothing is launched.

    The recipe's own shell code does run (it assembles the arguments), with ``RUN_DIR`` (the
    output directory of the CPU recipes) in a scratch directory unless ``env`` sets it; other
    python calls it makes are skipped.

    Args:
        recipe: path of a bash recipe.
        env: extra environment for the recipe (e.g. ``NNODES``, ``DATA_PATH``, ``RUN_DIR``).
        timeout_s: limit for the recipe's own shell code.

    Raises:
        RecipeError: when the recipe fails or never calls ``python -m torch.distributed.run``.
    """
    recipe = Path(recipe)
    if not recipe.is_file():
        raise RecipeError(f"{recipe}: no such recipe")
    with tempfile.TemporaryDirectory(prefix="check_recipe_") as tmp:
        shim = Path(tmp) / "python"
        shim.write_text(_SHIM.format(python=sys.executable))
        shim.chmod(0o755)
        capture = Path(tmp) / "launch.json"
        run_env = {**os.environ, "RUN_DIR": str(Path(tmp) / "run"), **(env or {}),
                   "ULTRAEP_PYTHON": str(shim),
                   "ULTRAEP_CAPTURE_FILE": str(capture)}
        completed = subprocess.run(["bash", str(recipe)], env=run_env, capture_output=True,
                                   text=True, timeout=timeout_s)
        if completed.returncode != 0:
            raise RecipeError(f"{recipe}: the recipe exited with {completed.returncode}",
                              (completed.stdout + completed.stderr)[-3000:])
        if not capture.exists():
            if not recipe.read_bytes().startswith(b"#!"):
                raise NotARecipe(f"{recipe}: no #! line and no launch: a file the recipes source, "
                                 "not a recipe")
            raise RecipeError(f"{recipe}: the recipe never ran $ULTRAEP_PYTHON -m torch.distributed.run")
        argv = json.loads(capture.read_text())
    return parse_torchrun_command(argv, source=str(recipe))


# ----------------------------------------------------------------------------------------------
# 2. Megatron's argument validation for the full world size
# ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def quiet_megatron():
    """Megatron's import-time warnings (no Transformer Engine, Apex or CUDA on this machine) and
    log lines say nothing about a recipe: keep them out of the report."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


@contextlib.contextmanager
def _rank0_of(world_size: int, argv: Sequence[str]):
    """Process environment of global rank 0 in a ``world_size`` job, with ``sys.argv`` = argv."""
    saved_env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    saved_argv = sys.argv
    os.environ.update(RANK="0", WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    sys.argv = list(argv)
    try:
        yield
    finally:
        sys.argv = saved_argv
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def validate_arguments(script_args: Sequence[str], world_size: int) -> tuple[argparse.Namespace, str]:
    """Megatron's parse + ``validate_args`` and UltraEP's ``validate_ultraep_args`` on rank 0 of
    a ``world_size`` job. No process group is created and no device is touched.

    With ``--eval-iters 0`` evaluation never runs, so its batch sizes are left to their defaults
    (the training ones): Megatron's eval-batch check then is the training batch's divisibility,
    which is reported as such.

    Returns:
        (validated arguments, everything Megatron printed while validating).

    Raises:
        RecipeError: with Megatron's (or UltraEP's) message when the arguments are rejected.
    """
    with quiet_megatron():
        from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
        from megatron.training.arguments import parse_args, validate_args

        from ultraep_megatron.megatron.arguments import add_ultraep_args, validate_ultraep_args

    import torch

    printed = io.StringIO()
    no_gpu = contextlib.nullcontext() if torch.cuda.is_available() else \
        mock.patch("torch.cuda.get_device_capability", return_value=TARGET_CAPABILITY)
    try:
        with _rank0_of(world_size, ["pretrain_gpt.py", *script_args]), quiet_megatron(), no_gpu, \
                contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            args = parse_args(extra_args_provider=add_ultraep_args)
            eval_batch_given = (args.eval_global_batch_size, args.eval_micro_batch_size) != (None, None)
            if args.eval_iters == 0:
                args.eval_global_batch_size = args.eval_micro_batch_size = None
                eval_batch_given = False
            validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
            validate_ultraep_args(args)
    except SystemExit:  # argparse: unknown flag or bad value; its last line says which
        lines = printed.getvalue().strip().splitlines()
        error = next((line for line in reversed(lines) if ": error: " in line), lines[-1] if lines else "")
        raise RecipeError(f"Megatron's parser refused the arguments: {error.split(': error: ', 1)[-1]}",
                          "\n".join(lines[-20:])) from None
    except AssertionError as error:
        if str(error).startswith("eval_global_batch_size") and not eval_batch_given:
            raise RecipeError(_batch_problem(args)) from None
        raise RecipeError(f"AssertionError: {error}") from None
    except (ValueError, RuntimeError, TypeError) as error:
        raise RecipeError(f"{type(error).__name__}: {error}") from None
    if args.vocab_size is None:
        raise RecipeError("--vocab-size is needed to size the embeddings (a HuggingFace "
                          "tokenizer ignores it; recipes pass the model's vocabulary size)")
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)
    return args, printed.getvalue()


def _batch_problem(args: argparse.Namespace) -> str:
    return (f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} (world size "
            f"{args.world_size} / (TP x PP x CP)): Megatron's microbatch calculator refuses it at "
            "start-up")


def startup_problems(args: argparse.Namespace) -> list[str]:
    """What Megatron refuses only when it starts, on validated ``args``: one line each.

    ``validate_args`` checks world size = TP x PP x CP x DP; ``initialize_model_parallel`` also
    needs world size = ETP x EP x PP x expert-DP (every rank in a whole EP group: else it raises,
    and its ``RankGenerator`` would leave ranks out or divide by zero), and the microbatch
    calculator needs global batch = micro batch x DP x microbatches.
    """
    problems = []
    pp = args.pipeline_model_parallel_size
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    ep = args.expert_model_parallel_size
    grid = etp * ep * pp
    if args.world_size % grid:
        problems.append(
            f"world size {args.world_size} is not divisible by expert-TP {etp} x EP {ep} x PP {pp} = "
            f"{grid}: Megatron's initialize_model_parallel refuses it (every rank must belong to a "
            f"whole EP group); use a multiple of {grid} GPUs or another --expert-model-parallel-size")
    if not (args.rampup_batch_size or getattr(args, "decrease_batch_size_if_needed", False)) and \
            args.global_batch_size % (args.micro_batch_size * args.data_parallel_size):
        problems.append(_batch_problem(args))
    return problems


# ----------------------------------------------------------------------------------------------
# 3. Rank layout
# ----------------------------------------------------------------------------------------------

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
                out.append(f"EP group {_span(group)} spans racks {self.racks(group)}: expert "
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


def _span(group: Sequence[int]) -> str:
    """'a-b' for a contiguous group, else the first members."""
    group = list(group)
    if group == list(range(group[0], group[0] + len(group))):
        return f"[{group[0]}-{group[-1]}]" if len(group) > 1 else f"[{group[0]}]"
    head = ", ".join(map(str, group[:4]))
    return f"[{head}, ... {group[-1]}] (stride {group[1] - group[0]})" if len(group) > 4 else f"[{head}]"


# ----------------------------------------------------------------------------------------------
# 4. Parameters and memory
# ----------------------------------------------------------------------------------------------

def moe_layer_pattern(args: argparse.Namespace) -> list[bool]:
    """[num_layers] True where the 1-based layer (index + 1) is an MoE layer."""
    if args.num_experts is None:
        return [False] * args.num_layers
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(args.num_layers)]
    if len(freq) != args.num_layers:
        raise RecipeError(f"--moe-layer-freq has {len(freq)} entries for {args.num_layers} layers")
    return [bool(x) for x in freq]


def built_mtp_layers(args: argparse.Namespace) -> int:
    """MTP layers the model holds: one per depth, or one shared by all (``--mtp-use-repeated-layer``)."""
    depths = args.mtp_num_layers or 0
    return min(depths, 1) if getattr(args, "mtp_use_repeated_layer", False) else depths


def balanced_moe_layer_ids(args: argparse.Namespace) -> list[int]:
    """Ids of the MoE layers ``--moe-balancer`` balances (``layer_spec.moe_layer_id``): the
    decoder's MoE layers, then the MTP block's (built from the last decoder layer's spec, numbered
    after the decoder). Empty for ``--moe-balancer none``."""
    if args.moe_balancer == policy.NONE:
        return []
    pattern = moe_layer_pattern(args)
    mtp = range(args.num_layers + 1, args.num_layers + 1 + built_mtp_layers(args))
    return [i + 1 for i, is_moe in enumerate(pattern) if is_moe] + (list(mtp) if pattern[-1] else [])


def _id_ranges(ids: Sequence[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


@dataclass
class LayerParams:
    """Parameters of one transformer layer, split by how Megatron shards them."""

    attention: int          # sharded by TP, replicated over DP
    mlp: int                # dense MLP or shared expert + router + norms: TP / replicated
    experts: int            # routed experts of the layer, all of them: sharded by EP x ETP
    expert_numel: int       # one routed expert (the unit a redundant slot holds)


def _norm(args) -> int:
    return 1 if args.normalization == "RMSNorm" else 2


def attention_params(args: argparse.Namespace) -> int:
    """Self-attention block incl. its input norm (and QK norms / MLA latent norms)."""
    h, norm = args.hidden_size, _norm(args)
    if args.multi_latent_attention:
        heads = args.num_attention_heads
        qk = args.qk_head_dim + args.qk_pos_emb_head_dim
        if args.q_lora_rank is None:
            q = h * heads * qk
        else:  # down-projection, latent norm, up-projection
            q = h * args.q_lora_rank + norm * args.q_lora_rank + args.q_lora_rank * heads * qk
        kv = (h * (args.kv_lora_rank + args.qk_pos_emb_head_dim) + norm * args.kv_lora_rank
              + args.kv_lora_rank * heads * (args.qk_head_dim + args.v_head_dim))
        out = heads * args.v_head_dim * h
        return q + kv + out + norm * h
    kv_channels = args.kv_channels or h // args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    q_width = args.num_attention_heads * kv_channels
    kv_width = groups * kv_channels
    params = h * (q_width + 2 * kv_width) + q_width * h
    if args.add_bias_linear:
        params += q_width + 2 * kv_width + h
    elif args.add_qkv_bias:
        params += q_width + 2 * kv_width
    if args.qk_layernorm:
        params += 2 * norm * kv_channels
    return params + norm * h


def _mlp_params(args, ffn: int) -> int:
    h = args.hidden_size
    up = 2 * ffn if args.swiglu else ffn
    bias = (up + h) if args.add_bias_linear else 0
    return h * up + ffn * h + bias


def layer_params(args: argparse.Namespace, is_moe: bool) -> LayerParams:
    """Parameters of one decoder layer (dense or MoE)."""
    h, norm = args.hidden_size, _norm(args)
    attention = attention_params(args)
    if not is_moe:
        return LayerParams(attention, _mlp_params(args, args.ffn_hidden_size) + norm * h, 0, 0)
    expert = _mlp_params(args, args.moe_ffn_hidden_size)
    shared = (_mlp_params(args, args.moe_shared_expert_intermediate_size)
              if args.moe_shared_expert_intermediate_size else 0)
    if shared and args.moe_shared_expert_gate:
        shared += h
    router = h * args.num_experts + (args.num_experts if args.add_bias_linear else 0)
    return LayerParams(attention, shared + router + norm * h, expert * args.num_experts, expert)


def stage_layers(args: argparse.Namespace) -> list[list[int]]:
    """1-based global decoder layers of every pipeline stage (all virtual stages together),
    from megatron-core's own ``get_num_layers_to_build`` / ``get_transformer_layer_offset``."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if args.pipeline_model_parallel_layout is not None:
        raise RecipeError("--pipeline-model-parallel-layout: the memory estimate splits layers by "
                          "--decoder-first/last-pipeline-num-layers or evenly; not by a layout")
    # The fields these two functions read, from the validated arguments (a TransformerConfig
    # would refuse the GPU-only fusions of a GPU recipe on this machine).
    config = types.SimpleNamespace(
        num_layers=args.num_layers,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=None,
    )
    vp_stages = [None]
    if config.virtual_pipeline_model_parallel_size:
        vp_stages = list(range(config.virtual_pipeline_model_parallel_size))
    stages = []
    for pp_rank in range(args.pipeline_model_parallel_size):
        layers = []
        for vp in vp_stages:
            count = get_num_layers_to_build(config, vp_stage=vp, pp_rank=pp_rank)
            offset = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=pp_rank)
            layers += list(range(offset + 1, offset + count + 1))
        stages.append(layers)
    built = sorted(layer for stage in stages for layer in stage)
    if built != list(range(1, args.num_layers + 1)):
        raise RecipeError(f"pipeline stages build layers {built}, not 1..{args.num_layers}")
    return stages


@dataclass
class StageMemory:
    """Bytes per rank of one pipeline stage (all ranks of a stage hold the same shares)."""

    stage: int
    layers: list[int]
    moe_layers: int                  # MoE layers on the rank (decoder + MTP)
    dense_params: int                # this rank's share of non-expert parameters
    expert_params: int               # this rank's share of routed-expert parameters
    model_states: int                # weights + main grads + optimizer states
    slot_weight_bytes: int           # one redundant slot's weight buffer
    slot_grad_bytes: int             # one redundant slot's fp32 gradient buffer
    num_slots: int

    @property
    def slots_with_reuse(self) -> int:
        """Replica slots shared by all MoE layers of the rank (§4.1)."""
        return self.num_slots * (self.slot_weight_bytes + self.slot_grad_bytes)

    @property
    def slots_without_reuse(self) -> int:
        """The same slots, one set per MoE layer."""
        return self.slots_with_reuse * self.moe_layers

    @property
    def total(self) -> int:
        return self.model_states + self.slots_with_reuse


@dataclass
class MemoryEstimate:
    total_params: int
    active_params: int
    stages: list[StageMemory] = field(default_factory=list)


def _bytes_per_param(args) -> tuple[int, int, int]:
    """(weight, main gradient, optimizer state) bytes per parameter, as Megatron allocates
    them: bf16/fp16 weights, fp32 main grads (``--accumulate-allreduce-grads-in-fp32``, the
    bf16 default) and Adam's fp32 master copy + two moments (the master copy only with bf16/fp16)."""
    half = args.bf16 or args.fp16
    weight = 2 if half else 4
    grad = 4 if (not half or args.accumulate_allreduce_grads_in_fp32) else 2
    optimizer = (4 if half else 0) + (8 if args.optimizer == "adam" else 4)
    return weight, grad, optimizer


def estimate_memory(args: argparse.Namespace) -> MemoryEstimate:
    """Parameters of the model and the model-state memory of one rank per pipeline stage.

    A stage's rank holds: its decoder layers (non-expert parts / TP; routed experts / (EP x
    ETP)); the word embedding on the first stage, the final norm and untied output layer on the
    last; MTP layers (and, with PP > 1, a copy of the word embedding) on the last stage.
    """
    h = args.hidden_size
    tp = args.tensor_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    ep, pp = args.expert_model_parallel_size, args.pipeline_model_parallel_size
    pattern = moe_layer_pattern(args)
    per_layer = {is_moe: layer_params(args, is_moe) for is_moe in {False, *pattern}}
    embedding = args.padded_vocab_size * h
    output = embedding if args.untie_embeddings_and_output_weights else 0
    final_norm = _norm(args) * h
    mtp_layers = built_mtp_layers(args)
    mtp_is_moe = pattern[-1]
    mtp_extra = 2 * _norm(args) * h + 2 * h * h + _norm(args) * h  # enorm, hnorm, eh_proj, norm

    def main_model_params(active: bool) -> int:
        # Published totals leave MTP out (DeepSeek-V3's 671B), and so does this count.
        count = embedding + output + final_norm
        for is_moe in pattern:
            p = per_layer[is_moe]
            experts = p.expert_numel * args.moe_router_topk if (active and is_moe) else p.experts
            count += p.attention + p.mlp + experts
        return count

    estimate = MemoryEstimate(total_params=main_model_params(False),
                              active_params=main_model_params(True))
    weight_b, grad_b, optim_b = _bytes_per_param(args)
    dense_shard = args.data_parallel_size * args.context_parallel_size
    expert_shard = args.world_size // (etp * ep * pp)
    if not args.use_distributed_optimizer:
        dense_shard = expert_shard = 1
    num_slots = args.moe_balancer_num_slots if args.moe_balancer != policy.NONE else 0
    expert_numel = per_layer[True].expert_numel if True in per_layer else 0
    for stage, layers in enumerate(stage_layers(args)):
        dense = sum(per_layer[pattern[l - 1]].attention + per_layer[pattern[l - 1]].mlp
                    for l in layers) / tp
        experts = sum(per_layer[pattern[l - 1]].experts for l in layers) / (ep * etp)
        moe_layers = sum(pattern[l - 1] for l in layers)
        if stage == 0:
            dense += embedding / tp
        if stage == pp - 1:
            dense += (output + final_norm) / tp
            if mtp_layers:
                p = per_layer[mtp_is_moe]
                dense += mtp_layers * (p.attention + p.mlp + mtp_extra) / tp
                experts += mtp_layers * p.experts / (ep * etp)
                moe_layers += mtp_layers * mtp_is_moe
                if pp > 1:
                    dense += embedding / tp  # MTP embeds the shifted tokens itself
            if pp > 1 and not args.untie_embeddings_and_output_weights:
                dense += embedding / tp
        model_states = (dense * (weight_b + grad_b + optim_b / dense_shard)
                        + experts * (weight_b + grad_b + optim_b / expert_shard))
        estimate.stages.append(StageMemory(
            stage=stage, layers=layers, moe_layers=int(moe_layers), dense_params=int(dense),
            expert_params=int(experts), model_states=int(model_states),
            slot_weight_bytes=expert_numel // etp * weight_b,
            slot_grad_bytes=expert_numel // etp * 4, num_slots=num_slots))
    return estimate


def flops_per_iteration(args: argparse.Namespace) -> float:
    """Megatron's own model-FLOPs count of one global batch (what its TFLOP/s/GPU divides)."""
    from megatron.training.training import num_floating_point_operations

    return float(num_floating_point_operations(copy.copy(args), args.global_batch_size))


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------

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
                               if a.moe_balancer != policy.NONE else ")"),
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
        shown = "; ".join(_span(g) for g in groups[:3]) + (" ..." if len(groups) > 3 else "")
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
