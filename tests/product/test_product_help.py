"""`python pretrain_gpt.py --help`, the first command many users type: exit 0 on a machine without
a GPU, Megatron's arguments and UltraEP's groups with their defaults, nothing else on the screen."""

from __future__ import annotations

import argparse
import os
import re

import pytest

from gloo_launch import run_python
from product_runs import REPO

from ultraep_megatron.megatron.run.arguments import add_ultraep_args, escape_stray_percent_in_help
from ultraep_megatron.planner.baselines import registry
from ultraep_megatron.settings.knobs import KNOBS


@pytest.fixture(scope="module")
def help_run():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, whatever machine the suite runs on
    return run_python(REPO / "pretrain_gpt.py", ["--help"], cwd=REPO, env=env)


def test_help_exits_0_without_a_gpu_and_prints_only_the_help(help_run):
    assert help_run.returncode == 0, help_run.stderr[-3000:]
    assert help_run.stdout.startswith("usage: pretrain_gpt.py")
    assert help_run.stderr == ""  # no import warnings, no CPU-backend banner, no traceback
    # Megatron's own help text, its bare percent sign included, is there.
    assert "--moe-paged-stash-buffer-size-factor-cuda" in help_run.stdout
    assert "(e.g. 1.10 = 10%)" in help_run.stdout


def test_help_lists_the_balancer_groups_with_their_defaults(help_run):
    text = " ".join(help_run.stdout.split())  # argparse wraps lines
    balancer = text[text.index("moe balancer:") : text.index("ultraep telemetry:")]
    assert f"--moe-balancer {{{','.join(registry.MOE_BALANCERS)}}}" in balancer
    assert "Default: none." in balancer
    for knob in KNOBS:
        assert knob.flag in balancer
        if knob.default is not None and knob.action is None:
            assert f"Default: {knob.default}." in balancer, knob.flag
    # Derived defaults, said so: the min quota and the trigger (argparse also wraps after hyphens).
    unwrapped = re.sub(r"(?<=\w)- (?=\w)", "-", balancer)
    assert (
        "Default: derived from --moe-balancer-hardware when given, else 1% of the mean per-rank load"
        in unwrapped
    )
    assert "Default: 1 + min quota / mean rank load of the microbatch" in unwrapped
    for flag in ("--metrics-jsonl", "--no-moe-load-telemetry"):
        assert flag in text[text.index("ultraep telemetry:") :]


def test_megatrons_own_help_needs_the_escape():
    """Negative control: Megatron's parser alone cannot format its help; escaped, it can, and
    help strings that already formatted (e.g. '%(default)s') are untouched."""
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(
        argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    )
    with pytest.raises(ValueError, match="unsupported format character"):
        parser.format_help()
    parser = add_ultraep_args(
        add_megatron_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False))
    )
    assert "10%" in parser.format_help()
    probe = argparse.ArgumentParser(prog="p")
    probe.add_argument("--a", default=3, help="%(default)s of 100%% and 5% more")
    escape_stray_percent_in_help(probe)
    assert "3 of 100% and 5% more" in " ".join(probe.format_help().split())
