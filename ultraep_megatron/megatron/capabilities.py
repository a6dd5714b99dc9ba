"""What a balanced MoE layer cannot run: the Megatron settings it refuses, each named by its flag.

One place for the checks, used twice: at startup on Megatron's parsed arguments
(``arguments.validate_ultraep_args``, so ``pretrain_gpt.py`` and ``ultraep check-recipe`` stop before
anything is built) and again in ``BalancedMoELayer``'s constructor on the model's
``TransformerConfig`` (a model built some other way). The attribute names of the two are the same.

Imports neither the layer nor its context, and Megatron only inside :func:`flex_backend_problem`.
"""

from __future__ import annotations

from typing import Optional


def moe_model_problems(args, domain_size: Optional[int]) -> list[str]:
    """Why Megatron's parsed ``args`` give no MoE model a balancer can run (before the settings of
    :func:`unsupported_moe_settings`): no experts, E experts not divisible by the R EP ranks, or
    an NVLink domain of ``domain_size`` EP ranks (``--moe-balancer-domain-size``) that does not
    divide R."""
    if args.num_experts is None:
        return ["needs an MoE model (--num-experts)"]
    problems = []
    ep = args.expert_model_parallel_size
    if args.num_experts % ep:
        problems.append(f"--num-experts {args.num_experts} is not divisible by "
                        f"--expert-model-parallel-size {ep}")
    if domain_size is not None and ep % domain_size:
        problems.append(f"--moe-balancer-domain-size {domain_size} must divide --expert-model-parallel-size "
                        f"{ep} (it counts the EP ranks of one NVLink domain)")
    return problems


def unsupported_moe_settings(config) -> list[str]:
    """What a balanced MoE layer cannot run, named by flag. ``config``: Megatron's args or a
    TransformerConfig (the attribute names are the same)."""
    problems = []
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    dispatcher = get('moe_token_dispatcher_type')
    if dispatcher == 'flex':
        # GPU-only (DeepEP / HybridEP); the check is whether megatron's bindings import.
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
    # (Local stand-in for the startup check of issue #35, owned by another change: fp8 with current
    # scaling and expert offloading accepted, what the replica path does not handle refused.)
    if get('fp4'):
        problems.append("--fp4-format is not supported")
    if get('fp8') and get('fp8_recipe') not in ('tensorwise', 'blockwise', 'mxfp8'):
        problems.append(f"--fp8-recipe {get('fp8_recipe')} is not supported; use tensorwise, blockwise or mxfp8")
    if get('fp8') and (get('fp8_param_gather') or get('fp8_param')):
        problems.append("--fp8-param-gather is not supported")
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


def flex_backend_problem(config) -> Optional[str]:
    """Why megatron's flex dispatcher cannot run with ``config`` here (``None`` if it can).

    The check is megatron's own: its DeepEP / HybridEP bindings are importable (they need CUDA).
    """
    from megatron.core.transformer.moe import token_dispatcher as token_dispatcher_module

    backend = getattr(config, "moe_flex_dispatcher_backend", None)
    if backend == "deepep":
        available = getattr(token_dispatcher_module, "fused_dispatch", None) is not None
        package = "DeepEP (deep_ep)"
    elif backend == "hybridep":
        available = getattr(token_dispatcher_module, "hybrid_ep_dispatch", None) is not None
        package = "HybridEP (deep_ep's hybrid_ep)"
    else:
        return (f"--moe-flex-dispatcher-backend {backend} is not supported with a balancer; "
                "use deepep or hybridep")
    if not available:
        return (f"--moe-token-dispatcher-type flex with --moe-flex-dispatcher-backend {backend} "
                f"needs {package}, which is not installed (it needs CUDA); use "
                "--moe-token-dispatcher-type alltoall")
    return None


def nothing_to_balance(args) -> Optional[str]:
    """The warning for a balancer at ``--expert-model-parallel-size 1`` (``None`` otherwise)."""
    if args.expert_model_parallel_size != 1:
        return None
    return (f"--moe-balancer {args.moe_balancer} with --expert-model-parallel-size 1: "
            "one EP rank holds every expert, there is nothing to balance (the "
            "balancer still plans every layer and allocates its slots)")
