"""The balancers UltraEP is compared with, and the one registry of every balancer's name.

* :mod:`.registry`: names, descriptions, labels and colours of every balancer;
* :mod:`.fixed_layout`: the identity plan (``none``) and the paper's fixed-layout EPLB on history
  (``eplb``) and on the exact load (``eplb-exact``), main experts at home;
* :mod:`.deepseek`: DeepSeek's own EPLB, which re-places every expert;
* :mod:`.least_loaded`: LLEP, Least-Loaded Expert Parallelism;
* :mod:`.placement`: the :class:`Placement` any of them is compared as, and its metrics.
"""

from . import registry
from .deepseek import deepseek_eplb
from .fixed_layout import eplb, eplb_exact, identity_plan, round_robin
from .least_loaded import llep
from .placement import Placement, placement_metrics

__all__ = [
    "registry",
    "identity_plan",
    "eplb",
    "eplb_exact",
    "round_robin",
    "deepseek_eplb",
    "llep",
    "Placement",
    "placement_metrics",
]
