"""The id by which the balancer, its ring, telemetry, dashboards and traces name an MoE layer.

Its own module so that the layer (``balanced_moe``), its spec (``layer_spec``) and the telemetry of
unbalanced runs (``telemetry``) share it without importing one another. No torch, no Megatron.
"""

from __future__ import annotations

from typing import Any


def moe_layer_id(module: Any) -> int:
    """The 1-based id of the MoE layer of ``module`` (an MoE layer or its router, numbered by
    Megatron).

    Decoder layers keep Megatron's global layer number. Megatron numbers the layers of the MTP
    block from 1 again; they come after the decoder stack here (``num_layers + k`` for the k-th),
    as Megatron's router does for its aux-loss log.
    """
    if getattr(module, "is_mtp_layer", False):
        return module.config.num_layers + module.layer_number
    return module.layer_number
