"""Step 2 of the recipe checker: Megatron's argument validation for the full world size.

Megatron's own argument parser and ``validate_args`` run on the recipe's arguments for that world
size (``RANK=0``, ``WORLD_SIZE=N`` in the environment, no process group, no device), then UltraEP's
``validate_ultraep_args``; :func:`startup_problems` adds what Megatron checks only when it starts:
the world size against the expert grid (ETP x EP x PP x expert-DP, ``initialize_model_parallel``)
and the global batch against micro batch x DP (the microbatch calculator).

The recipe is checked for the cluster it targets, not for this machine: what this machine lacks
(DeepEP / HybridEP for the flex dispatcher) is no problem here but a note (:func:`environment_notes`);
``pretrain_gpt.py``'s startup check refuses it on the machine that runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import logging
import os
import sys
import warnings
from typing import Sequence
from unittest import mock

from ultraep_megatron.megatron.recipe_check.launch import RecipeError

#: What validation on a machine without a GPU answers when Megatron asks the device's compute
#: capability (``--moe-grouped-gemm`` needs >= 8; with TP or CP > 1 below 10 it checks
#: ``CUDA_DEVICE_MAX_CONNECTIONS``): a Hopper GPU's, the oldest the recipes target.
TARGET_CAPABILITY = (9, 0)
#: What validation on a machine without Transformer Engine answers when Megatron asks its version
#: (``is_te_min_version``; e.g. ``--delay-wgrad-compute`` with ``--overlap-grad-reduce`` needs 2.8):
#: the newest megatron-core 0.19.2's argument checks ask for, which the recipes' GPU nodes install.
TARGET_TE_VERSION = "2.12.0"


@contextlib.contextmanager
def quiet_megatron():
    """Megatron's import-time warnings (no Transformer Engine, Apex or CUDA on this machine) and
    log lines say nothing about a recipe: keep them out of the report."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


@contextlib.contextmanager
def _rank0_of(world_size: int, argv: Sequence[str]):
    """Process environment of global rank 0 in a ``world_size`` job, with ``sys.argv`` = argv."""
    saved_env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    saved_argv = sys.argv
    os.environ.update(RANK="0", WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    sys.argv = list(argv)
    try:
        yield
    finally:
        sys.argv = saved_argv
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def validate_arguments(
    script_args: Sequence[str], world_size: int
) -> tuple[argparse.Namespace, str]:
    """``pretrain_gpt.py``'s checks in its order on rank 0 of a ``world_size`` job: Megatron's parse
    (one line per refused flag or value, with a "did you mean"), UltraEP's startup checks
    (``arguments.startup_problems`` for the target machines: Megatron's settings it would refuse with
    a bare assertion or only after starting, UltraEP's arguments, the trace directory probed, not
    made; balancing that would do nothing is a problem here), then Megatron's ``validate_args`` and
    UltraEP's ``validate_ultraep_args``. No process group is created and no device is touched.

    With ``--eval-iters 0`` evaluation never runs, so its batch sizes are left to their defaults
    (the training ones): Megatron's eval-batch check then is the training batch's divisibility,
    which is reported as such.

    Returns:
        (validated arguments, everything Megatron printed while validating).

    Raises:
        RecipeError: every problem found, one line each.
    """
    with quiet_megatron():
        from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
        from megatron.training.arguments import validate_args

        from ultraep_megatron.megatron.run.arguments import (
            startup_problems as ultraep_startup_problems,
        )
        from ultraep_megatron.megatron.run.arguments import validate_ultraep_args
        from ultraep_megatron.megatron.run.megatron_checks import assertion_problem
        from ultraep_megatron.megatron.run.startup import parse_megatron_args

    import torch

    from ultraep_megatron.settings.knobs import UltraEPArgumentError

    printed = io.StringIO()
    no_gpu = contextlib.ExitStack()
    if not torch.cuda.is_available():
        no_gpu.enter_context(
            mock.patch("torch.cuda.get_device_capability", return_value=TARGET_CAPABILITY)
        )
        no_gpu.enter_context(
            mock.patch(
                "megatron.training.arguments.get_device_arch_version",
                return_value=TARGET_CAPABILITY[0],
            )
        )
    if importlib.util.find_spec("transformer_engine") is None:
        no_gpu.enter_context(
            mock.patch("megatron.training.arguments.is_te_min_version", _target_te_min_version)
        )
    try:
        with (
            _rank0_of(world_size, ["pretrain_gpt.py", *script_args]),
            quiet_megatron(),
            no_gpu,
            contextlib.redirect_stdout(printed),
            contextlib.redirect_stderr(printed),
        ):
            args, parser_errors = parse_megatron_args()
            if parser_errors:
                raise RecipeError(
                    "\n".join(
                        f"Megatron's parser refused the arguments: {e}" for e in parser_errors
                    )
                )
            problems, noop = ultraep_startup_problems(
                args, environment=False
            )  # noop: warnings there
            problems = problems or noop
            if problems:
                raise RecipeError("\n".join(problems))
            eval_batch_given = (args.eval_global_batch_size, args.eval_micro_batch_size) != (
                None,
                None,
            )
            if args.eval_iters == 0:
                args.eval_global_batch_size = args.eval_micro_batch_size = None
                eval_batch_given = False
            validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
            validate_ultraep_args(args, environment=False)  # this machine's: environment_notes
    except SystemExit:  # argparse beyond the one-line parser (a --help or a config file's error)
        lines = printed.getvalue().strip().splitlines()
        error = next(
            (line for line in reversed(lines) if ": error: " in line), lines[-1] if lines else ""
        )
        raise RecipeError(
            f"Megatron's parser refused the arguments: {error.split(': error: ', 1)[-1]}"
        ) from None
    except AssertionError as error:
        if str(error).startswith("eval_global_batch_size") and not eval_batch_given:
            raise RecipeError(batch_problem(args)) from None
        raise RecipeError(assertion_problem(error)) from None
    except UltraEPArgumentError as error:  # every problem, one line each, naming its flag
        raise RecipeError("\n".join(error.problems)) from None
    except (ValueError, RuntimeError, TypeError) as error:
        raise RecipeError(
            f"Megatron's argument check failed: {' '.join(str(error).split())}"
        ) from None
    if args.vocab_size is None:
        raise RecipeError(
            "--vocab-size is needed to size the embeddings (a HuggingFace "
            "tokenizer ignores it; recipes pass the model's vocabulary size)"
        )
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)
    return args, printed.getvalue()


def _target_te_min_version(version: str, check_equality: bool = True) -> bool:
    """megatron's ``is_te_min_version`` answered for :data:`TARGET_TE_VERSION`."""
    from packaging.version import Version

    target = Version(TARGET_TE_VERSION)
    return target >= Version(version) if check_equality else target > Version(version)


def batch_problem(args: argparse.Namespace) -> str:
    step = args.micro_batch_size * args.data_parallel_size
    below = args.global_batch_size - args.global_batch_size % step
    valid = " or ".join(str(n) for n in (below, below + step) if n > 0)
    return (
        f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
        f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} (world size "
        f"{args.world_size} / (TP x PP x CP)): Megatron's microbatch calculator refuses it at "
        f"start-up; use a multiple of {step}: {valid} (GLOBAL_BATCH_SIZE in the recipes)"
    )


def startup_problems(args: argparse.Namespace) -> list[str]:
    """What Megatron refuses only when it starts, on validated ``args``: one line each.

    ``validate_args`` checks world size = TP x PP x CP x DP; ``initialize_model_parallel`` also
    needs world size = ETP x EP x PP x expert-DP (every rank in a whole EP group: else it raises,
    and its ``RankGenerator`` would leave ranks out or divide by zero), and the microbatch
    calculator needs global batch = micro batch x DP x microbatches.
    """
    problems = []
    pp = args.pipeline_model_parallel_size
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    ep = args.expert_model_parallel_size
    grid = etp * ep * pp
    if args.world_size % grid:
        problems.append(
            f"world size {args.world_size} is not divisible by expert-TP {etp} x EP {ep} x PP {pp} = "
            f"{grid}: Megatron's initialize_model_parallel refuses it (every rank must belong to a "
            f"whole EP group); use a multiple of {grid} GPUs or another --expert-model-parallel-size"
        )
    if not (
        args.rampup_batch_size or getattr(args, "decrease_batch_size_if_needed", False)
    ) and args.global_batch_size % (args.micro_batch_size * args.data_parallel_size):
        problems.append(batch_problem(args))
    return problems


def environment_notes(args: argparse.Namespace) -> list[str]:
    """What the recipe's GPU nodes need installed that this machine cannot import, one line each
    (``capabilities.missing_packages``): no problem of the recipe, which this machine does not run."""
    from ultraep_megatron.megatron.release import capabilities

    with quiet_megatron():
        missing = capabilities.missing_packages(args)
    return [
        f"{package} must be installed on the GPU nodes: not importable here ({flags}; "
        "pretrain_gpt.py refuses to start without it)"
        for package, flags in missing
    ]
