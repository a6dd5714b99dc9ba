"""The gloo stand-in for DeepEP (``deepep_gloo``) and megatron-core's flex dispatcher through it.

One launch of 4 gloo CPU ranks (``workers/flex_dispatcher_layer.py``):

* the stand-in's dispatch/combine alone, checked against plain-Python loops over the saved inputs
  (DeepEP intranode semantics: once per destination rank, rows ordered by source rank then token);
* megatron-core's MoELayer at EP=4 (skewed top-2 of 8 routing): the flex dispatcher
  (``moe_flex_dispatcher_backend="deepep"``, megatron's own ``_DeepepManager``) must match the
  alltoall dispatcher in outputs and all gradients.
"""

import pytest
import torch

from gloo_launch import WORKERS, launch_gloo_ranks

WORLD = 4
NUM_EXPERTS = 8
LOCAL = NUM_EXPERTS // WORLD
RTOL = 1e-5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("flex_dispatcher")
    launch_gloo_ranks(
        WORKERS / "flex_dispatcher_layer.py", WORLD, ["--out-dir", out], timeout_s=300
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def assert_close(actual, expected, what):
    scale = expected.abs().max().clamp_min(1e-12)
    err = (actual - expected).abs().max() / scale
    assert err <= RTOL, f"{what}: max error {err:.3g} relative to max |ref|"


def destination_ranks(index_row) -> set[int]:
    """Distinct ranks hosting the valid experts of one token's top-k row."""
    return {int(e) // LOCAL for e in index_row if int(e) >= 0}


def test_dispatch_rows_indices_probs_and_counts(ranks):
    """Each token once per destination rank, rows ordered by source rank then token."""
    units = [r["unit"] for r in ranks]
    # The inputs exercise what distinguishes per-rank from per-expert dispatch.
    rows = [row for u in units for row in u["indices"]]
    assert any(len(destination_ranks(r)) == 1 and min(r) >= 0 for r in rows), "no same-rank pair"
    assert any(len(destination_ranks(r)) == 0 for r in rows), "no fully masked token"
    for dest in range(WORLD):
        got = units[dest]
        row = 0
        counts = [0] * LOCAL
        for src in range(WORLD):  # order: source rank, then source token index
            u = units[src]
            for t, index_row in enumerate(u["indices"].tolist()):
                if dest not in destination_ranks(index_row):
                    continue
                assert torch.equal(got["recv_x"][row], u["x"][t]), f"rank {dest} row {row}"
                for k, e in enumerate(index_row):
                    local = e >= 0 and e // LOCAL == dest
                    assert got["recv_indices"][row, k] == (e - dest * LOCAL if local else -1)
                    assert got["recv_probs"][row, k] == (u["probs"][t, k] if local else 0.0)
                    if local:
                        counts[e - dest * LOCAL] += 1
                row += 1
        assert row == got["recv_x"].shape[0]
        assert got["recv_indices"].dtype == torch.int64 and got["recv_probs"].dtype == torch.float32
        assert got["tokens_per_expert"].tolist() == counts


def test_combine_and_both_backwards(ranks):
    """Receivers scale rows by (rank + 1): combined[t] = x[t] * sum of (r + 1) over the
    destination ranks r; the loss's recv_probs term makes d/d probs[t, k] = 10 * (host + 1)."""
    for u in (r["unit"] for r in ranks):
        scale = torch.tensor(
            [float(sum(r + 1 for r in destination_ranks(row))) for row in u["indices"].tolist()]
        )
        assert u["combine_second"] is None
        torch.testing.assert_close(u["combined"], u["x"] * scale[:, None])
        torch.testing.assert_close(u["x_grad"], u["upstream"] * scale[:, None])
        expected_probs_grad = torch.tensor(
            [
                [10.0 * (e // LOCAL + 1) if e >= 0 else 0.0 for e in row]
                for row in u["indices"].tolist()
            ]
        )
        torch.testing.assert_close(u["probs_grad"], expected_probs_grad)


def test_dispatch_rejects_bad_input(ranks):
    errors = ranks[0]["unit"]["value_errors"]
    assert all(errors), f"a bad input was accepted: {errors}"
    assert "multiple of the group size" in errors[0]
    assert ">= num_experts" in errors[2]


def test_flex_deepep_dispatcher_matches_alltoall(ranks):
    for rank, result in enumerate(ranks):
        flex, reference = result["flex"], result["alltoall"]
        assert (flex["dispatcher_class"], flex["manager_class"]) == (
            "MoEFlexTokenDispatcher",
            "_DeepepManager",
        )
        assert_close(flex["out"], reference["out"], f"rank {rank} output")
        assert_close(flex["dx"], reference["dx"], f"rank {rank} input grad")
        assert_close(flex["router_grad"], reference["router_grad"], f"rank {rank} router grad")
        assert set(flex["expert_grads"]) == set(range(rank * LOCAL, (rank + 1) * LOCAL))
        for expert, grads in reference["expert_grads"].items():
            for name, a, b in zip(("fc1", "fc2"), flex["expert_grads"][expert], grads):
                assert_close(a, b, f"rank {rank} expert {expert} {name} grad")
    assert ranks[0]["num_sms"] == 20  # megatron's default, set through the stand-in


def test_layer_routing_is_skewed_and_deduplicated(ranks):
    """The layer run exercises the stand-in: load is skewed, and tokens with both experts on one
    rank travel once (received rows < expert assignments)."""
    logs = [r["flex"]["dispatch_log"] for r in ranks]
    assert all(len(log) == 1 for log in logs), logs
    rows = torch.tensor([log[0][0] for log in logs], dtype=torch.float)
    assignments = torch.tensor([log[0][1] for log in logs], dtype=torch.float)
    assert assignments.max() / assignments.mean() > 2.0, f"routing not skewed: {assignments}"
    assert (rows < assignments).any(), f"no same-rank pair in the layer run: {rows} {assignments}"
    assert assignments.sum() == 2 * 16 * 2 * WORLD  # top-2 of SEQ * BATCH tokens per rank


def test_negative_control_detached_probs_is_caught(ranks):
    """Dispatching probabilities without their gradient keeps the forward identical but must fail
    the router-gradient comparison above (so that comparison checks the probs backward)."""
    for result in ranks:
        broken, reference = result["flex-detached-probs"], result["alltoall"]
        assert_close(broken["out"], reference["out"], "forward is unaffected")
        with pytest.raises(AssertionError):
            assert_close(broken["router_grad"], reference["router_grad"], "router grad")
        with pytest.raises(AssertionError):
            assert_close(broken["dx"], reference["dx"], "input grad")
