"""Run the repository's pretrain_gpt.py on N gloo CPU ranks and read its per-iteration metrics.

A tiny fp32 MoE GPT (2 layers, hidden 64, 8 experts, top-2, seq 32) that trains an iteration in
well under a second per rank; tests pass parallel sizes, checkpoint and dropout flags on top.

Usage::

    records = run_pretrain(tmp_path / "ep2", nproc=2, args=tiny_moe_args(ep=2, train_iters=4))
    losses = [r["losses"]["lm loss"] for r in records]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from gloo_launch import REPO_ROOT, launch_gloo_ranks

from ultraep_megatron.megatron.cpu_backend import REQUIRED_ARGS


def tiny_moe_args(*, ep: int, train_iters: int, dropout: float = 0.0, seed: int = 1234) -> list[str]:
    """pretrain_gpt.py arguments for the tiny MoE GPT at expert-parallel size ``ep``."""
    return [
        *REQUIRED_ARGS,
        "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
        "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", str(ep),
        # megatron-core 0.19.2 at EP=1, TP=1 adds the expert bias in place into the output of an
        # identity all-reduce, which autograd forbids; MoE models run without linear biases anyway.
        "--disable-bias-linear",
        "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", str(train_iters), "--lr", "1e-3", "--lr-decay-style", "constant",
        "--seed", str(seed),
        "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout),
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
    ]


def read_metrics(path: str | Path) -> list[dict]:
    """The ``--metrics-jsonl`` records, one dict per training iteration."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_pretrain(run_dir: str | Path, nproc: int, args: Sequence[str], *,
                 timeout_s: float = 600.0) -> list[dict]:
    """Run pretrain_gpt.py on ``nproc`` ranks with ``args``; return its per-iteration records.

    The console output is kept in ``run_dir/log``.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    launch_gloo_ranks(REPO_ROOT / "pretrain_gpt.py", nproc,
                      [*args, "--metrics-jsonl", str(metrics)],
                      timeout_s=timeout_s, log_path=run_dir / "log")
    return read_metrics(metrics)


#: Iterations of the runs that start from the resume test's checkpoint (conftest.finetune_runs).
FINETUNE_ITERS = 4

RESUME_TRAIN_ITERS, RESUME_SAVE_AT = 4, 2
RESUME_NPROC, RESUME_EP = 2, 2
# Every data-parallel rank draws its own dropout masks, and its RNG state is saved and restored
# per rank.
RESUME_ARGS = ["--data-parallel-random-init", "--ckpt-format", "torch_dist"]


def metrics_by_iteration(records):
    """{iteration: (lm loss, grad norm)} of --metrics-jsonl records."""
    return {r["iteration"]: (r["losses"]["lm loss"], r["grad_norm"]) for r in records}


def uninterrupted_and_resumed(root, optimizer_args):
    """Train RESUME_TRAIN_ITERS iterations saving at RESUME_SAVE_AT, then resume from there.

    Returns:
        (arguments of both runs, uninterrupted metrics, resumed metrics) by iteration.
    """
    base = [*tiny_moe_args(ep=RESUME_EP, train_iters=RESUME_TRAIN_ITERS, dropout=0.1),
            *RESUME_ARGS, *optimizer_args]
    uninterrupted = run_pretrain(root / "uninterrupted", RESUME_NPROC, [
        *base, "--save", str(root / "ckpt"), "--save-interval", str(RESUME_SAVE_AT)])
    resumed = run_pretrain(root / "resumed", RESUME_NPROC, [
        *base, "--load", str(root / "ckpt"), "--ckpt-step", str(RESUME_SAVE_AT)])
    return base, metrics_by_iteration(uninterrupted), metrics_by_iteration(resumed)
