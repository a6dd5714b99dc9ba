"""Worker: Transformer Engine's partial CUDA graphs of a transformer layer whose MLP is a balanced
MoE layer, captured and replayed through megatron-core's own machinery on N gloo CPU ranks.

Each scenario builds one megatron ``TransformerLayer`` (local spec: megatron's attention and
layernorms, an MoE MLP with a shared expert; bf16, as TE graphs run) with ``--cuda-graph-impl
transformer_engine`` and its ``--cuda-graph-modules``, loads the same weights, runs one eager
training step (megatron's ``cuda_graph_warmup_steps`` before capture), then megatron's
``TECudaGraphHelper.create_cudagraphs()`` captures it, over ``te_graph_standin`` in TE's
``make_graphed_callables`` place (every capture under its capturability guard). Then
``ITERATIONS`` training steps replay the graphs: the layer is called as ``TransformerBlock`` calls
it, so ``GraphableMegatronModule.__call__`` takes megatron's replay path
(``TransformerLayer._te_cuda_graph_replay``: the tensor store, the dispatcher's
``cudagraph_attrs``), each step's tokens pushed towards other experts, so every replay routes
differently (a plan left over from an earlier step would misroute).

Scenarios (``<out-dir>/rank<r>.pt`` holds each one's outputs, input and parameter gradients per
step, and what ran):

* ``none``: megatron's MoELayer with graphs of ``attn moe_router``, the reference;
* ``none_permuted`` / ``none_split``: the same fed each step's sequences in the other batch order,
  and fed them one sequence per microbatch (graphs captured for a micro-batch of 1, gradients
  accumulated over the two): the same mathematics summed in other orders and groupings, the noise
  floor (in bf16 an expert's gradient summed in two parts rounds each part: the split's floor is
  the one a replicated expert's gradient, main part plus replica part, is measured against);
* ``router``: ultraep (host planner) with graphs of ``attn moe_router``;
* ``router_hybridep``: the same with megatron's flex dispatcher over HybridEP (``deepep_gloo``'s
  stand-in), the GB200 recipes' default dispatcher with their default graphs;
* ``preprocess``: ultraep, device planner, graphs of ``attn moe_router moe_preprocess``: the load
  gather, device plan, reroute and permutation replay in the graph, the plan's record crosses
  after it;
* ``stale_plan`` (negative control): ``preprocess`` with every step completing the first step's
  plan (its record), as a layer would that kept host state from an earlier forward;
* ``host_planner_preprocess`` (negative control): ``preprocess`` with the planner switched to the
  host after the layer was built (the startup check refuses the combination): its capture must
  fail the capturability guard;
* under fp8 (``--fp8-format hybrid --fp8-recipe tensorwise``; the experts megatron's
  ``TEGroupedMLP`` over ``torch_grouped_linear``, whose GEMMs are ``te_grouped_fp8``'s stand-in of
  TE's fp8 grouped GEMM, megatron padding each expert's rows with ``toy_fp8``'s ``Fp8Padding``; the
  rest of the layer in bf16, as megatron's local linears are without TE): ``router_fp8`` (ultraep,
  host planner, graphs of ``attn moe_router``) and its reference ``router_fp8_eager`` (the same
  layer without graphs), ``none_fp8`` / ``none_fp8_eager`` (megatron's MoELayer, graphed and not:
  the floor of graphing itself), and ``stale_plan_fp8`` (negative control: ``router_fp8`` with
  every step planned on the first step's load); ``preprocess_fp8`` (device planner, graphs of
  ``attn moe_router moe_preprocess``) against ``preprocess_fp8_eager``, its floor megatron's layer
  under the same graphs (``none_fp8_preprocess``) against ``none_fp8_eager``, and
  ``stale_preprocess_fp8`` (negative control: ``stale_plan`` under fp8). megatron's
  ``TECudaGraphHelper`` hands the graph stand-in its fp8 arguments (``fp8_enabled``, the recipe object from ``get_fp8_recipe``,
  ``fp8_weight_caching``, the amax group); each step runs the layer in the fp8 autocast
  ``TransformerBlock`` runs it in (``layer_fp8_context``) and resets ``is_first_microbatch`` as
  megatron's schedule does.

Run:  torchrun --standalone --nproc-per-node 4 graph_capture_layer.py --out-dir DIR
"""

import argparse
import contextlib
import os
import sys
import time
import traceback
from typing import Optional

import torch

from ultraep_megatron.megatron.cpu import backend as cpu_backend

NUM_EXPERTS = 8
HIDDEN = 32
FFN = 48
SHARED_FFN = 32
TOPK = 2
SEQ, BATCH = 16, 2
ITERATIONS = 3
#: Per training step, the experts its tokens are pushed towards (EP=4: experts 2r and 2r + 1 live
#: on rank r): a different straggler, hence a different plan, at every replay.
HOT = ((0, 1), (2, 3), (4, 5))
ROUTER = "attn moe_router"
PREPROCESS = "attn moe_router moe_preprocess"
SCENARIOS = {
    "none": dict(balancer=None, modules=ROUTER),
    "none_permuted": dict(balancer=None, modules=ROUTER, permute=True),
    "none_split": dict(balancer=None, modules=ROUTER, split=True),
    "router": dict(balancer="ultraep", planner="host", modules=ROUTER),
    "router_hybridep": dict(balancer="ultraep", planner="host", modules=ROUTER, dispatcher="flex"),
    "preprocess": dict(balancer="ultraep", planner="device", modules=PREPROCESS),
    "stale_plan": dict(
        balancer="ultraep", planner="device", modules=PREPROCESS, fault="stale_plan"
    ),
    "host_planner_preprocess": dict(
        balancer="ultraep", planner="device", modules=PREPROCESS, fault="host_planner"
    ),
    # fp8 (--fp8-format hybrid --fp8-recipe tensorwise), grouped experts over te_grouped_fp8's
    # stand-in of TE's fp8 grouped GEMM; each graphed layer against itself run eagerly.
    "none_fp8": dict(balancer=None, modules=ROUTER, fp8="tensorwise"),
    "none_fp8_eager": dict(balancer=None, modules=ROUTER, fp8="tensorwise", eager=True),
    "router_fp8": dict(balancer="ultraep", planner="host", modules=ROUTER, fp8="tensorwise"),
    "router_fp8_eager": dict(
        balancer="ultraep", planner="host", modules=ROUTER, fp8="tensorwise", eager=True
    ),
    "stale_plan_fp8": dict(
        balancer="ultraep",
        planner="host",
        modules=ROUTER,
        fp8="tensorwise",
        fault="stale_host_plan",
    ),
    "none_fp8_preprocess": dict(balancer=None, modules=PREPROCESS, fp8="tensorwise"),
    "preprocess_fp8": dict(
        balancer="ultraep", planner="device", modules=PREPROCESS, fp8="tensorwise"
    ),
    "preprocess_fp8_eager": dict(
        balancer="ultraep", planner="device", modules=PREPROCESS, fp8="tensorwise", eager=True
    ),
    "stale_preprocess_fp8": dict(
        balancer="ultraep",
        planner="device",
        modules=PREPROCESS,
        fp8="tensorwise",
        fault="stale_plan",
    ),
}


class GraphChunk(torch.nn.Module):
    """A model chunk as megatron's training loop hands ``TECudaGraphHelper`` one: its ``decoder``
    holds the layers, and (as megatron's DDP wrapper does) it zeroes its gradient buffers."""

    position_embedding_type = "learned_absolute"  # no rotary embedding among the sample inputs

    def __init__(self, layer):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([layer])

    def zero_grad_buffer(self):
        self.zero_grad(set_to_none=True)


def build_layer(
    world: int,
    balancer,
    planner,
    modules: str,
    dispatcher: str = "alltoall",
    fp8: Optional[str] = None,
    eager: bool = False,
):
    """A TransformerLayer (local spec, MoE MLP with a shared expert), its MoE MLP balanced by
    ``balancer`` (``None``: megatron's MoELayer), with TE graphs of ``modules``; ``dispatcher``
    ``flex``: megatron's flex dispatcher over HybridEP. The router computes in fp32 (HybridEP takes
    fp32 probabilities), in every scenario alike. ``fp8``: megatron's fp8 with that recipe, the
    experts ``TEGroupedMLP`` over ``torch_grouped_linear`` (their GEMMs ``te_grouped_fp8``'s, the
    rest of the layer in bf16: without TE megatron's local linears have no fp8); ``eager``: no
    graphs (``--cuda-graph-impl none``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron_setup import model_parallel, moe_config

    from ultraep_megatron.megatron.balanced_layer.context import BalancingContext
    from ultraep_megatron.megatron.run.layer_spec import apply_moe_balancer
    from ultraep_megatron.planner import BalancerConfig

    model_parallel(world)
    config = moe_config(
        hidden=HIDDEN,
        ffn=FFN,
        experts=NUM_EXPERTS,
        topk=TOPK,
        ep=world,
        dispatcher=dispatcher,
        moe_shared_expert_intermediate_size=SHARED_FFN,
        moe_flex_dispatcher_backend="hybridep",
        moe_router_dtype="fp32",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        moe_grouped_gemm=fp8 is not None,
        cuda_graph_impl="none" if eager else "transformer_engine",
        cuda_graph_modules=[] if eager else modules.split(),
        # One eager step runs here before the capture; the helper then warms each graph up once
        # (megatron asks TE for max(1, 10 - warm-up steps) warm-up iterations).
        cuda_graph_warmup_steps=10,
    )
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    if (
        fp8 is not None
    ):  # as overlapped_schedule.py: --fp8-format hybrid --fp8-recipe RECIPE without TE
        import toy_fp8
        import torch_grouped_linear

        toy_fp8.install_fp8_standins(fp8)
        toy_fp8.enable_fp8(config, fp8)
        spec.submodules.mlp = torch_grouped_linear.grouped_moe_layer_spec()
    if balancer is not None:
        spec = apply_moe_balancer(
            spec,
            BalancingContext(
                BalancerConfig(name=balancer, num_slots=1, min_quota=1),
                ring_size=4,
                planner=planner,
            ),
        )
    layer = build_module(spec, config=config, layer_number=1)
    layer.train()
    return layer


def reference_state(layer) -> dict:
    """The weights every scenario loads: the first layer's, with the router rows spread out so a
    push towards two experts' rows makes them the top-k of most tokens."""
    state = {
        k: v.detach().clone() for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)
    }
    gen = torch.Generator().manual_seed(4321)
    router = [k for k in state if k.endswith("mlp.router.weight")][0]
    state[router] = (torch.randn(NUM_EXPERTS, HIDDEN, generator=gen) * 0.5).to(state[router].dtype)
    return state


def step_inputs(rank: int, step: int, router_weight: torch.Tensor):
    """Tokens [SEQ, BATCH, H] pushed towards step ``step``'s hot experts, and an upstream gradient."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    direction = router_weight.float()[list(HOT[step])].sum(0)
    x = x + 1.5 * direction / direction.norm() * HIDDEN**0.5
    return x.to(torch.bfloat16), torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(torch.bfloat16)


def causal_mask(batch: int):
    return (
        ~torch.tril(torch.ones(SEQ, SEQ))
        .bool()
        .view(1, 1, SEQ, SEQ)
        .expand(batch, 1, SEQ, SEQ)
        .contiguous()
    )


def layer_fp8_context(layer):
    """What ``TransformerBlock`` runs each layer in under fp8 with TE: megatron's
    ``fp8_utils.get_fp8_context(config, layer_number - 1)``, TE's ``fp8_autocast(enabled=True,
    fp8_recipe=get_fp8_recipe(config), fp8_group=<amax reduction group>)``, here the graph
    stand-in's (without TE megatron's own is empty); nothing without fp8."""
    import te_graph_standin
    from megatron.core import parallel_state

    if layer.config.fp8 is None:
        return contextlib.nullcontext()
    group = parallel_state.get_amax_reduction_group(
        with_context_parallel=True, tp_only_amax_red=layer.config.tp_only_amax_red
    )
    return te_graph_standin.fp8_autocast(
        enabled=True, fp8_recipe=te_graph_standin.get_fp8_recipe(layer.config), fp8_group=group
    )


def train_step(
    layer, rank: int, step: int, router_weight, permute: bool = False, split: bool = False
):
    """One training step as a TransformerBlock runs the layer: (out, dx, grads by name), in the
    original batch order. ``permute``: the sequences in the other batch order; ``split``: one
    sequence per microbatch, forward and backward each. Each microbatch's gradients are taken out
    of ``.grad`` into fp32 sums, as megatron's DDP moves them into ``main_grad``: the gradients a
    TE graph hands autograd are its static buffers (``.grad`` may become one), which the next
    replay overwrites."""
    x, up = step_inputs(rank, step, router_weight)
    order = torch.tensor([1, 0]) if permute else torch.arange(BATCH)
    microbatches = [order[i : i + 1] for i in range(BATCH)] if split else [order]
    layer.zero_grad(set_to_none=True)
    layer.set_is_first_microbatch()  # megatron's schedule, at a step's first microbatch (fp8 casts anew)
    outs, dxs, grads = [], [], {}
    for sequences in microbatches:
        xm = x[:, sequences].contiguous().requires_grad_(True)
        with layer_fp8_context(layer):
            out, _ = layer(hidden_states=xm, attention_mask=causal_mask(len(sequences)))
        (out * up[:, sequences]).float().sum().backward()
        outs.append(out.detach().float())
        dxs.append(xm.grad.detach().float())
        for name, param in layer.named_parameters():
            if param.grad is not None:
                grads[name] = grads.get(name, 0) + param.grad.detach().float()
                param.grad = None
    back = order.argsort()
    return torch.cat(outs, 1)[:, back].clone(), torch.cat(dxs, 1)[:, back].clone(), grads


def state_for(layer, state: dict) -> dict:
    """``state`` (the SequentialMLP experts' weights, ``experts.local_experts.{i}.linear_fc{1,2}.weight``)
    in ``layer``'s layout: grouped experts hold expert i's as ``experts.linear_fc{1,2}.weight{i}``."""
    names = set(layer.state_dict())
    if not any(".local_experts." in key for key in state) or any(
        ".local_experts." in key for key in names
    ):
        return state
    mapped = {}
    for key, value in state.items():
        if ".local_experts." in key:
            head, tail = key.split(".local_experts.")
            index, linear, _ = tail.split(".")
            key = f"{head}.{linear}.weight{index}"
        mapped[key] = value
    return {k: v for k, v in mapped.items() if k in names}


def run_scenario(name: str, sc: dict, world: int, rank: int, state: dict, standin) -> dict:
    from megatron.core.transformer import cuda_graphs

    layer = build_layer(
        world,
        sc["balancer"],
        sc.get("planner"),
        sc["modules"],
        sc.get("dispatcher", "alltoall"),
        fp8=sc.get("fp8"),
        eager=sc.get("eager", False),
    )
    layer.load_state_dict(state_for(layer, state), strict=True)
    router_weight = layer.mlp.router.weight.detach().clone()
    moe = layer.mlp
    manager = getattr(moe.token_dispatcher, "_comm_manager", None)
    result = {
        "moe_class": type(moe).__name__,
        "dispatcher_class": type(moe.token_dispatcher).__name__,
        "manager_class": type(manager).__name__ if manager is not None else None,
    }
    balancing = getattr(moe, "balancing", None)
    feed = dict(permute=sc.get("permute", False), split=sc.get("split", False))
    train_step(layer, rank, 0, router_weight, **feed)  # the eager warm-up step

    if (
        sc.get("fault") == "host_planner"
    ):  # what the startup check refuses: plan on the host in the graph
        balancing.planner = "host"
    if sc.get("fault") == "stale_plan":  # every replay completes the first plan's record
        unpack, first = balancing.unpack_graphed_plan, []

        def stale_unpack(host_half):
            if not first:
                first.append(host_half.clone())
            return unpack(first[0])

        balancing.unpack_graphed_plan = stale_unpack
    if sc.get("fault") == "stale_host_plan":  # every step plans on the first step's load
        start_plan, first_load = balancing.start_plan, []

        def stale_start_plan(load, balancer, **kwargs):
            if not first_load:
                first_load.append(load.clone())
            return start_plan(first_load[0], balancer, **kwargs)

        balancing.start_plan = stale_start_plan

    # What runs on the host during capture and replays: the router's forward, the dispatcher's plan.
    calls = {"router": 0, "plan": 0}
    router_forward = moe.router.forward

    fp8_seen = []  # the fp8 autocast state the router's Python ran under (TE's FP8GlobalStateManager)

    def counting_router(*args, **kwargs):
        calls["router"] += 1
        manager = standin.FP8GlobalStateManager
        fp8_seen.append(
            (manager.FP8_ENABLED, type(manager.FP8_RECIPE).__name__, manager.FP8_GRAPH_CAPTURING)
        )
        return router_forward(*args, **kwargs)

    moe.router.forward = counting_router
    if balancing is not None:
        begin = moe._begin

        def counting_plan(*args, **kwargs):
            calls["plan"] += 1
            return begin(*args, **kwargs)

        moe._begin = counting_plan
    forward_graph = backward_graph = None
    if not sc.get("eager"):
        helper = cuda_graphs.TECudaGraphHelper(
            model=[GraphChunk(layer)],
            config=layer.config,
            seq_length=SEQ,
            micro_batch_size=1 if feed["split"] else BATCH,
        )
        captured = standin.make_graphed_callables
        graphed_with = {}

        def recording(*args, **kwargs):  # what megatron hands TE's make_graphed_callables under fp8
            graphed_with.update(
                {k: kwargs.get(k) for k in ("fp8_enabled", "fp8_recipe", "fp8_weight_caching")}
            )
            graphed_with["fp8_group_size"] = (
                kwargs["fp8_group"].size() if kwargs.get("fp8_group") is not None else None
            )
            return captured(*args, **kwargs)

        cuda_graphs.make_graphed_callables = recording
        try:
            helper.create_cudagraphs()
        except (standin.CaptureViolation, RuntimeError) as error:
            # The stand-in's guard, or a host wait on a capturing stream (CUDA refuses both).
            if not isinstance(error, standin.CaptureViolation) and "capturing" not in str(error):
                raise
            cuda_graphs._set_capture_end()  # the helper's capture flag, left set by the failed capture
            result["capture_error"] = f"{type(error).__name__}: {error}"
            result["capture_error_where"] = traceback.format_exc(limit=-3)
            return result
        finally:
            cuda_graphs.make_graphed_callables = captured
        result["graphed_with"] = {
            k: (v if k != "fp8_recipe" else repr(v)) for k, v in graphed_with.items()
        }
        result["capture_calls"] = dict(calls)
        result["fp8_at_capture"] = list(fp8_seen)
        forward_graph, backward_graph = layer.cuda_graphs[0].graphs
        result["graph_ops"] = sorted({str(op.func) for op in forward_graph._tape})
        result["valid_cudagraph_attrs"] = list(moe.token_dispatcher.valid_cudagraph_attrs or [])
    calls.update(router=0, plan=0)
    fp8_seen.clear()
    skips = []  # the skip-weight-update flag after each step's forward (fp8 weight caching)
    # (token, expert) rows this rank's experts receive per step, counted once per dispatch.
    received, steps, inside = [], [], []
    dispatcher = moe.token_dispatcher
    for method in ("dispatch_postprocess", "dispatch_postprocess_parts"):
        if not hasattr(dispatcher, method):
            continue

        def counting(hidden_states, probs, _original=getattr(dispatcher, method)):
            inside.append(1)
            try:
                out = _original(hidden_states, probs)
            finally:
                inside.pop()
            if not inside:
                received.append(out[0].shape[0] + (out[1].shape[0] if len(out) == 5 else 0))
            return out

        setattr(dispatcher, method, counting)
    reductions = standin.FP8GlobalStateManager.reductions[False]
    for step in range(ITERATIONS):
        out, dx, grads = train_step(layer, rank, step, router_weight, **feed)
        steps.append({"out": out, "dx": dx, "grads": grads})
        flag = standin.FP8GlobalStateManager.skip_fp8_weight_update_tensor
        skips.append(None if flag is None else float(flag[0]))
    result.update(
        steps=steps,
        received_rows=received,
        replay_calls=dict(calls),
        replays=(forward_graph.replays, backward_graph.replays)
        if forward_graph is not None
        else (0, 0),
        fp8_at_replay=list(fp8_seen),
        skip_flags=skips,
        backward_reductions=standin.FP8GlobalStateManager.reductions[False] - reductions,
        fp8_casts=sum(getattr(m, "fp8_quantizations", 0) for m in layer.modules()),
        ring_live=balancing.ring.live if balancing is not None else 0,
        stats=balancing.pop_stats() if balancing is not None else {},
        planner=balancing.planner if balancing is not None else None,
    )
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--only", nargs="*", help="run only these scenarios (for debugging)")
    cli = parser.parse_args()

    cpu_backend.activate()
    torch.distributed.init_process_group("gloo")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import deepep_gloo
    import te_graph_standin

    deepep_gloo.install()  # HybridEP's fused dispatch and combine, over gloo
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # One microbatch per step on every data-parallel rank (TECudaGraphHelper reads the count).
    init_num_microbatches_calculator(
        rank,
        None,
        global_batch_size=BATCH * world,
        micro_batch_size=BATCH,
        data_parallel_size=world,
    )
    state = reference_state(build_layer(world, None, None, ROUTER))
    te_graph_standin.install()  # after megatron decided what TE provides (at import), before any capture
    results = {}
    for name, sc in SCENARIOS.items():
        if cli.only and name not in cli.only:
            continue
        t0 = time.perf_counter()
        results[name] = run_scenario(name, sc, world, rank, state, te_graph_standin)
        results[name]["seconds"] = time.perf_counter() - t0
    torch.save(results, os.path.join(cli.out_dir, f"rank{rank}.pt"))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
