"""The arguments a Megatron checkpoint was saved with, read with megatron-core's own reader; the
resume experiment (``ultraep resume-experiment``) checks and passes on its ``--train-iters``.

Megatron is imported only when a ``torch_dist`` checkpoint is read.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["checkpoint_args"]


def checkpoint_args(checkpoint: Path, step: int):
    """The arguments the run that saved ``checkpoint``'s iteration ``step`` was launched with
    (Megatron's ``args`` in its common state), or ``None`` when the directory holds no checkpoint
    files this knows (``torch_dist``: ``metadata.json``; ``torch``: ``mp_rank_*/model_optim_rng.pt``).

    Raises:
        ValueError: the files are there but cannot be read.
    """
    directory = Path(checkpoint) / f"iter_{step:07d}"
    torch_format = sorted(directory.glob("mp_rank_*/model_optim_rng.pt"))
    try:
        if (directory / "metadata.json").is_file():
            import warnings

            with warnings.catch_warnings():  # Megatron's import-time notes (no TE, no Apex)
                warnings.simplefilter("ignore")
                from megatron.core.dist_checkpointing.serialization import load_common_state_dict

                return load_common_state_dict(str(directory))["args"]
        if torch_format:
            import torch

            # mmap: the arguments without reading the weights.
            return torch.load(torch_format[0], map_location="cpu", mmap=True, weights_only=False)[
                "args"
            ]
    except Exception as error:
        raise ValueError(
            f"{directory}: cannot read the checkpoint's arguments ({error!r})"
        ) from None
    return None
