"""The trace file format (``traces/format.py``): a round trip through writer and reader at every
integer width, the documented byte layout parsed by hand, and the trace file names."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
import torch

from traces_helpers import E, R, sample_iterations, write_iterations

from ultraep_megatron import traces
from ultraep_megatron.traces import TraceWriter, read_trace


@pytest.mark.parametrize("compress", [True, False])
def test_round_trip_all_widths(tmp_path, compress):
    data = sample_iterations()
    data[4] = [(0, 1, torch.zeros((R, E), dtype=torch.int64))]  # all-zero load
    path = tmp_path / "t.uetrace"
    write_iterations(
        path, data, compress=compress, meta={"hidden_size": 16, "nested": {"a": [1, 2]}}
    )
    trace = read_trace(path)
    expected = [(it, mb, layer, load) for it, recs in data.items() for mb, layer, load in recs]
    assert trace.num_records == len(expected)
    assert trace.iteration.tolist() == [e[0] for e in expected]
    assert trace.microbatch.tolist() == [e[1] for e in expected]
    assert trace.layer.tolist() == [e[2] for e in expected]
    for got, (_, _, _, load) in zip(trace.load, expected):
        assert torch.equal(got, load)
    assert trace.header.meta == {"hidden_size": 16, "nested": {"a": [1, 2]}}
    assert (trace.header.version, trace.header.num_ranks, trace.header.num_experts) == (1, R, E)
    assert (
        trace.status == "closed" and trace.truncated_bytes == 0 and trace.uncommitted_records == 0
    )
    assert trace.layers == [1, 3]
    assert torch.equal(
        trace.load[trace.layer == 3], torch.stack([e[3] for e in expected if e[2] == 3])
    )


def test_byte_layout_matches_the_documented_spec(tmp_path):
    """Parse a file by hand following docs/traces.md, without the reader."""
    load = torch.arange(R * E, dtype=torch.int64).view(R, E) * 1000  # max 31000: 2-byte width
    path = tmp_path / "t.uetrace"
    write_iterations(path, {7: [(2, 5, load)]}, compress=False, meta={"k": 1})
    blob = path.read_bytes()
    assert blob.startswith(b"ULTRAEP-TRACE\n")
    line_end = blob.index(b"\n", 14)
    header = json.loads(blob[14:line_end])
    assert header["format"] == "ultraep-trace" and header["version"] == 1
    assert (header["num_ranks"], header["num_experts"], header["meta"]) == (R, E, {"k": 1})
    pos = line_end + 1
    seen = []
    while pos < len(blob):
        tag, mb, it, layer, width, codec, reserved, nbytes, crc = struct.unpack_from(
            "<4siqiBBHII", blob, pos
        )
        payload = blob[pos + 32 : pos + 32 + nbytes]
        assert crc == zlib.crc32(blob[pos : pos + 28] + payload)
        assert reserved == 0
        seen.append((tag, it, mb, layer, width, codec, payload))
        pos += 32 + nbytes
    assert pos == len(blob)
    assert [s[0] for s in seen] == [b"LOAD", b"ITER", b"CLOS"]
    _, it, mb, layer, width, codec, payload = seen[0]
    assert (it, mb, layer, width, codec) == (7, 2, 5, 2, 0)
    assert np.array_equal(np.frombuffer(payload, "<u2").reshape(R, E), load.numpy())
    assert seen[1][1:3] == (7, 1)  # commit of iteration 7 holding 1 load


def test_trace_paths(tmp_path):
    p = traces.trace_path(tmp_path / "dir", 3)
    assert p == tmp_path / "dir" / "ep_group_0003.uetrace" and p.parent.is_dir()
    TraceWriter(p, num_ranks=R, num_experts=E).close()
    TraceWriter(traces.trace_path(tmp_path / "dir", 1), num_ranks=R, num_experts=E).close()
    assert [f.name for f in traces.find_trace_files(tmp_path / "dir")] == [
        "ep_group_0001.uetrace",
        "ep_group_0003.uetrace",
    ]
    with pytest.raises(ValueError, match="does not exist"):
        traces.find_trace_files(tmp_path / "nope")
    with pytest.raises(ValueError, match="no \\*.uetrace"):
        traces.find_trace_files(tmp_path)
