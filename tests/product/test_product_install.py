"""Installing beside a cluster's torch: pip's own resolver, in dry-run mode, installs
ultraep-megatron into an environment that already holds an NVIDIA-container torch build
(2.9.0a0+<git>.nv25.05) and megatron-core from a Megatron-LM core_v0.19.0 checkout, and takes
nothing else: no second torch, no second megatron. Negative controls: the same environment with a
torch below the supported range, and the package with the old exact pins, cannot resolve without
replacing torch.

Cheap by design: the environment is a bare venv holding only the installed packages' metadata
(dist-info directories), the package is a wheel built from pyproject.toml alone, and pip runs
offline (--no-index) in --dry-run mode, reading its --report."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: An environment like NVIDIA's PyTorch container with a Megatron-LM checkout installed, holding
#: a version of every dependency inside the project's ranges.
CLUSTER = {
    "torch": "2.9.0a0+40ec155e58.nv25.05",
    "megatron-core": "0.19.0",
    "numpy": "1.26.4",
    "numba": "0.61.2",
    "matplotlib": "3.10.3",
    "pyyaml": "6.0.2",
    "wandb": "0.21.0",
    "psutil": "7.0.0",
    "einops": "0.8.1",
}


def pip_env() -> dict[str, str]:
    """pip isolated from this machine's configuration and indexes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_NO_INPUT="1")
    return env


def build_wheel(pyproject_text: str, out: Path) -> Path:
    """The package's wheel as pip would see it: pyproject.toml's metadata, an empty package."""
    src = out / "src"
    (src / "ultraep_megatron").mkdir(parents=True)
    (src / "ultraep_megatron" / "__init__.py").write_text("")
    (src / "pyproject.toml").write_text(pyproject_text)
    shutil.copy(REPO / "README.md", src / "README.md")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(out / "wheels"), str(src)], env=pip_env(), check=True, capture_output=True, timeout=300)
    return out / "wheels"


def cluster_env(path: Path, packages: dict[str, str]) -> Path:
    """A bare venv whose site-packages holds the metadata of ``packages`` (name -> version)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    site = next(path.glob("lib/python3*/site-packages"))
    for name, version in packages.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("conda\n")
        (info / "RECORD").write_text("")
    return path / "bin" / "python"


def dry_run(python: Path, wheels: Path, report: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--no-index",
         "--find-links", str(wheels), "--report", str(report), "--quiet", "ultraep-megatron"],
        env=pip_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    return build_wheel((REPO / "pyproject.toml").read_text(), tmp_path_factory.mktemp("wheel"))


def test_install_keeps_the_clusters_torch_and_megatron(wheels, tmp_path):
    python = cluster_env(tmp_path / "env", CLUSTER)
    report = tmp_path / "report.json"
    done = dry_run(python, wheels, report)
    assert done.returncode == 0, done.stderr
    installs = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]
    assert installs == [("ultraep-megatron", "0.1.0")]  # nothing replaced, nothing added


def test_a_torch_outside_the_range_is_not_silently_kept(wheels, tmp_path):
    python = cluster_env(tmp_path / "env", {**CLUSTER, "torch": "2.5.1"})
    done = dry_run(python, wheels, tmp_path / "report.json")
    assert done.returncode != 0 and "torch" in done.stderr  # pip would have to bring another torch


def test_the_old_exact_pins_would_replace_the_clusters_torch(tmp_path):
    pinned = re.sub(r'"torch[^"]*"', '"torch==2.14.1"', (REPO / "pyproject.toml").read_text())
    pinned = re.sub(r'"megatron-core[^"]*"', '"megatron-core==0.19.2"', pinned)
    assert '"torch==2.14.1"' in pinned
    wheels = build_wheel(pinned, tmp_path / "pinned")
    python = cluster_env(tmp_path / "env", CLUSTER)
    done = dry_run(python, wheels, tmp_path / "report.json")
    assert done.returncode != 0 and re.search(r"torch==2\.14\.1|megatron-core==0\.19\.2", done.stderr), done.stderr
