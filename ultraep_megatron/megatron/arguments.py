"""Command-line arguments UltraEP adds to Megatron's parser, in Megatron's own style.

Pass :func:`add_ultraep_args` as ``extra_args_provider`` to
``megatron.training.arguments.parse_and_validate_args``. The integration extends
:data:`MOE_BALANCERS` and the ``moe balancer`` group; :func:`validate_ultraep_args` checks
the combination once Megatron has validated its own arguments.
"""

from __future__ import annotations

import argparse

#: Expert-load balancers ``--moe-balancer`` accepts. ``none``: Megatron's MoE layer unchanged.
MOE_BALANCERS: tuple[str, ...] = ("none", "ultraep", "eplb", "eplb-exact")


def _add_moe_balancer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title='moe balancer')
    group.add_argument('--moe-balancer', type=str, default='none', choices=list(MOE_BALANCERS),
                       help='Expert-load balancer for the MoE layers. "none" runs '
                       'megatron-core\'s MoELayer unchanged. "ultraep" replicates hot experts '
                       'into redundant slots and reroutes tokens on the exact load of every '
                       'microbatch and layer. "eplb-exact" applies DeepSeek EPLB\'s replication '
                       'rule to the exact load; "eplb" to the load history (see '
                       '--moe-balancer-eplb-window/-interval). Training is mathematically unchanged.')
    group.add_argument('--moe-balancer-num-slots', type=int, default=2,
                       help='Redundant expert slots per expert-parallel rank. Their weight and '
                       'fp32 gradient buffers are shared by all MoE layers.')
    group.add_argument('--moe-balancer-min-quota', type=int, default=None,
                       help='Smallest number of (token, expert) pairs a replica may carry. '
                       'Default: 1%% of the mean per-rank load of the microbatch.')
    group.add_argument('--moe-balancer-eplb-window', type=int, default=16,
                       help='eplb: microbatches of load history the placement is computed from.')
    group.add_argument('--moe-balancer-eplb-interval', type=int, default=16,
                       help='eplb: re-plan the replica placement every this many microbatches.')
    group.add_argument('--moe-balancer-ring-size', type=int, default=None,
                       help='Capacity of the virtual-layer ring (in-flight MoE invocations per '
                       'rank). Default: MoE layers on the rank x the pipeline schedule\'s '
                       'in-flight microbatches.')
    group.add_argument('--moe-balancer-trace-dir', type=str, default=None,
                       help='Record the exact expert load [EP ranks, experts] of every '
                       'iteration, microbatch and MoE layer to one trace file per EP group in '
                       'this directory (see docs/traces.md; replay with tools/replay_trace.py).')
    group.add_argument('--moe-balancer-check-plans', action='store_true',
                       help='Check in every MoE layer that the routing matches the load its plan was '
                       'solved for (also in activation-recompute replays). Reads device memory on '
                       'the host in every layer: for debugging only.')
    group.add_argument('--moe-balancer-no-overlap', action='store_false',
                       dest='moe_balancer_overlap',
                       help='Wait for each replica weight/gradient transfer where it is issued instead '
                       'of overlapping it with the layer\'s other work (to measure what overlap hides).')
    return parser


def _add_telemetry_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title='ultraep telemetry')
    group.add_argument('--metrics-jsonl', type=str, default=None,
                       help='Append one JSON record per training iteration (lm loss, grad '
                       'norm, per-layer expert-load imbalance) to this file, from the last '
                       'rank. For tests and benchmarks; the console/wandb logs are unchanged.')
    group.add_argument('--no-moe-load-telemetry', action='store_false',
                       dest='moe_load_telemetry',
                       help='Do not compute the per-layer expert-load imbalance '
                       '(one small reduction per iteration).')
    return parser


def add_ultraep_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: adds UltraEP's argument groups to ``parser``."""
    parser = _add_moe_balancer_args(parser)
    parser = _add_telemetry_args(parser)
    return parser


def balancer_config_from_args(args: argparse.Namespace):
    """The ``BalancerConfig`` selected by ``--moe-balancer*``; ``None`` for ``none``."""
    if args.moe_balancer == 'none':
        return None
    from ultraep_megatron.megatron.runtime import BalancerConfig

    return BalancerConfig(
        name=args.moe_balancer,
        num_slots=args.moe_balancer_num_slots,
        min_quota=args.moe_balancer_min_quota,
        eplb_window=args.moe_balancer_eplb_window,
        eplb_interval=args.moe_balancer_eplb_interval,
        ring_size=args.moe_balancer_ring_size,
        trace_dir=args.moe_balancer_trace_dir,
    )


def balancing_context_from_args(args: argparse.Namespace):
    """The model's ``BalancingContext`` for ``--moe-balancer*``; ``None`` for ``none``."""
    config = balancer_config_from_args(args)
    if config is None:
        return None
    from ultraep_megatron.megatron.context import BalancingContext

    return BalancingContext(config, overlap=args.moe_balancer_overlap,
                            check_plans=args.moe_balancer_check_plans)


def validate_ultraep_args(args: argparse.Namespace) -> None:
    """Check UltraEP's arguments against Megatron's (after Megatron's own validation).

    Raises:
        ValueError: on a combination that cannot run.
    """
    if args.moe_balancer not in MOE_BALANCERS:
        raise ValueError(f"--moe-balancer must be one of {MOE_BALANCERS}, got {args.moe_balancer!r}")
    if args.moe_balancer == 'none':
        if getattr(args, 'moe_balancer_trace_dir', None):
            raise ValueError("--moe-balancer-trace-dir records the load the balanced dispatcher "
                             "gathers: use it with --moe-balancer ultraep, eplb or eplb-exact "
                             "(balancing never changes the routing it records)")
        return
    name = f"--moe-balancer {args.moe_balancer}"

    def fail(message: str) -> None:
        raise ValueError(f"{name}: {message}")

    if args.num_experts is None:
        fail("needs an MoE model (--num-experts)")
    if args.moe_balancer_num_slots < 0:
        fail(f"--moe-balancer-num-slots must be >= 0, got {args.moe_balancer_num_slots}")
    if args.moe_balancer_min_quota is not None and args.moe_balancer_min_quota < 1:
        fail(f"--moe-balancer-min-quota must be >= 1, got {args.moe_balancer_min_quota}")
    if args.moe_balancer_eplb_window < 1 or args.moe_balancer_eplb_interval < 1:
        fail("--moe-balancer-eplb-window and --moe-balancer-eplb-interval must be >= 1")
    if args.moe_balancer_ring_size is not None and args.moe_balancer_ring_size < 1:
        fail(f"--moe-balancer-ring-size must be >= 1, got {args.moe_balancer_ring_size}")
    ep = args.expert_model_parallel_size
    if args.num_experts % ep:
        fail(f"--num-experts {args.num_experts} is not divisible by "
             f"--expert-model-parallel-size {ep}")
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
    if (get('expert_tensor_parallel_size') or 1) > 1:
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
    if get('moe_latent_size'):
        problems.append("--moe-latent-size is not supported")
    cuda_graph = get('cuda_graph_impl') or 'none'
    if cuda_graph != 'none':
        problems.append(f"--cuda-graph-impl {cuda_graph} is not supported")
    return problems
