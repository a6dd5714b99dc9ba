"""Checkpoint resume through megatron.training.pretrain on gloo CPU ranks is exact.

A tiny fp32 MoE GPT (EP=2 on 2 ranks, dropout 0.1 so the restored RNG state matters) trains
uninterrupted while saving a torch_dist checkpoint at iteration RESUME_SAVE_AT; a second job
loads that checkpoint and continues (session fixtures in conftest.py). Its per-iteration losses and grad
norms must equal the uninterrupted run's, bit for bit, with and without the distributed
optimizer. A job that resumes without the RNG state is the negative control: with dropout on,
it must differ.
"""

import pytest

from megatron_runs import (
    RESUME_NPROC,
    RESUME_SAVE_AT,
    RESUME_TRAIN_ITERS,
    metrics_by_iteration,
    run_pretrain,
)


@pytest.mark.slow
@pytest.mark.parametrize("runs_fixture", ["adam_resume_runs", "distributed_adam_resume_runs"])
def test_resumed_run_equals_uninterrupted_run(request, runs_fixture):
    _, _, uninterrupted, resumed = request.getfixturevalue(runs_fixture)
    assert sorted(uninterrupted) == list(range(1, RESUME_TRAIN_ITERS + 1))
    assert sorted(resumed) == list(range(RESUME_SAVE_AT + 1, RESUME_TRAIN_ITERS + 1))
    for iteration, (loss, grad_norm) in resumed.items():
        assert (loss, grad_norm) == uninterrupted[iteration], f"iteration {iteration}"


@pytest.mark.slow
def test_resume_without_rng_state_differs(adam_resume_runs):
    """Negative control: the comparison above sees the dropout RNG state."""
    root, base, uninterrupted, _ = adam_resume_runs
    no_rng = metrics_by_iteration(
        run_pretrain(
            root / "resumed_no_rng",
            RESUME_NPROC,
            [
                *base,
                "--load",
                str(root / "ckpt"),
                "--ckpt-step",
                str(RESUME_SAVE_AT),
                "--no-load-rng",
            ],
        )
    )
    first = RESUME_SAVE_AT + 1
    assert no_rng[first][0] != uninterrupted[first][0]
