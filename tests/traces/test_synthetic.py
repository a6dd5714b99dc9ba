"""Synthetic loads (``traces/synthetic.py``): the drifting trace generator's loads are exact,
deterministic and drift; bad arguments are refused before a trace file is touched."""

from __future__ import annotations

import pytest
import torch

from ultraep_megatron.traces.synthetic import synthetic_loads, write_synthetic_trace


def test_synthetic_loads_are_exact_and_drift():
    kwargs = dict(
        num_iterations=30,
        num_microbatches=1,
        num_layers=2,
        num_ranks=4,
        num_experts=16,
        tokens_per_rank=4000,
        topk=2,
        seed=5,
    )
    drifting = list(synthetic_loads(drift=0.5, **kwargs))
    again = list(synthetic_loads(drift=0.5, **kwargs))
    assert all(torch.equal(a[3], b[3]) for a, b in zip(drifting, again))  # deterministic
    assert [(it, mb, layer) for it, mb, layer, _ in drifting[:4]] == [
        (1, 0, 1),
        (1, 0, 2),
        (2, 0, 1),
        (2, 0, 2),
    ]
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


def test_bad_arguments_are_refused_before_the_trace_file_is_touched(tmp_path):
    """Out-of-range values (a negative skew or drift) and inconsistent shapes raise on the call, so
    write_synthetic_trace neither creates nor clobbers the file."""
    kwargs = dict(
        num_iterations=2,
        num_microbatches=1,
        num_layers=1,
        num_ranks=2,
        num_experts=4,
        tokens_per_rank=8,
        topk=2,
    )
    for bad, match in (
        ({"skew": -3.0}, "skew must be a number >= 0"),
        ({"drift": -0.1}, "drift"),
        ({"num_experts": 5}, "multiple"),
        ({"topk": 5}, "topk"),
    ):
        with pytest.raises(ValueError, match=match):
            synthetic_loads(**{**kwargs, **bad})  # no next(): the call itself checks
        existing = tmp_path / "existing.uetrace"
        existing.write_bytes(b"keep me")
        with pytest.raises(ValueError, match=match):
            write_synthetic_trace(existing, **{**kwargs, **bad})
        assert existing.read_bytes() == b"keep me"
        with pytest.raises(ValueError):
            write_synthetic_trace(tmp_path / "new.uetrace", **{**kwargs, **bad})
        assert not (tmp_path / "new.uetrace").exists()
