"""Activating the CPU backend (the package docstring says what it does): :func:`activate` applies
every patch, each with its reason, into :data:`PATCHES`.

Usage::

    from ultraep_megatron.megatron.cpu import backend
    backend.activate()          # before building Megatron models; idempotent
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from typing import Any

import torch

from ultraep_megatron.megatron.cpu import megatron_patches, native_torch
from ultraep_megatron.megatron.cpu.device_mapping import CudaAsCpuMode
from ultraep_megatron.megatron.cpu.torch_cuda import (
    TORCH_CUDA_PATCHES,
    cpu_get_rng_state,
    noop,
    record_stream_patch,
)

logger = logging.getLogger(__name__)

#: (target, reason) for every patch applied by :func:`activate`; empty until then.
PATCHES: list[tuple[str, str]] = []

_ACTIVE = False


def cuda_present() -> bool:
    """True when a CUDA device can be used; the backend then does nothing."""
    return torch.cuda.is_available()


def is_active() -> bool:
    """True once :func:`activate` has patched this process."""
    return _ACTIVE


def is_log_rank() -> bool:
    """Global rank 0 (from the launcher's environment: usable before the process group exists)."""
    return os.environ.get("RANK", "0") == "0"


def _patch(owner: Any, attribute: str, replacement: Any, reason: str) -> None:
    if not hasattr(owner, attribute):
        raise AttributeError(
            f"{getattr(owner, '__name__', owner)}.{attribute} is missing: the CPU backend targets "
            "megatron-core 0.19.2 and 0.18.2"
        )
    setattr(owner, attribute, replacement)
    PATCHES.append((f"{getattr(owner, '__name__', type(owner).__name__)}.{attribute}", reason))


#: Warnings megatron-core and torch print on a CPU machine only because it lacks the GPU stack the
#: CPU backend stands in for; filtered while the backend is active (never with a CUDA device, where
#: each would mean a slower or different path than intended). Message prefixes (regexes).
CPU_ONLY_WARNINGS = (
    # No Transformer Engine / Apex on CPU: megatron's local kernels and torch's norm and optimizers
    # are the CPU path (TE's fused kernels are CUDA only). On GPU this says a run lost its fusions.
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed\. Falling back to Torch Norm",
    r"Only transformer-engine>=1\.7\.0 supports MoE experts",
    # The data loader's pin_memory without an accelerator: nothing to pin to on CPU.
    r"'pin_memory' argument is set as true but no accelerator is found",
)


def _filter_cpu_only_warnings() -> None:
    for message in CPU_ONLY_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def activate() -> bool:
    """Make megatron-core's MoE layer and training loop run on the CPU over gloo.

    Idempotent. With a CUDA device present it changes nothing and logs that.

    Returns:
        True when the backend is active in this process, False when CUDA is present.
    """
    global _ACTIVE
    if _ACTIVE:
        return True
    if cuda_present():
        logger.info("ultraep CPU backend: CUDA device present, backend not applied")
        return False
    _filter_cpu_only_warnings()  # before megatron's modules are imported (they warn at import)

    # Before torch.cuda is patched: dynamo indexes torch's functions (torch.cuda's included)
    # once, lazily; indexing the stand-ins instead would break it.
    from torch._dynamo import trace_rules

    trace_rules.get_torch_obj_rule_map()

    # Torch level: the CUDA device is an alias of the CPU.
    for name, (replacement, reason) in TORCH_CUDA_PATCHES.items():
        _patch(torch.cuda, name, replacement, reason)
    _patch(
        torch.cuda.random,
        "get_rng_state",
        cpu_get_rng_state,
        "megatron reads torch.cuda.random.get_rng_state directly; the CPU generator",
    )
    _patch(
        torch.Tensor,
        "record_stream",
        record_stream_patch(torch.Tensor.record_stream),
        "an allocator hint for tensors used on another stream; CPU work is complete when issued",
    )
    mode = CudaAsCpuMode()
    # Pushed for good (never popped): the whole process runs with CUDA arguments mapped.
    torch._C._push_on_torch_function_stack(mode)
    native_torch.register_device_mapping(mode)
    PATCHES.append(
        (
            "TorchFunctionMode CudaAsCpuMode",
            "device='cuda'/N, .cuda(), .to('cuda'), pin_memory and tensor.type() mean the CPU",
        )
    )

    # megatron's jit_fuser is torch.compile, applied at import time.
    torch.compiler.set_stance("force_eager")
    PATCHES.append(
        (
            "torch.compiler.set_stance('force_eager')",
            "compiled fusions probe CUDA and compile for minutes on small CPUs; eager is exact",
        )
    )

    # Megatron level.
    from megatron.core.pipeline_parallel.utils import ScheduleNode
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.training import initialize as mtraining_initialize
    from megatron.training import training as mtraining

    _patch(
        mtraining_initialize,
        "torch",
        megatron_patches.TorchViewForInitialize(),
        "initialize_megatron asserts CUDA and skips model-parallel/RNG set-up at 0 devices",
    )
    _patch(
        mtraining_initialize,
        "_warmup_jit_function",
        noop,
        "the warm-up only pre-compiles GPU fusions (and would draw from the RNG)",
    )
    _patch(
        token_dispatcher,
        "maybe_move_tensor_to_cpu",
        megatron_patches.maybe_move_tensor_to_cpu,
        "gloo all_to_all_single needs list split sizes; megatron converts only CUDA tensors",
    )
    _patch(
        mcore_random,
        "CudaRNGStatesTracker",
        megatron_patches.make_cpu_rng_tracker_class(),
        "tracker states must live in the CPU generator that CPU dropout draws from",
    )
    _patch(
        mcore_random,
        "_get_cuda_rng_state",
        megatron_patches.get_cpu_rng_state,
        "recompute/rerun RNG snapshots read the CUDA generator, here the CPU one",
    )
    _patch(
        mcore_random,
        "_set_cuda_rng_state",
        megatron_patches.set_cpu_rng_state,
        "recompute/rerun RNG snapshots write the CUDA generator, here the CPU one",
    )
    _patch(
        ScheduleNode,
        "default_backward_func",
        megatron_patches.backward_under_device_mapping(ScheduleNode.default_backward_func, mode),
        "the overlapped schedule's nodes start autograd's engine directly, where the device mapping "
        "would be off for megatron's Python backward functions (they allocate on 'cuda')",
    )
    _patch(
        mtraining,
        "build_train_valid_test_data_iterators",
        megatron_patches.rng_neutral(mtraining.build_train_valid_test_data_iterators),
        "DataLoader iterators draw a seed from the generator CPU dropout uses (breaks resume)",
    )
    from megatron.core.distributed import param_and_grad_buffer

    _patch(
        param_and_grad_buffer,
        "_coalescing_manager",
        megatron_patches.coalescing_per_dtype,
        "gloo's coalesced all-gather/reduce-scatter run all tensors as one dtype; fp8 parameters "
        "put a uint8 bucket beside bf16 ones: one coalesced call per dtype",
    )
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _patch(
        filesystem_async,
        "get_write_results_queue",
        megatron_patches.forked_write_results_queue(filesystem_async.get_write_results_queue),
        "torch_dist saves start a spawned multiprocessing manager (a fresh interpreter re-importing "
        "the script, ~5 s per saving rank); forked on the CPU",
    )
    from megatron.core.optimizer import distrib_optimizer

    if not distrib_optimizer.HAVE_APEX_OR_TE:
        optimizer_cls = distrib_optimizer.DistributedOptimizer
        for attribute, replacement, reason in megatron_patches.torch_adam_resume_patches(
            optimizer_cls
        ):
            _patch(optimizer_cls, attribute, replacement, reason)
    if megatron_patches.skip_dataset_helper_build():
        PATCHES.append(
            (
                "megatron.core.datasets.utils.compile_helpers",
                "the wheel ships helpers_cpp prebuilt but no Makefile",
            )
        )
    lifted = native_torch.lift_hot_path()
    PATCHES.append(
        (
            f"the balanced layer's host code ({len(lifted)} functions)",
            "runs without the device mapping: it names no device, and the mapping's per-call "
            "dispatch would be most of its cost (native_torch.hot_path)",
        )
    )

    _ACTIVE = True
    if importlib.util.find_spec("megatron.bridge") is not None:
        cover_bridge()
    if is_log_rank():  # one line; the list of patches when asked for (ULTRAEP_CPU_PATCHES=1)
        listed = os.environ.get("ULTRAEP_CPU_PATCHES", "0") not in ("", "0")
        lines = "".join(f"\n  - {target}: {reason}" for target, reason in PATCHES) if listed else ""
        logger.warning(
            "ultraep CPU backend active (no CUDA device): %d patches%s",
            len(PATCHES),
            lines or " (ULTRAEP_CPU_PATCHES=1 lists them)",
        )
    return True


_BRIDGE_COVERED = False


def cover_bridge() -> None:
    """Megatron-Bridge's own copy of megatron's initialize (``megatron.bridge.training.initialize``)
    on the CPU: it asserts CUDA (unless ``allow_no_cuda``), sets the device and seeds the model
    parallel RNG only at a nonzero device count, and warms up GPU fusions. Applied by
    :func:`activate` when megatron-bridge is installed; idempotent; nothing with CUDA present."""
    global _BRIDGE_COVERED
    if _BRIDGE_COVERED or not _ACTIVE:
        return
    from megatron.bridge.training import initialize as bridge_initialize

    _patch(
        bridge_initialize,
        "torch",
        megatron_patches.TorchViewForInitialize(),
        "Bridge's initialize_megatron asserts CUDA and skips device/RNG set-up at 0 devices",
    )
    _patch(
        bridge_initialize,
        "_warmup_jit_function",
        noop,
        "Bridge's warm-up only pre-compiles GPU fusions (and would draw from the RNG)",
    )
    _BRIDGE_COVERED = True
