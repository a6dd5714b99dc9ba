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

The quantized tensors follow TE 2.x's ``QuantizedTensor`` contract
(``transformer_engine/pytorch/tensor/quantized_tensor.py``: ``get_metadata``, ``dequantize``,
``detach`` sharing the storages, ``copy_`` re-quantizing in place) with ``Float8Tensor``'s,
``Float8BlockwiseQTensor``'s and ``MXFP8Tensor``'s storage attributes; their scales and block sizes
are the toy's (left out: TE's scale formulas, which ``te_grouped_fp8`` follows). Fails
(``ValueError``) on a recipe without current scaling and on a weight whose shape is not a multiple
of the recipe's blocks.

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


def _row_quantization(weight: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] quantized along its rows: (e4m3 values ``float8_e4m3fn`` [out, in], fp32
    dequantization scales: [1] per tensor, [out / BLOCK, in / BLOCK] per block, or powers of two
    [out, in / MX_BLOCK])."""
    w = weight.detach().float()
    tiny = torch.finfo(torch.float32).tiny
    if recipe == "tensorwise":
        scale = (w.abs().amax() / E4M3_MAX).clamp_min(tiny)
        return (w / scale).to(torch.float8_e4m3fn), scale.reshape(1)
    out_dim, in_dim = w.shape
    if recipe == "blockwise":
        if out_dim % BLOCK or in_dim % BLOCK:
            raise ValueError(f"blockwise: weight {tuple(w.shape)} is not a multiple of {BLOCK}")
        blocks = w.view(out_dim // BLOCK, BLOCK, in_dim // BLOCK, BLOCK)
        scale = (blocks.abs().amax(dim=(1, 3), keepdim=True) / E4M3_MAX).clamp_min(tiny)
        return (blocks / scale).to(torch.float8_e4m3fn).view_as(w), scale.view(
            out_dim // BLOCK, in_dim // BLOCK
        )
    if recipe == "mxfp8":
        if in_dim % MX_BLOCK:
            raise ValueError(f"mxfp8: input dimension {in_dim} is not a multiple of {MX_BLOCK}")
        blocks = w.view(out_dim, in_dim // MX_BLOCK, MX_BLOCK)
        amax = blocks.abs().amax(dim=2, keepdim=True).clamp_min(tiny)
        scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))  # power of two, E8M0
        return (blocks / scale).to(torch.float8_e4m3fn).view_as(w), scale.view(
            out_dim, in_dim // MX_BLOCK
        )
    raise ValueError(
        f"toy fp8 quantizer: recipe {recipe!r} is not a current-scaling recipe "
        f"({', '.join(CURRENT_SCALING_RECIPES)})"
    )


def _row_values(data: torch.Tensor, scale: torch.Tensor, recipe: str) -> torch.Tensor:
    """fp32 values of row-quantized ``data`` (e4m3, [out, in]) with its ``scale``."""
    values = data.float()
    out_dim, in_dim = values.shape
    if recipe == "tensorwise":
        return values * scale
    if recipe == "blockwise":
        blocks = values.view(out_dim // BLOCK, BLOCK, in_dim // BLOCK, BLOCK)
        return (blocks * scale.view(out_dim // BLOCK, 1, in_dim // BLOCK, 1)).view_as(values)
    return (values.view(out_dim, in_dim // MX_BLOCK, MX_BLOCK) * scale.unsqueeze(-1)).view_as(
        values
    )


def quantize_weight(weight: torch.Tensor, recipe: str) -> torch.Tensor:
    """The dequantized fp8 value of ``weight`` [out, in] under ``recipe`` (same shape and dtype):
    what a GEMM on the quantized weight computes with."""
    return _row_values(*_row_quantization(weight, recipe), recipe).to(weight.dtype)


# -- quantized parameters (--fp8-param-gather) -------------------------------------------------------


def _e4m3_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.view(torch.uint8)  # TE keeps fp8 data as uint8


def _e4m3(data: torch.Tensor) -> torch.Tensor:
    return data.view(torch.float8_e4m3fn)


class ToyQuantizer:
    """A weight quantizer of ``recipe`` (TE's ``Quantizer``: ``quantize(tensor)`` -> a quantized
    tensor; ``rowwise_usage`` / ``columnwise_usage``: which copies it keeps)."""

    def __init__(self, recipe: str, *, columnwise: bool = True):
        if recipe not in CURRENT_SCALING_RECIPES:
            raise ValueError(f"recipe {recipe!r}: the toy quantizer has current scaling only")
        self.recipe, self.rowwise_usage, self.columnwise_usage = recipe, True, columnwise

    def storages(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The storage tensors of ``weight`` [out, in] quantized, keyed as the quantized class's
        constructor takes them."""
        return QUANTIZED_CLASSES[self.recipe].storages_of(weight, self)

    def quantize(
        self, weight: torch.Tensor, *, requires_grad: bool = False
    ) -> "ToyQuantizedTensor":
        cls = QUANTIZED_CLASSES[self.recipe]
        return cls(
            shape=weight.shape,
            dtype=weight.dtype,
            requires_grad=requires_grad,
            fp8_dtype="e4m3",
            quantizer=self,
            **self.storages(weight),
        )


class ToyQuantizedTensor(torch.Tensor):
    """A quantized weight as TE's ``QuantizedTensor``: a wrapper subclass with the high-precision
    shape and dtype whose values live in storage tensors (attributes ``STORAGES``); ``get_metadata()``
    returns the constructor's keyword arguments, so ``type(t)(shape=, dtype=, requires_grad=,
    **t.get_metadata())`` rebuilds it; ``dequantize()`` gives the row-wise values. Ordinary torch
    ops see the dequantized values; ``copy_`` into it quantizes the source into its storages in
    place (what megatron's optimizer does to fp8 parameters after its step); ``detach`` shares them.

    The GEMMs of :mod:`torch_grouped_linear` use the row-wise copy for the forward and the
    column-wise one (:meth:`columnwise_values`) for the input gradient, as TE's kernels do.
    """

    #: constructor keyword -> attribute, for the storage tensors (``None`` where not kept).
    STORAGES: dict[str, str] = {}
    #: storages that are a cache TE leaves stale when the tensor is re-quantized (marked invalid,
    #: still returned by ``get_metadata()``), rebuilt from the others when used.
    CACHES: tuple[str, ...] = ()
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls, *, shape, dtype, requires_grad=False, fp8_dtype="e4m3", quantizer=None, **storages
    ):
        present = [t for t in storages.values() if t is not None]
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=present[0].device, requires_grad=requires_grad
        )
        for key, attr in cls.STORAGES.items():
            setattr(self, attr, storages.get(key))
        # A cache given to the constructor is valid (TE: ``_transpose_invalid = transpose is None``).
        self._caches_invalid = {key: storages.get(key) is None for key in cls.CACHES}
        self._fp8_dtype, self._quantizer = fp8_dtype, quantizer
        return self

    def get_metadata(self) -> dict:
        return {
            **{key: getattr(self, attr) for key, attr in self.STORAGES.items()},
            "fp8_dtype": self._fp8_dtype,
            "quantizer": self._quantizer,
        }

    def dequantize(self, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._rowwise_values().to(dtype or self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default:
            (tensor,) = args
            return type(tensor)(shape=tensor.shape, dtype=tensor.dtype, **tensor.get_metadata())
        if func is torch.ops.aten.copy_.default and isinstance(args[0], ToyQuantizedTensor):
            target, source = args[0], args[1]
            if isinstance(source, ToyQuantizedTensor):
                source = source.dequantize()
            fresh = target._quantizer.storages(source.to(target.dtype))
            for key, attr in target.STORAGES.items():
                if key in target.CACHES:  # megatron's re-quantization resets TE's caches: stale now
                    target._caches_invalid[key] = True
                elif getattr(target, attr) is not None:
                    getattr(target, attr).copy_(fresh[key])
            return target

        if (
            func is torch.ops.aten.mm.default
            and isinstance(args[1], ToyQuantizedTensor)
            and not isinstance(args[0], ToyQuantizedTensor)
        ):
            # grad_output @ weight: a linear layer's input gradient (megatron's local linear; its
            # forward multiplies by weight.t(), which gives the row-wise values). TE's dgrad GEMM
            # reads the column-wise copy.
            return func(args[0], args[1].columnwise_values().to(args[1].dtype), **kwargs)

        def plain(value):
            return value.dequantize() if isinstance(value, ToyQuantizedTensor) else value

        return func(
            *torch.utils._pytree.tree_map(plain, args),
            **torch.utils._pytree.tree_map(plain, kwargs),
        )

    def __repr__(self):
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype})"


class ToyFloat8Tensor(ToyQuantizedTensor):
    """``tensorwise`` (TE's ``Float8Tensor``): ``_data`` uint8 [out, in], ``_scale_inv`` fp32 [1],
    ``_transpose`` uint8 [in, out] (the column-wise copy, a byte transpose of ``_data``) or
    ``None``: a cache, left stale by a re-quantization (``copy_``) and then made from ``_data`` where
    the input gradient needs it, as TE's ``update_usage`` does."""

    STORAGES = {"data": "_data", "fp8_scale_inv": "_scale_inv", "data_transpose": "_transpose"}
    CACHES = ("data_transpose",)

    @classmethod
    def storages_of(cls, weight, quantizer):
        data, scale = _row_quantization(weight, "tensorwise")
        transpose = _e4m3_bytes(data.t().contiguous()) if quantizer.columnwise_usage else None
        return {"data": _e4m3_bytes(data), "fp8_scale_inv": scale, "data_transpose": transpose}

    def _rowwise_values(self):
        return _e4m3(self._data).float() * self._scale_inv

    def columnwise_values(self):
        if self._transpose is None or self._caches_invalid["data_transpose"]:
            return self._rowwise_values()  # the transpose made from _data: the same values
        return (_e4m3(self._transpose).float() * self._scale_inv).t()


class ToyBlockwiseTensor(ToyQuantizedTensor):
    """``blockwise`` (TE's ``Float8BlockwiseQTensor``): ``_rowwise_data`` uint8 [out, in] with
    ``_rowwise_scale_inv`` fp32 [out / B, in / B]; ``_columnwise_data`` uint8 [in, out] (the
    transpose, quantized in its own blocks) with ``_columnwise_scale_inv`` [in / B, out / B]."""

    STORAGES = {
        "rowwise_data": "_rowwise_data",
        "rowwise_scale_inv": "_rowwise_scale_inv",
        "columnwise_data": "_columnwise_data",
        "columnwise_scale_inv": "_columnwise_scale_inv",
    }

    @classmethod
    def storages_of(cls, weight, quantizer):
        data, scale = _row_quantization(weight, "blockwise")
        out = {
            "rowwise_data": _e4m3_bytes(data),
            "rowwise_scale_inv": scale,
            "columnwise_data": None,
            "columnwise_scale_inv": None,
        }
        if quantizer.columnwise_usage:
            column_data, column_scale = _row_quantization(weight.t(), "blockwise")
            out.update(columnwise_data=_e4m3_bytes(column_data), columnwise_scale_inv=column_scale)
        return out

    def _rowwise_values(self):
        return _row_values(_e4m3(self._rowwise_data), self._rowwise_scale_inv, "blockwise")

    def columnwise_values(self):
        if self._columnwise_data is None:
            return self._rowwise_values()
        return _row_values(
            _e4m3(self._columnwise_data), self._columnwise_scale_inv, "blockwise"
        ).t()


class ToyMXFP8Tensor(ToyQuantizedTensor):
    """``mxfp8`` (TE's ``MXFP8Tensor``): ``_rowwise_data`` uint8 [out, in] with ``_rowwise_scale_inv``
    uint8 E8M0 [out, in / 32] (1 x 32 blocks); ``_columnwise_data`` uint8 [out, in] quantized in
    32 x 1 blocks with ``_columnwise_scale_inv`` uint8 [out / 32, in]: other values than the
    row-wise copy's, which TE's input-gradient GEMM uses."""

    STORAGES = {
        "rowwise_data": "_rowwise_data",
        "rowwise_scale_inv": "_rowwise_scale_inv",
        "columnwise_data": "_columnwise_data",
        "columnwise_scale_inv": "_columnwise_scale_inv",
    }

    @staticmethod
    def _e8m0(scale: torch.Tensor) -> torch.Tensor:
        return (torch.log2(scale) + 127).round().to(torch.uint8)

    @staticmethod
    def _scale(e8m0: torch.Tensor) -> torch.Tensor:
        return torch.exp2(e8m0.float() - 127)

    @classmethod
    def storages_of(cls, weight, quantizer):
        data, scale = _row_quantization(weight, "mxfp8")
        out = {
            "rowwise_data": _e4m3_bytes(data),
            "rowwise_scale_inv": cls._e8m0(scale),
            "columnwise_data": None,
            "columnwise_scale_inv": None,
        }
        if quantizer.columnwise_usage:
            column_data, column_scale = _row_quantization(
                weight.t(), "mxfp8"
            )  # [in, out], 1 x 32 along out
            out.update(
                columnwise_data=_e4m3_bytes(column_data.t().contiguous()),
                columnwise_scale_inv=cls._e8m0(column_scale).t().contiguous(),
            )
        return out

    def _rowwise_values(self):
        return _row_values(_e4m3(self._rowwise_data), self._scale(self._rowwise_scale_inv), "mxfp8")

    def columnwise_values(self):
        if self._columnwise_data is None:
            return self._rowwise_values()
        return _row_values(
            _e4m3(self._columnwise_data).t(), self._scale(self._columnwise_scale_inv).t(), "mxfp8"
        ).t()


QUANTIZED_CLASSES = {
    "tensorwise": ToyFloat8Tensor,
    "blockwise": ToyBlockwiseTensor,
    "mxfp8": ToyMXFP8Tensor,
}


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
