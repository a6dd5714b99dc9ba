"""Installing beside a cluster's torch.

The container route (README.md, docs/user_guide.md, docs/first_gpu_run.md, patches/README.md):
``pip install -e "/path/to/ultraep-megatron[dev]"`` into an environment that already holds torch and
megatron-core. Two checks:

* pip's own resolver, in dry-run mode, against an environment holding an NVIDIA-container torch
  build (2.9.0a0+<git>.nv25.05) and megatron-core from a Megatron-LM checkout (0.19.0 or 0.18.0):
  it installs ultraep-megatron and nothing else: no second torch, no second megatron. Negative
  controls: a torch below the supported range, and the package with the old exact pins, cannot
  resolve without replacing torch. Cheap: a bare venv holding only dist-info directories, the
  package a wheel built from pyproject.toml alone, pip offline (--no-index), --report.
* the container route's command itself, run for real (not a dry run) in a fresh venv layered on a
  "container": this test environment's own torch and megatron-core installs and the packages they
  need (linked, not copied). pip keeps both where they are, installs the package and every runtime
  dependency the container lacks (numba, wandb, einops, ...), and ``pip check`` finds every
  requirement satisfied. Offline and cheap: the other distributions come from wheels holding this
  environment's metadata (name, version, requirements) and no files, so pip resolves and installs
  them exactly as from an index, in seconds. Negative control: the old ``pip install --no-deps``
  of patches/README.md leaves numba, wandb and einops missing, and the same check names them.

Not tested here: the NVIDIA container itself (it cannot be pulled on this machine) and real wheels
of the dependencies (no index is reached)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
    )
    return env


def build_wheel(pyproject_text: str, out: Path) -> Path:
    """The package's wheel as pip would see it: pyproject.toml's metadata, an empty package."""
    src = out / "src"
    (src / "ultraep_megatron").mkdir(parents=True)
    (src / "ultraep_megatron" / "__init__.py").write_text("")
    (src / "pyproject.toml").write_text(pyproject_text)
    shutil.copy(REPO / "README.md", src / "README.md")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out / "wheels"),
            str(src),
        ],
        env=pip_env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out / "wheels"


def cluster_env(path: Path, packages: dict[str, str]) -> Path:
    """A bare venv whose site-packages holds the metadata of ``packages`` (name -> version)."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120
    )
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
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--dry-run",
            "--no-index",
            "--find-links",
            str(wheels),
            "--report",
            str(report),
            "--quiet",
            "ultraep-megatron",
        ],
        env=pip_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    return build_wheel((REPO / "pyproject.toml").read_text(), tmp_path_factory.mktemp("wheel"))


@pytest.mark.parametrize("megatron_core", ["0.19.0", "0.18.0"])
def test_install_keeps_the_clusters_torch_and_megatron(wheels, tmp_path, megatron_core):
    python = cluster_env(tmp_path / "env", {**CLUSTER, "megatron-core": megatron_core})
    report = tmp_path / "report.json"
    done = dry_run(python, wheels, report)
    assert done.returncode == 0, done.stderr
    installs = [
        (i["metadata"]["name"], i["metadata"]["version"])
        for i in json.loads(report.read_text())["install"]
    ]
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
    assert done.returncode != 0 and re.search(
        r"torch==2\.14\.1|megatron-core==0\.19\.2", done.stderr
    ), done.stderr


# The container route, run for real ------------------------------------------------------------

#: The container route's command, as the docs give it (`pip install -e "/path/to/ultraep-megatron[dev]"`),
#: offline here: wheels from --find-links, and the build backend (setuptools) the container's.
CONTAINER_ROUTE = ["install", "-e", f"{REPO}[dev]"]
#: The runtime dependencies a container without them must get (pyproject.toml's).
RUNTIME = ("numba", "matplotlib", "pyyaml", "wandb", "psutil", "einops")


def installed() -> dict[str, importlib.metadata.Distribution]:
    """This environment's distributions by canonical name (the first on sys.path wins)."""
    found = {}
    for dist in importlib.metadata.distributions():
        found.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    return found


def requirement_closure(
    roots: list[str], dists: dict[str, importlib.metadata.Distribution]
) -> set[str]:
    """The canonical names of ``roots`` and everything they require here (markers and extras
    evaluated for this interpreter)."""
    todo, seen = [(canonicalize_name(r), frozenset()) for r in roots], set()
    names = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or name not in dists:
            continue
        seen.add((name, extras))
        names.add(name)
        for line in dists[name].requires or []:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in {"", *extras}):
                continue
            todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return names


def link_container(site: Path, names: set[str], dists) -> None:
    """A site directory holding ``names``' installs, linked from this environment's."""
    site.mkdir(parents=True)
    for name in names:
        tops = {Path(f).parts[0] for f in dists[name].files or [] if not str(f).startswith("..")}
        for top in tops:
            if not (site / top).exists():
                (site / top).symlink_to(dists[name].locate_file(top))


def metadata_wheel(dist: importlib.metadata.Distribution, out: Path) -> None:
    """A wheel holding ``dist``'s name, version and requirements, and no files."""
    name, version = dist.metadata["Name"], dist.version
    stem = f"{re.sub(r'[-_.]+', '_', name)}-{version}"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    if dist.metadata["Requires-Python"]:
        lines.append(f"Requires-Python: {dist.metadata['Requires-Python']}")
    lines += [f"Provides-Extra: {e}" for e in dist.metadata.get_all("Provides-Extra") or []]
    lines += [f"Requires-Dist: {r}" for r in dist.requires or []]
    files = {
        f"{stem}.dist-info/METADATA": "\n".join(lines) + "\n",
        f"{stem}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{stem}.dist-info/RECORD"] = "".join(
        f"{path},,\n" for path in [*files, f"{stem}.dist-info/RECORD"]
    )
    with zipfile.ZipFile(out / f"{stem}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    """(container site, wheel directory, {name: version}) for the container route."""
    root = tmp_path_factory.mktemp("container")
    dists = installed()
    names = requirement_closure(["torch", "megatron-core"], dists)
    link_container(root / "site", names, dists)
    (root / "wheels").mkdir()
    for name, dist in dists.items():
        if name not in names and name != "ultraep-megatron":
            metadata_wheel(dist, root / "wheels")
    return root / "site", root / "wheels", {name: dists[name].version for name in names}


def install_into_container(tmp_path: Path, container, *extra: str):
    """A fresh venv on the container's site, the container route's command run in it: (pip's
    output, `pip check`'s result, {canonical name: (version, location)} in the venv)."""
    site, wheels, _ = container
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "env")],
        check=True,
        timeout=120,
    )
    env_site = next((tmp_path / "env").glob("lib/python3*/site-packages"))
    (env_site / "zz_container.pth").write_text(f"{site}\n")
    python = tmp_path / "env" / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    done = subprocess.run(
        [
            *pip,
            *CONTAINER_ROUTE[:1],
            "--no-index",
            "--find-links",
            str(wheels),
            "--no-build-isolation",
            *extra,
            *CONTAINER_ROUTE[1:],
        ],
        env=pip_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    check = subprocess.run(
        [*pip, "check"], env=pip_env(), capture_output=True, text=True, timeout=300
    )
    where = subprocess.run(
        [
            str(python),
            "-c",
            (
                "import importlib.metadata as m, json, re\n"
                "out = {}\n"
                "for d in m.distributions():\n"
                "    out.setdefault(re.sub(r'[-_.]+', '-', d.metadata['Name']).lower(), (d.version, str(d.locate_file(''))))\n"
                "print(json.dumps(out))"
            ),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout, check, {k: tuple(v) for k, v in json.loads(where.stdout).items()}, env_site


def test_container_route_keeps_torch_and_megatron_and_installs_the_runtime_dependencies(
    tmp_path, container
):
    site, _, kept = container
    output, check, dists, env_site = install_into_container(tmp_path, container)
    # torch and megatron-core (and what they need) stay the container's: same versions, same place.
    for name in ("torch", "megatron-core"):
        assert dists[name] == (kept[name], str(site)), (name, dists[name])
    installed_now = re.search(r"Successfully installed (.*)", output)[1].split()
    print(
        f"\ncontainer route: {len(installed_now)} installed, torch {kept['torch']} and megatron-core "
        f"{kept['megatron-core']} kept ({len(kept)} container packages)"
    )
    assert not [p for p in installed_now if re.match(r"(torch|megatron[-_]core)-\d", p)], (
        installed_now
    )
    # The package and each runtime dependency the container lacks are installed into the venv.
    assert dists["ultraep-megatron"][1] == str(env_site)
    for name in RUNTIME:
        assert name not in kept and dists[name][1] == str(env_site), (name, dists.get(name))
    # Every requirement of every distribution is satisfied (pip's own check).
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_old_no_deps_install_leaves_runtime_dependencies_missing(tmp_path, container):
    """Negative control: patches/README.md's former `pip install --no-deps` -- the check above
    must fail, naming the runtime dependencies it left out."""
    _, check, dists, _ = install_into_container(tmp_path, container, "--no-deps")
    missing = set(
        re.findall(
            r"ultraep-megatron 0\.1\.0 requires ([A-Za-z0-9_.-]+), which is not installed",
            check.stdout,
        )
    )
    print(f"\n--no-deps: pip check finds ultraep-megatron missing {sorted(missing)}")
    assert check.returncode != 0 and {"numba", "wandb", "einops"} <= missing, check.stdout
    assert not {"numba", "wandb", "einops"} & set(dists)
