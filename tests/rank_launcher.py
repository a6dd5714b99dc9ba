"""The tests' warm rank launcher: torchrun's local launch, with every rank forked from a server that
has already imported torch and megatron-core.

A cold launch (``python -m torch.distributed.run``) costs each rank a fresh interpreter importing
torch, megatron-core and megatron's training package (about 5 s of CPU per rank here), before the
test's work starts; 4-8 ranks share 2 cores. The server imports them once per test session and
forks the ranks of every launch from itself, so a launch costs its work.

What a rank gets is what torchrun gives it (``torch.distributed.run --standalone``, one node):

* the environment the launch asked for, plus torchrun's worker variables (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ...); rank 0 hosts the rendezvous store
  (``init_process_group``'s ``env://``);
* a session of its own, as torchrun starts each rank (a process-group kill of the launcher does
  not reach it: the launcher kills every rank itself);
* the script run as ``__main__`` with its directory first on ``sys.path`` (the launch's
  ``PYTHONPATH`` after it), Python's teardown skipped as ``megatron/fast_exit.py`` does;
* what a fresh interpreter has: reseeded torch, numpy and ``random`` generators, the warning filters
  of a fresh interpreter with the launch's ``PYTHONWARNINGS``, its own stdout/stderr;
* torchrun's failure handling: when a rank fails, the others get SIGTERM, then SIGKILL, and the
  launch fails with torchrun's status 1 and its summary (``exitcode  : N``) naming the first rank
  that failed.

Not served (the client runs real torchrun instead, see :func:`servable`): another interpreter than
the server's, a machine with CUDA (its driver, initialized by the imports, does not survive a
fork), more than one node, torchrun options beyond the local ones, a ``PYTHONPATH`` that would
import another copy of a preloaded package, or ``ULTRAEP_COLD_LAUNCH=1`` (every launch cold, to
compare).

Three ways in:

* :func:`launch` from the test process (``gloo_launch.launch_gloo_ranks`` and ``megatron_runs``);
* the ``shim`` command, installed as ``ULTRAEP_PYTHON`` for scripts that launch through
  ``$ULTRAEP_PYTHON -m torch.distributed.run`` (the recipes, the main job): a torchrun command line
  goes to the server with the shim's own stdout/stderr, anything else runs the real interpreter;
* :func:`kill_marked` from ``processes.kill_launch``: a timed-out command's ranks, found by the
  launch marker its shim passed on.

On a timeout, an interrupt, or a client that goes away (its connection closes), the server kills the
launch's ranks and every process they started (any session), and confirms.
Every launch appends a line (script, ranks, wall seconds, status, test) to the session's statistics
file, which ``tests/conftest.py`` summarizes at the end of the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

#: Where the server of this test session listens (set in the test process's environment, so that
#: scripts it runs, and their shims, find it).
SOCKET_ENV = "ULTRAEP_RANK_LAUNCHER"
#: The real interpreter behind the shim.
REAL_PYTHON_ENV = "ULTRAEP_REAL_PYTHON"
#: Set to 1: every launch is a cold torchrun (to compare, or to rule the launcher out).
COLD_ENV = "ULTRAEP_COLD_LAUNCH"
#: The statistics file (one JSON line per launch).
STATS_ENV = "ULTRAEP_LAUNCH_STATS"
#: processes.LAUNCH_MARKER, repeated here: this module runs as a script without tests/ on its path.
LAUNCH_MARKER = "ULTRAEP_TEST_LAUNCH"

SHIM = Path(__file__).resolve().parent / "warm_python"
#: The server's script (``rank_server.py``: the server, each launch's supervisor, the ranks).
SERVER = Path(__file__).resolve().parent / "rank_server.py"
REPO_ROOT = Path(__file__).resolve().parents[1]

#: What the server imports once (in this order): torch, megatron-core and megatron's training
#: package, matplotlib (the dashboards' heatmaps; the backend is chosen where it is used), and of the
#: package under test only its planner, whose compiled kernels each rank would otherwise load from
#: numba's cache. Each import here must start no thread (a fork copies only the forking one).
PRELOAD = (
    "torch",
    "torch.distributed",
    "numpy",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.training",
    "megatron.training.training",
    "megatron.training.arguments",
    "matplotlib.pyplot",
    "ultraep_megatron.planner",
)
#: Top-level packages the server holds: a launch whose PYTHONPATH would find another copy of one
#: is not served.
PRELOADED_PACKAGES = ("torch", "numpy", "megatron", "ultraep_megatron")

#: Seconds a rank gets to exit after SIGTERM once another rank failed (torchrun: 30).
TERM_GRACE_S = 5.0
#: torchrun's local options the launcher understands (value-taking ones), the rest is refused.
_TORCHRUN_VALUE_OPTIONS = {
    "--nproc-per-node",
    "--nproc_per_node",
    "--nnodes",
    "--node-rank",
    "--node_rank",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
    "--max-restarts",
    "--max_restarts",
    "--rdzv-backend",
    "--rdzv_backend",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--rdzv-id",
    "--rdzv_id",
    "--monitor-interval",
    "--monitor_interval",
}
_TORCHRUN_FLAGS = {"--standalone"}


# -- the client side --------------------------------------------------------------------------------


def enabled() -> bool:
    return os.environ.get(COLD_ENV, "") not in ("1", "true", "yes")


def servable(python: str, env: dict[str, str]) -> bool:
    """Whether a launch with interpreter ``python`` and environment ``env`` can be forked from this
    session's server: the same interpreter, and no ``PYTHONPATH`` entry outside the server's that
    holds a package the server has already imported."""
    if not enabled() or os.path.realpath(python) != os.path.realpath(sys.executable):
        return False
    import torch

    if torch.cuda.is_available():  # CUDA is not fork-safe once imports have initialized its driver
        return False
    served = {os.path.realpath(p) for p in _server_pythonpath()}
    for entry in filter(None, env.get("PYTHONPATH", "").split(os.pathsep)):
        real = os.path.realpath(entry)
        if real not in served and any(Path(real, name).exists() for name in PRELOADED_PACKAGES):
            return False
    return available()


#: Why the server could not start in this session (then every launch is cold), or None.
unavailable: Optional[str] = None


def available() -> bool:
    """Whether this session's server runs (started on first use); if it cannot start, every launch
    of the session is cold and :data:`unavailable` says why."""
    global unavailable
    if unavailable is None:
        try:
            server_socket()
        except (OSError, RuntimeError) as error:
            unavailable = str(error)
    return unavailable is None


def _server_pythonpath() -> list[str]:
    return [str(REPO_ROOT)]


_server: Optional[subprocess.Popen] = None


def server_socket() -> str:
    """The socket of this session's server, started on first use (it imports for ~10 s)."""
    global _server
    if _server is not None and _server.poll() is None:
        return os.environ[SOCKET_ENV]
    directory = tempfile.mkdtemp(prefix="ultraep_ranks_")
    path = os.path.join(directory, "launcher.sock")
    stats = os.environ.get(STATS_ENV) or os.path.join(directory, "launches.jsonl")
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(_server_pythonpath())
    )
    env.pop("PYTHONWARNINGS", None)  # each rank applies its launch's own
    env.pop(LAUNCH_MARKER, None)
    _server = subprocess.Popen(
        [sys.executable, str(SERVER), "serve", path, stats, str(os.getpid())],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )
    # Lines an import printed before the server's answer are skipped, not taken for the answer
    # (seen once: the launcher then waited for a server that was serving).
    printed, answer = [], ""
    for line in _server.stdout:
        answer = line.strip()
        if answer == "ready" or answer.startswith("refused"):
            break
        printed.append(answer)
    if answer != "ready":
        with contextlib.suppress(ProcessLookupError):
            os.killpg(_server.pid, signal.SIGKILL)
        _server.wait()
        _server = None
        said = "; ".join(printed[-3:] + ([answer] if answer else [])) or "no answer"
        raise RuntimeError(f"the warm rank launcher did not start: {said}")
    os.environ[SOCKET_ENV], os.environ[STATS_ENV] = path, stats
    os.environ[REAL_PYTHON_ENV] = sys.executable
    return path


def stop_server() -> None:
    global _server
    if _server is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(_server.pid, signal.SIGKILL)
        _server.wait()
        _server = None


def shim_python() -> str:
    """``ULTRAEP_PYTHON`` for scripts that launch with ``$ULTRAEP_PYTHON -m torch.distributed.run``
    (the server started), or the real interpreter when launches are cold."""
    return str(SHIM) if servable(sys.executable, dict(os.environ)) else sys.executable


def _request(path: str, message: dict, fds: Sequence[int] = ()) -> socket.socket:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    data = (json.dumps(message) + "\n").encode()
    socket.send_fds(connection, [data], list(fds)) if fds else connection.sendall(data)
    return connection


def _read_line(connection: socket.socket, timeout_s: Optional[float]) -> Optional[dict]:
    """The next JSON line, or None past the timeout."""
    connection.settimeout(timeout_s)
    data = b""
    try:
        while not data.endswith(b"\n"):
            chunk = connection.recv(65536)
            if not chunk:
                raise ConnectionError("the warm rank launcher closed the connection")
            data += chunk
    except socket.timeout:
        return None
    return json.loads(data)


def launch(
    script: str | os.PathLike,
    nproc: int,
    args: Sequence[str],
    *,
    env: dict[str, str],
    cwd: str | os.PathLike,
    timeout_s: Optional[float],
    stdout: int,
    stderr: int,
    master_port: Optional[int] = None,
    torchrun: bool = True,
) -> int:
    """Run ``script args`` on ``nproc`` local ranks forked from the server, writing to the file
    descriptors ``stdout``/``stderr``; return torchrun's exit status (0, or 1 when a rank failed).
    With ``torchrun=False``: one process, as ``python script args`` (no torchrun variables, no
    session of its own), and its own exit status.

    Raises:
        subprocess.TimeoutExpired: past ``timeout_s``, once every rank (and whatever it started)
            is gone.
    """
    if not torchrun and nproc != 1:
        raise ValueError("a launch without torchrun is one process")
    message = {
        "script": os.fspath(script),
        "args": [str(a) for a in args],
        "nproc": nproc,
        "env": env,
        "cwd": os.fspath(cwd),
        "master_port": master_port,
        "torchrun": torchrun,
    }
    connection = _request(server_socket(), message, [stdout, stderr])
    with connection:
        try:
            reply = _read_line(connection, timeout_s)
        except BaseException:  # an interrupt: the ranks go with the connection
            _kill_on(connection)
            raise
        if reply is None:
            _kill_on(connection)
            raise subprocess.TimeoutExpired([script, *args], timeout_s)
    return reply["status"]


def _kill_on(connection: socket.socket) -> None:
    """Ask the launch's supervisor to kill its ranks, and wait until it says they are gone."""
    with contextlib.suppress(OSError):
        connection.sendall(b'{"kill": true}\n')
        _read_line(connection, 60)


def kill_marked(marker: str) -> None:
    """Kill the ranks of every launch whose environment carried ``LAUNCH_MARKER=marker`` (launched
    through the shim by a command that timed out), and wait until they are gone."""
    path = os.environ.get(SOCKET_ENV)
    if not path or _server is None or _server.poll() is not None:
        return
    with contextlib.suppress(OSError), _request(path, {"kill_marker": marker}) as connection:
        _read_line(connection, 60)


def launch_key(script: str, nproc: int, args: Sequence[str], env: dict[str, str]) -> str:
    """What makes two launches the same run: script, ranks, arguments and the ``ULTRAEP_*``
    variables (the tests' switches), with the launch's own directories (pytest's temporary ones)
    left out, so that a run launched twice shows as a duplicate."""
    import hashlib
    import re

    temporary = re.compile(r"/tmp/pytest-of-[^/]+/pytest-\d+/[^/\s]+")
    switches = sorted(
        (k, v)
        for k, v in env.items()
        if k.startswith("ULTRAEP_")
        and k
        not in (
            LAUNCH_MARKER,
            SOCKET_ENV,
            STATS_ENV,
            REAL_PYTHON_ENV,
            COLD_ENV,
            "ULTRAEP_GRAD_DUMP_DIR",
        )
    )
    text = json.dumps(
        [
            os.path.basename(script),
            nproc,
            [temporary.sub("TMP", str(a)) for a in args],
            [(k, temporary.sub("TMP", v)) for k, v in switches],
        ]
    )
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def record_launch(stats: dict) -> None:
    """Append one launch's statistics (a cold one: the warm ones are the server's to record)."""
    path = os.environ.get(STATS_ENV)
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps(stats) + "\n")


def read_stats(path: Optional[str] = None) -> list[dict]:
    path = path or os.environ.get(STATS_ENV)
    if not path or not os.path.exists(path):
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# -- the shim ---------------------------------------------------------------------------------------


#: The recipes' torchrun (``ultraep_megatron/megatron/run/torchrun.py``): a first failure with exit
#: status 2 (a refusal, its one line already printed) ends the launch with status 2 and no summary;
#: any other with that rank's status and torchrun's summary.
ONE_LINE_TORCHRUN = "ultraep_megatron.megatron.run.torchrun"


def parse_torchrun(argv: Sequence[str]) -> Optional[dict]:
    """``-m torch.distributed.run OPTIONS SCRIPT ARGS`` (or :data:`ONE_LINE_TORCHRUN`) ->
    {nproc, master_port, script, args, one_line_refusal}, or
    None for anything the launcher does not serve (another module, several nodes, other options)."""
    if list(argv[:1]) != ["-m"] or argv[1:2] not in (
        ["torch.distributed.run"],
        [ONE_LINE_TORCHRUN],
    ):
        return None
    rest, nproc, port = list(argv[2:]), 1, None
    while rest and rest[0].startswith("--"):
        option, _, value = rest.pop(0).partition("=")
        if option in _TORCHRUN_FLAGS:
            continue
        if option not in _TORCHRUN_VALUE_OPTIONS:
            return None
        if not value:
            if not rest:
                return None
            value = rest.pop(0)
        key = option.lstrip("-").replace("_", "-")
        if key == "nproc-per-node":
            if not value.isdigit():
                return None
            nproc = int(value)
        elif key == "nnodes" and value not in ("1", "1:1"):
            return None
        elif key == "node-rank" and value != "0":
            return None
        elif key == "master-port":
            port = int(value)
        elif key == "max-restarts" and value != "0":
            return None
    if not rest or rest[0].startswith("-"):
        return None
    return {
        "nproc": nproc,
        "master_port": port,
        "script": rest[0],
        "args": rest[1:],
        "one_line_refusal": argv[1] == ONE_LINE_TORCHRUN,
    }


def parse_script(argv: Sequence[str]) -> Optional[dict]:
    """``SCRIPT.py ARGS`` (no interpreter option) -> a one-process launch, or None."""
    if (
        not argv
        or argv[0].startswith("-")
        or not argv[0].endswith(".py")
        or not os.path.isfile(argv[0])
    ):
        return None
    return {
        "nproc": 1,
        "master_port": None,
        "script": argv[0],
        "args": list(argv[1:]),
        "torchrun": False,
    }


def shim_main(argv: Sequence[str]) -> None:
    """The ``warm_python`` shim: a torchrun launch or a script to the server, anything else (``-c``,
    ``-m`` of another module, options) to the interpreter."""
    real = os.environ.get(REAL_PYTHON_ENV) or sys.executable
    launch_request = parse_torchrun(argv) or parse_script(argv)
    path = os.environ.get(SOCKET_ENV)
    if launch_request is None or not path or not os.path.exists(path):
        os.execv(real, [real, *argv])
    message = {
        "script": os.path.abspath(launch_request["script"]),
        "args": launch_request["args"],
        "nproc": launch_request["nproc"],
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "master_port": launch_request["master_port"],
        "torchrun": launch_request.get("torchrun", True),
        "one_line_refusal": launch_request.get("one_line_refusal", False),
    }
    sys.stdout.flush()
    sys.stderr.flush()
    connection = _request(path, message, [1, 2])
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the ranks go with the shim
        signal.signal(signum, lambda *_: os._exit(128 + signal.SIGTERM))
    reply = _read_line(connection, None)
    os._exit(reply["status"])


def main(argv: Sequence[str]) -> None:
    if argv[:1] == ["shim"]:
        shim_main(argv[1:])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} shim PYTHON_ARGS...")


if __name__ == "__main__":
    main(sys.argv[1:])
