"""The memory model under fp8: Transformer Engine keeps a training weight of a linear layer as two
fp8 copies (row-wise for the forward, column-wise or transposed for the backward), 2 bytes an
element. With ``--fp8-param-gather`` (PRECISION=fp8_cs) they are the parameter: as heavy as bf16's,
in the model and in the redundant slots. With fp8 GEMMs on bf16 parameters (PRECISION=fp8_sc) TE
caches them on top of the parameter, in the model only (the replica experts cache no cast). fp32
main gradients and the distributed optimizer's fp32 master shards do not change.

The linear weights are counted here from DeepSeek-V2-Lite's published shape (HF config.json), not
from the checker's parameter functions.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ultraep_megatron.megatron import recipe_check as rc
from ultraep_megatron.megatron.recipe_check import memory

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "deepseek_v2_lite_16b_a2b_ep8_hgx.sh"

# DeepSeek-V2-Lite: hidden 2048; MLA, 16 heads, no query LoRA, kv LoRA 512, q/k head 128 + 64 RoPE,
# v head 128; layer 1 dense (SwiGLU FFN 10944), 26 MoE layers of 64 experts (FFN 1408) + 2 shared
# (2816); EP 8, PP 1, TP 1.
H, HEADS, KV_LORA, QK, ROPE, V = 2048, 16, 512, 128, 64, 128
ATTENTION_LINEARS = (
    H * HEADS * (QK + ROPE)  # q projection (no query LoRA)
    + H * (KV_LORA + ROPE)  # kv down-projection + RoPE key
    + KV_LORA * HEADS * (QK + V)  # kv up-projection
    + HEADS * V * H
)  # output projection


def swiglu(ffn: int) -> int:
    return 3 * H * ffn


QUANTIZED_PER_RANK = (
    27 * ATTENTION_LINEARS + swiglu(10944) + 26 * swiglu(2816) + 26 * (64 // 8) * swiglu(1408)
)


def stages(env: dict[str, str]):
    return rc.check_launch(rc.capture_launch(RECIPE, env)).memory.stages


@pytest.mark.parametrize("mechanism", ["two_copies", "control_one_byte"])
def test_fp8_weights_count_two_copies(monkeypatch, mechanism):
    if mechanism.startswith("control"):  # a count that forgets the backward's copy
        monkeypatch.setattr(memory, "FP8_WEIGHT_BYTES", 1)
    (bf16,), (params,), (cast,) = (stages({"PRECISION": p}) for p in ("bf16", "fp8_cs", "fp8_sc"))
    holds = (
        params.model_states == bf16.model_states
        and params.slot_weight_bytes == bf16.slot_weight_bytes
        and abs(cast.model_states - bf16.model_states - 2 * QUANTIZED_PER_RANK) <= 1
    )
    assert holds == (mechanism == "two_copies"), (
        params.model_states - bf16.model_states,
        cast.model_states - bf16.model_states,
        QUANTIZED_PER_RANK,
    )
    # The slots of cached casts hold bf16 weights; fp32 gradients and the parameter counts as in bf16.
    assert cast.slot_weight_bytes == bf16.slot_weight_bytes
    assert fp8_slot_grads_unchanged(bf16, params, cast)


def fp8_slot_grads_unchanged(*runs) -> bool:
    return all(
        r.slot_grad_bytes == swiglu(1408) * 4
        and (r.dense_params, r.expert_params) == (runs[0].dense_params, runs[0].expert_params)
        for r in runs
    )
