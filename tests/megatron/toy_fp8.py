"""A toy fp8 current-scaling quantizer, and what megatron's grouped experts need of Transformer
Engine under fp8, for CPU tests without TE.

The quantizers round to the real e4m3 grid (``torch.float8_e4m3fn``, which exists on the CPU), so
a weight computed with a stale cast gives a visibly different result. Current scaling: each scale
is computed from the tensor being quantized, at the moment it is quantized (no amax history), as
Transformer Engine's ``tensorwise`` (``Float8CurrentScaling``), ``blockwise``
(``Float8BlockScaling``) and ``mxfp8`` (``MXFP8BlockScaling``) recipes do for a weight:

* ``tensorwise``: one fp32 scale per tensor, ``amax / 448``;
* ``blockwise``: one fp32 scale per ``BLOCK x BLOCK`` block of a weight (TE: 128 x 128; the test
  shapes are smaller, so ``BLOCK`` is 16);
* ``mxfp8``: one power-of-two scale per 1 x 32 block along the input dimension (the smallest power
  of two that brings the block's amax within e4m3's range).

Only the forward's weights are quantized (``quantize_weight``); activations and gradients stay in
high precision. Their quantization is row-local or per expert chunk in TE and would apply alike to
a replica's rows; here it is left out on purpose: an fp8 rounding turns a last-bit difference of
two summation orders (the noise floor of the equivalence tests) into a whole fp8 step with some
probability, which no floor measured from a few samples bounds.

:func:`install_fp8_standins` gives megatron's ``TEGroupedMLP`` the two TE pieces it asserts under
fp8 (``HAVE_TE`` and ``Fp8Padding`` / ``Fp8Unpadding``, which pad each expert's rows to the GEMM
alignment with zero rows); :func:`enable_fp8` turns fp8 on in a built ``TransformerConfig`` (its
constructor checks the TE version, which is absent here).
"""

from __future__ import annotations

from typing import Sequence

import torch

#: e4m3's largest finite value.
E4M3_MAX = 448.0
#: Recipes with current scaling: a weight's quantization is a function of that weight alone.
CURRENT_SCALING_RECIPES = ("tensorwise", "blockwise", "mxfp8")
#: Block edge of the ``blockwise`` recipe here (TE's weights: 128).
BLOCK = 16
#: Block length of ``mxfp8`` (along the input dimension, as TE's rowwise MXFP8 weight).
MX_BLOCK = 32


def _round_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.to(torch.float8_e4m3fn).to(scaled.dtype)


def quantize_weight(weight: torch.Tensor, recipe: str) -> torch.Tensor:
    """The dequantized fp8 value of ``weight`` [out, in] under ``recipe`` (same shape and dtype):
    what a GEMM on the quantized weight computes with."""
    w = weight.detach().float()
    if recipe == "tensorwise":
        scale = (w.abs().amax() / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        return (_round_e4m3(w / scale) * scale).to(weight.dtype)
    if recipe == "blockwise":
        out_dim, in_dim = w.shape
        if out_dim % BLOCK or in_dim % BLOCK:
            raise ValueError(f"blockwise: weight {tuple(w.shape)} is not a multiple of {BLOCK}")
        blocks = w.view(out_dim // BLOCK, BLOCK, in_dim // BLOCK, BLOCK)
        scale = (blocks.abs().amax(dim=(1, 3), keepdim=True) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        return (_round_e4m3(blocks / scale) * scale).view_as(w).to(weight.dtype)
    if recipe == "mxfp8":
        out_dim, in_dim = w.shape
        if in_dim % MX_BLOCK:
            raise ValueError(f"mxfp8: input dimension {in_dim} is not a multiple of {MX_BLOCK}")
        blocks = w.view(out_dim, in_dim // MX_BLOCK, MX_BLOCK)
        amax = blocks.abs().amax(dim=2, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))  # power of two, E8M0
        return (_round_e4m3(blocks / scale) * scale).view_as(w).to(weight.dtype)
    raise ValueError(f"toy fp8 quantizer: recipe {recipe!r} is not a current-scaling recipe "
                     f"({', '.join(CURRENT_SCALING_RECIPES)})")


def align_size(recipe: str) -> int:
    """Rows per expert are padded to this multiple under fp8 (megatron's ``get_fp8_align_size``)."""
    return 32 if recipe == "mxfp8" else 16


class ToyFp8Padding(torch.nn.Module):
    """TE's ``Fp8Padding(num_gemms, align_size)``: ``forward(rows [T, H], splits)`` -> rows with
    each expert's chunk padded by zero rows to a multiple of the alignment, and the padded splits."""

    def __init__(self, num_gemms: int, align_size: int | None = None):
        super().__init__()
        self.num_gemms, self.align_size = num_gemms, align_size

    def _align(self) -> int:
        return self.align_size or _current_align

    def forward(self, rows: torch.Tensor, splits: Sequence[int]):
        align = self._align()
        padded = [(n + align - 1) // align * align for n in splits]
        chunks = []
        for chunk, n, p in zip(torch.split(rows, list(splits)), splits, padded):
            chunks += [chunk, chunk.new_zeros((p - n, *chunk.shape[1:]))]
        return torch.cat(chunks), padded


class ToyFp8Unpadding(ToyFp8Padding):
    """TE's ``Fp8Unpadding``: ``forward(padded rows, splits)`` -> the rows without the padding
    (``splits``: the unpadded counts)."""

    def forward(self, rows: torch.Tensor, splits: Sequence[int]):
        align = self._align()
        padded = [(n + align - 1) // align * align for n in splits]
        return torch.cat([chunk[:n] for chunk, n in zip(torch.split(rows, padded), splits)])


_current_align = 16


def install_fp8_standins(recipe: str) -> None:
    """Let megatron's ``TEGroupedMLP`` build and run under fp8 without TE: ``HAVE_TE`` and the
    padding modules in megatron's experts module (process-wide; tests run it in worker processes)."""
    global _current_align
    from megatron.core.transformer.moe import experts

    _current_align = align_size(recipe)
    experts.HAVE_TE = True
    experts.Fp8Padding, experts.Fp8Unpadding = ToyFp8Padding, ToyFp8Unpadding


def enable_fp8(config, recipe: str, fp8_format: str = "hybrid") -> None:
    """fp8 with ``recipe`` on a constructed megatron ``TransformerConfig`` (its ``__post_init__``
    asks TE's version under fp8, so it is set afterwards)."""
    if recipe not in CURRENT_SCALING_RECIPES:
        raise ValueError(f"recipe {recipe!r}: the toy quantizer has current scaling only")
    config.fp8, config.fp8_recipe = fp8_format, recipe
