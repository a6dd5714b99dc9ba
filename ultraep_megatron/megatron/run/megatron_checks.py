"""Megatron settings that Megatron refuses with a bare assertion, a raw argparse error or only once
the job has started, checked on the parsed command line and said in one line each, naming the flag
and the fix (``pretrain_gpt.py``'s startup check and ``ultraep check-recipe`` run the same checks):

* :func:`megatron_arg_problems`: experts that do not split over the EP ranks, decoder layers that do
  not split over the pipeline stages (with a first-stage count that would), a run that ends before
  its learning-rate warm-up (Megatron's scheduler asserts once the model is built);
* :func:`parser_error_hint`: "did you mean" for a misspelt flag or choice of Megatron's parser (our
  ``--moe-balancer*`` flags included);
* :func:`assertion_problem`: any other assertion of Megatron's ``validate_args`` as one line with
  the flags its failing check reads.

No Megatron import.
"""

from __future__ import annotations

import argparse
import difflib
import re
import traceback
from pathlib import Path
from typing import Iterable, Optional

from ultraep_megatron.traces.pipeline import PipelineSplitError, pipeline_stages

__all__ = ["assertion_problem", "megatron_arg_problems", "parser_error_hint"]


def _experts_problem(args) -> Optional[str]:
    experts, ep = (
        getattr(args, "num_experts", None),
        getattr(args, "expert_model_parallel_size", 1) or 1,
    )
    if experts is None or experts % ep == 0:
        return None
    below = experts - experts % ep
    nearby = [n for n in (below, below + ep) if n > 0]
    # An EP that divides the experts and also the ranks of a pipeline stage's expert grid (world /
    # (expert-TP x PP)), so that the layout it suggests can start on these GPUs.
    world = getattr(args, "world_size", None) or ep
    grid = world // (
        (getattr(args, "expert_tensor_parallel_size", 1) or 1)
        * (getattr(args, "pipeline_model_parallel_size", 1) or 1)
    )
    divisors = [
        d for d in range(min(ep, experts), 0, -1) if experts % d == 0 and grid % max(d, 1) == 0
    ][:1] or [1]
    return (
        f"--num-experts {experts} is not a multiple of --expert-model-parallel-size {ep}: every EP rank "
        f"holds the same number of experts (Megatron asserts it); use {' or '.join(map(str, nearby))} "
        f"experts, or --expert-model-parallel-size {divisors[0]}"
    )


def _pipeline_problem(args) -> Optional[str]:
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if (
        pp == 1
        and getattr(args, "decoder_first_pipeline_num_layers", None) is None
        and getattr(args, "decoder_last_pipeline_num_layers", None) is None
    ):
        return None
    if getattr(args, "num_layers", None) is None or any(
        getattr(args, name, None) is not None
        for name in (
            "pipeline_model_parallel_layout",
            "num_layers_per_virtual_pipeline_stage",
            "num_virtual_stages_per_pipeline_rank",
            "hybrid_layer_pattern",
        )
    ):
        return None  # virtual pipelines and layouts: Megatron's own checks (assertion_problem)
    try:
        pipeline_stages(
            args.num_layers,
            pp,
            first=args.decoder_first_pipeline_num_layers,
            last=args.decoder_last_pipeline_num_layers,
            account_for_embedding=bool(
                getattr(args, "account_for_embedding_in_pipeline_split", False)
            ),
            account_for_loss=bool(getattr(args, "account_for_loss_in_pipeline_split", False)),
        )
    except PipelineSplitError as error:
        fix = (
            f"; give the first stage its own count, e.g. {error.suggestion} (or the last stage, "
            "--decoder-last-pipeline-num-layers)"
            if error.suggestion
            else ""
        )
        return f"{error} (Megatron refuses it){fix}"
    return None


def _warmup_problem(args) -> Optional[str]:
    """Megatron's scheduler asserts warm-up steps < decay steps when it is built, after the model."""
    if getattr(args, "lr_warmup_fraction", None) is not None:
        return None
    if getattr(args, "train_iters", None):
        warmup, flag_w = args.lr_warmup_iters or 0, "--lr-warmup-iters"
        decay, flag_d = (
            (args.lr_decay_iters, "--lr-decay-iters")
            if args.lr_decay_iters
            else (args.train_iters, "--train-iters")
        )
    elif getattr(args, "train_samples", None):
        warmup, flag_w = args.lr_warmup_samples or 0, "--lr-warmup-samples"
        decay, flag_d = (
            (args.lr_decay_samples, "--lr-decay-samples")
            if args.lr_decay_samples
            else (args.train_samples, "--train-samples")
        )
    else:
        return None
    if warmup < decay:
        return None
    return (
        f"{flag_d} {decay} does not reach past the learning-rate warm-up ({flag_w} {warmup}): Megatron's "
        f"learning-rate scheduler refuses it once the model is built (the warm-up must end before the "
        f"decay); use {flag_d} above {warmup} or a shorter {flag_w}"
    )


def megatron_arg_problems(args: argparse.Namespace) -> list[str]:
    """What Megatron would refuse in these parsed (not yet validated) arguments with a bare assertion,
    or only after the job started; one line each naming the flag and the fix."""
    return [
        p for p in (_experts_problem(args), _pipeline_problem(args), _warmup_problem(args)) if p
    ]


_INVALID_CHOICE = re.compile(
    r"argument (\S+?)(?:/\S+)?: invalid choice: '(.*)' \(choose from (.*)\)$"
)


def parser_error_hint(message: str, option_strings: Iterable[str]) -> str:
    """``message`` (argparse's error for Megatron's parser) with a "did you mean" for each
    unrecognized flag close to one of ``option_strings`` and for an invalid choice close to a
    valid one."""
    choice = _INVALID_CHOICE.match(message)
    if choice:
        choices = [c.strip().strip("'") for c in choice.group(3).split(",")]
        close = difflib.get_close_matches(choice.group(2), choices, n=1, cutoff=0.5)
        return message + (f"; did you mean {choice.group(1)} {close[0]}?" if close else "")
    if message.startswith("unrecognized arguments: "):
        options = sorted(set(option_strings))
        hints = []
        for word in message.split(": ", 1)[1].split():
            flag = word.split("=", 1)[0]
            if not flag.startswith("--"):
                continue
            close = difflib.get_close_matches(flag, options, n=1, cutoff=0.75)
            if close:
                hints.append(f"{flag}: did you mean {close[0]}?")
        return message + (f" ({'; '.join(hints)})" if hints else "")
    return message


def assertion_problem(error: AssertionError) -> str:
    """One line for an assertion of Megatron's argument validation. Many are bare (``assert
    args.micro_batch_size is not None``): the failing line is then the message, with the flags its
    ``args.<name>`` attributes stand for."""
    if str(error):
        return f"Megatron's argument check failed: {' '.join(str(error).split())}"
    frame = traceback.extract_tb(error.__traceback__)[-1]
    flags = sorted(
        {f"--{name.replace('_', '-')}" for name in re.findall(r"\bargs\.(\w+)", frame.line or "")}
    )
    where = f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno}"
    return f"Megatron's validate_args failed `{frame.line}` ({where})" + (
        f": check {', '.join(flags)}" if flags else ""
    )
