"""The CUDA-graph stand-in (``te_graph_standin``) behaves as a graph: a replay re-executes the
captured tensor operations on new data in the static buffers and runs none of the captured Python,
and a capture refuses what CUDA's stream capture refuses (host reads of device data, shapes that
depend on the data, host waits on streams and events). Independent check: the same computation run
eagerly on the same inputs.
"""

import pytest
import torch

import te_graph_standin as standin
from ultraep_megatron.megatron.cpu import torch_cuda


def captured_function():
    """A small layer with a data-dependent *order* (a sort, fixed shapes) and a Python side effect."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    calls = []

    def function(x):
        calls.append(1)
        y = linear(x).relu()
        order = torch.sort(y.sum(1), stable=True).indices
        return y.index_select(0, order) * 2, order

    return linear, function, calls


def test_capture_replay_recomputes_from_the_static_inputs_without_python():
    linear, function, calls = captured_function()
    x = torch.randn(5, 4, requires_grad=True)
    forward, backward = standin.StandinGraph(), standin.StandinGraph()
    with forward.capture():
        out, order = function(x)
    grad_out = torch.empty_like(out)
    grads = standin._backward_capture(
        backward,
        [out],
        [x, linear.weight, linear.bias],
        [grad_out],
        allow_unused=False,
        retain_graph=False,
    )
    assert len(calls) == 1 and forward.num_operations > 0 and backward.num_operations > 0
    for seed in range(3):  # new data in the static buffers, then the graphs replayed
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            x.copy_(torch.randn(5, 4, generator=gen))
            grad_out.copy_(torch.randn(5, 3, generator=gen))
        forward.replay()
        backward.replay()
        eager_x = x.detach().clone().requires_grad_(True)
        linear.zero_grad()
        eager_out, eager_order = function(eager_x)
        eager_out.backward(grad_out)
        assert torch.equal(out, eager_out) and torch.equal(order, eager_order)
        for replayed, eager in zip(grads, (eager_x.grad, linear.weight.grad, linear.bias.grad)):
            assert torch.allclose(replayed, eager, rtol=0, atol=1e-6)
    # One Python call per eager check, none per replay.
    assert len(calls) == 1 + 3 and forward.replays == 3 and backward.replays == 3


def test_capture_replay_does_not_see_host_state_the_capture_set():
    """Host state set inside the capture is the capture's: a replay does not update it."""
    state = {}
    x = torch.zeros(3)
    graph = standin.StandinGraph()
    with graph.capture():
        y = x + 1
        state["shape_seen"] = tuple(y.shape)
        state["tensor"] = y
    with torch.no_grad():
        x.fill_(41.0)
    graph.replay()
    assert state["tensor"] is y and torch.equal(y, torch.full((3,), 42.0))  # the buffer is updated
    state.clear()
    graph.replay()
    assert state == {}  # ... and no Python ran


def violations():
    x = torch.randn(4, 3)
    return {
        "item": lambda: x.sum().item(),
        "int": lambda: int(x.argmax()),
        "bool": lambda: bool((x > 0).any()),
        "tolist": lambda: x.tolist(),
        "numpy": lambda: x.numpy(),
        "cpu": lambda: x.cpu(),
        "to_cpu": lambda: x.to("cpu"),
        "copy_to_host": lambda: torch.empty(3, device="cpu").copy_(x[0]),
        "equal": lambda: torch.equal(x, x),
        "nonzero": lambda: x.nonzero(),
        "masked_select": lambda: x.masked_select(x > 0),
        "bool_mask_index": lambda: x[x > 0],
        "unique": lambda: x.round().unique(),
        "bincount": lambda: torch.bincount(torch.tensor([0, 2])),
        "repeat_interleave_without_size": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
        "event_synchronize": lambda: torch_cuda.CpuEvent().synchronize(),
        "event_query": lambda: torch_cuda.CpuEvent().query(),
        "stream_synchronize": lambda: torch_cuda.CpuStream().synchronize(),
        "device_synchronize": lambda: torch_cuda._synchronize(),
    }


@pytest.mark.parametrize("name", list(violations()))
def test_capture_guard_refuses_what_cuda_capture_refuses(name):
    with pytest.raises(RuntimeError) as error:
        with standin.StandinGraph().capture():
            violations()[name]()
    refused = isinstance(error.value, standin.CaptureViolation)
    assert refused or "not permitted when stream is capturing" in str(error.value), error.value


def test_capture_guard_accepts_fixed_shapes_and_stream_dependencies():
    """The negative control of the guard: what a graph can capture passes. Outside a capture
    nothing is refused."""
    x = torch.randn(4, 3)
    with standin.StandinGraph().capture():
        torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([1, 2]), output_size=3)
        x[torch.tensor([0, 2])]
        torch.sort(x[:, 0], stable=True)
        torch.searchsorted(torch.tensor([0, 2, 5]), torch.tensor([1, 4]))
        event, stream = torch_cuda.CpuEvent(), torch_cuda.CpuStream()
        event.record()
        stream.wait_event(event)
        assert torch_cuda.is_capturing()
    assert not torch_cuda.is_capturing()
    x.sum().item(), torch_cuda.CpuEvent().synchronize(), x.nonzero()


class AutocastRecorder(torch.nn.Module):
    """A linear layer that records the fp8 autocast state its Python runs under."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.seen = []

    def forward(self, x):
        manager = standin.FP8GlobalStateManager
        self.seen.append((manager.FP8_ENABLED, manager.FP8_RECIPE, manager.FP8_GRAPH_CAPTURING))
        return self.linear(x)


@pytest.fixture
def host_device(monkeypatch):
    """What the CPU backend maps for the stand-in's calls in a worker, here without it: the RNG
    state TE saves around the capture, and the skip flag's tensor (TE allocates it on 'cuda')."""
    monkeypatch.setattr(torch.cuda, "get_rng_state", torch.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", torch.set_rng_state)
    standin.FP8GlobalStateManager.reset()
    standin.FP8GlobalStateManager.skip_fp8_weight_update_tensor = torch.empty(1)
    yield
    standin.FP8GlobalStateManager.reset()


def test_fp8_capture_runs_under_tes_autocast_and_replays_with_weight_caching(host_device):
    """TE's fp8 contract of ``make_graphed_callables``: warm-up and capture inside ``fp8_autocast``
    with the recipe and ``_graph=True``, the class's ``__call__`` unwrapped and the autocast state
    restored afterwards; with weight caching a replay needs ``is_first_microbatch`` and (first fp8
    module of its autocast) sets the skip-weight-update flag to its negation, and the backward
    replay asks for the amax reduction. The replay computes what the module computes eagerly."""
    torch.manual_seed(0)
    module = AutocastRecorder()
    recipe = standin.Float8CurrentScaling(fp8_format=standin.Format.HYBRID)
    x = torch.randn(5, 4, requires_grad=True)
    graphed = standin.make_graphed_callables(
        module,
        (x,),
        num_warmup_iters=2,
        fp8_enabled=True,
        fp8_recipe=recipe,
        fp8_weight_caching=True,
    )
    assert module.seen == [(True, recipe, True)] * 3  # two warm-up iterations and the capture
    assert (
        "__call__" not in AutocastRecorder.__dict__
        and not standin.FP8GlobalStateManager.FP8_ENABLED
    )
    assert not standin.is_graph_capturing()
    with pytest.raises(AssertionError, match="is_first_microbatch"):
        graphed(x)
    for first in (True, False):
        new_x = torch.randn(5, 4)
        with standin.fp8_autocast(enabled=True, fp8_recipe=recipe):
            out = graphed(new_x, is_first_microbatch=first)
        assert float(standin.FP8GlobalStateManager.skip_fp8_weight_update_tensor[0]) == float(
            not first
        )
        assert torch.equal(out, module.linear(new_x))
    assert len(module.seen) == 3, "a replay ran the module's Python"
    out.sum().backward()
    assert standin.FP8GlobalStateManager.reductions[False] == 1


def test_fp8_enabled_per_callable_and_delayed_scaling_refused(host_device):
    """``fp8_enabled`` per callable (TE >= 2.8, megatron's ``is_first_last_bf16_layer``) enables
    the autocast per instance; the stand-in refuses delayed scaling (TE's default recipe), which it
    does not model."""
    first, last = AutocastRecorder(), AutocastRecorder()
    x, y = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    recipe = standin.MXFP8BlockScaling()
    standin.make_graphed_callables(
        (first, last),
        ((x,), (y,)),
        num_warmup_iters=1,
        fp8_enabled=(True, False),
        fp8_recipe=recipe,
    )
    assert {enabled for enabled, _, _ in first.seen} == {True}
    assert {enabled for enabled, _, _ in last.seen} == {False}
    with pytest.raises(AssertionError, match="per callable"):
        standin.make_graphed_callables(
            (AutocastRecorder(),), ((x,),), fp8_enabled=(True, False), fp8_recipe=recipe
        )
    with pytest.raises(NotImplementedError, match="DelayedScaling"):
        standin.make_graphed_callables(AutocastRecorder(), (x,), fp8_enabled=True)
