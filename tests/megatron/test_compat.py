"""ultraep_megatron/megatron/release/compat.py: the megatron-core release the integration runs on, read
without importing megatron.core; what each release refuses (the startup check's own refusal on 0.18
is test_capabilities.py's ``mtp_full_recompute``); and the two locks, which differ only where the
releases need it.

Runs in the whole suite (0.19) and in CI's megatron-core 0.18 run, where ``ULTRAEP_MCORE=0.18``
is set: the environment must then really hold 0.18 (a broken layered environment would otherwise
test 0.19 twice).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ultraep_megatron.megatron.release import compat

REPO = Path(__file__).resolve().parents[2]
PIN = re.compile(
    r"^([A-Za-z0-9_.-]+)==(\S+) \\\n((?:    --hash=sha256:[0-9a-f]{64}(?: \\\n|\n))+)", re.M
)


def test_the_version_is_the_installed_distributions_and_read_without_importing_megatron():
    probe = (
        "import sys, json, importlib.metadata\n"
        "from ultraep_megatron.megatron.release import compat\n"
        "read = compat.mcore_version()\n"
        "print(json.dumps([read, 'megatron.core' in sys.modules, 'torch' in sys.modules,\n"
        "                  importlib.metadata.version('megatron-core')]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    read, megatron_imported, torch_imported, version = json.loads(
        done.stdout.strip().splitlines()[-1]
    )
    assert not megatron_imported and not torch_imported
    assert ".".join(map(str, read)) == version


def test_the_release_is_the_one_asked_for():
    asked = os.environ.get("ULTRAEP_MCORE")
    if asked is None:
        pytest.skip("ULTRAEP_MCORE not set (the default environment: megatron-core 0.19)")
    assert compat.release() == asked


def test_only_supported_releases_run(monkeypatch):
    assert compat.unsupported_release_problem() is None  # the installed one
    for version, supported in (
        ((0, 17, 1), False),
        ((0, 18, 0), True),
        ((0, 19, 9), True),
        ((0, 20, 0), False),
    ):
        monkeypatch.setattr(compat, "mcore_version", lambda v=version: v)
        problem = compat.unsupported_release_problem()
        assert (problem is None) == supported, (version, problem)
        if problem:
            assert problem.startswith(
                f"megatron-core {'.'.join(map(str, version))} is not supported"
            )
            assert "0.18.x and 0.19.x" in problem
            assert compat.release_problems(object()) == [problem]


def test_the_startup_check_names_an_unsupported_release(monkeypatch):
    """What ``pretrain_gpt.py`` and ``ultraep check-recipe`` report (arguments.ultraep_arg_problems)."""
    from types import SimpleNamespace

    from ultraep_megatron.megatron.release import capabilities

    config = SimpleNamespace(moe_token_dispatcher_type="alltoall")
    assert capabilities.unsupported_moe_settings(config) == []
    monkeypatch.setattr(compat, "mcore_version", lambda: (0, 20, 0))
    assert capabilities.unsupported_moe_settings(config) == [compat.unsupported_release_problem()]


#: The start of the refusal (the real startup check's, on 0.18: test_capabilities.py's mtp_full_recompute).
MTP_FULL_RECOMPUTE = (
    "--mtp-num-layers with --recompute-granularity full is not supported on megatron-core 0.18"
)


def test_the_018_refusals_apply_on_018_only(monkeypatch):
    from types import SimpleNamespace

    from ultraep_megatron.megatron.release import capabilities

    config = SimpleNamespace(
        moe_token_dispatcher_type="alltoall", mtp_num_layers=1, recompute_granularity="full"
    )
    selective = SimpleNamespace(**{**vars(config), "recompute_granularity": "selective"})
    for version, refused in (((0, 18, 2), True), ((0, 19, 2), False)):
        monkeypatch.setattr(compat, "mcore_version", lambda v=version: v)
        problems = capabilities.unsupported_moe_settings(config)
        assert [p.startswith(MTP_FULL_RECOMPUTE) for p in problems] == (
            [True] if refused else []
        ), problems
        assert capabilities.unsupported_moe_settings(selective) == []


def locked(path: Path) -> dict[str, str]:
    """name -> the requirement's lines (version and hashes) of a hashed lock."""
    text = path.read_text()
    found = {m[1].lower(): m[0] for m in PIN.finditer(text)}
    requirements = [line for line in text.splitlines() if line and line[0] not in "# "]
    assert len(found) == len(requirements), "a requirement without a sha256"
    return found


def test_the_locks_differ_in_megatron_core_alone():
    """The 0.18 lock keeps every other version of lock.txt (torch included): its environment is
    the main one plus megatron-core 0.18 (tools/ensure_env.sh installs only what differs)."""
    main, mcore018 = (
        locked(REPO / "requirements" / "lock.txt"),
        locked(REPO / "requirements" / "lock-mcore018.txt"),
    )
    assert main.keys() == mcore018.keys()
    differing = sorted(name for name in main if main[name] != mcore018[name])
    assert differing == ["megatron-core"]
    assert re.match(r"megatron-core==0\.19\.\d+ ", main["megatron-core"])
    assert re.match(r"megatron-core==0\.18\.\d+ ", mcore018["megatron-core"])
