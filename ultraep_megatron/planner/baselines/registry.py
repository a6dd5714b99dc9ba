"""Every balancer the project names, in one table: the ``--moe-balancer`` choices, the ideal they are
compared with, and the other systems' balancers replayed beside them (``PEERS``), each with a
one-line description, a display label and a colour. Flags, the replay, the plots and the docs read
names from here; nothing else spells them.
"""

from __future__ import annotations

__all__ = [
    "NONE", "ULTRAEP", "EPLB", "EPLB_EXACT", "IDEAL", "DEEPSEEK_EPLB", "LLEP",
    "BALANCERS", "MOE_BALANCERS", "PEERS", "COMPARED", "EXACT_LOAD", "LABELS", "COLORS", "describe",
]

NONE, ULTRAEP, EPLB, EPLB_EXACT = "none", "ultraep", "eplb", "eplb-exact"
#: The force-balanced router (megatron-core's ``--moe-router-force-load-balancing``): the paper's
#: ideal, a reference to compare with, not a balancer of the MoE layer.
IDEAL = "ideal"
#: Other systems' balancers, replayed for comparison (:mod:`.deepseek`, :mod:`.least_loaded`).
DEEPSEEK_EPLB, LLEP = "deepseek-eplb", "llep"

#: ``--moe-balancer`` choices and what each does.
BALANCERS: dict[str, str] = {
    NONE: "megatron-core's MoELayer unchanged: every token goes to its expert's home rank",
    ULTRAEP: "replicates hot experts into redundant slots and reroutes tokens, planned on the exact "
             "load of every microbatch and MoE layer",
    EPLB: "DeepSeek EPLB's replication rule on the load history (--moe-balancer-eplb-window, "
          "re-planned every --moe-balancer-eplb-interval microbatches); main experts stay home",
    EPLB_EXACT: "EPLB's replication rule on the exact load of every microbatch (the paper's EPLB++)",
}
MOE_BALANCERS: tuple[str, ...] = tuple(BALANCERS)
_IDEAL_DESCRIPTION = ("force-balanced routing (--moe-balancer none --moe-router-force-load-balancing): "
                      "every expert gets the same share of tokens; the upper bound of balancing")
PEERS: tuple[str, ...] = (DEEPSEEK_EPLB, LLEP)
#: What replay and the resume experiment compare: the balancers and the ideal.
COMPARED: tuple[str, ...] = (NONE, EPLB, EPLB_EXACT, ULTRAEP, IDEAL)
#: Balancers that plan on the exact load after gating, on the forward's critical path
#: (``eplb`` plans from history, off it).
EXACT_LOAD: frozenset[str] = frozenset({ULTRAEP, EPLB_EXACT})

#: Display labels in comparisons: the EPLB baselines keep main experts at home (the paper's
#: fixed-layout EPLB), unlike DeepSeek's own re-placing EPLB.
LABELS: dict[str, str] = {
    NONE: "none",
    ULTRAEP: "ultraep",
    EPLB: "eplb-fixed (history; mains at home)",
    EPLB_EXACT: "eplb++-fixed (exact load; mains at home)",
    IDEAL: "ideal",
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


def describe(name: str) -> str:
    """One line saying what balancer ``name`` (or the ideal) does."""
    return _IDEAL_DESCRIPTION if name == IDEAL else BALANCERS[name]
