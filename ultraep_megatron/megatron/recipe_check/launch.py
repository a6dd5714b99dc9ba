"""Step 1 of the recipe checker: the launch line, read, never run.

The recipe's own shell code runs (it assembles the arguments), with a directory of recording shims
first on ``PATH``: ``torchrun``, ``python``, ``python3`` (and ``python3.N``), ``srun``,
``deepspeed``, ``mpirun``, ``mpiexec`` and the other launchers of :data:`SHIMMED_PROGRAMS`, and
``$ULTRAEP_PYTHON``. A shim writes its program name and arguments to a capture file and exits 0;
nothing it stands for starts. An environment variable whose value is the path of such a program
(``PYTHON=/usr/bin/python3``) is pointed at the shim as well. Then the recorded calls are read
(:func:`read_launch`): ``torchrun`` / ``python -m torch.distributed.run`` with torchrun's own
parser, ``srun`` (its node and task counts, or the torchrun it starts), ``deepspeed``
(``--num_nodes``, ``--num_gpus``), ``mpirun`` / ``mpiexec`` (``-np``, ``--npernode``); world size =
nodes x processes per node, and ARGS are exactly what the cluster would get. An ``srun`` of a shell
script (``srun bash recipe.sh``, the user guide's SLURM line) runs that script's shell code under
the same shims. A job submission (``sbatch``, ``salloc``) or a remote shell (``ssh``, ``pdsh``) is
recorded, not run, and refused.

What the shims cannot catch, and how the checker deals with it:

* a launcher called by a path (``/usr/bin/python3 -m torch.distributed.run``,
  ``$CONDA_PREFIX/bin/torchrun``, ``./venv/bin/python``): a path bypasses ``PATH``. The recipe's
  text is scanned first (:func:`path_launches`) and a recipe with such a call is refused before any
  of it runs. The scan does not see into files the recipe sources, ``eval`` strings or paths
  assembled from pieces at run time;
* a launcher outside :data:`SHIMMED_PROGRAMS` (``accelerate launch``, ``ray``, a site's wrapper):
  it would run;
* the rest of the recipe's shell code does run: ``mkdir``, data downloads, ``nvidia-smi``. The
  checker sets ``RUN_DIR`` (the CPU recipes' output directory) to a scratch directory;
* a python call the recipe makes for a value (``GPUS=$(python -c ...)``) is a shim too: it prints
  nothing, so give that value with ``--env``.

A file without a ``#!`` line that launches nothing, like ``recipes/common.sh``, is a library the
recipes source: skipped (:class:`NotARecipe`). Also the checker's error, :class:`RecipeError`,
which every step raises.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence


class RecipeError(Exception):
    """A recipe that cannot launch as written (bad arguments, layout or launch line).

    Args:
        problem: one line saying what is wrong (the checker prints it as a PROBLEM line).
        details: what the recipe or Megatron printed around it, if that helps (shown indented).
    """

    def __init__(self, problem: str, details: str = ""):
        super().__init__(problem)
        self.problem, self.details = problem, details


class NotARecipe(RecipeError):
    """A file that launches nothing and is not meant to: a library the recipes source."""


PYTHONS = ("python", "python3", *(f"python3.{minor}" for minor in range(8, 16)))
#: ``python -m`` modules that are torchrun (the recipes': torchrun ending a refusal in one line).
TORCHRUN_MODULES = (
    "torch.distributed.run",
    "torch.distributed.launch",
    "ultraep_megatron.megatron.run.torchrun",
)
_TORCHRUN_ARGV = [[m] for m in TORCHRUN_MODULES]
#: Launchers of a training job whose command line the checker reads.
READ_LAUNCHERS = ("torchrun", "srun", "deepspeed", "mpirun", "mpiexec")
#: Programs that start work elsewhere: recorded, never run, and refused.
REFUSED_PROGRAMS = {
    "sbatch": "submits a batch job",
    "salloc": "allocates nodes",
    "ssh": "starts a remote shell",
    "pdsh": "starts remote shells",
    "accelerate": "launches through Hugging Face accelerate",
    "jsrun": "launches through LSF's jsrun",
    "aprun": "launches through Cray's aprun",
    "flux": "launches through Flux",
}
#: Programs a job script asks for a value, answered by their shim (:mod:`.rendezvous`).
ANSWERED_PROGRAMS = ("scontrol",)
#: Every program a recording shim stands in for while a recipe's shell code runs.
SHIMMED_PROGRAMS = (*PYTHONS, *READ_LAUNCHERS, *REFUSED_PROGRAMS, *ANSWERED_PROGRAMS)
#: Shells an ``srun`` shim runs (their launchers are shimmed too), e.g. ``srun bash recipe.sh``.
SHELLS = ("bash", "sh")

_SHIM = """#!{python}
# A recording shim of the recipe checker: stands in for {name}, writes its command line and exits.
import json, os, sys
with open(os.environ["ULTRAEP_CAPTURE_FILE"], "a") as handle:
    handle.write(json.dumps({{"program": {name!r}, "argv": sys.argv[1:]}}) + "\\n")
{after}"""
# srun of a shell script: the script runs under the same shims (its own launch is then recorded).
# The shim reads srun's command line with this module, loaded by its path (stdlib imports only).
_SRUN_SHELL = """import importlib.util
spec = importlib.util.spec_from_file_location("_ultraep_launch", {module!r})
launch = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
command = launch.srun_shell_command(sys.argv[1:])
if command:
    os.environ.setdefault("SLURM_NODEID", "0")
    os.execvp(command[0], command)
"""


@dataclass
class Launch:
    """A read launch: the process layout and the training script's arguments.

    Attributes:
        launcher: the launch command before the training script, as the recipe gave it (for the
            report), e.g. ``torchrun --nproc-per-node 8 --nnodes 2 ...``; empty for bare arguments.
        gpus_per_node_assumed: the processes per node were not given but assumed (bare arguments
            without ``--gpus-per-node`` or a hardware preset).
        problems: what is wrong with the launch line itself (a multi-node rendezvous on
            localhost, :mod:`.rendezvous`): PROBLEM lines of the report.
        notes: what the launch needs from the nodes' environment (a recipe checked on its own
            without ``MASTER_ADDR``): note lines.
    """

    nproc_per_node: int
    nnodes: int
    script: str
    args: list[str]
    source: str = "<arguments>"
    launcher: str = ""
    gpus_per_node_assumed: bool = False
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def _quiet_parse(parser: argparse.ArgumentParser, argv: Sequence[str], what: str, source: str):
    """``parser.parse_args(argv)``; its usage error as one :class:`RecipeError` line."""
    message = io.StringIO()
    try:
        with contextlib.redirect_stderr(message):
            return parser.parse_args(list(argv))
    except SystemExit:
        error = next(
            (
                line.split(": error: ", 1)[1]
                for line in message.getvalue().splitlines()
                if ": error: " in line
            ),
            message.getvalue().strip(),
        )
        raise RecipeError(f"{source}: cannot read the {what} command line: {error}") from None


def _command_text(words: Sequence[str], limit: int = 12) -> str:
    words = list(words)
    shown = shlex.join(words[:limit])
    return shown + (" ..." if len(words) > limit else "")


def parse_torchrun_command(
    argv: Sequence[str], source: str = "<arguments>", prefix: str = "", python: str = "python"
) -> Launch:
    """A :class:`Launch` from ``python``'s argv, which must be ``-m torch.distributed.run ...``
    (or another of :data:`TORCHRUN_MODULES`).

    torchrun's own parser reads its options, so every spelling it accepts works.
    """
    argv = list(argv)
    if not argv[1:] or argv[0] != "-m" or argv[1] not in TORCHRUN_MODULES:
        raise RecipeError(
            f"{source}: expected `python -m torch.distributed.run ...`, got {argv[:4]}"
        )
    return _torchrun_launch(argv[2:], source, f"{prefix}{python} {' '.join(argv[:2])}")


def _torchrun_launch(argv: Sequence[str], source: str, launcher: str) -> Launch:
    from torch.distributed.run import get_args_parser

    options = _quiet_parse(get_args_parser(), argv, "torchrun", source)
    nnodes = "1" if options.standalone else str(options.nnodes)
    low, _, high = nnodes.partition(":")
    if high and low == high:  # torchrun's default, 1:1
        nnodes = low
    if ":" in nnodes:
        raise RecipeError(f"{source}: elastic --nnodes {nnodes} has no fixed world size")
    try:
        nproc = int(options.nproc_per_node)
    except ValueError:
        raise RecipeError(
            f"{source}: --nproc-per-node {options.nproc_per_node!r} is not a number of processes"
        ) from None
    if not nnodes.isdigit():
        raise RecipeError(f"{source}: --nnodes {nnodes!r} is not a number of nodes")
    from .rendezvous import torchrun_problems  # here: the srun shim loads this file alone

    script_at = len(argv) - len(options.training_script_args) - 1
    return Launch(
        nproc_per_node=nproc,
        nnodes=int(nnodes),
        script=options.training_script,
        args=list(options.training_script_args),
        source=source,
        launcher=_command_text([*launcher.split(), *argv[:script_at]]),
        problems=torchrun_problems(int(nnodes), options),
    )


def _deepspeed_parser() -> argparse.ArgumentParser:
    """deepspeed's launcher options (``deepspeed/launcher/runner.py``, ``parse_args``): the ones with
    a value and the switches, so the user script and its arguments are found where deepspeed finds
    them."""
    parser = argparse.ArgumentParser(prog="deepspeed", add_help=False)
    for names in (
        ("-H", "--hostfile"),
        ("-i", "--include"),
        ("-e", "--exclude"),
        ("--master_addr",),
        ("--launcher",),
        ("--launcher_args",),
        ("--enable_each_rank_log",),
        ("--autotuning",),
        ("--bind_core_list",),
    ):
        parser.add_argument(*names)
    for names in (
        ("--num_nodes",),
        ("--min_elastic_nodes",),
        ("--max_elastic_nodes",),
        ("--num_gpus", "--num_accelerators"),
        ("--master_port",),
    ):
        parser.add_argument(*names, type=int, default=-1)
    for name in (
        "--module",
        "--no_python",
        "--no_local_rank",
        "--no_ssh_check",
        "--force_multi",
        "--save_pid",
        "--elastic_training",
        "--bind_cores_to_rank",
    ):
        parser.add_argument(name, action="store_true")
    parser.add_argument("user_script")
    parser.add_argument("user_args", nargs=argparse.REMAINDER)
    return parser


def _deepspeed_launch(argv: Sequence[str], source: str, prefix: str = "") -> Launch:
    options = _quiet_parse(_deepspeed_parser(), argv, "deepspeed", source)
    if options.num_nodes < 1 or options.num_gpus < 1:
        raise RecipeError(
            f"{source}: deepspeed without --num_nodes and --num_gpus takes its world size "
            "from a hostfile, which the checker does not read; give both"
        )
    script_at = len(argv) - len(options.user_args) - 1
    return Launch(
        nproc_per_node=options.num_gpus,
        nnodes=options.num_nodes,
        script=options.user_script,
        args=list(options.user_args),
        source=source,
        launcher=_command_text([*prefix.split(), "deepspeed", *argv[:script_at]]),
    )


#: srun / mpirun options that take no value (so the word after one is not skipped as its value).
_SRUN_SWITCHES = {
    "--exclusive",
    "--overlap",
    "-l",
    "--label",
    "-u",
    "--unbuffered",
    "--pty",
    "-v",
    "--verbose",
    "-Q",
    "--quiet",
    "-k",
    "--no-kill",
    "-K",
    "--kill-on-bad-exit",
    "-O",
    "--overcommit",
    "--contiguous",
    "--multi-prog",
    "-Z",
    "--no-allocate",
    "--test-only",
    "--spread-job",
    "--use-min-nodes",
    "-X",
    "--disable-status",
    "-E",
    "--preserve-env",
    "-s",
    "--oversubscribe",
    "-H",
    "--hold",
    "--whole",
    "--exact",
}
_MPI_SWITCHES = {
    "--oversubscribe",
    "--allow-run-as-root",
    "-v",
    "--verbose",
    "-q",
    "--quiet",
    "--tag-output",
    "--timestamp-output",
    "--report-bindings",
    "--display-map",
    "--bind-to-core",
    "--bind-to-socket",
    "--nooversubscribe",
    "-l",
    "--prefix-output",
}


def _split_command(
    program: str, argv: Sequence[str], switches: set[str]
) -> tuple[dict[str, str], list[str]]:
    """(options with their values, the command it runs) of an ``srun`` / ``mpirun`` command line."""
    options, i, argv = {}, 0, list(argv)
    while i < len(argv) and argv[i].startswith("-"):
        word = argv[i]
        if "=" in word and word.startswith("--"):
            key, value = word.split("=", 1)
            options[key] = value
        elif word in switches or i + 1 == len(argv):
            options[word] = ""
        elif (
            len(word) > 2
            and not word.startswith("--")
            and word[1:2].isalpha()
            and program == "srun"
        ):
            options[word[:2]] = word[2:]  # -N2
        else:
            options[word] = argv[i + 1]
            i += 1
        i += 1
    return options, argv[i:]


def _count(
    options: dict[str, str], names: Sequence[str], source: str, program: str
) -> Optional[int]:
    for name in names:
        if name in options:
            value = options[name].split("-")[-1]  # srun's -N MIN-MAX: the most it may use
            if not value.isdigit():
                raise RecipeError(f"{source}: {program} {name} {options[name]!r} is not a number")
            return int(value)
    return None


def _wrapped_launch(program: str, argv: Sequence[str], source: str) -> Launch:
    """An ``srun`` or ``mpirun`` call: the torchrun / deepspeed it starts, else one process per task
    (nodes x tasks per node) running the training script."""
    is_srun = program == "srun"
    options, command = _split_command(program, argv, _SRUN_SWITCHES if is_srun else _MPI_SWITCHES)
    prefix = _command_text([program, *argv[: len(argv) - len(command)]], limit=8)
    if not command:
        raise RecipeError(f"{source}: {program} without a command")
    name = os.path.basename(command[0])
    if name == "torchrun":
        return _torchrun_launch(command[1:], source, f"{prefix} torchrun")
    if name == "deepspeed":
        return _deepspeed_launch(command[1:], source, prefix)
    if name in PYTHONS and command[1:2] == ["-m"] and command[2:3] in _TORCHRUN_ARGV:
        return parse_torchrun_command(command[1:], source, prefix=f"{prefix} ", python=name)
    if is_srun:
        nodes = _count(options, ("-N", "--nodes"), source, program)
        per_node = _count(options, ("--ntasks-per-node",), source, program)
        tasks = _count(options, ("-n", "--ntasks"), source, program)
        how = "give -N/--nodes and --ntasks-per-node"
    else:
        nodes, tasks = None, _count(options, ("-np", "-n", "--np", "-c"), source, program)
        per_node = _count(options, ("--npernode", "-npernode", "-N"), source, program)
        how = "give -np and --npernode"
    if per_node is None and tasks is not None and nodes:
        per_node = tasks // nodes if tasks % nodes == 0 else None
    if nodes is None and tasks is not None and per_node:
        nodes = tasks // per_node if tasks % per_node == 0 else None
    if nodes is None or per_node is None:
        raise RecipeError(
            f"{source}: {program} starts {shlex.join(command[:2])} without a fixed number of "
            f"nodes and processes per node the checker can read; {how}"
        )
    script, args = (
        (command[1], command[2:])
        if name in PYTHONS and len(command) > 1
        else (command[0], command[1:])
    )
    return Launch(
        nproc_per_node=per_node,
        nnodes=nodes,
        script=script,
        args=list(args),
        source=source,
        launcher=_command_text([*prefix.split(), *command[: len(command) - len(args) - 1]]),
    )


def srun_shell_command(argv: Sequence[str]) -> list[str]:
    """The command of an ``srun`` command line when it runs a shell script (``srun
    --ntasks-per-node 1 bash recipe.sh``), else ``[]``."""
    _, command = _split_command("srun", argv, _SRUN_SWITCHES)
    return command if command and os.path.basename(command[0]) in SHELLS else []


def read_launch(program: str, argv: Sequence[str], source: str) -> Optional[Launch]:
    """The training launch of one recorded call, ``None`` for a call that launches no training
    (``python tools/prepare_data.py``: a helper the recipe runs, skipped).

    Raises:
        RecipeError: a job submission or remote shell (:data:`REFUSED_PROGRAMS`), or a launch whose
            layout cannot be read.
    """
    if program in REFUSED_PROGRAMS:
        raise RecipeError(
            f"{source}: the recipe runs `{_command_text([program, *argv], 6)}`, which "
            f"{REFUSED_PROGRAMS[program]}: recorded, not run; check the script that job "
            "runs (ultraep check-recipe SCRIPT)"
        )
    if program in ANSWERED_PROGRAMS:
        return None
    if program in PYTHONS:
        if argv[:1] == ["-m"] and argv[1:2] in _TORCHRUN_ARGV:
            return parse_torchrun_command(argv, source, python=program)
        return None
    if program == "torchrun":
        return _torchrun_launch(argv, source, "torchrun")
    if program == "deepspeed":
        return _deepspeed_launch(argv, source)
    if program == "srun" and srun_shell_command(argv):
        return None  # the shim ran the shell script under the same shims: its launch is recorded
    return _wrapped_launch(program, argv, source)


def default_gpus_per_node(script_args: Sequence[str]) -> Optional[int]:
    """GPUs per node of a bare launch: the ``--moe-balancer-hardware`` preset's among
    ``script_args`` (h100-hgx, h200-hgx: 8; paper-rack: 4, a GB200 tray); ``None`` without a preset
    (also for an unknown preset name, which the validation then reports, naming the flag).
    """
    from ultraep_megatron.settings.hardware import HARDWARE_PRESETS

    name = hardware_name(script_args)
    return HARDWARE_PRESETS[name].gpus_per_node if name in HARDWARE_PRESETS else None


def hardware_name(script_args: Sequence[str]) -> Optional[str]:
    """The last ``--moe-balancer-hardware`` value among ``script_args`` (Megatron's parser keeps
    the last), ``None`` if there is none."""
    name = None
    for i, arg in enumerate(script_args):
        if arg == "--moe-balancer-hardware" and i + 1 < len(script_args):
            name = script_args[i + 1]
        elif arg.startswith("--moe-balancer-hardware="):
            name = arg.split("=", 1)[1]
    return name


_LAUNCHER_NAMES = "|".join(re.escape(p) for p in sorted(SHIMMED_PROGRAMS, key=len, reverse=True))
#: A word that runs a launcher by a path (``/usr/bin/python3``, ``$VENV/bin/torchrun``, ``./python``).
_PATH_LAUNCH = re.compile(
    rf"""(?:^|[\s;|&(`"'=])([^\s;|&()`"'<>=]*/({_LAUNCHER_NAMES}))(?=$|[\s;|&)`"'<>])"""
)


def path_launches(text: str) -> list[tuple[int, str]]:
    """(line number, path) of every launcher the recipe text calls by a path, which a shim first on
    ``PATH`` cannot stand in for (comments and the ``#!`` line left out)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        code = re.sub(r"(^|\s)#.*$", "", line)
        if number == 1 and line.startswith("#!"):
            continue
        found += [(number, m.group(1)) for m in _PATH_LAUNCH.finditer(code)]
    return found


def _shim_environment(env: dict[str, str], shims: Path) -> dict[str, str]:
    """``env`` with the shims first on ``PATH`` and every variable naming a launcher's path
    (``ULTRAEP_PYTHON``, a ``PYTHON=/usr/bin/python3``) pointed at its shim."""
    out = dict(env)
    for key, value in env.items():
        if (
            key != "PATH"
            and value.startswith(("/", "./", "~"))
            and os.path.basename(value) in SHIMMED_PROGRAMS
        ):
            out[key] = str(shims / os.path.basename(value))
    out["PATH"] = str(shims) + (os.pathsep + env["PATH"] if env.get("PATH") else "")
    out["ULTRAEP_PYTHON"] = str(shims / "python")
    return out


def write_shims(directory: Path, programs: Sequence[str] = SHIMMED_PROGRAMS) -> None:
    """One executable recording shim per name of ``programs`` in ``directory``."""
    from .rendezvous import SCONTROL

    for name in programs:
        after = {"srun": _SRUN_SHELL.format(module=__file__), "scontrol": SCONTROL}.get(name, "")
        shim = directory / name
        shim.write_text(_SHIM.format(python=sys.executable, name=name, after=after))
        shim.chmod(0o755)


def capture_launch(
    recipe: str | Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    extra_args: Sequence[str] = (),
) -> Launch:
    """The one training launch of ``recipe`` (:func:`capture_launches`).

    Raises:
        RecipeError: as :func:`capture_launches`, and when the recipe launches several different
            trainings.
    """
    launches = capture_launches(recipe, env, timeout_s, extra_args)
    if len(launches) > 1:
        raise RecipeError(
            f"{recipe}: the recipe launches {len(launches)} different trainings "
            f"({'; '.join(lc.launcher for lc in launches)}); check one launch per recipe"
        )
    return launches[0]


def capture_launches(
    recipe: str | Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    extra_args: Sequence[str] = (),
) -> list[Launch]:
    """Run ``recipe``'s shell code with recording shims in place of its launchers and read the
    launches it would start, in order, the same launch once (a job script may start a run and its
    baseline); nothing is launched (the module docstring says what the shims cannot catch).

    The recipe runs with ``RUN_DIR`` (the output directory of the CPU recipes) in a scratch
    directory unless ``env`` sets it; python calls that are not a launch (a data preparation step)
    are recorded and skipped.

    Args:
        recipe: path of a bash recipe.
        env: extra environment for the recipe (e.g. ``NNODES``, ``DATA_PATH``, ``RUN_DIR``).
        timeout_s: limit for the recipe's own shell code.
        extra_args: the recipe's command-line arguments (a user's overrides: the recipes append
            them to the training script's arguments, where the last value of a flag wins).

    Raises:
        RecipeError: when the recipe calls a launcher by its path (refused before anything runs),
            fails, launches nothing, or submits a job.
    """
    recipe = Path(recipe)
    if not recipe.is_file():
        raise RecipeError(f"{recipe}: no such recipe")
    text = recipe.read_text(errors="replace")
    by_path = path_launches(text)
    if by_path:
        number, path = by_path[0]
        raise RecipeError(
            f"{recipe}:{number} runs {path} by its path, which the checker's recording shims "
            "(first on PATH) cannot stand in for, so the recipe was not run; call "
            f"{os.path.basename(path)} from PATH (or through $ULTRAEP_PYTHON)"
        )
    with tempfile.TemporaryDirectory(prefix="check_recipe_") as tmp:
        shims = Path(tmp) / "shims"
        shims.mkdir()
        # SHIMMED_PROGRAMS read here: a test disables them (its negative control)
        write_shims(shims, SHIMMED_PROGRAMS)
        capture = Path(tmp) / "calls.jsonl"
        run_env = _shim_environment(
            {**os.environ, "RUN_DIR": str(Path(tmp) / "run"), **(env or {})}, shims
        )
        run_env["ULTRAEP_CAPTURE_FILE"] = str(capture)
        completed = subprocess.run(
            ["bash", str(recipe), *extra_args],
            env=run_env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
        calls = (
            [json.loads(line) for line in capture.read_text().splitlines()]
            if capture.exists()
            else []
        )
    launches = [
        launch
        for call in calls
        if (launch := read_launch(call["program"], call["argv"], str(recipe))) is not None
    ]
    from .rendezvous import PLACEHOLDER, refusal

    no_host = refusal(completed.stderr) if completed.returncode != 0 else None
    if no_host and not (env or {}).get("MASTER_ADDR"):
        # The recipe refused to guess the rendezvous host: a PROBLEM, and the rest of the launch
        # checked with a placeholder host so the report still shows its layout and memory.
        found = capture_launches(
            recipe, {**(env or {}), "MASTER_ADDR": PLACEHOLDER}, timeout_s, extra_args
        )
        for launch in found:
            if no_host.startswith(f"{recipe.name}: "):  # the recipe itself: its user gives it
                launch.notes.insert(0, f"needs MASTER_ADDR on several nodes ({no_host})")
            else:  # a job script's environment is what every node gets: it hangs or stops
                launch.problems.insert(0, no_host)
        return found
    if completed.returncode != 0:
        said = completed.stderr.strip().splitlines()[-1:]
        if said and said[0].startswith(
            f"{recipe.name}: "
        ):  # the recipes' one line naming a variable
            raise RecipeError(said[0])
        raise RecipeError(
            f"{recipe}: the recipe exited with {completed.returncode}",
            (completed.stdout + completed.stderr)[-3000:],
        )
    if not launches:
        if not calls and not text.startswith("#!"):
            raise NotARecipe(
                f"{recipe}: no #! line and no launch: a file the recipes source, not a recipe"
            )
        ran = "; ".join(_command_text([c["program"], *c["argv"]], 4) for c in calls)
        raise RecipeError(
            f"{recipe}: the recipe launched no training (no torchrun, python -m "
            f"torch.distributed.run, srun, deepspeed or mpirun)"
            + (f"; it ran {ran}" if ran else "")
        )
    distinct = {}
    for lc in launches:
        distinct.setdefault((lc.nproc_per_node, lc.nnodes, lc.script, tuple(lc.args)), lc)
    return list(distinct.values())
