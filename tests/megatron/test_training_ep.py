"""megatron.training.pretrain on gloo CPU ranks: expert parallelism does not change training.

From one checkpoint, a tiny fp32 MoE GPT with dropout 0 trains a few iterations at EP=1 on 2 and
on 4 ranks, EP=2 on 2 ranks and EP=4 on 4 ranks, on the same global batches; the per-iteration
losses and grad norms of the EP runs must agree with EP=1 on 2 ranks within the noise floor of the
two EP=1 runs (the same mathematics with the gradients all-reduced over another number of ranks,
measured in this session: ``equivalence.py``).
"""

import pytest

from equivalence import compare_series, failures, summary
from megatron_runs import FINETUNE_ITERS


def series(finetune_runs, nproc, ep):
    """{"lm loss": {iteration: value}, "grad norm": {...}}; every run from the same weights (the
    resume test's checkpoint; conftest.finetune_runs)."""
    records = finetune_runs(f"ep{ep}_n{nproc}", nproc, ep)
    return {
        "lm loss": {r["iteration"]: r["losses"]["lm loss"] for r in records},
        "grad norm": {r["iteration"]: r["grad_norm"] for r in records},
    }


@pytest.mark.slow
@pytest.mark.parametrize("nproc,ep", [(2, 2), (4, 4)])
def test_ep_training_matches_ep1(finetune_runs, nproc, ep):
    reference, twin = series(finetune_runs, 2, 1), series(finetune_runs, 4, 1)
    run = series(finetune_runs, nproc, ep)
    comparisons = []
    for what in ("lm loss", "grad norm"):
        comparisons += compare_series(
            f"EP={ep} {what}", run[what], reference[what], reference[what], twin[what]
        )
    print(f"\nEP={ep} against EP=1: {summary(comparisons)}")
    assert not failures(comparisons), failures(comparisons)
    # The model trains: the comparison is between moving sequences, not constants.
    assert len(set(reference["lm loss"].values())) == FINETUNE_ITERS
