"""Benchmark the expert data plane: naive per-replica sends vs direct batched vs relay schedules.

Part 1 (8 gloo ranks on this machine, plans from skewed loads): wall time of weight distribution with
  * naive:  one blocking ``send``/``recv`` per replica, replicas in a fixed global order;
  * direct: the batched, chunked schedule without relay (``relay="off"``);
  * relay:  the adaptive relay schedule (``relay="adaptive"``);
and of gradient reduction (direct vs relay). Methods are interleaved within each iteration and the
reported figures are medians of the max-over-ranks time, as ratios within this one run.

Part 2 (pure computation): max per-rank send volume, direct vs relay, on Zipf loads shaped like the
planner benchmark (R in {32, 40, 64}, E in {128, 160, 256}, slots in {1, 2, 4}, top-8, 4096 tokens
per rank).

    OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench_dataplane.py [--expert-numel N] [--iters K]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ultraep_megatron.dataplane import ReplicaBuffer, build_schedule  # noqa: E402
from ultraep_megatron.planner import solve  # noqa: E402
from ultraep_megatron.traces.synthetic import zipf_topk_load  # noqa: E402


def zipf_loads(
    num_ranks: int,
    num_experts: int,
    *,
    exponent: float,
    seed: int,
    tokens_per_rank: int = 4096,
    top_k: int = 8,
) -> torch.Tensor:
    """Per-rank token counts per expert, int64 ``[R, E]`` (``traces.synthetic.zipf_topk_load``)."""
    return zipf_topk_load(
        num_ranks,
        num_experts,
        tokens_per_rank=tokens_per_rank,
        top_k=top_k,
        exponent=exponent,
        seed=seed,
    )


def make_plan(load: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, str]:
    """``slot_expert`` from the UltraEP planner."""
    return solve(load, num_slots).slot_expert, "ultraep_megatron.planner.solve"


def naive_distribute(
    sched, main: list[list[torch.Tensor]], replica: torch.Tensor, rank: int
) -> None:
    """One blocking send/recv per replica, in a fixed global order (what a straightforward loop does)."""
    first_local = rank * sched.experts_per_rank
    for e, src, dst, dst_slot in zip(
        sched.edge_expert.tolist(),
        sched.home_rank(sched.edge_expert).tolist(),
        sched.edge_dst.tolist(),
        sched.edge_dst_slot.tolist(),
    ):
        if rank == src:
            dist.send(torch.cat(main[e - first_local]), dst)
        elif rank == dst:
            dist.recv(replica[dst_slot], src)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _worker(rank: int, world_size: int, port: int, args: dict, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=300),
    )
    numel, num_experts, num_slots = args["expert_numel"], args["num_experts"], args["num_slots"]
    per_rank = num_experts // world_size
    load = zipf_loads(
        world_size, num_experts, exponent=args["exponent"], seed=args["seed"], top_k=args["top_k"]
    )
    slot_expert, source = make_plan(load, num_slots)
    direct = build_schedule(
        slot_expert, num_experts, numel, chunk_numel=args["chunk_numel"], relay="off"
    )
    relay = build_schedule(
        slot_expert,
        num_experts,
        numel,
        chunk_numel=args["chunk_numel"],
        relay="adaptive",
        relay_threshold=args["relay_threshold"],
    )
    gen = torch.Generator().manual_seed(rank)
    # Two tensors per expert, like linear_fc1 / linear_fc2.
    main = [
        [
            torch.randn(numel // 3 * 2, generator=gen),
            torch.randn(numel - numel // 3 * 2, generator=gen),
        ]
        for _ in range(per_rank)
    ]
    buffer = ReplicaBuffer(
        num_slots, [t.shape for t in main[0]], torch.float32
    )  # on its HostCommStream
    main_grads = [[torch.zeros_like(t) for t in m] for m in main]

    def reduce_with(sched):
        buffer.replica_grads.fill_(1.0)
        return lambda: buffer.reduce_gradients(sched, main_grads)

    methods = {
        "naive": lambda: naive_distribute(direct, main, buffer.replica_weights, rank),
        "direct": lambda: buffer.distribute_weights(direct, main),
        "relay": lambda: buffer.distribute_weights(relay, main),
    }
    times = {name: [] for name in [*methods, "grad_direct", "grad_relay"]}
    for it in range(args["warmup"] + args["iters"]):
        for name, fn in methods.items():
            t = _timed(fn)
            if it >= args["warmup"]:
                times[name].append(t)
        for name, sched in (("grad_direct", direct), ("grad_relay", relay)):
            t = _timed(reduce_with(sched))
            if it >= args["warmup"]:
                times[name].append(t)
    if rank == 0:
        result = dict(
            plan_source=source,
            max_fanout=int(max((slot_expert == e).sum() for e in range(num_experts))),
            replicas=int((slot_expert >= 0).sum()),
            relayed_experts=relay.relayed_experts.numel(),
            num_chunks=direct.num_chunks,
            direct_send=direct.send_volume().tolist(),
            relay_send=relay.send_volume().tolist(),
            median_s={k: statistics.median(v) for k, v in times.items()},
        )
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def volume_table(exponent: float) -> list[tuple]:
    """Rows ``(R, E, slots, direct max, relay max, relayed experts)`` in expert units."""
    rows = []
    for num_ranks in (32, 40, 64):
        for num_experts in (128, 160, 256):
            if num_experts % num_ranks:
                continue
            load = zipf_loads(
                num_ranks, num_experts, exponent=exponent, seed=num_ranks * 1000 + num_experts
            )
            for num_slots in (1, 2, 4):
                slot_expert, _ = make_plan(load, num_slots)
                direct = build_schedule(slot_expert, num_experts, 1, relay="off")
                relay = build_schedule(slot_expert, num_experts, 1, relay="adaptive")
                rows.append(
                    (
                        num_ranks,
                        num_experts,
                        num_slots,
                        int(direct.send_volume().max()),
                        int(relay.send_volume().max()),
                        relay.relayed_experts.numel(),
                    )
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--num-slots", type=int, default=2)
    parser.add_argument(
        "--expert-numel", type=int, default=1 << 21, help="elements per expert (fp32)"
    )
    parser.add_argument("--chunk-numel", type=int, default=1 << 18)
    parser.add_argument("--relay-threshold", type=int, default=3)
    parser.add_argument(
        "--exponent", type=float, default=2.0, help="Zipf exponent of expert popularity"
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=1,
        help="experts per token; at 8 ranks top-8 caps any expert at one rank's average load, "
        "so the planner makes no hot fan-out (see docs/dataplane.md)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument(
        "--skip-timing", action="store_true", help="only print the send-volume table"
    )
    parser.add_argument("--skip-volumes", action="store_true", help="only run the timed part")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    if not args.skip_timing:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            out_path = os.path.join(tmp, "result.json")
            mp.spawn(
                _worker, args=(args.world_size, port, vars(args), out_path), nprocs=args.world_size
            )
            with open(out_path) as f:
                r = json.load(f)
        med = r["median_s"]
        mib = args.expert_numel * 4 / 2**20
        load1, _, _ = os.getloadavg()
        print(
            f"== Weight distribution, {args.world_size} gloo ranks on 127.0.0.1 ({os.cpu_count()} CPU cores, "
            f"load average {load1:.1f} after the run) =="
        )
        print(
            f"plan: {r['plan_source']}, E={args.num_experts}, slots={args.num_slots}, Zipf {args.exponent}, top-{args.top_k}: "
            f"{r['replicas']} replicas, max fan-out {r['max_fanout']}, {r['relayed_experts']} relayed expert(s)"
        )
        print(
            f"expert {args.expert_numel} fp32 elements ({mib:.1f} MiB), {r['num_chunks']} chunks of {args.chunk_numel}"
        )
        print(f"{'method':<14}{'median ms':>10}{'vs naive':>10}{'vs direct':>11}")
        for name in ("naive", "direct", "relay"):
            print(
                f"{name:<14}{med[name] * 1e3:>10.1f}{med['naive'] / med[name]:>9.2f}x{med['direct'] / med[name]:>10.2f}x"
            )
        print(f"{'grad direct':<14}{med['grad_direct'] * 1e3:>10.1f}{'':>10}{1.0:>10.2f}x")
        print(
            f"{'grad relay':<14}{med['grad_relay'] * 1e3:>10.1f}{'':>10}{med['grad_direct'] / med['grad_relay']:>10.2f}x"
        )
        dmax, rmax = max(r["direct_send"]), max(r["relay_send"])
        print(
            f"per-rank send volume (experts): direct {[v // args.expert_numel for v in r['direct_send']]}, "
            f"relay {[v // args.expert_numel for v in r['relay_send']]}"
        )
        print(
            f"max per-rank send volume: direct {dmax * 4 / 2**20:.0f} MiB, relay {rmax * 4 / 2**20:.0f} MiB "
            f"({dmax / max(rmax, 1):.2f}x lower with relay)"
        )
        print()

    if args.skip_volumes:
        return
    print(
        "== Max per-rank send volume (experts), planner-benchmark loads: Zipf, top-8, 4096 tokens/rank =="
    )
    for exponent in (0.8, 1.2):
        print(f"Zipf exponent {exponent}")
        print(
            f"{'R':>4}{'E':>5}{'slots':>6}{'direct':>8}{'relay':>7}{'reduction':>11}{'relayed':>9}"
        )
        for num_ranks, num_experts, num_slots, dmax, rmax, relayed in volume_table(exponent):
            print(
                f"{num_ranks:>4}{num_experts:>5}{num_slots:>6}{dmax:>8}{rmax:>7}{dmax / max(rmax, 1):>10.2f}x{relayed:>9}"
            )


if __name__ == "__main__":
    main()
