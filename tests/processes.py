"""Running test subprocesses that leave nothing behind.

:func:`run_process_group` runs a command (torchrun and its ranks, a recipe, the resume
experiment's driver) so that on a timeout or an interrupt every process it started is killed, at
any depth and in any session, before the test goes on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from typing import Sequence

import rank_launcher

#: The environment variable that marks every process of one launch (inherited by all descendants,
#: whatever session they start): how a timed-out launch finds them all.
LAUNCH_MARKER = "ULTRAEP_TEST_LAUNCH"


def launched_processes(marker: str) -> list[int]:
    """PIDs of the live processes whose environment carries ``LAUNCH_MARKER=marker``."""
    needle = f"{LAUNCH_MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as handle:
                zombie = handle.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle in environ and not zombie:
            found.append(int(entry))
    return found


def kill_launch(marker: str, process_group: int | None = None, timeout_s: float = 30.0) -> None:
    """SIGKILL every process of the launch ``marker`` (and ``process_group``) until none is left.

    torchrun starts each rank in a session of its own, so killing torchrun's process group leaves
    the ranks running, re-parented to init: each with hundreds of gloo threads, they slowed every
    later test on the machine tenfold. The marker in their inherited environment finds them; the
    warm launcher (``rank_launcher``) finds the ranks it forked for the command.
    """
    if process_group is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process_group, signal.SIGKILL)
    # Ranks the command launched through the warm launcher's shim are the launcher's children, forked
    # without a new environment: it kills them and confirms.
    rank_launcher.kill_marked(marker)
    deadline = time.monotonic() + timeout_s
    while (pids := launched_processes(marker)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def run_process_group(
    command: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, **kwargs)``,
    with every process the command starts (any depth, any session: :func:`kill_launch`) killed on a
    timeout or an interrupt.

    Raises:
        subprocess.TimeoutExpired: past ``timeout_s``, once they are all gone (with the output).
    """
    marker = uuid.uuid4().hex
    env = {**(os.environ if env is None else env), LAUNCH_MARKER: marker}
    with subprocess.Popen(
        command,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kwargs,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except BaseException as error:
            kill_launch(marker, process.pid)
            stdout, stderr = process.communicate()
            if isinstance(error, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(
                    command, timeout_s, output=stdout, stderr=stderr
                ) from None
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
