"""Shared multi-rank runs of pretrain_gpt.py, launched once per test session, and the CPU
backend's probe process (``probe``: cpu/test_backend.py and test_native_torch.py read it).

The uninterrupted run of the resume test also provides the checkpoint the EP-equivalence
training test starts from (any checkpoint will do there; launches are the suite's main cost).
The initial checkpoint of the recipe-feature model is the balanced-training tests' common start.
"""

import json

import pytest

from gloo_launch import WORKERS, launch_gloo_ranks
from megatron_runs import (
    FINETUNE_ITERS,
    make_initial_checkpoint,
    run_pretrain,
    tiny_moe_args,
    uninterrupted_and_resumed,
)


@pytest.fixture(scope="session")
def adam_resume_runs(tmp_path_factory):
    """(run root with ckpt/, base arguments, uninterrupted, resumed) with torch Adam."""
    root = tmp_path_factory.mktemp("resume_adam")
    return (root, *uninterrupted_and_resumed(root, []))


@pytest.fixture(scope="session")
def distributed_adam_resume_runs(tmp_path_factory):
    """Same with megatron's distributed optimizer around torch Adam."""
    root = tmp_path_factory.mktemp("resume_distributed_adam")
    return (root, *uninterrupted_and_resumed(root, ["--use-distributed-optimizer"]))


@pytest.fixture(scope="session")
def finetune_runs(adam_resume_runs):
    """``get(name, nproc, ep, extra=())`` -> the --metrics-jsonl records of the tiny model trained
    ``FINETUNE_ITERS`` iterations from the resume test's checkpoint (its weights only: fresh
    optimizer and RNG, iteration 0) on ``nproc`` ranks at EP size ``ep``, with ``extra`` flags;
    each name launched once per session (the EP-equivalence and domain tests share their ``none``
    runs). The run's directory is ``<checkpoint's root>/<name>``."""
    checkpoint = adam_resume_runs[0] / "ckpt"
    done = {}

    def get(name, nproc, ep, extra=()):
        if name not in done:
            records = run_pretrain(
                checkpoint.parent / name,
                nproc,
                [
                    *tiny_moe_args(ep=ep, train_iters=FINETUNE_ITERS),
                    "--load",
                    str(checkpoint),
                    "--finetune",
                    *extra,
                ],
            )
            assert [r["iteration"] for r in records] == list(range(1, FINETUNE_ITERS + 1))
            done[name] = records
        return done[name]

    return get


@pytest.fixture(scope="session")
def initial_checkpoint(tmp_path_factory):
    """The recipe-feature model's initial state (megatron_runs.make_initial_checkpoint): the
    equivalence tests start every layout from it; launched without the CPU flags, it also shows
    pretrain_gpt.py applying them."""
    root = tmp_path_factory.mktemp("initial_checkpoint")
    return root / "ckpt", make_initial_checkpoint(root)


@pytest.fixture(scope="session")
def probe(tmp_path_factory):
    """What the CPU backend does in a fresh single-rank process (workers/cpu_backend_probe.py)."""
    out = tmp_path_factory.mktemp("cpu_backend") / "probe.json"
    launch_gloo_ranks(WORKERS / "cpu_backend_probe.py", 1, ["--out", out], timeout_s=300)
    return json.loads(out.read_text())
