"""Benchmark: what balancing adds to one MoE layer's critical path on a GPU, for one rank of an
R-rank expert-parallel group, from the router's output to the permuted tokens.

Every path starts from the same routing (``[T, E]`` top-k of a Zipf-skewed router, and its ``[T, k]``
top-k indices) and ends with the tokens in the all-to-all's send order, on the device:

  megatron        megatron-core's own: the per-expert counts, their copy to the host and the wait
                  for it (its dispatcher's one synchronization), its unfused argsort permutation;
  ultraep host    the balanced dispatcher with ``--moe-balancer-planner host``: the ``[R, E]`` load
                  (this rank's row counted from the routing, the other ranks' rows standing in for
                  the all-gather, which both paths make), its one copy to the host and wait
                  (``_copy_to_host``), the plan on the host (trigger, solve, this rank's dispatch
                  metadata: ``BalancingContext.plan_on_host``'s work), the reroute table's upload and the
                  permutation from the plan over the routed pairs (``_permutation``);
  ultraep device  with ``--moe-balancer-planner device``: the load stays on the device, the plan and
                  the reroute table are made there (``device_planning``), the permutation is queued,
                  then the plan's host half crosses in one copy and wait and the host metadata is
                  derived from it (``BalancingContext.complete_device_plan``'s work);
  ultraep device graphed   the same, the plan replayed from a CUDA graph captured once on a static
                  load (what runs when ``moe_preprocess`` is captured: the plan's many small
                  kernels cost one launch).

Each iteration ends with a device synchronization, so a path's time includes its kernels; the
difference is the latency balancing adds where the GPU waits for the host (the UltraEP paper keeps
its balancing overhead on the critical path at 300 us or less per layer). Times are wall clock,
medians over the timed iterations.

``--sweep-experts 64,128,256,512`` adds the permutation's own time (``_permutation`` over the
``T x k`` routed pairs, and megatron's argsort permutation of the ``[T, E]`` map for scale) against
E at the same T and k: the pairs' cost does not grow with E.

``--overlapped`` times the same paths as megatron's overlapped 1F1B schedule
(``--overlap-moe-expert-parallel-comm``) runs them: the layer's pre-dispatch node (megatron: the
counts and their copy to the host started, the permutation; ultraep host planner: the load and its
copy started, the pairs sorted by logical expert; device planner: the plan, the reroute table and
the permutation on the device, its host half's copy started), then the other microbatch's experts
backward queued (``--moe-ffn-hidden-size`` experts over the ``T x k`` rows: the input-gradient and
weight-gradient GEMMs), then the dispatch node (the one host wait; ultraep: the plan or its host
half, the rows moved to their instances). The backward runs on the device while the host waits,
so what balancing adds is what its wait and host work exceed that backward by, per layer.

    python tools/bench_critical_path.py                      # on a machine with a GPU
    python tools/bench_critical_path.py --device cpu         # a dry run of the same code on the CPU
    python tools/bench_critical_path.py --device cpu --sweep-experts 64,128,256,512
    python tools/bench_critical_path.py --overlapped         # as the overlapped schedule runs it
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--ep-size", type=int, default=64, help="R")
    p.add_argument("--num-experts", type=int, default=256, help="E")
    p.add_argument("--num-slots", type=int, default=2, help="S, redundant slots per rank")
    p.add_argument("--tokens", type=int, default=4096, help="T, tokens of this rank's microbatch")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=7168)
    p.add_argument(
        "--zipf", type=float, default=1.0, help="Zipf exponent of the experts' popularity"
    )
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument(
        "--sweep-experts",
        type=str,
        default=None,
        metavar="E1,E2,...",
        help="also time the permutation alone for these expert counts (same T, top-k)",
    )
    p.add_argument(
        "--overlapped",
        action="store_true",
        help="also time the paths as megatron's overlapped 1F1B schedule runs them "
        "(--overlap-moe-expert-parallel-comm): the other microbatch's experts backward "
        "queued between the pre-dispatch and the dispatch node",
    )
    p.add_argument(
        "--moe-ffn-hidden-size",
        type=int,
        default=2048,
        help="the experts' FFN width, for --overlapped's experts backward",
    )
    return p.parse_args()


def routing(cfg, device, generator, num_experts=None):
    """Top-k of logits skewed towards Zipf-popular experts: (routing_map [T, E] bool, probs [T, E],
    topk_ids [T, k]). The experts' popularity order is ``zipf_topk_load``'s (seed 0), which makes
    the other ranks' rows."""
    E = num_experts or cfg.num_experts
    order = torch.randperm(E, generator=torch.Generator().manual_seed(0))
    popularity = torch.empty(E)
    popularity[order] = 1.0 / torch.arange(1, E + 1, dtype=torch.float64).pow(cfg.zipf).float()
    gumbel = -torch.log(-torch.log(torch.rand(cfg.tokens, E, generator=generator)))
    logits = (popularity.log() + gumbel).to(device)
    top = logits.topk(cfg.topk, dim=-1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top.indices, True)
    probs = torch.zeros_like(logits).scatter_(1, top.indices, torch.softmax(top.values, dim=-1))
    return routing_map, probs, top.indices


def sort_key(num_experts: int) -> torch.dtype:
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


def copy_to_host(tensor, stream=None):
    """The plan's crossing as the balanced layer makes it (``invocation.PlanHandle``): ``tensor``
    copied to pinned host memory behind an event, waited for."""
    from ultraep_megatron.megatron.balanced_layer.invocation import PlanHandle

    return PlanHandle(tensor, lambda host: host, stream).wait()


def rank_plan(plan, load, rank, balanced=True):
    """The host's part of a plan on ``rank`` (what ``invocation.wait`` makes of it)."""
    from ultraep_megatron.megatron.balanced_layer.invocation import host_plan

    return host_plan(
        plan,
        load,
        rank,
        balanced=balanced,
        plan_seconds=0.0,
        schedule_builder=None,
        with_table=True,
    )


def timed(fn, cfg, sync) -> float:
    """Median wall time of ``fn`` in microseconds, each call ending in a device synchronization."""
    times = []
    for i in range(cfg.warmup + cfg.iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= cfg.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def interleaved_times(paths, cfg, sync) -> dict:
    """Seconds of each of ``paths`` (name -> callable), the paths taking turns in every iteration
    (so drift hits all alike), ``cfg.warmup`` rounds dropped: name -> ``cfg.iters`` times."""
    times = {name: [] for name in paths}
    for i in range(cfg.warmup + cfg.iters):
        for name, path in paths.items():
            sync()
            t0 = time.perf_counter()
            path()
            sync()
            if i >= cfg.warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def sweep_experts(cfg, device, sync):
    """The permutation alone against E at fixed T and top-k: the balanced dispatcher's over the
    routed pairs (from a host plan of a Zipf load) and megatron's argsort of the [T, E] map."""
    from megatron.core.transformer.moe.moe_utils import permute

    from ultraep_megatron.megatron.balanced_layer import dispatchers
    from ultraep_megatron.planner import BalancerConfig
    from ultraep_megatron.planner.baselines import registry
    from ultraep_megatron.traces.synthetic import zipf_topk_load

    R, S, T, k = cfg.ep_size, cfg.num_slots, cfg.tokens, cfg.topk
    print(
        f"Permutation alone, T={T}, top-{k} (T x k = {T * k} routed pairs), one rank of EP={R}, S={S}, "
        f"hidden {cfg.hidden_size} bf16 (token gather included), on {device_name(cfg)}; medians of "
        f"{cfg.iters} iterations"
    )
    print("  E     ultraep pairs   megatron argsort")
    for E in [int(e) for e in cfg.sweep_experts.split(",")]:
        generator = torch.Generator().manual_seed(0)
        routing_map, probs, topk_ids = routing(cfg, device, generator, num_experts=E)
        tokens = torch.randn(T, cfg.hidden_size, generator=generator).to(
            device=device, dtype=torch.bfloat16
        )
        load = zipf_topk_load(R, E, tokens_per_rank=T, top_k=k, exponent=cfg.zipf, seed=0)
        load[0] = routing_map.sum(dim=0).cpu()
        balancer = BalancerConfig(name=registry.ULTRAEP, num_slots=S).build()
        plan = balancer.plan(load)
        table = rank_plan(plan, load, 0).reroute_table.to(device)

        def ours():
            return dispatchers.permute_pairs(tokens, probs, topk_ids, table, sort_key(E))[0]

        def theirs():
            return permute(tokens, routing_map, probs=probs, num_out_tokens=T * k)[0]

        print(f"  {E:<5} {timed(ours, cfg, sync):10.1f} us   {timed(theirs, cfg, sync):10.1f} us")


def graphed_device_planner(cfg, device, others, routing_map, config, rank):
    """The device planner's plan (trigger, solve, reroute table, host half) captured once into a
    CUDA graph on a static load: ``(static load, graph, its planned outputs)``, or why it could not
    be captured (a message). In a captured ``moe_preprocess`` the plan replays this way: its
    hundreds of small kernels cost one launch."""
    from ultraep_megatron.megatron.balanced_layer import device_planning

    static_load = others.clone()
    static_load[rank] = routing_map.sum(dim=0)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (Triton compiles, allocator pools)
            for _ in range(3):
                device_planning.plan_on_device(static_load, config, rank)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            planned = device_planning.plan_on_device(static_load, config, rank)
        return static_load, graph, planned
    except Exception as error:  # noqa: BLE001  (reported in the table, the other paths still run)
        return f"capture failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"


def experts_backward(cfg, device, generator):
    """The other microbatch's experts backward on this rank, as the overlapped schedule queues it
    between a layer's pre-dispatch and dispatch nodes: the ``T x k`` rows this rank receives on
    average, through gated experts of width ``--moe-ffn-hidden-size`` (fc1 [2F, H], fc2 [H, F]):
    the input-gradient and weight-gradient GEMMs of both, bf16. Returns a function queueing them."""
    rows, H, F = cfg.tokens * cfg.topk, cfg.hidden_size, cfg.moe_ffn_hidden_size

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=torch.bfloat16)

    x, act, fc1, fc2, dy = rand(rows, H), rand(rows, F), rand(2 * F, H), rand(H, F), rand(rows, H)

    def queue():
        d_act = dy @ fc2  # fc2 input gradient
        d_fc2 = dy.t() @ act  # fc2 weight gradient
        d_h = torch.cat([d_act, d_act], dim=1)
        d_x = d_h @ fc1  # fc1 input gradient
        d_fc1 = d_h.t() @ x  # fc1 weight gradient
        return d_x, d_fc1, d_fc2

    return queue


def overlapped(cfg, device, sync, paths_inputs):
    """The paths as megatron's overlapped schedule runs them (module docstring, ``--overlapped``):
    pre-dispatch node, the other microbatch's experts backward queued, dispatch node."""
    (dispatchers, device_planning, permute, balancer, config, others, routing_map, probs) = (
        paths_inputs[:8]
    )
    topk_ids, tokens, rank = paths_inputs[8:]
    from ultraep_megatron.planner import reroute

    R, E, S, T, k = cfg.ep_size, cfg.num_experts, cfg.num_slots, cfg.tokens, cfg.topk
    backward = experts_backward(cfg, device, torch.Generator().manual_seed(1))
    side = torch.cuda.Stream() if cfg.device == "cuda" else None
    key = sort_key(E)

    def load_on_device():
        load = others.clone()
        load[rank] = routing_map.sum(dim=0)
        return load

    def megatron_path():
        from ultraep_megatron.megatron.balanced_layer.invocation import PlanHandle

        counts = PlanHandle(routing_map.sum(dim=0), lambda host: host, side)  # its dtoh point
        permuted = permute(tokens, routing_map, probs=probs, num_out_tokens=int(T * k))[0]
        backward()  # the other microbatch
        counts.wait()  # its sync point
        return permuted

    def host_planner_path():
        from ultraep_megatron.megatron.balanced_layer.invocation import PlanHandle

        crossing = PlanHandle(load_on_device(), lambda host: host, side)  # pre-dispatch node
        order = reroute.expert_major_order(topk_ids, key)
        logical = tokens.index_select(0, torch.div(order, k, rounding_mode="floor"))
        logical_probs = probs.gather(1, topk_ids).reshape(-1).index_select(0, order)
        backward()  # the other microbatch
        host_load = crossing.wait()  # dispatch node
        balanced = balancer.balances(host_load)
        plan = balancer.plan(host_load, balances=balanced)
        table = rank_plan(plan, host_load, rank, balanced).reroute_table.to(device)
        stand_in = types.SimpleNamespace(
            invocation=types.SimpleNamespace(topk_ids=topk_ids, reroute_table=table),
            expert_major=order,
        )
        planned = dispatchers.BalancedAlltoAllDispatcher.planned_inputs
        return planned(stand_in, logical, logical_probs)[0]

    def device_planner_path():
        planned = device_planning.plan_on_device(load_on_device(), config, rank)
        permuted = dispatchers.permute_pairs(tokens, probs, topk_ids, planned.reroute_table, key)[0]
        from ultraep_megatron.megatron.balanced_layer.invocation import PlanHandle

        crossing = PlanHandle(planned.host_half, lambda host: host, side)
        backward()  # the other microbatch
        host_half = crossing.wait()  # dispatch node
        host_load, plan, balanced = device_planning.unpack_host_half(host_half, R, E, S)
        rank_plan(plan, host_load, rank, balanced)
        return permuted

    def backward_alone():
        backward()

    paths = {
        "experts backward alone": backward_alone,
        "megatron": megatron_path,
        "ultraep host": host_planner_path,
        "ultraep device": device_planner_path,
    }
    times = interleaved_times(paths, cfg, sync)
    us = {name: statistics.median(v) * 1e6 for name, v in times.items()}
    print(
        f"Overlapped 1F1B schedule (--overlap-moe-expert-parallel-comm): a layer's pre-dispatch node, the other "
        f"microbatch's experts backward ({T * k} rows, hidden {cfg.hidden_size}, expert FFN {cfg.moe_ffn_hidden_size}, "
        f"bf16), the dispatch node; medians of {cfg.iters} iterations"
    )
    print(f"  experts backward alone: {us['experts backward alone']:8.1f} us")
    for name in ("megatron", "ultraep host", "ultraep device"):
        print(f"  {name} step: {us[name]:8.1f} us")
    print(
        f"  added by balancing per layer under the overlapped schedule: host planner "
        f"{us['ultraep host'] - us['megatron']:8.1f} us, device planner {us['ultraep device'] - us['megatron']:8.1f} us"
    )


def device_name(cfg) -> str:
    return torch.cuda.get_device_name(0) if cfg.device == "cuda" else "CPU (dry run)"


def main():
    cfg = parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)  # megatron's notes on missing TE / Apex
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "bench_critical_path.py: no CUDA device (--device cpu runs the same code on the CPU)"
        )
    if cfg.device == "cpu":
        from ultraep_megatron.megatron.cpu import backend as cpu_backend

        cpu_backend.activate()
    from megatron.core.transformer.moe.moe_utils import permute

    from ultraep_megatron.megatron.balanced_layer import device_planning, dispatchers
    from ultraep_megatron.planner import BalancerConfig
    from ultraep_megatron.planner.baselines import registry
    from ultraep_megatron.traces.synthetic import zipf_topk_load

    device = torch.device(cfg.device)
    sync = torch.cuda.synchronize if cfg.device == "cuda" else (lambda: None)
    R, E, S, T, k = cfg.ep_size, cfg.num_experts, cfg.num_slots, cfg.tokens, cfg.topk
    rank = 0
    generator = torch.Generator().manual_seed(0)
    routing_map, probs, topk_ids = routing(cfg, device, generator)
    tokens = torch.randn(T, cfg.hidden_size, generator=generator).to(
        device=device, dtype=torch.bfloat16
    )
    others = zipf_topk_load(R, E, tokens_per_rank=T, top_k=k, exponent=cfg.zipf, seed=0).to(
        device
    )  # the other ranks' rows
    config = BalancerConfig(name=registry.ULTRAEP, num_slots=S)
    balancer = config.build()
    balancer.warm_up()
    key = sort_key(E)
    last = {}  # the last host plan

    def megatron_path():
        counts = routing_map.sum(dim=0)
        host = counts.to("cpu", non_blocking=True)  # megatron's dtoh point, then its sync point
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return permute(tokens, routing_map, probs=probs, num_out_tokens=int(T * k))[0], host

    host_stretch = {"host": [], "device": []}

    def host_planner_path():
        load = others.clone()
        load[rank] = routing_map.sum(dim=0)
        host_load = copy_to_host(load)
        h0 = time.perf_counter()
        balanced = balancer.balances(host_load)
        plan = balancer.plan(host_load, balances=balanced)
        last["plan"] = rank_plan(plan, host_load, rank, balanced)
        host_stretch["host"].append(time.perf_counter() - h0)
        table = last["plan"].reroute_table.to(device, non_blocking=True)
        return dispatchers.permute_pairs(tokens, probs, topk_ids, table, key)[0]

    def permute_then_cross(planned, stretch: str):
        """A device plan's rest: the permutation from its reroute table, then its host half across
        (the one wait) and the host metadata derived from it."""
        permuted = dispatchers.permute_pairs(tokens, probs, topk_ids, planned.reroute_table, key)[0]
        host_half = copy_to_host(planned.host_half)
        h0 = time.perf_counter()
        host_load, plan, balanced = device_planning.unpack_host_half(host_half, R, E, S)
        last["plan"] = rank_plan(plan, host_load, rank, balanced)
        host_stretch[stretch].append(time.perf_counter() - h0)
        return permuted

    def device_planner_path():
        load = others.clone()
        load[rank] = routing_map.sum(dim=0)
        planned = device_planning.plan_on_device(load, config, rank)
        return permute_then_cross(planned, "device")

    paths = {
        "megatron": megatron_path,
        "ultraep host": host_planner_path,
        "ultraep device": device_planner_path,
    }
    graphed = (
        graphed_device_planner(cfg, device, others, routing_map, config, rank)
        if cfg.device == "cuda"
        else None
    )
    if isinstance(graphed, tuple):
        static_load, graph, planned_in_graph = graphed
        host_stretch["graphed"] = []

        def graphed_device_planner_path():
            static_load.copy_(others)
            static_load[rank] = routing_map.sum(dim=0)
            graph.replay()
            return permute_then_cross(planned_in_graph, "graphed")

        paths["ultraep device graphed"] = graphed_device_planner_path
    times = interleaved_times(paths, cfg, sync)
    plan = last["plan"].plan
    replicas = int((plan.slot_expert >= 0).sum())
    median_us = {key: statistics.median(v) * 1e6 for key, v in times.items()}
    stretch_us = {key: statistics.median(v[cfg.warmup :]) * 1e6 for key, v in host_stretch.items()}
    print(
        f"Critical path of one MoE layer's routing -> permuted tokens, one rank of EP={R}, E={E}, "
        f"S={S}, T={T}, top-{k}, hidden {cfg.hidden_size} bf16, on {device_name(cfg)}; medians of {cfg.iters} "
        f"iterations (torch {torch.__version__})"
    )
    print(f"  megatron (counts to host, wait, argsort permute): {median_us['megatron']:8.1f} us")
    print(
        f"  ultraep host planner (load to host, wait, plan, permute from the plan): "
        f"{median_us['ultraep host']:8.1f} us"
    )
    print(
        f"  ultraep device planner (plan on the device, permute, plan to host, wait): "
        f"{median_us['ultraep device']:8.1f} us"
    )
    if "ultraep device graphed" in median_us:
        print(
            f"  ultraep device planner, plan replayed from a CUDA graph (what a captured moe_preprocess "
            f"runs): {median_us['ultraep device graphed']:8.1f} us; added by balancing "
            f"{median_us['ultraep device graphed'] - median_us['megatron']:8.1f} us"
        )
    elif graphed is not None:
        print(f"  ultraep device planner in a CUDA graph: {graphed}")
    print(
        f"  added by balancing: host planner {median_us['ultraep host'] - median_us['megatron']:8.1f} us, "
        f"of which the host plan (trigger + solve + rank reroute) {stretch_us['host']:.1f} us; "
        f"device planner {median_us['ultraep device'] - median_us['megatron']:8.1f} us, of which the host "
        f"metadata after the wait {stretch_us['device']:.1f} us; {replicas} replicas in the last plan"
    )
    if cfg.overlapped:
        overlapped(
            cfg,
            device,
            sync,
            (
                dispatchers,
                device_planning,
                permute,
                balancer,
                config,
                others,
                routing_map,
                probs,
                topk_ids,
                tokens,
                rank,
            ),
        )
    if cfg.sweep_experts:
        sweep_experts(cfg, device, sync)


if __name__ == "__main__":
    main()
