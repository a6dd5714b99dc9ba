"""Megatron's decoder layers per pipeline stage (``traces/pipeline.py``) against megatron-core's own
numbering: a ``TransformerConfig`` with the split, ``get_num_layers_to_build`` and
``get_transformer_layer_offset`` for every stage, over layer counts, stage counts, first/last stage
counts and the embedding/loss accounting. Where megatron-core builds the layers 1..L, the stages
must be the same; where it refuses (or builds a model that is not layers 1..L), the split is refused
here, naming the flags; the first-stage counts offered for a refused even split are ones megatron
builds."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from ultraep_megatron.traces.pipeline import (
    PipelineSplitError,
    first_stage_suggestion,
    pipeline_stages,
)

LAYERS = (1, 2, 5, 8, 23, 27, 28, 46, 61, 94)
STAGES = (1, 2, 3, 4, 8)
FIRST = (None, 1, 12, 13, 15, 23)
LAST = (None, 1, 11, 14, 23)


def megatron_stages(num_layers, pp, first=None, last=None, embedding=False, loss=False):
    """megatron-core's stages (1-based layer ranges), or None where it refuses the split."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = TransformerConfig(
                num_layers=num_layers,
                hidden_size=64,
                num_attention_heads=4,
                pipeline_model_parallel_size=pp,
                pipeline_dtype=torch.float32,
                num_layers_in_first_pipeline_stage=first,
                num_layers_in_last_pipeline_stage=last,
                account_for_embedding_in_pipeline_split=embedding,
                account_for_loss_in_pipeline_split=loss,
            )
            stages = []
            for rank in range(pp):
                offset = get_transformer_layer_offset(config, pp_rank=rank)
                stages.append(
                    range(offset + 1, offset + get_num_layers_to_build(config, pp_rank=rank) + 1)
                )
    except (ValueError, AssertionError):
        return None
    return stages


def ours(num_layers, pp, first=None, last=None, embedding=False, loss=False):
    try:
        return pipeline_stages(
            num_layers,
            pp,
            first=first,
            last=last,
            account_for_embedding=embedding,
            account_for_loss=loss,
        )
    except PipelineSplitError:
        return None


def test_every_split_numbers_its_layers_as_megatron_does():
    compared = refused_here_only = 0
    for L, pp, first, last, embedding, loss in itertools.product(
        LAYERS, STAGES, FIRST, LAST, (False, True), (False, True)
    ):
        theirs = megatron_stages(L, pp, first, last, embedding, loss)
        mine = ours(L, pp, first, last, embedding, loss)
        whole = theirs is not None and [n for stage in theirs for n in stage] == list(
            range(1, L + 1)
        )
        if whole and not (pp == 1 and first is not None and last is not None):
            assert mine == theirs, (L, pp, first, last, embedding, loss)
            compared += 1
        else:
            # Megatron refuses it, or builds something else than layers 1..L (a first/last count on a
            # single stage builds that many layers, silently): refused here.
            assert mine is None, (L, pp, first, last, embedding, loss, theirs)
            refused_here_only += theirs is not None
    assert compared > 200 and refused_here_only > 0, (compared, refused_here_only)


def test_the_even_split_formula_mislabels_an_uneven_first_stage():
    """The negative control: the even split's offset (stage x layers / stages), what the trace
    reader used before, labels stage 1 of a 28-layer model with a 12-layer first stage 15-30;
    megatron-core numbers it 13-28."""
    theirs = megatron_stages(28, 2, first=12)
    assert theirs[1] == range(13, 29) == ours(28, 2, first=12)[1]
    even_offset = 1 * 28 // 2
    assert range(even_offset + 1, even_offset + 17) != theirs[1]


@pytest.mark.parametrize(
    "num_layers, pp, message, suggestion",
    [
        (
            27,
            2,
            "--num-layers 27 does not split evenly over --pipeline-model-parallel-size 2 stages",
            "--decoder-first-pipeline-num-layers 13",
        ),
        (
            94,
            4,
            "--num-layers 94 does not split evenly over --pipeline-model-parallel-size 4 stages",
            "--decoder-first-pipeline-num-layers 22",
        ),
        (
            5,
            4,
            "--num-layers 5 does not split evenly over --pipeline-model-parallel-size 4 stages",
            "--decoder-first-pipeline-num-layers 2",
        ),
    ],
)
def test_an_uneven_split_names_the_flags_and_a_first_stage_count_megatron_builds(
    num_layers, pp, message, suggestion
):
    with pytest.raises(PipelineSplitError) as error:
        pipeline_stages(num_layers, pp)
    assert str(error.value) == message and error.value.suggestion == suggestion
    first = int(suggestion.split()[-1])
    theirs = megatron_stages(num_layers, pp, first=first)
    assert theirs == ours(num_layers, pp, first=first)
    assert [n for stage in theirs for n in stage] == list(range(1, num_layers + 1))


def test_first_and_last_counts_that_leave_no_whole_middle_split_are_refused():
    with pytest.raises(
        PipelineSplitError,
        match=r"--decoder-first-pipeline-num-layers 23 and "
        r"--decoder-last-pipeline-num-layers 23 leave 49 of --num-layers 95 "
        r"to 2 middle pipeline stage\(s\)",
    ):
        pipeline_stages(95, 4, first=23, last=23)
    assert first_stage_suggestion(95, 4, last=23) == "--decoder-first-pipeline-num-layers 24"
    assert megatron_stages(95, 4, first=24, last=23) == ours(95, 4, first=24, last=23)
