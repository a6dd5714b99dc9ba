#!/usr/bin/env python3
"""Regenerate the hashed locks: requirements/lock.txt, the exact dependency set of `.[dev]` that
tools/ensure_env.sh (the README's environment) and CI install, and requirements/lock-mcore018.txt,
the same set with megatron-core 0.18 (`ULTRAEP_MCORE=0.18 bash tools/ensure_env.sh`).

    python tools/update_lock.py                  # both: newest versions allowed by pyproject.toml
    python tools/update_lock.py -c freeze.txt    # or pinned by a constraints file (e.g. a `pip freeze`)
    python tools/update_lock.py --only mcore018  # only the 0.18 lock, from the current lock.txt
    python tools/update_lock.py --only bridge    # Megatron-Bridge's layer, re-hashed

requirements/lock-bridge.txt is lock.txt's lines, then, below its marker line, megatron-bridge and
the packages its imports need, pinned by hand (Bridge is installed without its declared
dependencies, which pull CUDA-only packages); `--only bridge` re-hashes those pins (prebuilt wheels,
no dependencies) after lock.txt's current lines.

The 0.18 lock keeps every version of lock.txt that megatron-core 0.18 allows (torch included), so
its environment can be layered on the main one and install only the lines that differ.

pip resolves the project in dry-run mode for a fresh CPython 3.12 environment on this platform
(Linux x86_64: the README's environment and CI) and reports the chosen files with their sha256;
nothing is installed. Run it with Python 3.12 after changing the dependency ranges.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKS = {
    "main": REPO / "requirements" / "lock.txt",
    "mcore018": REPO / "requirements" / "lock-mcore018.txt",
    "bridge": REPO / "requirements" / "lock-bridge.txt",
}
#: The line of lock-bridge.txt after which its own pins start.
BRIDGE_MARKER = "# --- megatron-bridge's layer"
#: The megatron-core releases of each lock (a pip requirement on top of pyproject.toml's range).
MCORE = {"main": None, "mcore018": "megatron-core>=0.18,<0.19"}
HEADERS = {
    "main": [
        "# The exact dependency set of ultraep-megatron[dev] for CPython 3.12 on Linux x86_64, with the",
        "# sha256 of every file: what tools/ensure_env.sh (the README's environment) and CI install, with",
        "# `pip install --require-hashes --no-deps -r requirements/lock.txt`. pyproject.toml holds the",
        "# ranges a cluster installs into. Regenerate with `python tools/update_lock.py`.",
    ],
    "mcore018": [
        "# The exact dependency set of ultraep-megatron[dev] with megatron-core 0.18 for CPython 3.12 on",
        "# Linux x86_64, with the sha256 of every file: requirements/lock.txt's versions wherever",
        "# megatron-core 0.18 allows them (torch included). `ULTRAEP_MCORE=0.18 bash tools/ensure_env.sh`",
        "# layers an environment on the main one and installs the lines that differ from lock.txt;",
        "# `pip install --require-hashes --no-deps -r requirements/lock-mcore018.txt` makes it from",
        "# scratch. Regenerate with `python tools/update_lock.py`.",
    ],
}
PIN = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)")


def pins(lock: Path) -> dict[str, str]:
    """name (as written) -> version of each requirement of a lock file."""
    return {m[1]: m[2] for m in map(PIN.match, lock.read_text().splitlines()) if m}


def hash_pins(pinned: list[str]) -> list[dict]:
    """pip's report of exactly ``pinned`` (prebuilt wheels, no dependencies) for CPython 3.12."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True)
        report, requirements = Path(tmp) / "report.json", Path(tmp) / "pins.txt"
        requirements.write_text("\n".join(pinned) + "\n")
        python = str(target / "bin" / "python")
        command = [sys.executable, "-m", "pip", "--python", python, "install", "--dry-run"]
        command += ["--ignore-installed", "--no-deps", "--only-binary=:all:", "--quiet"]
        subprocess.run([*command, "--report", str(report), "-r", str(requirements)], check=True)
        return json.loads(report.read_text())["install"]


def write_bridge_lock() -> None:
    """lock-bridge.txt: lock.txt's lines, the marker, Bridge's own pins re-hashed."""
    header, _, own = LOCKS["bridge"].read_text().partition(BRIDGE_MARKER)
    marker_rest, _, own = own.partition("\n")
    pinned = [f"{m[1]}=={m[2]}" for m in map(PIN.match, own.splitlines()) if m]
    head = [line for line in header.splitlines() if line.startswith("#")]
    main = LOCKS["main"].read_text().split("\n\n", 1)[1].rstrip("\n")
    lines = []
    for item in sorted(hash_pins(pinned), key=lambda i: i["metadata"]["name"].lower()):
        sha = item["download_info"]["archive_info"]["hashes"]["sha256"]
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{sha}")
    body = "\n".join(head) + "\n\n" + main + "\n\n" + BRIDGE_MARKER + marker_rest + "\n"
    LOCKS["bridge"].write_text(body + "\n".join(lines) + "\n")
    print(f"wrote {LOCKS['bridge']} ({len(lines)} packages over lock.txt)")


def resolve(constraints: list[str]) -> list[dict]:
    """pip's resolution of `.[dev]` for a fresh CPython 3.12 venv under ``constraints`` (lines of
    a pip constraints file): the report's ``install`` items."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True)
        report = Path(tmp) / "report.json"
        command = [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(target / "bin" / "python"),
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            f"{REPO}[dev]",
        ]
        if constraints:
            constraint_file = Path(tmp) / "constraints.txt"
            constraint_file.write_text("\n".join(constraints) + "\n")
            command[6:6] = ["-c", str(constraint_file)]
        subprocess.run(command, check=True)
        return json.loads(report.read_text())["install"]


def write_lock(name: str, installs: list[dict]) -> None:
    lines = [*HEADERS[name], ""]
    for item in sorted(installs, key=lambda i: i["metadata"]["name"].lower()):
        package, version = item["metadata"]["name"], item["metadata"]["version"]
        if package == "ultraep-megatron":
            continue
        hashes = item["download_info"].get("archive_info", {}).get("hashes", {})
        if "sha256" not in hashes:
            raise SystemExit(f"{package} {version}: the index gave no sha256")
        lines.append(f"{package}=={version} \\\n    --hash=sha256:{hashes['sha256']}")
    LOCKS[name].parent.mkdir(exist_ok=True)
    LOCKS[name].write_text("\n".join(lines) + "\n")
    print(f"wrote {LOCKS[name]} ({len(installs) - 1} packages)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--constraints", type=Path, default=None, help="pip constraints file")
    parser.add_argument(
        "--only",
        choices=sorted(LOCKS),
        default=None,
        help="regenerate one lock (mcore018: from the current lock.txt's versions)",
    )
    args = parser.parse_args()
    if sys.version_info[:2] != (3, 12):
        parser.error("run with Python 3.12 (megatron-core 0.18 and 0.19 ship cp312 wheels only)")
    user = args.constraints.read_text().splitlines() if args.constraints else []
    if args.only in (None, "main"):
        write_lock("main", resolve(user))
    if args.only in (None, "mcore018"):
        # lock.txt's versions, megatron-core's excepted: the 0.18 environment shares the rest.
        kept = [
            f"{name}=={version}"
            for name, version in pins(LOCKS["main"]).items()
            if name.lower() != "megatron-core"
        ]
        write_lock("mcore018", resolve([*kept, MCORE["mcore018"]]))
    if args.only in (None, "bridge"):
        write_bridge_lock()
    return 0


if __name__ == "__main__":
    sys.exit(main())
