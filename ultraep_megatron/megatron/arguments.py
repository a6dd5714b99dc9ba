"""Command-line arguments UltraEP adds to Megatron's parser, in Megatron's own style.

Pass :func:`add_ultraep_args` as ``extra_args_provider`` to
``megatron.training.arguments.parse_and_validate_args``. The ``moe balancer`` group comes from the
policy registry (``ultraep_megatron.planner.policy``: names, knobs, defaults, validation);
:func:`validate_ultraep_args` checks the combination. :func:`startup_checks_or_exit` runs it (and
the CPU and trace-directory checks) on the raw command line before Megatron validates, prints or
initialises anything.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import time
from pathlib import Path
from typing import Sequence

from ultraep_megatron.planner import policy

#: How long a rank other than rank 0 waits before exiting on an argument problem (rank 0 prints it).
NON_LOG_RANK_EXIT_DELAY_S = 5.0


def _add_moe_balancer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title='moe balancer')
    policy.add_balancer_arguments(group)
    return parser


def _add_telemetry_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title='ultraep telemetry')
    group.add_argument('--metrics-jsonl', type=str, default=None,
                       help='One JSON record per training iteration (losses, learning rate, grad '
                       'norm, per-layer expert-load imbalance) in this file, from the last rank. '
                       'A resumed run keeps the records before its first iteration; a run from '
                       'iteration 1 starts the file anew. The console/wandb logs are unchanged.')
    group.add_argument('--no-moe-load-telemetry', action='store_false',
                       dest='moe_load_telemetry',
                       help='Do not compute the per-layer expert-load imbalance '
                       '(one small reduction per iteration).')
    return parser


def add_ultraep_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: adds UltraEP's argument groups to ``parser`` (and makes
    Megatron's own help printable, see :func:`escape_stray_percent_in_help`)."""
    parser = _add_moe_balancer_args(parser)
    parser = _add_telemetry_args(parser)
    escape_stray_percent_in_help(parser)
    return parser


# A '%' that argparse expands in a help string: '%(name)s'-style or '%%'.
_HELP_FORMAT = re.compile(r"%(\(\w+\)[-#0 +]*\d*(?:\.\d+)?[a-zA-Z]|%)?")


def escape_stray_percent_in_help(parser: argparse.ArgumentParser) -> None:
    """Escape the ``%`` signs argparse cannot expand in ``parser``'s help strings.

    megatron-core 0.19.2's help of ``--moe-paged-stash-buffer-size-factor-cuda`` ends in a bare
    "10%", so ``pretrain_gpt.py --help`` died in argparse's formatting. Strings that format are
    left as they are.
    """
    for action in parser._actions:
        if not isinstance(action.help, str) or "%" not in action.help:
            continue
        try:
            action.help % {**vars(action), "prog": parser.prog}
        except (ValueError, TypeError, KeyError):
            action.help = _HELP_FORMAT.sub(lambda m: m[0] if m[1] else "%%", action.help)


def balancer_config_from_args(args: argparse.Namespace):
    """The ``BalancerConfig`` selected by ``--moe-balancer*``; ``None`` for ``none``."""
    config = policy.BalancerConfig.from_args(args)
    return None if config.name == policy.NONE else config


def balancing_context_from_args(args: argparse.Namespace):
    """The model's ``BalancingContext`` for ``--moe-balancer*``; ``None`` for ``none``."""
    config = balancer_config_from_args(args)
    if config is None:
        return None
    from ultraep_megatron.megatron.context import BalancingContext

    return BalancingContext(config)


def validate_ultraep_args(args: argparse.Namespace) -> None:
    """Check UltraEP's arguments against Megatron's (after Megatron's own validation).

    Raises:
        ValueError: on a combination that cannot run.
    """
    config = policy.BalancerConfig.from_args(args)  # the registry's validation, naming the flag
    if config.name == policy.NONE:
        return
    name = f"--moe-balancer {args.moe_balancer}"

    def fail(message: str) -> None:
        raise ValueError(f"{name}: {message}")

    if args.num_experts is None:
        fail("needs an MoE model (--num-experts)")
    ep = args.expert_model_parallel_size
    if args.num_experts % ep:
        fail(f"--num-experts {args.num_experts} is not divisible by "
             f"--expert-model-parallel-size {ep}")
    if config.domain_size is not None and ep % config.domain_size:
        fail(f"--moe-balancer-domain-size {config.domain_size} must divide --expert-model-parallel-size "
             f"{ep} (it counts the EP ranks of one NVLink domain)")
    for message in unsupported_moe_settings(args):
        fail(message)


def unsupported_moe_settings(config) -> list[str]:
    """What a balanced MoE layer cannot run, named by flag. ``config``: Megatron's args or a
    TransformerConfig (the attribute names are the same)."""
    problems = []
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    dispatcher = get('moe_token_dispatcher_type')
    if dispatcher == 'flex':
        # GPU-only (DeepEP / HybridEP); the check is whether megatron's bindings import.
        from ultraep_megatron.megatron.balanced_moe import flex_backend_problem

        problem = flex_backend_problem(config)
        if problem:
            problems.append(problem)
    elif dispatcher != 'alltoall':
        problems.append(f"--moe-token-dispatcher-type {dispatcher} is not supported; use alltoall "
                        "(or flex with DeepEP/HybridEP on GPUs)")
    if get('moe_expert_capacity_factor') is not None or get('moe_pad_expert_input_to_capacity'):
        problems.append("token dropping (--moe-expert-capacity-factor / "
                        "--moe-pad-expert-input-to-capacity) is not supported: balancing "
                        "needs dropless routing")
    # Megatron's default expert-TP size is the TP size (set by its validation).
    if (get('expert_tensor_parallel_size') or get('tensor_model_parallel_size') or 1) > 1:
        problems.append("--expert-tensor-parallel-size > 1 is not supported")
    if get('use_transformer_engine_op_fuser'):
        problems.append("--use-transformer-engine-op-fuser is not supported (its fused grouped MLP "
                        "has no per-expert weights to replicate)")
    if get('moe_router_padding_for_quantization'):
        problems.append("--moe-router-padding-for-quantization is not supported")
    if get('overlap_moe_expert_parallel_comm') or get('delay_wgrad_compute') or \
            get('overlap_dispatch_backward_with_experts_wgrad'):
        problems.append("--overlap-moe-expert-parallel-comm / --delay-wgrad-compute are not "
                        "supported")
    if get('fp8') or get('fp4'):
        # The redundant slots of every layer run one shared experts module; Transformer Engine
        # caches a module's low-precision weight casts and scales across calls, so a layer's
        # replica could run on another layer's cast weights.
        problems.append("--fp8-format / --fp4-format are not supported: the replica experts share one module "
                        "across layers and Transformer Engine would reuse its cached low-precision "
                        "weights between them; train in bf16")
    offloaded = sorted({'expert_fc1', 'moe_act', 'fused_group_mlp'} & set(get('offload_modules') or []))
    if get('fine_grained_activation_offloading') and offloaded:
        # Its saved-tensor hooks wrap the experts' own: they would keep (or offload) the replica
        # experts' weights, views of the shared buffer that later layers overwrite, as they are at
        # offload time, never waiting for the backward's re-materialization.
        problems.append(f"--offload-modules {' '.join(offloaded)} with --fine-grained-activation-offloading "
                        "is not supported: it would store the replica experts' weights, which share one "
                        "buffer across layers; offload other modules")
    for flag in ('use_megatron_fsdp', 'use_torch_fsdp2'):
        if get(flag):
            # FSDP shards every expert across the expert-data-parallel ranks and gathers it only in
            # the expert's own forward and backward; the replica transfers read whole main-expert
            # weights before the experts' forward and in the layer's backward before the experts',
            # and reduce replica gradients into the DDP main_grad buffers FSDP does not have.
            problems.append(f"--{flag.replace('_', '-')} is not supported: the replica transfers read and "
                            "write whole main-expert weights and gradients outside the experts' FSDP hooks; "
                            "use --use-distributed-optimizer")
    if get('moe_latent_size'):
        problems.append("--moe-latent-size is not supported")
    cuda_graph = get('cuda_graph_impl') or 'none'
    if cuda_graph != 'none':
        problems.append(f"--cuda-graph-impl {cuda_graph} is not supported")
    elif get('enable_cuda_graph') or get('external_cuda_graph'):  # Megatron's older spellings
        problems.append("CUDA graphs (--enable-cuda-graph / --external-cuda-graph) are not supported")
    return problems


def trace_dir_problem(args: argparse.Namespace) -> str | None:
    """Why ``--moe-balancer-trace-dir`` cannot take this run's trace (``None`` if it can).

    The directory must be (made) writable. A trace already there is appended to only by a run
    that resumes a checkpoint (``--load`` with one to load, not ``--finetune``); a fresh run
    would mix its iterations into another run's trace, so it is refused.
    """
    from ultraep_megatron.traces import TRACE_SUFFIX

    flag = f"--moe-balancer-trace-dir {args.moe_balancer_trace_dir}"
    path = Path(args.moe_balancer_trace_dir)
    if path.exists() and not path.is_dir():
        return f"{flag}: not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"{flag}: cannot create the directory ({error.strerror})"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{flag}: the directory is not writable"
    traces = sorted(p.name for p in path.glob(f"*{TRACE_SUFFIX}"))
    from megatron.training.checkpointing import checkpoint_exists

    resuming = args.load is not None and not args.finetune and (
        args.ckpt_step is not None or checkpoint_exists(args.load))
    if traces and not resuming:
        return (f"{flag} already holds a trace ({', '.join(traces)}) and this run resumes no "
                "checkpoint, so its records would be appended to another run's; use an empty "
                "directory (a run resuming with --load continues its trace there)")
    return None


def startup_problems(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(errors, warnings) about UltraEP's arguments, on Megatron's parsed, not yet validated
    ``args``; each names its flag."""
    errors, warnings = [], []
    try:
        validate_ultraep_args(args)
    except ValueError as error:
        errors.append(str(error))
    if args.moe_balancer == policy.NONE or errors:
        return errors, warnings
    if args.moe_balancer_trace_dir:
        problem = trace_dir_problem(args)
        if problem:
            errors.append(problem)
    if args.expert_model_parallel_size == 1:
        warnings.append(f"--moe-balancer {args.moe_balancer} with --expert-model-parallel-size 1: "
                        "one EP rank holds every expert, there is nothing to balance (the "
                        "balancer still plans every layer and allocates its slots)")
    return errors, warnings


def _let_rank_zero_report(log_rank: bool) -> None:
    """Before a failing rank exits: torchrun stops every rank once one fails, so a rank other than
    rank 0 waits for rank 0 to print the problems."""
    if not log_rank:
        time.sleep(NON_LOG_RANK_EXIT_DELAY_S)


def startup_checks_or_exit(argv: Sequence[str], *, prog: str = "pretrain_gpt.py",
                           extra_args_provider=None) -> list[str]:
    """UltraEP's checks of a training command line, before Megatron validates its arguments,
    prints them, initialises wandb or builds the model.

    On a CPU machine (the CPU backend active) the missing ``cpu_backend.CPU_FLAGS`` are applied
    and logged, a conflicting one is an error. Then Megatron's parser reads the command line and
    :func:`startup_problems` checks it. Every rank runs the same checks; global rank 0 prints
    each problem on one line. On an error every rank exits with status 2 (argparse's), with no
    traceback.

    Args:
        argv: the command line without the program name.
        prog: the program name for the messages.
        extra_args_provider: the parser extension the program uses besides UltraEP's.

    Returns:
        ``argv`` with the CPU flags applied; hand it to Megatron (e.g. as ``sys.argv[1:]``).
    """
    from megatron.training.arguments import parse_args

    from ultraep_megatron.megatron import cpu_backend

    log_rank = cpu_backend.is_log_rank()

    def report(kind: str, message: str) -> None:
        if log_rank:
            print(f"{prog}: {kind}: {message}", file=sys.stderr if kind == "error" else sys.stdout,
                  flush=True)

    argv, errors = list(argv), []
    if cpu_backend.is_active():
        try:
            argv, applied = cpu_backend.apply_required_args(argv)
        except ValueError as error:
            errors.append(str(error))
        else:
            if applied and not {"-h", "--help"} & set(argv):  # --help prints the help, nothing else
                report("note", "no CUDA device: the CPU backend applied " + "; ".join(applied))

    def add_args(parser):
        parser = add_ultraep_args(parser)
        return extra_args_provider(parser) if extra_args_provider else parser

    saved_argv = sys.argv
    sys.argv = [prog, *argv]
    try:
        # argparse prints its own one-line usage error; only rank 0 lets it through.
        with contextlib.redirect_stderr(sys.stderr if log_rank else io.StringIO()):
            args = parse_args(extra_args_provider=add_args, ignore_unknown_args=True)
    except SystemExit as parser_exit:
        if parser_exit.code:  # argparse's error: rank 0 prints it
            _let_rank_zero_report(log_rank)
        raise
    finally:
        sys.argv = saved_argv
    problems, warnings = startup_problems(args)
    errors += problems
    for message in warnings:
        report("warning", message)
    for message in errors:
        report("error", message)
    if errors:
        _let_rank_zero_report(log_rank)
        sys.exit(2)
    return argv
