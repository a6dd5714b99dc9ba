"""A CPU stand-in for Transformer Engine's CUDA graphs: ``make_graphed_callables``
(``transformer_engine/pytorch/graph.py``), what megatron-core's ``TECudaGraphHelper`` captures
per-layer graphs with (``--cuda-graph-impl transformer_engine``), over :class:`StandinGraph` in
``torch.cuda.CUDAGraph``'s place.

What it follows of TE's ``_make_graphed_callables`` (the ``_order`` path megatron takes):

* the checks: callables all in training mode (or all in eval), no hooks on them, buffers without
  gradients, tensor-only sample arguments, as many sample argument sets as ``_order`` and
  ``_num_layers_per_chunk`` ask for;
* warm-up: each callable, in the order's forward sequence, runs ``num_warmup_iters`` times
  eagerly, each forward followed by the gradient of its outputs (``empty_like`` incoming gradients,
  as TE passes) with respect to its static input surface (sample arguments that need a gradient,
  then the module's parameters), between megatron's ``pre_warmup_hook`` and ``post_warmup_hook``;
  the CUDA RNG state is restored afterwards;
* capture in the order's sequence: a forward graph per (callable, microbatch) for ``+chunk``
  entries, a backward graph for ``-chunk`` entries (layers of a chunk in reverse), each backward
  graph the gradient of the forward graph's outputs that need one, with static incoming-gradient
  buffers;
* the graphed callable: ``Graphed.forward`` copies the user's tensors into the static input
  buffers (where they are not those buffers), replays the forward graph and returns its static
  outputs detached; ``Graphed.backward`` (once differentiable) copies the incoming gradients into
  the static gradient buffers, replays the backward graph and returns the static input gradients
  (``None`` for inputs without one), the module's parameters among them, so autograd accumulates
  them; with ``_order`` the result per (callable, microbatch) is a forward function that runs the
  graph while the module's training mode is the captured one, its own forward otherwise; keyword
  arguments of the sample must be given at replay.

:class:`StandinGraph` behaves as a graph does: its capture runs the Python of the captured region
once and records every aten operation it issues (a ``TorchDispatchMode``), and a replay re-executes
those *tensor operations* on the recorded tensors, writing each result into the tensor the capture
produced (the static buffers, whose storage stays fixed), and runs no Python of the captured region:
host state the region set at capture (an attribute, an object) is what the capture left, not what a
replay would compute. Parameters, static inputs and other tensors made before the capture are read
where they are at replay, as a graph reads fixed addresses; Python numbers in the region are baked
in, as kernel arguments are. A collective in the region (gloo here, NCCL on a GPU) is re-issued at
replay and waited for at once.

What a capture refuses, as CUDA's stream capture does (:class:`CaptureViolation`): a host read of
tensor data (``item``, ``int``/``float``/``bool`` of a tensor, ``tolist``, ``numpy``, ``__array__``,
``cpu()`` / ``to('cpu')``, a copy into a host tensor made with ``pin_memory`` or on ``'cpu'``,
``torch.equal``), an operation whose output shape depends on the data (aten's
``dynamic_output_shape`` operations: ``nonzero``, ``unique``, ``masked_select``, boolean-mask
indexing, ``repeat_interleave`` without ``output_size``, ``bincount``), and a host wait or poll on
a stream, an event or the device (the CPU backend's stand-ins refuse those inside
``torch_cuda.stream_capture``). A violation raises where it happens, as CUDA's capture fails there.

Left out: fp8 (TE's ``fp8_autocast`` wrapping, amax reductions, weight caching: refused); the
graph memory pool and buffer reuse between graphs (``pool``, ``_reuse_graph_input_output_buffers``:
each graph keeps its own buffers, which changes memory, never values); graph-safe RNG state
registration (a random operation draws anew at each replay, as with registered generators);
``retain_graph_in_backward`` (the backward graph is replayed from its recording in any case);
TE's filtering of the TE modules a graph visits (for fp8 meta); CUDA graphs' own limits beyond the ones above
(a kernel launch from another thread, an allocation that TE's pool would refuse); the captured
operations themselves run on the CPU, through the CPU backend (``ultraep_megatron.megatron.cpu``).

Usage (after the CPU backend is active and the model is built)::

    import te_graph_standin
    te_graph_standin.install()    # megatron's TECudaGraphHelper now captures with this
"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ultraep_megatron.megatron.cpu import torch_cuda
from ultraep_megatron.megatron.balanced_layer.native_torch import device_mapping

#: The TE version whose ``make_graphed_callables`` interface this follows: megatron-core 0.19.2
#: passes ``_num_layers_per_chunk`` from TE 2.6 on, ``_reuse_graph_input_output_buffers`` from 2.7,
#: and resets graphs (``graph.reset()``) only from 2.10.
TE_VERSION = "2.7.0"


class CaptureViolation(RuntimeError):
    """An operation inside a capture that a CUDA graph cannot capture (module docstring)."""


_HOST_READS = {
    torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.__array__: "__array__",
    torch.Tensor.cpu: "cpu()", torch.Tensor.__repr__: "repr", torch.Tensor.__format__: "format",
}


def _is_host(device) -> bool:
    return (isinstance(device, str) and device == "cpu") or (isinstance(device, torch.device) and device.type == "cpu")


class _HostReadGuard(TorchFunctionMode):
    """Inside a capture: refuses host reads that bypass aten (``tolist``, ``numpy``, ``cpu()``,
    ``to('cpu')``, a copy into a host tensor). Host tensors are those made inside the capture with
    ``pin_memory=True`` or on ``'cpu'`` explicitly (every other tensor is device memory here)."""

    def __init__(self):
        super().__init__()
        self._host = torch.utils.weak.WeakIdKeyDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise CaptureViolation(f"{_HOST_READS[func]} of a tensor inside a CUDA graph capture: a host "
                                   "read of device data (the capture would wait for the device)")
        if func is torch.Tensor.to and (any(_is_host(a) for a in args[1:2]) or _is_host(kwargs.get("device"))):
            raise CaptureViolation("to('cpu') of a tensor inside a CUDA graph capture: a device-to-host copy "
                                   "(its data would be the capture's, not a replay's)")
        if func is torch.Tensor.copy_ and len(args) > 1 and args[0] in self._host:
            raise CaptureViolation("copy_ into a host tensor inside a CUDA graph capture: a device-to-host "
                                   "copy (its data would be the capture's, not a replay's)")
        result = func(*args, **kwargs)
        if kwargs.get("pin_memory") or _is_host(kwargs.get("device")):
            for t in tree_flatten(result)[0]:
                if isinstance(t, torch.Tensor):
                    self._host[t] = True
        return result


def _shape_depends_on_data(func, args, kwargs) -> bool:
    """aten's ``dynamic_output_shape`` operations, less the calls whose shape is fixed by their
    arguments: ``repeat_interleave`` given ``output_size``, indexing with integer indices only."""
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func is torch.ops.aten.repeat_interleave.Tensor:
        return kwargs.get("output_size", args[1] if len(args) > 1 else None) is None
    if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return True


@dataclass
class _Recorded:
    """One aten call of a capture: what it was called with and the tensors it produced."""

    func: Any
    args: tuple
    kwargs: dict
    outputs: list  # the call's flattened outputs (tensors and anything else)


_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                torch.ops.aten.new_empty_strided.default}


class _Recorder(TorchDispatchMode):
    """Records every aten call of a capture (:class:`_Recorded`) and refuses host reads and
    data-dependent shapes at the aten level."""

    def __init__(self):
        super().__init__()
        self.tape: list[_Recorded] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.data_dependent_output in func.tags:
            raise CaptureViolation(f"{func} inside a CUDA graph capture: a host read of device data "
                                   "(item(), int(), bool() of a tensor, torch.equal)")
        if _shape_depends_on_data(func, args, kwargs):
            raise CaptureViolation(f"{func} inside a CUDA graph capture: its output shape depends on the "
                                   "data (a graph's shapes are fixed at capture)")
        result = func(*args, **kwargs)
        self.tape.append(_Recorded(func, args, kwargs, tree_flatten(result)[0]))
        return result


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class StandinGraph:
    """``torch.cuda.CUDAGraph`` as TE uses it, on the CPU: ``with graph.capture(): ...`` records the
    region's tensor operations, :meth:`replay` re-executes them (module docstring)."""

    def __init__(self):
        self._tape: Optional[list[_Recorded]] = None
        self.replays = 0

    @contextlib.contextmanager
    def capture(self):
        if self._tape is not None:
            raise RuntimeError("this graph was captured already")
        recorder, guard = _Recorder(), _HostReadGuard()
        with torch_cuda.stream_capture(), recorder, guard:
            yield
        self._tape = recorder.tape

    @property
    def num_operations(self) -> int:
        return len(self._tape or ())

    def replay(self) -> None:
        if self._tape is None:
            raise RuntimeError("replay of a graph that was never captured")
        with torch.no_grad():
            for op in self._tape:
                if op.func.is_view or op.func in _ALLOCATIONS:
                    continue  # a view shares its base's storage; an allocation runs no kernel
                fresh = tree_flatten(op.func(*op.args, **op.kwargs))[0]
                inputs = [t for t in tree_flatten((op.args, op.kwargs))[0] if isinstance(t, torch.Tensor)]
                for recorded, new in zip(op.outputs, fresh):
                    if isinstance(new, torch._C.ScriptObject) and hasattr(new, "wait"):
                        new.wait()  # a collective's work: done before anything reads its output
                    if not isinstance(new, torch.Tensor) or new is recorded:
                        continue
                    if any(new is t for t in inputs) or _aliases(new, recorded):
                        continue  # an in-place or out= call wrote the recorded tensor itself
                    if new.shape != recorded.shape:
                        raise CaptureViolation(f"{op.func} replayed to shape {tuple(new.shape)}, captured "
                                               f"{tuple(recorded.shape)}")
                    recorded.copy_(new)
        self.replays += 1


def _engine_grad(outputs, inputs, grad_outputs, *, allow_unused: bool, retain_graph: bool,
                 modes: tuple = ()) -> tuple:
    """``torch.autograd.grad`` with the CPU backend's device mapping (and ``modes``) active inside
    the backward: a torch-function mode is off in its own handler, and ``autograd.grad`` is one of
    its calls, so megatron's Python backward functions would otherwise allocate on a CUDA device."""
    from torch.autograd.graph import _engine_run_backward

    pushed = [m for m in (device_mapping(), *modes) if m is not None]
    for mode in pushed:
        torch._C._push_on_torch_function_stack(mode)
    try:
        grads = _engine_run_backward(tuple(outputs), tuple(grad_outputs), retain_graph, False, tuple(inputs),
                                     allow_unused, accumulate_grad=False)
    finally:
        for _ in pushed:
            torch._C._pop_torch_function_stack()
    return grads


def _backward_capture(graph: StandinGraph, outputs, inputs, grad_outputs, allow_unused: bool, retain_graph: bool):
    """The backward graph's capture: the function-level guard active inside the backward as well."""
    recorder, guard = _Recorder(), _HostReadGuard()
    if graph._tape is not None:
        raise RuntimeError("this graph was captured already")
    with torch_cuda.stream_capture(), recorder:
        grads = _engine_grad(outputs, inputs, grad_outputs, allow_unused=allow_unused,
                             retain_graph=retain_graph, modes=(guard,))
    graph._tape = recorder.tape
    return grads


def make_graphed_callables(modules, sample_args, num_warmup_iters: int = 3, allow_unused_input: bool = False,
                           sample_kwargs=None, fp8_enabled=False, fp8_calibrating: bool = False,
                           fp8_recipe=None, fp8_group=None, fp8_weight_caching: bool = False,
                           _order: Optional[list[int]] = None, _num_layers_per_chunk=None, pool=None,
                           retain_graph_in_backward: bool = False,
                           _reuse_graph_input_output_buffers: bool = False,
                           pre_warmup_hook: Optional[Callable] = None,
                           post_warmup_hook: Optional[Callable] = None):
    """TE's ``make_graphed_callables`` over :class:`StandinGraph` (module docstring: what it follows
    and leaves out)."""
    if any(fp8_enabled) if isinstance(fp8_enabled, tuple) else fp8_enabled:
        raise NotImplementedError("the CUDA-graph stand-in captures high precision only (fp8_enabled)")
    just_one = not isinstance(modules, tuple)
    if just_one:
        modules, sample_args = (modules,), (sample_args,)
        sample_kwargs = (sample_kwargs or {},)
    elif sample_kwargs is None:
        sample_kwargs = tuple({} for _ in sample_args)
    for module in modules:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Graphing for {type(module)} is not supported.")
        if module._backward_hooks or module._forward_hooks or module._forward_pre_hooks:
            raise AssertionError("Modules must not have hooks registered at the time they are passed.")
        if any(b.requires_grad for b in module.buffers()):
            raise AssertionError("only parameters may be trainable; all buffers must have requires_grad=False")
    is_training = all(m.training for m in modules)
    if not is_training and any(m.training for m in modules):
        raise AssertionError("make_graphed_callables only supports modules all in training or all in eval mode")

    if _order is None:  # every forward graph, then every backward graph in reverse
        num_chunks, num_microbatches, layers_per_chunk = 1, 1, [len(modules)]
        order = [1, -1]
    else:
        order = list(_order)
        num_chunks = max(order)
        num_microbatches = len(order) // num_chunks // 2
        if num_chunks * num_microbatches * 2 != len(order):
            raise AssertionError("_order must hold a forward and a backward per chunk and microbatch")
        if _num_layers_per_chunk is None:
            layers_per_chunk = [len(sample_args) // num_chunks // num_microbatches] * num_chunks
        elif isinstance(_num_layers_per_chunk, int):
            layers_per_chunk = [_num_layers_per_chunk] * num_chunks
        else:
            layers_per_chunk = list(_num_layers_per_chunk)
    if len(modules) != sum(layers_per_chunk):
        raise AssertionError(f"Callables should have ({sum(layers_per_chunk)}) entries, got {len(modules)}")
    if len(sample_args) != sum(layers_per_chunk) * num_microbatches or len(sample_kwargs) != len(sample_args):
        raise AssertionError(f"Expected {sum(layers_per_chunk) * num_microbatches} args tuples, got {len(sample_args)}")
    prefix = [0]
    for n in layers_per_chunk:
        prefix.append(prefix[-1] + n)

    kwargs_keys = [list(kw.keys()) for kw in sample_kwargs]
    flat_args = []
    for args, kw, keys in zip(sample_args, sample_kwargs, kwargs_keys):
        flat = tree_flatten(args)[0] + tree_flatten([kw[k] for k in keys])[0]
        if not all(isinstance(a, torch.Tensor) for a in tree_flatten(args)[0]):
            raise AssertionError("sample_args for each callable must contain only Tensors")
        flat_args.append(tuple(flat))
    module_params, callable_of = [], []  # per (callable, microbatch), in sample order
    for chunk in range(num_chunks):
        for _ in range(num_microbatches):
            for layer in range(layers_per_chunk[chunk]):
                module = modules[prefix[chunk] + layer]
                callable_of.append(module)
                module_params.append(tuple(module.parameters()))
    surfaces = [flat_args[i] + module_params[i] for i in range(len(flat_args))]

    def forward_indices(c_id, mb):
        chunk = c_id - 1
        start = prefix[chunk] * num_microbatches + mb * layers_per_chunk[chunk]
        return [start + layer for layer in range(layers_per_chunk[chunk])]

    rng_state = torch.cuda.get_rng_state()
    # Warm-up, in the order's forward sequence.
    if pre_warmup_hook is not None:
        pre_warmup_hook()
    fwd_count = [0] * num_chunks
    for c_id in order:
        if c_id <= 0:
            continue
        for idx in forward_indices(c_id, fwd_count[c_id - 1]):
            for _ in range(num_warmup_iters):
                outputs = tree_flatten(callable_of[idx](*sample_args[idx], **sample_kwargs[idx]))[0]
                if is_training:
                    needing = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
                    _engine_grad(needing, [i for i in surfaces[idx] if i.requires_grad],
                                 [torch.empty_like(o) for o in needing], allow_unused=allow_unused_input,
                                 retain_graph=False)
                del outputs
        fwd_count[c_id - 1] += 1
    if post_warmup_hook is not None:
        post_warmup_hook()

    # Capture: forward graphs in the order's sequence, backward graphs (layers in reverse) likewise.
    fwd_graphs = [StandinGraph() for _ in flat_args]
    bwd_graphs = [StandinGraph() for _ in flat_args]
    static_outputs, output_specs = [None] * len(flat_args), [None] * len(flat_args)
    static_grad_outputs, static_grad_inputs = [None] * len(flat_args), [None] * len(flat_args)
    fwd_count, bwd_count = [0] * num_chunks, [0] * num_chunks
    for c_id in order:
        if c_id > 0:
            for idx in forward_indices(c_id, fwd_count[c_id - 1]):
                with fwd_graphs[idx].capture():
                    outputs = callable_of[idx](*sample_args[idx], **sample_kwargs[idx])
                flat, spec = tree_flatten(outputs)
                static_outputs[idx], output_specs[idx] = tuple(flat), spec
            fwd_count[c_id - 1] += 1
        else:
            chunk = -c_id - 1
            for idx in reversed(forward_indices(-c_id, bwd_count[chunk])):
                grad_buffers = tuple(torch.empty_like(o) if o.requires_grad else None for o in static_outputs[idx])
                grads = ()
                if is_training:
                    grads = _backward_capture(
                        bwd_graphs[idx], [o for o in static_outputs[idx] if o.requires_grad],
                        [i for i in surfaces[idx] if i.requires_grad], [g for g in grad_buffers if g is not None],
                        allow_unused_input, retain_graph_in_backward)
                grads_iter = iter(grads)
                static_grad_inputs[idx] = tuple(
                    next(grads_iter) if is_training and isinstance(i, torch.Tensor) and i.requires_grad else None
                    for i in surfaces[idx])
                static_grad_outputs[idx] = grad_buffers
            bwd_count[chunk] += 1
    torch.cuda.set_rng_state(rng_state)

    graphed = []
    for idx in range(len(flat_args)):
        function = _graphed_function(fwd_graphs[idx], bwd_graphs[idx], module_params[idx], kwargs_keys[idx],
                                     len(flat_args[idx]), output_specs[idx], surfaces[idx], static_outputs[idx],
                                     static_grad_outputs[idx], static_grad_inputs[idx])
        module = callable_of[idx]
        forward = _graphed_forward(module, module.training, function, module.forward)
        forward.graphs = (fwd_graphs[idx], bwd_graphs[idx])  # for tests: replay counts, recordings
        if _order is None:
            module.forward = forward
            graphed.append(module)
        else:
            graphed.append(forward)
    return graphed[0] if just_one else tuple(graphed)


def _graphed_function(fwd_graph, bwd_graph, module_params, kwargs_keys, num_user_args, output_spec,
                      surface, static_outputs, static_grad_outputs, static_grad_inputs):
    """TE's ``Graphed`` autograd function and its ``functionalized`` caller, for one graph pair."""

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for i in range(num_user_args):
                if surface[i].data_ptr() != inputs[i].data_ptr():
                    surface[i].copy_(inputs[i])
            fwd_graph.replay()
            return tuple(o.detach() for o in static_outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            assert len(grads) == len(static_grad_outputs)
            for buffer, grad in zip(static_grad_outputs, grads):
                if buffer is not None and buffer.data_ptr() != grad.data_ptr():
                    buffer.copy_(grad)
            bwd_graph.replay()
            return tuple(g.detach() if g is not None else None for g in static_grad_inputs)

    def functionalized(*user_args, **user_kwargs):
        for key in kwargs_keys:
            if key not in user_kwargs:
                raise TypeError(f"Graphed callable was initialized with kwarg {key}, but it was not "
                                "provided in graph replay")
        flat = tree_flatten(user_args)[0] + tree_flatten([user_kwargs[k] for k in kwargs_keys])[0]
        out = Graphed.apply(*flat, *module_params)
        return tree_unflatten(list(out), output_spec)

    return functionalized


def _graphed_forward(module, training: bool, graphed, original_forward):
    def forward(*user_args, **user_kwargs):
        if module.training == training:
            return graphed(*user_args, **user_kwargs)
        return original_forward(*user_args, **user_kwargs)

    return forward


def _te_module(name: str) -> types.ModuleType:
    """A named empty module in sys.modules: megatron's replay path imports
    ``transformer_engine.pytorch`` only to check that TE is there."""
    module = types.ModuleType(name)
    module.__doc__ = "stand-in: tests/megatron/te_graph_standin.py (CUDA graphs only)"

    def missing(attribute):
        raise AttributeError(f"{name}.{attribute}: only TE's CUDA graphs are stood in here "
                             "(tests/megatron/te_graph_standin.py)")

    module.__getattr__ = missing
    return module


def install() -> None:
    """Make megatron's TE graph path capture with this stand-in: ``TECudaGraphHelper``'s
    ``make_graphed_callables`` and its TE check, the TE version megatron reads (``TE_VERSION``),
    and an empty ``transformer_engine.pytorch`` for the replay path's import check. Call after the
    model is built (megatron decides what TE provides when it is imported)."""
    from packaging.version import Version

    from megatron.core import utils as mcore_utils
    from megatron.core.transformer import cuda_graphs

    if "transformer_engine" not in sys.modules:
        package, pytorch = _te_module("transformer_engine"), _te_module("transformer_engine.pytorch")
        package.__dict__["pytorch"] = pytorch
        package.__dict__["__version__"] = TE_VERSION
        package.__dict__["__path__"] = []
        sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"] = package, pytorch
    mcore_utils._te_version = Version(TE_VERSION)
    cuda_graphs.HAVE_TE_GRAPHS = True
    cuda_graphs.make_graphed_callables = make_graphed_callables
