"""patches/: `--moe-balancer` in a user's Megatron-LM checkout by a small change to its
pretrain_gpt.py, one patch per release: megatron-lm-core_v0.19.0-pretrain_gpt.patch (tag
core_v0.19.0, three hunks) and megatron-lm-core_v0.18.x-pretrain_gpt.patch (tags core_v0.18.0 /
core_v0.18.2, branch core_r0.18.0: one file; two hunks).

Megatron-LM's file cannot be fetched by CI (no package ships it), so these tests check each patch
itself: that it is a well-formed diff that applies (git apply) to a file holding its context, and
that the code it adds -- run in the context it expects, with Megatron's own parser and GPT model
config (0.19) or model provider (0.18) -- adds the flags, swaps the MoE layers of Megatron's default
spec for balanced ones and installs the telemetry. The code of a patch runs on its own megatron-core
release: the 0.19 patch in the whole suite, the 0.18 one in CI's megatron-core 0.18 run
(``ULTRAEP_MCORE=0.18 bash tools/run_tests.sh tests/product/test_product_patch.py``); on the other
release it is skipped, saying so.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from gloo_launch import run_python
from product_runs import REPO, recipe_env
from ultraep_megatron.megatron.release import compat

#: megatron-core release -> (its patch, the number of hunks).
PATCHES = {
    "0.19": (REPO / "patches" / "megatron-lm-core_v0.19.0-pretrain_gpt.patch", 3),
    "0.18": (REPO / "patches" / "megatron-lm-core_v0.18.x-pretrain_gpt.patch", 2),
}
WORKER = REPO / "tests" / "product" / "workers" / "patch_hook.py"
HUNK = re.compile(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@")

TINY_ARGS = [
    "--distributed-backend",
    "gloo",
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-masked-softmax-fusion",
    "--num-layers",
    "3",
    "--hidden-size",
    "64",
    "--ffn-hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--num-experts",
    "8",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "64",
    "--moe-layer-freq",
    "([0]+[1]*2)",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--disable-bias-linear",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "2",
    "--lr",
    "1e-3",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "256",
]


def hunks(text: str):
    """[(old_start, old_lines, new_lines)] of a one-file unified diff."""
    out, current = [], None
    for line in text.splitlines():
        match = HUNK.match(line)
        if match:
            current = (int(match[1]), [], [])
            out.append(current)
            expected = (int(match[2]), int(match[4]))
            current[1].append(expected)
        elif current is not None and line[:1] in (" ", "-", "+"):
            if line[0] in " -":
                current[1].append(line[1:])
            if line[0] in " +":
                current[2].append(line[1:])
    return [(start, old[1:], new, old[0]) for start, old, new in out]


@pytest.mark.parametrize("release", PATCHES)
def test_patch_is_a_well_formed_diff_of_pretrain_gpt(tmp_path, release):
    patch, num_hunks = PATCHES[release]
    text = patch.read_text()
    assert text.startswith("diff --git a/pretrain_gpt.py b/pretrain_gpt.py\n")
    parsed = hunks(text)
    assert len(parsed) == num_hunks
    for _, old, new, (old_count, new_count) in parsed:
        assert (len(old), len(new)) == (old_count, new_count)
    # A file holding each hunk's context at its line numbers, filler elsewhere: the patch must
    # apply there, and yield exactly its post-image.
    length = max(start + len(old) for start, old, _, _ in parsed) + 5
    lines = [f"# filler line {i}" for i in range(1, length + 1)]
    for start, old, _, _ in parsed:
        lines[start - 1 : start - 1 + len(old)] = old
    (tmp_path / "pretrain_gpt.py").write_text("\n".join(lines) + "\n")
    applied = subprocess.run(
        ["git", "apply", "--verbose", str(patch)], cwd=tmp_path, capture_output=True, text=True
    )
    assert applied.returncode == 0, applied.stderr
    patched = (tmp_path / "pretrain_gpt.py").read_text().splitlines()
    offset = 0
    for start, old, new, _ in parsed:
        begin = start - 1 + offset
        assert patched[begin : begin + len(new)] == new
        offset += len(new) - len(old)


def on_release(release: str):
    """Skip unless the installed megatron-core is ``release``: a patch's code runs on its own."""
    if compat.release() != release:
        pytest.skip(
            f"the {release} patch's code needs megatron-core {release} (installed: "
            f"{compat.version_string()}; run with ULTRAEP_MCORE={release})"
        )


def run_hook(release: str, *args: str) -> dict:
    on_release(release)
    completed = run_python(
        WORKER, [release, str(PATCHES[release][0]), *TINY_ARGS, *args], env=recipe_env()
    )
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-4000:]
    line = next(l for l in completed.stdout.splitlines() if l.startswith("PATCH_HOOK "))
    return json.loads(line[len("PATCH_HOOK ") :])


@pytest.mark.slow
@pytest.mark.parametrize("release", PATCHES)
def test_patched_code_balances_the_moe_layers_of_megatrons_default_spec(release):
    report = run_hook(release, "--moe-balancer", "ultraep", "--moe-balancer-num-slots", "3")
    assert report["moe_balancer"] == "ultraep" and report["spec_replaced"]
    # Layer 1 is dense (--moe-layer-freq), layers 2-3 are balanced MoE layers.
    assert "MoE" not in report["mlp_classes"][0]
    assert report["mlp_classes"][1:] == ["BalancedMoELayer", "BalancedMoELayer"]
    assert report["balancer_configs"] == [None, ["ultraep", 3], ["ultraep", 3]]
    assert report["training_log"] == "_TrainingLogHook" and report["dashboard"] == "Dashboard"
    # The MTP block's spec is balanced too, and the built model is checked for unbalanced layers.
    assert report["mtp_spec_balanced"]
    assert {"refuse_unbalanced_moe_layers", "end_iterations_with_model_grads"} <= set(
        report["post_wrap_hooks"]
    )
    if (
        release == "0.18"
    ):  # the model is built from the balanced specs, not by the checkout's builder
        assert report["checkout_builder_used"] is False


@pytest.mark.slow
@pytest.mark.parametrize("release", PATCHES)
def test_patched_code_leaves_megatron_unchanged_without_a_balancer(release):
    report = run_hook(release, "--moe-balancer", "none")
    assert not report["spec_replaced"] and not report["mtp_spec_balanced"]
    if release == "0.18":  # the checkout's own builder builds the model
        assert report["checkout_builder_used"] is True
    assert "MoE" not in report["mlp_classes"][0]
    assert report["mlp_classes"][1:] == ["MoELayer", "MoELayer"]
    # Telemetry still reports the router's per-layer imbalance.
    assert report["training_log"] == "_TrainingLogHook"
