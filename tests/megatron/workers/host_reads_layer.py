"""Worker: host reads of device data in one MoE layer's forward and backward, megatron-core's
MoELayer against UltraEP's BalancedMoELayer on the same weights and tokens (``device_reads``).

Scenarios ``ep{2,4}`` and ``ep{2,4}-recompute`` (MoE activation recompute) with skewed routing, so
the balanced layer really replicates; ``ep2-device``, ``ep4-device`` and ``ep4-recompute-device``
the same with ``--moe-balancer-planner device``. Negative controls, the balanced layer with one deliberate read:
``ep4-tolist`` a ``.tolist()`` of the routing map in its dispatcher's forward,
``ep4-item-in-backward`` an ``.item()`` of a main expert's weight where the backward starts the
gradient reduction, ``ep4-item-in-transfer`` an ``.item()`` of the replica weight buffer inside the
weight distribution's program (the code a CUDA run issues on the caller's thread),
``ep4-device-item-in-plan`` an ``.item()`` of the device plan's threshold where it is queued.
``ep4-recompute-check-plans`` runs with ``--moe-balancer-check-plans``, whose checks read device
memory (by design, for debugging). ``ep4-hybridep`` / ``ep4-deepep``: the flex dispatcher (megatron's
for ``none``) over ``deepep_gloo``'s stand-ins, which report where the real HybridEP / DeepEP make
the host wait; ``ep4-hybridep-unmodified``, the negative control: the balanced layer with megatron's
own fused dispatch (no plan counts handed to HybridEP). Each rank writes ``<out-dir>/rank<r>.json``:
{scenario: {"none"|"balanced": {"counts", "events", "replicas"}}}.

The replica transfers run on the caller's thread here, not on the replica buffer's
``HostCommStream``: the counter is a torch function mode, which sees one thread, and on CUDA the
transfers' host code (packing, issuing, folding) runs on the caller's thread too.

Run:  torchrun --standalone --nproc-per-node 4 host_reads_layer.py --out-dir DIR
"""

import argparse
import contextlib
import inspect
import json
import os
import sys

import torch

from ultraep_megatron.megatron.cpu import backend as cpu_backend

SCENARIOS = {
    "ep2": dict(ep=2, recompute=False),
    "ep4": dict(ep=4, recompute=False),
    "ep2-recompute": dict(ep=2, recompute=True),
    "ep4-recompute": dict(ep=4, recompute=True),
    "ep4-tolist": dict(ep=4, recompute=False, fault="tolist"),
    "ep4-item-in-backward": dict(ep=4, recompute=False, fault="item"),
    "ep4-item-in-transfer": dict(ep=4, recompute=False, fault="item-in-transfer"),
    "ep4-recompute-check-plans": dict(ep=4, recompute=True, check_plans=True),
    # The flex dispatcher over deepep_gloo's stand-ins, which report the real libraries' host waits.
    "ep4-hybridep": dict(ep=4, recompute=False, dispatcher="flex", flex_backend="hybridep"),
    "ep4-deepep": dict(ep=4, recompute=False, dispatcher="flex", flex_backend="deepep"),
    "ep4-hybridep-unmodified": dict(
        ep=4,
        recompute=False,
        dispatcher="flex",
        flex_backend="hybridep",
        fault="megatron-flex-dispatch",
    ),
    # --moe-balancer-planner device: the plan made on the device, crossing once after the permutation.
    "ep2-device": dict(ep=2, recompute=False, planner="device"),
    "ep4-device": dict(ep=4, recompute=False, planner="device"),
    "ep4-recompute-device": dict(ep=4, recompute=True, planner="device"),
    "ep4-device-item-in-plan": dict(
        ep=4, recompute=False, planner="device", fault="item-in-device-plan"
    ),
}

_COUNTER = None


def measure(layer, weights, rank, counter, microbatches: int = 2) -> dict:
    from balanced_moe_layer import rank_inputs, skew

    global _COUNTER
    layer.train()
    balancing = getattr(layer, "balancing", None)
    counter.tag(*layer.parameters(), *layer.buffers())
    if balancing is not None:
        counter.tag(balancing.slots.buffer.replica_weights, balancing.slots.buffer.replica_grads)
        balancing.slots.buffer.comm_stream = None  # see the module docstring
    for mb in range(microbatches):
        x, up = rank_inputs(rank, mb)
        x = skew(x, weights).requires_grad_(True)
        counter.tag(x, up)
        _COUNTER = counter
        try:
            with counter:
                out, _ = layer(x)
                (out * up).sum().backward()
        finally:
            _COUNTER = None
    stats = balancing.pop_stats() if balancing is not None else {}
    return {
        "counts": dict(counter.counts),
        "events": counter.events,
        "replicas": sum(v["replicas"] for v in stats.values()),
    }


@contextlib.contextmanager
def reading_inside_the_distribution():
    """Every weight distribution's program reads the replica weight buffer on the host first."""
    from ultraep_megatron.dataplane import distribute

    rounds = distribute._distribution_rounds
    made = {"reads": 0}

    signature = inspect.signature(rounds)

    def rounds_reading_the_buffer(*args, **kwargs):
        signature.bind(*args, **kwargs).arguments["replica_weights"].sum().item()
        made["reads"] += 1
        yield from rounds(*args, **kwargs)

    distribute._distribution_rounds = rounds_reading_the_buffer
    try:
        yield made
    finally:
        distribute._distribution_rounds = rounds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    cli = parser.parse_args()
    cpu_backend.activate()
    torch.distributed.init_process_group("gloo")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from balanced_moe_layer import build_layer, global_weights, load_weights
    from device_reads import DeviceReadCounter, install_sync_counting
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    import deepep_gloo

    install_sync_counting(lambda: _COUNTER)
    deepep_gloo.install()
    deepep_gloo.on_host_wait = lambda what: _COUNTER is not None and _COUNTER.count("sync", what)
    deepep_gloo.on_device_outputs = lambda *tensors: _COUNTER is not None and _COUNTER.tag(*tensors)
    rank = torch.distributed.get_rank()
    weights = global_weights()
    results = {}
    for name, sc in SCENARIOS.items():
        results[name] = {}
        for which in ("none", "balanced"):
            layer = build_layer(
                sc["ep"],
                None if which == "none" else "ultraep",
                2,
                sc["recompute"],
                sc.get("dispatcher", "alltoall"),
                flex_backend=sc.get("flex_backend", "deepep"),
                planner=sc.get("planner") if which == "balanced" else None,
            )
            load_weights(layer, weights)
            if which == "balanced" and sc.get("check_plans"):
                layer.balancing.check_plans = True
            if which == "balanced" and sc.get("fault") == "tolist":
                begin = layer._begin

                def plan_reading_the_routing(routing_map, _begin=begin):
                    routing_map.tolist()
                    return _begin(routing_map)

                layer._begin = plan_reading_the_routing
            if which == "balanced" and sc.get("fault") == "megatron-flex-dispatch":
                # megatron's own fused dispatch, without the plan's counts handed to HybridEP
                dispatcher = layer.token_dispatcher
                dispatcher.token_dispatch = lambda *a, _d=dispatcher, **k: (
                    MoEFlexTokenDispatcher.token_dispatch(_d, *a, **k)
                )
            if which == "balanced" and sc.get("fault") == "item":
                reduce = layer.balancing.slots.reduce

                def start_reading_a_weight(invocation, *args, _reduce=reduce):
                    invocation.take_main_params()[0][0].sum().item()
                    return _reduce(invocation, *args)

                layer.balancing.slots.reduce = start_reading_a_weight
            if which == "balanced" and sc.get("fault") == "item-in-device-plan":
                start_plan = layer.balancing.start_plan

                def plan_reading_the_threshold(*args, _start=start_plan, **kwargs):
                    handle = _start(*args, **kwargs)
                    handle.crossing[1].item()  # the record's threshold (record_layout.H_THRESHOLD)
                    return handle

                layer.balancing.start_plan = plan_reading_the_threshold
            if which == "balanced" and sc.get("fault") == "item-in-transfer":
                with reading_inside_the_distribution() as deliberate:
                    results[name][which] = measure(layer, weights, rank, DeviceReadCounter())
                results[name][which]["deliberate_reads"] = deliberate["reads"]
                continue
            results[name][which] = measure(layer, weights, rank, DeviceReadCounter())
    with open(os.path.join(cli.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
