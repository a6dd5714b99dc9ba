"""--moe-balancer-domain-size on megatron-core's training loop: an EP=4 run (4 gloo CPU ranks) whose
replicas must stay inside NVLink domains of 2 ranks trains as ``--moe-balancer none`` does, and
neither its telemetry nor its routing trace shows a replica outside its home's domain.

One launch: the ``none`` runs it is compared with are the EP-equivalence test's (conftest's
``finetune_runs``: the same checkpoint, batches and iterations). The tolerance is the noise floor
between two ``none`` runs of the same model in different layouts (EP=1 on 2 ranks against EP=4 on 4
ranks), measured in the same session (``equivalence.py``).
"""

import pytest
import torch

from equivalence import compare_series, failures, summary
from megatron_runs import FINETUNE_ITERS

pytestmark = pytest.mark.slow

DOMAIN, SLOTS = 2, 2
NAME = "ep4_n4_ultraep_domain2"


@pytest.fixture(scope="module")
def runs(finetune_runs, adam_resume_runs):
    """(EP=1 none, EP=4 none, EP=4 ultraep in domains of 2, the latter's trace directory)."""
    trace_dir = adam_resume_runs[0] / NAME / "trace"
    balanced = finetune_runs(
        NAME,
        4,
        4,
        [
            "--moe-balancer",
            "ultraep",
            "--moe-balancer-num-slots",
            str(SLOTS),
            "--moe-balancer-domain-size",
            str(DOMAIN),
            "--moe-balancer-trace-dir",
            str(trace_dir),
        ],
    )
    return finetune_runs("ep1_n2", 2, 1), finetune_runs("ep4_n4", 4, 4), balanced, trace_dir


def series(records, what):
    return {
        r["iteration"]: (r["losses"]["lm loss"] if what == "lm loss" else r["grad_norm"])
        for r in records
    }


def test_trains_with_none_equivalent_losses(runs):
    ep1, ep4, balanced, _ = runs
    comparisons = []
    for what in ("lm loss", "grad norm"):
        comparisons += compare_series(
            what, series(balanced, what), series(ep4, what), series(ep1, what), series(ep4, what)
        )
    print(f"\ndomain-constrained ultraep vs none: {summary(comparisons)}")
    assert not failures(comparisons), failures(comparisons)
    losses = series(ep4, "lm loss")
    assert len(set(losses.values())) == FINETUNE_ITERS, "the model must be training"


def test_telemetry_shows_replicas_but_none_across_a_domain(runs):
    _, _, balanced, _ = runs
    replicas = 0.0
    for record in balanced:
        for layer, stats in record["balancer"].items():
            assert stats["cross_domain_replicas"] == 0, (record["iteration"], layer)
            assert 0.0 <= stats["balanced_fraction"] <= 1.0
            replicas += stats["replicas"]
    assert replicas > 0, "the domain-constrained planner must really replicate"


def test_trace_shows_no_cross_domain_replica(runs):
    """The run's loads, re-planned with its recorded policy, reproduce its telemetry with no
    replica outside its home's domain, while the same loads planned over one domain need some (so
    the zero is the constraint's doing)."""
    from ultraep_megatron import planner
    from ultraep_megatron.planner import BalancerConfig
    from ultraep_megatron.traces import find_trace_files, read_trace

    _, _, balanced, trace_dir = runs
    trace = read_trace(find_trace_files(trace_dir)[0])
    meta = trace.header.meta
    assert (meta["domain_size"], meta["num_slots"]) == (DOMAIN, SLOTS)
    config = BalancerConfig(
        meta["balancer"], num_slots=meta["num_slots"], domain_size=meta["domain_size"]
    )
    balancers = {layer: config.build() for layer in trace.layers}
    telemetry = {r["iteration"]: r["balancer"] for r in balanced}
    crossing_without_domains = 0
    for i in range(len(trace.layer)):
        load, layer, iteration = trace.load[i], int(trace.layer[i]), int(trace.iteration[i])
        m = planner.metrics(load, balancers[layer].plan(load), domain_size=DOMAIN)
        assert m["cross_domain_replicas"] == 0
        assert (
            m["replicas"] == telemetry[iteration][str(layer)]["replicas"]
        )  # one microbatch per iteration
        free = planner.solve(load, SLOTS)
        crossing_without_domains += planner.metrics(load, free, domain_size=DOMAIN)[
            "cross_domain_replicas"
        ]
    assert len(trace.layer) == FINETUNE_ITERS * len(trace.layers)
    assert crossing_without_domains > 0
    assert torch.equal(trace.iteration.unique(), torch.arange(1, FINETUNE_ITERS + 1))
