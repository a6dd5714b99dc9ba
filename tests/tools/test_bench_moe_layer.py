"""``tools/bench_moe_layer.py`` keeps running: every layer of its table (megatron's, the balanced
ones, the controls) builds, runs interleaved and is reported. A dry run on the CPU (EP=2, small
shapes, few iterations): its figures mean nothing at this size; the benchmark's own runs are in
docs/integration.md."""

import re
import subprocess
import sys

from gloo_launch import REPO_ROOT, gloo_env


def test_moe_layer_benchmark_runs_every_layer_on_the_cpu():
    completed = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "tools" / "bench_moe_layer.py"),
            "--hidden-size",
            "32",
            "--ffn-hidden-size",
            "64",
            "--tokens-per-rank",
            "128",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=gloo_env(),
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = completed.stdout
    assert "MoE layer fwd+bwd, EP=2" in out and "hidden 32, ffn 64, 128 tokens/rank" in out, out
    rows = dict(
        re.findall(r"^\| ([a-z][a-z +-]*?) +\| +\d+\.\d \|.*?\| +(\d\.\d{3}) \(", out, re.M)
    )
    for label in (
        "none",
        "ultraep",
        "ultraep no-overlap",
        "ultraep no transfers",
        "eplb-exact",
        "force-balanced",
        "force-balanced again",
        "ultraep experts only",
        "force-balanced experts only",
    ):
        assert label in rows, (label, out)
    # The derived figures under the table follow from the table's (to their printed precision).
    ultraep, floor = (
        float(rows["ultraep"]),
        re.search(
            r"^noise floor: .*?critical x f-b \S+ \(repeats ([\d. ]+)\): .*? varied by up to (\d\.\d\d)",
            out,
            re.M,
        ),
    )
    assert (
        floor and abs(float(floor[2]) - max(abs(float(r) - 1) for r in floor[1].split())) <= 0.01
    ), out
    control = re.search(
        r"^without transfers .*?critical x f-b (\d\.\d{3}) .*?; ultraep's (\d\.\d{3}) over it, "
        r"(\d\.\d{3}),",
        out,
        re.M,
    )
    assert (
        control
        and float(control[1]) == float(rows["ultraep no transfers"])
        and float(control[2]) == ultraep
    )
    assert quotient_as_printed(float(control[3]), float(control[2]), float(control[1]), 3, 3), (
        control[0]
    )
    alone = re.search(
        r"^expert compute alone .*?critical x f-b (\d\.\d\d) .*?; the layer's (\d\.\d\d) over "
        r"it, (\d\.\d{3}),",
        out,
        re.M,
    )
    assert alone and quotient_as_printed(float(alone[3]), float(alone[2]), float(alone[1]), 2, 3), (
        alone[0]
    )
    # The balanced layers report their overheads per iteration.
    assert re.search(
        r"^ultraep: transfers \d+\.\d\d ms per iteration when waited where issued", out, re.M
    ), out


def quotient_as_printed(
    quotient: float, numerator: float, denominator: float, digits: int, quotient_digits: int
) -> bool:
    """Whether a printed ``quotient`` is ``numerator / denominator`` of two figures printed with
    ``digits`` decimals: within what their rounding and its own can move it."""
    half, own = 0.5 * 10**-digits, 0.5 * 10**-quotient_digits
    slack = (
        half / denominator + (numerator + half) * half / (denominator * (denominator - half)) + own
    )
    return abs(quotient - numerator / denominator) <= slack + 1e-12


def test_quotient_as_printed_sees_a_wrong_division():
    """Negative control of the check above: the report's own line passes, a quotient off by more
    than the rounding allows (or the inverse ratio) fails."""
    assert quotient_as_printed(0.719, 0.688, 0.956, 3, 3) and quotient_as_printed(
        0.792, 0.69, 0.87, 2, 3
    )
    assert not quotient_as_printed(0.725, 0.688, 0.956, 3, 3)
    assert not quotient_as_printed(0.956 / 0.688, 0.688, 0.956, 3, 3)
