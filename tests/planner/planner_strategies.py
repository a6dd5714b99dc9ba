"""Hypothesis strategies for planner tests: random and adversarial int64 [R, E] loads."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

LOAD_KINDS = ("drawn", "uniform", "zipf", "sparse", "one_expert", "equal", "binary",
              "empty_rank", "one_rank_hot", "huge", "all_zero")


def make_load(draw, kind: str, R: int, G: int) -> np.ndarray:
    """A random or adversarial int64 [R, R*G] load of the given kind."""
    E = R * G
    if kind == "drawn":  # fully hypothesis-controlled (shrinks to minimal counterexamples)
        values = draw(st.lists(st.integers(0, 30), min_size=R * E, max_size=R * E))
        return np.array(values, np.int64).reshape(R, E)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "uniform":
        return rng.integers(0, int(rng.choice([3, 100, 10_000])), (R, E))
    if kind == "zipf":
        p = (np.arange(E) + 1.0) ** -rng.uniform(0.3, 3.0)
        p = p[rng.permutation(E)]
        return np.stack([rng.multinomial(int(rng.integers(0, 5000)), p / p.sum())
                         for _ in range(R)])
    if kind == "sparse":
        return rng.integers(0, 1000, (R, E)) * (rng.random((R, E)) < 0.1)
    if kind == "one_expert":  # one expert takes every token
        load = np.zeros((R, E), np.int64)
        load[:, rng.integers(E)] = rng.integers(0, 1000, R)
        return load
    if kind == "equal":  # ties everywhere
        return np.full((R, E), int(rng.integers(0, 50)), np.int64)
    if kind == "binary":
        return rng.integers(0, 2, (R, E))
    if kind == "empty_rank":  # a source with no tokens and a rank whose experts get none
        load = rng.integers(0, 500, (R, E))
        load[rng.integers(R)] = 0
        r = rng.integers(R)
        load[:, r * G:(r + 1) * G] = 0
        return load
    if kind == "one_rank_hot":
        load = rng.integers(0, 20, (R, E))
        r = rng.integers(R)
        load[:, r * G:(r + 1) * G] += rng.integers(0, 5000, (R, G))
        return load
    if kind == "huge":  # far from int32, sums stay far from int64 overflow
        return rng.integers(0, 10**12, (R, E))
    if kind == "all_zero":
        return np.zeros((R, E), np.int64)
    raise AssertionError(kind)


@st.composite
def problems(draw, max_ranks: int = 12, max_experts_per_rank: int = 4, max_slots: int = 4):
    R = draw(st.integers(1, max_ranks))
    G = draw(st.integers(1, max_experts_per_rank))
    S = draw(st.integers(0, max_slots))
    kind = draw(st.sampled_from(LOAD_KINDS))
    if kind == "drawn":  # keep hypothesis' buffer small
        R, G = min(R, 4), min(G, 3)
    load = torch.from_numpy(make_load(draw, kind, R, G).astype(np.int64))
    min_quota = draw(st.one_of(st.none(), st.integers(1, 3), st.integers(1, 2000)))
    return load, S, min_quota


@st.composite
def domain_problems(draw, max_ranks: int = 12, max_experts_per_rank: int = 4, max_slots: int = 4):
    """``problems`` plus an NVLink domain size dividing R."""
    load, S, min_quota = draw(problems(max_ranks, max_experts_per_rank, max_slots))
    R = load.shape[0]
    N = draw(st.sampled_from([d for d in range(1, R + 1) if R % d == 0]))
    return load, S, min_quota, N
