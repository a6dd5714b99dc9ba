"""The fixture the command's tests share: a small synthetic trace directory (one EP group of 4
ranks, 16 experts, 2 layers, 6 iterations of 2 microbatches, drifting), with a production expert's
shape in its meta."""

from __future__ import annotations

import pytest

from ultraep_megatron import traces


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("traces")
    traces.write_synthetic_trace(
        traces.trace_path(directory, 0),
        num_iterations=6,
        num_microbatches=2,
        num_layers=2,
        num_ranks=4,
        num_experts=16,
        tokens_per_rank=256,
        topk=2,
        drift=0.6,
        seed=3,
        meta={"hidden_size": 4096, "moe_ffn_hidden_size": 1536, "swiglu": True},
    )
    return directory
