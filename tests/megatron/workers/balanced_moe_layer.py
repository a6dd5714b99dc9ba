"""Worker: megatron-core's MoELayer vs UltraEP's BalancedMoELayer on N gloo CPU ranks.

Both layers get the same global weights and tokens (megatron's layer also gets them in a permuted
token order: the noise floor of the comparison); the router is skewed (a large bias on a few
experts' router rows) so the balancer must replicate. Scenarios, each saved to
``<out-dir>/rank<r>.pt``:

* ``single``: one microbatch, forward + backward;
* ``pipelined``: three microbatches forwarded before any backward, backwards in forward order
  (what 1F1B does on a stage), so three plans are in flight in the ring at once;
* ``recompute``: MoE activation recompute (``recompute_modules=['moe']``);
* ``eplb`` / ``eplb-exact``: the baselines through the same dispatcher;
* ``grouped``: ``TEGroupedMLP`` experts (``--moe-grouped-gemm``) with ``torch_grouped_linear`` in
  Transformer Engine's place, against megatron's MoELayer with the same grouped experts;
* ``no_replica_grad_reduction``: ``single`` with the replica-gradient reduction broken (the
  negative control);
* ``mixed``: ``single`` with hot experts 3 and 4, so that EP ranks 1 and 2 each have one main
  expert with a replica and one without (local index 1 and 0 respectively: local != global ids);
* ``frozen_input``: ``single`` with tokens that need no gradient (the layers below frozen), so the
  dispatched tokens carry no gradient into the replica-gradient reduction;
* ``frozen_router``: ``frozen_input`` with the router frozen too (expert-only fine-tuning): neither
  the replica rows nor their probabilities need a gradient, yet the replicas' weight gradients are
  part of their main experts' gradients;
* ``relayed``: ``single`` with one hot expert and relay trees forced (``relay="always"``, from two
  remote replicas on): a relay adds its leaves' replica gradients into its own slot before
  forwarding the sum to the home;
* ``idle_replica``: ``single`` with ``eplb`` keeping a placement that replicates expert 7, which the
  router never picks (its router row points away from every token): the hosted slots receive no
  rows, and their gradient slots must still be written (zeros) before the reduction reads them;
* ``flex``: the balanced flex dispatcher (``--moe-token-dispatcher-type flex``, DeepEP backend) over
  megatron's real ``_DeepepManager``, with ``deepep_gloo`` standing in for DeepEP's CUDA kernels;
  three microbatches in flight, against megatron's all-to-all MoELayer;
* ``flex-hybridep`` / ``flex-hybridep-padded``: the same over megatron's ``_HybridEPManager``
  (``deepep_gloo``'s HybridEP stand-in), handed the plan's row counts; ``-padded`` with every local
  slot's rows padded to a multiple of 8, as HybridEP pads them to the fp8 alignment under fp8;
* ``flex-hybridep-fp8``: HybridEP under blockwise fp8 with grouped experts (``te_grouped_fp8``'s GEMMs),
  every local slot's rows padded to the fp8 alignment; its references are megatron's layer in fp8
  and in fp32 (``reference``): fp8 may round a replicated expert's split rows otherwise, so it is
  compared under the fp8 gate, not to a noise floor;
* ``latent``: latent MoE (``--moe-latent-size``): megatron's MoELayer projects the tokens hidden ->
  latent before ``dispatch_preprocess`` and latent -> hidden after ``combine_postprocess``
  (``te_linear_standin`` in Transformer Engine's linear's place), and builds the experts, the
  replica experts too, at the latent size; three microbatches in flight;
* ``device_planner`` (``_recompute``, ``_flex``): ``pipelined`` (``recompute``, ``flex``) planned on
  the device (``--moe-balancer-planner device``: on the CPU the device planner's torch calls);
* ``device_planner_fallback``: ``device_planner`` whose self-check fails on rank 1 alone (its kernel
  returns a wrong plan while the layer is built): the EP group hands over to the host planner;
* ``latent_no_replica_grad_reduction``: ``latent`` with the replica-gradient reduction broken (its
  negative control; compared against ``latent``'s references).

Run:  torchrun --standalone --nproc-per-node 4 balanced_moe_layer.py --out-dir DIR
"""

import argparse
import contextlib
import functools
import io
import os
import sys

import torch

# tests/megatron, where the modules the workers share live (also for the workers importing this one)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_setup import expert_linears, load_moe_weights, moe_inputs, moe_weights
from ultraep_megatron.megatron.cpu import backend as cpu_backend

NUM_EXPERTS = 8
HIDDEN = 32
FFN = 48
TOPK = 2
SEQ, BATCH = 16, 2
HOT_EXPERTS = (0, 1)  # both on EP rank 0 at EP=4: rank 0 is the straggler without balancing
LATENT = 16  # --moe-latent-size of the latent scenarios


def global_weights() -> dict[str, torch.Tensor]:
    return moe_weights(NUM_EXPERTS, HIDDEN, FFN, seed=4321)


def latent_weights() -> dict[str, torch.Tensor]:
    """The latent scenarios' experts and projections. Shapes (L = LATENT): fc1 [E, F, L], fc2
    [E, L, F], fc1_latent [L, H], fc2_latent [H, L]."""
    gen = torch.Generator().manual_seed(8765)
    return {
        "fc1": torch.randn(NUM_EXPERTS, FFN, LATENT, generator=gen) * LATENT**-0.5,
        "fc2": torch.randn(NUM_EXPERTS, LATENT, FFN, generator=gen) * FFN**-0.5,
        "fc1_latent": torch.randn(LATENT, HIDDEN, generator=gen) * HIDDEN**-0.5,
        "fc2_latent": torch.randn(HIDDEN, LATENT, generator=gen) * LATENT**-0.5,
    }


def rank_inputs(rank: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [SEQ, BATCH, H] and upstream grad of a rank's microbatch."""
    return moe_inputs(1000 * microbatch + rank, SEQ, BATCH, HIDDEN)


def build_layer(
    ep_size: int,
    balancer: str | None,
    num_slots: int,
    recompute: bool,
    dispatcher: str = "alltoall",
    grouped: bool = False,
    balancer_config=None,
    use_cpu_initialization: bool = True,
    flex_backend: str = "deepep",
    pad_multiple=None,
    planner: str | None = None,
    latent_size: int | None = None,
    fp8: str | None = None,
):
    """megatron's MoELayer (``balancer`` None) or a BalancedMoELayer with ``balancer_config`` (by
    default ``balancer`` with ``num_slots`` slots and a floor of 1), planning on the ``planner``
    (``--moe-balancer-planner``; ``None``: its default), with latent projections to ``latent_size``
    (``--moe-latent-size``) if given. Parameters are made on the CPU, or with
    ``use_cpu_initialization=False`` on the current CUDA device (megatron's default)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron_setup import model_parallel, moe_config

    from ultraep_megatron.megatron.balanced_layer.balanced_moe import BalancedMoELayer
    from ultraep_megatron.megatron.balanced_layer.context import BalancingContext
    from ultraep_megatron.planner import BalancerConfig

    model_parallel(ep_size)
    extra = dict(recompute_granularity="selective", recompute_modules=["moe"]) if recompute else {}
    config = moe_config(
        hidden=HIDDEN,
        ffn=FFN,
        experts=NUM_EXPERTS,
        topk=TOPK,
        ep=ep_size,
        dispatcher=dispatcher,
        moe_flex_dispatcher_backend=flex_backend,
        # HybridEP takes float32 probabilities (megatron casts them with a warning otherwise).
        moe_router_dtype="fp32" if flex_backend == "hybridep" else None,
        use_cpu_initialization=use_cpu_initialization,
        moe_latent_size=latent_size,
        **extra,
    )
    if fp8 is not None:  # toy current-scaling fp8 (grouped experts only): TE's pieces stood in for
        import toy_fp8

        toy_fp8.install_fp8_standins(fp8)
        toy_fp8.enable_fp8(config, fp8)
    if grouped:  # TEGroupedMLP experts, a pure-torch grouped linear in Transformer Engine's place
        import torch_grouped_linear

        builder = torch_grouped_linear.grouped_moe_layer_spec()
        config.moe_grouped_gemm = True
    else:
        builder = get_moe_module_spec(use_te=False, num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    if balancer is not None:
        builder = functools.partial(
            BalancedMoELayer,
            submodules=builder.keywords["submodules"],
            balancing=BalancingContext(
                balancer_config
                or BalancerConfig(
                    name=balancer, num_slots=num_slots, min_quota=1, eplb_window=2, eplb_interval=2
                ),
                ring_size=4,
                planner=planner,
            ),
        )
    layer = builder(
        config=config,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        is_mtp_layer=False,
    )
    layer.set_layer_number(1)
    if (
        pad_multiple is not None
    ):  # HybridEP's padding of each expert's rows (megatron sets it under fp8)
        layer.token_dispatcher._comm_manager.pad_multiple = pad_multiple
    return layer


def load_weights(layer, weights):
    """The router's and the local experts' weights (``load_moe_weights``), and the latent
    projections' of a latent layer."""
    load_moe_weights(layer, weights)
    with torch.no_grad():
        for projection, key in latent_projections(layer):
            projection.weight.copy_(weights[key])


def latent_projections(layer) -> list:
    """[(fc1_latent_proj, "fc1_latent"), (fc2_latent_proj, "fc2_latent")] of a latent MoE layer,
    [] otherwise."""
    if not layer.config.moe_latent_size:
        return []
    return [(layer.fc1_latent_proj, "fc1_latent"), (layer.fc2_latent_proj, "fc2_latent")]


def skew(x: torch.Tensor, weights, hot=HOT_EXPERTS) -> torch.Tensor:
    """Push tokens towards the ``hot`` experts' router rows so they win the top-k most of the time."""
    direction = weights["router"][list(hot)].sum(0)
    return x + 0.6 * direction / direction.norm() * x.shape[-1] ** 0.5


def token_order(microbatch: int, permute_tokens: bool) -> torch.Tensor:
    """The order a microbatch's SEQ x BATCH tokens are fed in: their own, or a fixed random one
    per microbatch (the same mathematics summed in another order: the noise floor)."""
    if permute_tokens:
        return torch.randperm(SEQ * BATCH, generator=torch.Generator().manual_seed(microbatch))
    return torch.arange(SEQ * BATCH)


def permuted(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[SEQ, BATCH, H] with its tokens (flattened SEQ x BATCH) in ``order``."""
    return x.reshape(-1, x.shape[-1])[order].view_as(x)


class CountingReplicas:
    """The context's replica experts, counting their calls in first forwards and in backwards (a
    replica backward that recomputed its forward, or a recompute replay, would show there)."""

    def __init__(self, replicas, calls):
        self.replicas, self.calls = replicas, calls

    def __call__(self, *args):
        self.calls["backward" if torch._C._current_graph_task_id() != -1 else "forward"] += 1
        return self.replicas(*args)

    def __getattr__(self, name):
        return getattr(self.replicas, name)


class FoldRecorder(list):
    """Records ``("folded", replicated local experts)`` when an invocation of ``layer`` completes
    its replica-gradient reduction (between ``__init__`` and :meth:`close`), beside the
    accumulation events already in the list."""

    def __init__(self, layer, events):
        from pretrain_grad_dump import replicated_local_experts

        from ultraep_megatron.megatron.balanced_layer.invocation import BalancedInvocation

        super().__init__(events)
        self._cls, self._original = BalancedInvocation, BalancedInvocation.finish_reduction
        recorder = self

        def finish_reduction(invocation):
            grads = recorder._original(invocation)
            if invocation.experts is layer.layer_experts:
                recorder.append(("folded", replicated_local_experts(invocation)))
            return grads

        BalancedInvocation.finish_reduction = finish_reduction

    def close(self) -> list:
        self._cls.finish_reduction = self._original
        return list(self)


def run(
    layer,
    weights,
    rank,
    microbatches: int,
    permute_tokens: bool = False,
    hot=HOT_EXPERTS,
    input_grad: bool = True,
    router_grad: bool = True,
) -> dict:
    """Forward + backward of ``microbatches`` microbatches. ``permute_tokens``: feed every
    microbatch's tokens in another order (results put back in the original order): the same
    mathematics summed in another order, for the noise floor. ``hot``: the experts the tokens are
    pushed towards; ``input_grad`` / ``router_grad``: whether the tokens / the router weight need a
    gradient."""
    balancing = getattr(layer, "balancing", None)
    layer.router.weight.requires_grad_(router_grad)
    layer.zero_grad(set_to_none=True)
    layer.train()
    # (token, expert) rows each rank's experts get after the dispatch: the real per-rank load,
    # observed independently of the planner's own bookkeeping. Counted after megatron's
    # dispatch_postprocess, which expands a token received once (DeepEP sends a token once per rank)
    # into one row per local expert.
    received_rows = []
    postprocess = layer.token_dispatcher.dispatch_postprocess

    def counting_postprocess(hidden_states, probs):
        rows, tokens_per_expert, permuted_probs = postprocess(hidden_states, probs)
        if (
            not torch._C._current_graph_task_id() != -1
        ):  # count first forwards, not recompute replays
            received_rows.append(rows.shape[0])
        return rows, tokens_per_expert, permuted_probs

    layer.token_dispatcher.dispatch_postprocess = counting_postprocess
    padded_layouts = []  # per split into parts: whether the dispatched rows held padding
    if hasattr(
        layer.token_dispatcher, "dispatch_postprocess_parts"
    ):  # replica hosts skip the above
        postprocess_parts = layer.token_dispatcher.dispatch_postprocess_parts

        def counting_postprocess_parts(hidden_states, probs):
            counted = len(received_rows)
            parts = postprocess_parts(hidden_states, probs)
            # Padded: the rows per local slot as dispatched are not the plan's.
            plan_rows = layer.token_dispatcher.invocation.plan.rows_per_slot
            padded_layouts.append(
                [int(n) for n in parts[2].tolist()] != [int(n) for n in plan_rows.tolist()]
            )
            # Unless it went through megatron's postprocess (counted there).
            if torch._C._current_graph_task_id() == -1 and len(received_rows) == counted:
                received_rows.append(parts[0].shape[0] + parts[1].shape[0])
            return parts

        layer.token_dispatcher.dispatch_postprocess_parts = counting_postprocess_parts
    # Replica expert compute, split into first forwards and calls made inside a backward (a replica
    # backward that recomputed its forward, or an activation-recompute replay, would show there).
    replica_calls = {"forward": 0, "backward": 0}
    # Routings whose top-k indices the router's tap handed over (not taken from the routing map).
    tapped = []
    tap = getattr(layer, "_topk_tap", None)
    if tap is not None:
        get_replay_topk = tap.get_replay_topk

        def counting_tap(*args, **kwargs):
            tapped.append(1)
            return get_replay_topk(*args, **kwargs)

        tap.get_replay_topk = counting_tap
    if balancing is not None:
        balancing.replica_experts = CountingReplicas(balancing.replica_experts, replica_calls)
    # When each local main expert's gradient is accumulated (the hook Megatron DDP puts on a
    # parameter's grad accumulator to hand main_grad to its bucket reduction) against when the
    # replica-gradient reduction is folded in, with the local experts that had a replica.
    # The accumulators are kept alive here, as Megatron DDP keeps them: autograd holds them weakly,
    # and a hook on a collected accumulator never fires.
    accumulation_events, accumulators = [], []
    relayed = []  # per schedule the transfers used: whether it streams through a relay tree
    idle_hosted = []  # redundant slots this rank hosted that received no rows
    if balancing is not None:
        # Every redundant slot this rank hosts must be written before each reduction (the buffer is
        # not cleared between uses): a slot read without being written poisons a main gradient.
        buffer = balancing.slots.buffer
        buffer.replica_grads.fill_(float("nan"))
        schedule = buffer.schedule

        def recording_schedule(*args, **kwargs):
            built = schedule(*args, **kwargs)
            relayed.append(built.uses_relay)
            return built

        buffer.schedule = recording_schedule
        reduce = balancing.slots.reduce

        def recording_reduce(invocation, targets, hosted_grads, fold_on_stream):
            plan = invocation.plan
            mine = plan.schedule.rank_transfers(balancing.ep_rank)
            idle_hosted.extend(s for s in mine.hosted_slots if plan.replica_rows[s] == 0)
            return reduce(invocation, targets, hosted_grads, fold_on_stream)

        balancing.slots.reduce = recording_reduce
        for local in range(layer.num_local_experts):
            for weight in expert_linears(layer, local):
                accumulator = weight.expand_as(weight).grad_fn.next_functions[0][0]
                accumulator.register_hook(
                    functools.partial(
                        lambda local, *_: accumulation_events.append(("accumulated", local)), local
                    )
                )
                accumulators.append(accumulator)
        accumulation_events = FoldRecorder(layer, accumulation_events)
    xs, outs, ups, orders = [], [], [], []
    for mb in range(microbatches):
        x, up = rank_inputs(rank, mb)
        order = token_order(mb, permute_tokens)
        x = permuted(skew(x, weights, hot), order).requires_grad_(input_grad)
        out, _ = layer(x)
        (
            xs.append(x),
            outs.append(out),
            ups.append(permuted(up, order)),
            orders.append(order.argsort()),
        )
    ring_live = balancing.ring.live if balancing is not None else 0
    for out, up in zip(outs, ups):  # backwards in forward order, as a 1F1B stage does
        (out * up).sum().backward()
    if isinstance(accumulation_events, FoldRecorder):
        accumulation_events = accumulation_events.close()
    stats = balancing.pop_stats() if balancing is not None else {}
    return {
        "out": [permuted(o.detach(), back).clone() for o, back in zip(outs, orders)],
        "dx": [
            permuted(x.grad.detach(), back).clone() for x, back in zip(xs, orders) if input_grad
        ],
        "router_grad": layer.router.weight.grad.detach().clone() if router_grad else None,
        "expert_grads": {
            int(idx): tuple(w.grad.detach().clone() for w in expert_linears(layer, local))
            for local, idx in enumerate(layer.local_expert_indices)
        },
        "latent_grads": {
            key: projection.weight.grad.detach().clone()
            for projection, key in latent_projections(layer)
        },
        "ring_live_before_backward": ring_live,
        "ring_live_after_backward": balancing.ring.live if balancing is not None else 0,
        "stats": stats,
        "received_rows": received_rows,
        "padded_layouts": padded_layouts,
        "replica_calls": replica_calls,
        "accumulation_events": accumulation_events,
        "replica_buffer_numel": balancing.slots.buffer.replica_weights.numel()
        if balancing is not None
        else 0,
        "relayed": relayed,
        "idle_hosted": idle_hosted,
        "tapped_routings": len(tapped),
        "planner": balancing.planner if balancing is not None else None,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--num-slots", type=int, default=1)
    parser.add_argument("--only", nargs="*", help="run only these scenarios (for debugging)")
    cli = parser.parse_args()

    cpu_backend.activate()
    torch.distributed.init_process_group("gloo")
    # DeepEP's fused kernels are CUDA-only; its gloo stand-in lets megatron's flex path run here
    # (and torch_grouped_linear stands in for Transformer Engine's grouped GEMM).
    import deepep_gloo
    import te_linear_standin

    deepep_gloo.install()
    te_linear_standin.install()  # megatron's latent projections are Transformer Engine linears
    from megatron.core import parallel_state

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    weights = global_weights()
    results = {}
    scenarios = {
        "single": dict(microbatches=1, recompute=False, balancer="ultraep"),
        "pipelined": dict(microbatches=3, recompute=False, balancer="ultraep"),
        "recompute": dict(microbatches=2, recompute=True, balancer="ultraep"),
        "eplb": dict(microbatches=3, recompute=False, balancer="eplb"),
        "eplb-exact": dict(microbatches=1, recompute=False, balancer="eplb-exact"),
        "flex": dict(microbatches=3, recompute=False, balancer="ultraep", dispatcher="flex"),
        "flex-hybridep": dict(
            microbatches=3,
            recompute=False,
            balancer="ultraep",
            dispatcher="flex",
            flex_backend="hybridep",
        ),
        # HybridEP pads every local slot's rows to 8 (as it pads to the fp8 alignment under fp8).
        "flex-hybridep-padded": dict(
            microbatches=2,
            recompute=False,
            balancer="ultraep",
            dispatcher="flex",
            flex_backend="hybridep",
            pad_multiple=8,
        ),
        "grouped": dict(microbatches=3, recompute=False, balancer="ultraep", grouped=True),
        # HybridEP under fp8 with grouped experts: every local slot's rows padded to the fp8
        # alignment, which the grouped GEMM stand-in requires of main and replica experts alike.
        # Compared under the fp8 gate (fp8_equivalence.py) against fp32. blockwise: mxfp8 would
        # refuse FFN = 48 (not a multiple of 32), as TE's MXFP8 quantizer does.
        "flex-hybridep-fp8": dict(
            microbatches=2,
            recompute=False,
            balancer="ultraep",
            dispatcher="flex",
            flex_backend="hybridep",
            grouped=True,
            fp8="blockwise",
        ),
    }
    # The negative control: the single scenario with replica gradients never reduced (one of the
    # faults of pretrain_grad_dump.py, which holds every way the tests break the balancer).
    from pretrain_grad_dump import FAULTS

    scenarios["no_replica_grad_reduction"] = dict(
        scenarios["single"], fault="no_replica_grad_reduction"
    )
    scenarios["mixed"] = dict(scenarios["single"], hot=(3, 4))
    scenarios["frozen_input"] = dict(scenarios["single"], input_grad=False)
    scenarios["frozen_router"] = dict(scenarios["frozen_input"], router_grad=False)
    scenarios["relayed"] = dict(scenarios["single"], hot=(0,), relay=True)
    scenarios["idle_replica"] = dict(scenarios["single"], balancer="eplb", idle_replica=True)
    # --moe-balancer-planner device: the plan and the reroute table made from the load on the device.
    scenarios["device_planner"] = dict(scenarios["pipelined"], planner="device")
    scenarios["device_planner_recompute"] = dict(scenarios["recompute"], planner="device")
    scenarios["device_planner_flex"] = dict(scenarios["flex"], planner="device")
    # Its self-check failing on global rank 1 alone (a kernel returning a wrong plan, while the
    # layer is built): the whole EP group plans on the host (the references: pipelined's).
    scenarios["device_planner_fallback"] = dict(
        scenarios["device_planner"],
        references="pipelined",
        build_fault="device_planner_wrong_plan_on_rank_1",
    )
    # Latent MoE, and its negative control (compared with the same references: they are not rerun).
    scenarios["latent"] = dict(scenarios["pipelined"], latent=True)
    scenarios["latent_no_replica_grad_reduction"] = dict(
        scenarios["latent"], fault="no_replica_grad_reduction", references="latent"
    )
    for name, sc in scenarios.items():
        if cli.only and name not in cli.only:
            continue
        scenario_weights = weights
        if sc.get(
            "idle_replica"
        ):  # expert 7's router row against the direction tokens are pushed in
            scenario_weights = dict(weights, router=weights["router"].clone())
            scenario_weights["router"][7] = -2.0 * weights["router"][list(HOT_EXPERTS)].sum(0)
        if sc.get("latent"):
            scenario_weights = dict(weights, **latent_weights())
        references = sc.get("references")
        if references is not None:  # the same references as the ``references`` scenario's
            for key in ("none", "none_permuted"):
                results[f"{name}/{key}"] = results[f"{references}/{key}"]
        # The reference is always megatron's own all-to-all MoELayer, also fed permuted tokens; under
        # fp8 (no noise floor: the balanced layer rounds a replicated expert's rows otherwise) also
        # in fp32 with the same tokens, weights and routing.
        runs = [
            ("none", None, False),
            ("none_permuted", None, True),
            ("balanced", sc["balancer"], False),
        ]
        if sc.get("fp8"):
            runs = [("reference", None, False)] + [
                run_ for run_ in runs if run_[0] != "none_permuted"
            ]
        for key, balancer, permute in runs:
            if references is not None and balancer is None:
                continue
            dispatcher = sc.get("dispatcher", "alltoall") if balancer else "alltoall"
            # What the balancing context prints while the layer is built (the device planner's
            # self-check: its ready line, or the warning of its hand-over to the host planner).
            printed = io.StringIO()
            with (
                FAULTS[sc["build_fault"]]()
                if balancer and "build_fault" in sc
                else contextlib.nullcontext(),
                contextlib.redirect_stdout(printed),
            ):
                layer = build_layer(
                    world,
                    balancer,
                    cli.num_slots,
                    sc["recompute"],
                    dispatcher,
                    sc.get("grouped", False),
                    flex_backend=sc.get("flex_backend", "deepep"),
                    pad_multiple=sc.get("pad_multiple") if balancer else None,
                    planner=sc.get("planner") if balancer else None,
                    latent_size=LATENT if sc.get("latent") else None,
                    fp8=sc.get("fp8") if key != "reference" else None,
                )
            print(printed.getvalue(), end="", flush=True)
            load_weights(layer, scenario_weights)
            if balancer and sc.get("idle_replica"):  # kept: not refreshed at this call
                slots = torch.full((world, cli.num_slots), -1, dtype=torch.int64)
                slots[: world - 1, 0] = NUM_EXPERTS - 1  # every rank but its home hosts expert 7
                layer.balancer._placement, layer.balancer._calls = slots, 1
            if balancer and sc.get("relay"):  # every expert with two or more remote replicas
                layer.balancing.slots.buffer.relay = "always"
                layer.balancing.slots.buffer.relay_threshold = 1
            key = f"{name}/{key}"
            with FAULTS[sc["fault"]]() if balancer and "fault" in sc else contextlib.nullcontext():
                results[key] = run(
                    layer,
                    scenario_weights,
                    rank,
                    sc["microbatches"],
                    permute,
                    hot=sc.get("hot", HOT_EXPERTS),
                    input_grad=sc.get("input_grad", True),
                    router_grad=sc.get("router_grad", True),
                )
            results[key]["printed_by_balancer"] = [
                line for line in printed.getvalue().splitlines() if line.startswith("ultraep:")
            ]
            results[key]["dispatcher_class"] = type(layer.token_dispatcher).__name__
            manager = getattr(layer.token_dispatcher, "_comm_manager", None)
            results[key]["manager_class"] = type(manager).__name__ if manager is not None else None
            results[key]["experts_class"] = type(layer.experts).__name__
    results["local_expert_indices"] = list(
        range(rank * NUM_EXPERTS // world, (rank + 1) * NUM_EXPERTS // world)
    )
    torch.save(results, os.path.join(cli.out_dir, f"rank{rank}.pt"))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
