"""What a balanced MoE layer cannot run: the Megatron settings it refuses, each named by its flag.

One place for the checks, used twice: at startup on Megatron's parsed arguments
(``arguments.validate_ultraep_args``, so ``pretrain_gpt.py`` and ``ultraep check-recipe`` stop before
anything is built) and again in ``BalancedMoELayer``'s constructor on the model's
``TransformerConfig`` (a model built some other way). The attribute names of the two are the same.

Two kinds of problem: a configuration's (a setting the balanced layer cannot run, anywhere) and an
environment's (what this machine lacks to run a supported setting: :func:`missing_packages`).
``ultraep check-recipe`` judges a recipe for the cluster it targets, so it refuses only the first
and notes the second; ``pretrain_gpt.py``, on the machine that runs it, refuses both.

Imports neither the layer nor its context, and Megatron only inside :func:`flex_backend_problem`.
"""

from __future__ import annotations

from typing import Optional

from ultraep_megatron.megatron.release import compat
from ultraep_megatron.planner.baselines import registry


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
        problems.append(
            f"--num-experts {args.num_experts} is not divisible by "
            f"--expert-model-parallel-size {ep}"
        )
    if domain_size is not None and ep % domain_size:
        problems.append(
            f"--moe-balancer-domain-size {domain_size} must divide --expert-model-parallel-size "
            f"{ep} (it counts the EP ranks of one NVLink domain)"
        )
    return problems


def unsupported_moe_settings(
    config, environment: bool = True, planner: Optional[str] = None
) -> list[str]:
    """What a balanced MoE layer cannot run, named by flag. ``config``: Megatron's args or a
    TransformerConfig (the attribute names are the same). ``environment``: also what this machine
    lacks (:func:`missing_packages`); ``False`` judges the configuration alone, for the
    machines it targets (``ultraep check-recipe``). ``planner``: where the layer plans (the
    balancing context's, resolved); ``None``: as ``--moe-balancer-planner`` gives it, which must then
    say ``device`` where a setting needs the device planner. First, what the installed megatron-core
    release cannot run (``compat.release_problems``)."""
    problems = compat.release_problems(config)
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    planner = (
        planner
        or get('moe_balancer_planner')
        or default_planner(get('moe_balancer'), preprocess_graphed(config))
    )
    dispatcher = get('moe_token_dispatcher_type')
    if dispatcher == 'flex':
        # GPU-only (DeepEP / HybridEP); the check is whether megatron's bindings import.
        problem = (
            flex_backend_problem(config) if environment else _flex_backend_name_problem(config)
        )
        if problem:
            problems.append(problem)
    elif dispatcher != 'alltoall':
        problems.append(
            f"--moe-token-dispatcher-type {dispatcher} is not supported: the balanced "
            "dispatchers are megatron's all-to-all and flex ones over physical slots; use "
            "alltoall (or flex with DeepEP/HybridEP on GPUs)"
        )
    if get('moe_expert_capacity_factor') is not None or get('moe_pad_expert_input_to_capacity'):
        problems.append(
            "token dropping (--moe-expert-capacity-factor / "
            "--moe-pad-expert-input-to-capacity) is not supported: balancing "
            "needs dropless routing"
        )
    # Megatron's default expert-TP size is the TP size (set by its validation).
    if (get('expert_tensor_parallel_size') or get('tensor_model_parallel_size') or 1) > 1:
        problems.append(
            "--expert-tensor-parallel-size > 1 is not supported: a replica is a whole expert "
            "copied between EP ranks, and expert TP shards every expert over other ranks"
        )
    if get('use_transformer_engine_op_fuser'):
        problems.append(
            "--use-transformer-engine-op-fuser is not supported (its fused grouped MLP "
            "has no per-expert weights to replicate)"
        )
    if get('moe_router_padding_for_quantization'):
        problems.append(
            "--moe-router-padding-for-quantization is not supported: it adds padding rows to "
            "the routing that the plan's exact per-slot row counts do not hold"
        )
    if get('overlap_dispatch_backward_with_experts_wgrad'):
        # megatron's overlapped 1F1B schedule (--overlap-moe-expert-parallel-comm) and its delayed
        # weight gradients (--delay-wgrad-compute) run: the balanced layer's plan, transfers and
        # replica-gradient reduction sit in that schedule's nodes (docs/integration.md).
        problems.append(
            "--overlap-dispatch-backward-with-experts-wgrad is not supported: it computes the "
            "experts' delayed weight gradients inside the dispatch's backward, where the "
            "replicas' would have to be computed and reduced too, which has not been checked; use "
            "--overlap-moe-expert-parallel-comm with --delay-wgrad-compute"
        )
    problems += _low_precision_problems(get)
    for flag in ('use_megatron_fsdp', 'use_torch_fsdp2'):
        if get(flag):
            # FSDP shards every expert across the expert-data-parallel ranks and gathers it only in
            # the expert's own forward and backward; the replica transfers read whole main-expert
            # weights before the experts' forward and in the layer's backward before the experts',
            # and reduce replica gradients into the DDP main_grad buffers FSDP does not have.
            problems.append(
                f"--{flag.replace('_', '-')} is not supported: the replica transfers read and "
                "write whole main-expert weights and gradients outside the experts' FSDP hooks; "
                "use --use-distributed-optimizer"
            )
    if get('fine_grained_activation_offloading'):
        # Megatron offloads only CUDA tensors, so on the CPU backend its offloading path leaves every
        # activation in place: no test here runs it with a balanced layer.
        problems.append(
            "--fine-grained-activation-offloading is not supported with a balancer: megatron's "
            "offloading of the experts' activations has not run with a balanced layer (it "
            "offloads CUDA tensors only, so no CPU test exercises it); leave it out"
        )
    if get('moe_expert_rank_capacity_factor') is not None:
        problems.append(
            "--moe-expert-rank-capacity-factor is not supported: HybridEP drops the tokens over a "
            "rank's budget, and balancing needs dropless routing (the plan gives HybridEP each "
            "rank's exact row count instead)"
        )
    problem = _cuda_graph_problem(get, planner)
    if problem:
        problems.append(problem)
    elif get('overlap_moe_expert_parallel_comm') and (get('cuda_graph_impl') or 'none') != 'none':
        problems.append(
            f"--overlap-moe-expert-parallel-comm with --cuda-graph-impl {get('cuda_graph_impl')} is not "
            "supported with a balancer: megatron's graph replay then runs the MoE layer's routing and "
            "preprocessing from inside the replayed layer, which has not been checked with the balanced "
            "layer; leave out one of them"
        )
    return problems


#: fp8 recipes with current scaling: a weight's quantization is a pure function of that weight, so a
#: replica that quantizes its main expert's weight at every call computes with exactly its fp8 weight.
FP8_RECIPES = ("tensorwise", "blockwise", "mxfp8")
_FP8_REFUSED = {
    "delayed": "delayed scaling keeps an amax history per module: the one replica module all layers share "
    "would mix every layer's history and register amaxes only on ranks whose slots got rows, so "
    "the amax reduction could hang or misalign",
    "custom": "a custom recipe's quantizers are not known to be pure functions of the weight, which a "
    "replica quantizing its main expert's weight at every call relies on",
}
#: CUDA-graph modules (megatron's ``--cuda-graph-modules``) whose graphs end before a balanced MoE
#: layer's own part (its plan, then transfers sized by the plan) begins.
CUDA_GRAPH_MODULES = ("attn", "moe_router", "mlp", "mamba")
#: The module whose Transformer Engine graph captures the balanced layer's preprocessing (load
#: gather, plan, reroute, permutation): with the device planner only, whose plan needs no host read;
#: the plan's record crosses after the graph, where megatron's dispatcher waits for its splits.
DEVICE_PLANNER_GRAPH_MODULE = "moe_preprocess"
_CUDA_GRAPH_REFUSED = {
    "moe": "it captures the whole MoE layer",
    "full_iteration": "it captures the whole iteration",
    "full_iteration_inference": "it captures whole inference iterations",
}
_CUDA_GRAPH_WHY = (
    "a graph cannot capture the balanced layer's transfers, whose sizes the plan sets; capture "
    "only " + ", ".join(CUDA_GRAPH_MODULES) + f", and {DEVICE_PLANNER_GRAPH_MODULE} with "
    "--cuda-graph-impl transformer_engine and --moe-balancer-planner device"
)
_PREPROCESS_GRAPH_WHY = {
    "planner": "the host planner copies the exact load to the host and plans there, inside the captured "
    "preprocessing, which a CUDA graph cannot capture (a host read of device data); leave "
    "--moe-balancer-planner out or pass device, whose plan, reroute and permutation stay on the "
    "device and whose record crosses after the graph",
    "flex": "the flex dispatcher's (DeepEP / HybridEP) preprocessing has not been checked under capture yet; "
    "use --moe-token-dispatcher-type alltoall, or leave moe_preprocess out",
    "fusion": "the fused permutation (Transformer Engine's kernel over the physical routing map) has not been "
    "checked under capture yet; leave --moe-permute-fusion off, or leave moe_preprocess out",
}


def _name(value) -> str:
    """An enum's name or a string setting as written (megatron gives either, args or config)."""
    return getattr(value, "name", value) if not isinstance(value, str) else value


def _low_precision_problems(get) -> list[str]:
    """fp8 with current scaling runs (the replica experts re-quantize their weights at every call);
    delayed and custom fp8 recipes and every fp4 recipe are refused."""
    problems = []
    working = "use --fp8-recipe " + ", ".join(FP8_RECIPES[:-1]) + " or " + FP8_RECIPES[-1]
    if get('fp8'):
        recipe = _name(getattr(get('fp8_recipe'), "value", get('fp8_recipe')))
        if recipe not in FP8_RECIPES:
            why = _FP8_REFUSED.get(recipe, "only current-scaling recipes are supported")
            # Megatron's default recipe is delayed: say so when the user gave only --fp8-format.
            problems.append(
                f"--fp8-recipe {recipe} (with --fp8-format {get('fp8')}) is not supported: "
                f"{why}; {working}"
            )
    problems += _mxfp8_parameter_problems(get)
    if get('fp8') and get('fp8_param_gather') and get('first_last_layers_bf16'):
        problems.append(
            "--first-last-layers-bf16 with --fp8-param-gather is not supported: the bf16 layers' "
            "experts hold plain weights and the others quantized ones, and the replica slots all "
            "MoE layers share have one layout; leave the first and last layers in fp8"
        )
    if get('fp4'):
        recipe = _name(getattr(get('fp4_recipe'), "value", get('fp4_recipe')))
        problems.append(
            f"--fp4-format {get('fp4')} (--fp4-recipe {recipe}) is not supported: the replica "
            "experts' fp4 path (re-quantization, scales, the replica weight transfer) has not "
            f"been checked yet; use --fp8-format with {working[4:]}"
        )
    return problems


#: megatron's flag for gathering MXFP8 parameters through the gradient buffer.
REUSE_GRAD_BUF_FLAG = "--reuse-grad-buf-for-mxfp8-param-ag"
_ABSENT = object()


def _mxfp8_parameter_problems(get) -> list[str]:
    """MXFP8 parameters (``--fp8-recipe mxfp8 --fp8-param-gather``) need megatron's
    ``--reuse-grad-buf-for-mxfp8-param-ag``, and the flag needs them.

    Without the flag, megatron's DDP maps each quantized parameter into its parameter buffer with
    Transformer Engine's ``replace_raw_data``, which refuses MXFP8 tensors: the run fails building
    its buffers. With it, an MXFP8 parameter keeps its own storage; the distributed optimizer
    stages the bf16 main parameters in the gradient buffer, megatron all-gathers them there and
    quantizes them into the parameters when a module's forward pre-hook completes the gather, then
    zeroes that part of the buffer for the gradients. The balanced layer copies replicas from the
    parameters after running those hooks (``BalancedMoELayer._prepare_main_params``), so after the
    quantization, and never reads the shared buffer. With another recipe's fp8 parameters the flag
    would stage the main parameters in their uint8 buffer. Only Megatron's arguments carry the flag
    (a layer's ``TransformerConfig`` does not): the layer's own check skips this."""
    if get('reuse_grad_buf_for_mxfp8_param_ag', _ABSENT) is _ABSENT:
        return []
    recipe = _name(getattr(get('fp8_recipe'), "value", get('fp8_recipe')))
    mxfp8_params = bool(get('fp8')) and recipe == "mxfp8" and bool(get('fp8_param_gather'))
    reuse = bool(get('reuse_grad_buf_for_mxfp8_param_ag'))
    if mxfp8_params and not reuse:
        return [
            f"--fp8-recipe mxfp8 with --fp8-param-gather needs {REUSE_GRAD_BUF_FLAG}: without it megatron "
            "maps each MXFP8 parameter into its parameter buffer with Transformer Engine's replace_raw_data, "
            f"which does not support MXFP8 (the run fails building its buffers); add {REUSE_GRAD_BUF_FLAG}, "
            "as NVIDIA recommends for MXFP8"
        ]
    if reuse and not mxfp8_params:
        return [
            f"{REUSE_GRAD_BUF_FLAG} is only for MXFP8 parameters (--fp8-format with --fp8-recipe mxfp8 "
            "--fp8-param-gather): with other parameters megatron would stage the main parameters in a "
            f"buffer of another type, or refuse it; leave {REUSE_GRAD_BUF_FLAG} off"
        ]
    return []


def preprocess_graphed(config) -> bool:
    """Whether Transformer Engine's per-layer graphs capture the MoE preprocessing
    (``--cuda-graph-impl transformer_engine --cuda-graph-modules ... moe_preprocess``)."""
    modules = getattr(config, "cuda_graph_modules", None) or []
    modules = modules.split(",") if isinstance(modules, str) else modules
    return getattr(
        config, "cuda_graph_impl", None
    ) == "transformer_engine" and DEVICE_PLANNER_GRAPH_MODULE in [_name(m) for m in modules]


def default_planner(balancer: Optional[str], graphed: bool) -> str:
    """``--moe-balancer-planner`` left out: ``host`` (eagerly the faster: one compiled solve against
    the device planner's hundreds of small kernels, docs/integration.md "On a GPU"), or ``device``
    for ultraep where the preprocessing is captured in a CUDA graph, which needs a plan without a
    host read and replays its kernels in one launch."""
    return "device" if graphed and balancer in (None, registry.ULTRAEP) else "host"


def _cuda_graph_problem(get, planner: Optional[str]) -> Optional[str]:
    """Per-layer CUDA graphs of modules that end before the balanced part run, and Transformer
    Engine's graph of the preprocessing with the device planner; a graph that would capture the
    balanced part (``moe``, a whole layer, the whole iteration) is refused, named as given
    (``--cuda-graph-impl``, or Megatron's older ``--enable-cuda-graph`` / ``--external-cuda-graph``
    and ``--cuda-graph-scope``)."""
    impl, flag = get('cuda_graph_impl') or 'none', None
    if impl == 'none' and get('enable_cuda_graph'):
        impl, flag = 'local', '--enable-cuda-graph'
    elif impl == 'none' and get('external_cuda_graph'):
        impl, flag = 'transformer_engine', '--external-cuda-graph'
    flag = flag or f"--cuda-graph-impl {impl}"
    modules = (
        get('cuda_graph_modules')
        or get('cuda_graph_scope_deprecated')
        or get('cuda_graph_scope')
        or []
    )
    if isinstance(modules, str):  # a TransformerConfig built by hand: "full" or comma-separated
        modules = modules.split(',') if modules else []
    elif not isinstance(modules, (list, tuple)):
        modules = [modules]
    names = [_name(m) for m in modules]
    if 'full_iteration' in names and impl in ('none', 'local'):  # megatron migrates this spelling
        impl, flag = 'full_iteration', '--cuda-graph-modules full_iteration'
    if impl == 'none':
        return None
    if impl == 'full_iteration':
        return (
            f"{flag} is not supported with a balancer: {_CUDA_GRAPH_REFUSED['full_iteration']}; "
            f"{_CUDA_GRAPH_WHY}"
        )
    accepted = CUDA_GRAPH_MODULES + (DEVICE_PLANNER_GRAPH_MODULE, 'full')
    refused = [n for n in names if n not in accepted]
    if refused:
        name = refused[0]
        why = _CUDA_GRAPH_REFUSED.get(
            name, "it is not known to end before the balanced layer's part"
        )
        return (
            f"--cuda-graph-modules {' '.join(refused)} (with {flag}) is not supported with a balancer: "
            f"{why}; {_CUDA_GRAPH_WHY}"
        )
    if not [n for n in names if n != 'full']:
        return (
            f"{flag} without --cuda-graph-modules (whole-layer capture) is not supported with a "
            f"balancer: it captures every MoE layer whole; {_CUDA_GRAPH_WHY}"
        )
    if impl == 'local' and not ('moe_router' in names or DEVICE_PLANNER_GRAPH_MODULE in names):
        # megatron's local graphs (its CudaGraphManager over torch.cuda.CUDAGraph) have no stand-in
        # here, so no test runs them with a balanced layer; Transformer Engine's do.
        return (
            f"{flag} (--cuda-graph-modules {' '.join(names)}) is not supported with a balancer: megatron's "
            "local CUDA graphs have not run with a balanced layer; use --cuda-graph-impl transformer_engine "
            "(its graphs of attn, moe_router and moe_preprocess run with one: tests/megatron/test_graph_capture.py)"
        )
    if impl == 'local' and ('moe_router' in names or DEVICE_PLANNER_GRAPH_MODULE in names):
        # megatron's local partial capture graphs _forward_mlp_router, which runs the MoE layer's
        # route *and* preprocess through its own graph runner (it adds moe_preprocess to
        # moe_router); Transformer Engine's capture ends where megatron's early-return signal says.
        graphed = ' '.join(n for n in names if n in ('moe_router', DEVICE_PLANNER_GRAPH_MODULE))
        return (
            f"--cuda-graph-modules {graphed} with {flag} is not supported with a balancer: megatron's "
            "local graph of the router also captures the MoE preprocessing, through megatron's own "
            "graph runner, which has not been checked with the balanced layer; use --cuda-graph-impl "
            "transformer_engine"
        )
    if DEVICE_PLANNER_GRAPH_MODULE in names:
        if planner != "device":
            why = _PREPROCESS_GRAPH_WHY["planner"]
        elif get('moe_token_dispatcher_type') == 'flex':
            why = _PREPROCESS_GRAPH_WHY["flex"]
        elif get('moe_permute_fusion'):
            why = _PREPROCESS_GRAPH_WHY["fusion"]
        else:
            return None
        planner_flag = (
            f"--moe-balancer-planner {planner}" if planner else "no --moe-balancer-planner"
        )
        return (
            f"--cuda-graph-modules {DEVICE_PLANNER_GRAPH_MODULE} (with {flag}, {planner_flag}) is not "
            f"supported with a balancer: {why}"
        )
    return None


#: --moe-flex-dispatcher-backend -> (megatron's name bound when the package imports, the package).
FLEX_BACKENDS = {
    "deepep": ("fused_dispatch", "DeepEP (deep_ep)"),
    "hybridep": ("hybrid_ep_dispatch", "HybridEP (deep_ep's hybrid_ep)"),
}


def _flex_backend_name_problem(config) -> Optional[str]:
    """A configuration problem: a flex backend the balanced dispatcher does not know."""
    backend = getattr(config, "moe_flex_dispatcher_backend", None)
    if backend in FLEX_BACKENDS:
        return None
    return (
        f"--moe-flex-dispatcher-backend {backend} is not supported with a balancer; "
        "use deepep or hybridep"
    )


def missing_flex_backend(config) -> Optional[str]:
    """An environment problem: the package of ``config``'s flex dispatcher backend
    (``--moe-flex-dispatcher-backend``) when this machine cannot import it; ``None`` if it can, or
    for a backend not in :data:`FLEX_BACKENDS`. The check is megatron's own: its DeepEP / HybridEP
    bindings are importable (they need CUDA)."""
    backend = getattr(config, "moe_flex_dispatcher_backend", None)
    if backend not in FLEX_BACKENDS:
        return None
    from megatron.core.transformer.moe import token_dispatcher as token_dispatcher_module

    bound, package = FLEX_BACKENDS[backend]
    return None if getattr(token_dispatcher_module, bound, None) is not None else package


def missing_packages(config) -> list[tuple[str, str]]:
    """The environment problems of ``config``: (package, the flags that need it) for each package
    its settings need that this machine cannot import (the flex dispatcher's backend)."""
    if getattr(config, "moe_token_dispatcher_type", None) != "flex":
        return []
    package = missing_flex_backend(config)
    backend = getattr(config, "moe_flex_dispatcher_backend", None)
    return (
        [(package, f"--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend {backend}")]
        if package
        else []
    )


def flex_backend_problem(config) -> Optional[str]:
    """Why megatron's flex dispatcher cannot run with ``config`` here (``None`` if it can): a
    backend it does not know, or one this machine cannot import (:func:`missing_flex_backend`)."""
    problem = _flex_backend_name_problem(config)
    if problem:
        return problem
    package = missing_flex_backend(config)
    if package:
        return (
            f"--moe-token-dispatcher-type flex with --moe-flex-dispatcher-backend "
            f"{config.moe_flex_dispatcher_backend} needs {package}, which is not installed (it "
            "needs CUDA); use --moe-token-dispatcher-type alltoall"
        )
    return None


def nothing_to_balance(args) -> Optional[str]:
    """The warning for a balancer at ``--expert-model-parallel-size 1`` (``None`` otherwise)."""
    if args.expert_model_parallel_size != 1:
        return None
    return (
        f"--moe-balancer {args.moe_balancer} with --expert-model-parallel-size 1: "
        "one EP rank holds every expert, there is nothing to balance (the "
        "balancer still plans every layer and allocates its slots)"
    )
