"""Iteration boundaries belong to the model: each model's ``finalize_model_grads_func`` ends its own
context's iteration (``layer_spec.end_model_iterations``), so two models in one process
each get theirs, numbered by the caller's loop (``pretrain_gpt.py``: megatron.training's
``curr_iteration + 1``; Megatron-Bridge: its ``train_state.step + 1``), which the trace recorder
follows from its first record. The end-to-end checks (trace iterations match the loop's) are
``test_balanced_training.py::test_trace_records_every_microbatch_once_mtp_included`` and, on
Bridge, ``tests/bridge/test_bridge_pipeline.py``."""

import functools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.training import global_vars  # noqa: E402

from ultraep_megatron.megatron.balanced_layer.context import BalancingContext  # noqa: E402
from ultraep_megatron.megatron.run.layer_spec import (  # noqa: E402
    end_model_iterations,
    megatron_training_iteration,
)
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


#: The iteration source of ``pretrain_gpt.py``'s entry (``balance_moe_layers``' default).
end_megatron_iterations = functools.partial(
    end_model_iterations, current_iteration=megatron_training_iteration
)


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
    end_megatron_iterations([model_a], a)
    end_megatron_iterations([model_b], b)
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
    end_megatron_iterations([model_c], a)
    model_c.config.finalize_model_grads_func = finalize
    run_iteration(model_c, 12, megatron_args, calls)
    assert ended_iterations([a, b]) == [14, 11]
    # Wrapping is idempotent: a second hook for the same context does not end an iteration twice.
    end_megatron_iterations([model_c], a)
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
    end_megatron_iterations([model_a], a)
    end_megatron_iterations([model_b], a)  # the second model's context is ignored
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


def _recorded_iterations(tmp_path, trace: str, follow: bool) -> list[int]:
    """A run resumed at Bridge's step 100 (megatron.training's globals never set): two iterations
    of two microbatches of layer 1, the hook numbering them by the caller's step when ``follow``
    (else a recorder without a hook, numbering from 1). The iterations of the trace's records."""
    from ultraep_megatron.traces import find_trace_files, read_trace

    assert global_vars._GLOBAL_ARGS is None
    calls = []
    finalize = lambda model, num_tokens: calls.append(model[0])  # noqa: E731
    balancing = context(tmp_path, trace)
    balancing.trace.describe(
        None,
        SimpleNamespace(
            hidden_size=8,
            moe_ffn_hidden_size=8,
            gated_linear_unit=False,
            moe_router_topk=1,
            num_layers=1,
            mtp_num_layers=None,
        ),
    )
    state = SimpleNamespace(step=100)
    model = Chunk(finalize)
    if follow:
        end_model_iterations([model], balancing, current_iteration=lambda: state.step + 1)
    else:
        model.config.finalize_model_grads_func = balancing.ending_iterations(
            finalize, lambda: state.step + 1
        )
    plan = SimpleNamespace(load=torch.tensor([[3, 1], [0, 4]]))  # [R, E] one microbatch's load
    for _ in range(2):  # Bridge's loop: forward/backward, finalize, then step += 1
        model(torch.zeros(1))
        for _ in range(2):
            balancing.trace.on_invocation(1, plan, training=True, ep_rank=0)
        model.config.finalize_model_grads_func([model], num_tokens=None)
        state.step += 1
    balancing.close()
    (path,) = find_trace_files(tmp_path / trace)
    return read_trace(path).iteration.tolist()


def test_the_trace_is_numbered_by_the_hooks_iteration_from_its_first_record(tmp_path):
    """The recorder reads the running iteration from the model's iteration hook (Bridge's
    ``train_state.step + 1`` here): a resumed run's first iteration is 101, not 1, with none of
    megatron.training's globals set. Negative control: a recorder no hook numbers starts at 1."""
    assert _recorded_iterations(tmp_path, "hooked", follow=True) == [101, 101, 102, 102]
    assert _recorded_iterations(tmp_path, "unhooked", follow=False) == [1, 1, 102, 102]
