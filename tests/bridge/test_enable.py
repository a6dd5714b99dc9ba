"""``enable_ultraep`` on a Megatron-Bridge ``ConfigContainer`` (ultraep_megatron.megatron.bridge.enable):
the startup checks ``pretrain_gpt.py`` runs, on the ConfigContainer's fields, each refusal naming
the config field. In-process, no ranks: the checks run before the model is built.

Skipped (one reason line) where megatron-bridge is not installed: run with ``ULTRAEP_BRIDGE=1``.
"""

from __future__ import annotations

import argparse

import pytest
from bridge_helpers import needs_bridge

pytestmark = needs_bridge


def _cfg(**model_overrides):
    from bridge_pretrain import tiny_config

    options = argparse.Namespace(ep=2, iters=1, microbatches=1, overlap=False, expert_bias=None)
    return tiny_config(options, 4, **model_overrides)


@pytest.mark.parametrize(
    "override, field",
    [
        ({"moe_expert_capacity_factor": 1.0}, "cfg.model.moe_expert_capacity_factor"),
        ({"moe_token_dispatcher_type": "allgather"}, "cfg.model.moe_token_dispatcher_type"),
        ({"num_moe_experts": 3}, "cfg.model.num_moe_experts 3 is not divisible by "
         "cfg.model.expert_model_parallel_size 2"),
    ],
)  # fmt: skip
def test_a_refused_setting_is_named_by_its_config_field(override, field):
    from ultraep_megatron.megatron.bridge.enable import enable_ultraep

    cfg = _cfg(**override)
    spec = cfg.model.transformer_layer_spec
    with pytest.raises(ValueError, match="enable_ultraep refuses") as refused:
        enable_ultraep(cfg, num_slots=2)
    assert field in str(refused.value)
    assert "--moe-" not in str(refused.value) and "--num-" not in str(refused.value)
    assert cfg.model.transformer_layer_spec is spec  # refused before anything changed


def test_a_refused_knob_is_named_by_enable_ultraeps_argument():
    from ultraep_megatron.megatron.bridge.enable import enable_ultraep

    with pytest.raises(ValueError, match=r"enable_ultraep\(num_slots=\)"):
        enable_ultraep(_cfg(), num_slots=-1)


def test_the_tested_config_passes_the_checks():
    """The config tests/bridge/test_bridge_pretrain.py trains: no problem (no false refusal)."""
    from ultraep_megatron.megatron.bridge.enable import _flags_namespace, config_problems

    assert config_problems(_cfg(), _flags_namespace("ultraep", {"num_slots": 2})) == []
