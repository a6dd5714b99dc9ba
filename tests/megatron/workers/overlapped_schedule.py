"""Worker: the balanced layer inside megatron's overlapped 1F1B schedule, on 4 gloo CPU ranks.

``--overlap-moe-expert-parallel-comm`` makes megatron-core run each training step through
``pipeline_parallel/combined_1f1b.py``: every transformer layer is cut into nodes
(``models/gpt/fine_grained_callables.py``: attention and pre-dispatch, dispatch, experts, combine)
and one microbatch's forward runs interleaved with another's backward
(``models/common/model_chunk_schedule_plan.py``); with ``--delay-wgrad-compute`` the experts' weight
gradients are computed later, in ``backward_dw()``. Here a tiny GPT (megatron-core's ``GPTModel``,
2 MoE layers, 8 experts, top-2, bf16) wrapped in megatron's DDP (the distributed optimizer's
reduce-scatter, overlapped, buckets smaller than an expert) takes training steps through megatron's own
``forward_backward_no_pipelining`` with the overlap on: the real schedule, its nodes and their
streams (the CPU backend's), without ``pretrain``'s loop. EP 2 on 4 ranks: expert-data-parallel
groups {0, 2} and {1, 3} whose EP groups plan different loads.

Scenarios (each a fresh model from the same initial weights; ``STEPS`` steps of ``MICROBATCHES``
microbatches, learning rate 0: every step's reduced gradients compare):

* ``overlap``: the all-to-all dispatcher, the host planner (its plan completed in the dispatch
  node), SequentialMLP experts;
* ``overlap_device``: the same planned on the device (``--moe-balancer-planner device``);
* ``overlap_hybridep``: the flex dispatcher's HybridEP path over megatron's ``_HybridEPManager``,
  with ``deepep_gloo``'s stand-in for HybridEP's kernels;
* ``delay``: ``--delay-wgrad-compute`` with ``TEGroupedMLP`` experts over ``torch_grouped_linear``
  (Transformer Engine's delayed-wgrad contract: the weight-gradient GEMMs stashed in the backward,
  run in ``backward_dw()``, DDP's gradient hooks fired there);
* ``delay_hybridep``: ``delay`` over HybridEP;
* ``delay_reduced_before_dw`` (negative control): ``delay`` with the replica gradients reduced in
  the experts' backward, before ``backward_dw()`` computed them;
* ``delay_hooks_in_plan_order`` (negative control of the order check): ``delay`` with a layer
  whose plan replicated one of its experts running the held-back DDP hooks of its experts' linears
  in reverse;
* ``overlap_fp8``: fp8 (``--fp8-format hybrid --fp8-recipe tensorwise``) with ``TEGroupedMLP``
  experts over ``torch_grouped_linear``, whose GEMMs are ``te_grouped_fp8``'s stand-in of TE's fp8
  grouped GEMM (megatron pads each expert's rows to 16 with ``toy_fp8``'s ``Fp8Padding``); the
  rest of the model in bf16 (megatron's local linears; without TE megatron's fp8 context is empty);
* ``delay_fp8``: ``overlap_fp8`` with ``--delay-wgrad-compute`` (the fp8 weight-gradient GEMMs
  stashed with their quantized operands, run in ``backward_dw()``);
* ``delay_fp8_reduced_before_dw`` (negative control): ``delay_fp8`` with the replica gradients
  reduced before ``backward_dw()`` computed them.

Each scenario runs ``none`` (megatron's ``MoELayer``) and ``ultraep`` at EP 2, and ``none`` at EP 4
on the same ranks (``none_floor``: every expert's rows computed on one rank, the same mathematics
summed in other GEMMs: the noise floor), every run from the same weights (drawn by each parameter's
layout-independent name). The
dump per rank: its shard of every parameter's reduced gradient per step (global names), the losses, the replicas each plan made,
the ring's live slots after the step, the order megatron's DDP saw the gradients ready
(``megatron_records.GradReadyOrder``), and the nodes that called the balanced layer.

Run:  torchrun --nproc-per-node 4 overlapped_schedule.py --out-dir DIR [--only SCENARIO ...]
"""

import argparse
import contextlib
import os
import re
import sys

import torch

from ultraep_megatron.megatron.cpu import backend as cpu_backend

STEPS, MICROBATCHES = 2, 3
SEQ, MICRO_BATCH, VOCAB = 32, 4, 128
HIDDEN, FFN, EXPERTS, TOPK = 64, 64, 8, 2
EP = 2
#: The noise floor's EP size: on the same 4 ranks every expert computes all its rows on one rank
#: (expert-data-parallel 1), where at EP 2 two ranks each compute part of them, as balancing splits a
#: replicated expert's rows: the same mathematics summed in other GEMMs.
FLOOR_EP = 4
#: The planner's smallest replica quota (rows); see build_model.
MIN_QUOTA = 16
#: Every router's expert bias: EP rank 0's experts preferred.
EXPERT_BIAS = [0.06, 0.04, 0.02, 0.0, 0.0, -0.02, -0.04, -0.06]

SCENARIOS = {
    "overlap": dict(),
    "overlap_device": dict(planner="device"),
    "overlap_hybridep": dict(dispatcher="flex"),
    "delay": dict(delay=True),
    "delay_hybridep": dict(delay=True, dispatcher="flex"),
    "delay_reduced_before_dw": dict(
        delay=True, fault="reduced_before_backward_dw", references="delay"
    ),
    "delay_hooks_in_plan_order": dict(
        delay=True, fault="dw_hooks_in_plan_order", references="delay"
    ),
    # fp8 (tensorwise current scaling) over te_grouped_fp8's stand-in of TE's fp8 grouped GEMM: the
    # undelayed twin first, then the delayed run, then the delayed run with the fault
    "overlap_fp8": dict(grouped=True, fp8="tensorwise"),
    "delay_fp8": dict(delay=True, fp8="tensorwise"),
    "delay_fp8_reduced_before_dw": dict(
        delay=True, fp8="tensorwise", fault="reduced_before_backward_dw", references="delay_fp8"
    ),
}


def model_config(sc, balancer, ep):
    import torch.nn.functional as F
    from megatron_setup import moe_config

    flex = sc.get("dispatcher") == "flex"
    config = moe_config(
        hidden=HIDDEN,
        ffn=FFN,
        experts=EXPERTS,
        topk=TOPK,
        ep=ep,
        num_layers=2,
        dispatcher="flex" if flex else "alltoall",
        ffn_hidden_size=2 * HIDDEN,
        moe_flex_dispatcher_backend="hybridep",
        moe_router_dtype="fp32" if flex else None,
        moe_grouped_gemm=bool(sc.get("delay") or sc.get("grouped")),
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        activation_func=F.silu,
        gated_linear_unit=True,
        normalization="RMSNorm",
        overlap_moe_expert_parallel_comm=True,
        delay_wgrad_compute=bool(sc.get("delay")),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # DeepSeek-V3's routing with a fixed expert bias (set after the build, never updated here):
        # skewed towards EP rank 0's experts, the same way on every rank and run, so balancing must
        # replicate, and the floor's batch swap routes each batch as the reference does
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
    )
    if sc.get(
        "fp8"
    ):  # megatron's --fp8-format hybrid --fp8-recipe RECIPE, without TE (as fp8_moe_layer.py)
        import toy_fp8

        toy_fp8.install_fp8_standins(sc["fp8"])
        toy_fp8.enable_fp8(config, sc["fp8"])
    return config


def build_model(sc, balancer):
    """(megatron's DDP around a GPTModel, its BalancingContext or None)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import torch_grouped_linear
    from megatron_records import set_expert_bias
    from ultraep_megatron.megatron.balanced_layer.context import BalancingContext
    from ultraep_megatron.megatron.run.layer_spec import apply_moe_balancer
    from ultraep_megatron.planner import BalancerConfig

    from megatron.core import parallel_state

    config = model_config(sc, balancer, parallel_state.get_expert_model_parallel_world_size())
    model_parallel_cuda_manual_seed(123)
    torch.manual_seed(123)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    if config.moe_grouped_gemm:  # TEGroupedMLP over the stand-in of TE's grouped linear
        spec.submodules.mlp = torch_grouped_linear.grouped_moe_layer_spec()
    balancing = None
    if balancer is not None:
        # A replica takes at least MIN_QUOTA rows: a GEMM of one or two rows runs another kernel on
        # some CPUs (its rows round otherwise), which no layout of ``none`` reproduces.
        balancing = BalancingContext(
            BalancerConfig(name=balancer, num_slots=2, min_quota=MIN_QUOTA),
            planner=sc.get("planner"),
        )
        spec = apply_moe_balancer(spec, balancing)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        use_distributed_optimizer=True,
        bucket_size=2000,
        delay_wgrad_compute=bool(sc.get("delay")),
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    set_expert_bias([ddp], EXPERT_BIAS)
    return ddp, balancing


def batches(rank: int, step: int):
    """The step's ``MICROBATCHES`` microbatches of (tokens, labels) [MICRO_BATCH, SEQ] on ``rank``."""
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    sequences = torch.randint(0, VOCAB, (MICROBATCHES * MICRO_BATCH, SEQ + 1), generator=gen)
    return [
        (chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous())
        for chunk in sequences.split(MICRO_BATCH)
    ]


def initialize_by_global_name(ddp, names: dict) -> None:
    """Every parameter from a generator seeded by its layout-independent name (the same weights at
    any EP size; norms at one)."""
    import zlib

    with torch.no_grad():
        for (_, local), name in names.items():
            param = ddp.module.get_parameter(local.removeprefix("module."))
            if "norm" in name:
                param.fill_(1.0)
                continue
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


def forward_step(data_iterator, model, return_schedule_plan=False):
    """pretrain_gpt.py's forward step on this worker's batches (with the schedule plan the
    overlapped schedule asks for)."""
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    attention_mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    loss_mask = torch.ones_like(tokens, dtype=torch.float)

    def loss_func(output_tensor):
        loss = (output_tensor.float().view(-1) * loss_mask.view(-1)).sum()
        num_tokens = loss_mask.sum().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}

    if return_schedule_plan:
        return model.build_schedule_plan(
            tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask
        ), loss_func
    return model(
        tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask
    ), loss_func


class NodeCalls:
    """Which of megatron's schedule nodes called the balanced layer's parts (the callables of
    ``fine_grained_callables.py``, by name), and where the plan's host wait happened."""

    def __init__(self):
        self.calls = set()
        self.delayed_wgrad_calls = 0  # the replica experts' delayed weight gradients computed

    @contextlib.contextmanager
    def installed(self):
        try:
            from megatron.core.models.common.utils import TransformerLayerNode
        except ImportError:  # megatron-core 0.18 keeps it beside the GPT callables
            from megatron.core.models.gpt.fine_grained_callables import TransformerLayerNode

        from ultraep_megatron.megatron.balanced_layer.balanced_moe import BalancedMoELayer
        from ultraep_megatron.megatron.balanced_layer.invocation import PlanHandle

        node_stack = []
        forward_impl = TransformerLayerNode.forward_impl

        def recording_forward_impl(node, *args):
            node_stack.append(node.name)
            try:
                return forward_impl(node, *args)
            finally:
                node_stack.pop()

        wait = PlanHandle.wait
        calls = self.calls

        def recording_wait(handle):
            if handle._plan is None:  # the host waits (later calls return the plan)
                calls.add(("host wait", node_stack[-1] if node_stack else None))
            return wait(handle)

        wrapped = {}
        for method in ("preprocess", "dispatch", "routed_experts_compute", "postprocess"):
            original = getattr(BalancedMoELayer, method)

            def recording(self, *args, _original=original, _method=method, **kwargs):
                calls.add((_method, node_stack[-1] if node_stack else None))
                return _original(self, *args, **kwargs)

            wrapped[method] = original
            setattr(BalancedMoELayer, method, recording)
        from ultraep_megatron.megatron.balanced_layer.expert_slots import ReplicaExperts

        delayed = ReplicaExperts.delayed_weight_grads

        def counting_delayed(replicas):
            self.delayed_wgrad_calls += 1
            return delayed(replicas)

        ReplicaExperts.delayed_weight_grads = counting_delayed
        TransformerLayerNode.forward_impl = recording_forward_impl
        PlanHandle.wait = recording_wait
        try:
            yield self
        finally:
            ReplicaExperts.delayed_weight_grads = delayed
            TransformerLayerNode.forward_impl = forward_impl
            PlanHandle.wait = wait
            for method, original in wrapped.items():
                setattr(BalancedMoELayer, method, original)


def _reduced_before_backward_dw():
    """The negative control's fault: every balanced layer reduces its replica gradients in the
    experts' backward, as without --delay-wgrad-compute, i.e. before backward_dw() computed them
    (the replica experts' linears then hand autograd gradients not computed yet)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from ultraep_megatron.megatron.balanced_layer import replica_autograd
    from ultraep_megatron.megatron.balanced_layer.balanced_moe import BalancedMoELayer

    weights, reduce = replica_autograd.ReplicaWeights, replica_autograd.ReduceReplicaGrads
    originals = weights.backward, reduce.backward, BalancedMoELayer.backward_dw

    def weights_backward(ctx, *weight_grads):
        ctx.invocation.start_reduction(weight_grads)
        return None, None, None

    def reduce_backward(ctx, grad_received):
        invocation = ctx.invocation
        invocation.experts.awaiting_dw.append(invocation)
        reduced = invocation.finish_reduction()
        by_param = {
            id(p): g
            for expert, grads in zip(invocation.take_main_params(), reduced)
            for p, g in zip(expert, grads)
        }
        return (None, grad_received, *(by_param[id(p)] for p in ctx.params))

    def backward_dw(self, routed_experts=True, shared_experts=False):
        if routed_experts and self.layer_experts.delays_wgrad:
            invocation = self.layer_experts.awaiting_dw.popleft()
            if sum(invocation.plan.replica_rows) > 0:  # the replicas' own delayed computation
                self.balancing.replica_experts.delayed_weight_grads()
        return MoELayer.backward_dw(self, routed_experts, shared_experts)

    weights.backward, reduce.backward = (
        staticmethod(weights_backward),
        staticmethod(reduce_backward),
    )
    BalancedMoELayer.backward_dw = backward_dw
    try:
        yield
    finally:
        weights.backward, reduce.backward = (staticmethod(f) for f in originals[:2])
        BalancedMoELayer.backward_dw = originals[2]


def _dw_hooks_in_plan_order():
    """The order fault: a balanced layer whose invocation replicated one of its local experts runs
    the held-back DDP hooks of its experts' linears in reverse (the order then depends on the plan)."""
    from pretrain_grad_dump import replicated_local_experts

    from ultraep_megatron.megatron.balanced_layer import balanced_moe

    original = balanced_moe._deferred_wgrad_hooks

    @contextlib.contextmanager
    def deferred(modules):
        with original(modules) as fired:
            yield fired
            layer = _CURRENT_DW_LAYER[-1] if _CURRENT_DW_LAYER else None
            if layer is not None and replicated_local_experts(layer._dw_invocation):
                fired.reverse()

    backward_dw = balanced_moe.BalancedMoELayer.backward_dw

    def recording_backward_dw(self, *args, **kwargs):
        awaiting = self.layer_experts.awaiting_dw
        self._dw_invocation = awaiting[0] if awaiting else None
        _CURRENT_DW_LAYER.append(self)
        try:
            return backward_dw(self, *args, **kwargs)
        finally:
            _CURRENT_DW_LAYER.pop()

    balanced_moe._deferred_wgrad_hooks = deferred
    balanced_moe.BalancedMoELayer.backward_dw = recording_backward_dw
    try:
        yield
    finally:
        balanced_moe._deferred_wgrad_hooks = original
        balanced_moe.BalancedMoELayer.backward_dw = backward_dw


_CURRENT_DW_LAYER: list = []

FAULTS = {
    "reduced_before_backward_dw": contextlib.contextmanager(_reduced_before_backward_dw),
    "dw_hooks_in_plan_order": contextlib.contextmanager(_dw_hooks_in_plan_order),
}


def grouped_expert_names(ddp, names: dict) -> dict:
    """``global_parameter_names`` with grouped experts' ``linear_fc*.weight{j}`` renamed to the
    global expert index too."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    local_to_global = {}
    for name, module in ddp.named_modules():
        if isinstance(module, BaseMoELayer):
            local_to_global[f"{name}.experts."] = module.local_expert_indices
    out = {}
    for key, global_name in names.items():
        match = re.match(r"^(.*\.experts\.linear_fc\d\.(?:weight|bias))(\d+)$", key[1])
        prefix = next((p for p in local_to_global if match and key[1].startswith(p)), None)
        if prefix is not None:
            global_name = re.sub(
                r"(weight|bias)\d+$",
                rf"\g<1>{local_to_global[prefix][int(match.group(2))]}",
                global_name,
            )
        out[key] = global_name
    return out


def train(ddp, balancing, rank: int, order_recorder) -> dict:
    """``STEPS`` steps of megatron's forward-backward at learning rate 0 (no optimizer: every step
    starts from the same weights); per step the reduced gradients and the losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_records import global_parameter_names, reduced_gradients

    config = ddp.config
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = None
    config.grad_scale_func = None
    plans = []
    if balancing is not None:
        planned = balancing.planned

        def recording(invocation, *args):
            planned(invocation, *args)
            if invocation.training:
                plan = invocation.plan
                replicated = sorted(int(e) for e in plan.slot_expert.reshape(-1).tolist() if e >= 0)
                plans.append((invocation.layer_number, replicated, list(plan.replica_rows)))

        balancing.planned = recording
    names = grouped_expert_names(ddp, global_parameter_names([ddp]))
    initialize_by_global_name(ddp, names)
    out = {"grads": {}, "losses": {}, "ring_live": {}, "plans": {}}
    forward_backward = get_forward_backward_func()
    for step in range(1, STEPS + 1):
        ddp.zero_grad_buffer()
        order_recorder.begin(step, [ddp])
        plans.clear()
        data = iter(batches(rank, step))
        reports = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data,
            model=[ddp],
            num_microbatches=MICROBATCHES,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        ddp.finish_grad_sync()
        out["grads"][step] = reduced_gradients([ddp], names)  # {global name: (gradient, owned)}
        out["losses"][step] = [float(r["lm loss"][0]) for r in reports]
        out["ring_live"][step] = balancing.ring.live if balancing is not None else 0
        out["plans"][step] = list(plans)
    if balancing is not None:
        out["stats"] = balancing.pop_stats()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--only", nargs="*", help="run only these scenarios (for debugging)")
    cli = parser.parse_args()

    cpu_backend.activate()
    torch.distributed.init_process_group("gloo")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import deepep_gloo

    deepep_gloo.install()  # HybridEP's kernels are CUDA-only: megatron's flex path over gloo
    from megatron.core import parallel_state

    from megatron_records import GradReadyOrder
    from megatron_setup import model_parallel

    rank = torch.distributed.get_rank()
    order = GradReadyOrder()
    order.install()
    scenarios = {name: sc for name, sc in SCENARIOS.items() if not cli.only or name in cli.only}
    results = {}
    # The floors first, at EP 4, then the compared runs at EP 2: megatron's groups are made twice.
    for ep, runs in (
        (FLOOR_EP, [("none_floor", None)]),
        (EP, [("none", None), ("ultraep", "ultraep")]),
    ):
        model_parallel(ep)
        for name, sc in scenarios.items():
            for key, balancer in runs:
                if sc.get("references") and balancer is None:
                    results[f"{name}/{key}"] = results[f"{sc['references']}/{key}"]
                    continue
                order.__init__()  # a fresh record for this run (its hook stays installed)
                fault = (
                    FAULTS[sc["fault"]]()
                    if "fault" in sc and balancer
                    else contextlib.nullcontext()
                )
                nodes = NodeCalls()
                with fault, nodes.installed():
                    ddp, balancing = build_model(sc, balancer)
                    result = train(ddp, balancing, rank, order)
                result["grad_order"] = order.result()
                result["node_calls"] = sorted(nodes.calls, key=str)
                result["experts_class"] = type(ddp.module.decoder.layers[0].mlp.experts).__name__
                dispatcher = ddp.module.decoder.layers[0].mlp.token_dispatcher
                result["dispatcher_class"] = type(dispatcher).__name__
                manager = getattr(dispatcher, "_comm_manager", None)
                result["manager_class"] = type(manager).__name__ if manager is not None else None
                result["delayed_wgrad_calls"] = nodes.delayed_wgrad_calls
                # forwards whose experts cast their weights to fp8 (te_grouped_fp8 ran)
                result["fp8_casts"] = sum(getattr(m, "fp8_quantizations", 0) for m in ddp.modules())
                results[f"{name}/{key}"] = result
    torch.save(results, os.path.join(cli.out_dir, f"rank{rank}.pt"))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
