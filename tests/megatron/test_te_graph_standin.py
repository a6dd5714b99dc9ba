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
    grads = standin._backward_capture(backward, [out], [x, linear.weight, linear.bias], [grad_out],
                                      allow_unused=False, retain_graph=False)
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
