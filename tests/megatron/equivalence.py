"""Equivalence of training runs, up to a noise floor measured in the same test session.

Two runs of the same mathematics that only sum in different orders differ by rounding. The tests
measure that difference on this machine, in this session, between two ``--moe-balancer none`` runs
of the same model, state and batches in different parallel layouts (EP4 x DP4 against EP2 x PP2 x
DP2: expert gradients summed over other token sets, dense gradients all-reduced over another
number of ranks, microbatches accumulated in another order). That is the *noise floor* of each
compared quantity. A balanced run must stay within ``NOISE_MULTIPLE`` times the floor of its
reference: the balancer reorders sums of the same terms too (a replicated expert's gradient is
summed in two parts), so its difference is rounding of the same kind and scale, whatever the CPU's
BLAS does with the summation order.

Why ``NOISE_MULTIPLE = 10``: the floor of a quantity is the largest of its differences over every
compared batch (or, for a trajectory, over the compared iterations); another reordering's difference
is another draw of the same kind of rounding, and a factor 10 covers how far two such draws fall
apart (measured here: see the report each test prints) while staying far below what a broken
balancer produces (the negative controls show relative errors of 1e-2 and more, 1e4x and more
above the floor). A relative difference below one unit roundoff of the stored fp32 value cannot be
resolved at all, so no floor is smaller than that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

#: fp32 unit roundoff: the smallest relative difference an fp32 value can resolve.
UNIT_ROUNDOFF = 2.0**-24
#: Tolerance = NOISE_MULTIPLE x noise floor (see the module docstring).
NOISE_MULTIPLE = 10.0


def relative_difference(actual: torch.Tensor | float, reference: torch.Tensor | float) -> float:
    """``||actual - reference|| / ||reference||`` (Frobenius norm); 0 when they are equal, inf
    when only the reference is zero."""
    actual = torch.as_tensor(actual, dtype=torch.float64)
    reference = torch.as_tensor(reference, dtype=torch.float64)
    difference = float((actual - reference).norm())
    if difference == 0.0:
        return 0.0
    scale = float(reference.norm())
    return difference / scale if scale > 0 else math.inf


@dataclass(frozen=True)
class Comparison:
    """One compared quantity: its relative error against the reference and its tolerance."""

    what: str
    error: float
    floor: float

    @property
    def tolerance(self) -> float:
        return NOISE_MULTIPLE * self.floor

    @property
    def ratio(self) -> float:
        """error / tolerance: <= 1 passes."""
        return self.error / self.tolerance

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance


def noise_floor(differences: Iterable[float]) -> float:
    """The floor from the floor pair's relative differences: their largest, at least one unit
    roundoff."""
    return max([UNIT_ROUNDOFF, *differences])


def gradient_floors(
    x: Mapping[int, Mapping[str, torch.Tensor]],
    y: Mapping[int, Mapping[str, torch.Tensor]],
    iterations: Sequence[int],
) -> dict[str, float]:
    """Per parameter, the noise floor of the gradients of two reference runs over ``iterations``
    (``x``, ``y``: {iteration: {parameter: gradient}})."""
    names = set(x[iterations[0]]) & set(y[iterations[0]])
    return {
        name: noise_floor(relative_difference(x[it][name], y[it][name]) for it in iterations)
        for name in sorted(names)
    }


def compare_gradients(
    actual: Mapping[int, Mapping[str, torch.Tensor]],
    reference: Mapping[int, Mapping[str, torch.Tensor]],
    floors: Mapping[str, float],
    iterations: Sequence[int],
) -> list[Comparison]:
    """Every parameter's gradient at every iteration of ``iterations``."""
    out = []
    for it in iterations:
        if sorted(actual[it]) != sorted(reference[it]):
            raise AssertionError(
                f"iteration {it}: the runs have different parameters: "
                f"{sorted(set(actual[it]) ^ set(reference[it]))}"
            )
        out += [
            Comparison(
                f"iteration {it} {name}",
                relative_difference(actual[it][name], reference[it][name]),
                floors[name],
            )
            for name in sorted(reference[it])
        ]
    return out


def compare_series(
    name: str,
    actual: Mapping[int, float],
    reference: Mapping[int, float],
    floor_x: Mapping[int, float],
    floor_y: Mapping[int, float],
) -> list[Comparison]:
    """A scalar per iteration (loss, grad norm) of ``actual`` against ``reference``; the floor is
    the largest difference of ``floor_x`` and ``floor_y`` over all their iterations. For a
    trajectory that is the widest the floor pair drifts apart in the window: rounding differences
    grow chaotically under Adam, so when two trajectories part is itself random."""
    floor = noise_floor(relative_difference(floor_x[it], floor_y[it]) for it in floor_y)
    return [
        Comparison(f"{name} iteration {it}", relative_difference(actual[it], reference[it]), floor)
        for it in sorted(reference)
    ]


def summary(comparisons: Sequence[Comparison]) -> str:
    """One line: how many, the worst error/tolerance ratio and where."""
    worst = max(comparisons, key=lambda c: c.ratio)
    floors = [c.floor for c in comparisons]
    return (
        f"{len(comparisons)} compared, worst error/tolerance {worst.ratio:.3g} "
        f"({worst.what}: error {worst.error:.3g}, floor {worst.floor:.3g}); "
        f"floors {min(floors):.3g}..{max(floors):.3g}"
    )


def failures(comparisons: Sequence[Comparison]) -> list[str]:
    """The comparisons over tolerance, described."""
    return [
        f"{c.what}: error {c.error:.3g} > {NOISE_MULTIPLE:g} x floor {c.floor:.3g}"
        for c in comparisons
        if not c.passed
    ]


def losses(run, iterations) -> dict[int, float]:
    """{iteration: lm loss} of a run's ``--metrics-jsonl`` records (``run.records``)."""
    return {it: run.records[it]["losses"]["lm loss"] for it in iterations}


def grad_norms(run, iterations) -> dict[int, float]:
    return {it: run.records[it]["grad_norm"] for it in iterations}


def per_step_comparisons(
    actual, reference, floor_x, floor_y, floor_iterations: Sequence[int], iterations: Sequence[int]
) -> list[Comparison]:
    """Every parameter's reduced gradient, the loss and the grad norm of ``actual`` against
    ``reference`` at the lr-0 ``iterations`` (runs of workers/pretrain_grad_dump.py: ``.grads``,
    ``.records``); floors from ``floor_x`` against ``floor_y`` over ``floor_iterations``."""
    floors = gradient_floors(floor_x.grads, floor_y.grads, list(floor_iterations))
    comparisons = compare_gradients(actual.grads, reference.grads, floors, iterations)
    for what, values in (("lm loss", losses), ("grad norm", grad_norms)):
        comparisons += compare_series(
            what,
            values(actual, iterations),
            values(reference, iterations),
            values(floor_x, floor_iterations),
            values(floor_y, floor_iterations),
        )
    return comparisons


def trajectory_comparisons(
    actual, reference, floor_x, floor_y, iterations: Sequence[int], *, shared_floor: bool = False
) -> list[Comparison]:
    """Losses and grad norms of ``actual`` against ``reference`` over the trained ``iterations``,
    the floor from ``floor_x`` against ``floor_y`` over the same iterations: per readout, or with
    ``shared_floor`` the larger of the two for both. Both read out one drift, the floor pair's
    parameters parting; with quantized (fp8) weights, which absorb drifts below their rounding step,
    that drift comes in rare jumps and one readout can miss it (a floor pair's losses agreed to the
    last bit while its grad norms differed by 2.6e-5)."""
    comparisons = []
    for what, values in (("lm loss", losses), ("grad norm", grad_norms)):
        comparisons += compare_series(
            what,
            values(actual, iterations),
            values(reference, iterations),
            values(floor_x, iterations),
            values(floor_y, iterations),
        )
    if shared_floor:
        floor = max(c.floor for c in comparisons)
        comparisons = [Comparison(c.what, c.error, floor) for c in comparisons]
    return comparisons
