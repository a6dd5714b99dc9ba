"""Benchmark: what balancing adds to one MoE layer's critical path on a GPU, for one rank of an
R-rank expert-parallel group, from the router's output to the permuted tokens.

Every path starts from the same routing (``[T, E]`` top-k of a Zipf-skewed router, and its ``[T, k]``
top-k indices) and ends with the tokens in the all-to-all's send order, on the device:

  megatron        megatron-core's own: the per-expert counts, their copy to the host and the wait
                  for it (its dispatcher's one synchronization), its unfused argsort permutation;
  ultraep host    the balanced dispatcher with ``--moe-balancer-planner host``: the ``[R, E]`` load
                  (this rank's row counted from the routing, the other ranks' rows standing in for
                  the all-gather, which both paths make), its one copy to the host and wait
                  (``invocation.PlanHandle``), the plan on the host (``planner.fused_plan.host_plan``:
                  trigger, solve, this rank's record and int32 reroute table, into a pinned buffer),
                  the table's upload and the permutation (``planner.fused_reroute.reroute_permute``,
                  one op);
  ultraep device  with ``--moe-balancer-planner device``: the load stays on the device, the plan is
                  one op there (``planner.fused_plan.plan_invocation``: its record and table; one
                  Triton launch on CUDA), the record's copy to the host starts, the permutation
                  from the table is queued (``reroute_permute``), then the one wait and the record
                  read (``planner.record_layout.unpack_record``), as ``BalancingContext.start_plan``
                  and its handle's ``wait`` do;
  ultraep device graphed   the same, the plan replayed from a CUDA graph captured once on a static
                  load (what runs when ``moe_preprocess`` is captured).

Each iteration ends with a device synchronization, so a path's time includes its kernels; the
difference is the latency balancing adds where the GPU waits for the host (the UltraEP paper keeps
its balancing overhead on the critical path at 300 us or less per layer). Times are wall clock,
medians over the timed iterations.

``--profile`` adds each path's per-phase breakdown from ``torch.profiler``: every phase is a
``torch.profiler.record_function`` range (load gather, plan, crossing, table upload, reroute +
permute; megatron's argsort permute), and the table gives per iteration its CPU issue time (the
range's host wall time: launches, host work, the wait) and its device time (the kernels and copies
queued inside it). The reroute and the permutation are one op (``reroute_permute``), so one phase.

``--sweep-experts 64,128,256,512`` adds the permutation's own time (``reroute_permute`` over the
``T x k`` routed pairs, and megatron's argsort permutation of the ``[T, E]`` map for scale) against
E at the same T and k: the pairs' cost does not grow with E.

``--overlapped`` times the same paths as megatron's overlapped 1F1B schedule
(``--overlap-moe-expert-parallel-comm``) runs them: the layer's pre-dispatch node (megatron: the
counts and their copy to the host started, the permutation; ultraep host planner: the load and its
copy started, the pairs sorted by logical expert; device planner: the plan, its record's copy
started, the permutation from its table), then the other microbatch's experts backward queued
(``--moe-ffn-hidden-size`` experts over the ``T x k`` rows: the input-gradient and weight-gradient
GEMMs), then the dispatch node (the one host wait; ultraep host planner: the plan, the table's
upload, the rows moved to their instances; device planner: the record read). The backward runs on
the device while the host waits, so what balancing adds is what its wait and host work exceed
that backward by, per layer.

    python tools/bench_critical_path.py                      # on a machine with a GPU
    python tools/bench_critical_path.py --device cpu         # a dry run of the same code on the CPU
    python tools/bench_critical_path.py --device cpu --sweep-experts 64,128,256,512
    python tools/bench_critical_path.py --overlapped         # as the overlapped schedule runs it
    python tools/bench_critical_path.py --profile            # + the per-phase table
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import types
import warnings
from pathlib import Path

import numpy as np
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
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print each path's per-phase breakdown from torch.profiler (CPU issue time and "
        "device time of load gather, plan, crossing, table upload, reroute + permute, permute)",
    )
    p.add_argument(
        "--profile-iters", type=int, default=20, help="profiled iterations per path, for --profile"
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


PHASES = ("load gather", "plan", "crossing", "table upload", "reroute + permute", "permute")


PROFILING = {"on": False}  # phase() opens its ranges only while phase_table profiles


def phase(name: str):
    """A ``torch.profiler.record_function`` range of one phase (``--profile``'s table) while
    ``phase_table`` profiles; else nothing (a range is a dispatcher call: the timed paths would
    pay it, the ultraep ones more often than megatron's)."""
    return torch.profiler.record_function(name) if PROFILING["on"] else contextlib.nullcontext()


def crossing(tensor, finish=None, stream=None, pool=None):
    """The plan's crossing as the balanced layer makes it (``invocation.PlanHandle``): ``tensor``
    copied into a pinned buffer of ``pool`` on ``stream`` behind an event (started); ``.wait()``
    gives ``finish`` of the host copy (the copy itself without ``finish``)."""
    from ultraep_megatron.megatron.balanced_layer.invocation import PinnedPool, PlanHandle

    handle = PlanHandle(tensor, finish or (lambda host: host))
    return handle.start(stream, pool if pool is not None else PinnedPool())


class HostPlanner:
    """The host planner's work after its load crossed (``--moe-balancer-planner host``): the
    record and this rank's reroute table (``planner.fused_plan.host_plan``: trigger, solve,
    packing) into a pinned table buffer, then its upload (``invocation.upload``)."""

    def __init__(self, cfg, config, rank, device):
        from ultraep_megatron.planner.record_layout import table_columns

        R, E, S = cfg.ep_size, cfg.num_experts, cfg.num_slots
        self.config, self.rank, self.device = config, rank, device
        self.table = torch.empty(
            (4, table_columns(R, E, S)), dtype=torch.int32, pin_memory=device.type == "cuda"
        )
        self.record = None
        self.seconds = []  # host time of each plan

    def plan(self, host_load):
        from ultraep_megatron.planner.fused_plan import host_plan

        h0 = time.perf_counter()
        self.record, _ = host_plan(host_load, self.config, self.rank, table=self.table.numpy())
        self.seconds.append(time.perf_counter() - h0)
        return self.record

    def upload(self):
        from ultraep_megatron.megatron.balanced_layer.invocation import upload

        return upload(self.table, self.device)


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
    routed pairs (``reroute_permute`` with the table of a host plan of a Zipf load) and megatron's
    argsort of the [T, E] map."""
    from megatron.core.transformer.moe.moe_utils import permute

    from ultraep_megatron.planner import BalancerConfig
    from ultraep_megatron.planner.baselines import registry
    from ultraep_megatron.planner.fused_plan import host_plan
    from ultraep_megatron.planner.fused_reroute import reroute_permute
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
        _, table = host_plan(load, BalancerConfig(name=registry.ULTRAEP, num_slots=S), 0)
        table = torch.from_numpy(table).to(device)
        pair_probs = probs.gather(1, topk_ids)

        def ours():
            return reroute_permute(topk_ids, tokens, pair_probs, table, num_experts=E).permuted

        def theirs():
            return permute(tokens, routing_map, probs=probs, num_out_tokens=T * k)[0]

        print(f"  {E:<5} {timed(ours, cfg, sync):10.1f} us   {timed(theirs, cfg, sync):10.1f} us")


def graphed_device_planner(cfg, device, others, routing_map, config, rank):
    """The device planner's plan (``plan_invocation``: one op, one Triton launch on CUDA) captured
    once into a CUDA graph on a static load: ``(static load, graph, its FusedPlan)``, or why it
    could not be captured (a message). In a captured ``moe_preprocess`` the plan replays this way
    and a fresh handle takes its record after each replay (``unpack_graphed_plan``)."""
    from ultraep_megatron.planner.fused_plan import plan_invocation

    static_load = others.clone()
    static_load[rank] = routing_map.sum(dim=0)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (Triton compiles, allocator pools)
            for _ in range(3):
                plan_invocation(static_load, config, rank)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            planned = plan_invocation(static_load, config, rank)
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


def overlapped(cfg, device, sync, bench):
    """The paths as megatron's overlapped schedule runs them (module docstring, ``--overlapped``):
    pre-dispatch node, the other microbatch's experts backward queued, dispatch node."""
    from megatron.core.transformer.moe.moe_utils import permute

    from ultraep_megatron.megatron.balanced_layer import dispatchers
    from ultraep_megatron.planner import reroute
    from ultraep_megatron.planner.fused_plan import plan_invocation
    from ultraep_megatron.planner.fused_reroute import reroute_permute
    from ultraep_megatron.planner.record_layout import unpack_record

    R, E, S, T, k = cfg.ep_size, cfg.num_experts, cfg.num_slots, cfg.tokens, cfg.topk
    b = bench
    backward = experts_backward(cfg, device, torch.Generator().manual_seed(1))
    key = sort_key(E)

    def megatron_path():
        counts = crossing(b.routing_map.sum(dim=0), stream=b.side, pool=b.pool)  # its dtoh point
        permuted = permute(b.tokens, b.routing_map, probs=b.probs, num_out_tokens=int(T * k))[0]
        backward()  # the other microbatch
        counts.wait()  # its sync point
        return permuted

    def host_planner_path():
        handle = crossing(b.load_on_device(), stream=b.side, pool=b.pool)  # pre-dispatch node
        order = reroute.expert_major_order(b.topk_ids, key)
        logical = b.tokens.index_select(0, torch.div(order, k, rounding_mode="floor"))
        logical_probs = b.pair_probs.reshape(-1).index_select(0, order)
        backward()  # the other microbatch
        b.host.plan(handle.wait())  # dispatch node
        stand_in = types.SimpleNamespace(
            invocation=types.SimpleNamespace(topk_ids=b.topk_ids, reroute_table=b.host.upload()),
            expert_major=order,
        )
        planned = dispatchers.BalancedAlltoAllDispatcher.planned_inputs
        return planned(stand_in, logical, logical_probs)[0]

    def device_planner_path():
        fused = plan_invocation(b.load_on_device(), b.config, b.rank)
        handle = crossing(
            fused.record, lambda host: unpack_record(host.numpy(), R, E, S), b.side, b.pool
        )
        permuted = reroute_permute(
            b.topk_ids, b.tokens, b.pair_probs, fused.table, num_experts=E
        ).permuted
        backward()  # the other microbatch
        handle.wait()  # dispatch node: the record read
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


def phase_table(paths, cfg, sync) -> dict:
    """``--profile``: each path run ``cfg.profile_iters`` times under ``torch.profiler`` (CPU, and
    CUDA where it runs), its phases' ``record_function`` ranges summed: path -> phase -> (CPU issue
    us, device us) per iteration. CPU issue time is the range's wall time on the host (launches,
    host work, waits); device time is the kernels and copies launched inside the range (the
    profiler's device time of the range, or of its GPU-side annotation where that is larger)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if cfg.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    table = {}
    for name, path in paths.items():
        PROFILING["on"] = True
        for _ in range(3):  # warm (allocator, first-call caches) outside the profile
            path()
            sync()
        with profile(activities=activities) as prof:
            for _ in range(cfg.profile_iters):
                path()
                sync()
        PROFILING["on"] = False
        cpu_us, device_us, annotated_us = {}, {}, {}
        for event in prof.events():
            if event.name not in PHASES:
                continue
            if event.device_type == torch.autograd.DeviceType.CPU:
                cpu_us[event.name] = cpu_us.get(event.name, 0.0) + event.cpu_time_total
                device = getattr(event, "device_time_total", None)
                if device is None:
                    device = getattr(event, "cuda_time_total", 0.0)
                device_us[event.name] = device_us.get(event.name, 0.0) + device
            else:  # the range's GPU-side annotation (kineto's gpu_user_annotation)
                annotated_us[event.name] = annotated_us.get(event.name, 0.0) + (
                    event.time_range.elapsed_us()
                )
        n = cfg.profile_iters
        table[name] = {
            ph: (
                cpu_us[ph] / n,
                max(device_us.get(ph, 0.0), annotated_us.get(ph, 0.0)) / n,
            )
            for ph in PHASES
            if ph in cpu_us
        }
    return table


def print_phase_table(table, cfg) -> None:
    print(
        f"Per-phase breakdown (torch.profiler record_function ranges, {cfg.profile_iters} profiled "
        f"iterations per path; us per iteration, CPU issue / device)"
    )
    header = "| path | " + " | ".join(PHASES) + " | total |"
    print(header)
    print("|" + "---|" * (len(PHASES) + 2))
    for name, phases in table.items():
        cells = []
        for ph in PHASES:
            cells.append(f"{phases[ph][0]:.1f} / {phases[ph][1]:.1f}" if ph in phases else "-")
        cpu = sum(v[0] for v in phases.values())
        dev = sum(v[1] for v in phases.values())
        print(f"| {name} | " + " | ".join(cells) + f" | {cpu:.1f} / {dev:.1f} |")
    for name, phases in table.items():  # the same, one line a path (gpu_check.sh's figure)
        parts = ", ".join(f"{ph} {cpu:.1f}/{dev:.1f}" for ph, (cpu, dev) in phases.items())
        print(f"  phases of {name} (CPU issue/device us): {parts}")


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

    from ultraep_megatron.megatron.balanced_layer.invocation import PinnedPool
    from ultraep_megatron.planner import BalancerConfig
    from ultraep_megatron.planner.baselines import registry
    from ultraep_megatron.planner.fused_plan import plan_invocation
    from ultraep_megatron.planner.fused_reroute import reroute_permute
    from ultraep_megatron.planner.record_layout import unpack_record
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
    config.build().warm_up()  # the host planner's compiled kernels, loaded before timing
    side = torch.cuda.Stream() if cfg.device == "cuda" else None

    def load_on_device():
        """The [R, E] load: this rank's row counted from the routing, the other ranks' rows
        standing in for the all-gather both paths make."""
        load = others.clone()
        load[rank] = routing_map.sum(dim=0)
        return load

    bench = types.SimpleNamespace(
        routing_map=routing_map,
        probs=probs,
        pair_probs=probs.gather(1, topk_ids),
        topk_ids=topk_ids,
        tokens=tokens,
        rank=rank,
        config=config,
        side=side,
        pool=PinnedPool(),
        host=HostPlanner(cfg, config, rank, device),
        load_on_device=load_on_device,
    )
    last = {}  # the last plan record (host or device planner)

    def unpack(host):
        return unpack_record(host.numpy(), R, E, S)

    def megatron_path():
        with phase("load gather"):
            counts = routing_map.sum(dim=0)
        with phase("crossing"):  # megatron's dtoh point, then its sync point
            crossing(counts, stream=side, pool=bench.pool).wait()
        with phase("permute"):
            return permute(tokens, routing_map, probs=probs, num_out_tokens=int(T * k))[0]

    def host_planner_path():
        with phase("load gather"):
            load = load_on_device()
        with phase("crossing"):
            host_load = crossing(load, stream=side, pool=bench.pool).wait()
        with phase("plan"):
            last["record"] = bench.host.plan(host_load)
        with phase("table upload"):
            table = bench.host.upload()
        with phase("reroute + permute"):
            return reroute_permute(
                topk_ids, tokens, bench.pair_probs, table, num_experts=E
            ).permuted

    device_host_seconds = {"device": [], "graphed": []}

    def permute_then_cross(fused, handle, stretch: str):
        """A device plan's rest: the permutation from its reroute table (on the device), then its
        record's crossing waited for and read (``unpack_record``)."""
        with phase("reroute + permute"):
            permuted = reroute_permute(
                topk_ids, tokens, bench.pair_probs, fused.table, num_experts=E
            ).permuted
        with phase("crossing"):
            last["record"] = handle.wait()
        device_host_seconds[stretch].append(handle.host_seconds)
        return permuted

    def device_planner_path():
        with phase("load gather"):
            load = load_on_device()
        with phase("plan"):
            fused = plan_invocation(load, config, rank)
        with phase("crossing"):  # started as the layer starts it: right after the plan
            handle = crossing(fused.record, unpack, side, bench.pool)
        return permute_then_cross(fused, handle, "device")

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

        def graphed_device_planner_path():
            with phase("load gather"):
                static_load.copy_(others)
                static_load[rank] = routing_map.sum(dim=0)
            with phase("plan"):
                graph.replay()
            with phase("crossing"):
                handle = crossing(planned_in_graph.record, unpack, side, bench.pool)
            return permute_then_cross(planned_in_graph, handle, "graphed")

        paths["ultraep device graphed"] = graphed_device_planner_path
    times = interleaved_times(paths, cfg, sync)
    record = last["record"]
    if isinstance(record, np.ndarray):  # the host planner's record
        record = unpack_record(record, R, E, S)
    slot_expert = record.slot_expert
    replicas = int((slot_expert >= 0).sum())
    median_us = {key: statistics.median(v) * 1e6 for key, v in times.items()}
    host_us = statistics.median(bench.host.seconds[cfg.warmup :] or bench.host.seconds) * 1e6
    device_us = statistics.median(device_host_seconds["device"][cfg.warmup :]) * 1e6
    print(
        f"Critical path of one MoE layer's routing -> permuted tokens, one rank of EP={R}, E={E}, "
        f"S={S}, T={T}, top-{k}, hidden {cfg.hidden_size} bf16, on {device_name(cfg)}; medians of {cfg.iters} "
        f"iterations (torch {torch.__version__})"
    )
    print(f"  megatron (counts to host, wait, argsort permute): {median_us['megatron']:8.1f} us")
    print(
        f"  ultraep host planner (load to host, wait, plan, table upload, reroute_permute): "
        f"{median_us['ultraep host']:8.1f} us"
    )
    print(
        f"  ultraep device planner (plan_invocation, reroute_permute, record to host, wait): "
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
        f"of which the host plan (host_plan: trigger + solve + record and table) {host_us:.1f} us; "
        f"device planner {median_us['ultraep device'] - median_us['megatron']:8.1f} us, of which the "
        f"record read after the wait {device_us:.1f} us; {replicas} replicas in the last plan"
    )
    if cfg.profile:
        print_phase_table(phase_table(paths, cfg, sync), cfg)
    if cfg.overlapped:
        overlapped(cfg, device, sync, bench)
    if cfg.sweep_experts:
        sweep_experts(cfg, device, sync)


if __name__ == "__main__":
    main()
