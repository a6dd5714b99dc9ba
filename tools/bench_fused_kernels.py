"""Times and launch counts of the fused control-path ops, and their check against the host path.

    python tools/bench_fused_kernels.py                        # CUDA if present, else this CPU
    python tools/bench_fused_kernels.py --device cuda --check  # + bit-for-bit vs the host planner
    python tools/bench_fused_kernels.py --ranks 64 --experts 256 --json out.json

Per EP size R and expert count E (S slots, one rank's view, the other ranks' loads synthetic):
``plan_invocation`` (on CUDA the fused Triton kernel, one launch; on the CPU the host planner's
path, the compiled solve and packing) and ``reroute_permute`` of T tokens' top-k pairs with H
hidden (CUDA: two launches forward) and its backward. Times are medians of ``--iters`` calls
(CUDA events on CUDA, wall clock on the CPU); launches are the kernels ``torch.profiler`` sees on
CUDA, the dispatched ops on the CPU. ``--check`` compares the device's record, table and reroute
with the host path's and exits 1 on a difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ultraep_megatron.planner import BalancerConfig  # noqa: E402
from ultraep_megatron.planner.baselines.registry import ULTRAEP  # noqa: E402
from ultraep_megatron.planner.fused_plan import host_plan, plan_invocation  # noqa: E402
from ultraep_megatron.planner.fused_reroute import host_reroute, reroute_permute  # noqa: E402
from ultraep_megatron.traces.synthetic import zipf_load  # noqa: E402


def routing(T: int, E: int, k: int, seed: int) -> torch.Tensor:
    """[T, k] distinct experts per token, Zipf-skewed (exponent 1.2) over the experts."""
    generator = torch.Generator().manual_seed(seed)
    skew = torch.arange(1, E + 1, dtype=torch.float64).pow(-1.2)[
        torch.randperm(E, generator=generator)
    ]
    keys = torch.rand(T, E, generator=generator, dtype=torch.float64).log() / skew  # Gumbel-top-k
    return keys.topk(k, dim=1).indices


def timed(fn, device: torch.device, iters: int) -> float:
    """Median microseconds of ``fn()``."""
    fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e6)
    return statistics.median(samples)


def launches(fn, device: torch.device) -> int:
    """Kernels launched by ``fn()`` (CUDA, from the profiler) or ops dispatched (CPU)."""
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.ops


def bench(R, E, S, T, k, H, device, iters, check):
    rank = 1 % R
    ids = routing(T, E, k, seed=R + E)
    load = zipf_load(R, E, 1.5, seed=R) * max(1, T * k // max(1, E))
    load[rank] = torch.bincount(ids.reshape(-1), minlength=E)
    config = BalancerConfig(ULTRAEP, num_slots=S)
    dload = load.to(device)
    fused = plan_invocation(dload, config, rank)
    row = {"R": R, "E": E, "S": S, "T": T, "k": k, "H": H, "device": device.type}
    row["plan_us"] = timed(lambda: plan_invocation(dload, config, rank), device, iters)
    row["plan_launches"] = launches(lambda: plan_invocation(dload, config, rank), device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = torch.randn(T, H, dtype=dtype, device=device, requires_grad=True)
    probs = torch.rand(T, k, device=device, requires_grad=True)
    dids = ids.to(device)

    def forward():
        return reroute_permute(dids, hidden, probs, fused.table, num_experts=E)

    out = forward()
    grad = torch.ones_like(out.permuted)
    row["reroute_us"] = timed(forward, device, iters)
    row["reroute_launches"] = launches(lambda: forward(), device)
    row["backward_us"] = timed(
        lambda: torch.autograd.grad(forward().permuted, hidden, grad), device, iters
    )
    if check:
        record, table = host_plan(load, config, rank)
        same = torch.equal(fused.record.cpu(), torch.from_numpy(record))
        same &= torch.equal(fused.table.cpu(), torch.from_numpy(table))
        expected = host_reroute(
            ids, hidden.detach().cpu(), probs.detach().cpu(), fused.table.cpu(), E
        )
        got = (out.permuted, out.permuted_probs, out.send_token, out.pair_slot, out.pair_row)
        same &= all(torch.equal(a.detach().cpu(), b) for a, b in zip(got, expected))
        row["matches_host"] = bool(same)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ranks", default="8,16,32,64")
    parser.add_argument("--experts", default="256,512")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for R in (int(x) for x in args.ranks.split(",")):
        for E in (int(x) for x in args.experts.split(",")):
            row = bench(R, E, args.slots, args.tokens, args.topk, args.hidden, device, args.iters,
                        args.check)  # fmt: skip
            rows.append(row)
            match = {True: " match", False: " MISMATCH"}.get(row.get("matches_host"), "")
            print(
                f"fused R={R} E={E} S={args.slots} T={args.tokens} k={args.topk} on {device.type}: "
                f"plan {row['plan_us']:.1f} us ({row['plan_launches']} launches), reroute "
                f"{row['reroute_us']:.1f} us ({row['reroute_launches']} launches), backward "
                f"{row['backward_us']:.1f} us{match}"
            )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
    return 1 if any(r.get("matches_host") is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
