"""The DDP-layout table: --moe-balancer ultraep against none with megatron's DDP options, per row.

    python tools/ddp_layout_table.py              # fp32 and bf16, 2000-element and default buckets
    python tools/ddp_layout_table.py --dtypes fp32 --buckets 2000 --iters 4    # one corner, shorter

The tiny MoE GPT of the test suite (2 layers, 8 experts, top-2) on 4 gloo CPU ranks at EP 2, so
expert-data-parallel 2 (the two EP groups plan different loads), global batch 16 of micro-batches
2, no gradient clipping, trained ``--iters`` iterations from one initial checkpoint. For each dtype
and bucket size, three rows of DDP flags: the distributed optimizer alone, with
``--overlap-grad-reduce``, and with ``--overlap-param-gather`` too. Each row prints the largest
relative lm-loss difference of ``ultraep`` against ``none`` over the iterations and its ratio to
the noise floor: the largest difference between ``none`` at EP 2 and at EP 4 (the same mathematics
summed in another order), measured in the same run. The suite's equivalence tests tolerate 10x the
floor (tests/megatron/equivalence.py).

The runs use the suite's launch helpers (tests/megatron: torchrun over gloo, the initial
checkpoint); each prints progress on stderr. About 20 s per run on 2 cores; the default set is 30 runs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "megatron")]

from megatron_runs import run_pretrain, save_initial_checkpoint, tiny_moe_args  # noqa: E402

from ultraep_megatron.planner.baselines.registry import NONE, ULTRAEP  # noqa: E402

ROWS = {
    "distributed optimizer only": ["--use-distributed-optimizer"],
    "+ --overlap-grad-reduce": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
    "+ --overlap-grad-reduce --overlap-param-gather": [
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    ],
}
WORLD = 4


def max_relative_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument(
        "--buckets",
        default="2000,default",
        help="comma-separated --ddp-bucket-size values; "
        "'default' for megatron's (40M elements: the tiny model is one bucket)",
    )
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument(
        "--work-dir", default=None, help="where the runs go (default: a temporary directory)"
    )
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ddp_layout_table_"))
    started = time.monotonic()

    def run(name, ep, extra):
        print(f"[{time.monotonic() - started:6.0f} s] {name}", file=sys.stderr, flush=True)
        records = run_pretrain(
            work / name,
            WORLD,
            [
                *tiny_moe_args(ep=ep, train_iters=args.iters),
                "--global-batch-size",
                "16",
                "--clip-grad",
                "0.0",
                *extra,
            ],
        )
        return [r["losses"]["lm loss"] for r in records]

    print(
        "| dtype | bucket | DDP flags | max rel. lm-loss difference ultraep vs none | noise floor (none EP2 vs EP4) | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for dtype in args.dtypes.split(","):
        dtype_flags = ["--bf16"] if dtype == "bf16" else []
        print(
            f"[{time.monotonic() - started:6.0f} s] {dtype}: initial checkpoint",
            file=sys.stderr,
            flush=True,
        )
        save_initial_checkpoint(
            work / f"{dtype}_initial", [*tiny_moe_args(ep=1, train_iters=1), *dtype_flags]
        )
        load = [
            "--load",
            str(work / f"{dtype}_initial" / "ckpt"),
            "--finetune",
            "--ckpt-format",
            "torch_dist",
        ]
        for bucket in args.buckets.split(","):
            bucket_flags = [] if bucket == "default" else ["--ddp-bucket-size", bucket]
            base = [*dtype_flags, *bucket_flags, *load]
            differences, none = {}, None
            for row, (label, flags) in enumerate(ROWS.items()):
                none = run(
                    f"{dtype}_{bucket}_{row}_none", 2, [*base, *flags, "--moe-balancer", NONE]
                )
                ultraep = run(
                    f"{dtype}_{bucket}_{row}_ultraep", 2, [*base, *flags, "--moe-balancer", ULTRAEP]
                )
                differences[label] = max_relative_difference(ultraep, none)
            # The floor pair: the last row's none at EP 2 (above) and at EP 4.
            floor = max(
                2.0**-24,
                max_relative_difference(
                    run(f"{dtype}_{bucket}_floor_ep4", 4, [*base, *flags, "--moe-balancer", NONE]),
                    none,
                ),
            )
            for label, difference in differences.items():
                print(
                    f"| {dtype} | {bucket} | {label} | {difference:.3g} | {floor:.3g} | {difference / floor:.2f} |",
                    flush=True,
                )
    print(f"({time.monotonic() - started:.0f} s, runs in {work})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
