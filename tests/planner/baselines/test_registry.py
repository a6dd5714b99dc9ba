"""The registry of every balancer's name (``planner/baselines/registry.py``)."""

from __future__ import annotations

from ultraep_megatron.planner.baselines import registry


def test_names_and_what_is_compared():
    assert registry.MOE_BALANCERS == ("none", "ultraep", "eplb", "eplb-exact")
    assert set(registry.COMPARED) == set(registry.MOE_BALANCERS) | {registry.IDEAL}
    assert registry.PEERS == ("deepseek-eplb", "llep")
    assert registry.EXACT_LOAD == {"ultraep", "eplb-exact"}


def test_every_balancer_has_a_label_a_colour_and_a_description():
    named = {*registry.MOE_BALANCERS, registry.IDEAL, *registry.PEERS}
    assert set(registry.LABELS) == set(registry.COLORS) == named
    assert len(set(registry.COLORS.values())) == len(registry.COLORS)
    assert all(registry.describe(name) for name in (*registry.MOE_BALANCERS, registry.IDEAL))
    # The fixed-layout EPLB baselines keep main experts at home, unlike DeepSeek's own EPLB.
    assert all("mains at home" in registry.LABELS[k] for k in (registry.EPLB, registry.EPLB_EXACT))
    assert "re-places" in registry.LABELS[registry.DEEPSEEK_EPLB]
