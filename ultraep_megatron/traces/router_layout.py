"""The layout a Megatron routing trace is read with (:mod:`.router`): how a run's ranks and layers
map onto EP groups and layer numbers (:class:`RouterTraceLayout`), from flags or from the run's own
arguments (:func:`read_run_args`: Megatron's log, a wandb ``config.yaml``, or a JSON/YAML mapping),
which must agree. No Megatron import.
"""

from __future__ import annotations

import ast
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .pipeline import PipelineSplitError, pipeline_stages

__all__ = ["RouterTraceLayout", "read_run_args"]

#: Megatron's argument dump at start-up: "  name ........ value".
_ARG_LINE = re.compile(r"^\s{2}(\w+) \.+ (.*)$")


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def read_run_args(path: str | os.PathLike) -> dict[str, Any]:
    """Megatron's arguments of a run (``expert_model_parallel_size``, ``num_experts``...).

    ``path``: the run's log (rank 0 prints every argument at start-up, between "arguments" rulers),
    a wandb ``config.yaml`` of the run (``name: {value: v}``), or a JSON / YAML mapping name -> value.

    Raises:
        ValueError: when the file holds none of these.
    """
    path = Path(path)
    text = path.read_text(errors="replace")
    found = {
        m.group(1): _value(m.group(2).strip())
        for line in text.splitlines()
        if (m := _ARG_LINE.match(line))
    }
    if "expert_model_parallel_size" in found or "num_experts" in found:
        return found
    try:
        data = json.loads(text)
    except ValueError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            data = None
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: neither a Megatron log with its argument dump nor a JSON/YAML mapping "
            "of arguments"
        )
    return {k: (v["value"] if isinstance(v, dict) and "value" in v else v) for k, v in data.items()}


@dataclass(frozen=True)
class RouterTraceLayout:
    """How a run's ranks and layers map onto EP groups and layer numbers.

    Attributes:
        ep_size: ``--expert-model-parallel-size`` (R, ranks per EP group).
        num_experts: ``--num-experts`` (E).
        num_layers: ``--num-layers``; needed for MTP records and pipeline parallelism.
        pp_size: ``--pipeline-model-parallel-size``.
        first_stage_layers / last_stage_layers: ``--decoder-first/last-pipeline-num-layers``.
        account_for_embedding / account_for_loss: ``--account-for-embedding/loss-in-pipeline-split``.
        recompute: the MoE layers' routers run again in the backward (MoE or full activation
            recompute): 2 calls per microbatch, the second dropped (see the module docstring).
        num_microbatches: microbatches per step; when known, every (rank, step, layer) must have
            this many records.
        world_size: the run's world size; when known, the number of rank files must equal it.
        meta: facts about the model for the cost model (``hidden_size``, ``moe_ffn_hidden_size``,
            ``swiglu``, ``topk``, ``num_layers``).
    """

    ep_size: int
    num_experts: int
    num_layers: Optional[int] = None
    pp_size: int = 1
    num_microbatches: Optional[int] = None
    world_size: Optional[int] = None
    meta: Optional[dict] = None
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    account_for_embedding: bool = False
    account_for_loss: bool = False
    recompute: bool = False

    def stages(self) -> Optional[list[range]]:
        """The 1-based global decoder layers of each pipeline stage (``None``: no pipeline, or
        ``num_layers`` unknown).

        Raises:
            ValueError: the layers do not split so, naming the flags.
        """
        if self.pp_size == 1 and self.first_stage_layers is None and self.last_stage_layers is None:
            return None
        if self.num_layers is None:
            raise ValueError(
                f"with --pipeline-model-parallel-size {self.pp_size} the layer numbers need "
                "--num-layers (or --run-args with the run's log or config)"
            )
        try:
            return pipeline_stages(
                self.num_layers,
                self.pp_size,
                first=self.first_stage_layers,
                last=self.last_stage_layers,
                account_for_embedding=self.account_for_embedding,
                account_for_loss=self.account_for_loss,
            )
        except PipelineSplitError as error:
            raise ValueError(
                f"{error}, so the run must have split them otherwise: give its "
                "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers "
                "(or --run-args with its log or config)"
            ) from None

    @classmethod
    def resolve(
        cls,
        *,
        ep_size: Optional[int] = None,
        num_experts: Optional[int] = None,
        num_layers: Optional[int] = None,
        pp_size: Optional[int] = None,
        first_stage_layers: Optional[int] = None,
        last_stage_layers: Optional[int] = None,
        run_args: Optional[dict] = None,
    ) -> "RouterTraceLayout":
        """The layout from explicit values (flags) and the run's arguments, which must agree.

        Raises:
            ValueError: naming the flag that is missing or that contradicts the run's arguments.
        """
        args = dict(run_args or {})

        def pick(flag: str, key: str, given, required: bool):
            known = args.get(key)
            if given is not None and known is not None and int(given) != int(known):
                raise ValueError(
                    f"{flag} {given} contradicts the run's arguments ({key} = {known})"
                )
            value = given if given is not None else known
            if value is None and required:
                raise ValueError(
                    f"Megatron's routing trace does not say {key}: give {flag} "
                    "(or --run-args with the run's log or config)"
                )
            return None if value is None else int(value)

        ep = pick("--expert-model-parallel-size", "expert_model_parallel_size", ep_size, True)
        experts = pick("--num-experts", "num_experts", num_experts, True)
        layers = pick("--num-layers", "num_layers", num_layers, False)
        pp = (
            pick("--pipeline-model-parallel-size", "pipeline_model_parallel_size", pp_size, False)
            or 1
        )
        first = pick(
            "--decoder-first-pipeline-num-layers",
            "decoder_first_pipeline_num_layers",
            first_stage_layers,
            False,
        )
        last = pick(
            "--decoder-last-pipeline-num-layers",
            "decoder_last_pipeline_num_layers",
            last_stage_layers,
            False,
        )
        if args.get("pipeline_model_parallel_layout") not in (None, "None"):
            raise ValueError(
                "the run sets --pipeline-model-parallel-layout: layer numbers from a layout "
                "string are not read here"
            )
        if args.get("use_tp_pp_dp_mapping"):
            raise ValueError(
                "the run uses --use-tp-pp-dp-mapping: its pipeline stages are not blocks of "
                "consecutive ranks, as read here"
            )
        if ep < 1 or experts < 1 or experts % ep:
            raise ValueError(
                f"--num-experts {experts} must be a positive multiple of "
                f"--expert-model-parallel-size {ep}"
            )
        if (args.get("expert_tensor_parallel_size") or 1) != 1:
            raise ValueError(
                "the run has --expert-tensor-parallel-size "
                f"{args['expert_tensor_parallel_size']}: its EP groups are not consecutive "
                "ranks (and UltraEP balances expert-TP 1 only)"
            )
        if (args.get("virtual_pipeline_model_parallel_size") or 1) != 1:
            raise ValueError(
                "the run uses a virtual pipeline: Megatron's trace names layers by their "
                "index in a model chunk, so chunks of one stage cannot be told apart"
            )
        microbatches = None
        gbs, mbs, dp = (
            args.get(k) for k in ("global_batch_size", "micro_batch_size", "data_parallel_size")
        )
        if gbs and mbs and dp and not args.get("rampup_batch_size"):
            microbatches = int(gbs) // (int(mbs) * int(dp))
        meta = {"source": "megatron --moe-routing-trace-path"}
        for key, arg in (
            ("hidden_size", "hidden_size"),
            ("moe_ffn_hidden_size", "moe_ffn_hidden_size"),
            ("swiglu", "swiglu"),
            ("topk", "moe_router_topk"),
            ("num_layers", "num_layers"),
            ("hardware", "moe_balancer_hardware"),
            ("domain_size", "moe_balancer_domain_size"),
        ):
            if args.get(arg) is not None:
                meta[key] = args[arg]
        if layers is not None:
            meta["num_layers"] = layers
        world = args.get("world_size")
        modules = args.get("recompute_modules") or []
        recompute = args.get("recompute_granularity") == "full" or (
            args.get("recompute_granularity") == "selective" and "moe" in modules
        )
        layout = cls(
            ep,
            experts,
            layers,
            pp,
            microbatches,
            None if world is None else int(world),
            meta,
            first_stage_layers=first,
            last_stage_layers=last,
            account_for_embedding=bool(args.get("account_for_embedding_in_pipeline_split")),
            account_for_loss=bool(args.get("account_for_loss_in_pipeline_split")),
            recompute=recompute,
        )
        layout.stages()  # a split that cannot be is refused here, naming the flags
        if recompute and microbatches is None:
            raise ValueError(
                "the run recomputes its MoE layers in the backward (--recompute-granularity "
                f"{args.get('recompute_granularity')}), so each router runs twice per "
                "microbatch: give --run-args with the run's log, whose global batch, micro "
                "batch and data-parallel size say which calls are forwards"
            )
        return layout
