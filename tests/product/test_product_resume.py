"""`ultraep resume-experiment` end to end on the tiny CPU model: resume one checkpoint under
`none`, `ultraep` and the force-balanced ideal for 3 iterations each, with the same data; the
table's TFLOP/s/GPU, fractions and imbalance figures are recomputed here from the runs' own logs
(Megatron's iteration times), Megatron's FLOPs formula on the recipe's arguments and the
per-iteration records. The launch is the recipe as a user types it, with a TRAIN_ITERS other than
the checkpoint's (Megatron refuses another LR schedule length; the driver passes the checkpoint's);
its ranks start from the session's warm launcher (ULTRAEP_PYTHON: its shim; the driver's default,
the running interpreter, is test_one_iteration_and_the_running_python's). Failed runs are
reported, not hidden."""

from __future__ import annotations

import csv
import json
import re
import sys

import pytest

from processes import run_process_group
from product_runs import CHECKPOINT_ITERATION, TINY_RECIPE, recipe_env

from ultraep_megatron.analysis import resume_runs
from ultraep_megatron.megatron.run.checkpoint_args import checkpoint_args
from ultraep_megatron.cli import main
from ultraep_megatron.megatron import recipe_check as check_recipe
from ultraep_megatron.megatron.recipe_check.model import flops_per_iteration

ITERATIONS, WARMUP = 3, 1
BALANCERS = ("none", "ultraep", "ideal")
MEGATRON_LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([0-9.]+)"
)


@pytest.fixture(scope="module")
def experiment(tiny_balanced_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_experiment")
    command = [
        sys.executable,
        "-m",
        "ultraep_megatron.cli",
        "resume-experiment",
        "--load",
        str(tiny_balanced_run.checkpoint),
        "--iterations",
        str(ITERATIONS),
        "--warmup-iterations",
        str(WARMUP),
        "--balancers",
        ",".join(BALANCERS),
        "--output-dir",
        str(out),
        # The tiny recipe forces a routing skew; the ideal run must not.
        "--ideal-args",
        "--moe-router-force-biased 0",
        "--",
        "bash",
        str(TINY_RECIPE),
    ]
    env = recipe_env(TRAIN_ITERS="10")  # the checkpoint's run: the recipe's default 40
    completed = run_process_group(command, env=env, timeout_s=1200)
    with open(out / "comparison.csv") as handle:
        table = {row["balancer"]: row for row in csv.DictReader(handle)}
    records = {b: resume_runs._read_jsonl(out / b / "metrics.jsonl") for b in BALANCERS}
    return completed, out, table, records


def megatron_times(log_path):
    """{iteration: Megatron's elapsed ms} from a run's console log."""
    return {int(m[1]): float(m[2]) for m in MEGATRON_LINE.finditer(log_path.read_text())}


@pytest.mark.slow
def test_every_balancer_resumes_the_checkpoint_for_the_window(experiment, tiny_balanced_run):
    completed, out, table, records = experiment
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    resumed = list(range(CHECKPOINT_ITERATION + 1, CHECKPOINT_ITERATION + ITERATIONS + 1))
    for index, balancer in enumerate(BALANCERS, 1):
        assert table[balancer]["status"] == "ok"
        assert int(table[balancer]["measured"]) == ITERATIONS - WARMUP
        assert sorted(records[balancer]) == resumed
        for i, iteration in enumerate(resumed, 1):  # progress while it runs
            assert (
                f"[{index}/3 {balancer}] iteration {iteration} ({i}/{ITERATIONS})"
                in completed.stdout
            )
    # The checkpoint's --train-iters (40) is passed on and wins over the recipe's (TRAIN_ITERS=10).
    for balancer in BALANCERS:
        log = (out / balancer / "log.txt").read_text()
        assert "--train-iters 40" in log.splitlines()[0]
        assert re.search(rf"iteration\s+{CHECKPOINT_ITERATION + 1}/\s+40 \|", log)
    # The checkpoint is read, never written.
    checkpoint = tiny_balanced_run.checkpoint
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip() == str(
        CHECKPOINT_ITERATION
    )
    assert sorted(p.name for p in checkpoint.glob("iter_*")) == [f"iter_{CHECKPOINT_ITERATION:07d}"]
    assert (out / "comparison.png").read_bytes().startswith(b"\x89PNG")
    markdown = (out / "comparison.md").read_text()
    assert "| TFLOP/s/GPU | fraction of ideal |" in markdown
    assert all(f"| {b} | ok |" in markdown for b in BALANCERS)


@pytest.mark.slow
def test_throughput_is_megatrons_formula_over_the_measured_window(experiment):
    completed, out, table, records = experiment
    launch = check_recipe.capture_launch(TINY_RECIPE)
    args, _ = check_recipe.validate_arguments(launch.args, launch.world_size)
    flops = flops_per_iteration(args)  # Megatron's formula, independently of the run
    measured = list(range(CHECKPOINT_ITERATION + 1 + WARMUP, CHECKPOINT_ITERATION + ITERATIONS + 1))
    tflops = {}
    for balancer in BALANCERS:
        times = megatron_times(out / balancer / "log.txt")
        assert all(
            records[balancer][i]["flops_per_iteration"] == pytest.approx(flops, rel=1e-12)
            for i in measured
        )
        seconds = sum(times[i] for i in measured) / 1e3
        tflops[balancer] = flops * len(measured) / (seconds * 1e12 * launch.world_size)
        assert float(table[balancer]["tflops"]) == pytest.approx(tflops[balancer], rel=1e-9)
        assert float(table[balancer]["time_ms"]) == pytest.approx(
            seconds * 1e3 / len(measured), rel=1e-9
        )
    for balancer in BALANCERS:
        assert float(table[balancer]["fraction_of_ideal"]) == pytest.approx(
            tflops[balancer] / tflops["ideal"], rel=1e-9
        )
        assert float(table[balancer]["speedup_vs_none"]) == pytest.approx(
            tflops[balancer] / tflops["none"], rel=1e-9
        )


@pytest.mark.slow
def test_same_data_and_imbalance_figures(experiment):
    completed, out, table, records = experiment
    measured = range(CHECKPOINT_ITERATION + 1 + WARMUP, CHECKPOINT_ITERATION + ITERATIONS + 1)

    def mean_over(balancer, pick):
        values = [v for i in measured for v in pick(records[balancer][i])]
        return sum(values) / len(values)

    router = lambda r: r["load_imbalance"].values()  # noqa: E731
    balanced = lambda r: [s["imbalance_after"] for s in r["balancer"].values()]  # noqa: E731
    # Same checkpoint, same batches: the router sends the same tokens with and without
    # balancing, and the loss is unchanged.
    for iteration in records["none"]:
        assert (
            records["ultraep"][iteration]["load_imbalance"]
            == records["none"][iteration]["load_imbalance"]
        )
        assert records["ultraep"][iteration]["losses"]["lm loss"] == pytest.approx(
            records["none"][iteration]["losses"]["lm loss"], rel=1e-5
        )
    assert table["ultraep"]["same_data_as_none"] == "yes"
    for balancer in BALANCERS:
        assert float(table[balancer]["imbalance_before"]) == pytest.approx(
            mean_over(balancer, router), rel=1e-12
        )
    assert float(table["ultraep"]["imbalance_after"]) == pytest.approx(
        mean_over("ultraep", balanced), rel=1e-12
    )
    assert float(table["none"]["imbalance_after"]) == float(table["none"]["imbalance_before"])
    # Balancing and forcing both remove most of the recipe's skew.
    assert (
        float(table["ultraep"]["imbalance_after"]) < 1.05 < float(table["none"]["imbalance_after"])
    )
    assert float(table["ideal"]["imbalance_before"]) < float(table["none"]["imbalance_before"])
    with open(out / "per_layer_imbalance.csv") as handle:
        rows = [r for r in csv.DictReader(handle) if r["balancer"] == "ultraep"]
    assert [int(r["layer"]) for r in rows] == [1, 2, 3, 4]
    for r in rows:
        expected = sum(
            records["ultraep"][i]["balancer"][r["layer"]]["imbalance_after"] for i in measured
        ) / len(measured)
        assert float(r["imbalance_after"]) == pytest.approx(expected, rel=1e-12)


# A launcher standing in for a training job, one failure mode per balancer: `ultraep` crashes,
# `none` stops after one of two iterations, `eplb` writes to the checkpoint.
FAKE_LAUNCHER = r"""
case " $* " in
  *" ultraep "*) echo "RuntimeError: boom" >&2; exit 3 ;;
  *" eplb "*) echo 9 > "$CHECKPOINT_DIR/latest_checkpointed_iteration.txt" ;;
esac
echo " [t] iteration        3/      40 | elapsed time per iteration (ms): 12.5 | throughput per GPU (TFLOP/s/GPU): 1.5 |"
case " $* " in *" none "*) exit 0 ;; esac
echo " [t] iteration        4/      40 | elapsed time per iteration (ms): 12.5 | throughput per GPU (TFLOP/s/GPU): 1.5 |"
"""


def test_failed_runs_are_reported_not_hidden(tmp_path, capsys):
    checkpoint = tmp_path / "ckpt"
    (checkpoint / "iter_0000002").mkdir(parents=True)
    (checkpoint / "latest_checkpointed_iteration.txt").write_text("2")
    out = tmp_path / "out"
    code = main(
        [
            "resume-experiment",
            "--load",
            str(checkpoint),
            "--iterations",
            "2",
            "--balancers",
            "ultraep,none,eplb",
            "--output-dir",
            str(out),
            "--",
            "bash",
            "-c",
            FAKE_LAUNCHER,
            "launcher",
        ]
    )
    printed = capsys.readouterr()
    assert code == 1
    assert "RuntimeError: boom" in printed.out  # the failed run's last lines are shown
    with open(out / "comparison.csv") as handle:
        status = {row["balancer"]: row["status"] for row in csv.DictReader(handle)}
    assert status["ultraep"] == "failed: exit code 3"
    assert status["none"].startswith("failed: logged 1 of 2 iterations")
    assert status["eplb"].startswith("failed: the run wrote to the checkpoint")
    markdown = (out / "comparison.md").read_text()
    assert "Failed runs:" in markdown and str(out / "ultraep" / "log.txt") in markdown
    assert "3 run(s) failed" in printed.err
    # Machine-readable: the same statuses as JSON on stdout, progress on stderr.
    assert (
        main(
            [
                "resume-experiment",
                "--load",
                str(checkpoint),
                "--ckpt-step",
                "2",
                "--iterations",
                "2",
                "--balancers",
                "ultraep,none",
                "--output-dir",
                str(out),
                "--json",
                "--",
                "bash",
                "-c",
                FAKE_LAUNCHER,
                "launcher",
            ]
        )
        == 1
    )
    printed = capsys.readouterr()
    runs = {r["balancer"]: r["status"] for r in json.loads(printed.out)["runs"]}
    assert runs == {"ultraep": "failed: exit code 3", "none": status["none"]}
    assert "[1/2 ultraep]" in printed.err


def test_bad_experiment_setups_are_refused(tmp_path, capsys):
    assert main(["resume-experiment", "--load", str(tmp_path), "--", "true"]) == 2
    assert "latest_checkpointed_iteration.txt" in capsys.readouterr().err
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    (tmp_path / "iter_0000002").mkdir()
    with pytest.raises(SystemExit) as exc:
        main(
            ["resume-experiment", "--load", str(tmp_path), "--balancers", "none,lplb", "--", "true"]
        )
    assert exc.value.code == 2 and "unknown" in capsys.readouterr().err
    assert (
        main(
            [
                "resume-experiment",
                "--load",
                str(tmp_path),
                "--iterations",
                "2",
                "--warmup-iterations",
                "2",
                "--",
                "true",
            ]
        )
        == 2
    )


def test_the_checkpoints_iteration_settings_are_checked_before_launching(
    tiny_balanced_run, tmp_path, capsys
):
    """The tiny recipe trains 40 iterations (its TRAIN_ITERS default), read back from the
    checkpoint; a window past them is refused before anything runs."""
    saved = checkpoint_args(tiny_balanced_run.checkpoint, CHECKPOINT_ITERATION)
    assert saved.train_iters == 40 and saved.expert_model_parallel_size == 4
    marker = tmp_path / "launched"
    assert (
        main(
            [
                "resume-experiment",
                "--load",
                str(tiny_balanced_run.checkpoint),
                "--iterations",
                "39",
                "--output-dir",
                str(tmp_path / "out"),
                "--",
                "touch",
                str(marker),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "trains 40 iterations (--train-iters 40" in err
        and "leaves 38, fewer than --iterations 39" in err
    )
    assert not marker.exists()


ONE_ITERATION = r"""
echo "python: $ULTRAEP_PYTHON"
while [ $# -gt 0 ]; do [ "$1" = --metrics-jsonl ] && metrics=$2; shift; done
echo '{"iteration": 3, "losses": {"lm loss": 6.9}, "load_imbalance": {"1": 1.5}}' > "$metrics"
echo " [t] iteration        3/      40 | elapsed time per iteration (ms): 12.5 | throughput per GPU (TFLOP/s/GPU): 1.5 |"
"""


def test_one_iteration_and_the_running_python(tmp_path, capsys, monkeypatch):
    """--iterations 1 measures that iteration (no warm-up to leave out, said so); the launch gets
    this python as ULTRAEP_PYTHON unless the environment sets one."""
    monkeypatch.delenv("ULTRAEP_PYTHON", raising=False)
    checkpoint = tmp_path / "ckpt"
    (checkpoint / "iter_0000002").mkdir(parents=True)
    (checkpoint / "latest_checkpointed_iteration.txt").write_text("2")
    out = tmp_path / "out"
    assert (
        main(
            [
                "resume-experiment",
                "--load",
                str(checkpoint),
                "--iterations",
                "1",
                "--balancers",
                "none",
                "--output-dir",
                str(out),
                "--",
                "bash",
                "-c",
                ONE_ITERATION,
                "launcher",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert (
        "no warm-up iteration is left out" in printed
        and "its --train-iters is not checked" in printed
    )
    with open(out / "comparison.csv") as handle:
        row = next(csv.DictReader(handle))
    assert (row["status"], row["measured"], float(row["time_ms"])) == ("ok", "1", 12.5)
    assert f"python: {sys.executable}" in (out / "none" / "log.txt").read_text()
    monkeypatch.setenv("ULTRAEP_PYTHON", "/opt/cluster/python")
    assert (
        main(
            [
                "resume-experiment",
                "--load",
                str(checkpoint),
                "--iterations",
                "1",
                "--balancers",
                "none",
                "--output-dir",
                str(out),
                "--",
                "bash",
                "-c",
                ONE_ITERATION,
                "launcher",
            ]
        )
        == 0
    )
    assert "python: /opt/cluster/python" in (out / "none" / "log.txt").read_text()
