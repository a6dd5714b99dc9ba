"""Synthetic loads (``traces/synthetic.py``): the drifting trace generator's loads are exact,
deterministic and drift."""

from __future__ import annotations

import pytest
import torch

from ultraep_megatron.traces.synthetic import synthetic_loads


def test_synthetic_loads_are_exact_and_drift():
    kwargs = dict(num_iterations=30, num_microbatches=1, num_layers=2, num_ranks=4, num_experts=16,
                  tokens_per_rank=4000, topk=2, seed=5)
    drifting = list(synthetic_loads(drift=0.5, **kwargs))
    again = list(synthetic_loads(drift=0.5, **kwargs))
    assert all(torch.equal(a[3], b[3]) for a, b in zip(drifting, again))  # deterministic
    assert [(it, mb, layer) for it, mb, layer, _ in drifting[:4]] == [(1, 0, 1), (1, 0, 2), (2, 0, 1), (2, 0, 2)]
    for _, _, _, load in drifting:
        assert load.shape == (4, 16) and (load.sum(1) == 8000).all()

    def popularity_correlation(records):
        layer1 = [r[3].sum(0).double() for r in records if r[2] == 1]
        first, last = layer1[0], layer1[-1]
        return float(torch.corrcoef(torch.stack([first, last]))[0, 1])

    stationary = list(synthetic_loads(drift=0.0, **kwargs))
    # Without drift the popularity stays put; with drift the hot experts move.
    assert popularity_correlation(stationary) > 0.95
    assert popularity_correlation(drifting) < 0.6
    with pytest.raises(ValueError, match="multiple"):
        next(synthetic_loads(**{**kwargs, "num_experts": 10}))
