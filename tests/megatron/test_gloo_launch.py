"""The test launcher leaves nothing running behind a timed-out job: not the job's children, not
torchrun's ranks, which torchrun starts in sessions of their own, not the ranks the warm launcher
forked; and a warm rank gets what a torchrun rank gets."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

import rank_launcher
from gloo_launch import WORKERS, gloo_env, launch_gloo_ranks, run_process_group, run_ranks

# A parent that starts a long-lived child in a session of its own (as torchrun starts its ranks)
# and reports its pid.
SPAWNER = (
    "import subprocess, sys, time; "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], "
    "start_new_session=True); "
    "print(child.pid, flush=True); time.sleep(300)"
)


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
    completed = run_process_group(
        [
            sys.executable,
            "-c",
            "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)",
        ],
        timeout_s=60,
    )
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


def _probe(tmp_path, name, env=None, nproc=2):
    out = tmp_path / name
    out.mkdir()
    completed = run_ranks(WORKERS / "launch_probe.py", nproc, [str(out)], env=env, timeout_s=300)
    return completed, [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


#: What torchrun's agent puts in a worker's environment for its own machinery (error files, its
#: store, NCCL defaults), which a warm rank, launched without the agent, does not get.
AGENT_ONLY = {
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_TIMER_FILE",
    "TORCHELASTIC_HEALTH_CHECK_PORT",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "NCCL_ASYNC_ERROR_HANDLING",
    # this test's own: the cold launch's switch and run_process_group's marker
    rank_launcher.COLD_ENV,
    rank_launcher.LAUNCH_MARKER,
}


def test_a_warm_rank_gets_what_a_torchrun_rank_gets(tmp_path, monkeypatch):
    """The same probe launched by torchrun and by the warm launcher: the same worker variables,
    sys.path, argv, working directory, warning filters, a session of its own and generators seeded
    per process."""
    monkeypatch.setenv(rank_launcher.COLD_ENV, "1")
    cold_run, cold = _probe(tmp_path, "cold")
    monkeypatch.delenv(rank_launcher.COLD_ENV)
    warm_run, warm = _probe(tmp_path, "warm")
    launches = rank_launcher.read_stats()
    assert [l["warm"] for l in launches if l["script"] == "launch_probe.py"][-2:] == [False, True]
    for rank, (c, w) in enumerate(zip(cold, warm)):
        missing = set(c["env"]) - set(w["env"]) - AGENT_ONLY
        assert not missing, f"torchrun sets {sorted(missing)}, the warm launcher does not"
        for name in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "ROLE_RANK",
            "MASTER_ADDR",
            "OMP_NUM_THREADS",
            "PYTHONPATH",
            "GLOO_SOCKET_IFNAME",
        ):
            assert w["env"].get(name) == c["env"].get(name), name
        assert w["env"]["RANK"] == str(rank)
        for key in ("path", "cwd", "warning_filters", "main_module"):
            assert w[key] == c[key], key
        assert (w["argv"], c["argv"]) == (
            [str(WORKERS / "launch_probe.py"), str(tmp_path / "warm")],
            [str(WORKERS / "launch_probe.py"), str(tmp_path / "cold")],
        )
        assert w["session_leader"] and c["session_leader"]
    assert len({r["torch_seed"] for r in warm}) == len(warm)  # not the server's generator, shared
    for line in ("probe rank 0 out", "probe rank 1 err"):
        assert line in warm_run.stdout + warm_run.stderr
    assert (warm_run.returncode, cold_run.returncode) == (0, 0)


def test_a_failing_rank_fails_the_launch_as_torchrun_reports_it(tmp_path):
    """Rank 1 exits with status 3 while rank 0 waits: rank 0 is stopped, the launch fails with
    torchrun's status and summary naming the first failure."""
    start = time.monotonic()
    completed, _ = _probe(tmp_path, "failing", env={"FAIL_RANK": "1"})
    assert completed.returncode == 1
    assert (
        "exitcode  : 3" in completed.stderr and "rank      : 1 (local_rank: 1)" in completed.stderr
    )
    assert time.monotonic() - start < 60  # rank 0's sleep of 600 s was cut short


def test_a_timed_out_script_leaves_no_rank_of_its_shim_launch_behind(tmp_path):
    """A bash script launching through $ULTRAEP_PYTHON (the warm launcher's shim, as the recipes
    do) times out: its ranks, forked by the launcher rather than started by the script, are killed
    all the same."""
    script = f'exec "$ULTRAEP_PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 {WORKERS / "hang.py"} {tmp_path}'
    env = gloo_env({"ULTRAEP_PYTHON": rank_launcher.shim_python()})
    with pytest.raises(subprocess.TimeoutExpired):
        run_process_group(["bash", "-c", script], env=env, timeout_s=20)
    ranks = [tuple(map(int, p.read_text().split())) for p in sorted(tmp_path.glob("rank*.pid"))]
    assert len(ranks) == 2, "both ranks started before the timeout"
    assert not any(_alive(pid) for pid, _ in ranks), "a rank outlived its launch's timeout"
    launches = [
        l
        for l in rank_launcher.read_stats()
        if l["test"].endswith("::test_a_timed_out_script_leaves_no_rank_of_its_shim_launch_behind")
    ]
    assert [(l["script"], l["warm"], l["killed"]) for l in launches] == [("hang.py", True, True)]
