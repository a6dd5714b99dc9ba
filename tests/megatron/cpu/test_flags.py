"""The flags a CPU run needs (``megatron/cpu/flags.py``), applied to a ``pretrain`` command line."""

import pytest

from ultraep_megatron.megatron.cpu import flags as cpu_flags


def test_missing_cpu_flags_are_applied_with_their_reasons():
    argv = ["--num-layers", "2", "--transformer-impl=local", "--no-rope-fusion"]
    completed, applied = cpu_flags.apply_required_args(argv)
    assert completed[:4] == argv, "the given arguments are kept"
    assert sorted(completed[4:]) == sorted(
        token
        for flag, (value, _) in cpu_flags.CPU_FLAGS.items()
        if flag not in ("--transformer-impl", "--no-rope-fusion")
        for token in (flag, value)
        if token is not None
    )
    assert applied[0] == "--distributed-backend gloo (NCCL needs GPUs)"
    assert len(applied) == len(cpu_flags.CPU_FLAGS) - 2
    assert cpu_flags.apply_required_args(completed) == (completed, []), "nothing left to apply"


@pytest.mark.parametrize(
    "argv", [["--transformer-impl", "transformer_engine"], ["--distributed-backend=nccl"]]
)
def test_conflicting_cpu_flag_is_refused_naming_what_to_pass(argv):
    flag = argv[0].split("=")[0]
    with pytest.raises(ValueError, match=f"pass {flag} {cpu_flags.CPU_FLAGS[flag][0]}"):
        cpu_flags.apply_required_args(argv)


def test_every_conflicting_cpu_flag_is_refused_one_line_each():
    with pytest.raises(ValueError) as raised:
        cpu_flags.apply_required_args(
            ["--transformer-impl", "transformer_engine", "--distributed-backend=nccl"]
        )
    lines = str(raised.value).splitlines()
    assert len(lines) == 2, lines
    assert (
        "pass --distributed-backend gloo" in lines[0]
        and "pass --transformer-impl local" in lines[1]
    )
