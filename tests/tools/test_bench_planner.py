"""``tools/bench_planner.py --only self-check`` (a row of ``tools/gpu_check.sh``) runs where there
is no GPU: it times the fused ops' self-check (``planner.self_check``) fresh and cached at R=64,
E=256 with one domain and domains of 8, and says passed. Control: with the plan op's record off by
one in the threshold it says FAILED and exits 1 (so the GPU row cannot pass a broken kernel)."""

import re

from gloo_launch import REPO_ROOT, gloo_env, run_python

LINE = (
    r"^fused ops self-check \(plan_invocation \+ reroute_permute vs the host planner, on CPU "
    r"\(no CUDA device\)\) R=64 E=256 S=2{domains}: fresh \d+\.\d\d s, cached \d+\.\d us, {verdict}"
)

# The bench run with the op's record broken (the threshold field off by one), as a script.
BROKEN = f"""
import runpy, sys
import torch
from ultraep_megatron.planner import fused_plan
from ultraep_megatron.planner.record_layout import H_THRESHOLD
real = fused_plan._plan_on_load_device
def broken(*args):
    record, table = real(*args)
    record = record.clone()
    record[H_THRESHOLD] += 1
    return record, table
fused_plan._plan_on_load_device = broken
sys.argv = ["bench_planner.py", "--only", "self-check"]
runpy.run_path({str(REPO_ROOT / "tools" / "bench_planner.py")!r}, run_name="__main__")
"""


def test_self_check_section_runs_on_the_cpu_and_fails_on_a_broken_op(tmp_path):
    done = run_python(
        REPO_ROOT / "tools" / "bench_planner.py", ["--only", "self-check"], env=gloo_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for domains in ("", " domains of 8"):
        assert re.search(LINE.format(domains=domains, verdict="passed$"), done.stdout, re.M), (
            done.stdout
        )
    script = tmp_path / "broken_bench.py"
    script.write_text(BROKEN)
    broken = run_python(script, [], env=gloo_env())
    assert broken.returncode == 1, (broken.stdout, broken.stderr[-3000:])
    assert re.search(
        LINE.format(domains="", verdict="FAILED: \\d+ problems"), broken.stdout, re.M
    ), broken.stdout
