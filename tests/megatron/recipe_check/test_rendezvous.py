"""A multi-node launch never guesses its rendezvous host (recipes/common.sh, recipe_check.rendezvous).

* ``NNODES > 1`` without ``MASTER_ADDR``: node 0 of Slurm's ``SLURM_JOB_NODELIST`` where there is
  one (``scontrol show hostnames``), else the recipe stops before torchrun with one line naming
  ``MASTER_ADDR``, exit status 2; one node still rendezvous at localhost;
* ``ultraep check-recipe``: a job script without it is a PROBLEM (exit 1), the shipped sbatch
  example (which names it) passes, a recipe checked on its own gets a NOTE; a raw torchrun line of
  several nodes at localhost is a PROBLEM.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from ultraep_megatron.cli import main
from ultraep_megatron.megatron import recipe_check as rc

REPO = Path(__file__).resolve().parents[3]
MULTI_NODE = sorted(
    p.name
    for p in (REPO / "recipes").glob("*.sh")
    if re.search(r"^source .*/common\.sh", p.read_text(), re.M)
)
SBATCH = REPO / "recipes" / "slurm_qwen3_30b_a3b_hgx.sbatch"


def run_recipe(tmp_path: Path, recipe: str, path_dirs=(), **env: str):
    """The recipe run for real with a python that records that it started (nothing trains)."""
    started = tmp_path / "started"
    started.unlink(missing_ok=True)
    fake = tmp_path / "fake_python"
    fake.write_text(f'#!/bin/bash\necho "$@" > {started}\n')
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "SLURM_"))}
    base.update({"ULTRAEP_PYTHON": str(fake), "NODE_RANK": "2", **env})
    base["PATH"] = os.pathsep.join([*map(str, path_dirs), base["PATH"]])
    done = subprocess.run(
        ["bash", str(REPO / "recipes" / recipe)], env=base, capture_output=True, text=True
    )
    return done, (started.read_text() if started.exists() else None)


@pytest.mark.parametrize("recipe", MULTI_NODE)
def test_several_nodes_without_master_addr_stop_with_one_line(tmp_path, recipe):
    done, started = run_recipe(tmp_path, recipe, NNODES="4")
    assert done.returncode == 2 and started is None
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"{recipe}: MASTER_ADDR is not set and NNODES=4"), line


def test_slurm_node_list_gives_node_0_and_one_node_keeps_localhost(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    # Slurm's own expansion of gpu[017-020]: one host per line, node 0 first.
    scontrol.write_text(
        '#!/bin/bash\n[[ "$1 $2 $3" == "show hostnames gpu[017-020]" ]] || exit 1\n'
        "printf 'gpu017\\ngpu018\\ngpu019\\ngpu020\\n'\n"
    )
    scontrol.chmod(0o755)
    recipe = "qwen3_30b_a3b_ep8_hgx.sh"
    done, started = run_recipe(
        tmp_path, recipe, [bin_dir], NNODES="4", SLURM_JOB_NODELIST="gpu[017-020]"
    )
    assert done.returncode == 0, done.stderr
    assert "--nnodes 4 --node-rank 2 --master-addr gpu017 " in started
    # Negative control: the node list without scontrol to read it is the one-line refusal.
    done, started = run_recipe(tmp_path, recipe, NNODES="4", SLURM_JOB_NODELIST="gpu[017-020]")
    assert (done.returncode, started) == (2, None) and "MASTER_ADDR" in done.stderr
    done, started = run_recipe(tmp_path, recipe, NNODES="1", NODE_RANK="0")
    assert done.returncode == 0 and "--master-addr localhost " in started
    done, started = run_recipe(tmp_path, recipe, NNODES="4", MASTER_ADDR="10.0.0.7")
    assert done.returncode == 0 and "--master-addr 10.0.0.7 " in started


def test_the_sbatch_example_passes_and_without_master_addr_is_a_problem(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.chdir(REPO)
    assert main(["check-recipe", str(SBATCH)]) == 0
    out = capsys.readouterr().out
    assert "PROBLEM" not in out and "2/2 recipe(s) passed" in out
    assert "--nnodes 4" in out and "--master-addr slurm-node-0.invalid" in out
    job = tmp_path / "job.sbatch"
    job.write_text(re.sub(r"^export MASTER_ADDR=.*\n", "", SBATCH.read_text(), flags=re.M))
    assert "MASTER_ADDR=" not in job.read_text()
    assert main(["check-recipe", str(job)]) == 1
    problems = [ln for ln in capsys.readouterr().out.splitlines() if "PROBLEM" in ln]
    assert len(problems) == 2 and all("MASTER_ADDR is not set and NNODES=4" in p for p in problems)


def test_a_recipe_checked_alone_notes_master_addr_and_still_reports_its_layout(capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    recipe = str(REPO / "recipes" / "qwen3_30b_a3b_ep8_hgx.sh")
    assert main(["check-recipe", "--env", "NNODES=4", recipe]) == 0
    out = capsys.readouterr().out
    assert "NOTE: needs MASTER_ADDR on several nodes" in out and "PROBLEM" not in out
    assert "world size 32 = 4 nodes x 8 GPUs" in out


def test_a_torchrun_line_of_several_nodes_at_localhost_is_a_problem(tmp_path):
    job = tmp_path / "job.sh"
    line = (
        "torchrun --nproc-per-node 8 --nnodes 4 --node-rank 0 {} pretrain_gpt.py --num-layers 2\n"
    )
    job.write_text("#!/bin/bash\n" + line.format("--master-addr localhost"))
    (problem,) = rc.capture_launch(job).problems
    assert "4 nodes rendezvous at --master-addr localhost" in problem and "MASTER_ADDR" in problem
    job.write_text("#!/bin/bash\n" + line.format(""))  # torchrun's default host, 127.0.0.1
    assert "127.0.0.1" in rc.capture_launch(job).problems[0]
    job.write_text("#!/bin/bash\n" + line.format("--master-addr node0"))
    assert rc.capture_launch(job).problems == []
    job.write_text("#!/bin/bash\n" + line.format("--rdzv-backend c10d --rdzv-endpoint node0:29400"))
    assert rc.capture_launch(job).problems == []


def test_the_235b_hgx_recipe_s_minimum_in_the_docs_is_the_one_check_recipe_accepts(monkeypatch):
    """docs/first_gpu_run.md's multiple for recipes/qwen3_235b_a22b_ep32_pp8_hgx.sh, against the
    recipe's own layout (expert-TP x EP x PP of its launch) and the checker: the minimum passes,
    half of it and one and a half of it are refused for the world size."""
    monkeypatch.setenv("MASTER_ADDR", "node0")
    text = (REPO / "docs" / "first_gpu_run.md").read_text()
    found = re.search(
        r"multiple of expert-TP x EP x PP = (\d+) x (\d+) x (\d+) = (\d+) GPUs \(`NNODES` a "
        r"multiple of (\d+)\)",
        text.replace("\n", " "),
    )
    assert found, "the docs' minimum for the 235B HGX recipe"
    etp, ep, pp, gpus, nodes = map(int, found.groups())
    recipe = REPO / "recipes" / "qwen3_235b_a22b_ep32_pp8_hgx.sh"
    launch = rc.capture_launch(recipe, {"NNODES": str(nodes)})
    args = launch.args

    def value(flag: str) -> int:
        return int(args[len(args) - 1 - args[::-1].index(flag) + 1])

    assert (etp, ep, pp) == (
        value("--expert-tensor-parallel-size"),
        value("--expert-model-parallel-size"),
        value("--pipeline-model-parallel-size"),
    )
    assert etp * ep * pp == gpus == nodes * launch.nproc_per_node
    assert rc.check_launch(launch).problems() == []
    for other in (nodes // 2, nodes * 3 // 2):  # a batch that divides: the world size is refused
        env = {"NNODES": str(other), "GLOBAL_BATCH_SIZE": "6144"}
        with pytest.raises(rc.RecipeError, match=f"world size {other * 8} is not divisible"):
            rc.check_launch(rc.capture_launch(recipe, env)).problems()
