"""Synthetic routing loads, deterministic for a given seed: one module for every generator the tests,
benchmarks and ``ultraep trace synth`` use. Each answers a different need:

* :func:`zipf_load` ``(R, E, imbalance)``: one load ``[R, E]`` whose rank imbalance is about the
  one asked for (Zipf popularity, its exponent bisected to match), like UltraEP's Fig. 15 / Table 4
  simulations; the planner's tests and ``tools/bench_planner.py``.
* :func:`zipf_topk_load` ``(R, E, exponent=...)``: one load sampled token by token, each token
  picking ``top_k`` *distinct* experts from Zipf(``exponent``) popularity; the data plane's tests
  and ``tools/bench_dataplane.py`` / ``tools/bench_critical_path.py`` (loads by Zipf exponent, not
  by a target imbalance).
* :func:`synthetic_loads`: a run's worth of loads (iterations x microbatches x layers) whose
  popularity drifts over training; :func:`write_synthetic_trace` writes them as a trace file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from .format import check_int
from .writer import TraceWriter

__all__ = ["synthetic_loads", "write_synthetic_trace", "zipf_load", "zipf_topk_load"]


def zipf_load(
    num_ranks: int,
    num_experts: int,
    imbalance: float,
    *,
    tokens_per_rank: int = 4096,
    topk: int = 8,
    seed: int = 0,
    source_noise: float = 0.3,
) -> torch.Tensor:
    """int64 [R, E] load whose expected max/mean rank load is about ``imbalance``.

    Expert popularity follows a Zipf law ``p ~ 1 / rank^alpha`` over a random permutation of the
    experts (so hot experts land on random ranks); ``alpha`` is bisected until the expected rank
    imbalance matches. A token picks ``topk`` distinct experts, so no expert gets more than 1/topk
    of the picks (the head of the law is capped there, which bounds the reachable imbalance for
    few experts per rank). Each source rank perturbs the popularity by a log-normal factor
    (``source_noise``) and draws its ``tokens_per_rank * topk`` picks from a multinomial, capped
    at ``tokens_per_rank`` per expert.
    """
    if num_experts % num_ranks:
        raise ValueError("num_experts must be a multiple of num_ranks")
    rng = np.random.default_rng(seed)
    R, E, G = num_ranks, num_experts, num_experts // num_ranks
    perm = rng.permutation(E)

    def popularity(alpha: float) -> np.ndarray:
        p = (np.arange(E) + 1.0) ** -alpha
        p /= p.sum()
        for _ in range(64):  # cap at 1/topk and renormalize the rest
            over = p > 1.0 / topk + 1e-12
            if not over.any():
                break
            p[over] = 1.0 / topk
            p[~over] *= (1.0 - over.sum() / topk) / p[~over].sum()
        out = np.empty(E)
        out[perm] = p
        return out

    def rank_imbalance(alpha: float) -> float:
        per_rank = popularity(alpha).reshape(R, G).sum(1)
        return per_rank.max() / per_rank.mean()

    lo, hi = 0.0, 8.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rank_imbalance(mid) < imbalance else (lo, mid)
    p = popularity(hi)
    per_source = p[None, :] * rng.lognormal(0.0, source_noise, size=(R, E))
    per_source /= per_source.sum(1, keepdims=True)
    load = np.stack([rng.multinomial(tokens_per_rank * topk, per_source[s]) for s in range(R)])
    return torch.from_numpy(np.minimum(load, tokens_per_rank).astype(np.int64))


def zipf_topk_load(
    num_ranks: int,
    num_experts: int,
    *,
    tokens_per_rank: int = 4096,
    top_k: int = 8,
    exponent: float = 1.0,
    seed: int = 0,
) -> torch.Tensor:
    """Per-rank token counts routed to each expert, int64 ``[R, E]``.

    Expert popularity follows Zipf(``exponent``) over a random expert order; each token picks ``top_k``
    distinct experts; each rank's popularity is jittered so ranks differ.
    """
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_experts, generator=gen)
    popularity = torch.empty(num_experts)
    popularity[order] = (
        1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64).pow(exponent).float()
    )
    loads = torch.zeros(num_ranks, num_experts, dtype=torch.int64)
    for r in range(num_ranks):
        p = popularity * torch.empty(num_experts).uniform_(0.8, 1.2, generator=gen)
        # Gumbel top-k = sampling top_k distinct experts without replacement, proportional to p.
        gumbel = -(-torch.rand(tokens_per_rank, num_experts, generator=gen).log()).log()
        picks = (p.log() + gumbel).topk(top_k, dim=1).indices
        loads[r] = torch.bincount(picks.flatten(), minlength=num_experts)
    return loads


def synthetic_loads(
    *,
    num_iterations: int,
    num_microbatches: int,
    num_layers: int,
    num_ranks: int,
    num_experts: int,
    tokens_per_rank: int,
    topk: int,
    skew: float = 1.0,
    drift: float = 0.3,
    rank_spread: float = 0.3,
    seed: int = 0,
) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """Drifting-Zipf routing loads: yields ``(iteration, microbatch, layer, load int64 [R, E])`` in
    training order (iterations and layers 1-based, microbatches 0-based).

    Every layer starts from its own Zipf popularity (``logit_e = -skew * log(rank_e + 1)`` over a
    random expert order). Each iteration, every expert's logit takes a random-walk step of
    standard deviation ``drift`` (hot experts move over training and differ across layers); every
    source rank adds a fixed per-(layer, rank) offset of spread ``rank_spread`` (its data domain),
    and each microbatch samples ``tokens_per_rank * topk`` (token, expert) pairs per source rank
    multinomially (microbatch jitter). Row sums are exactly ``tokens_per_rank * topk``.

    The arguments are checked on the call, before the first load (a ValueError), so that
    :func:`write_synthetic_trace` opens no file for bad ones.
    """
    for name, v in (
        ("num_iterations", num_iterations),
        ("num_microbatches", num_microbatches),
        ("num_layers", num_layers),
        ("num_ranks", num_ranks),
        ("num_experts", num_experts),
        ("tokens_per_rank", tokens_per_rank),
        ("topk", topk),
    ):
        check_int(name, v, 1, 1 << 40)
    if num_experts % num_ranks:
        raise ValueError(
            f"num_experts ({num_experts}) must be a multiple of num_ranks ({num_ranks})"
        )
    if topk > num_experts:
        raise ValueError(f"topk ({topk}) must be <= num_experts ({num_experts})")
    for name, v in (("skew", skew), ("drift", drift), ("rank_spread", rank_spread)):
        if not 0 <= v < float("inf"):
            raise ValueError(f"{name} must be a number >= 0, got {v}")
    return _drifting_loads(
        num_iterations,
        num_microbatches,
        num_layers,
        num_ranks,
        num_experts,
        tokens_per_rank * topk,
        skew,
        drift,
        rank_spread,
        seed,
    )


def _drifting_loads(
    num_iterations: int,
    num_microbatches: int,
    num_layers: int,
    num_ranks: int,
    num_experts: int,
    pairs: int,
    skew: float,
    drift: float,
    rank_spread: float,
    seed: int,
) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """The generator of :func:`synthetic_loads` (checked arguments; ``pairs`` per source rank)."""
    rng = np.random.default_rng(seed)
    R, E = num_ranks, num_experts
    zipf = -skew * np.log(np.arange(1, E + 1, dtype=np.float64))
    logits = np.stack([zipf[rng.permutation(E)] for _ in range(num_layers)])  # [L, E]
    domain = rng.normal(0.0, rank_spread, size=(num_layers, R, E))  # [L, R, E]
    for it in range(1, num_iterations + 1):
        if it > 1:
            logits = logits + rng.normal(0.0, drift, size=logits.shape)
        for mb in range(num_microbatches):
            for li in range(num_layers):
                z = logits[li][None, :] + domain[li]  # [R, E]
                p = np.exp(z - z.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                load = np.stack([rng.multinomial(pairs, p[r]) for r in range(R)])
                yield it, mb, li + 1, torch.from_numpy(load.astype(np.int64))


def write_synthetic_trace(
    path: str | os.PathLike, *, meta: Optional[dict] = None, **kwargs
) -> Path:
    """Write :func:`synthetic_loads` (``kwargs``) to ``path`` as a trace; returns the path."""
    meta = {
        "source": "synthetic drifting Zipf",
        **{k: v for k, v in kwargs.items()},
        **(meta or {}),
    }
    loads = synthetic_loads(**kwargs)  # checks the arguments before the file is opened
    with TraceWriter(
        path,
        num_ranks=kwargs["num_ranks"],
        num_experts=kwargs["num_experts"],
        meta=meta,
        fsync=False,
        mode="overwrite",
    ) as writer:
        current = None
        for it, mb, layer, load in loads:
            if current is not None and it != current:
                writer.flush_iteration(current)
            current = it
            writer.append(it, mb, layer, load)
        if current is not None:
            writer.flush_iteration(current)
    return Path(path)
