"""A CPU stand-in for Transformer Engine's CUDA graphs: ``make_graphed_callables`` (TE 2.7,
``transformer_engine/pytorch/graph.py``), what megatron-core 0.19.2's ``TECudaGraphHelper`` captures
per-layer graphs with (``--cuda-graph-impl transformer_engine``), over
``standin_graph.StandinGraph`` in ``torch.cuda.CUDAGraph``'s place; :func:`install` puts it there
(after the CPU backend is active and the model is built).

Follows TE's ``_make_graphed_callables`` on the ``_order`` path megatron takes: its checks
(callables all in training or all in eval mode, without hooks, buffers without gradients,
tensor-only sample arguments, as many sample sets as ``_order`` and ``_num_layers_per_chunk`` ask
for); the warm-up in the order's forward sequence (``num_warmup_iters`` eager forwards, each
followed by the gradient of its outputs with respect to the sample inputs and the parameters,
between megatron's ``pre_warmup_hook`` and ``post_warmup_hook``; the RNG state restored); the
capture (a forward graph per callable and microbatch for ``+chunk`` entries, a backward graph for
``-chunk`` ones, a chunk's layers in reverse, with static incoming-gradient buffers); the graphed
callable (``Graphed``: the user's tensors copied into the static inputs, the forward graph replayed,
its static outputs returned detached; its backward replays the backward graph and returns the static
input and parameter gradients), which runs the graph while the module's training mode is the
captured one and its own forward otherwise. Under fp8 it follows TE as ``te_fp8_standin``'s
docstring says.

Fails as TE does, with its exceptions and messages, on the checks above and on a replay without a
keyword argument of the sample; a capture fails where CUDA's does (``CaptureViolation``); under fp8
it refuses delayed scaling (``NotImplementedError``; megatron's ``--fp8-recipe delayed`` is refused
at startup for a balanced layer).

Leaves out: delayed scaling's amax histories, the fp8 meta of the TE modules a graph visits (no TE
module runs inside the graphs; the experts' fp8 GEMMs are ``te_grouped_fp8``'s), the device's fp8
checks, ``fp8_calibrating`` beyond the autocast, the graph memory pool and buffer reuse between
graphs (memory, never values), graph-safe RNG registration, ``retain_graph_in_backward`` (a backward
graph replays from its recording in any case), CUDA graphs' limits beyond ``standin_graph``'s; the
captured operations run through the CPU backend (``ultraep_megatron.megatron.cpu``).
"""

from __future__ import annotations

import sys
import types
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

# Re-exported: the tests and workers reach the graph and TE's fp8 names through this module.
from standin_graph import CaptureViolation, StandinGraph, _backward_capture, _engine_grad  # noqa: F401
from te_fp8_standin import (  # noqa: F401
    DelayedScaling,
    FP8GlobalStateManager,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    _wrap_autocast,
    fp8_autocast,
    get_fp8_recipe,
    is_graph_capturing,
    set_capture_end,
    set_capture_start,
)

__all__ = [
    "CaptureViolation",
    "DelayedScaling",
    "FP8GlobalStateManager",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MXFP8BlockScaling",
    "StandinGraph",
    "TE_VERSION",
    "fp8_autocast",
    "get_fp8_recipe",
    "install",
    "is_graph_capturing",
    "make_graphed_callables",
]

#: The TE version whose ``make_graphed_callables`` interface this follows: megatron-core 0.19.2
#: passes ``_num_layers_per_chunk`` from TE 2.6 on, ``_reuse_graph_input_output_buffers`` from 2.7,
#: and resets graphs (``graph.reset()``) only from 2.10; under fp8 it passes ``fp8_enabled`` as a
#: bool before 2.8 and one per callable from 2.8 on (``is_first_last_bf16_layer``).
TE_VERSION = "2.7.0"


def make_graphed_callables(
    modules,
    sample_args,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs=None,
    fp8_enabled=False,
    fp8_calibrating: bool = False,
    fp8_recipe=None,
    fp8_group=None,
    fp8_weight_caching: bool = False,
    _order: Optional[list[int]] = None,
    _num_layers_per_chunk=None,
    pool=None,
    retain_graph_in_backward: bool = False,
    _reuse_graph_input_output_buffers: bool = False,
    pre_warmup_hook: Optional[Callable] = None,
    post_warmup_hook: Optional[Callable] = None,
):
    """TE's ``make_graphed_callables`` over :class:`StandinGraph` (module docstring: what it follows
    and leaves out)."""
    just_one = not isinstance(modules, tuple)
    fp8_modules = (modules,) if just_one else modules
    if not isinstance(fp8_enabled, tuple):
        if not isinstance(fp8_enabled, bool):
            raise AssertionError("fp8_enabled must be a bool or a tuple of bools")
        fp8_enabled = (fp8_enabled,) * len(fp8_modules)
    elif len(fp8_enabled) != len(fp8_modules):
        raise AssertionError(
            f"fp8_enabled ({len(fp8_enabled)}) must be given per callable ({len(fp8_modules)})"
        )
    fp8_recipe = (
        DelayedScaling() if fp8_recipe is None else fp8_recipe
    )  # TE's get_default_fp8_recipe()
    if any(fp8_enabled) and isinstance(fp8_recipe, DelayedScaling):
        raise NotImplementedError(
            "the CUDA-graph stand-in models current-scaling fp8 only (fp8_recipe "
            "DelayedScaling: amax histories are not modelled)"
        )
    set_capture_start()
    unwrap = _wrap_autocast(fp8_modules, fp8_enabled, fp8_calibrating, fp8_recipe, fp8_group)
    try:
        return _make_graphed_callables(
            modules,
            sample_args,
            num_warmup_iters,
            allow_unused_input,
            sample_kwargs,
            fp8_weight_caching,
            _order,
            _num_layers_per_chunk,
            retain_graph_in_backward,
            pre_warmup_hook,
            post_warmup_hook,
        )
    finally:
        unwrap()
        set_capture_end()


def _make_graphed_callables(
    modules,
    sample_args,
    num_warmup_iters,
    allow_unused_input,
    sample_kwargs,
    fp8_weight_caching,
    _order,
    _num_layers_per_chunk,
    retain_graph_in_backward,
    pre_warmup_hook,
    post_warmup_hook,
):
    """TE's ``_make_graphed_callables`` (module docstring)."""
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
            raise AssertionError(
                "Modules must not have hooks registered at the time they are passed."
            )
        if any(b.requires_grad for b in module.buffers()):
            raise AssertionError(
                "only parameters may be trainable; all buffers must have requires_grad=False"
            )
    is_training = all(m.training for m in modules)
    if not is_training and any(m.training for m in modules):
        raise AssertionError(
            "make_graphed_callables only supports modules all in training or all in eval mode"
        )

    if _order is None:  # every forward graph, then every backward graph in reverse
        num_chunks, num_microbatches, layers_per_chunk = 1, 1, [len(modules)]
        order = [1, -1]
    else:
        order = list(_order)
        num_chunks = max(order)
        num_microbatches = len(order) // num_chunks // 2
        if num_chunks * num_microbatches * 2 != len(order):
            raise AssertionError(
                "_order must hold a forward and a backward per chunk and microbatch"
            )
        if _num_layers_per_chunk is None:
            layers_per_chunk = [len(sample_args) // num_chunks // num_microbatches] * num_chunks
        elif isinstance(_num_layers_per_chunk, int):
            layers_per_chunk = [_num_layers_per_chunk] * num_chunks
        else:
            layers_per_chunk = list(_num_layers_per_chunk)
    if len(modules) != sum(layers_per_chunk):
        raise AssertionError(
            f"Callables should have ({sum(layers_per_chunk)}) entries, got {len(modules)}"
        )
    if len(sample_args) != sum(layers_per_chunk) * num_microbatches or len(sample_kwargs) != len(
        sample_args
    ):
        raise AssertionError(
            f"Expected {sum(layers_per_chunk) * num_microbatches} args tuples, got {len(sample_args)}"
        )
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

    if fp8_weight_caching:  # the flag TE's modules read inside the graph, initialized
        FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(False)
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
                    needing = [
                        o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad
                    ]
                    _engine_grad(
                        needing,
                        [i for i in surfaces[idx] if i.requires_grad],
                        [torch.empty_like(o) for o in needing],
                        allow_unused=allow_unused_input,
                        retain_graph=False,
                    )
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
                grad_buffers = tuple(
                    torch.empty_like(o) if o.requires_grad else None for o in static_outputs[idx]
                )
                grads = ()
                if is_training:
                    grads = _backward_capture(
                        bwd_graphs[idx],
                        [o for o in static_outputs[idx] if o.requires_grad],
                        [i for i in surfaces[idx] if i.requires_grad],
                        [g for g in grad_buffers if g is not None],
                        allow_unused_input,
                        retain_graph_in_backward,
                    )
                grads_iter = iter(grads)
                static_grad_inputs[idx] = tuple(
                    next(grads_iter)
                    if is_training and isinstance(i, torch.Tensor) and i.requires_grad
                    else None
                    for i in surfaces[idx]
                )
                static_grad_outputs[idx] = grad_buffers
            bwd_count[chunk] += 1
    torch.cuda.set_rng_state(rng_state)

    graphed = []
    for idx in range(len(flat_args)):
        function = _graphed_function(
            fwd_graphs[idx],
            bwd_graphs[idx],
            module_params[idx],
            kwargs_keys[idx],
            len(flat_args[idx]),
            output_specs[idx],
            surfaces[idx],
            static_outputs[idx],
            static_grad_outputs[idx],
            static_grad_inputs[idx],
            fp8_weight_caching,
        )
        module = callable_of[idx]
        forward = _graphed_forward(module, module.training, function, module.forward)
        forward.graphs = (fwd_graphs[idx], bwd_graphs[idx])  # for tests: replay counts, recordings
        if _order is None:
            module.forward = forward
            graphed.append(module)
        else:
            graphed.append(forward)
    return graphed[0] if just_one else tuple(graphed)


def _graphed_function(
    fwd_graph,
    bwd_graph,
    module_params,
    kwargs_keys,
    num_user_args,
    output_spec,
    surface,
    static_outputs,
    static_grad_outputs,
    static_grad_inputs,
    fp8_weight_caching=False,
):
    """TE's ``Graphed`` autograd function and its ``functionalized`` caller, for one graph pair."""

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, skip_fp8_weight_update, *inputs):
            ctx.is_first_module = FP8GlobalStateManager.is_first_fp8_module()
            if ctx.is_first_module and skip_fp8_weight_update is not None:
                FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(skip_fp8_weight_update)
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
            if ctx.is_first_module:
                FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
            return (None,) + tuple(
                g.detach() if g is not None else None for g in static_grad_inputs
            )

    def functionalized(*user_args, **user_kwargs):
        skip_fp8_weight_update = None
        if fp8_weight_caching:
            if not isinstance(user_kwargs.get("is_first_microbatch"), bool):
                raise AssertionError(
                    "`is_first_microbatch` boolean kwarg must be provided for FP8 weight caching."
                )
            skip_fp8_weight_update = not user_kwargs["is_first_microbatch"]
        for key in kwargs_keys:
            if key not in user_kwargs:
                raise TypeError(
                    f"Graphed callable was initialized with kwarg {key}, but it was not "
                    "provided in graph replay"
                )
        flat = tree_flatten(user_args)[0] + tree_flatten([user_kwargs[k] for k in kwargs_keys])[0]
        out = Graphed.apply(skip_fp8_weight_update, *flat, *module_params)
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
        raise AttributeError(
            f"{name}.{attribute}: only TE's CUDA graphs are stood in here "
            "(tests/megatron/te_graph_standin.py)"
        )

    module.__getattr__ = missing
    return module


def install() -> None:
    """Make megatron's TE graph path capture with this stand-in: ``TECudaGraphHelper``'s
    ``make_graphed_callables`` and its TE check, the TE version megatron reads (``TE_VERSION``),
    and an empty ``transformer_engine.pytorch`` for the replay path's import check; under fp8,
    megatron's ``fp8_utils.get_fp8_recipe`` as it runs with TE (:func:`get_fp8_recipe`), which the
    helper calls for ``make_graphed_callables``' ``fp8_recipe``. Call after the model is built
    (megatron decides what TE provides when it is imported)."""
    from packaging.version import Version

    from megatron.core import fp8_utils
    from megatron.core import utils as mcore_utils
    from megatron.core.transformer import cuda_graphs

    if not fp8_utils.HAVE_TE:  # its TE-less get_fp8_recipe returns None
        fp8_utils.get_fp8_recipe = get_fp8_recipe
    FP8GlobalStateManager.reset()

    if "transformer_engine" not in sys.modules:
        package, pytorch = (
            _te_module("transformer_engine"),
            _te_module("transformer_engine.pytorch"),
        )
        package.__dict__["pytorch"] = pytorch
        package.__dict__["__version__"] = TE_VERSION
        package.__dict__["__path__"] = []
        sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"] = (
            package,
            pytorch,
        )
    mcore_utils._te_version = Version(TE_VERSION)
    cuda_graphs.HAVE_TE_GRAPHS = True
    cuda_graphs.make_graphed_callables = make_graphed_callables
