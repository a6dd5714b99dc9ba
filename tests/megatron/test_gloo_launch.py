"""The test launcher leaves nothing running behind a timed-out job: not the job's children, not
torchrun's ranks, which torchrun starts in sessions of their own."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from gloo_launch import WORKERS, launch_gloo_ranks, run_process_group

# A parent that starts a long-lived child in a session of its own (as torchrun starts its ranks)
# and reports its pid.
SPAWNER = ("import subprocess, sys, time; "
           "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], "
           "start_new_session=True); "
           "print(child.pid, flush=True); time.sleep(300)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_timeout_kills_the_whole_process_group():
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_process_group([sys.executable, "-c", SPAWNER], timeout_s=3)
    child = int(raised.value.output.split()[0])  # the output printed before the timeout is kept
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the job's child outlived the timeout"
    assert time.monotonic() - start < 30


def test_a_finished_command_returns_its_status_and_output():
    completed = run_process_group([sys.executable, "-c", "import sys; print('out'); "
                                   "print('err', file=sys.stderr); sys.exit(3)"], timeout_s=60)
    assert (completed.returncode, completed.stdout, completed.stderr) == (3, "out\n", "err\n")


def test_a_timed_out_torchrun_job_leaves_no_rank_behind(tmp_path):
    """Two ranks that hang: the launch fails at its timeout, and afterwards neither rank (each in
    a session of its own, re-parented once torchrun dies) is still running."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        launch_gloo_ranks(WORKERS / "hang.py", 2, [str(tmp_path)], timeout_s=15)
    ranks = [tuple(map(int, p.read_text().split())) for p in sorted(tmp_path.glob("rank*.pid"))]
    assert len(ranks) == 2, "both ranks started before the timeout"
    pids = [pid for pid, _ in ranks]
    # What made torchrun's ranks survive a process-group kill: each leads a session of its own.
    assert all(session == pid for pid, session in ranks), ranks
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids), "a rank outlived its launch's timeout"
    assert time.monotonic() - start < 45
