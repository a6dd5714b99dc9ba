"""Benchmark: what balancing adds to one MoE layer's critical path on a GPU, for one rank of an
R-rank expert-parallel group, from the router's output to the permuted tokens.

Both paths start from the same routing (``[T, E]`` top-k of a Zipf-skewed router) and end with the
tokens in the all-to-all's send order, on the device:

  megatron   megatron-core's own: the per-expert counts, their copy to the host and the wait for
             it (its dispatcher's one synchronization), its unfused argsort permutation;
  ultraep    the balanced dispatcher's: the ``[R, E]`` load (this rank's row counted from the
             routing, the other ranks' rows standing in for the all-gather, which both paths
             make), its one copy to the host and wait (``_copy_to_host``), the plan on the host
             (trigger, solve, this rank's dispatch metadata: ``BalancingContext.plan``'s work), the
             reroute table's upload and the permutation from the plan (``_permutation``).

Each iteration ends with a device synchronization, so a path's time includes its kernels; the
difference is the latency balancing adds where the GPU waits for the host (the UltraEP paper keeps
its balancing overhead on the critical path at 300 us or less per layer). Times are wall clock,
medians over the timed iterations.

    python tools/bench_critical_path.py                      # on a machine with a GPU
    python tools/bench_critical_path.py --device cpu         # a dry run of the same code on the CPU
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
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the experts' popularity")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    return p.parse_args()


def routing(cfg, device, generator):
    """Top-k of logits skewed towards Zipf-popular experts: (routing_map [T, E] bool, probs [T, E]).
    The experts' popularity order is ``zipf_topk_load``'s (seed 0), which makes the other ranks' rows."""
    order = torch.randperm(cfg.num_experts, generator=torch.Generator().manual_seed(0))
    popularity = torch.empty(cfg.num_experts)
    popularity[order] = 1.0 / torch.arange(1, cfg.num_experts + 1, dtype=torch.float64).pow(cfg.zipf).float()
    gumbel = -torch.log(-torch.log(torch.rand(cfg.tokens, cfg.num_experts, generator=generator)))
    logits = (popularity.log() + gumbel).to(device)
    top = logits.topk(cfg.topk, dim=-1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top.indices, True)
    probs = torch.zeros_like(logits).scatter_(1, top.indices, torch.softmax(top.values, dim=-1))
    return routing_map, probs


def main():
    cfg = parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)  # megatron's notes on missing TE / Apex
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_critical_path.py: no CUDA device (--device cpu runs the same code on the CPU)")
    if cfg.device == "cpu":
        from ultraep_megatron.megatron.cpu import backend as cpu_backend

        cpu_backend.activate()
    from megatron.core.transformer.moe.moe_utils import permute

    from ultraep_megatron.megatron import dispatchers
    from ultraep_megatron.megatron.context import Overheads
    from ultraep_megatron.megatron.invocation import plan_invocation
    from ultraep_megatron.planner.baselines import registry
    from ultraep_megatron.planner import BalancerConfig
    from ultraep_megatron.traces.synthetic import zipf_topk_load

    device = torch.device(cfg.device)
    R, E, S, T, k = cfg.ep_size, cfg.num_experts, cfg.num_slots, cfg.tokens, cfg.topk
    rank = 0
    generator = torch.Generator().manual_seed(0)
    routing_map, probs = routing(cfg, device, generator)
    tokens = torch.randn(T, cfg.hidden_size, generator=generator).to(device=device, dtype=torch.bfloat16)
    others = zipf_topk_load(R, E, tokens_per_rank=T, top_k=k, exponent=cfg.zipf, seed=0).to(device)  # the other ranks' rows
    balancer = BalancerConfig(name=registry.ULTRAEP, num_slots=S).build()
    balancer.warm_up()
    # The balanced dispatcher's permutation, on a stand-in for its state (no process group here).
    dispatcher = types.SimpleNamespace(
        num_logical_experts=E, num_out_tokens=T * k, invocation=None, _check_plan=lambda routing_map: None,
        _layer=types.SimpleNamespace(balancing=types.SimpleNamespace(overheads=Overheads())))
    dispatcher._instances = dispatchers._PhysicalSlotRouting._instances.__get__(dispatcher)
    permutation = dispatchers.BalancedAlltoAllDispatcher._permutation.__get__(dispatcher)
    sync = torch.cuda.synchronize if cfg.device == "cuda" else (lambda: None)

    def megatron_path():
        counts = routing_map.sum(dim=0)
        host = counts.to("cpu", non_blocking=True)  # megatron's dtoh point, then its sync point
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return permute(tokens, routing_map, probs=probs, num_out_tokens=int(T * k))[0], host

    host_stretch = []

    def ultraep_path():
        load = others.clone()
        load[rank] = routing_map.sum(dim=0)
        host_load = dispatchers._copy_to_host(load)
        h0 = time.perf_counter()
        balanced = balancer.balances(host_load)
        plan = balancer.plan(host_load, balances=balanced)
        dispatcher.invocation = plan_invocation(plan, host_load, rank, layer_number=1, vid=None,
                                                schedule_builder=None, balanced=balanced, plan_seconds=0.0)
        host_stretch.append(time.perf_counter() - h0)
        sorted_tokens, _ = permutation(routing_map, probs)
        return tokens.index_select(0, sorted_tokens)

    balanced_label = registry.ULTRAEP
    times = {"megatron": [], balanced_label: []}
    for i in range(cfg.warmup + cfg.iters):
        for name, path in (("megatron", megatron_path), (balanced_label, ultraep_path)):
            sync()
            t0 = time.perf_counter()
            path()
            sync()
            if i >= cfg.warmup:
                times[name].append(time.perf_counter() - t0)
    plan = dispatcher.invocation.plan
    replicas = int((plan.slot_expert >= 0).sum())
    name = torch.cuda.get_device_name(0) if cfg.device == "cuda" else "CPU (dry run)"
    median_us = {key: statistics.median(v) * 1e6 for key, v in times.items()}
    print(f"Critical path of one MoE layer's routing -> permuted tokens, one rank of EP={R}, E={E}, "
          f"S={S}, T={T}, top-{k}, hidden {cfg.hidden_size} bf16, on {name}; medians of {cfg.iters} "
          f"iterations (torch {torch.__version__})")
    print(f"  megatron (counts to host, wait, argsort permute): {median_us['megatron']:8.1f} us")
    print(f"  ultraep  (load to host, wait, plan, permute from the plan): {median_us[balanced_label]:8.1f} us")
    print(f"  added by balancing: {median_us[balanced_label] - median_us['megatron']:8.1f} us, of which the "
          f"host plan (trigger + solve + dispatch metadata) {statistics.median(host_stretch[cfg.warmup:]) * 1e6:.1f} us; "
          f"{replicas} replicas in the last plan")


if __name__ == "__main__":
    main()
