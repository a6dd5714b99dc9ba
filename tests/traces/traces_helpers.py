"""What the tests of ``ultraep_megatron.traces`` share: small loads and trace files written with
them, and where the shipped real trace lies (``tests/traces/data``, read by the analysis and command
tests too)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ultraep_megatron.traces import TraceWriter
from ultraep_megatron.traces.synthetic import synthetic_loads

REPO = Path(__file__).resolve().parents[2]
#: The shipped real routing trace (tests/traces/data/README.md says how it was recorded).
KJV_TRACE = Path(__file__).resolve().parent / "data" / "kjv_tiny.uetrace"
R, E = 4, 8


def random_load(rng: np.random.Generator, high: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, high, size=(R, E), dtype=np.int64))


def write_iterations(path, loads_by_iteration, *, compress=True, close=True, meta=None):
    """loads_by_iteration: {iteration: [(microbatch, layer, load), ...]}."""
    writer = TraceWriter(
        path,
        num_ranks=R,
        num_experts=E,
        meta=meta or {"run": "test"},
        compress=compress,
        fsync=False,
        mode="overwrite",
    )
    for it, recs in loads_by_iteration.items():
        for mb, layer, load in recs:
            writer.append(it, mb, layer, load)
        writer.flush_iteration(it)
    if close:
        writer.close()
    return writer


def sample_iterations(seed=0, iterations=3, highs=(200, 60_000, 3_000_000_000, 1 << 40)):
    rng = np.random.default_rng(seed)
    out = {}
    for it in range(1, iterations + 1):
        out[it] = [
            (mb, layer, random_load(rng, highs[(it + mb + layer) % len(highs)]))
            for mb in range(2)
            for layer in (1, 3)
        ]
    return out


def drifting_records(
    iterations=12, microbatches=2, layers=2, drift=0.6, seed=0, group=0, num_ranks=4, num_experts=16
):
    """Replay records (EP group ``group``) of a drifting synthetic trace: 512 tokens per rank, top-2."""
    return [
        (group, *rec)
        for rec in synthetic_loads(
            num_iterations=iterations,
            num_microbatches=microbatches,
            num_layers=layers,
            num_ranks=num_ranks,
            num_experts=num_experts,
            tokens_per_rank=512,
            topk=2,
            drift=drift,
            seed=seed,
        )
    ]
