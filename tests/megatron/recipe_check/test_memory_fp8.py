"""The memory model under fp8: with ``--fp8-param-gather`` (PRECISION=fp8_cs) the linear layers'
weights weigh 1 byte instead of bf16's 2, in the model and in the redundant slots; fp32 main
gradients and the distributed optimizer's fp32 master shards do not change; fp8 GEMMs with bf16
parameters (PRECISION=fp8_sc, no parameter gather) change nothing.

The expected saving is counted here from DeepSeek-V2-Lite's published shape (HF config.json), not
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
ATTENTION_LINEARS = (H * HEADS * (QK + ROPE)          # q projection (no query LoRA)
                     + H * (KV_LORA + ROPE)           # kv down-projection + RoPE key
                     + KV_LORA * HEADS * (QK + V)     # kv up-projection
                     + HEADS * V * H)                 # output projection


def swiglu(ffn: int) -> int:
    return 3 * H * ffn


QUANTIZED_PER_RANK = (27 * ATTENTION_LINEARS + swiglu(10944) + 26 * swiglu(2816)
                      + 26 * (64 // 8) * swiglu(1408))


def stages(env: dict[str, str]):
    return rc.check_launch(rc.capture_launch(RECIPE, env)).memory.stages


@pytest.mark.parametrize("mechanism", ["fp8_counted", "control_fp8_counted_as_bf16"])
def test_fp8_param_gather_counts_one_byte_linear_weights(monkeypatch, mechanism):
    if mechanism.startswith("control"):  # the old count: quantized weights as heavy as bf16 ones
        monkeypatch.setattr(memory, "FP8_PARAM_BYTES", 2)
    (bf16,), (fp8,) = stages({"PRECISION": "bf16"}), stages({"PRECISION": "fp8_cs"})
    saved = bf16.model_states - fp8.model_states
    slot_saved = bf16.slot_weight_bytes - fp8.slot_weight_bytes
    holds = abs(saved - QUANTIZED_PER_RANK) <= 1 and slot_saved == swiglu(1408)
    assert holds == (mechanism == "fp8_counted"), (saved, QUANTIZED_PER_RANK, slot_saved)
    # fp32 gradients of the slots are what they were; the parameter counts too.
    assert fp8.slot_grad_bytes == bf16.slot_grad_bytes == swiglu(1408) * 4
    assert (fp8.dense_params, fp8.expert_params) == (bf16.dense_params, bf16.expert_params)


def test_fp8_gemms_with_bf16_parameters_change_no_model_state():
    (bf16,), (blockwise,) = stages({"PRECISION": "bf16"}), stages({"PRECISION": "fp8_sc"})
    assert blockwise.model_states == bf16.model_states
    assert blockwise.slot_weight_bytes == bf16.slot_weight_bytes
