"""megatron-core's real MoELayer on 4 gloo CPU ranks: expert parallelism changes nothing.

One 4-rank launch runs the layer at EP=1, 2 and 4 (plus EP=2/4 with experts loaded in a
rolled order, the negative control); the assertions here compare those runs with each other
and with an independent pure-torch MoE computed in this process.
"""

import pytest
import torch
import torch.nn.functional as F

from gloo_launch import WORKERS, launch_gloo_ranks

WORLD = 4
TOPK = 2
# Same tokens, same experts: only the order of float additions in the all-to-all path may
# differ. The pure-torch reference computes each expert on a different batch composition.
EP_RTOL, EP_ATOL = 1e-6, 1e-6
REF_RTOL, REF_ATOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("moe_layer_ep")
    launch_gloo_ranks(
        WORKERS / "moe_layer_ep.py",
        WORLD,
        ["--out-dir", out_dir, "--ep-sizes", "1,2,4", "--permute-experts"],
        timeout_s=300,
    )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def reference_moe(x, weights):
    """Top-2 softmax-over-top-k MoE with GELU experts, token by token in plain torch.

    Args:
        x: tokens [S, B, H]. weights: router [E, H], fc1 [E, F, H], fc2 [E, H, F].
    Returns:
        output [S, B, H].
    """
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ weights["router"].T  # [T, E]
    top_logits, top_experts = logits.topk(TOPK, dim=-1)  # [T, K]
    gates = top_logits.softmax(dim=-1)  # [T, K]
    out = torch.zeros_like(tokens)
    for k in range(TOPK):
        fc1 = weights["fc1"][top_experts[:, k]]  # [T, F, H]
        fc2 = weights["fc2"][top_experts[:, k]]  # [T, H, F]
        hidden = F.gelu(torch.einsum("tfh,th->tf", fc1, tokens))
        out = out + gates[:, k : k + 1] * torch.einsum("thf,tf->th", fc2, hidden)
    return out.reshape(x.shape)


def reference_grads(result):
    """Output and gradients of the pure-torch MoE on one rank's tokens."""
    weights = {k: v.clone().requires_grad_(True) for k, v in result["weights"].items()}
    x = result["x"].clone().requires_grad_(True)
    out = reference_moe(x, weights)
    (out * result["upstream"]).sum().backward()
    return out.detach(), x.grad, {k: v.grad for k, v in weights.items()}


def max_rel_err(actual, expected):
    """max |actual - expected| / max |expected|: the error relative to the tensor's scale."""
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


@pytest.mark.slow
def test_ep1_matches_independent_reference(rank_results):
    for result in rank_results:
        out, dx, grads = reference_grads(result)
        run = result["runs"]["ep1"]
        torch.testing.assert_close(run["out"], out, rtol=REF_RTOL, atol=REF_ATOL)
        torch.testing.assert_close(run["dx"], dx, rtol=REF_RTOL, atol=REF_ATOL)
        torch.testing.assert_close(
            run["router_grad"], grads["router"], rtol=REF_RTOL, atol=REF_ATOL
        )
        for expert, (fc1_grad, fc2_grad) in run["expert_grads"].items():
            torch.testing.assert_close(fc1_grad, grads["fc1"][expert], rtol=REF_RTOL, atol=REF_ATOL)
            torch.testing.assert_close(fc2_grad, grads["fc2"][expert], rtol=REF_RTOL, atol=REF_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("ep_size", [2, 4])
def test_ep_outputs_and_input_grads_equal_ep1(rank_results, ep_size):
    for result in rank_results:
        ep1, epn = result["runs"]["ep1"], result["runs"][f"ep{ep_size}"]
        assert epn["loaded_experts"] == sorted(epn["loaded_experts"])
        assert len(epn["loaded_experts"]) == 8 // ep_size
        torch.testing.assert_close(epn["out"], ep1["out"], rtol=EP_RTOL, atol=EP_ATOL)
        torch.testing.assert_close(epn["dx"], ep1["dx"], rtol=EP_RTOL, atol=EP_ATOL)
        torch.testing.assert_close(
            epn["router_grad"], ep1["router_grad"], rtol=EP_RTOL, atol=EP_ATOL
        )


@pytest.mark.slow
@pytest.mark.parametrize("ep_size", [2, 4])
def test_ep_expert_grads_sum_ep1_grads_over_the_ep_group(rank_results, ep_size):
    """An expert sharded by EP sees the tokens of its whole EP group: its gradient is the sum
    of the EP=1 gradients (each from one rank's tokens) over that group."""
    for result in rank_results:
        run = result["runs"][f"ep{ep_size}"]
        assert len(run["ep_group"]) == ep_size
        for expert, (fc1_grad, fc2_grad) in run["expert_grads"].items():
            expected_fc1 = sum(
                rank_results[r]["runs"]["ep1"]["expert_grads"][expert][0] for r in run["ep_group"]
            )
            expected_fc2 = sum(
                rank_results[r]["runs"]["ep1"]["expert_grads"][expert][1] for r in run["ep_group"]
            )
            # A sum over ranks vs one matmul over all tokens: rounding differs, so the bound
            # is relative to the gradient's scale.
            assert max_rel_err(fc1_grad, expected_fc1) <= EP_RTOL
            assert max_rel_err(fc2_grad, expected_fc2) <= EP_RTOL


@pytest.mark.slow
@pytest.mark.parametrize("ep_size", [2, 4])
def test_negative_control_permuted_experts_differ(rank_results, ep_size):
    """Loading the experts in a rolled order must break the equality checked above."""
    for result in rank_results:
        ep1, permuted = result["runs"]["ep1"], result["runs"][f"ep{ep_size}-permuted"]
        assert permuted["loaded_experts"] != result["runs"][f"ep{ep_size}"]["loaded_experts"]
        with pytest.raises(AssertionError):
            torch.testing.assert_close(permuted["out"], ep1["out"], rtol=EP_RTOL, atol=EP_ATOL)
        assert max_rel_err(permuted["out"], ep1["out"]) > 1e-2
        with pytest.raises(AssertionError):
            torch.testing.assert_close(permuted["dx"], ep1["dx"], rtol=EP_RTOL, atol=EP_ATOL)
