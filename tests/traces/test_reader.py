"""Reading traces (``traces/reader.py``): crash and truncation semantics at every cut, what
``trace_info`` counts at every cut, the torn-tail policies, foreign, corrupt and unsupported files,
and reading while the writer runs."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from traces_helpers import E, R, random_load, sample_iterations, write_iterations

from ultraep_megatron.traces import (
    TraceFormatError,
    TraceReader,
    TraceRecords,
    TraceTruncatedError,
    TraceTruncatedWarning,
    TraceWriter,
    read_trace,
)
from ultraep_megatron.traces.reader import trace_info


def record_ends(path: Path) -> list[tuple[bytes, int]]:
    """(tag, end offset) of every record, walking the documented layout by hand."""
    blob = path.read_bytes()
    pos = blob.index(b"\n", 14) + 1
    out = []
    while pos < len(blob):
        tag = blob[pos : pos + 4]
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


def test_trace_info_counts_what_a_replay_reads_at_every_cut(tmp_path):
    """One definition of a trace's loads and iterations, the committed ones: ``trace_info`` (``ultraep
    trace info``) counts what ``read_trace`` and a replay's ``TraceRecords`` read, wherever the
    file is cut, and the loads after the last commit apart."""
    full = tmp_path / "full.uetrace"
    write_iterations(full, sample_iterations(iterations=3), compress=True)
    blob = full.read_bytes()
    cut_path = tmp_path / "cut.uetrace"
    for cut in range(blob.index(b"\n", 14) + 1, len(blob) + 1, 11):
        cut_path.write_bytes(blob[:cut])
        info = trace_info(cut_path)
        trace = read_trace(cut_path, on_truncated="ignore")
        assert (info["loads"], info["iterations"]) == (
            trace.num_records,
            len(set(trace.iteration.tolist())),
        ), cut
        assert sum(info["layers"].values()) == info["loads"]
        everything = read_trace(cut_path, on_truncated="ignore", include_uncommitted=True)
        assert info["uncommitted"] == everything.num_records - trace.num_records
        described = TraceRecords([cut_path], on_truncated="ignore").describe()[0]
        assert f" {info['loads']} loads in {info['iterations']} iterations" in described, (
            cut,
            described,
        )


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
    newer.write_bytes(
        b"ULTRAEP-TRACE\n"
        + json.dumps(
            {"format": "ultraep-trace", "version": 99, "num_ranks": R, "num_experts": E}
        ).encode()
        + b"\n"
    )
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
    assert (
        live.status == "open" and live.uncommitted_records == 1 and live.committed_iterations == 1
    )
    assert [r.iteration for r in TraceReader(path).records(include_uncommitted=True)] == [1, 1, 2]
    writer.append(2, 1, 1, loads[3])
    writer.flush_iteration(2)
    assert [r.iteration for r in TraceReader(path)] == [1, 1, 2, 2]
    writer.close()
    assert TraceReader(path).scan().status == "closed"
