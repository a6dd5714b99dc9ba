"""A CPU stand-in for Apex's ``fused_weight_gradient_mlp_cuda``, the kernel megatron-core's linear
layers call under ``--gradient-accumulation-fusion`` (megatron's GPU default) to add a weight
gradient into ``weight.main_grad`` instead of returning it.

Follows Apex's ``csrc/megatron/fused_weight_gradient_dense.cpp`` (and its ``*_cuda.cu``) as
megatron-core 0.19.2's ``tensor_parallel/layers.py`` calls it with an fp32 ``main_grad``:
``wgrad_gemm_accum_fp32(input [N, in], d_output [N, out], d_weight [out, in])`` does ``d_weight +=
d_output^T @ input``. :func:`install` (the worker's ``ULTRAEP_WGRAD_FUSION_STANDIN=1``) also redoes
megatron's import-time lookup of the module.

Fails (``TypeError``) on a ``d_weight`` that is not fp32. Leaves out: ``wgrad_gemm_accum_fp16`` (a
16-bit ``main_grad``: megatron then finds no such attribute), the kernel's cuBLAS GEMM (here the
unfused backward's matmul, so fp32 gradients are the unfused ones).
"""

from __future__ import annotations

import sys
import types

import torch

MODULE = "fused_weight_gradient_mlp_cuda"


def wgrad_gemm_accum_fp32(
    input: torch.Tensor, d_output: torch.Tensor, d_weight: torch.Tensor
) -> None:
    if d_weight.dtype != torch.float32:
        raise TypeError(f"wgrad_gemm_accum_fp32 needs an fp32 d_weight, got {d_weight.dtype}")
    d_weight.add_(d_output.t().matmul(input).to(torch.float32))


def install() -> None:
    """Make ``import fused_weight_gradient_mlp_cuda`` find this stand-in. Where megatron's linear
    layers are imported already (the tests' warm launcher preloads megatron), redo their one
    import-time lookup of the kernel, as a fresh import would have found it."""
    module = types.ModuleType(MODULE, __doc__)
    module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
    sys.modules[MODULE] = module
    layers = sys.modules.get("megatron.core.tensor_parallel.layers")
    if layers is not None:
        layers.fused_weight_gradient_mlp_cuda = module
        layers._grad_accum_fusion_available = True
