"""Megatron's decoder layers per pipeline stage, as megatron-core 0.19 numbers them.

A pipeline stage builds a contiguous run of decoder layers (no virtual pipeline): evenly split over
``--pipeline-model-parallel-size`` stages, or with the first and/or last stage given its own count
(``--decoder-first-pipeline-num-layers``, ``--decoder-last-pipeline-num-layers``) and the rest split
evenly over the middle stages, or with the embedding and/or the loss counted as one layer of the
first / last stage (``--account-for-embedding-in-pipeline-split``, ``--account-for-loss-in-pipeline-split``).
It mirrors megatron-core's ``get_num_layers_to_build`` and ``get_transformer_layer_offset`` (tested
against them: ``tests/traces/test_pipeline.py``) without importing Megatron: a routing trace names a
layer by its index on its stage, and its 1-based global number is the stage's offset + index + 1.
Megatron refuses a split that does not come out whole, with a bare assertion or at model build;
:func:`pipeline_stages` says why, naming the flags, and offers a first-stage count that works.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["PipelineSplitError", "pipeline_stages", "first_stage_suggestion"]


class PipelineSplitError(ValueError):
    """A layer count that does not split over the pipeline stages as given (the message names the
    flags); ``suggestion`` is a flag with a value that would split it, or ``""``."""

    def __init__(self, message: str, suggestion: str = ""):
        super().__init__(message)
        self.suggestion = suggestion


def first_stage_suggestion(num_layers: int, pp_size: int, last: Optional[int] = None) -> str:
    """A ``--decoder-first-pipeline-num-layers`` value that splits ``num_layers`` (less ``last`` on
    the last stage) over ``pp_size`` stages: the other stages get as many as possible evenly, the
    first at least one. ``""`` when there is none."""
    middle = pp_size - 1 - (last is not None)
    rest = num_layers - (last or 0)
    if middle < 1:
        return ""
    stages = middle + 1  # the first stage and the middle ones share what the last leaves
    for per in (-(-rest // stages), rest // stages, *range(rest // stages - 1, 0, -1)):
        first = rest - middle * per
        if per >= 1 and first >= 1:
            return f"--decoder-first-pipeline-num-layers {first}"
    return ""


def pipeline_stages(
    num_layers: int,
    pp_size: int,
    *,
    first: Optional[int] = None,
    last: Optional[int] = None,
    account_for_embedding: bool = False,
    account_for_loss: bool = False,
) -> list[range]:
    """The 1-based global decoder layer numbers each pipeline stage builds, stage by stage.

    Raises:
        PipelineSplitError: the layers do not split so (the message names the flags, as Megatron's
            refusal would not).
    """
    if num_layers < 1 or pp_size < 1:
        raise PipelineSplitError(
            f"--num-layers {num_layers} and --pipeline-model-parallel-size {pp_size} "
            "must be at least 1"
        )
    uneven = first is not None or last is not None
    if uneven and (account_for_embedding or account_for_loss):
        raise PipelineSplitError(
            "--decoder-first/last-pipeline-num-layers cannot be combined with "
            "--account-for-embedding/loss-in-pipeline-split (Megatron refuses the pair)"
        )
    if uneven:
        for flag, value in (
            ("--decoder-first-pipeline-num-layers", first),
            ("--decoder-last-pipeline-num-layers", last),
        ):
            if value is not None and value < 1:
                raise PipelineSplitError(f"{flag} {value} must be at least 1")
        middle_stages = pp_size - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        given = " and ".join(
            f"{flag} {value}"
            for flag, value in (
                ("--decoder-first-pipeline-num-layers", first),
                ("--decoder-last-pipeline-num-layers", last),
            )
            if value is not None
        )
        if middle_stages < 0:
            raise PipelineSplitError(
                f"{given} need 2 pipeline stages, --pipeline-model-parallel-size is {pp_size}"
            )
        if middle_stages == 0 and middle_layers != 0:
            raise PipelineSplitError(
                f"{given} put {num_layers - middle_layers} layers on the "
                f"{pp_size} pipeline stage(s), --num-layers is {num_layers}"
            )
        if middle_stages and (middle_layers < middle_stages or middle_layers % middle_stages):
            raise PipelineSplitError(
                f"{given} leave {middle_layers} of --num-layers {num_layers} to {middle_stages} middle "
                f"pipeline stage(s): not a whole number of layers each",
                first_stage_suggestion(num_layers, pp_size, last),
            )
        per = middle_layers // middle_stages if middle_stages else 0
        counts = [per] * pp_size
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
    else:
        total = num_layers + account_for_embedding + account_for_loss
        if total % pp_size:
            counted = "".join(
                f" + 1 ({flag})"
                for flag, on in (
                    ("--account-for-embedding-in-pipeline-split", account_for_embedding),
                    ("--account-for-loss-in-pipeline-split", account_for_loss),
                )
                if on
            )
            raise PipelineSplitError(
                f"--num-layers {num_layers}{counted} does not split evenly over --pipeline-model-parallel-size "
                f"{pp_size} stages",
                "" if counted else first_stage_suggestion(num_layers, pp_size),
            )
        counts = [total // pp_size] * pp_size
        counts[0] -= account_for_embedding
        counts[-1] -= account_for_loss
        if min(counts) < 0:
            raise PipelineSplitError(
                f"--num-layers {num_layers} leaves a pipeline stage no layer to hold "
                "the embedding or the loss"
            )
    stages, start = [], 1
    for count in counts:
        stages.append(range(start, start + count))
        start += count
    return stages
