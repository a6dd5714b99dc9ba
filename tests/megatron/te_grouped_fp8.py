"""Transformer Engine's fp8 grouped GEMM (``GroupedLinear`` under current scaling), stood in on the
CPU: every GEMM group's input, weight and output gradient quantized as TE quantizes them, with real
e4m3 / e5m2 rounding (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``), for equivalence tests that
must see what fp8 does to a replicated expert's rows.

What it follows (TransformerEngine 2.x, ``transformer_engine/``; megatron-core 0.19.2 builds the
recipes):

* ``pytorch/module/grouped_linear.py`` (``_GroupedLinear.forward`` / ``backward``, the split-quantize
  path): the input is split by ``m_splits`` and each group quantized with *that group's* input
  quantizer (``_split_quantization._split_quantize(inp, m_splits, input_quantizers)``), row-wise for
  the forward GEMM and column-wise for the weight gradient (both from the high-precision input);
  each group's weight with its weight quantizer, row-wise for the forward and column-wise for the
  input gradient; in the backward the output gradient split and quantized with each group's
  gradient quantizer, row-wise for the input gradient (``layout="NN"``) and column-wise for the
  weight gradient (``layout="NT"``). fprop: ``x_row @ w_row.T``; dgrad: ``dy_row @ w_col``; wgrad:
  ``dy_col.T @ x_col``. Weight gradients come out in high precision.
* delayed weight gradients (``delay_wgrad_compute``, the same ``_GroupedLinear.backward`` and
  ``GroupedLinear.backward_dw``): the backward quantizes each group's output gradient as above,
  computes the input gradient, and puts the weight-gradient grouped GEMM into the module's
  ``WeightGradStore`` with its operands (the column-wise quantized inputs saved in the forward,
  TE's ``inputmats``, and the quantized output gradients) and the tensors it will write, which the
  backward returns for the weights; ``backward_dw`` runs it later (``grouped_gemm.WeightGradStore``;
  the module's side is ``torch_grouped_linear``'s). The values are the undelayed path's, bit for
  bit. Bias gradients come in the backward under fp8, as TE's (its fused ``dbias`` with the
  gradient's quantization).
* ``common/recipe/__init__.py``: the data formats (``--fp8-format e4m3``: e4m3 everywhere;
  ``hybrid``: e4m3 forward, e5m2 for gradients) and the recipes' scale options as megatron builds
  them (``Float8CurrentScaling``: fp32 scales, powers of two with
  ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1``; ``Float8BlockScaling``: power-of-two scales, fp32
  with ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``, 1-D blocks for inputs and gradients, 2-D for
  weights; ``MXFP8BlockScaling``: E8M0 scales).
* ``tensorwise`` (``pytorch/tensor/float8_tensor.py`` ``Float8CurrentScalingQuantizer``,
  ``common/recipe/current_scaling.cu`` and ``recipe_common.cuh`` ``compute_scale_from_amax``): one
  amax per quantized tensor, i.e. per GEMM group; ``scale = fp8_max / amax`` (1 where the amax is 0,
  inf or nan; the input type's largest value where the quotient overflows); ``data = cast(x * scale)``
  saturating; ``scale_inv = 1 / scale``. The column-wise copy is the transpose of the same data.
* ``blockwise`` (``pytorch/tensor/float8_blockwise_tensor.py`` ``Float8BlockQuantizer``,
  ``common/transpose/quantize_transpose_vector_blockwise.cu`` and ``..._square_blockwise.cu``):
  inputs and gradients in 1 x 128 blocks row-wise and 128 x 1 blocks column-wise (the column-wise
  blocks run along the tokens, so which rows share a block depends on where a group starts);
  weights in 128 x 128 blocks whose column-wise copy is the transpose of the row-wise data; scales
  from ``compute_scale_from_amax`` per block, rounded down to a power of two (the exponent bits
  kept); partial blocks at the edges; scale storage shaped and padded as ``get_scale_shape``.
* ``mxfp8`` (``pytorch/tensor/mxfp8_tensor.py`` ``MXFP8Quantizer``, ``common/util/ptx.cuh``
  ``float_to_e8m0``): 1 x 32 blocks row-wise, 32 x 1 column-wise, for inputs, weights and
  gradients alike; the E8M0 scale is ``amax * (1 / fp8_max)`` with its exponent rounded up (the
  non-Blackwell branch of ``float_to_e8m0``, which the Blackwell ``cvt.rp.satfinite`` matches);
  ``data = cast(x * 2^(127 - e))``. A tensor whose rows or columns are not multiples of 32 is
  refused (``is_quantizable``; megatron pads each expert's rows to 32). Scale storage padded to
  [128, 4] row-wise and [4, 128] column-wise multiples (``get_scale_shape``); the padding holds
  zeros here (TE leaves it unset and the GEMM never reads it).
* ``is_first_microbatch`` and the weight cache: the caller's (``torch_grouped_linear``).

Fails (``ValueError``) where TE refuses an MXFP8 operand or group whose rows or columns are not
multiples of 32; refuses what it leaves out (recipes without current scaling, formats other than
``e4m3`` / ``hybrid``).

What it leaves out: TE's kernels and cuBLAS. The GEMMs run in fp32 on the dequantized operands, with
no model of cuBLAS's fp8 accumulation: Hopper accumulates fp8 products in reduced precision,
promoted to fp32 at intervals with split accumulation, less often with fast accumulation (TE's
tensorwise forward GEMM, ``use_split_accumulator=False``). Measured on an H200
(``torch._scaled_mm``, per-tensor scales, fp32 output): cuBLAS lies 4e-5 to 1.3e-4 (relative) from
the exact product of the dequantized operands with split accumulation and 1.1e-3 to 1.3e-3 with fast
accumulation at K = 4096, where fp8's own rounding errs by 3.7e-2 to 5.9e-2 and these fp32 GEMMs by
1e-7 to 4e-7. (torch's CPU and CUDA conversions to e4m3 / e5m2 gave the same code for 4.2 million
values and every midpoint of the grids.) No check of cuBLAS's own shape limits for block-scaled
GEMMs. Delayed scaling, NVFP4, custom recipes, amax reduction groups (TE refuses them for
``GroupedLinear``: TP > 1 with current scaling raises), ``amax_epsilon`` (0 in every recipe megatron
builds), ``backward_override`` and ``save_original_input`` (the latter re-quantizes the same input
in the backward: the same values under current scaling), bias epilogues (biases are added in high
precision) and the grouped-tensor path of recent TE on Blackwell / cuBLASLt 13.x
(``group_quantize``: per-group scales as here; on Blackwell TE runs ``blockwise`` as MXFP8 with its
power-of-two scales broadcast, the same values).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch

#: fp8 formats: torch dtype and largest finite value (TE's ``TypeInfo<OType>::max_finite_value``).
FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
#: Recipes with current scaling that this stand-in quantizes (megatron's ``--fp8-recipe``).
RECIPES = ("tensorwise", "blockwise", "mxfp8")
#: ``Float8BlockQuantizer.block_len`` as megatron's Float8BlockScaling builds it.
BLOCK_LEN = 128
#: ``MXFP8_BLOCK_SCALING_SIZE``.
MX_BLOCK = 32


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


#: TE's switches of the scales' form (read by its recipe classes): power-of-two scales for
#: ``Float8CurrentScaling`` (default: fp32 scales), fp32 scales for ``Float8BlockScaling`` (default:
#: powers of two).
POWER_2_SCALES_ENV = {
    "tensorwise": "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES",
    "blockwise": "NVTE_FP8_BLOCK_SCALING_FP32_SCALES",
}


def default_power_2_scales(name: str) -> bool:
    """Whether TE's recipe ``name`` scales by powers of two, given its environment switch."""
    if name == "tensorwise":
        return os.getenv(POWER_2_SCALES_ENV[name], "0") == "1"
    if name == "blockwise":
        return os.getenv(POWER_2_SCALES_ENV[name], "0") != "1"
    return True  # mxfp8: E8M0


@dataclass(frozen=True)
class Fp8Recipe:
    """An fp8 recipe as megatron sets it: ``name`` (``--fp8-recipe``) and ``fp8_format``
    (``--fp8-format``: ``e4m3`` or ``hybrid``); ``power_2_scales`` as TE's environment switches
    make it (``POWER_2_SCALES_ENV``) unless given."""

    name: str
    fp8_format: str = "hybrid"
    power_2_scales: Optional[bool] = None

    def __post_init__(self):
        if self.name not in RECIPES:
            raise ValueError(
                f"--fp8-recipe {self.name!r}: the TE stand-in has current scaling only ({RECIPES})"
            )
        if self.fp8_format not in ("e4m3", "hybrid"):
            raise ValueError(f"--fp8-format {self.fp8_format!r}: TE trains with e4m3 or hybrid")
        if self.power_2_scales is None:
            object.__setattr__(self, "power_2_scales", default_power_2_scales(self.name))
        if self.name == "mxfp8" and not self.power_2_scales:
            raise ValueError("mxfp8 scales are E8M0: powers of two")

    @property
    def forward_format(self) -> str:
        """Inputs and weights."""
        return "e4m3"

    @property
    def backward_format(self) -> str:
        """Output gradients (``hybrid``: e5m2)."""
        return "e5m2" if self.fp8_format == "hybrid" else "e4m3"

    @classmethod
    def of_config(cls, config) -> "Fp8Recipe":
        """The recipe of a megatron ``TransformerConfig`` with fp8 on."""
        recipe = getattr(config.fp8_recipe, "value", config.fp8_recipe)
        return cls(recipe, getattr(config.fp8, "value", config.fp8))


# -- scales ------------------------------------------------------------------------------------------


def compute_scale_from_amax(amax: torch.Tensor, fp8_max: float, pow_2: bool) -> torch.Tensor:
    """TE's ``compute_scale_from_amax`` (epsilon 0, fp32 input): per element of ``amax`` (fp32)."""
    amax = amax.float()
    scale = torch.full_like(amax, fp8_max) / amax  # IEEE fp32 division, as __fdiv_rn
    scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
    scale = torch.where((amax == 0) | torch.isinf(amax) | torch.isnan(amax), 1.0, scale)
    if pow_2:  # keep sign and exponent: the largest power of two not above the scale
        scale = (scale.view(torch.int32) & -0x800000).view(torch.float32)
    return scale


def float_to_e8m0(value: torch.Tensor) -> torch.Tensor:
    """TE's ``ptx::float_to_e8m0`` (non-Blackwell branch): the biased exponent of ``value`` (fp32,
    >= 0) rounded up, as uint8 (0xFE for inf, 0xFF for nan)."""
    bits = value.float().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent < 0xFE) & ((exponent > 0) | (mantissa > 0x400000))
    exponent = exponent + up.to(torch.int32)
    exponent = torch.where((exponent == 0xFF) & (mantissa == 0), 0xFE, exponent)  # inf
    return exponent.to(torch.uint8)


def e8m0_to_scale(e8m0: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) as fp32 (the dequantization factor), exact: ``e`` placed in the exponent bits
    (e = 0, a subnormal 2^-127, by exp2)."""
    e = e8m0.to(torch.int32)
    return torch.where(e > 0, (e << 23).view(torch.float32), torch.exp2(e.float() - 127.0))


def _cast(scaled: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round to ``fmt`` to nearest even, saturating (TE's ``satfinite`` conversion)."""
    dtype, fp8_max = FORMATS[fmt]
    return scaled.clamp(-fp8_max, fp8_max).to(dtype)


# -- quantized storages ------------------------------------------------------------------------------


class Quantized(NamedTuple):
    """One copy (row- or column-wise) of a quantized [rows, cols] tensor: ``data`` in fp8 with the
    logical shape (TE stores a column-wise copy transposed, except MXFP8's; the values are the
    same), ``scale_inv`` in TE's storage shape with its padding, ``values`` the dequantized fp32
    values [rows, cols] a GEMM computes with."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    values: torch.Tensor


def _blocks(x: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """``x`` [M, K] zero-padded to whole blocks, viewed [M / br, br, K / bc, bc]."""
    m, k = x.shape
    if m % block_rows or k % block_cols:
        padded = x.new_zeros(round_up(m, block_rows), round_up(k, block_cols))
        padded[:m, :k] = x
        x = padded
    return x.view(x.shape[0] // block_rows, block_rows, x.shape[1] // block_cols, block_cols)


def _unblock(blocks: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """[M / br, br, K / bc, bc] back to [M, K] (the padding dropped)."""
    return blocks.reshape(blocks.shape[0] * blocks.shape[1], blocks.shape[2] * blocks.shape[3])[
        :m, :k
    ]


def _quantize_blocks(x: torch.Tensor, fmt: str, block_rows: int, block_cols: int, scales):
    """Per ``block_rows x block_cols`` block of ``x`` [M, K] (partial blocks at the edges): its
    amax, ``scales(amax) -> (multiplier, scale_inv)``, the cast of ``x * multiplier``. Returns
    (data [M, K], values [M, K], scale_inv per block [M / br, K / bc])."""
    m, k = x.shape
    blocks = _blocks(x.detach().float(), block_rows, block_cols)
    multiplier, scale_inv = scales(blocks.abs().amax(dim=(1, 3)))
    data = _cast(blocks * multiplier[:, None, :, None], fmt)
    values = data.float() * scale_inv[:, None, :, None]
    return _unblock(data, m, k), _unblock(values, m, k), scale_inv


def quantize_tensorwise(x: torch.Tensor, fmt: str, pow_2: bool = False) -> Quantized:
    """``Float8CurrentScalingQuantizer``: one amax over all of ``x``."""
    x = x.detach().float()
    amax = x.abs().amax() if x.numel() else x.new_zeros(())
    scale = compute_scale_from_amax(amax, FORMATS[fmt][1], pow_2)
    data = _cast(x * scale, fmt)
    scale_inv = (1.0 / scale).reshape(1)
    return Quantized(data, scale_inv, data.float() * scale_inv)


def quantize_blockwise(
    x: torch.Tensor, fmt: str, *, columnwise: bool, two_d: bool = False, pow_2: bool = True
) -> Quantized:
    """``Float8BlockQuantizer`` (``block_scaling_dim`` 1 or 2 with ``two_d``) of ``x`` [M, K]:
    row-wise 1 x 128 blocks (along K), column-wise 128 x 1 (along M), 2-D 128 x 128 for weights;
    power-of-two scales unless ``pow_2`` is False. ``scale_inv`` shaped as TE's ``get_scale_shape``
    (padded to multiples of 4)."""

    def scales(amax):
        scale = compute_scale_from_amax(amax, FORMATS[fmt][1], pow_2)
        return scale, 1.0 / scale

    if two_d:
        data, values, block_inv = _quantize_blocks(x, fmt, BLOCK_LEN, BLOCK_LEN, scales)
        stored = block_inv.t() if columnwise else block_inv  # the transpose's blocks
    elif columnwise:
        data, values, stored = _quantize_blocks(x, fmt, BLOCK_LEN, 1, scales)  # [M/128, K]
    else:
        data, values, block_inv = _quantize_blocks(x, fmt, 1, BLOCK_LEN, scales)  # [M, K/128]
        stored = block_inv.t()  # TE keeps 1 x 128 scales K-block major: [K/128, M]
    scale_inv = stored.new_zeros(stored.shape[0], round_up(stored.shape[1], 4))
    scale_inv[:, : stored.shape[1]] = stored
    return Quantized(data, scale_inv, values)


def quantize_mxfp8(x: torch.Tensor, fmt: str, *, columnwise: bool) -> Quantized:
    """``MXFP8Quantizer`` of ``x`` [M, K]: row-wise 1 x 32 blocks, column-wise 32 x 1; E8M0 scales
    stored [roundup(M, 128), roundup(K / 32, 4)] row-wise, [roundup(M / 32, 4), roundup(K, 128)]
    column-wise."""
    m, k = x.shape
    if m % MX_BLOCK or k % MX_BLOCK:
        raise ValueError(
            f"MXFP8 quantization: shape {(m, k)} is not a multiple of {MX_BLOCK} in both "
            f"dimensions (TE's MXFP8Quantizer.is_quantizable; megatron pads each expert's rows)"
        )
    block_rows, block_cols = (MX_BLOCK, 1) if columnwise else (1, MX_BLOCK)
    reciprocal_max = torch.tensor(1.0 / FORMATS[fmt][1], dtype=torch.float32)  # max_norm_rcp
    e8m0 = None

    def scales(amax):
        nonlocal e8m0
        e8m0 = float_to_e8m0(amax * reciprocal_max)
        return e8m0_to_scale(254 - e8m0.to(torch.int32)), e8m0_to_scale(
            e8m0
        )  # 2^(127 - e), 2^(e - 127)

    data, values, _ = _quantize_blocks(x, fmt, block_rows, block_cols, scales)
    scale_inv = torch.zeros(mxfp8_scale_shape((m, k), columnwise=columnwise), dtype=torch.uint8)
    scale_inv[: e8m0.shape[0], : e8m0.shape[1]] = e8m0
    return Quantized(data, scale_inv, values)


def mxfp8_scale_shape(shape: tuple[int, int], *, columnwise: bool) -> tuple[int, int]:
    """TE's ``MXFP8Quantizer.get_scale_shape`` for a [M, K] tensor."""
    m, k = shape
    if columnwise:
        return round_up(m // MX_BLOCK, 4), round_up(k, 128)
    return round_up(m, 128), round_up(k // MX_BLOCK, 4)


# -- the operands of a group's GEMMs ------------------------------------------------------------------


def quantize_activation(
    x: torch.Tensor, recipe: Fp8Recipe, fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's input (``fmt`` e4m3) or output gradient (the recipe's backward format) [M, K]:
    (row-wise values, column-wise values), both quantized from ``x`` as TE's input and gradient
    quantizers do (one amax per group under tensorwise; 1-D blocks under blockwise; 1 x 32 / 32 x 1
    under mxfp8)."""
    pow_2 = recipe.power_2_scales
    if recipe.name == "tensorwise":
        values = quantize_tensorwise(x, fmt, pow_2).values
        return values, values
    if recipe.name == "blockwise":
        return (
            quantize_blockwise(x, fmt, columnwise=False, pow_2=pow_2).values,
            quantize_blockwise(x, fmt, columnwise=True, pow_2=pow_2).values,
        )
    return quantize_mxfp8(x, fmt, columnwise=False).values, quantize_mxfp8(
        x, fmt, columnwise=True
    ).values


def quantize_weight(weight: torch.Tensor, recipe: Fp8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """A high-precision weight [N, K] as TE's weight quantizer casts it: (row-wise values for the
    forward GEMM, column-wise values for the input gradient). tensorwise: one amax; blockwise:
    128 x 128 blocks (the column-wise copy is the transpose of the same data); mxfp8: 1 x 32 blocks
    along K row-wise, 32 x 1 along N column-wise."""
    fmt, pow_2 = recipe.forward_format, recipe.power_2_scales
    if recipe.name == "tensorwise":
        values = quantize_tensorwise(weight, fmt, pow_2).values
        return values, values
    if recipe.name == "blockwise":
        values = quantize_blockwise(weight, fmt, columnwise=False, two_d=True, pow_2=pow_2).values
        return values, values
    return quantize_mxfp8(weight, fmt, columnwise=False).values, quantize_mxfp8(
        weight, fmt, columnwise=True
    ).values


class WeightOperand:
    """One group's weight as the GEMMs see it: a high-precision weight's cast (row- and column-wise
    values, ``quantize_weight``) or a quantized parameter (``--fp8-param-gather``: TE computes with
    it as it is, the forward with its row-wise values and the input gradient with its column-wise
    ones, which TE makes available only in the backward, ``update_usage(columnwise_usage=True)``)."""

    def __init__(
        self, rowwise: torch.Tensor, columnwise: Optional[torch.Tensor] = None, quantized=None
    ):
        self.rowwise, self.columnwise, self.quantized = rowwise, columnwise, quantized

    @classmethod
    def of_cast(cls, weight: torch.Tensor, recipe: Fp8Recipe) -> "WeightOperand":
        return cls(*quantize_weight(weight, recipe))

    @classmethod
    def of_quantized_parameter(cls, weight) -> "WeightOperand":
        """``weight``: a quantized tensor with ``dequantize()`` and ``columnwise_values()``."""
        return cls(weight.dequantize(dtype=torch.float32), quantized=weight)

    def saved(self) -> torch.Tensor:
        """What the backward needs: the column-wise values, or the quantized parameter itself
        (saved as TE saves it, so the balanced layer's saved-tensor hooks see it)."""
        return self.quantized if self.quantized is not None else self.columnwise

    @staticmethod
    def dgrad_values(saved: torch.Tensor, quantized: bool) -> torch.Tensor:
        """The column-wise values from what :meth:`saved` gave (after the saved-tensor hooks):
        a quantized parameter's, made now as TE makes them for the backward."""
        return saved.columnwise_values().float() if quantized else saved


class _Fp8GroupedLinear(torch.autograd.Function):
    """``rows [T, K]`` split by ``m_splits``; group i: ``rows_i @ weight_i.T`` in fp8 (module
    docstring); returns [T, N] in the rows' dtype and, in the backward, the input gradient and a
    high-precision gradient per weight."""

    @staticmethod
    def forward(ctx, rows, recipe, m_splits, operands, wgrad_store, *weights):
        chunks = torch.split(rows, list(m_splits))
        outs, saved_inputs = [], []
        for chunk, operand in zip(chunks, operands):
            x_row, x_col = quantize_activation(chunk, recipe, recipe.forward_format)
            outs.append(x_row @ operand.rowwise.t())
            saved_inputs.append(x_col)
        ctx.recipe, ctx.m_splits, ctx.wgrad_store = recipe, tuple(m_splits), wgrad_store
        ctx.weight_shapes = [w.shape for w in weights]
        ctx.quantized = [
            operand.quantized is not None for operand in operands
        ]  # no tensor kept in ctx
        ctx.weight_dtypes = [w.dtype for w in weights]
        ctx.save_for_backward(*saved_inputs, *[operand.saved() for operand in operands])
        out = torch.cat(outs) if outs else rows.new_zeros(0, 0)
        return out.to(rows.dtype)

    @staticmethod
    def backward(ctx, grad):
        saved, num_gemms = ctx.saved_tensors, len(ctx.quantized)
        inputs, weights = saved[:num_gemms], saved[num_gemms:]
        grad_inputs, grad_columnwise = [], []
        for dy, weight, quantized in zip(
            torch.split(grad, list(ctx.m_splits)), weights, ctx.quantized
        ):
            dy_row, dy_col = quantize_activation(dy, ctx.recipe, ctx.recipe.backward_format)
            grad_inputs.append(dy_row @ WeightOperand.dgrad_values(weight, quantized))
            grad_columnwise.append(dy_col)
        grad_rows = torch.cat(grad_inputs).to(grad.dtype) if ctx.needs_input_grad[0] else None
        if ctx.wgrad_store is not None and ctx.wgrad_store.delay_wgrad_compute():
            # TE: ``wgrad_store.put([inputmats, grad_output, wgrad_list], grouped_gemm_wgrad)``; the
            # backward returns the tensors the GEMMs will write (zeros here until backward_dw).
            wgrad_list = [
                grad.new_zeros(shape, dtype=dtype)
                for shape, dtype in zip(ctx.weight_shapes, ctx.weight_dtypes)
            ]
            ctx.wgrad_store.put([list(inputs), grad_columnwise, wgrad_list], _delayed_fp8_wgrad)
            return (grad_rows, None, None, None, None, *wgrad_list)
        grad_weights = [dy_col.t() @ x_col for dy_col, x_col in zip(grad_columnwise, inputs)]
        return (
            grad_rows,
            None,
            None,
            None,
            None,
            *[g.to(dtype) for g, dtype in zip(grad_weights, ctx.weight_dtypes)],
        )


def _delayed_fp8_wgrad(input_columnwise, grad_columnwise, wgrad_list):
    """The stashed weight-gradient grouped GEMM (TE's ``grouped_gemm_wgrad``, ``layout="NT"``), run by
    the module's ``backward_dw``: ``dy_col.T @ x_col`` per group into the tensors the backward
    returned (their dtype's rounding of the fp32 product, as the undelayed path's). Returns
    (weight gradients, bias gradients: none, the biases' came in the backward)."""
    for buffer, x_col, dy_col in zip(wgrad_list, input_columnwise, grad_columnwise):
        buffer.copy_(dy_col.t() @ x_col)
    return wgrad_list, []


def fp8_grouped_linear(
    rows: torch.Tensor,
    m_splits: Sequence[int],
    weights: Sequence[torch.Tensor],
    operands: Sequence[WeightOperand],
    recipe: Fp8Recipe,
    wgrad_store=None,
) -> torch.Tensor:
    """TE's ``GroupedLinear`` forward under fp8: ``rows`` [T, K] (groups contiguous, ``m_splits``
    rows each), ``weights`` the G parameters [N, K] (gradients flow to them), ``operands`` their
    quantized forms; ``wgrad_store`` (``grouped_gemm.WeightGradStore``) with delayed weight
    gradients enabled: the backward stashes the weight-gradient GEMMs there (module docstring).
    Returns [T, N]."""
    if recipe.name == "mxfp8":
        odd = [m for m in m_splits if m % MX_BLOCK]
        if odd:
            raise ValueError(
                f"mxfp8 grouped GEMM: group rows {list(m_splits)} are not multiples of {MX_BLOCK}"
            )
    return _Fp8GroupedLinear.apply(
        rows, recipe, tuple(m_splits), list(operands), wgrad_store, *weights
    )
