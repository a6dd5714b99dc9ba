"""Run the repository's pretrain_gpt.py on N gloo CPU ranks and read its per-iteration metrics.

A tiny fp32 MoE GPT (2 layers, hidden 64, 8 experts, top-2, seq 32) that trains an iteration in
well under a second per rank; tests pass parallel sizes, checkpoint and dropout flags on top.
``recipe_moe_args`` adds what the rack-scale recipes use (4 layers, MTP, DeepSeek-V3 routing, ...);
``launch_dump_run`` runs it through workers/pretrain_grad_dump.py (gradients, evaluations, faults).
``argument_verdicts`` runs pretrain_gpt.py's argument checks on many command lines in one process;
``torchrun`` launches a script and returns its status and output, failing or not.

Usage::

    records = run_pretrain(tmp_path / "ep2", nproc=2, args=tiny_moe_args(ep=2, train_iters=4))
    losses = [r["losses"]["lm loss"] for r in records]
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from gloo_launch import REPO_ROOT, WORKERS, gloo_env, launch_gloo_ranks, run_python, run_ranks

from ultraep_megatron.megatron.cpu.flags import CPU_FLAGS, REQUIRED_ARGS


def tiny_moe_args(
    *, ep: int, train_iters: int, dropout: float = 0.0, seed: int = 1234
) -> list[str]:
    """pretrain_gpt.py arguments for the tiny MoE GPT at expert-parallel size ``ep``."""
    return [
        *REQUIRED_ARGS,
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--ffn-hidden-size",
        "128",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--max-position-embeddings",
        "32",
        "--num-experts",
        "8",
        "--moe-router-topk",
        "2",
        "--moe-ffn-hidden-size",
        "64",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--expert-model-parallel-size",
        str(ep),
        # megatron-core 0.19.2 at EP=1, TP=1 adds the expert bias in place into the output of an
        # identity all-reduce, which autograd forbids; MoE models run without linear biases anyway.
        "--disable-bias-linear",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--train-iters",
        str(train_iters),
        "--lr",
        "1e-3",
        "--lr-decay-style",
        "constant",
        "--seed",
        str(seed),
        "--hidden-dropout",
        str(dropout),
        "--attention-dropout",
        str(dropout),
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "256",
        "--log-interval",
        "1",
        "--eval-interval",
        "1000",
        "--eval-iters",
        "0",
    ]


def read_metrics(path: str | Path) -> list[dict]:
    """The ``--metrics-jsonl`` records, one dict per training iteration."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_pretrain(
    run_dir: str | Path, nproc: int, args: Sequence[str], *, timeout_s: float = 600.0
) -> list[dict]:
    """Run pretrain_gpt.py on ``nproc`` ranks with ``args``; return its per-iteration records.

    The console output is kept in ``run_dir/log``.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    launch_gloo_ranks(
        REPO_ROOT / "pretrain_gpt.py",
        nproc,
        [*args, "--metrics-jsonl", str(metrics)],
        timeout_s=timeout_s,
        log_path=run_dir / "log",
    )
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
    base = [
        *tiny_moe_args(ep=RESUME_EP, train_iters=RESUME_TRAIN_ITERS, dropout=0.1),
        *RESUME_ARGS,
        *optimizer_args,
    ]
    uninterrupted = run_pretrain(
        root / "uninterrupted",
        RESUME_NPROC,
        [*base, "--save", str(root / "ckpt"), "--save-interval", str(RESUME_SAVE_AT)],
    )
    resumed = run_pretrain(
        root / "resumed",
        RESUME_NPROC,
        [*base, "--load", str(root / "ckpt"), "--ckpt-step", str(RESUME_SAVE_AT)],
    )
    return base, metrics_by_iteration(uninterrupted), metrics_by_iteration(resumed)


# --- The features of the rack-scale recipes, on the tiny model -----------------------------------

#: What the DeepSeek-V3 / GLM-4.5-Air / RefMoE recipes use, at tiny size: a dense first layer
#: (--moe-layer-freq), a shared expert, DeepSeek-V3 routing (sigmoid scores, an expert bias with
#: its aux-loss-free update, group-limited top-k, top-k scaling, sequence aux loss), one MTP layer
#: (which needs RoPE), per-token loss, and evaluation during training.
RECIPE_FEATURES = [
    "--num-layers",
    "4",
    "--moe-layer-freq",
    "[0,1,1,1]",
    "--moe-shared-expert-intermediate-size",
    "64",
    "--moe-router-score-function",
    "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate",
    "1e-3",
    "--moe-router-num-groups",
    "4",
    "--moe-router-group-topk",
    "2",
    "--moe-router-topk-scaling-factor",
    "2.5",
    "--moe-router-load-balancing-type",
    "seq_aux_loss",
    "--moe-aux-loss-coeff",
    "1e-4",
    "--mtp-num-layers",
    "1",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--calculate-per-token-loss",
    "--global-batch-size",
    "16",
    "--eval-interval",
    "4",
    "--eval-iters",
    "1",
]
#: The expert bias the initial checkpoint starts from: EP rank 0's experts are preferred, so the
#: routing is skewed (rank imbalance about 2.4 at EP=4) the same way in every layout that loads it.
SKEWED_EXPERT_BIAS = "0.06,0.04,0.02,0,0,-0.02,-0.04,-0.06"


def recipe_moe_args(*, ep: int, train_iters: int) -> list[str]:
    """tiny_moe_args with RECIPE_FEATURES (later flags override earlier ones)."""
    return [*tiny_moe_args(ep=ep, train_iters=train_iters), *RECIPE_FEATURES]


@dataclass
class DumpRun:
    """A run of workers/pretrain_grad_dump.py: per-iteration metrics and what the worker dumped
    (its docstring), merged over ranks."""

    run_dir: Path
    records: dict[int, dict]  # --metrics-jsonl records by iteration
    grads: dict[
        int, dict[str, torch.Tensor]
    ]  # lr-0 iterations; a name from the first rank holding it
    expert_bias: dict[int, dict[str, torch.Tensor]]
    evals: list[dict]  # the last rank's evaluation records
    log: str


def launch_dump_run(
    run_dir: Path, nproc: int, args: Sequence[str], env: dict[str, str], timeout_s: float = 600.0
) -> DumpRun:
    """pretrain_gpt.py through workers/pretrain_grad_dump.py on ``nproc`` gloo ranks."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    log = launch_gloo_ranks(
        WORKERS / "pretrain_grad_dump.py",
        nproc,
        [*args, "--metrics-jsonl", str(metrics)],
        env={"ULTRAEP_GRAD_DUMP_DIR": str(run_dir), **env},
        timeout_s=timeout_s,
        log_path=run_dir / "log",
    )
    dumps = [torch.load(run_dir / f"rank{r}.pt") for r in range(nproc)]
    expert_bias = {}
    for dump in dumps:
        for it, tensors in dump["expert_bias"].items():
            for name, tensor in tensors.items():
                expert_bias.setdefault(it, {}).setdefault(name, tensor)
    grads = {
        it: merge_reduced_gradients([dump["grads"][it] for dump in dumps])
        for it in dumps[0]["grads"]
    }
    return DumpRun(
        run_dir,
        {r["iteration"]: r for r in read_metrics(metrics)},
        grads,
        expert_bias,
        dumps[-1]["eval"],
        log,
    )


def merge_reduced_gradients(
    per_rank: Sequence[dict[str, tuple[torch.Tensor, torch.Tensor]]],
) -> dict[str, torch.Tensor]:
    """One iteration's reduced gradients, by global name, from every rank's ``(gradient, owned)``
    (workers/megatron_records.reduced_gradients): each element from the first rank that holds
    its reduced value. Every element must be held by some rank (with the distributed optimizer the
    shards of a bucket's data-parallel group cover it)."""
    merged: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for grads in per_rank:
        for name, (grad, owned) in grads.items():
            if name not in merged:
                merged[name], covered[name] = torch.zeros_like(grad), torch.zeros_like(owned)
            take = owned & ~covered[name]
            merged[name][take] = grad[take]
            covered[name] |= owned
    missing = [name for name, mask in covered.items() if not bool(mask.all())]
    assert not missing, f"no rank holds the reduced gradient of part of {missing[:5]}"
    return merged


#: The parallel layout of :func:`save_initial_checkpoint`'s one rank.
ONE_RANK_LAYOUT = {"--pipeline-model-parallel-size": "1", "--expert-model-parallel-size": "1"}


def save_initial_checkpoint(
    run_dir: Path, args: Sequence[str], env: dict[str, str] | None = None
) -> DumpRun:
    """The model of ``args`` at initialization, on one rank (EP 1, PP 1), saved as a torch_dist
    checkpoint in ``run_dir/ckpt`` after one iteration at learning rate 0 (the expert bias frozen
    for it). Every layout that loads it (``--load CKPT --finetune``) starts from the same weights,
    whatever its EP and PP; a layout initialized by itself would draw other weights.

    Returns:
        The run that saved it (its checkpoint: ``run_dir/ckpt``).
    """
    args = list(args)
    for flag in (
        *ONE_RANK_LAYOUT,
        "--decoder-first-pipeline-num-layers",
        "--decoder-last-pipeline-num-layers",
        "--num-virtual-stages-per-pipeline-rank",
    ):
        while flag in args:
            i = args.index(flag)
            del args[i : i + 2]
    # Schedules of more ranks, which change no weight: megatron's overlapped schedule needs EP > 1.
    args = [
        a for a in args if a not in ("--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute")
    ]
    args += [token for flag, value in ONE_RANK_LAYOUT.items() for token in (flag, value)]
    args += [
        "--train-iters",
        "1",
        "--lr",
        "0.0",
        "--min-lr",
        "0.0",
        "--lr-warmup-iters",
        "0",
        "--lr-decay-style",
        "constant",
        "--moe-router-bias-update-rate",
        "0.0",
        "--eval-iters",
        "0",
        "--save",
        str(run_dir / "ckpt"),
        "--save-interval",
        "1",
        "--ckpt-format",
        "torch_dist",
    ]
    return launch_dump_run(run_dir, 1, args, env or {})


def make_initial_checkpoint(run_dir: Path) -> DumpRun:
    """The tiny recipe-feature model at initialization (:func:`save_initial_checkpoint`) with
    SKEWED_EXPERT_BIAS. Launched without the CPU flags: pretrain_gpt.py applies them."""
    args = [a for a in recipe_moe_args(ep=1, train_iters=1)]
    for flag, (value, _) in CPU_FLAGS.items():
        i = args.index(flag)
        del args[i : i + (1 if value is None else 2)]
    return save_initial_checkpoint(run_dir, args, {"ULTRAEP_EXPERT_BIAS": SKEWED_EXPERT_BIAS})


def check_verdict(verdict: dict, name: str, expected: str | None, *, warned: bool) -> None:
    """One command line's verdict of :func:`argument_verdicts`: accepted (``expected`` None) or
    refused with ``expected`` in its error; the EP-size-1 warning exactly when ``warned``."""
    error, warnings = verdict["error"], verdict["warnings"]
    if expected is None:
        assert error is None, error
    else:
        assert error is not None, f"{name} was accepted"
        assert expected in error, error
    if warned:
        assert len(warnings) == 1 and "--expert-model-parallel-size 1" in warnings[0], warnings
    else:
        assert warnings == [], warnings


def argument_verdicts(cases: dict[str, list[str]]) -> dict[str, dict]:
    """pretrain_gpt.py's argument checks, in its order, on each command line of ``cases``
    ({name: argv}): UltraEP's startup checks on Megatron's parse, then, if they pass, Megatron's own
    parse and validation. One process for all (workers/validate_balancer_args.py): parsing needs no
    distributed setup.

    Returns:
        {name: {"error": None or the first message, "errors": [every message of UltraEP's startup
        checks], "warnings": [UltraEP's warnings]}}.
    """
    with tempfile.TemporaryDirectory(prefix="argument_verdicts_") as tmp:
        path = Path(tmp) / "cases.json"
        path.write_text(json.dumps([{"name": name, "argv": argv} for name, argv in cases.items()]))
        out = run_python(
            WORKERS / "validate_balancer_args.py",
            [str(path)],
            env=gloo_env({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}),
        )
    found = {}
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("RESULT "):
            record = json.loads(line[len("RESULT ") :])
            found[record.pop("name")] = record
    assert set(found) == set(cases), out.stderr[-3000:]
    return found


def torchrun(
    script: str | Path,
    nproc: int,
    args: Sequence[str],
    env: dict[str, str] | None = None,
    timeout_s: float = 300,
) -> tuple[int, str]:
    """(exit status, combined output) of ``script`` on ``nproc`` gloo ranks, failing or not."""
    completed = run_ranks(script, nproc, args, env=env, timeout_s=timeout_s)
    return completed.returncode, completed.stdout + completed.stderr


@dataclass
class QuantizedWeights:
    """What a run with fp8 parameters recorded (workers/pretrain_grad_dump.record_quantized_weights),
    merged over ranks: digests of the quantized bytes each replica computed with and of its main
    expert's, keyed (iteration, layer, global expert, EP group ranks); the expert weights'
    classes; how often each stood-in TE function ran (summed over ranks)."""

    replicas: list[tuple[tuple, str]]
    homes: dict[tuple, set[str]]
    weight_classes: set[str]
    calls: dict[str, int]

    def mismatches(self) -> list[tuple]:
        """Keys of the replica calls whose bytes were not their main expert's at that iteration
        (or whose main expert had no one set of bytes in it)."""
        return [key for key, digest in self.replicas if self.homes.get(key) != {digest}]


def quantized_weights(run: DumpRun) -> QuantizedWeights:
    """The fp8-parameter record of ``run`` (all its ranks)."""
    record = QuantizedWeights([], {}, set(), {})
    for path in sorted(run.run_dir.glob("rank*.pt")):
        dump = torch.load(path, weights_only=False)["fp8_params"]
        record.replicas += dump["replicas"]
        for key, digests in dump["homes"].items():
            record.homes.setdefault(key, set()).update(digests)
        record.weight_classes |= dump["weight_classes"]
        for name, count in dump["calls"].items():
            record.calls[name] = record.calls.get(name, 0) + count
    return record
