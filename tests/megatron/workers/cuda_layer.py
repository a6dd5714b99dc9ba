"""Worker: the balanced MoE layer on a GPU, its ranks sharing the GPU (``cuda_staging``).

megatron-core's MoELayer and UltraEP's BalancedMoELayer get the same weights and tokens on ``cuda``
(skewed routing, so the balancer replicates), EP = the number of ranks. Per scenario each layer runs
its microbatches' forwards, then their backwards:

1. ``warn``: under ``torch.cuda.set_sync_debug_mode("warn")``; every synchronizing CUDA call (a host
   read of device data, a blocking copy) is recorded with the place that asked for it (the stack's
   innermost frame in megatron-core, UltraEP or a test helper). Event and device synchronizations,
   which that mode does not report (torch 2.11), are recorded the same way.
2. ``error``: under ``set_sync_debug_mode("error")``, with the measured layer's own designated
   wait allowed (megatron's layer: its ``_maybe_dtoh_and_synchronize``; the balanced layer: its
   ``PlanHandle.wait``, for the load or the device plan's record; calls counted): any other synchronization raises, also one inside
   a C++ autograd node, whose warning in (1) autograd replays after the backward without the place.

A first forward and backward of each scenario's two layer kinds runs before any of this, unwatched:
what a first use sets up (CUDA's RNG, cuBLAS handles, the pinned host pool) is not the per-layer
path. Each result also counts the staged operations of its layer, and where the data plane ran its
transfers (``cuda_staging``: on a CUDA stream, NCCL's path, or on the host). Layers are
moved to the GPU before use, as megatron's ``get_model`` does (megatron's router keeps its weight on
the host until then, and its first forward would upload it, blocking).

Pass (2) also saves outputs, input gradients, the router's and the local experts' weight gradients
for the equivalence check; megatron's layer fed the tokens in another order gives the noise floor.
TF32 is off: fp32 products in both layers.

Scenarios: ``single`` (one microbatch), ``pipelined`` (three in flight), ``recompute`` (MoE
activation recompute, two), ``grouped`` (``TEGroupedMLP`` with ``torch_grouped_linear`` in
Transformer Engine's place, two), all with ``--moe-balancer-planner host``; ``device-planner`` and
``device-planner-recompute`` (three in flight; recompute, two) with the plan made on the device.

Each rank writes ``<out-dir>/rank<r>.pt``. ``--device cpu`` is a dry run of the same code on a
machine without a GPU (no sync debug mode there: every record is empty).

Run:  torchrun --standalone --nproc-per-node 4 cuda_layer.py --out-dir DIR [--device cpu]
"""

import argparse
import contextlib
import datetime
import os
import sys
import traceback
import warnings

import torch

SCENARIOS = {
    "single": dict(microbatches=1, recompute=False, grouped=False, planner="host"),
    "pipelined": dict(microbatches=3, recompute=False, grouped=False, planner="host"),
    "recompute": dict(microbatches=2, recompute=True, grouped=False, planner="host"),
    "grouped": dict(microbatches=2, recompute=False, grouped=True, planner="host"),
    # --moe-balancer-planner device: the plan made on the GPU, crossing once.
    "device-planner": dict(microbatches=3, recompute=False, grouped=False, planner="device"),
    "device-planner-recompute": dict(
        microbatches=2, recompute=True, grouped=False, planner="device"
    ),
    # The negative control: the balanced layer with a deliberate ``.tolist()`` of the routing in its
    # dispatcher's forward (a sync the check must catch); no reference runs.
    "single-tolist": dict(
        microbatches=1, recompute=False, grouped=False, fault="tolist", planner="host"
    ),
}
_ON_CUDA = torch.cuda.is_available()
#: The sync watch: "off", "warn" (record every synchronization) or "error" (refuse all but the
#: measured layer's designated wait, ``allowed``); how deep inside a designated wait; how many
#: designated calls ran; what was recorded.
_watch = {"mode": "off", "allowed": None, "depth": 0, "designated": 0, "records": None}


def _where(stack) -> str:
    """The innermost frame of ``stack`` in megatron-core, UltraEP or a test helper (not this worker
    nor torch or the standard library): ``path:line (function)``."""
    for frame in reversed(stack):
        path = frame.filename.replace(os.sep, "/")
        if "cuda_layer.py" in path or "cuda_staging.py" in path:
            continue
        for root in ("ultraep_megatron/", "megatron/core/", "tests/megatron/"):
            if root in path:
                return f"{path[path.index(root) :]}:{frame.lineno} ({frame.name})"
    innermost = stack[-1] if stack else None
    return (
        f"elsewhere: {innermost.filename}:{innermost.lineno} ({innermost.name})"
        if innermost
        else "?"
    )


def _designated(kind: str, function):
    """Layer kind ``kind``'s designated wait: allowed in the ``error`` pass of that kind's layer
    (megatron's layer may not use the balancer's, nor the balanced layer megatron's), counted."""
    from cuda_staging import device_waits_allowed

    def designated(*args, **kwargs):
        if _watch["mode"] != "error" or _watch["allowed"] != kind:
            return function(*args, **kwargs)
        _watch["designated"] += 1
        _watch["depth"] += 1  # the event and device synchronizations inside are allowed too
        try:
            with device_waits_allowed():
                return function(*args, **kwargs)
        finally:
            _watch["depth"] -= 1

    return designated


def _watched(what: str, synchronize):
    """An event or device synchronization, which CUDA's sync debug mode does not report (torch
    2.11; a stream synchronization it does): recorded or refused like those it reports."""

    def watched(*args, **kwargs):
        if _watch["mode"] == "warn":
            _watch["records"].append(_where(traceback.extract_stack()[:-1]))
        elif _watch["mode"] == "error" and _watch["depth"] == 0:
            raise RuntimeError(f"called a synchronizing CUDA operation ({what})")
        return synchronize(*args, **kwargs)

    return watched


def install_watch() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from ultraep_megatron.megatron.balanced_layer.invocation import PlanHandle

    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _designated(
        "megatron", MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize
    )
    PlanHandle.wait = _designated("ultraep", PlanHandle.wait)
    if _ON_CUDA:
        torch.cuda.Event.synchronize = _watched("event synchronize", torch.cuda.Event.synchronize)
        torch.cuda.synchronize = _watched("device synchronize", torch.cuda.synchronize)


@contextlib.contextmanager
def watching_syncs(mode: str, records: list, kind: str):
    """``warn``: every synchronization's place appended to ``records``; ``error``: every one but the
    designated wait of layer kind ``kind`` raises. (Without CUDA: nothing to watch.)"""
    _watch.update(
        mode=mode if _ON_CUDA else "off", allowed=kind, depth=0, designated=0, records=records
    )
    if not _ON_CUDA:
        try:
            yield
        finally:
            _watch["mode"] = "off"
        return
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            records.append(_where(traceback.extract_stack()[:-1]))
        else:
            shown(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
            _watch["mode"] = "off"


def microbatches(weights, rank, count: int, device, permute_tokens: bool) -> list[tuple]:
    """(tokens [SEQ, BATCH, H], upstream gradient, order back) per microbatch, on ``device``:
    uploaded before any measurement (a blocking upload synchronizes)."""
    from balanced_moe_layer import permuted, rank_inputs, skew, token_order

    batches = []
    for mb in range(count):
        x, up = rank_inputs(rank, mb)
        order = token_order(mb, permute_tokens)
        batches.append(
            (
                permuted(skew(x, weights), order).to(device).requires_grad_(True),
                permuted(up, order).to(device),
                order.argsort(),
            )
        )
    return batches


def make_layer(world: int, balancer, sc: dict, device):
    """Scenario ``sc``'s layer (megatron's, or balanced by ``balancer``) on ``device``: made on the
    GPU as megatron makes it, on the host for a dry run."""
    from balanced_moe_layer import build_layer

    return build_layer(
        world,
        balancer,
        1,
        sc["recompute"],
        grouped=sc["grouped"],
        use_cpu_initialization=device.type == "cpu",
        planner=sc["planner"] if balancer else None,
    ).to(device)


def run(layer, batches) -> list:
    """Every microbatch's forward, then their backwards in forward order (a 1F1B stage's order);
    the outputs, on the device."""
    layer.zero_grad(set_to_none=True)
    layer.train()
    outs = [layer(x)[0] for x, _, _ in batches]
    for out, (_, up, _) in zip(outs, batches):
        (out * up).sum().backward()
    return outs


def collected(layer, batches, outs) -> dict:
    """The results, on the host (after the measurement: these copies synchronize)."""
    from balanced_moe_layer import permuted
    from megatron_setup import expert_linears

    return {
        "out": [permuted(o.detach().cpu(), back) for o, (_, _, back) in zip(outs, batches)],
        "dx": [permuted(x.grad.detach().cpu(), back) for x, _, back in batches],
        "router_grad": layer.router.weight.grad.detach().cpu(),
        "expert_grads": {
            int(idx): tuple(w.grad.detach().cpu() for w in expert_linears(layer, local))
            for local, idx in enumerate(layer.local_expert_indices)
        },
    }


def measure(build, weights, rank, sc, device, permute_tokens=False) -> dict:
    import cuda_staging
    from balanced_moe_layer import load_weights

    result = {}
    for mode in ("warn", "error"):
        layer = build()
        load_weights(layer, weights)
        kind = "megatron" if getattr(layer, "balancing", None) is None else "ultraep"
        batches = microbatches(weights, rank, sc["microbatches"], device, permute_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
        records: list = []
        outs, error = None, None
        staged = dict(cuda_staging.staged_calls)
        try:
            with watching_syncs(mode, records, kind):
                outs = run(layer, batches)
        except RuntimeError as failure:
            if "synchronizing CUDA operation" not in str(failure):
                raise  # not a refused synchronization: fail the rank (its peers fail with it)
            error = f"{failure}\n{traceback.format_exc()[-3000:]}"
        balancing = getattr(layer, "balancing", None)
        stats = balancing.pop_stats() if balancing is not None else {}
        result[mode] = {
            "syncs": records,
            "error": error,
            "designated_calls": _watch["designated"] if mode == "error" else None,
            "replicas": sum(v["replicas"] for v in stats.values()),
            "staged": {
                k: v - staged.get(k, 0)
                for k, v in cuda_staging.staged_calls.items()
                if v != staged.get(k, 0)
            },
        }
        if mode == "error":
            result["outputs"] = collected(layer, batches, outs) if error is None else None
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    cli = parser.parse_args()
    if cli.device == "cuda" and not _ON_CUDA:
        raise SystemExit("cuda_layer.py: no CUDA device (use --device cpu for a dry run)")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    if cli.device == "cpu":
        from ultraep_megatron.megatron.cpu import backend as cpu_backend

        cpu_backend.activate()
    else:
        torch.cuda.set_device(0)  # every rank on the one GPU
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # A rank stuck in a staged operation fails in a minute rather than gloo's default half hour.
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    import cuda_staging

    cuda_staging.install()
    install_watch()
    from balanced_moe_layer import global_weights, load_weights
    from megatron.core import parallel_state

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device(cli.device)
    weights = global_weights()
    results = {
        "device": torch.cuda.get_device_name(0) if cli.device == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    for name, sc in SCENARIOS.items():
        # Outside the watch, once per scenario and layer kind: what a first forward and backward
        # set up (CUDA's RNG, cuBLAS handles, the pinned host pool) is not the per-layer path.
        for balancer in (None, "ultraep"):
            layer = make_layer(world, balancer, sc, device)
            load_weights(layer, weights)
            run(layer, microbatches(weights, rank, sc["microbatches"], device, False))
            if balancer is not None:
                layer.balancing.pop_stats()
        runs = (
            ("none", None, False),
            ("none_permuted", None, True),
            ("balanced", "ultraep", False),
        )
        for key, balancer, permute in runs[2:] if "fault" in sc else runs:

            def build(balancer=balancer):
                layer = make_layer(world, balancer, sc, device)
                if sc.get("fault") == "tolist":
                    begin = layer._begin

                    def plan_reading_the_routing(routing_map, _begin=begin):
                        routing_map.tolist()
                        return _begin(routing_map)

                    layer._begin = plan_reading_the_routing
                return layer

            results[f"{name}/{key}"] = measure(build, weights, rank, sc, device, permute)
            if rank == 0:
                r = results[f"{name}/{key}"]
                print(
                    f"[cuda_layer] {name}/{key}: syncs {len(r['warn']['syncs'])} "
                    f"(designated calls {r['error']['designated_calls']}), refused: "
                    f"{'none' if r['error']['error'] is None else r['error']['error'].splitlines()[0]}",
                    flush=True,
                )
    results["staged_calls"] = dict(cuda_staging.staged_calls)
    torch.save(results, os.path.join(cli.out_dir, f"rank{rank}.pt"))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
