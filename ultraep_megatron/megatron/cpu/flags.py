"""The command-line flags a CPU ``pretrain`` run needs, and applying them to a command line.

``pretrain_gpt.py`` applies the missing ones itself (``startup.startup_checks_or_exit``) and refuses
a conflicting one. No torch import.
"""

from __future__ import annotations

#: Flags a CPU ``pretrain`` run needs: flag -> (its value, or None for a switch; why).
CPU_FLAGS: dict[str, tuple[str | None, str]] = {
    "--distributed-backend": ("gloo", "NCCL needs GPUs"),
    "--transformer-impl": ("local", "Transformer Engine needs GPUs"),
    "--no-gradient-accumulation-fusion": (
        None,
        "fused wgrad accumulation is an Apex/TE CUDA kernel",
    ),
    "--no-persist-layer-norm": (None, "persistent LayerNorm is an Apex CUDA kernel"),
    "--no-bias-gelu-fusion": (None, "torch.compile'd fusion; eager is the CPU reference"),
    "--no-bias-dropout-fusion": (None, "torch.compile'd fusion; eager is the CPU reference"),
    "--no-rope-fusion": (None, "fused RoPE is a TE/Apex CUDA kernel"),
    "--no-masked-softmax-fusion": (None, "fused softmax is a CUDA kernel"),
}

#: :data:`CPU_FLAGS` as command-line arguments.
REQUIRED_ARGS: tuple[str, ...] = tuple(
    token for flag, (value, _) in CPU_FLAGS.items() for token in (flag, value) if token is not None
)


def apply_required_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` (a ``pretrain`` command line) completed with the :data:`CPU_FLAGS` it lacks.

    A missing flag is appended (a CPU run cannot do without it); a flag given with another value
    is an error, since the user asked for something this machine cannot run.

    Returns:
        (the completed argv, one line per flag applied, naming it and why).

    Raises:
        ValueError: naming every conflicting flag and the value a CPU run needs, one line each.
    """
    given: dict[str, str | None] = {}
    for i, token in enumerate(argv):
        flag, sep, value = token.partition("=")
        if flag in CPU_FLAGS:
            given[flag] = value if sep else (argv[i + 1] if i + 1 < len(argv) else None)
    argv, applied, conflicts = list(argv), [], []
    for flag, (value, why) in CPU_FLAGS.items():
        if flag not in given:
            argv += [flag] if value is None else [flag, value]
            applied.append(f"{flag}{'' if value is None else ' ' + value} ({why})")
        elif value is not None and given[flag] != value:
            conflicts.append(
                f"{flag} {given[flag]} cannot run without a CUDA device ({why}); "
                f"pass {flag} {value} or run on a GPU machine"
            )
    if conflicts:
        raise ValueError("\n".join(conflicts))
    return argv, applied
