"""Session fixtures of the product tests (see product_runs.py)."""

import pytest

from product_runs import TinyRun, run_tiny_balanced


@pytest.fixture(scope="session")
def tiny_balanced_run(tmp_path_factory) -> TinyRun:
    """The tiny recipe, balanced, 2 iterations, checkpoint at iteration 2 (one 4-rank launch)."""
    return run_tiny_balanced(tmp_path_factory.mktemp("tiny_balanced"))
