"""The test launcher leaves nothing running behind a timed-out job."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gloo_launch import run_process_group

# A parent that starts a long-lived child and reports its pid, as torchrun starts its ranks.
SPAWNER = ("import subprocess, sys, time; "
           "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
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
