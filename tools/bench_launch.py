"""Benchmark: what the tests' warm rank launcher saves per multi-rank launch.

The same launch, a typical one of the suite (the tiny MoE GPT of ``tests/megatron/megatron_runs.py``
through ``pretrain_gpt.py`` with ``--moe-balancer ultraep``, a few iterations), alternately cold
(torchrun: every rank a fresh interpreter importing torch and megatron-core) and warm (forked from
the session's launcher, ``tests/rank_launcher.py``), each ``--repeats`` times; prints the median
wall time of each and the difference. The launcher's server starts before the first warm launch
and is not counted (once per test session).

    python tools/bench_launch.py                    # 4 ranks, 2 iterations, 3 repeats
    python tools/bench_launch.py --nproc 8 --ep 4 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "megatron")]

import rank_launcher  # noqa: E402
from megatron_runs import run_pretrain, tiny_moe_args  # noqa: E402

from ultraep_megatron.planner.baselines.registry import ULTRAEP  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks per launch")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size")
    p.add_argument("--iters", type=int, default=2, help="training iterations per launch")
    p.add_argument("--repeats", type=int, default=3, help="launches of each kind (alternating)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launch_args = [*tiny_moe_args(ep=args.ep, train_iters=args.iters), "--moe-balancer", ULTRAEP]
    t0 = time.monotonic()
    if not rank_launcher.available():
        raise SystemExit(
            f"bench_launch.py: the warm launcher did not start: {rank_launcher.unavailable}"
        )
    print(f"launcher server started in {time.monotonic() - t0:.1f} s (once per test session)")
    times = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="bench_launch_") as tmp:
        for i in range(args.repeats):
            for kind in ("cold", "warm"):
                if kind == "cold":
                    os.environ[rank_launcher.COLD_ENV] = "1"
                else:
                    os.environ.pop(rank_launcher.COLD_ENV, None)
                start = time.monotonic()
                records = run_pretrain(Path(tmp) / f"{kind}{i}", args.nproc, launch_args)
                times[kind].append(time.monotonic() - start)
                assert len(records) == args.iters, records
    cold, warm = (statistics.median(times[k]) for k in ("cold", "warm"))
    print(
        f"pretrain_gpt.py, tiny MoE GPT, {args.nproc} ranks, EP {args.ep}, {args.iters} iterations, "
        f"ultraep; medians of {args.repeats} (alternating), {os.cpu_count()} CPU cores:"
    )
    print(f"  cold (torchrun)      {cold:7.1f} s   {' '.join(f'{t:.1f}' for t in times['cold'])}")
    print(f"  warm (forked ranks)  {warm:7.1f} s   {' '.join(f'{t:.1f}' for t in times['warm'])}")
    print(f"  saved per launch     {cold - warm:7.1f} s ({warm / cold:.2f}x the cold time)")
    rank_launcher.stop_server()


if __name__ == "__main__":
    main()
