"""Transformer Engine's fp8 parameters (``--fp8-param-gather``) on megatron-core's own DDP and
distributed-optimizer path, with the stand-in of TE's parts (``fp8_param_standin.py``).

In process: the stand-in's TE functions against the toy quantizer they must agree with (a cast of
main-parameter shards, gathered, is the whole weight's quantization; MXFP8 storage cannot be
remapped, as in TE) and megatron's own TE >= 2.2 code calling them. One launch: MXFP8 parameters
without ``--reuse-grad-buf-for-mxfp8-param-ag`` (the startup check's refusal bypassed) fail where
megatron builds its buffers, with TE's error, which is why the startup check refuses them. The
balanced layer through the whole path: ``test_recipe_variants.py`` (every recipe's fp8 presets),
``test_production_layouts.py`` (blockwise fp8 parameters).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import fp8_param_standin
import toy_fp8
from gloo_launch import WORKERS
from megatron_runs import tiny_moe_args, torchrun

RECIPES = ("tensorwise", "blockwise", "mxfp8")


def weight(seed: int, shape=(64, 96)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=gen) * 0.02
    w[5, 7] = 0.5  # one block's amax far above the rest's
    return w.to(torch.bfloat16)


def storages(tensor) -> dict[str, torch.Tensor]:
    return {
        key: value
        for key, value in tensor.get_metadata().items()
        if isinstance(value, torch.Tensor)
    }


def test_replace_raw_data_remaps_row_wise_bytes_and_refuses_mxfp8():
    """TE's replace_raw_data: a Float8Tensor's data and a blockwise tensor's row-wise data move into
    the given buffer view with their values; an MXFP8Tensor raises NotImplementedError (TE's
    message), what megatron's DDP hits mapping MXFP8 parameters into its parameter buffer."""
    for recipe, attr in (("tensorwise", "_data"), ("blockwise", "_rowwise_data")):
        quantized = toy_fp8.ToyQuantizer(recipe).quantize(weight(1))
        values = quantized.dequantize().clone()
        buffer = torch.zeros(quantized.numel() + 64, dtype=torch.uint8)
        view = buffer[64:].view(quantized.shape)
        fp8_param_standin.replace_raw_data(quantized, view)
        assert getattr(quantized, attr).data_ptr() == view.data_ptr()
        assert torch.equal(quantized.dequantize(), values)
        with pytest.raises(ValueError, match="data types"):
            fp8_param_standin.replace_raw_data(
                quantized, torch.zeros(quantized.shape, dtype=torch.bfloat16)
            )
    with pytest.raises(
        NotImplementedError, match="replace_raw_data for MXFP8Tensor is not supported"
    ):
        fp8_param_standin.replace_raw_data(
            toy_fp8.ToyQuantizer("mxfp8").quantize(weight(1)),
            torch.zeros(64, 96, dtype=torch.uint8),
        )


@pytest.mark.parametrize("recipe", RECIPES)
def test_cast_of_main_parameter_shards_gathered_is_the_whole_weights_quantization(recipe):
    """Two ranks each own a shard of a weight's main parameters, split inside a scale block. TE's
    cast (amaxes reduced with MAX, each rank's shard cast into its fragment), the fragments
    gathered, then TE's post-all-gather processing: every storage tensor is, bit for bit, the
    quantization of the whole new weight. Between the gather and the post-processing the
    derived copies (tensorwise transpose, blockwise column-wise copy) are still the old
    weight's: a replica copied then would carry them."""
    old, new = weight(1), weight(2)
    split = 1000  # inside a 16 x 16 block, a 1 x 32 and a 32 x 1 block
    ranks = [toy_fp8.ToyQuantizer(recipe).quantize(old) for _ in range(2)]
    shards = [(new.reshape(-1)[:split], 0), (new.reshape(-1)[split:], split)]
    params = [[(w, master, start)] for w, (master, start) in zip(ranks, shards)]
    amaxes = torch.maximum(
        *(fp8_param_standin.shard_amaxes(recipe, p) for p in params)
    )  # the all-reduce
    for p in params:
        fp8_param_standin.cast_shards(recipe, p, amaxes)
    gathered = ranks[0]
    data_attrs = ["_data"] if recipe == "tensorwise" else ["_rowwise_data"]
    data_attrs += ["_columnwise_data"] if recipe == "mxfp8" else []
    for attr in data_attrs:  # the all-gather of each rank's fragment of the bytes
        getattr(gathered, attr).view(-1)[split:] = getattr(ranks[1], attr).view(-1)[split:]
    want = toy_fp8.ToyQuantizer(recipe).storages(new)
    have = storages(gathered)
    derived = {
        "tensorwise": {"data_transpose"},
        "blockwise": {"columnwise_data", "columnwise_scale_inv"},
    }
    for key, value in want.items():
        if value is None:
            continue
        same = torch.equal(have[key].view(torch.uint8), value.view(torch.uint8))
        assert same != (key in derived.get(recipe, set())), f"{recipe} {key} before post-processing"
    fp8_param_standin.post_all_gather_processing([gathered])
    for key, value in want.items():
        if value is not None:
            assert torch.equal(
                storages(gathered)[key].view(torch.uint8), value.view(torch.uint8)
            ), key


@pytest.fixture
def megatron_on_the_standin():
    from megatron.core import fp8_utils

    with fp8_param_standin.installed():
        yield fp8_utils


def test_megatron_runs_its_te_code_on_the_standin(megatron_on_the_standin):
    """megatron's fp8_utils, with the stand-in installed, runs its own TE >= 2.2 functions (the
    code of fp8_utils.py) and they reach the stand-in's TE functions: the distributed
    optimizer's cast (with manual post-processing: the transpose left for the gather), the buffer
    remap (refused for MXFP8) and the post-processing."""
    fp8_utils = megatron_on_the_standin
    for name in ("_quantize_param_shard_impl", "_modify_underlying_storage_impl"):
        assert getattr(fp8_utils, name).__code__.co_filename == fp8_utils.__file__, name
    model_weight = toy_fp8.ToyQuantizer("tensorwise").quantize(weight(1))
    fp8_param_standin.create_transpose(model_weight)
    assert fp8_utils.is_float8tensor(model_weight) and not fp8_utils.is_mxfp8tensor(model_weight)
    master = weight(2).float()
    with mock.patch("torch.distributed.all_reduce"):  # one rank holds the whole weight
        fp8_utils.quantize_param_shard([model_weight], [master.reshape(-1)], [0], None)
    want = toy_fp8.ToyQuantizer("tensorwise").storages(weight(2))
    assert torch.equal(model_weight._data, want["data"])
    assert not model_weight._caches_invalid["data_transpose"], "manual post-processing: caches kept"
    assert not torch.equal(model_weight._transpose, want["data_transpose"])
    fp8_utils.post_all_gather_processing([model_weight])
    assert torch.equal(model_weight._transpose, want["data_transpose"])
    mxfp8 = toy_fp8.ToyQuantizer("mxfp8").quantize(weight(1))
    assert fp8_utils.is_mxfp8tensor(mxfp8)
    with pytest.raises(NotImplementedError, match="MXFP8Tensor"):
        fp8_utils.modify_underlying_storage(mxfp8, torch.zeros(64, 96, dtype=torch.uint8))


MXFP8_PARAMETERS = [
    "--bf16",
    "--use-distributed-optimizer",
    "--fp8-format",
    "e4m3",
    "--fp8-recipe",
    "mxfp8",
    "--fp8-param-gather",
    "--moe-balancer",
    "ultraep",
]


@pytest.mark.slow
def test_mxfp8_parameters_without_the_reuse_flag_fail_building_megatrons_buffers(tmp_path):
    """What the startup check's refusal prevents: with MXFP8 parameters and no
    --reuse-grad-buf-for-mxfp8-param-ag, megatron's DDP maps each parameter into its parameter
    buffer with TE's replace_raw_data, which raises for MXFP8 (one rank; the refusal bypassed)."""
    args = [*tiny_moe_args(ep=1, train_iters=1), *MXFP8_PARAMETERS]
    status, output = torchrun(
        WORKERS / "pretrain_grad_dump.py",
        1,
        args,
        {
            "ULTRAEP_GRAD_DUMP_DIR": str(tmp_path),
            "ULTRAEP_FAULTS": "mxfp8_parameters_without_reuse_accepted",
        },
    )
    assert status != 0, output[-3000:]
    assert "replace_raw_data for MXFP8Tensor is not supported yet" in output, output[-3000:]
    assert "param_and_grad_buffer.py" in output and "modify_underlying_storage" in output, output[
        -3000:
    ]
