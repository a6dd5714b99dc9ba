"""Shared multi-rank runs of pretrain_gpt.py, launched once per test session.

The uninterrupted run of the resume test also provides the checkpoint the EP-equivalence
training test starts from (any checkpoint will do there; launches are the suite's main cost).
The initial checkpoint of the recipe-feature model is the balanced-training tests' common start.
"""

import pytest

from megatron_runs import make_initial_checkpoint, uninterrupted_and_resumed


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
def initial_checkpoint(tmp_path_factory):
    """The recipe-feature model's initial state (megatron_runs.make_initial_checkpoint): the
    equivalence tests start every layout from it; launched without the CPU flags, it also shows
    pretrain_gpt.py applying them."""
    root = tmp_path_factory.mktemp("initial_checkpoint")
    return root / "ckpt", make_initial_checkpoint(root)
