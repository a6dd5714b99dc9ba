"""Replacements for Megatron's CUDA-only code, applied by :func:`~.backend.activate`: the device
check and set-up of ``megatron.training.initialize``, the alltoall dispatcher's split sizes, the
RNG tracker (its named states in the CPU generator CPU dropout draws from), the data iterators'
seed draw, resuming the DistributedOptimizer around torch's Adam, and the gradient buffers'
coalesced collectives over gloo (one dtype per call).

:func:`skip_dataset_helper_build` is the one patch that applies with CUDA present too.
"""

from __future__ import annotations

import contextlib
import types
from typing import Callable

import torch


class OneDeviceCudaView(types.ModuleType):
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


class TorchViewForInitialize(types.ModuleType):
    """``torch`` as seen by megatron.training.initialize; everything but ``cuda`` is torch."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = OneDeviceCudaView()

    def __getattr__(self, name):
        return getattr(torch, name)


def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Megatron's DtoH helper, also converting CPU tensors when numpy is asked for.

    The alltoall dispatcher asks for numpy split sizes; megatron converts only CUDA tensors,
    and gloo's ``all_to_all_single`` rejects tensor split sizes.
    """
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().cpu().numpy()
    return tensor


def make_cpu_rng_tracker_class():
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
            super().__init__(
                use_cudagraphable_rng=False, is_inference_rng_tracker=is_inference_rng_tracker
            )

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


def rng_neutral(build: Callable) -> Callable:
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


def torch_adam_resume_patches(distrib_optimizer_cls) -> list[tuple[str, Callable, str]]:
    """Resume of megatron's DistributedOptimizer around torch's Adam (no Apex/TE): (attribute of
    ``distrib_optimizer_cls``, replacement, reason) for each method to replace."""
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

    return [
        (
            "sharded_state_dict",
            sharded_state_dict,
            "loading builds a state dict from torch Adam's per-param 'step', absent in a fresh optimizer",
        ),
        (
            "load_state_dict",
            load_state_dict,
            "torch Adam's per-param step is lost/shared on load, and fp32 main params are views of leaf "
            "params",
        ),
    ]


class PerDtypeCoalescedWork:
    """The handle of :func:`coalescing_per_dtype`: waits for every dtype's coalesced call."""

    def __init__(self):
        self.works: list = []

    def wait(self, timeout=None) -> None:
        for work in self.works:
            work.wait()


@contextlib.contextmanager
def coalescing_per_dtype(group=None, device=None, async_ops: bool = False):
    """torch's ``_coalescing_manager`` with one coalesced call per dtype, for megatron's
    gradient and parameter buffers over gloo.

    gloo's coalesced all-gather and reduce-scatter run every tensor of the call as one dtype's
    (two ranks gathering a uint8 and a bf16 tensor in one call get garbage in both), and megatron
    coalesces a uint8 bucket of fp8 parameters with the bf16 buckets of its other parameters
    (``partition_buckets``); NCCL runs each tensor as its own. The ops are recorded as torch
    records them, then replayed into torch's manager one dtype at a time (its fast path), in the
    order of their first op."""
    from torch.distributed import distributed_c10d as c10d

    group = group or c10d._get_default_group()
    if c10d._world.pg_coalesce_state.get(group):
        raise ValueError("ProcessGroup has non-empty op list at the start of coalescing")
    c10d._world.pg_coalesce_state[group] = []
    handle = PerDtypeCoalescedWork()
    try:
        yield handle
    finally:
        ops = c10d._world.pg_coalesce_state.pop(group, [])
    dtypes = list(dict.fromkeys(op.tensor.dtype for op in ops))
    for dtype in dtypes:
        with c10d._coalescing_manager(group, device, async_ops) as coalesced:
            c10d._world.pg_coalesce_state[group] = [op for op in ops if op.tensor.dtype == dtype]
        handle.works.append(coalesced)


def forked_write_results_queue(original: Callable) -> Callable:
    """megatron's dist-checkpoint write-results queue from a forked ``multiprocessing`` manager, not
    a spawned one. A spawned manager is a fresh interpreter that re-imports the training script's
    module, torch and megatron (about 5 s of CPU per saving rank here); CUDA's reason for spawning,
    no fork after CUDA is initialized, does not hold on the CPU."""

    def get_write_results_queue(mp_mode: str = "spawn"):
        return original(mp_mode="fork")

    return get_write_results_queue


def backward_under_device_mapping(default_backward_func: Callable, mode) -> Callable:
    """``ScheduleNode.default_backward_func`` (megatron's overlapped 1F1B schedule,
    ``--overlap-moe-expert-parallel-comm``) with the device mapping ``mode`` active inside the
    backward pass it runs. The node starts autograd's engine itself
    (``Variable._execution_engine.run_backward``), not through ``torch.autograd.backward``, whose
    entry the mode wraps (``CudaAsCpuMode._backward``); autograd captures the torch-function modes
    when a backward pass starts, and the mode is off inside its own handler."""

    def backward_func(self, outputs, output_grad):
        torch._C._push_on_torch_function_stack(mode)
        try:
            return default_backward_func(self, outputs, output_grad)
        finally:
            torch._C._pop_torch_function_stack()

    backward_func.__wrapped__ = default_backward_func
    return backward_func


def get_cpu_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def set_cpu_rng_state(new_state, device=-1, graph_safe: bool = False):
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
    GPU or not. Unlike the other patches this applies with CUDA present too.

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
