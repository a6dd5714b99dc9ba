"""The warm rank launcher's server (``rank_launcher`` is its client and says what a rank gets):
one process per test session that imports torch, megatron-core and the rest of ``PRELOAD`` once,
then forks a supervisor per launch, which forks the launch's ranks, waits for them (or for a kill,
or for the client going away), records the launch and replies.

    python tests/rank_server.py serve SOCKET STATS_FILE PARENT_PID    # started by rank_launcher
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
from typing import Optional, Sequence

from rank_launcher import LAUNCH_MARKER, PRELOAD, TERM_GRACE_S, launch_key


def _descendants(roots: Sequence[int]) -> list[int]:
    """Every live process below ``roots`` (by parent pid, whatever their session)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, stack = [], list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _kill_tree(pids: Sequence[int], timeout_s: float = 30.0) -> None:
    """SIGKILL ``pids`` and everything they started, until none is left."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in [*pids, *_descendants(pids)] if _alive(pid)]
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:  # reap our own children, so they stop being zombies
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class _Server:
    def __init__(self, path: str, stats: str, parent: int):
        self.path, self.stats, self.parent = path, stats, parent
        self.supervisors: dict[int, Optional[str]] = {}  # supervisor pid -> its launch's marker
        import warnings

        self.fresh_warning_filters = list(warnings.filters)  # before any import adds to them

    def preload(self) -> None:
        import importlib
        import warnings

        environ = dict(os.environ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            silencer = warnings.filters[0]
            for name in PRELOAD:
                importlib.import_module(name)
            # What the imports added (each rank has them, as an interpreter that imported these has).
            self.import_warning_filters = warnings.filters[: warnings.filters.index(silencer)]
            # Indexed once, lazily, by dynamo, before the CPU backend patches torch.cuda: the same in
            # every rank.
            from torch._dynamo import trace_rules

            trace_rules.get_torch_obj_rule_map()
            from ultraep_megatron.planner import BalancerConfig

            BalancerConfig().build().warm_up()  # numba's cached kernels, loaded once
        # What the imports put in the environment (torch's inductor cache directory, ...), which
        # each rank's own imports would have put in its environment where unset.
        self.import_environ = {k: v for k, v in os.environ.items() if environ.get(k) != v}
        # The interpreter's path as the imports left it (they may append to it), less this script's folder.
        self.base_sys_path = [
            p
            for p in sys.path
            if os.path.realpath(p) != os.path.realpath(os.path.dirname(__file__))
        ]

    def serve(self) -> None:
        threads = len(os.listdir("/proc/self/task"))
        if (
            threads != 1
        ):  # a fork copies the forking thread alone: another one's locks would be held
            print(f"refused: the preloaded imports started {threads - 1} thread(s)", flush=True)
            return
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(16)
        listener.settimeout(1.0)
        print("ready", flush=True)
        while os.getppid() == self.parent or self.parent == 0:
            self._reap()
            try:
                connection, _ = listener.accept()
            except socket.timeout:
                continue
            with connection:
                data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
                while not data.endswith(b"\n"):
                    more = connection.recv(1 << 20)
                    if not more:
                        break
                    data += more
                message = json.loads(data)
                if "kill_marker" in message:
                    self._kill_marker(message["kill_marker"])
                    connection.sendall(b'{"killed": true}\n')
                    continue
                supervisor = os.fork()
                if supervisor == 0:
                    listener.close()
                    try:
                        _Supervisor(self, message, connection, fds).run()
                    finally:
                        os._exit(0)
                self.supervisors[supervisor] = message["env"].get(LAUNCH_MARKER)
                for fd in fds:
                    os.close(fd)
        _kill_tree(list(self.supervisors))  # the test session is gone

    def _reap(self) -> None:
        for pid in list(self.supervisors):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    del self.supervisors[pid]

    def _kill_marker(self, marker: str) -> None:
        """Kill the ranks of the launches carrying ``marker``; their supervisors record and reply."""
        launches = [
            pid for pid, launch_marker in self.supervisors.items() if launch_marker == marker
        ]
        _kill_tree(_descendants(launches))
        deadline = time.monotonic() + 30
        while any(pid in self.supervisors for pid in launches) and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.02)


class _Supervisor:
    """One launch: forks the ranks, waits for them (or a kill, or the client going away), replies."""

    def __init__(
        self, server: _Server, message: dict, connection: socket.socket, fds: Sequence[int]
    ):
        self.server, self.message, self.connection = server, message, connection
        self.stdout, self.stderr = fds
        self.ranks: dict[int, int] = {}  # pid -> rank

    def run(self) -> int:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        start = time.monotonic()
        nproc = self.message["nproc"]
        torchrun = self.message.get("torchrun", True)
        port = self.message.get("master_port") or _free_port()
        run_id = os.urandom(8).hex()
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                self._run_rank(rank, nproc, port, run_id)  # never returns
            self.ranks[pid] = rank
        status, first_failure, killed = self._wait()
        seconds = time.monotonic() - start
        if not torchrun:  # the process's own status, as subprocess.run returns it
            status = -signal.SIGKILL if killed else (first_failure[1] if first_failure else 0)
        elif first_failure is not None and not killed:
            code = first_failure[1]
            if self.message.get("one_line_refusal"):  # the recipes' torchrun (rank_launcher)
                status = code if code > 0 else 1
            if status != 2 or not self.message.get("one_line_refusal"):
                self._print_failure(*first_failure)
        self._record(seconds, status, killed)
        with contextlib.suppress(OSError):
            self.connection.sendall(
                (json.dumps({"status": status, "killed": killed}) + "\n").encode()
            )
        return status

    def _wait(self) -> tuple[int, Optional[tuple], bool]:
        """(torchrun's status, (rank, exit code, pid, time) of the first failure, killed)."""
        import select

        running, first_failure = dict(self.ranks), None
        terminate_at = None
        self.connection.setblocking(False)
        while running:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid in running:
                rank = running.pop(pid)
                code = os.waitstatus_to_exitcode(wait_status)
                if code != 0 and first_failure is None:
                    first_failure = (rank, code, pid, time.time())
                    for other in running:  # torchrun stops the others
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(other, signal.SIGTERM)
                    terminate_at = time.monotonic() + TERM_GRACE_S
                continue
            if terminate_at is not None and time.monotonic() > terminate_at:
                _kill_tree(list(running))
                terminate_at = None
            readable, _, _ = select.select([self.connection], [], [], 0.05)
            if readable:
                with contextlib.suppress(OSError):
                    self.connection.recv(65536)
                # A kill request, or the client gone (a timed-out or interrupted test, a killed shim).
                _kill_tree(list(self.ranks))
                self.connection.setblocking(True)
                return -signal.SIGKILL, first_failure, True
        return (0 if first_failure is None else 1), first_failure, False

    def _print_failure(self, rank: int, code: int, pid: int, when: float) -> None:
        """torchrun's summary of a failed launch (the lines tests read)."""
        script = self.message["script"]
        text = (
            f"{'=' * 60}\n{script} FAILED\n{'-' * 60}\nFailures:\n  <NO_OTHER_FAILURES>\n{'-' * 60}\n"
            f"Root Cause (first observed failure):\n[0]:\n"
            f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S', time.localtime(when))}\n"
            f"  host      : {socket.gethostname()}\n"
            f"  rank      : {rank} (local_rank: {rank})\n"
            f"  exitcode  : {code} (pid: {pid})\n"
            f"  error_file: <N/A>\n"
            f"  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n"
            f"{'=' * 60}\n"
        )
        with contextlib.suppress(OSError):
            os.write(self.stderr, text.encode())

    def _record(self, seconds: float, status: int, killed: bool) -> None:
        env = self.message["env"]
        record = {
            "script": os.path.basename(self.message["script"]),
            "nproc": self.message["nproc"],
            "seconds": round(seconds, 3),
            "status": status,
            "killed": killed,
            "warm": True,
            "test": env.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
            "launch": launch_key(
                self.message["script"], self.message["nproc"], self.message["args"], env
            ),
        }
        with open(self.server.stats, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def _run_rank(self, rank: int, nproc: int, port: int, run_id: str) -> None:
        """In the forked rank: become what torchrun's worker would be (or, without torchrun, what
        ``python SCRIPT`` would be), then run the script."""
        torchrun = self.message.get("torchrun", True)
        try:
            if torchrun:
                os.setsid()
            else:  # its own process group all the same: the supervisor kills it with what it started
                os.setpgid(0, 0)
            self.connection.close()
            os.dup2(self.stdout, 1)
            os.dup2(self.stderr, 2)
            os.close(self.stdout)
            os.close(self.stderr)
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
                signal.signal(
                    signum,
                    signal.SIG_DFL if signum != signal.SIGINT else signal.default_int_handler,
                )
            env = dict(self.message["env"])
            if torchrun:
                env.update(self._torchrun_variables(rank, nproc, port, run_id))
                env.setdefault("OMP_NUM_THREADS", "1")
            for name, value in self.server.import_environ.items():
                env.setdefault(name, value)
            os.environ.clear()
            os.environ.update(env)
            os.chdir(self.message["cwd"])
            self._fresh_interpreter_state(env)
            rules_dir = env.get("ULTRAEP_NCCL_RULES_DIR")
            if rules_dir:  # tests/nccl_rules.py: every distributed operation recorded, then written
                import atexit

                import nccl_rules

                nccl_rules.install()
                atexit.register(nccl_rules.dump, rules_dir, rank)
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(1)
        _run_script(self.message["script"], self.message["args"], self.server.base_sys_path, env)

    @staticmethod
    def _torchrun_variables(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
        """What torchrun's agent sets for a worker (``torch.distributed.elastic``'s local agent)."""
        return dict(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            ROLE_RANK=str(rank),
            ROLE_NAME="default",
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_WORLD_SIZE="1",
            ROLE_WORLD_SIZE=str(nproc),
            MASTER_ADDR="localhost",
            MASTER_PORT=str(port),
            TORCHELASTIC_RUN_ID=run_id,
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
            TORCHELASTIC_USE_AGENT_STORE="False",
            TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        )

    def _fresh_interpreter_state(self, env: dict[str, str]) -> None:
        import io
        import random
        import warnings

        import numpy
        import torch

        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdout = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), write_through=unbuffered, line_buffering=False
        )
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False),
            write_through=True,
            line_buffering=False,
            errors="backslashreplace",
        )
        # A fresh interpreter's defaults, the launch's PYTHONWARNINGS before them, then what the
        # imports added.
        warnings.filters[:] = self.server.fresh_warning_filters
        sys.warnoptions[:] = [o for o in env.get("PYTHONWARNINGS", "").split(",") if o]
        warnings._processoptions(sys.warnoptions)
        warnings.filters[:0] = self.server.import_warning_filters
        warnings._filters_mutated()
        random.seed()
        numpy.random.seed()
        torch.seed()


def _run_script(
    script: str, args: Sequence[str], base_sys_path: Sequence[str], env: dict[str, str]
) -> None:
    """As ``python SCRIPT ARGS`` would (sys.path: the script's folder, PYTHONPATH, the rest), with
    fast_exit's ending: exit handlers run, Python's teardown skipped."""
    import atexit
    import runpy
    import threading

    script = os.path.abspath(script)
    pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = [
        p
        for p in base_sys_path
        if p not in pythonpath and os.path.realpath(p) not in map(os.path.realpath, pythonpath)
    ]
    sys.path[:] = [os.path.dirname(script), *pythonpath, *rest]
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exit_request:
        code = exit_request.code
        if code is None:
            status = 0
        elif isinstance(code, int):
            status = code
        else:
            print(code, file=sys.stderr)
            status = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


def main(argv: Sequence[str]) -> None:
    if argv[:1] != ["serve"] or len(argv) != 4:
        raise SystemExit(f"usage: {sys.argv[0]} serve SOCKET STATS_FILE PARENT_PID")
    server = _Server(argv[1], argv[2], int(argv[3]))
    server.preload()
    server.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
