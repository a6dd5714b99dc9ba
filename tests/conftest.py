"""Puts tests/ and each of its folders on the import path: the helpers every folder shares
(``processes.py``) and each folder's own (``<folder>_helpers.py`` and the like). Test modules are
imported by path (``--import-mode=importlib``), so a test file is named after the module it tests
(``tests/planner/test_solve.py`` for ``ultraep_megatron/planner/solve.py``) whatever other folders
hold."""

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
_SKIPPED = {"data", "workers", "__pycache__"}  # fixtures and subprocess scripts, not helpers

for _folder in [
    _TESTS,
    *sorted(
        p
        for p in _TESTS.rglob("*")
        if p.is_dir() and not _SKIPPED & set(p.relative_to(_TESTS).parts)
    ),
]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


# -- what the run cost: the slowest items and the multi-rank launches ------------------------------

import os  # noqa: E402
import tempfile  # noqa: E402

import rank_launcher  # noqa: E402

_ITEM_SECONDS: dict[str, float] = {}


def pytest_configure(config):
    if not os.environ.get(rank_launcher.STATS_ENV):
        handle, path = tempfile.mkstemp(prefix="ultraep_launches_", suffix=".jsonl")
        os.close(handle)
        os.environ[rank_launcher.STATS_ENV] = path


def pytest_unconfigure(config):
    rank_launcher.stop_server()


def pytest_runtest_logreport(report):
    _ITEM_SECONDS[report.nodeid] = _ITEM_SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The 15 slowest items (set-up, call and tear-down together: a fixture that trains counts for
    the first test using it) and the multi-rank launches with their summed wall time."""
    write = terminalreporter.write_line
    if _ITEM_SECONDS:
        terminalreporter.section("15 slowest items (set-up + call + tear-down)")
        for nodeid, seconds in sorted(_ITEM_SECONDS.items(), key=lambda item: -item[1])[:15]:
            write(f"{seconds:8.1f} s  {nodeid}")
    launches = rank_launcher.read_stats()
    if rank_launcher.unavailable:
        terminalreporter.section("multi-rank launches")
        write(
            f"the warm rank launcher did not start ({rank_launcher.unavailable}): every launch was cold"
        )
    if launches:
        terminalreporter.section("multi-rank launches")
        warm = [launch for launch in launches if launch.get("warm")]
        total = sum(launch["seconds"] for launch in launches)
        write(
            f"{len(launches)} launches ({len(warm)} warm, {len(launches) - len(warm)} cold), "
            f"{sum(launch['nproc'] for launch in launches)} ranks, {total:.0f} s of wall time in all"
        )
        by_test: dict[str, list[float]] = {}
        for launch in launches:
            by_test.setdefault(launch.get("test") or "(outside a test)", []).append(
                launch["seconds"]
            )
        for test, seconds in sorted(by_test.items(), key=lambda item: -sum(item[1]))[:10]:
            write(f"{sum(seconds):8.1f} s  {len(seconds):3d} launch(es)  {test}")
        # The same run launched twice (a reference two tests could share) shows here.
        runs: dict[str, list[dict]] = {}
        for launch in launches:
            if launch.get("launch") and launch.get("status") == 0:
                runs.setdefault(launch["launch"], []).append(launch)
        repeated = {key: same for key, same in runs.items() if len(same) > 1}
        write(
            f"runs launched more than once: {len(repeated)}"
            + (
                ""
                if not repeated
                else ", ".join(
                    f" {same[0]['script']} x{len(same)} ({', '.join(sorted({l['test'] for l in same}))})"
                    for same in repeated.values()
                )
            )
        )
