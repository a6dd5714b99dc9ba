"""Writing traces (``traces/writer.py``): a crashed writer loses at most the iteration in flight, a
resumed run appends after the last commit (cutting a torn tail, refusing another shape), bad input
is refused, and closing commits what is pending."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from traces_helpers import E, R, REPO, sample_iterations, write_iterations

from ultraep_megatron.traces import TraceReader, TraceWriter, read_trace


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
