"""How the balancers look in every comparison the offline tools draw or print: one display label and
one colour per balancer (the registry, ``planner/baselines/registry.py``, names and describes them).

``ultraep replay`` / ``advise`` and the resume experiment use it, with :mod:`.figures` for how a
figure is drawn. No Megatron import, no matplotlib.
"""

from __future__ import annotations

import zlib

from ultraep_megatron.planner.baselines.registry import (
    DEEPSEEK_EPLB,
    EPLB,
    EPLB_EXACT,
    IDEAL,
    LLEP,
    NONE,
    ULTRAEP,
)

__all__ = ["COLORS", "LABELS", "balancer_color", "balancer_of"]

#: Display labels in comparisons: the EPLB baselines keep main experts at home (the paper's
#: fixed-layout EPLB), unlike DeepSeek's own re-placing EPLB.
LABELS: dict[str, str] = {
    NONE: NONE,
    ULTRAEP: ULTRAEP,
    EPLB: "eplb-fixed (history; mains at home)",
    EPLB_EXACT: "eplb++-fixed (exact load; mains at home)",
    IDEAL: IDEAL,
    DEEPSEEK_EPLB: "deepseek-eplb (re-places all experts; E + R*S physical experts)",
    LLEP: "llep (alpha capacity factor, m min tokens per GEMM, lambda trigger)",
}
#: One colour per balancer in every figure (matplotlib's tab10 shades; ``none`` grey).
COLORS: dict[str, str] = {
    NONE: "#555555",
    EPLB: "#ff7f0e",
    EPLB_EXACT: "#9467bd",
    ULTRAEP: "#1f77b4",
    IDEAL: "#2ca02c",
    DEEPSEEK_EPLB: "#8c564b",
    LLEP: "#e377c2",
}
#: Colours of names not in :data:`COLORS` (a fixed one per name).
_OTHER_COLORS = ("#17becf", "#bcbd22", "#d62728", "#7f7f7f")


def balancer_of(label: str) -> str:
    """The balancer a label names: 'ultraep/S=2/q=None' -> 'ultraep', 'eplb/i=4/w=4' -> 'eplb',
    'ultraep q=hw=834' -> 'ultraep'."""
    return label.split("/")[0].split(" ")[0]


def balancer_color(label: str) -> str:
    """The colour of the balancer ``label`` names (others: a fixed colour per name)."""
    name = balancer_of(label)
    if name in COLORS:
        return COLORS[name]
    return _OTHER_COLORS[zlib.crc32(name.encode()) % len(_OTHER_COLORS)]
