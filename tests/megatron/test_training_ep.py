"""megatron.training.pretrain on gloo CPU ranks: expert parallelism does not change training.

From one checkpoint, a tiny fp32 MoE GPT with dropout 0 trains a few
iterations at EP=1 on 2 ranks, EP=2 on 2 ranks and EP=4 on 4 ranks, on the same global batches;
the per-iteration losses and grad norms must agree. (Reference on 2 ranks for both: its 4-rank
twin agrees with it to the same 1e-7 level and would cost the suite another 4-rank launch.)
"""

import math

import pytest

from megatron_runs import run_pretrain, tiny_moe_args

TRAIN_ITERS = 4
# Bit-identical forward; expert gradients are summed over ranks in a different order at EP>1
# (see test_moe_layer_ep), which Adam carries into later iterations at the 1e-7 level.
RTOL = 1e-6


@pytest.fixture(scope="module")
def checkpoint(adam_resume_runs):
    """A torch_dist checkpoint of the tiny model (the resume test's, EP=2); runs here load its
    weights only."""
    return adam_resume_runs[0] / "ckpt"


def losses_and_grad_norms(checkpoint, name, nproc, ep):
    records = run_pretrain(checkpoint.parent / name, nproc, [
        *tiny_moe_args(ep=ep, train_iters=TRAIN_ITERS),
        # Same weights for every EP size; fresh optimizer and RNG, iteration 0.
        "--load", str(checkpoint), "--finetune",
    ])
    assert [r["iteration"] for r in records] == list(range(1, TRAIN_ITERS + 1))
    return [r["losses"]["lm loss"] for r in records], [r["grad_norm"] for r in records]


def assert_sequences_close(actual, expected, what):
    assert len(actual) == len(expected)
    for iteration, (a, e) in enumerate(zip(actual, expected), start=1):
        assert math.isfinite(a), f"{what} at iteration {iteration} is {a}"
        assert abs(a - e) <= RTOL * abs(e), f"{what} at iteration {iteration}: {a!r} vs {e!r}"


@pytest.fixture(scope="module")
def ep1_reference(checkpoint):
    return losses_and_grad_norms(checkpoint, "ep1_n2", 2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,ep", [(2, 2), (4, 4)])
def test_ep_training_matches_ep1(checkpoint, ep1_reference, nproc, ep):
    ref_losses, ref_norms = ep1_reference
    losses, norms = losses_and_grad_norms(checkpoint, f"ep{ep}_n{nproc}", nproc, ep)
    assert_sequences_close(losses, ref_losses, f"EP={ep} lm loss")
    assert_sequences_close(norms, ref_norms, f"EP={ep} grad norm")
    # The model trains: the comparison is between moving sequences, not constants.
    assert len(set(ref_losses)) == TRAIN_ITERS
