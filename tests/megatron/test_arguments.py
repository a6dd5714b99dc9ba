"""The ``--moe-balancer-*`` flags (``settings/knobs.py``, added to Megatron's parser by
``megatron/run/arguments.py``): one table of knobs gives Megatron's and ``ultraep``'s flags and their
defaults, the planner's rules (``BalancerConfig.problems``) their validation naming each flag; the
planner receives plain numbers.
Bad values fail at startup with a message naming the flag, as in pretrain_gpt.py: UltraEP's startup
checks on Megatron's parse of the command line, then Megatron's own parser and validation (one
subprocess for all command lines, no distributed setup; the Megatron settings a balanced layer
refuses: test_capabilities.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from megatron_runs import argument_verdicts, check_verdict, tiny_moe_args

from ultraep_megatron.megatron.run import arguments
from ultraep_megatron.planner import BalancerConfig
from ultraep_megatron.planner.balancer import DEFAULT_NUM_SLOTS
from ultraep_megatron.settings import knobs
from ultraep_megatron.settings.hardware import (
    DEFAULT_SHAPE,
    HARDWARE_PRESETS,
    hardware_min_quota,
    hardware_preset,
    min_quota_from_hardware,
)


def parsed(*argv, **add):
    parser = argparse.ArgumentParser()
    knobs.add_balancer_arguments(parser, **add)
    return parser.parse_args(list(argv))


def test_defaults_and_the_flags_built_from_them():
    args = parsed()
    assert args.moe_balancer == "none" and arguments.balancer_config_from_args(args) is None
    config = arguments.balancer_config_from_args(parsed("--moe-balancer", "ultraep"))
    planner_fields = set(BalancerConfig.__dataclass_fields__)
    for knob in knobs.KNOBS:  # parser default == knob default == the planner's default
        assert getattr(args, knob.dest) == knob.default, knob.flag
        if knob.field in planner_fields:
            assert (
                knob.default == getattr(BalancerConfig(), knob.field) == getattr(config, knob.field)
            ), knob.flag
        else:
            assert knob.runtime_only or knob.field == "hardware", knob.flag
    assert config.num_slots == DEFAULT_NUM_SLOTS == 2
    replay_parser = argparse.ArgumentParser()
    knobs.add_balancer_arguments(replay_parser, runtime=False, balancer_flag=False)
    flags = {a.option_strings[0] for a in replay_parser._actions if a.option_strings}
    assert "--moe-balancer-trace-dir" not in flags and "--moe-balancer-num-slots" in flags
    assert "--moe-balancer" not in flags
    # Knobs a parser does not define keep their defaults.
    partial = arguments.balancer_config_from_args(
        argparse.Namespace(moe_balancer="eplb", moe_balancer_eplb_window=4)
    )
    assert (partial.name, partial.eplb_window, partial.num_slots) == ("eplb", 4, DEFAULT_NUM_SLOTS)


@pytest.mark.parametrize(
    "changes,flag",
    [
        ({"moe_balancer": "lplb"}, "--moe-balancer"),
        ({"moe_balancer_num_slots": -1}, "--moe-balancer-num-slots"),
        ({"moe_balancer_num_slots": True}, "--moe-balancer-num-slots"),
        ({"moe_balancer_min_quota": 0}, "--moe-balancer-min-quota"),
        ({"moe_balancer_eplb_window": 0}, "--moe-balancer-eplb-window"),
        ({"moe_balancer_eplb_interval": 0}, "--moe-balancer-eplb-interval"),
        ({"moe_balancer_ring_size": 0}, "--moe-balancer-ring-size"),
        ({"moe_balancer_trigger": 0.9}, "--moe-balancer-trigger"),
        ({"moe_balancer_trigger": "1.2"}, "--moe-balancer-trigger"),
        ({"moe_balancer_domain_size": 0}, "--moe-balancer-domain-size"),
        ({"moe_balancer_hardware": "tpu-pod"}, "--moe-balancer-hardware"),
        ({"moe_balancer": "none", "moe_balancer_trace_dir": "/tmp/x"}, "--moe-balancer-trace-dir"),
    ],
)
def test_validation_names_the_flag(changes, flag):
    args = argparse.Namespace(**{**vars(parsed("--moe-balancer", "ultraep")), **changes})
    with pytest.raises(ValueError, match=flag):
        arguments.balancer_config_from_args(args)


def test_every_problem_is_named_not_only_the_first():
    """validate_ultraep_args collects: four problems of a command line, four lines, each naming its
    flag (knobs, the model, the settings a balanced layer refuses)."""
    args = argparse.Namespace(
        **vars(
            parsed(
                "--moe-balancer",
                "ultraep",
                "--moe-balancer-num-slots",
                "-1",
                "--moe-balancer-trigger",
                "0.5",
            )
        ),
        num_experts=6,
        expert_model_parallel_size=4,
        moe_token_dispatcher_type="allgather",
    )
    with pytest.raises(ValueError) as raised:
        arguments.validate_ultraep_args(args)
    lines = str(raised.value).splitlines()
    assert raised.value.problems == lines
    flags = [
        "--moe-balancer-num-slots",
        "--moe-balancer-trigger",
        "--num-experts 6",
        "--moe-token-dispatcher-type allgather",
    ]
    assert len(lines) == len(flags) and all(flag in line for flag, line in zip(flags, lines)), lines
    # The startup check says the experts' split once, first, as Megatron's setting with its fix.
    errors, warnings = arguments.startup_problems(args)
    assert warnings == [] and errors[0].startswith(
        "--num-experts 6 is not a multiple of --expert-model-parallel-size 4"
    )
    assert errors[1:] == [line for line in lines if "--num-experts" not in line]


def test_hardware_presets_are_named_in_the_flag_help():
    help_text = next(k.help for k in knobs.KNOBS if k.field == "hardware")
    assert all(name in help_text for name in HARDWARE_PRESETS)


def test_hardware_floor_reaches_the_planner_as_a_number():
    """``--moe-balancer-hardware`` sets the planner's min quota (and so its default trigger); an
    explicit ``--moe-balancer-min-quota`` wins."""
    q = min_quota_from_hardware(DEFAULT_SHAPE, hardware_preset("h100-hgx"), training=True)
    assert q == hardware_min_quota("h100-hgx") > 1
    config = arguments.balancer_config_from_args(
        parsed("--moe-balancer", "ultraep", "--moe-balancer-hardware", "h100-hgx")
    )
    assert config.min_quota == q
    given = arguments.balancer_config_from_args(
        parsed(
            "--moe-balancer",
            "ultraep",
            "--moe-balancer-hardware",
            "h100-hgx",
            "--moe-balancer-min-quota",
            "7",
        )
    )
    assert given.min_quota == 7
    balancer = config.build()
    mean = 40_000
    for excess, balanced in ((q - 1, False), (q, True)):
        load = torch.zeros(4, 8, dtype=torch.int64)
        load[:, 0::2] = torch.tensor([mean + excess, mean, mean, mean - excess]) // 4
        load[0, 0::2] += torch.tensor([mean + excess, mean, mean, mean - excess]) % 4
        assert balancer.balances(load) == balanced, excess


BASE = tiny_moe_args(ep=1, train_iters=2)
ULTRAEP = ["--moe-balancer", "ultraep"]
# Trace directories, made by the fixture under its temporary directory ({tmp} below).
HELD_TRACE = "{tmp}/held/ep_group_0000.uetrace"  # an earlier run's trace
RESUMABLE = "{tmp}/ckpt/latest_checkpointed_iteration.txt"  # a checkpoint to resume
A_FILE = "{tmp}/a_file"

COMMAND_LINES = {
    # name: (extra argv, substring the error must contain; None = must pass)
    "valid_ultraep": (ULTRAEP, None),
    "valid_none": ([], None),
    "valid_eplb": (["--moe-balancer", "eplb", "--moe-balancer-eplb-window", "4"], None),
    "negative_slots": ([*ULTRAEP, "--moe-balancer-num-slots", "-1"], "--moe-balancer-num-slots"),
    "zero_min_quota": ([*ULTRAEP, "--moe-balancer-min-quota", "0"], "--moe-balancer-min-quota"),
    "bad_eplb_window": (
        ["--moe-balancer", "eplb", "--moe-balancer-eplb-window", "0"],
        "--moe-balancer-eplb-window",
    ),
    "ring_size_zero": ([*ULTRAEP, "--moe-balancer-ring-size", "0"], "--moe-balancer-ring-size"),
    "valid_domain_trigger_hardware": (
        [
            *ULTRAEP,
            "--moe-balancer-domain-size",
            "1",
            "--moe-balancer-trigger",
            "1.2",
            "--moe-balancer-hardware",
            "h100-hgx",
        ],
        None,
    ),
    "trigger_below_one": ([*ULTRAEP, "--moe-balancer-trigger", "0.5"], "--moe-balancer-trigger"),
    "unknown_hardware": ([*ULTRAEP, "--moe-balancer-hardware", "tpu"], "--moe-balancer-hardware"),
    "unknown_balancer": (["--moe-balancer", "magic"], "--moe-balancer"),
    "trace_without_balancer": (["--moe-balancer-trace-dir", "/tmp/x"], "--moe-balancer-trace-dir"),
    "trace_dir_is_a_file": ([*ULTRAEP, "--moe-balancer-trace-dir", A_FILE], "not a directory"),
    "trace_dir_under_a_file": (
        [*ULTRAEP, "--moe-balancer-trace-dir", A_FILE + "/trace"],
        "cannot create the directory",
    ),
    "fresh_run_into_a_trace": (
        [*ULTRAEP, "--moe-balancer-trace-dir", "{tmp}/held"],
        "already holds a trace (ep_group_0000.uetrace)",
    ),
    "finetune_into_a_trace": (
        [*ULTRAEP, "--moe-balancer-trace-dir", "{tmp}/held", "--load", "{tmp}/ckpt", "--finetune"],
        "already holds a trace",
    ),
    "resume_into_its_trace": (
        [*ULTRAEP, "--moe-balancer-trace-dir", "{tmp}/held", "--load", "{tmp}/ckpt"],
        None,
    ),
    "new_trace_dir": ([*ULTRAEP, "--moe-balancer-trace-dir", "{tmp}/new/trace"], None),
    # Three problems at once: three lines (test_three_problems_are_three_lines).
    "three_problems": (
        [
            *ULTRAEP,
            "--moe-balancer-num-slots",
            "-1",
            "--moe-balancer-domain-size",
            "0",
            "--moe-balancer-trace-dir",
            A_FILE,
        ],
        "--moe-balancer-num-slots",
    ),
}
# Every command line runs at EP=1: a balancer whose flags are valid is warned about it.
WARNED = {
    "valid_ultraep",
    "valid_eplb",
    "valid_domain_trigger_hardware",
    *(name for name in COMMAND_LINES if "trace" in name),
} - {"trace_without_balancer"}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("args")
    for made in (HELD_TRACE, RESUMABLE, A_FILE):
        made = Path(made.format(tmp=tmp))
        made.parent.mkdir(parents=True, exist_ok=True)
        made.write_text("1")
    return argument_verdicts(
        {
            name: [a.format(tmp=tmp) for a in [*BASE, *extra]]
            for name, (extra, _) in COMMAND_LINES.items()
        }
    )


@pytest.mark.parametrize("name", list(COMMAND_LINES))
def test_command_line(verdicts, name):
    check_verdict(verdicts[name], name, COMMAND_LINES[name][1], warned=name in WARNED)


def test_three_problems_are_three_lines(verdicts):
    """pretrain_gpt.py's startup checks report every problem, one line each naming its flag (the
    trace directory's too), not the first alone."""
    errors = verdicts["three_problems"]["errors"]
    assert [e.split(" ", 1)[0] for e in errors] == [
        "--moe-balancer-num-slots",
        "--moe-balancer-domain-size",
        "--moe-balancer-trace-dir",
    ], errors
    assert "not a directory" in errors[2] and all("\n" not in e for e in errors)


def test_planner_flag_choices_and_balancers():
    """--moe-balancer-planner: host or device; device plans ultraep only; by default host here (no
    CUDA, or the CPU backend)."""
    from ultraep_megatron.megatron.balanced_layer.context import resolve_planner

    assert parsed("--moe-balancer-planner", "device").moe_balancer_planner == "device"
    with pytest.raises(SystemExit):
        parsed("--moe-balancer-planner", "gpu")
    for balancer, planner, bad in (
        ("ultraep", "device", False),
        ("ultraep", "host", False),
        ("eplb", "device", True),
        ("eplb-exact", "host", False),
        ("ultraep", "gpu", True),
    ):
        args = argparse.Namespace(moe_balancer=balancer, moe_balancer_planner=planner)
        problems = knobs.knob_problems(args)[1]
        assert bool(problems) == bad and all("--moe-balancer-planner" in p for p in problems), (
            problems
        )
    if not torch.cuda.is_available():
        assert resolve_planner(None, "ultraep") == "host"
    assert (
        resolve_planner("device", "ultraep") == "device" and resolve_planner(None, "eplb") == "host"
    )
    with pytest.raises(ValueError, match="ultraep only"):
        resolve_planner("device", "eplb")
