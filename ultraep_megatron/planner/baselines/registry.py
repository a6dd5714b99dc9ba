"""Every balancer the project names, in one table: the ``--moe-balancer`` choices, the ideal they are
compared with, and the other systems' balancers replayed beside them (``PEERS``), each with a
one-line description. Flags, the replay, the plots and the docs read names from here; nothing else
spells them. How they look in comparisons (labels, colours): ``analysis/plotting.py``.
"""

from __future__ import annotations

__all__ = [
    "NONE",
    "ULTRAEP",
    "EPLB",
    "EPLB_EXACT",
    "IDEAL",
    "DEEPSEEK_EPLB",
    "LLEP",
    "BALANCERS",
    "MOE_BALANCERS",
    "PEERS",
    "COMPARED",
    "EXACT_LOAD",
    "describe",
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
_IDEAL_DESCRIPTION = (
    "force-balanced routing (--moe-balancer none --moe-router-force-load-balancing): "
    "every expert gets the same share of tokens; the upper bound of balancing"
)
PEERS: tuple[str, ...] = (DEEPSEEK_EPLB, LLEP)
#: What replay and the resume experiment compare: the balancers and the ideal.
COMPARED: tuple[str, ...] = (NONE, EPLB, EPLB_EXACT, ULTRAEP, IDEAL)
#: Balancers that plan on the exact load after gating, on the forward's critical path
#: (``eplb`` plans from history, off it).
EXACT_LOAD: frozenset[str] = frozenset({ULTRAEP, EPLB_EXACT})


def describe(name: str) -> str:
    """One line saying what balancer ``name`` (or the ideal) does."""
    return _IDEAL_DESCRIPTION if name == IDEAL else BALANCERS[name]
