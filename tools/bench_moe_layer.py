"""Benchmark: one megatron-core MoE layer on CPU ranks over gloo, skewed routing.

Measures forward+backward throughput (tokens/s over the EP group) of, in one run:
  none           megatron-core's MoELayer with the skewed router (the straggler case),
  ultraep        the same layer balanced by UltraEP (BalancedMoELayer),
  eplb-exact     EPLB's replication rule on the exact load, through the same dispatcher,
  force-balanced megatron-core's MoELayer with --moe-router-force-load-balancing (the ideal),
and UltraEP's overhead breakdown (plan, weight distribution + re-materialization + gradient
reduction, reroute), per iteration.

    bash tools/ensure_env.sh >/dev/null && ~/.cache/ultraep-megatron/venv/bin/python tools/bench_moe_layer.py

Skew: megatron-core's --moe-router-force-biased (a fixed random per-expert logit bias shared by all
ranks; negative std = the same bias every step). One thread per rank; on this 2-core machine use
EP=2. Figures are only comparable within one run.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep-size", type=int, default=2)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--ffn-hidden-size", type=int, default=512)
    p.add_argument("--tokens-per-rank", type=int, default=2048)
    p.add_argument("--num-slots", type=int, default=1)
    p.add_argument("--router-bias-std", type=float, default=-2.0,
                   help="--moe-router-force-biased std (negative: fixed bias per layer)")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args()


def build(cfg, balancer: str | None, force_balanced: bool):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ultraep_megatron.megatron.balanced_moe import BalancedMoELayer
    from ultraep_megatron.megatron.runtime import reset_runtime
    from ultraep_megatron.planner.policy import BalancerConfig

    reset_runtime()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=cfg.ep_size)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=1, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        moe_ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=4,
        num_moe_experts=cfg.num_experts, moe_router_topk=cfg.topk,
        moe_token_dispatcher_type="alltoall", expert_model_parallel_size=cfg.ep_size,
        moe_aux_loss_coeff=0.0, add_bias_linear=False, use_cpu_initialization=True,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        moe_router_force_load_balancing=force_balanced,
        moe_router_force_biased=None if force_balanced else cfg.router_bias_std,
    )
    builder = get_moe_module_spec(use_te=False, num_experts=cfg.num_experts, moe_grouped_gemm=False)
    if balancer is not None:
        builder = functools.partial(
            BalancedMoELayer, submodules=builder.keywords["submodules"],
            balancer_config=BalancerConfig(name=balancer, num_slots=cfg.num_slots))
    layer = builder(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                    is_mtp_layer=False)
    layer.set_layer_number(1)
    return layer


def measure(cfg, layer) -> tuple[float, float, float, float]:
    """Per forward+backward, medians over the timed iterations:

    (wall seconds of the group (max over ranks), busiest rank's CPU seconds, mean rank CPU seconds,
    max/mean rows received by the ranks' experts).

    CPU seconds are the main thread's (``time.thread_time``): compute only, not time spent waiting
    in gloo or descheduled, so their max over ranks is the critical path a rank with a dedicated
    device would see even when this VM's cores are shared with other work.
    """
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg.tokens_per_rank, 1, cfg.hidden_size, generator=gen)
    rows = []
    compute = layer.routed_experts_compute

    def counting(h, p):
        rows.append(h.shape[0])
        return compute(h, p)

    layer.routed_experts_compute = counting
    times, cpu_max, cpu_mean = [], [], []
    world = torch.distributed.get_world_size()
    for i in range(cfg.warmup + cfg.iters):
        xi = x.clone().requires_grad_(True)
        torch.distributed.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        out, _ = layer(xi)
        out.sum().backward()
        cpu = time.thread_time() - c0
        t = torch.tensor([time.perf_counter() - t0])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        cpus = [torch.zeros(1) for _ in range(world)]
        torch.distributed.all_gather(cpus, torch.tensor([cpu]))
        if i >= cfg.warmup:
            times.append(float(t))
            cpu_max.append(float(torch.cat(cpus).max()))
            cpu_mean.append(float(torch.cat(cpus).mean()))
        if i == cfg.warmup - 1:  # overhead counters cover the timed iterations only
            from ultraep_megatron.megatron.runtime import get_runtime

            rt = get_runtime()
            rt.plan_seconds = rt.transfer_seconds = rt.reroute_seconds = 0.0
    received = torch.tensor([float(rows[-1])])
    gathered = [torch.zeros(1) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, received)
    loads = torch.cat(gathered)
    median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return median(times), median(cpu_max), median(cpu_mean), float(loads.max() / loads.mean())


def worker(cfg):
    from ultraep_megatron.megatron import cpu_backend

    cpu_backend.activate()
    torch.distributed.init_process_group("gloo")
    from ultraep_megatron.megatron.runtime import get_runtime
    from ultraep_megatron.planner import policy

    rank = torch.distributed.get_rank()
    tokens = cfg.tokens_per_rank * cfg.ep_size
    rows = []
    for name, balancer, force in ((policy.NONE, None, False), (policy.ULTRAEP, policy.ULTRAEP, False),
                                  (policy.EPLB_EXACT, policy.EPLB_EXACT, False), ("force-balanced", None, True)):
        layer = build(cfg, balancer, force)
        seconds, cpu_max, cpu_mean, imbalance = measure(cfg, layer)
        overhead = ""
        if balancer is not None:
            rt = get_runtime()
            n = cfg.iters
            overhead = (f"plan {rt.plan_seconds / n * 1e3:.2f} ms, transfers {rt.transfer_seconds / n * 1e3:.2f} ms, "
                        f"reroute {rt.reroute_seconds / n * 1e3:.2f} ms")
        rows.append((name, seconds, tokens / seconds, cpu_max, cpu_mean, imbalance, overhead))
    if rank == 0:
        ideal, ideal_cpu = rows[-1][2], rows[-1][3]
        print(f"\nMoE layer fwd+bwd, EP={cfg.ep_size} (gloo, 1 thread/rank), E={cfg.num_experts}, top-{cfg.topk}, "
              f"hidden {cfg.hidden_size}, ffn {cfg.ffn_hidden_size}, {cfg.tokens_per_rank} tokens/rank, "
              f"{cfg.num_slots} slot(s)/rank, router bias std {cfg.router_bias_std}")
        print("wall: slowest rank's wall time; CPU: main-thread compute time of the busiest rank (the "
              "critical path with a device per rank) and its x force-balanced (lower busiest-rank CPU = higher)")
        print(f"| {'balancer':<15} | {'wall ms':>8} | {'tokens/s':>9} | {'wall x f-b':>10} | {'busiest CPU ms':>14} "
              f"| {'mean CPU ms':>11} | {'CPU x f-b':>9} | {'rank imbalance':>14} | balancing overhead per timed iteration")
        print(f"|{'-' * 17}|{'-' * 10}|{'-' * 11}|{'-' * 12}|{'-' * 16}|{'-' * 13}|{'-' * 11}|{'-' * 16}|---")
        for name, seconds, tps, cpu_max, cpu_mean, imbalance, overhead in rows:
            print(f"| {name:<15} | {seconds * 1e3:8.1f} | {tps:9.0f} | {tps / ideal:10.2f} | {cpu_max * 1e3:14.1f} "
                  f"| {cpu_mean * 1e3:11.1f} | {ideal_cpu / cpu_max:9.2f} | {imbalance:14.2f} | {overhead}")
    torch.distributed.destroy_process_group()


def main():
    cfg = parse_args()
    if "RANK" in os.environ:
        return worker(cfg)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1",
               PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.ep_size}",
           __file__, *sys.argv[1:]]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
