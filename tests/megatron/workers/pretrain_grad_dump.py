"""Worker: the repository's pretrain_gpt.py, instrumented for the equivalence tests.

Everything below is controlled by environment variables; the training itself is pretrain_gpt.py's.

* ``ULTRAEP_GRAD_DUMP_DIR`` (required): where ``rank<r>.pt`` goes, a dict with

  - ``grads``: ``{iteration: {global parameter name: (gradient, owned)}}`` for the lr-0
    iterations (after ``train_step`` the gradient buffers still hold the iteration's reduced
    gradients; Megatron zeroes them at the start of the next step): ``owned`` marks the elements
    whose reduced value this rank holds, all of them unless the distributed optimizer leaves the
    rank a shard of each bucket (``megatron_records.reduced_gradients``). Global names do not depend on the
    parallel layout: decoder layers by their global number, routed experts by their global index,
    wrapper prefixes dropped.
  - ``expert_bias``: ``{iteration: {global router name: expert bias}}`` after the lr-0
    iterations' updates.
  - ``eval``: one record per evaluation (during and after training, in order): the iteration,
    whether it ran during training, its losses, the imbalance after balancing of each balanced invocation it made and the live
    virtual-layer-ring slots after it.

* ``ULTRAEP_LR0_ITERS=K``: iterations 1..K run at learning rate 0 (the scheduler's lr is replaced
  by 0 until then): every one of them computes gradients from the same parameters on a new batch,
  so runs compare per step. The configured schedule (Adam) takes over from iteration K + 1.

* ``ULTRAEP_EXPERT_BIAS=b0,b1,...``: before the first iteration, every router's expert bias
  (DeepSeek-V3's aux-loss-free bias, added to the scores for top-k selection) is set to these
  values: a skewed routing that, saved in a checkpoint, every layout loads alike.

* ``ULTRAEP_WGRAD_FUSION_STANDIN=1``: ``--gradient-accumulation-fusion`` runs, with a CPU stand-in
  for its Apex kernel (``wgrad_fusion_standin.py``); the CPU backend then no longer adds
  ``--no-gradient-accumulation-fusion``.

* ``--fp8-param-gather`` with ``--fp8-format``: the expert weights are Transformer Engine's
  quantized parameters, stood in by ``fp8_param_standin`` (TE's parts of megatron's fp8-parameter
  path: building, buffer mapping, the optimizer's cast, the gather's post-processing).

* ``ULTRAEP_GRAD_ORDER=1``: the dump also gets ``grad_order`` (``megatron_records.GradReadyOrder``): per
  iteration, the order in which megatron's DDP was told each parameter's gradient was ready and in
  which its bucket groups started their collectives, the buckets and the ranks each group reduces
  over, and the experts each training invocation's plan replicated.

* ``ULTRAEP_FAULTS``: comma-separated faults from :data:`FAULTS`, each ``name@iteration`` (active
  during that iteration's ``train_step`` only) or ``name`` (the whole run). They break the
  balancer on purpose, for the negative controls.

Run:  torchrun ... pretrain_grad_dump.py <pretrain_gpt.py arguments>
"""

import contextlib
import os
import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------------------------------------
# Faults: every way the tests break the balancer, in one place. Each is a context manager that
# patches the narrowest point of the mechanism it breaks and restores it on exit.
# ---------------------------------------------------------------------------------------------


def replicated_local_experts(invocation) -> tuple:
    """Local indices of this rank's main experts with a replica in the invocation's plan."""
    record = invocation.plan.record
    G = record.num_experts // record.num_ranks
    first = invocation.context.ep_rank * G
    replicated = set(record.slot_expert.reshape(-1).tolist())
    return tuple(g for g in range(G) if first + g in replicated)


@contextlib.contextmanager
def _patched(owner, name, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _no_replica_grad_reduction():
    """Replica gradients never reach the main experts: the data plane's reduction runs (every rank
    takes part) but folds into throwaway gradients."""
    from ultraep_megatron.dataplane import ReplicaBuffer

    def replacement(original):
        def reduce_gradients(self, schedule, main_grads, **kwargs):
            dropped = [[torch.zeros_like(g) for g in expert] for expert in main_grads]
            return original(self, schedule, dropped, **kwargs)

        return reduce_gradients

    return _patched(ReplicaBuffer, "reduce_gradients", replacement)


def _skip_rematerialization():
    """The backward's re-materialization copies nothing (the buffer is still marked as holding
    the invocation's replicas), so replica backwards use what a later layer left there."""
    from ultraep_megatron.dataplane import ReplicaBuffer
    from ultraep_megatron.megatron.balanced_layer.dispatchers import in_backward_pass

    def replacement(original):
        def distribute_weights(self, schedule, main_weights, **kwargs):
            if not in_backward_pass():
                return original(self, schedule, main_weights, **kwargs)
            return None

        return distribute_weights

    return _patched(ReplicaBuffer, "distribute_weights", replacement)


def _replica_gets_other_layer_weights():
    """Replicas are filled (forward and backward) with the experts of the next MoE layer of this
    rank's model, cyclically (a rank with one MoE layer is unaffected)."""
    import gc

    from ultraep_megatron.megatron.balanced_layer.balanced_moe import BalancedMoELayer
    from ultraep_megatron.megatron.balanced_layer.invocation import BalancedInvocation

    def replacement(original):
        def start_weights(self):
            layers = sorted(
                (
                    o
                    for o in gc.get_objects()
                    if isinstance(o, BalancedMoELayer) and o.balancing is self.context
                ),
                key=lambda layer: layer.layer_number,
            )
            mine = next(layer for layer in layers if layer.layer_experts is self.experts)
            other = layers[(layers.index(mine) + 1) % len(layers)].layer_experts
            self.context.slots.fill(self, other.main_weights(other.lookup()))

        return start_weights

    return _patched(BalancedInvocation, "start_weights", replacement)


def _rematerialized_from_another_microbatch():
    """The backward re-materializes a layer's replicas per the plan whose replicas the buffer holds
    when it starts (under megatron's overlapped schedule: the other microbatch's latest forward),
    not per its own invocation's, and then counts the buffer as holding its own."""
    from ultraep_megatron.megatron.balanced_layer.dispatchers import in_backward_pass
    from ultraep_megatron.megatron.balanced_layer.invocation import BalancedInvocation

    def replacement(original):
        def start_weights(self):
            slots = self.context.slots
            other = slots.holder
            if (
                not in_backward_pass()
                or other is None
                or other is self
                or other.plan.schedule_builder is None
                or self.plan.schedule_builder is None
            ):
                return original(self)
            slots.holder = self  # the buffer keeps the other invocation's replicas

        return start_weights

    return _patched(BalancedInvocation, "start_weights", replacement)


def _unbalanced_mtp_layer():
    """The MTP block keeps Megatron's own MoELayer (its spec is not balanced)."""
    from ultraep_megatron.megatron.run import layer_spec

    return _patched(
        layer_spec,
        "_balanced_mtp_block_spec",
        lambda original: lambda megatron_mtp_block_spec: megatron_mtp_block_spec,
    )


def _replays_in_forward_order():
    """Activation-recompute replays take the parked runs of a layer strictly oldest first, also
    the runs of one model forward (the MTP block's shared layer), which are replayed in reverse:
    every run is parked as a model forward of its own."""
    from ultraep_megatron.megatron.balanced_layer.ring import VirtualLayerRing

    def replacement(original):
        def park_for_recompute(self, layer, vid, runs_per_forward=1):
            return original(self, layer, vid, 1)

        return park_for_recompute

    return _patched(VirtualLayerRing, "park_for_recompute", replacement)


def _grads_ready_in_plan_order():
    """The order fault: only the main experts with a replica wait for the replica-gradient
    reduction; the others' gradients are accumulated (and handed to DDP's buckets) as soon as
    their own backward produced them, so the order buckets complete in follows the local plan."""
    from ultraep_megatron.megatron.balanced_layer import replica_autograd

    def replacement(original):
        def apply(invocation, received, *params):
            main = invocation.take_main_params()
            replicated = {id(p) for g in replicated_local_experts(invocation) for p in main[g]}
            return original(invocation, received, *(p for p in params if id(p) in replicated))

        return apply

    return _patched(replica_autograd.ReduceReplicaGrads, "apply", replacement)


class _PlanDependentIdentity(torch.autograd.Function):
    """Identity on the tokens; its other inputs are parameters whose gradient it gives zeros."""

    @staticmethod
    def forward(ctx, tokens, *params):
        ctx.shapes = [p.shape for p in params]
        return tokens.view_as(tokens)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(grad.new_zeros(shape) for shape in ctx.shapes))


def _plan_dependent_node_before_dispatch():
    """The gradient-order fault: an autograd node before the dispatch that depends on the plan.
    The permuted tokens pass through an identity whose inputs also include the parameters of the
    local main experts this rank's plan replicates; it adds zeros to their gradients, so the values
    stay right, but their gradient accumulation (and DDP's grad-ready hook) now waits for the
    dispatch's backward: DDP sees the experts' gradients ready in an order of the local plan's
    making."""
    from ultraep_megatron.megatron.balanced_layer.balanced_moe import BalancedMoELayer

    def replacement(original):
        def preprocess(self, hidden_states, probs, routing_map):
            hidden_states, probs = original(self, hidden_states, probs, routing_map)
            if not torch.is_grad_enabled():
                return hidden_states, probs
            invocation = self.token_dispatcher.invocation
            main = invocation.take_main_params()
            replicated = [
                p for g in replicated_local_experts(invocation) for p in main[g] if p.requires_grad
            ]
            return _PlanDependentIdentity.apply(hidden_states, *replicated), probs

        return preprocess

    return _patched(BalancedMoELayer, "preprocess", replacement)


def _replicas_before_param_gather():
    """The gather fault: the replicas are copied from the main experts without first completing
    megatron's parameter all-gather for them (--overlap-param-gather), i.e. from the previous step's
    weights in the shards other ranks own."""
    from ultraep_megatron.megatron.balanced_layer.balanced_moe import BalancedMoELayer

    return _patched(BalancedMoELayer, "_prepare_main_params", lambda original: lambda self: None)


def _mxfp8_parameters_without_reuse_accepted():
    """The startup check accepts MXFP8 parameters without --reuse-grad-buf-for-mxfp8-param-ag (to
    show what megatron then does with them)."""
    from ultraep_megatron.megatron.release import capabilities

    return _patched(capabilities, "_mxfp8_parameter_problems", lambda original: lambda get: [])


def _device_planner_kernel(broken, only_rank=None):
    """The device planner's op body (``fused_plan._plan_on_load_device``: the Triton kernel on
    CUDA, the host code on the CPU) replaced by ``broken(original, *args)`` wherever the device
    planner runs it (not the self-check's reference, the host planner), on global rank
    ``only_rank`` alone if given; the process's self-check outcomes are forgotten around it."""
    from ultraep_megatron.planner import fused_plan, self_check

    def replacement(original):
        def plan(*args, **kwargs):
            if (
                only_rank is not None
                and torch.distributed.is_initialized()
                and torch.distributed.get_rank() != only_rank
            ):
                return original(*args, **kwargs)
            return broken(original, *args, **kwargs)

        return plan

    @contextlib.contextmanager
    def patched_and_checked_afresh():
        self_check.OUTCOMES.clear()
        try:
            with _patched(fused_plan, "_plan_on_load_device", replacement):
                yield
        finally:
            self_check.OUTCOMES.clear()

    return patched_and_checked_afresh()


def _says_nothing_is_feasible(original, *args, **kwargs):
    """A wrong plan: the record says no replica is placed (its slot layout emptied)."""
    record, table = original(*args, **kwargs)
    record = record.clone()
    R, E = args[0].shape
    S = args[2]
    record[16 : 16 + R * S] = -1
    return record, table


def _raises(original, *args, **kwargs):
    raise RuntimeError("triton compilation failed (a fault of the tests)")


def _device_planner_wrong_plan():
    """The device planner's kernel returns a wrong plan (no replica placed)."""
    return _device_planner_kernel(_says_nothing_is_feasible)


def _device_planner_wrong_plan_on_rank_1():
    """The same on global rank 1 only: the other ranks' self-checks pass."""
    return _device_planner_kernel(_says_nothing_is_feasible, only_rank=1)


def _device_planner_raises():
    """The device planner's kernel raises (as a Triton compilation error would)."""
    return _device_planner_kernel(_raises)


FAULTS = {
    "grads_ready_in_plan_order": _grads_ready_in_plan_order,
    "replicas_before_param_gather": _replicas_before_param_gather,
    "plan_dependent_node_before_dispatch": _plan_dependent_node_before_dispatch,
    "device_planner_wrong_plan": _device_planner_wrong_plan,
    "device_planner_wrong_plan_on_rank_1": _device_planner_wrong_plan_on_rank_1,
    "device_planner_raises": _device_planner_raises,
    "no_replica_grad_reduction": _no_replica_grad_reduction,
    "skip_rematerialization": _skip_rematerialization,
    "replica_gets_other_layer_weights": _replica_gets_other_layer_weights,
    "unbalanced_mtp_layer": _unbalanced_mtp_layer,
    "rematerialized_from_another_microbatch": _rematerialized_from_another_microbatch,
    "replays_in_forward_order": _replays_in_forward_order,
    "mxfp8_parameters_without_reuse_accepted": _mxfp8_parameters_without_reuse_accepted,
}


def parse_faults(spec: str) -> tuple[list[str], dict[int, list[str]]]:
    """``"a,b@3"`` -> (whole-run faults, {iteration: faults})."""
    whole, by_iteration = [], {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, iteration = item.partition("@")
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}; known: {sorted(FAULTS)}")
        if iteration:
            by_iteration.setdefault(int(iteration), []).append(name)
        else:
            whole.append(name)
    return whole, by_iteration


def record_quantized_weights(out: dict, current_iteration) -> None:
    """With fp8 parameters: digests of the quantized bytes every replica computed with (each
    forward replica call) and of its main expert's at that iteration (each balanced forward, after
    the main experts' own forward, whose pre-hook completes megatron's parameter gather), keyed
    (iteration, layer, global expert, EP group ranks), in ``out["fp8_params"]``, with the expert
    weights' classes and the stand-in's call counts."""
    import hashlib

    import fp8_param_standin
    from ultraep_megatron.megatron.balanced_layer import balanced_moe, expert_slots
    from ultraep_megatron.megatron.balanced_layer.balanced_moe import BalancedMoELayer

    record = out["fp8_params"] = {
        "replicas": [],
        "homes": {},
        "weight_classes": set(),
        "calls": fp8_param_standin.CALLS,
    }

    def digest(tensors) -> str:
        sha = hashlib.sha1()
        for tensor in tensors:
            for key, part in sorted(tensor.get_metadata().items()):
                if isinstance(part, torch.Tensor) and key not in expert_slots.DERIVED_PARTS:
                    sha.update(
                        key.encode()
                        + part.detach().contiguous().view(torch.uint8).numpy().tobytes()
                    )
        return sha.hexdigest()

    def ep_ranks(group) -> tuple:
        return tuple(torch.distributed.get_process_group_ranks(group))

    compute = BalancedMoELayer.routed_experts_compute

    def routed_experts_compute(self, hidden_states, probs):
        result = compute(self, hidden_states, probs)  # the experts' forward completed their gather
        group = ep_ranks(self.token_dispatcher.ep_group)
        for expert, params in zip(self.local_expert_indices, self.layer_experts.lookup()):
            record["weight_classes"].update(type(p).__name__ for p in params)
            key = (current_iteration(), self.layer_number, int(expert), group)
            record["homes"].setdefault(key, set()).add(digest(params))
        return result

    replicas_of = {}  # the invocation whose replicas run (in the layer's graph)
    run_in_graph = balanced_moe.run_replicas_in_graph

    def run_replicas_in_graph(invocation, tokens, probs, rows_per_slot):
        replicas_of["invocation"] = invocation
        try:
            return run_in_graph(invocation, tokens, probs, rows_per_slot)
        finally:
            del replicas_of["invocation"]

    call = expert_slots.ReplicaExperts.__call__

    def replica_call(self, slot_weights, tokens, rows_per_slot, probs):
        invocation = replicas_of.get("invocation")
        if invocation is not None:
            context = invocation.context
            group = ep_ranks(context.registrations[0].ep_group)
            slot_expert = invocation.plan.slot_expert[context.ep_rank].tolist()
            for expert, weights, rows in zip(slot_expert, slot_weights, rows_per_slot):
                if expert >= 0 and rows > 0:
                    key = (current_iteration(), invocation.layer_number, int(expert), group)
                    record["replicas"].append((key, digest(weights)))
        return call(self, slot_weights, tokens, rows_per_slot, probs)

    BalancedMoELayer.routed_experts_compute = routed_experts_compute
    balanced_moe.run_replicas_in_graph = run_replicas_in_graph
    expert_slots.ReplicaExperts.__call__ = replica_call


def main():
    # What it reads of megatron's model and DDP: from this script's folder, on sys.path as a
    # script's is (imported here: the tests load this module for its FAULTS alone).
    from megatron_records import (
        GradReadyOrder,
        expert_biases,
        global_parameter_names,
        reduced_gradients,
        set_expert_bias,
    )

    dump_dir = Path(os.environ["ULTRAEP_GRAD_DUMP_DIR"])
    dump_dir.mkdir(parents=True, exist_ok=True)
    lr0_iters = int(os.environ.get("ULTRAEP_LR0_ITERS", "0"))
    expert_bias = os.environ.get("ULTRAEP_EXPERT_BIAS")
    whole_run_faults, iteration_faults = parse_faults(os.environ.get("ULTRAEP_FAULTS", ""))
    wgrad_fusion = os.environ.get("ULTRAEP_WGRAD_FUSION_STANDIN") == "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' stand-ins
    grad_order = GradReadyOrder() if os.environ.get("ULTRAEP_GRAD_ORDER") == "1" else None
    if wgrad_fusion:  # before megatron is imported: it looks the kernel up once
        import wgrad_fusion_standin

        wgrad_fusion_standin.install()
    from ultraep_megatron.megatron.cpu import backend as cpu_backend
    from ultraep_megatron.megatron.cpu import flags as cpu_flags

    if wgrad_fusion:
        del cpu_flags.CPU_FLAGS["--no-gradient-accumulation-fusion"]

    cpu_backend.activate()  # pretrain_gpt.py does it too (idempotent); before megatron imports
    import fp8_param_standin

    if fp8_param_standin.needed_by(sys.argv[1:]):  # TE's fp8 parameters, stood in (its docstring)
        fp8_param_standin.install()
    import megatron.training.training as megatron_training
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.training.global_vars import get_args

    from ultraep_megatron.megatron.balanced_layer.context import BalancingContext

    out = {"grads": {}, "expert_bias": {}, "eval": []}
    names = {}
    iteration = 0
    if fp8_param_standin.needed_by(sys.argv[1:]):
        record_quantized_weights(out, lambda: iteration)

    scheduler_lr = OptimizerParamScheduler.get_lr

    def get_lr(self, param_group):
        # The lr of iteration i is set after iteration i - 1, at num_steps = (i - 1) * batch.
        if self.num_steps < lr0_iters * get_args().global_batch_size:
            return 0.0
        return scheduler_lr(self, param_group)

    OptimizerParamScheduler.get_lr = get_lr
    if grad_order is not None:
        grad_order.install()

    original_train_step = megatron_training.train_step

    def train_step(forward_step_func, data_iterator, model, *args, **kwargs):
        nonlocal iteration
        iteration += 1
        if iteration == 1 and expert_bias:
            set_expert_bias(model, [float(b) for b in expert_bias.split(",")])
        if grad_order is not None:
            grad_order.begin(iteration, model)
        with contextlib.ExitStack() as faults:
            for name in iteration_faults.get(iteration, []):
                faults.enter_context(FAULTS[name]())
            result = original_train_step(forward_step_func, data_iterator, model, *args, **kwargs)
        if iteration <= lr0_iters:
            if not names:
                names.update(global_parameter_names(model))
            out["expert_bias"][iteration] = expert_biases(model, names)
            out["grads"][iteration] = reduced_gradients(model, names)
        return result

    megatron_training.train_step = train_step

    eval_plans = []
    contexts = []  # the model's balancing context (one per process here)
    original_planned = BalancingContext.planned

    def planned(self, invocation, host_seconds):
        if self not in contexts:
            contexts.append(self)
        original_planned(self, invocation, host_seconds)
        plan = invocation.plan
        if not invocation.training:
            eval_plans.append(plan.metrics()["imbalance_after"])
        elif grad_order is not None:
            grad_order.on_plan(invocation.layer_number, plan.slot_expert)

    BalancingContext.planned = planned

    original_evaluate = megatron_training.evaluate

    def evaluate(*args, **kwargs):
        eval_plans.clear()
        result = original_evaluate(*args, **kwargs)
        rings = [c.ring for c in contexts]
        out["eval"].append(
            {
                "iteration": iteration,
                "during_training": not training_done,
                "losses": {key: float(value) for key, value in result[0].items()},
                "imbalance_after": list(eval_plans),
                "ring_live": sum(ring.live for ring in rings),
            }
        )
        return result

    megatron_training.evaluate = evaluate

    training_done = False
    original_train = megatron_training.train

    def train(*args, **kwargs):
        nonlocal training_done
        result = original_train(*args, **kwargs)
        training_done = True
        return result

    megatron_training.train = train

    sys.argv = [str(REPO / "pretrain_gpt.py"), *sys.argv[1:]]
    with contextlib.ExitStack() as faults:
        for name in whole_run_faults:
            faults.enter_context(FAULTS[name]())
        try:
            runpy.run_path(str(REPO / "pretrain_gpt.py"), run_name="__main__")
        except SystemExit as done:
            if done.code not in (0, None):
                raise
    if grad_order is not None:
        out["grad_order"] = grad_order.result()
    torch.save(out, dump_dir / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
