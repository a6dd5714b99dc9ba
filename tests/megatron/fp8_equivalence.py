"""Equivalence under fp8: the gate of torchtitan's MoonEP equivalence work, for balanced layers
whose fp8 GEMMs quantize as Transformer Engine's do (``te_grouped_fp8``).

Under fp8 a balanced layer is not the same computation as ``none``: a replicated expert's rows are
split between its main instance and replicas, and TE's grouped GEMM quantizes each part with its
own group's quantizer (under tensorwise current scaling, each part with its own amax; under the
block recipes, column-wise blocks along the tokens regrouped). Both are the same mathematics
rounded otherwise, so both are measured against a high-precision reference (fp32, the same tokens,
weights and routing), per kind of quantity (every tensor of the kind, over ranks, steps and
microbatches, concatenated): ``ultraep``'s relative distance to the reference must not exceed
``none``'s by more than 10 % (``GATE_EXCESS``), and ``ultraep``'s distance to ``none`` must not
exceed either one's distance to the reference (neither is the more correct; they differ by which
rounding of the same sums each takes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from equivalence import relative_difference

#: The gate: ultraep's distance to the reference at most this times none's.
GATE_EXCESS = 1.10
#: "Invisible at fp8 resolution": a difference at most this fraction of fp8's own error.
FP8_RESOLUTION = 1e-3


def concatenated(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened and concatenated, in float64."""
    return torch.cat([t.reshape(-1).double() for t in tensors])


@dataclass(frozen=True)
class GateRow:
    """One kind of quantity: ``none``'s and ``ultraep``'s relative distances to the reference,
    and ``ultraep``'s to ``none``."""

    kind: str
    none: float
    ultraep: float
    between: float

    @classmethod
    def of(
        cls, kind: str, none: torch.Tensor, ultraep: torch.Tensor, reference: torch.Tensor
    ) -> "GateRow":
        return cls(
            kind,
            relative_difference(none, reference),
            relative_difference(ultraep, reference),
            relative_difference(ultraep, none),
        )

    @property
    def ratio(self) -> float:
        """ultraep's distance to the reference over none's."""
        return self.ultraep / self.none

    @property
    def passed(self) -> bool:
        return self.ultraep <= GATE_EXCESS * self.none and self.between <= min(
            self.none, self.ultraep
        )

    @property
    def margin(self) -> float:
        """How far past the gate's first bound ultraep lies (> 1: it fails)."""
        return self.ratio / GATE_EXCESS

    def __str__(self):
        return (
            f"{self.kind:24s} none {self.none:.4e}  ultraep {self.ultraep:.4e}  ratio {self.ratio:.4f}  "
            f"ultraep-none {self.between:.3e} ({self.between / min(self.none, self.ultraep):.3g} of the smaller)"
        )
