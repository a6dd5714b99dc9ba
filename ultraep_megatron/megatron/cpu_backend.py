"""CPU backend for megatron-core 0.19.2: run the real MoE layer and training loop over gloo.

Megatron-core assumes a CUDA device everywhere on its training path. On a machine without
one (developer laptops, CI), :func:`activate` makes "the CUDA device" an alias of the CPU,
at runtime and from outside the wheel (no file of site-packages is edited):

* allocations on ``'cuda'`` / ``cuda:N`` / device index N land on the CPU (a
  :class:`~torch.overrides.TorchFunctionMode` rewrites the device arguments);
* ``torch.cuda`` calls that would raise without a device (streams, events, RNG state,
  memory statistics, ``current_device``) get their CPU meaning;
* Megatron's own CUDA-only assumptions (its ``is_available()`` assert, the model-parallel
  and RNG-tracker set-up it skips when ``device_count() == 0``, split sizes for
  ``all_to_all_single``, tensor type strings, fusion warm-up) are patched one by one;
* the CUDA generator *is* the CPU generator (CPU dropout draws from it), so Megatron's RNG
  tracker swaps its named states in and out of the CPU generator, and building the data
  iterators must not draw from it (else a resumed run would diverge);
* resuming megatron's DistributedOptimizer around torch's Adam (no Apex/TE on a CPU) keeps each
  parameter's Adam step.

Every patch carries a one-line reason (see :data:`PATCHES` after activation) and is applied
only when ``torch.cuda.is_available()`` is False. It is a development and CI backend: the
patches change where tensors live, never what is computed, so CPU runs are exact (the
expert-parallel equivalence tests compare EP=2/4 with EP=1 bit-for-bit or to 1e-6).

Torch-level ``torch.cuda.is_available()`` and ``device_count()`` stay truthful; only
``megatron.training.initialize`` sees one device. Run one thread per rank
(``OMP_NUM_THREADS=1``) and pass :data:`REQUIRED_ARGS` to ``pretrain`` (``pretrain_gpt.py``
applies the missing ones itself, see :func:`apply_required_args`).

Usage::

    from ultraep_megatron.megatron import cpu_backend
    cpu_backend.activate()          # before building Megatron models; idempotent

The balancer's own host code (planning, reroute, replica transfers) runs without the device
mapping (:func:`native_torch`): it names no CUDA device, and the mode's per-call dispatch would be
most of its cost here.

Limit: Python backward functions see the device mapping when the backward pass starts with
``Tensor.backward`` or ``torch.autograd.backward`` (what Megatron's schedules call), not with
``torch.autograd.grad``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import types
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

#: Flags a CPU ``pretrain`` run needs: flag -> (its value, or None for a switch; why).
CPU_FLAGS: dict[str, tuple[str | None, str]] = {
    "--distributed-backend": ("gloo", "NCCL needs GPUs"),
    "--transformer-impl": ("local", "Transformer Engine needs GPUs"),
    "--no-gradient-accumulation-fusion": (None, "fused wgrad accumulation is an Apex/TE CUDA kernel"),
    "--no-persist-layer-norm": (None, "persistent LayerNorm is an Apex CUDA kernel"),
    "--no-bias-gelu-fusion": (None, "torch.compile'd fusion; eager is the CPU reference"),
    "--no-bias-dropout-fusion": (None, "torch.compile'd fusion; eager is the CPU reference"),
    "--no-rope-fusion": (None, "fused RoPE is a TE/Apex CUDA kernel"),
    "--no-masked-softmax-fusion": (None, "fused softmax is a CUDA kernel"),
}

#: :data:`CPU_FLAGS` as command-line arguments.
REQUIRED_ARGS: tuple[str, ...] = tuple(
    token for flag, (value, _) in CPU_FLAGS.items() for token in (flag, value) if token is not None)


def apply_required_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` (a ``pretrain`` command line) completed with the :data:`CPU_FLAGS` it lacks.

    A missing flag is appended (a CPU run cannot do without it); a flag given with another value
    is an error, since the user asked for something this machine cannot run.

    Returns:
        (the completed argv, one line per flag applied, naming it and why).

    Raises:
        ValueError: naming the conflicting flag and the value a CPU run needs.
    """
    given: dict[str, str | None] = {}
    for i, token in enumerate(argv):
        flag, sep, value = token.partition("=")
        if flag in CPU_FLAGS:
            given[flag] = value if sep else (argv[i + 1] if i + 1 < len(argv) else None)
    argv, applied = list(argv), []
    for flag, (value, why) in CPU_FLAGS.items():
        if flag not in given:
            argv += [flag] if value is None else [flag, value]
            applied.append(f"{flag}{'' if value is None else ' ' + value} ({why})")
        elif value is not None and given[flag] != value:
            raise ValueError(f"{flag} {given[flag]} cannot run without a CUDA device ({why}); "
                             f"pass {flag} {value} or run on a GPU machine")
    return argv, applied


#: (target, reason) for every patch applied by :func:`activate`; empty until then.
PATCHES: list[tuple[str, str]] = []

_ACTIVE = False
_FUNCTION_MODE: TorchFunctionMode | None = None


def cuda_present() -> bool:
    """True when a CUDA device can be used; the backend then does nothing."""
    return torch.cuda.is_available()


def is_active() -> bool:
    """True once :func:`activate` has patched this process."""
    return _ACTIVE


def native_torch(fn: Callable) -> Callable:
    """Decorator: ``fn`` runs without the device mapping's per-call dispatch.

    The mapping is a Python torch-function mode, so every torch call and tensor attribute read
    passes through it (about 2.5 us each here). The balancer's host planning and data-plane calls
    name only devices taken from tensors and need none of it; Megatron code must never run inside.
    Only the mapping is lifted, and only when it is the innermost mode: a mode pushed after it (the
    tests' host-read counter) keeps seeing every call. Does nothing on a GPU (no mode there).
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # torch's own stack primitives, not its context manager: this runs several times per
        # layer and microbatch, and the context manager costs a dozen Python calls.
        depth = torch._C._len_torch_function_stack() if _ACTIVE else 0
        if depth == 0 or torch._C._get_function_stack_at(depth - 1) is not _FUNCTION_MODE:
            return fn(*args, **kwargs)
        mode = torch._C._pop_torch_function_stack()
        try:
            return fn(*args, **kwargs)
        finally:
            torch._C._push_on_torch_function_stack(mode)

    return wrapper


# ---------------------------------------------------------------------------------------------
# Device mapping: "cuda" means the CPU.
# ---------------------------------------------------------------------------------------------

_CPU = torch.device("cpu")


def is_cuda_device(device: Any) -> bool:
    """True for 'cuda', 'cuda:N', torch.device('cuda', N) and a bare device index N."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    # A bare int is a CUDA ordinal in torch's device arguments (bool is an int, never a device).
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaAsCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU, for every torch call made while active.

    Megatron allocates with ``device='cuda'`` / ``torch.cuda.current_device()`` in about a
    hundred places, moves batches with ``.cuda()``, and checks ``tensor.type()`` strings.
    """

    _TENSOR_TYPE_AS_CUDA = {
        "torch.FloatTensor": "torch.cuda.FloatTensor",
        "torch.HalfTensor": "torch.cuda.HalfTensor",
        "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.backward:
            return self._backward(*_tensor_backward_to_autograd(*args, **kwargs))
        if func is torch.autograd.backward:
            return self._backward(*args, **kwargs)
        if "device" in kwargs and is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if kwargs.get("pin_memory"):
            # Pinning needs a CUDA driver; pageable CPU memory is what a CPU run uses anyway.
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's optimizers and grad clipping dispatch on 'torch.cuda.*Tensor' names.
            name = func(*args)
            return self._TENSOR_TYPE_AS_CUDA.get(name, name)
        return func(*args, **kwargs)

    def _backward(self, tensors, grad_tensors=None, retain_graph=None, create_graph=False,
                  inputs=None):
        """``torch.autograd.backward`` with this mode active inside the backward pass.

        A mode is off while its handler runs, and autograd captures the mode stack when a
        backward pass starts; megatron's Python backward functions (all-to-all, gathers)
        allocate on CUDA, so the engine is started here with the mode pushed again.
        """
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward

        tensors = (tensors,) if torch.is_tensor(tensors) else tuple(tensors)
        if inputs is None:
            inputs = ()
        elif torch.is_tensor(inputs):
            inputs = (inputs,)
        else:
            inputs = tuple(inputs)
        grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)),
                            is_grads_batched=False)
        if retain_graph is None:
            retain_graph = create_graph
        torch._C._push_on_torch_function_stack(self)
        try:
            _engine_run_backward(tensors, grads, retain_graph, create_graph, inputs,
                                 allow_unreachable=True, accumulate_grad=True)
        finally:
            torch._C._pop_torch_function_stack()


def _tensor_backward_to_autograd(tensor, gradient=None, retain_graph=None, create_graph=False,
                                 inputs=None):
    """Tensor.backward's arguments as torch.autograd.backward's."""
    return tensor, gradient, retain_graph, create_graph, inputs


# ---------------------------------------------------------------------------------------------
# torch.cuda stand-ins with CPU meaning.
# ---------------------------------------------------------------------------------------------


class _CpuEvent:
    """A CUDA event on a device whose work is always complete when the host reaches it."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end_event) -> float:
        return 0.0


class _CpuStream:
    """A CUDA stream on a device that executes every op synchronously, in program order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _CpuStream()


def _current_stream(device=None) -> _CpuStream:
    return _DEFAULT_STREAM


class _StreamContext:
    """``torch.cuda.stream(s)``: a no-op scope that, like ``torch.cuda.StreamContext``, can be
    entered more than once (megatron's DDP enters one twice with several distributed-optimizer
    instances)."""

    def __init__(self, stream=None):
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc):
        return False


def _noop(*args, **kwargs):
    return None


def _zero(*args, **kwargs) -> int:
    return 0


def _cpu_get_rng_state(device="cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device="cuda", *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all (left unpatched: a lazy no-op).
    torch.default_generator.manual_seed(int(seed))


# torch.cuda attribute -> (replacement, reason). Only functions that raise (or silently do
# nothing) without a device are replaced; is_available()/device_count() stay truthful.
_TORCH_CUDA_PATCHES: dict[str, tuple[Any, str]] = {
    "current_device": (lambda: 0, "Megatron allocates on device=current_device(); ordinal 0 maps to the CPU"),
    "set_device": (_noop, "rank-to-GPU binding has no CPU meaning"),
    "Stream": (_CpuStream, "the alltoall dispatcher, DDP and shared experts build side streams; CPU ops run in order"),
    "Event": (_CpuEvent, "stream events order work that the CPU already runs in order"),
    "current_stream": (_current_stream, "callers compare and wait on streams; one CPU stream"),
    "default_stream": (_current_stream, "callers compare and wait on streams; one CPU stream"),
    "stream": (_StreamContext, "side-stream scopes are no-ops on the CPU"),
    "set_stream": (_noop, "side-stream selection is a no-op on the CPU"),
    "synchronize": (_noop, "CPU work is complete when the host reaches the call"),
    "empty_cache": (_noop, "no caching allocator to release on the CPU"),
    "get_rng_state": (_cpu_get_rng_state, "the CUDA generator is the CPU generator (dropout on CPU draws from it)"),
    "set_rng_state": (_cpu_set_rng_state, "the CUDA generator is the CPU generator (checkpoint resume restores it)"),
    "manual_seed": (_cpu_manual_seed, "the CUDA generator is the CPU generator (seeded by Megatron's RNG set-up)"),
    "memory_allocated": (_zero, "memory reports read CUDA allocator counters; the CPU has none"),
    "max_memory_allocated": (_zero, "memory reports read CUDA allocator counters; the CPU has none"),
    "memory_reserved": (_zero, "memory reports read CUDA allocator counters; the CPU has none"),
    "max_memory_reserved": (_zero, "memory reports read CUDA allocator counters; the CPU has none"),
    "reset_peak_memory_stats": (_noop, "memory reports read CUDA allocator counters; the CPU has none"),
    "memory_stats": (lambda *a, **k: {}, "memory reports read CUDA allocator counters; the CPU has none"),
    "is_current_stream_capturing": (lambda: False, "megatron's router tracer (--moe-routing-trace-path) skips CUDA-graph capture; the CPU never captures"),
}


# ---------------------------------------------------------------------------------------------
# Megatron-level patches.
# ---------------------------------------------------------------------------------------------


class _OneDeviceCudaView(types.ModuleType):
    """``torch.cuda`` as seen by megatron.training.initialize: one (CPU-aliased) device."""

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1


class _TorchViewForInitialize(types.ModuleType):
    """``torch`` as seen by megatron.training.initialize; everything but ``cuda`` is torch."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _OneDeviceCudaView()

    def __getattr__(self, name):
        return getattr(torch, name)


def _maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Megatron's DtoH helper, also converting CPU tensors when numpy is asked for.

    The alltoall dispatcher asks for numpy split sizes; megatron converts only CUDA tensors,
    and gloo's ``all_to_all_single`` rejects tensor split sizes.
    """
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().cpu().numpy()
    return tensor


def _make_cpu_rng_tracker_class():
    from megatron.core.tensor_parallel import random as mcore_random

    class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
        """Megatron's RNG-states tracker on the CPU default generator.

        Dropout on the CPU draws from the CPU default generator, so each named state
        (data-parallel, model-parallel, expert-parallel) must be swapped into *that*
        generator; megatron's tracker swaps the CUDA generator and warns whenever the CPU
        state changes inside a fork, which here is every fork.
        """

        def __init__(self, use_cudagraphable_rng=False, is_inference_rng_tracker=False):
            if use_cudagraphable_rng:
                raise ValueError("CUDA-graph-safe RNG states need a GPU")
            super().__init__(use_cudagraphable_rng=False,
                             is_inference_rng_tracker=is_inference_rng_tracker)

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            outer_state = torch.get_rng_state()
            torch.default_generator.manual_seed(int(seed))
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)

        @contextlib.contextmanager
        def fork(self, name=mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_name = self._current_state_name
            outer_state = torch.get_rng_state()
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(
                        f"current state name {self._current_state_name} is not the same as "
                        f"the desired state name {name}."
                    )
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker


def _rng_neutral(build: Callable) -> Callable:
    """``build`` with the CPU generator's state restored afterwards.

    torch's DataLoader draws a base seed from the default generator when an iterator is made;
    on a GPU that generator is not the one dropout uses, here it is. A resumed run builds its
    iterators after restoring the checkpoint's RNG state, so that draw must leave no trace.
    """

    def build_without_consuming_rng(*args, **kwargs):
        state = torch.get_rng_state()
        try:
            return build(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    build_without_consuming_rng.__wrapped__ = build
    return build_without_consuming_rng


def _torch_adam_states_complete(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of a torch Adam/AdamW the state its first step would create.

    Without Apex/TE, megatron's DistributedOptimizer reads the per-parameter 'step' of torch
    Adam when it builds the state dict to load a checkpoint into; a fresh optimizer has none.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _patch_distributed_optimizer_for_torch_adam(distrib_optimizer_cls) -> None:
    """Resume of megatron's DistributedOptimizer around torch's Adam (no Apex/TE)."""
    original_sharded_state_dict = distrib_optimizer_cls.sharded_state_dict
    original_load_state_dict = distrib_optimizer_cls.load_state_dict

    def sharded_state_dict(self, *args, **kwargs):
        is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
        if is_loading and isinstance(self.optimizer, torch.optim.Adam | torch.optim.AdamW):
            _torch_adam_states_complete(self.optimizer)
        return original_sharded_state_dict(self, *args, **kwargs)

    def load_state_dict(self, state_dict):
        # In fp32 the main params are views of the model's leaf params (requires_grad):
        # copying checkpoint values into them must not be recorded by autograd.
        with torch.no_grad():
            original_load_state_dict(self, state_dict)
        # The checkpoint keeps torch Adam's step in the param groups; megatron's parameter-state
        # load then overwrites each param's step with the placeholder of the load template, and
        # where it does set it, hands one shared tensor to all params (torch Adam increments each
        # param's step in place). Give every param its own step, from its group.
        for group in self.optimizer.param_groups:
            if group.get("step") is None:
                continue
            for param in group["params"]:
                state = self.optimizer.state.get(param)
                if state and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]))

    _patch(distrib_optimizer_cls, "sharded_state_dict", sharded_state_dict,
           "loading builds a state dict from torch Adam's per-param 'step', absent in a fresh optimizer")
    _patch(distrib_optimizer_cls, "load_state_dict", load_state_dict,
           "torch Adam's per-param step is lost/shared on load, and fp32 main params are views "
           "of leaf params")


def _get_cpu_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _dataset_helpers_importable() -> bool:
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def skip_dataset_helper_build() -> bool:
    """Skip megatron's ``make`` of the dataset helpers when the wheel already ships them.

    The megatron-core wheel ships the compiled ``helpers_cpp`` extension but no Makefile, so
    ``compile_helpers()`` (run by ``initialize_megatron`` on rank 0) fails on any machine,
    GPU or not. Unlike the rest of this module this applies with CUDA present too.

    Returns:
        True when the build step was replaced by a no-op.
    """
    from megatron.core.datasets import utils as dataset_utils

    if getattr(dataset_utils.compile_helpers, "_ultraep_skip", False):
        return True
    if not _dataset_helpers_importable():
        return False

    def compile_helpers():
        """No-op: the wheel's prebuilt helpers_cpp is importable."""

    compile_helpers._ultraep_skip = True
    dataset_utils.compile_helpers = compile_helpers
    return True


# ---------------------------------------------------------------------------------------------
# Activation.
# ---------------------------------------------------------------------------------------------


def _patch(owner: Any, attribute: str, replacement: Any, reason: str) -> None:
    if not hasattr(owner, attribute):
        raise AttributeError(
            f"{getattr(owner, '__name__', owner)}.{attribute} is missing: the CPU backend targets "
            "megatron-core 0.19.2"
        )
    setattr(owner, attribute, replacement)
    PATCHES.append((f"{getattr(owner, '__name__', type(owner).__name__)}.{attribute}", reason))


def is_log_rank() -> bool:
    """Global rank 0 (from the launcher's environment: usable before the process group exists)."""
    return os.environ.get("RANK", "0") == "0"


def activate() -> bool:
    """Make megatron-core's MoE layer and training loop run on the CPU over gloo.

    Idempotent. With a CUDA device present it changes nothing and logs that.

    Returns:
        True when the backend is active in this process, False when CUDA is present.
    """
    global _ACTIVE, _FUNCTION_MODE
    if _ACTIVE:
        return True
    if cuda_present():
        logger.info("ultraep CPU backend: CUDA device present, backend not applied")
        return False

    # Before torch.cuda is patched: dynamo indexes torch's functions (torch.cuda's included)
    # once, lazily; indexing the stand-ins instead would break it.
    from torch._dynamo import trace_rules

    trace_rules.get_torch_obj_rule_map()

    # Torch level: the CUDA device is an alias of the CPU.
    for name, (replacement, reason) in _TORCH_CUDA_PATCHES.items():
        _patch(torch.cuda, name, replacement, reason)
    _patch(torch.cuda.random, "get_rng_state", _cpu_get_rng_state,
           "megatron reads torch.cuda.random.get_rng_state directly; the CPU generator")
    _FUNCTION_MODE = _CudaAsCpuMode()
    # Pushed for good (never popped): the whole process runs with CUDA arguments mapped.
    torch._C._push_on_torch_function_stack(_FUNCTION_MODE)
    PATCHES.append(("TorchFunctionMode _CudaAsCpuMode",
                    "device='cuda'/N, .cuda(), .to('cuda'), pin_memory and tensor.type() mean the CPU"))

    # megatron's jit_fuser is torch.compile, applied at import time.
    torch.compiler.set_stance("force_eager")
    PATCHES.append(("torch.compiler.set_stance('force_eager')",
                    "compiled fusions probe CUDA and compile for minutes on small CPUs; eager is exact"))

    # Megatron level.
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.training import initialize as mtraining_initialize
    from megatron.training import training as mtraining

    _patch(mtraining_initialize, "torch", _TorchViewForInitialize(),
           "initialize_megatron asserts CUDA and skips model-parallel/RNG set-up at 0 devices")
    _patch(mtraining_initialize, "_warmup_jit_function", _noop,
           "the warm-up only pre-compiles GPU fusions (and would draw from the RNG)")
    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", _maybe_move_tensor_to_cpu,
           "gloo all_to_all_single needs list split sizes; megatron converts only CUDA tensors")
    _patch(mcore_random, "CudaRNGStatesTracker", _make_cpu_rng_tracker_class(),
           "tracker states must live in the CPU generator that CPU dropout draws from")
    _patch(mcore_random, "_get_cuda_rng_state", _get_cpu_rng_state,
           "recompute/rerun RNG snapshots read the CUDA generator, here the CPU one")
    _patch(mcore_random, "_set_cuda_rng_state", _set_cpu_rng_state,
           "recompute/rerun RNG snapshots write the CUDA generator, here the CPU one")
    _patch(mtraining, "build_train_valid_test_data_iterators",
           _rng_neutral(mtraining.build_train_valid_test_data_iterators),
           "DataLoader iterators draw a seed from the generator CPU dropout uses (breaks resume)")
    from megatron.core.optimizer import distrib_optimizer

    if not distrib_optimizer.HAVE_APEX_OR_TE:
        _patch_distributed_optimizer_for_torch_adam(distrib_optimizer.DistributedOptimizer)
    if skip_dataset_helper_build():
        PATCHES.append(("megatron.core.datasets.utils.compile_helpers",
                        "the wheel ships helpers_cpp prebuilt but no Makefile"))

    _ACTIVE = True
    if is_log_rank():
        lines = "\n".join(f"  - {target}: {reason}" for target, reason in PATCHES)
        logger.warning("ultraep CPU backend active (no CUDA device): %d patches\n%s",
                       len(PATCHES), lines)
    return True
