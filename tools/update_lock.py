#!/usr/bin/env python3
"""Regenerate requirements/lock.txt: the exact, hashed dependency set of `.[dev]` that
tools/ensure_env.sh (the README's environment) and CI install.

    python tools/update_lock.py                  # newest versions allowed by pyproject.toml
    python tools/update_lock.py -c freeze.txt    # or pinned by a constraints file (e.g. a `pip freeze`)

pip resolves the project in dry-run mode for a fresh CPython 3.12 environment on this platform
(Linux x86_64: the README's environment and CI) and reports the chosen files with their sha256;
nothing is installed. Run it with Python 3.12 after changing the dependency ranges.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "lock.txt"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--constraints", type=Path, default=None, help="pip constraints file")
    args = parser.parse_args()
    if sys.version_info[:2] != (3, 12):
        parser.error("run with Python 3.12 (megatron-core 0.19 ships cp312 wheels only)")
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True)
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "--python", str(target / "bin" / "python"), "install",
                   "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), f"{REPO}[dev]"]
        if args.constraints:
            command[6:6] = ["-c", str(args.constraints)]
        subprocess.run(command, check=True)
        installs = json.loads(report.read_text())["install"]
    lines = ["# The exact dependency set of ultraep-megatron[dev] for CPython 3.12 on Linux x86_64, with the",
             "# sha256 of every file: what tools/ensure_env.sh (the README's environment) and CI install, with",
             "# `pip install --require-hashes --no-deps -r requirements/lock.txt`. pyproject.toml holds the",
             "# ranges a cluster installs into. Regenerate with `python tools/update_lock.py`.", ""]
    for item in sorted(installs, key=lambda i: i["metadata"]["name"].lower()):
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if name == "ultraep-megatron":
            continue
        hashes = item["download_info"].get("archive_info", {}).get("hashes", {})
        if "sha256" not in hashes:
            raise SystemExit(f"{name} {version}: the index gave no sha256")
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{hashes['sha256']}")
    LOCK.parent.mkdir(exist_ok=True)
    LOCK.write_text("\n".join(lines) + "\n")
    print(f"wrote {LOCK} ({len(installs) - 1} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
