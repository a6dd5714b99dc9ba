"""Launch N CPU ranks over gloo, for tests that run real megatron-core.

Each rank is a process of its own running a script (a worker under ``workers/`` or the
repository's ``pretrain_gpt.py``), so a test never shares megatron's global state with pytest.
The ranks are forked from the session's warm launcher (``rank_launcher``: torch and megatron-core
already imported), or started by torchrun where it cannot serve the launch (another interpreter,
``ULTRAEP_COLD_LAUNCH=1``). Workers hand results back through files in a directory the test owns.

Usage::

    from gloo_launch import REPO_ROOT, launch_gloo_ranks
    launch_gloo_ranks(WORKERS / "moe_layer_ep.py", nproc=4, args=["--out-dir", str(tmp_path)])
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import rank_launcher
from processes import run_process_group  # noqa: F401  (tests import it from here too)

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
#: The interpreter for ranks: $ULTRAEP_PYTHON if set, else the one running the tests.
PYTHON = os.environ.get("ULTRAEP_PYTHON", sys.executable)
FAST_EXIT = Path(__file__).resolve().parent / "fast_exit.py"


def gloo_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for CPU ranks: one thread each (two threads per rank on two cores ran 5x
    slower), the repository importable, wandb offline."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        WANDB_MODE="offline",
        PYTHONUNBUFFERED="1",
        # torchrun's c10d/gloo bind to loopback only.
        MASTER_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME=env.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    if extra:
        env.update(extra)
    return env


def torchrun_command(script: str | Path, nproc: int, args: Sequence[str] = ()) -> list[str]:
    """torchrun running ``script`` on ``nproc`` local ranks, each through fast_exit.py (its
    docstring: the script runs unchanged, Python's teardown is skipped)."""
    return [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(FAST_EXIT),
        str(script),
        *map(str, args),
    ]


def run_ranks(
    script: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
) -> subprocess.CompletedProcess:
    """``script args`` on ``nproc`` gloo ranks, warm (``rank_launcher``) where it can be served, else
    with torchrun; the combined status and output, failing or not.

    Raises:
        subprocess.TimeoutExpired: past ``timeout_s``, once every rank (and what it started) is gone.
    """
    env = gloo_env(env)
    if not rank_launcher.servable(PYTHON, env):
        start = time.monotonic()
        completed = run_process_group(
            torchrun_command(script, nproc, args), cwd=REPO_ROOT, env=env, timeout_s=timeout_s
        )
        rank_launcher.record_launch(
            {
                "script": Path(script).name,
                "nproc": nproc,
                "warm": False,
                "seconds": round(time.monotonic() - start, 3),
                "status": completed.returncode,
                "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
                "launch": rank_launcher.launch_key(str(script), nproc, args, env),
            }
        )
        return completed
    return _warm(script, nproc, args, env=env, cwd=REPO_ROOT, timeout_s=timeout_s, torchrun=True)


def run_python(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    env: dict[str, str],
    cwd: str | Path = REPO_ROOT,
    timeout_s: float = 300.0,
) -> subprocess.CompletedProcess:
    """``python script args`` as one process with environment ``env``, forked from the warm
    launcher where it can be served, else a fresh interpreter; its status and output (text).

    Raises:
        subprocess.TimeoutExpired: past ``timeout_s``, once it (and what it started) is gone.
    """
    if not rank_launcher.servable(PYTHON, env):
        return subprocess.run(
            [PYTHON, str(script), *map(str, args)],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    return _warm(script, 1, args, env=env, cwd=cwd, timeout_s=timeout_s, torchrun=False)


def _warm(script, nproc, args, *, env, cwd, timeout_s, torchrun) -> subprocess.CompletedProcess:
    """A launch through ``rank_launcher``, its output collected in temporary files."""
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:

        def output() -> tuple[str, str]:
            texts = []
            for handle in (stdout, stderr):
                handle.seek(0)
                texts.append(handle.read().decode(errors="replace"))
            return texts[0], texts[1]

        try:
            status = rank_launcher.launch(
                script,
                nproc,
                [str(a) for a in args],
                env=env,
                cwd=cwd,
                timeout_s=timeout_s,
                stdout=stdout.fileno(),
                stderr=stderr.fileno(),
                torchrun=torchrun,
            )
        except subprocess.TimeoutExpired as error:
            error.output, error.stderr = output()
            raise
        return subprocess.CompletedProcess([str(script), *map(str, args)], status, *output())


def launch_gloo_ranks(
    script: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
    log_path: str | Path | None = None,
) -> str:
    """Run ``script`` on ``nproc`` local ranks (:func:`run_ranks`); return the combined output.

    Args:
        script: Python file every rank runs.
        nproc: number of ranks (processes), each a gloo rank on the CPU.
        args: command-line arguments for the script.
        env: extra environment variables.
        timeout_s: wall-clock limit; the job and every process it started are killed past it
            (``processes.run_process_group``). The default leaves a wide margin over what the
            launches take on this project's 2-core machines: the longest, an 8-rank recipe
            variant of 6 iterations, about 40 s alone and 75 s with another job beside it, so
            600 s is 8x that, for a machine under other load.
        log_path: if given, the combined stdout/stderr is also written there.

    Returns:
        The combined stdout and stderr of all ranks.

    Raises:
        ValueError: for nproc < 1.
        RuntimeError: when the job fails or times out (with the tail of its output).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    try:
        completed = run_ranks(script, nproc, args, env=env, timeout_s=timeout_s)
    except subprocess.TimeoutExpired as error:
        output = (error.stdout or "") + (error.stderr or "")
        if isinstance(output, bytes):
            output = output.decode(errors="replace")
        raise RuntimeError(f"{script} timed out after {timeout_s} s:\n{output[-6000:]}") from error
    output = completed.stdout + completed.stderr
    if log_path is not None:
        Path(log_path).write_text(output)
    if completed.returncode != 0:
        raise RuntimeError(
            f"{script} on {nproc} ranks exited with {completed.returncode}:\n{output[-8000:]}"
        )
    return output
