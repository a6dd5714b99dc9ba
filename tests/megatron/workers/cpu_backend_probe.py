"""Worker: activate the CPU backend in a fresh process and record what it does.

Writes ``<out>`` (JSON) with observations the test checks against independent expectations:
where CUDA-addressed allocations land, whether backward passes see the device mapping, how the
RNG tracker's named states relate to plain CPU generators, and which patches were applied.

Run:  torchrun --standalone --nproc-per-node 1 cpu_backend_probe.py --out FILE
"""

import argparse
import json
import logging

import torch
from torch.overrides import TorchFunctionMode

from ultraep_megatron.megatron.cpu import backend as cpu_backend
from ultraep_megatron.megatron.cpu.native_torch import native_torch

SEED = 4321
DRAW = 8


class AllocatesOnCudaInBackward(torch.autograd.Function):
    """Identity whose backward allocates with device='cuda', as megatron's collectives do."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + torch.zeros(grad.shape, device="cuda")


def reference_draws(seed: int, count: int) -> list[float]:
    """``count`` successive draws of DRAW normals from a CPU generator seeded with ``seed``
    (drawn in the same chunks as the probe: torch draws long and short tensors differently)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        value for _ in range(count) for value in torch.randn(DRAW, generator=generator).tolist()
    ]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out_path = parser.parse_args().out

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger().addHandler(handler)

    result = {"first_activate": cpu_backend.activate()}
    patch_count = len(cpu_backend.PATCHES)
    result["second_activate"] = cpu_backend.activate()
    result["patches_after_second"] = len(cpu_backend.PATCHES) - patch_count
    result["patches"] = cpu_backend.PATCHES
    result["activation_log_lines"] = sum("CPU backend active" in r.getMessage() for r in records)

    # Devices.
    result["devices"] = {
        "zeros_cuda": str(torch.zeros(2, device="cuda").device),
        "empty_current_device": str(torch.empty(2, device=torch.cuda.current_device()).device),
        "tensor_cuda_0": str(torch.tensor([1.0], device=torch.device("cuda", 0)).device),
        "dot_cuda": str(torch.ones(2).cuda().device),
        "to_cuda": str(torch.ones(2).to("cuda:0").device),
        "to_cuda_kw": str(torch.ones(2).to(device="cuda", non_blocking=True).device),
        "new_empty": str(torch.ones(2).new_empty(3, device="cuda").device),
        "pinned": str(torch.empty(2, pin_memory=True).device),
    }
    result["type_string"] = torch.ones(1).type()
    result["torch_cuda_is_available"] = torch.cuda.is_available()
    from megatron.training import initialize as mtraining_initialize

    result["initialize_sees_cuda"] = [
        mtraining_initialize.torch.cuda.is_available(),
        mtraining_initialize.torch.cuda.device_count(),
    ]

    # A backward pass started both ways runs Python backward functions under the mapping.
    x = torch.ones(3, requires_grad=True)
    AllocatesOnCudaInBackward.apply(x).sum().backward()
    y = torch.ones(3, requires_grad=True)
    torch.autograd.backward(AllocatesOnCudaInBackward.apply(y).sum())
    result["backward_grads"] = [x.grad.tolist(), y.grad.tolist()]

    # native_torch lifts the mapping when it is the innermost mode, and only then.
    @native_torch
    def modes_inside():
        return [type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()]

    class Outer(TorchFunctionMode):  # stands for a mode pushed after the mapping (a test's counter)
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    result["native_torch"] = {"alone": modes_inside()}
    with Outer():
        result["native_torch"]["under_another_mode"] = modes_inside()
    result["native_torch"]["after"] = [
        type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()
    ]

    @native_torch
    def raises():
        raise KeyError("inside")

    try:
        raises()
    except KeyError:
        pass
    result["native_torch"]["after_an_error"] = [
        type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()
    ]

    # gloo needs list-like split sizes from the alltoall dispatcher.
    from megatron.core.transformer.moe import token_dispatcher

    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    result["splits"] = [type(splits).__module__, list(map(int, splits))]

    # RNG tracker: named states are CPU generator states seeded like megatron seeds them.
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random

    parallel_state.initialize_model_parallel()
    mcore_random.model_parallel_cuda_manual_seed(SEED)
    tracker = mcore_random.get_cuda_rng_tracker()
    default_first = torch.randn(DRAW).tolist()
    with tracker.fork(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        model_parallel = torch.randn(DRAW).tolist()
    with tracker.fork(mcore_random.get_expert_parallel_rng_tracker_name()):
        expert_parallel = torch.randn(DRAW).tolist()
    default_second = torch.randn(DRAW).tolist()
    with tracker.fork(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        model_parallel_continued = torch.randn(DRAW).tolist()
    result["rng"] = {
        "default_first": default_first,
        "default_second": default_second,
        "model_parallel": model_parallel,
        "expert_parallel": expert_parallel,
        "model_parallel_continued": model_parallel_continued,
    }
    # Reference: one plain generator per named state, seeded as megatron's docs define them.
    result["rng_reference"] = {
        "default": reference_draws(SEED, 2),
        "model_parallel": reference_draws(SEED + 2718, 2),
        "expert_parallel": reference_draws(SEED + 1024, 1),
    }
    # Snapshot and restore of all states (activation recompute, checkpoint) replays the draws.
    states = mcore_random._get_all_rng_states()
    before = [torch.randn(DRAW).tolist()]
    with tracker.fork(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        before.append(torch.randn(DRAW).tolist())
    mcore_random._set_all_rng_states(*states)
    after = [torch.randn(DRAW).tolist()]
    with tracker.fork(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        after.append(torch.randn(DRAW).tolist())
    result["rng_replay"] = [before, after]
    result["rng_warnings"] = sum("RNG state changed" in r.getMessage() for r in records)

    # Megatron's buffers coalesce a uint8 bucket's gather with bf16 ones: through the manager its
    # module uses here, and through torch's (what gloo does with mixed dtypes in one call).
    from torch.distributed.distributed_c10d import _coalescing_manager as torch_coalescing
    from megatron.core.distributed import param_and_grad_buffer

    def coalesced_gathers(manager):
        outputs = [torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.bfloat16)]
        with manager(None, async_ops=True) as handle:
            torch.distributed.all_gather_into_tensor(
                outputs[0], torch.full((4,), 10, dtype=torch.uint8)
            )
            torch.distributed.all_gather_into_tensor(
                outputs[1], torch.full((4,), 1.5, dtype=torch.bfloat16)
            )
        handle.wait()
        return [t.tolist() for t in outputs]

    result["coalesced_mixed_dtypes"] = {
        "megatron": coalesced_gathers(param_and_grad_buffer._coalescing_manager),
        "torch": coalesced_gathers(torch_coalescing),
    }

    from megatron.core.datasets import utils as dataset_utils

    dataset_utils.compile_helpers()  # must not run make
    from megatron.core.datasets import helpers  # noqa: F401  the prebuilt extension

    result["compile_helpers_skipped"] = True
    with open(out_path, "w") as handle:
        json.dump(result, handle)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
