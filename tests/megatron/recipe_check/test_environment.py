"""The recipe checker judges a recipe for the cluster it targets, not for this machine: a flex
dispatcher backend (DeepEP / HybridEP) this machine cannot import is a NOTE, not a problem, while
``pretrain_gpt.py``'s startup check (``arguments.startup_problems``, on the machine that runs it)
still refuses it with its one-line message. A configuration the balanced dispatcher cannot run
(a backend it does not know) is refused by both.

Whether the backend imports is megatron's own binding (``token_dispatcher.hybrid_ep_dispatch``),
set here both ways, so the tests hold on a machine with HybridEP installed too; "installed" is the
negative control: no note, no refusal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ultraep_megatron.megatron.run import arguments
from ultraep_megatron.megatron.release import compat
from ultraep_megatron.megatron import recipe_check as rc

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
GB200 = RECIPES / "qwen3_235b_a22b_ep64_dp4.sh"
#: pretrain_gpt.py's refusal, as it was before the checker learnt to tell the two apart.
REFUSAL = (
    "--moe-balancer ultraep: --moe-token-dispatcher-type flex with --moe-flex-dispatcher-backend "
    "hybridep needs HybridEP (deep_ep's hybrid_ep), which is not installed (it needs CUDA); use "
    "--moe-token-dispatcher-type alltoall"
)
NOTE = (
    "HybridEP (deep_ep's hybrid_ep) must be installed on the GPU nodes: not importable here "
    "(--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep; pretrain_gpt.py "
    "refuses to start without it)"
)


@pytest.fixture(scope="module")
def launch():
    # the recipe's default dispatcher; MASTER_ADDR as on the nodes (without it: a NOTE of its own)
    return rc.capture_launch(GB200, {"DISPATCHER": "", "MASTER_ADDR": "node0"})


def hybridep_installed(monkeypatch, installed: bool) -> None:
    from megatron.core.transformer.moe import token_dispatcher

    monkeypatch.setattr(
        token_dispatcher, "hybrid_ep_dispatch", object() if installed else None, raising=False
    )


@pytest.mark.parametrize("installed", [False, True], ids=["not_installed", "installed_control"])
def test_check_recipe_notes_a_missing_hybridep_and_startup_still_refuses(
    launch, monkeypatch, installed
):
    hybridep_installed(monkeypatch, installed)
    report = rc.check_launch(launch)
    assert (report.args.moe_token_dispatcher_type, report.args.moe_flex_dispatcher_backend) == (
        "flex",
        "hybridep",
    )
    assert report.problems() == []
    assert report.notes == ([] if installed else [NOTE])
    assert ("  NOTE: " + NOTE in rc.format_report(report).splitlines()) != installed
    errors, _ = arguments.startup_problems(report.args)  # what pretrain_gpt.py runs first
    assert errors == ([] if installed else [REFUSAL])


def test_a_backend_the_balancer_does_not_know_is_still_refused_by_the_checker(launch, monkeypatch):
    """A configuration problem: one PROBLEM line, whatever this machine has installed."""
    hybridep_installed(monkeypatch, False)
    with pytest.raises(rc.RecipeError) as raised:
        rc.check_launch(
            rc.Launch(
                4, 64, "pretrain_gpt.py", [*launch.args, "--moe-flex-dispatcher-backend", "ncclep"]
            )
        )
    refusal = (
        "--moe-balancer ultraep: --moe-flex-dispatcher-backend ncclep is not supported with a balancer; "
        "use deepep or hybridep"
    )
    if (
        compat.is_018()
    ):  # megatron-core 0.18 has no ncclep backend: its own parser refuses the value
        refusal = (
            "Megatron's parser refused the arguments: argument --moe-flex-dispatcher-backend: invalid "
            "choice: 'ncclep' (choose from 'deepep', 'hybridep')"
        )
    assert raised.value.problem.splitlines() == [refusal]
