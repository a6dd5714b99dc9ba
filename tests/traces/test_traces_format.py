"""The trace file format: round trip, the documented byte layout, crash/truncation semantics,
foreign and corrupt files, live reading, resumed runs, and the synthetic generator."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from ultraep_megatron import traces
from ultraep_megatron.traces import (
    TraceFormatError,
    TraceReader,
    TraceTruncatedError,
    TraceTruncatedWarning,
    TraceWriter,
    read_trace,
)

REPO = Path(__file__).resolve().parents[2]
R, E = 4, 8


def random_load(rng: np.random.Generator, high: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, high, size=(R, E), dtype=np.int64))


def write_iterations(path, loads_by_iteration, *, compress=True, close=True, meta=None):
    """loads_by_iteration: {iteration: [(microbatch, layer, load), ...]}."""
    writer = TraceWriter(path, num_ranks=R, num_experts=E, meta=meta or {"run": "test"}, compress=compress,
                         fsync=False, mode="overwrite")
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
        out[it] = [(mb, layer, random_load(rng, highs[(it + mb + layer) % len(highs)]))
                   for mb in range(2) for layer in (1, 3)]
    return out


@pytest.mark.parametrize("compress", [True, False])
def test_round_trip_all_widths(tmp_path, compress):
    data = sample_iterations()
    data[4] = [(0, 1, torch.zeros((R, E), dtype=torch.int64))]  # all-zero load
    path = tmp_path / "t.uetrace"
    write_iterations(path, data, compress=compress, meta={"hidden_size": 16, "nested": {"a": [1, 2]}})
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
    assert trace.status == "closed" and trace.truncated_bytes == 0 and trace.uncommitted_records == 0
    assert trace.layers == [1, 3]
    assert torch.equal(trace.for_layer(3), torch.stack([e[3] for e in expected if e[2] == 3]))


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
        tag, mb, it, layer, width, codec, reserved, nbytes, crc = struct.unpack_from("<4siqiBBHII", blob, pos)
        payload = blob[pos + 32:pos + 32 + nbytes]
        assert crc == zlib.crc32(blob[pos:pos + 28] + payload)
        assert reserved == 0
        seen.append((tag, it, mb, layer, width, codec, payload))
        pos += 32 + nbytes
    assert pos == len(blob)
    assert [s[0] for s in seen] == [b"LOAD", b"ITER", b"CLOS"]
    _, it, mb, layer, width, codec, payload = seen[0]
    assert (it, mb, layer, width, codec) == (7, 2, 5, 2, 0)
    assert np.array_equal(np.frombuffer(payload, "<u2").reshape(R, E), load.numpy())
    assert seen[1][1:3] == (7, 1)  # commit of iteration 7 holding 1 load


def record_ends(path: Path) -> list[tuple[bytes, int]]:
    """(tag, end offset) of every record, walking the documented layout by hand."""
    blob = path.read_bytes()
    pos = blob.index(b"\n", 14) + 1
    out = []
    while pos < len(blob):
        tag = blob[pos:pos + 4]
        nbytes = struct.unpack_from("<I", blob, pos + 24)[0]
        pos += 32 + nbytes
        out.append((tag, pos))
    return out


def test_every_truncation_point_keeps_exactly_the_committed_iterations(tmp_path):
    data = sample_iterations(iterations=3)
    full = tmp_path / "full.uetrace"
    write_iterations(full, data, compress=True)
    blob = full.read_bytes()
    ends = record_ends(full)
    commits = [end for tag, end in ends if tag == b"ITER"]
    header_end = blob.index(b"\n", 14) + 1
    boundaries = {header_end, *(end for _, end in ends)}
    cut_path = tmp_path / "cut.uetrace"
    # Every record boundary and the bytes right around it, plus a stride through the rest.
    cuts = {c for b in boundaries for c in (b - 2, b - 1, b, b + 1, b + 31, b + 32, b + 33)}
    cuts |= set(range(header_end, len(blob), 13))
    for cut in sorted(c for c in cuts if header_end <= c < len(blob)):
        cut_path.write_bytes(blob[:cut])
        with pytest.warns(TraceTruncatedWarning) if cut not in boundaries else _no_warning():
            trace = read_trace(cut_path)
        committed = sum(1 for c in commits if c <= cut)
        expected = [load for it in list(data)[:committed] for _, _, load in data[it]]
        assert trace.num_records == len(expected), cut
        assert all(torch.equal(a, b) for a, b in zip(trace.load, expected))
        if cut in boundaries:
            assert trace.status == "open" and trace.truncated_bytes == 0
        else:
            assert trace.status == "truncated"
            previous = max(b for b in boundaries if b < cut)
            assert trace.truncated_bytes == cut - previous


class _no_warning:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error", TraceTruncatedWarning)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def test_truncated_tail_policies(tmp_path):
    path = tmp_path / "t.uetrace"
    write_iterations(path, sample_iterations(iterations=2), close=True)
    blob = path.read_bytes()
    path.write_bytes(blob[:-40])  # cut into the last commit record area
    with pytest.raises(TraceTruncatedError, match="truncated"):
        read_trace(path, on_truncated="error")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace = read_trace(path, on_truncated="ignore")
    assert trace.status == "truncated"
    # The file system may pad a torn write with zeros: still a truncation, not corruption.
    path.write_bytes(blob + b"\0" * 100)
    assert read_trace(path, on_truncated="ignore").status == "truncated"
    with pytest.raises(ValueError, match="on_truncated"):
        TraceReader(path, on_truncated="maybe")


def test_foreign_corrupt_and_unsupported_files(tmp_path):
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    with pytest.raises(TraceFormatError, match="not an UltraEP trace"):
        TraceReader(foreign)
    jsonl = tmp_path / "other.jsonl"
    jsonl.write_text('{"format": "ultraep-trace", "version": 1}\n')
    with pytest.raises(TraceFormatError, match="not an UltraEP trace"):
        TraceReader(jsonl)
    wrong_format = tmp_path / "wrong.uetrace"
    wrong_format.write_bytes(b"ULTRAEP-TRACE\n" + b'{"format": "something-else", "version": 1}\n')
    with pytest.raises(TraceFormatError, match="does not declare format"):
        TraceReader(wrong_format)
    newer = tmp_path / "newer.uetrace"
    newer.write_bytes(b"ULTRAEP-TRACE\n" + json.dumps(
        {"format": "ultraep-trace", "version": 99, "num_ranks": R, "num_experts": E}).encode() + b"\n")
    with pytest.raises(TraceFormatError, match="version 99"):
        TraceReader(newer)
    empty = tmp_path / "empty.uetrace"
    empty.write_bytes(b"")
    with pytest.raises(TraceTruncatedError, match="magic"):
        TraceReader(empty)
    half_header = tmp_path / "half.uetrace"
    half_header.write_bytes(b"ULTRAEP-TRACE\n{\"format\": \"ultraep-tr")
    with pytest.raises(TraceTruncatedError, match="JSON header"):
        TraceReader(half_header)
    # A flipped byte in the first record (not at the end) is corruption, not truncation.
    good = tmp_path / "good.uetrace"
    write_iterations(good, sample_iterations(iterations=2), compress=False)
    blob = bytearray(good.read_bytes())
    first_payload = blob.index(b"\n", 14) + 1 + 32
    blob[first_payload] ^= 0xFF
    bad = tmp_path / "bad.uetrace"
    bad.write_bytes(bytes(blob))
    with pytest.raises(TraceFormatError, match="checksum"):
        read_trace(bad)
    blob = bytearray(good.read_bytes())
    blob[blob.index(b"\n", 14) + 1] = ord("X")  # unknown tag
    bad.write_bytes(bytes(blob))
    with pytest.raises(TraceFormatError, match="corrupt record header"):
        read_trace(bad)


def test_reader_sees_committed_iterations_while_the_writer_runs(tmp_path):
    path = tmp_path / "live.uetrace"
    rng = np.random.default_rng(3)
    loads = [random_load(rng, 500) for _ in range(4)]
    writer = TraceWriter(path, num_ranks=R, num_experts=E, meta={}, fsync=False, mode="overwrite")
    writer.append(1, 0, 1, loads[0])
    writer.append(1, 1, 1, loads[1])
    writer.flush_iteration(1)
    writer.append(2, 0, 1, loads[2])
    writer._file.flush()  # what a full OS buffer would do mid-iteration
    live = TraceReader(path)
    got = list(live.records())
    assert [r.iteration for r in got] == [1, 1] and torch.equal(got[1].load, loads[1])
    assert live.status == "open" and live.uncommitted_records == 1 and live.committed_iterations == 1
    assert [r.iteration for r in TraceReader(path).records(include_uncommitted=True)] == [1, 1, 2]
    writer.append(2, 1, 1, loads[3])
    writer.flush_iteration(2)
    assert [r.iteration for r in TraceReader(path)] == [1, 1, 2, 2]
    writer.close()
    assert TraceReader(path).scan().status == "closed"


def test_a_crashed_writer_loses_at_most_the_iteration_in_flight(tmp_path):
    path = tmp_path / "crash.uetrace"
    code = f"""
import os, torch
from ultraep_megatron.traces import TraceWriter
w = TraceWriter({str(path)!r}, num_ranks={R}, num_experts={E}, meta={{}})
for it in (1, 2, 3):
    for layer in (1, 2):
        w.append(it, 0, layer, torch.full(({R}, {E}), it * 10 + layer, dtype=torch.int64))
    if it < 3:
        w.flush_iteration(it)
os._exit(1)  # killed mid-iteration 3: no close, no flush
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 1, proc.stderr.decode()
    trace = read_trace(path)
    assert trace.iteration.tolist() == [1, 1, 2, 2]
    assert trace.load[:, 0, 0].tolist() == [11, 12, 21, 22]
    assert trace.status == "open"
    # A resumed run appends after the last commit.
    with TraceWriter(path, num_ranks=R, num_experts=E, meta={"ignored": True}) as writer:
        writer.append(3, 0, 1, torch.full((R, E), 99, dtype=torch.int64))
        writer.flush_iteration(3)
    trace = read_trace(path)
    assert trace.iteration.tolist() == [1, 1, 2, 2, 3] and int(trace.load[-1, 0, 0]) == 99
    assert trace.header.meta == {} and trace.status == "closed"


def test_append_mode_cuts_a_torn_tail_and_checks_the_shape(tmp_path):
    path = tmp_path / "resume.uetrace"
    data = sample_iterations(iterations=2)
    write_iterations(path, data)
    blob = path.read_bytes()
    path.write_bytes(blob[:-50])  # torn inside iteration 2's records or commit
    with TraceWriter(path, num_ranks=R, num_experts=E) as writer:
        writer.append(5, 0, 1, data[1][0][2])
        writer.flush_iteration(5)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace = read_trace(path)
    assert trace.iteration.tolist() == [1] * len(data[1]) + [5]
    assert trace.status == "closed"
    with pytest.raises(ValueError, match="cannot append"):
        TraceWriter(path, num_ranks=2, num_experts=E)
    TraceWriter(path, num_ranks=2, num_experts=E, mode="overwrite").close()
    assert TraceReader(path).num_ranks == 2


def test_writer_rejects_bad_input(tmp_path):
    path = tmp_path / "w.uetrace"
    with pytest.raises(ValueError, match="multiple"):
        TraceWriter(path, num_ranks=3, num_experts=8)
    with pytest.raises(ValueError, match="JSON"):
        TraceWriter(path, num_ranks=R, num_experts=E, meta={"x": object()})
    writer = TraceWriter(path, num_ranks=R, num_experts=E, fsync=False, mode="overwrite")
    with pytest.raises(ValueError, match=r"\[R, E\]"):
        writer.append(1, 0, 1, torch.zeros((E, R), dtype=torch.int64))
    with pytest.raises(ValueError, match="negative"):
        writer.append(1, 0, 1, torch.full((R, E), -1, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer"):
        writer.append(1, 0, 1, torch.zeros((R, E)))
    with pytest.raises(ValueError, match="microbatch"):
        writer.append(1, -1, 1, torch.zeros((R, E), dtype=torch.int64))
    writer.append(1, 0, 1, torch.ones((R, E), dtype=torch.int32))
    with pytest.raises(ValueError, match="pending"):
        writer.flush_iteration(2)
    writer.flush_iteration(1)
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        writer.append(2, 0, 1, torch.zeros((R, E), dtype=torch.int64))
    assert read_trace(path).load.tolist() == [[[1] * E] * R]


def test_close_commits_pending_records(tmp_path):
    path = tmp_path / "c.uetrace"
    with TraceWriter(path, num_ranks=R, num_experts=E, fsync=False, mode="overwrite") as writer:
        writer.append(4, 0, 1, torch.ones((R, E), dtype=torch.int64))
        writer.append(5, 0, 1, torch.ones((R, E), dtype=torch.int64))
    assert read_trace(path).iteration.tolist() == [4, 5]


def test_trace_paths(tmp_path):
    p = traces.trace_path(tmp_path / "dir", 3)
    assert p == tmp_path / "dir" / "ep_group_0003.uetrace" and p.parent.is_dir()
    TraceWriter(p, num_ranks=R, num_experts=E).close()
    TraceWriter(traces.trace_path(tmp_path / "dir", 1), num_ranks=R, num_experts=E).close()
    assert [f.name for f in traces.find_trace_files(tmp_path / "dir")] == ["ep_group_0001.uetrace", "ep_group_0003.uetrace"]
    with pytest.raises(ValueError, match="does not exist"):
        traces.find_trace_files(tmp_path / "nope")
    with pytest.raises(ValueError, match="no \\*.uetrace"):
        traces.find_trace_files(tmp_path)


def test_synthetic_loads_are_exact_and_drift():
    kwargs = dict(num_iterations=30, num_microbatches=1, num_layers=2, num_ranks=4, num_experts=16,
                  tokens_per_rank=4000, topk=2, seed=5)
    drifting = list(traces.synthetic_loads(drift=0.5, **kwargs))
    again = list(traces.synthetic_loads(drift=0.5, **kwargs))
    assert all(torch.equal(a[3], b[3]) for a, b in zip(drifting, again))  # deterministic
    assert [(it, mb, layer) for it, mb, layer, _ in drifting[:4]] == [(1, 0, 1), (1, 0, 2), (2, 0, 1), (2, 0, 2)]
    for _, _, _, load in drifting:
        assert load.shape == (4, 16) and (load.sum(1) == 8000).all()

    def popularity_correlation(records):
        layer1 = [r[3].sum(0).double() for r in records if r[2] == 1]
        first, last = layer1[0], layer1[-1]
        return float(torch.corrcoef(torch.stack([first, last]))[0, 1])

    stationary = list(traces.synthetic_loads(drift=0.0, **kwargs))
    # Without drift the popularity stays put; with drift the hot experts move.
    assert popularity_correlation(stationary) > 0.95
    assert popularity_correlation(drifting) < 0.6
    with pytest.raises(ValueError, match="multiple"):
        next(traces.synthetic_loads(**{**kwargs, "num_experts": 10}))
