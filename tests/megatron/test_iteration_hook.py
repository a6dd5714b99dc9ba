"""Iteration boundaries belong to the model: each model's ``finalize_model_grads_func`` ends its own
context's iteration (``layer_spec.end_model_iterations``), so two models in one process
each get theirs. The end-to-end check (trace iterations match megatron's log) is
``test_balanced_training.py::test_trace_records_every_microbatch_once_mtp_included``."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.training import global_vars  # noqa: E402

from ultraep_megatron.megatron.balanced_layer.context import BalancingContext  # noqa: E402
from ultraep_megatron.megatron.run.layer_spec import end_model_iterations  # noqa: E402
from ultraep_megatron.planner import BalancerConfig  # noqa: E402


class Chunk(torch.nn.Module):
    """A model chunk as megatron's ``get_model_config`` sees it: a module with a ``config``."""

    def __init__(self, finalize):
        super().__init__()
        self.config = SimpleNamespace(finalize_model_grads_func=finalize)

    def forward(self, x):
        return x


@pytest.fixture
def megatron_args():
    args = SimpleNamespace(curr_iteration=0)
    previous = global_vars._GLOBAL_ARGS
    global_vars.set_args(args)
    yield args
    global_vars.set_args(previous)


def context(tmp_path, name):
    return BalancingContext(BalancerConfig("ultraep", num_slots=1), trace_dir=str(tmp_path / name))


def ended_iterations(contexts):
    """The iteration each context's trace recorder expects next (``None``: no iteration ended)."""
    return [c.trace.iteration for c in contexts]


def run_iteration(chunk, iteration, args, calls):
    """What megatron's training step does for the hook: forward, then finalize_model_grads."""
    args.curr_iteration = iteration
    chunk(torch.zeros(1))
    chunk.config.finalize_model_grads_func([chunk], num_tokens=None)
    assert calls[-1] is chunk  # the function megatron or the builder set still runs


def test_two_models_in_one_process_each_end_their_own_iterations(tmp_path, megatron_args):
    calls = []
    finalize = lambda model, num_tokens: calls.append(model[0])  # noqa: E731 (a builder's hook)
    a, b = context(tmp_path, "a"), context(tmp_path, "b")
    model_a, model_b = Chunk(finalize), Chunk(finalize)
    end_model_iterations([model_a], a)
    end_model_iterations([model_b], b)
    assert ended_iterations([a, b]) == [None, None]
    run_iteration(model_a, 4, megatron_args, calls)
    assert ended_iterations([a, b]) == [
        6,
        None,
    ]  # iteration 5 (megatron's log number) ended in a only
    run_iteration(model_b, 9, megatron_args, calls)
    assert ended_iterations([a, b]) == [6, 11]
    # megatron-core 0.18 replaces the function when training starts: the first forward wraps again.
    model_a.config.finalize_model_grads_func = finalize
    model_c = Chunk(finalize)
    end_model_iterations([model_c], a)
    model_c.config.finalize_model_grads_func = finalize
    run_iteration(model_c, 12, megatron_args, calls)
    assert ended_iterations([a, b]) == [14, 11]
    # Wrapping is idempotent: a second hook for the same context does not end an iteration twice.
    end_model_iterations([model_c], a)
    ends = []
    a.end_iteration = ends.append
    run_iteration(model_c, 13, megatron_args, calls)
    assert ends == [14]


def test_negative_control_one_hook_for_the_process_ends_the_other_models_iterations(
    tmp_path, megatron_args
):
    """What the process-wide ``training_log`` patch did: one context for every model. The check above
    sees it: model b's iteration ends a's context, never b's."""
    calls = []
    finalize = lambda model, num_tokens: calls.append(model[0])  # noqa: E731
    a, b = context(tmp_path, "a"), context(tmp_path, "b")
    model_a, model_b = Chunk(finalize), Chunk(finalize)
    end_model_iterations([model_a], a)
    end_model_iterations([model_b], a)  # the second model's context is ignored
    run_iteration(model_b, 9, megatron_args, calls)
    assert ended_iterations([a, b]) != [None, 11]


def test_the_callers_iteration_without_megatron_training_globals(tmp_path):
    """Megatron-Bridge's loop sets none of megatron.training's globals: the caller's iteration
    (its ``train_state.step``) numbers the iteration that ends."""
    calls = []
    finalize = lambda model, num_tokens: calls.append(model[0])  # noqa: E731
    a = context(tmp_path, "a")
    step = {"value": 7}
    model_a = Chunk(finalize)
    end_model_iterations([model_a], a, current_iteration=lambda: step["value"])
    model_a(torch.zeros(1))
    model_a.config.finalize_model_grads_func([model_a], num_tokens=None)
    assert calls[-1] is model_a
    assert ended_iterations([a]) == [8]  # iteration 7 ended
