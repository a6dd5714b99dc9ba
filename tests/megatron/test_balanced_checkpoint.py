"""Checkpoints and --moe-balancer: replica state never enters a checkpoint, and a checkpoint saved
under one balancer resumes under another with the same continuation.

Tiny fp32 MoE GPT, EP=2 on 2 gloo ranks. An ``ultraep`` and a ``none`` run each train
6 iterations saving torch_dist checkpoints at iteration 3; resumes from iteration 3 must continue
as the uninterrupted runs did: ultraep -> ultraep bit for bit; across balancers within the noise
floor of the two uninterrupted runs (``ultraep`` against ``none``: the same mathematics summed in
another order, measured here, ``equivalence.py``).
"""

import pytest
import torch.distributed.checkpoint as dcp

from equivalence import compare_series, failures, summary
from megatron_runs import run_pretrain, tiny_moe_args

pytestmark = pytest.mark.slow

NPROC, EP, ITERS, SAVE_AT = 2, 2, 6, 3


def args(balancer):
    # The router's own (unforced) imbalance: megatron's --moe-router-force-biased draws its bias
    # once per process, so a resumed process would route differently from the uninterrupted one.
    return [
        *tiny_moe_args(ep=EP, train_iters=ITERS),
        "--moe-balancer",
        balancer,
        "--moe-balancer-num-slots",
        "1",
        "--moe-balancer-min-quota",
        "1",
    ]


def by_iteration(records):
    return {
        r["iteration"]: (r["losses"]["lm loss"], r["grad_norm"], r.get("balancer")) for r in records
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("balanced_ckpt")
    out = {}
    for balancer in ("ultraep", "none"):
        out[balancer] = by_iteration(
            run_pretrain(
                root / f"{balancer}_full",
                NPROC,
                [
                    *args(balancer),
                    "--save",
                    str(root / f"ckpt_{balancer}"),
                    "--save-interval",
                    str(SAVE_AT),
                ],
            )
        )
    for saved, resumed in (("ultraep", "ultraep"), ("ultraep", "none"), ("none", "ultraep")):
        out[f"{saved}->{resumed}"] = by_iteration(
            run_pretrain(
                root / f"{saved}_to_{resumed}",
                NPROC,
                [
                    *args(resumed),
                    "--load",
                    str(root / f"ckpt_{saved}"),
                    "--ckpt-step",
                    str(SAVE_AT),
                ],
            )
        )
    return root, out


def test_ultraep_resume_is_exact(runs):
    _, out = runs
    full, resumed = out["ultraep"], out["ultraep->ultraep"]
    assert sorted(resumed) == list(range(SAVE_AT + 1, ITERS + 1))
    for it, (loss, norm, stats) in resumed.items():
        assert (loss, norm) == full[it][:2], f"iteration {it}"
        assert stats and sum(v["replicas"] for v in stats.values()) > 0, (
            "replicas used after resume"
        )


@pytest.mark.parametrize("saved,resumed", [("ultraep", "none"), ("none", "ultraep")])
def test_resume_across_balancers(runs, saved, resumed):
    _, out = runs
    cont, full = out[f"{saved}->{resumed}"], out[saved]
    assert sorted(cont) == list(range(SAVE_AT + 1, ITERS + 1))
    comparisons = []
    for index, what in enumerate(("lm loss", "grad norm")):
        values = {
            name: {it: record[index] for it, record in run.items()}
            for name, run in (
                ("cont", cont),
                ("full", full),
                ("ultraep", out["ultraep"]),
                ("none", out["none"]),
            )
        }
        expected = {it: values["full"][it] for it in cont}
        comparisons += compare_series(
            what, values["cont"], expected, values["ultraep"], values["none"]
        )
    print(f"\n{saved} -> {resumed}: {summary(comparisons)}")
    assert not failures(comparisons), failures(comparisons)


def checkpoint_keys(path):
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def test_no_replica_state_in_checkpoints(runs):
    root, _ = runs
    keys = {
        b: checkpoint_keys(root / f"ckpt_{b}" / f"iter_{SAVE_AT:07d}") for b in ("ultraep", "none")
    }
    assert keys["ultraep"] == keys["none"], sorted(keys["ultraep"] ^ keys["none"])
    assert not [k for k in keys["ultraep"] if "replica" in k.lower() or "ultraep" in k.lower()]
    assert any("experts" in k for k in keys["ultraep"]), "expert weights are checkpointed"
