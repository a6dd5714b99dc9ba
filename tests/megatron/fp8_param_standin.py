"""Transformer Engine's fp8 parameters (``--fp8-param-gather``) through megatron-core's own DDP and
distributed optimizer, on CPU ranks without TE.

What megatron-core 0.19.2 does with them on a GPU, and what runs of it here:

* **Building** (TE's ``fp8_model_init``, ``module/base.py``: ``reset_parameters``): each linear
  weight TE owns is initialized in high precision, kept on the host for the optimizer's main
  parameters (``get_high_precision_init_val``) and quantized by its recipe's quantizer with
  row- and column-wise usage. Here: the routed experts' linear weights of megatron's
  ``SequentialMLP`` (:func:`quantize_expert_weights`), as ``toy_fp8``'s quantized tensors, whose
  GEMMs megatron's local linear runs on their values (forward: row-wise; input gradient:
  column-wise, ``toy_fp8``).
* **The DDP buffers** (``param_and_grad_buffer.py``): a quantized parameter's storage is mapped
  into the uint8 parameter buffer with ``fp8_utils.modify_underlying_storage`` -> TE's
  ``replace_raw_data`` (:func:`replace_raw_data`: a ``Float8Tensor``'s ``_data``, a
  ``Float8BlockwiseQTensor``'s ``_rowwise_data``; an ``MXFP8Tensor`` raises
  ``NotImplementedError``, as TE's does). With ``--reuse-grad-buf-for-mxfp8-param-ag`` megatron
  skips that for quantized parameters: an MXFP8 weight keeps its storage, its gradient buffer is
  shared with a bf16 parameter buffer for the all-gather.
* **The optimizer step** (``distrib_optimizer.py``): the fp32 main-parameter shards are cast into
  the quantized weights by ``fp8_utils.quantize_param_shard``, megatron's own code for TE >= 2.2
  (run here as written, :func:`install`), which calls TE's ``cast_master_weights_to_fp8`` with
  ``manual_post_all_gather_processing=True`` (:func:`cast_master_weights_to_fp8`: per-weight or
  per-block amaxes of each rank's shard reduced with MAX over the group, scales written into the
  weight in place, the shard cast into the weight's mapped bytes; caches left as they are). With
  the reuse flag megatron instead stages the bf16 main parameters in the shared buffer
  (``_copy_main_params_to_param_buffer``).
* **The parameter all-gather** (``_ParamAndGradBucketGroup``): the uint8 buffer is gathered, then
  ``fp8_utils.post_all_gather_processing`` -> TE's (:func:`post_all_gather_processing`: a
  ``Float8Tensor``'s transpose made from its data where the GPU needs it, a blockwise weight's
  column-wise copy made from its row-wise one, nothing for MXFP8). With the reuse flag the bf16
  values gathered into the shared buffer are quantized into each weight by ``copy_``
  (``copy_tensor_to_quantized_param``), and that part of the buffer is zeroed for the gradients.

Megatron's own code runs every step of it; this module supplies only TE's parts, following TE's
source (``transformer_engine/pytorch/tensor/utils.py``, ``float8_tensor.py``,
``float8_blockwise_tensor.py``, ``mxfp8_tensor.py``, ``storage/*.py``, ``module/base.py``;
release 2.18), on ``toy_fp8``'s quantized tensors.

Fails as TE does: ``replace_raw_data`` of an MXFP8 tensor (``NotImplementedError``), another
quantized class (``ValueError``); and refuses (``NotImplementedError``) what it leaves out: FSDP
shards, a cast without ``manual_post_all_gather_processing``.

Left out: TE's kernels and their numerics (``toy_fp8``'s quantizers: scale formulas, block sizes,
no MXFP8 scale padding), delayed scaling (refused by the balancer), NVFP4, FSDP's sharded model
weights, TE's grouped weights (``--moe-grouped-gemm`` with a single grouped parameter), every
weight but the routed experts' (attention, dense and shared-expert linears stay high precision
here), and saving checkpoints of the quantized tensors (torch_dist needs TE's serialization of
them; saved as they are, they garbled the checkpoint's other tensors): runs start from a
high-precision checkpoint, which megatron quantizes as it loads it.
"""

from __future__ import annotations

import ast
import builtins
import collections
import contextlib
import inspect
import math
import types
from typing import Optional, Sequence

import torch

import toy_fp8

#: The TE release this module follows; megatron's TE version checks see it.
TE_VERSION = "2.18.0"
#: TE's ``is_non_tn_fp8_gemm_supported()``: False on Hopper (its fp8 GEMMs need the weight's
#: transpose), True on Blackwell. Hopper's, so the transpose path runs.
NON_TN_FP8_GEMM_SUPPORTED = False

#: Block shape of each recipe's scales, per copy: (rows, columns) of a weight [out, in] sharing
#: one scale. None: the whole tensor.
_ROWWISE_BLOCK = {
    "tensorwise": None,
    "blockwise": (toy_fp8.BLOCK, toy_fp8.BLOCK),
    "mxfp8": (1, toy_fp8.MX_BLOCK),
}
_COLUMNWISE_BLOCK = {"mxfp8": (toy_fp8.MX_BLOCK, 1)}


#: How often each TE function stood in here ran in this process (the tests check that the path ran).
CALLS: collections.Counter = collections.Counter()


def recipe_of(tensor: torch.Tensor) -> str:
    """The current-scaling recipe of a ``toy_fp8`` quantized tensor."""
    for recipe, cls in toy_fp8.QUANTIZED_CLASSES.items():
        if type(tensor) is cls:
            return recipe
    raise ValueError(f"{type(tensor).__name__} is not a quantized tensor of the stand-in")


# -- TE's replace_raw_data, post_all_gather_processing, cast_master_weights_to_fp8 ------------------


def replace_raw_data(tensor: torch.Tensor, new_raw_data: torch.Tensor) -> None:
    """TE's ``replace_raw_data``: move a quantized tensor's row-wise bytes into ``new_raw_data``
    (a view of megatron's parameter buffer), keeping their values. An MXFP8 tensor raises, as in
    TE (megatron: its tile-scaling layout cannot be mapped into the buffer)."""
    CALLS["replace_raw_data"] += 1
    if isinstance(tensor, toy_fp8.ToyFloat8Tensor):
        attr = "_data"
    elif isinstance(tensor, toy_fp8.ToyBlockwiseTensor):
        attr = "_rowwise_data"
    elif isinstance(tensor, toy_fp8.ToyMXFP8Tensor):
        raise NotImplementedError("replace_raw_data for MXFP8Tensor is not supported yet")
    else:
        raise ValueError(f"replace_raw_data for {type(tensor)} is not supported yet")
    old = getattr(tensor, attr)
    if old.dtype != new_raw_data.dtype:
        raise ValueError(
            "The data types of raw data don't match: "
            f"old dtype={old.dtype}, new dtype={new_raw_data.dtype}"
        )
    new_raw_data.detach().copy_(old.view(new_raw_data.shape))
    setattr(tensor, attr, new_raw_data.view(old.shape))


def create_transpose(tensor: "toy_fp8.ToyFloat8Tensor") -> None:
    """TE's ``Float8TensorStorage._create_transpose``: the transpose cache made from ``_data``
    (into the existing one where there is one) and marked valid."""
    transposed = tensor._data.t().contiguous()
    if tensor._transpose is None:
        tensor._transpose = transposed
    else:
        tensor._transpose.copy_(transposed)
    tensor._caches_invalid["data_transpose"] = False


def create_columnwise(tensor: "toy_fp8.ToyBlockwiseTensor") -> None:
    """TE's ``Float8BlockwiseQTensorStorage._create_columnwise`` (2D block scaling): the
    column-wise data is the byte transpose of the row-wise data, its scales the transpose of the
    row-wise scales, written into the existing column-wise storage."""
    data = tensor._rowwise_data.t().contiguous()
    scales = tensor._rowwise_scale_inv.t()
    if tensor._columnwise_data is None:
        tensor._columnwise_data = data
    else:
        tensor._columnwise_data.copy_(data)
    if tensor._columnwise_scale_inv is None:
        tensor._columnwise_scale_inv = scales.contiguous()
    else:
        h, w = (min(a, b) for a, b in zip(tensor._columnwise_scale_inv.shape, scales.shape))
        tensor._columnwise_scale_inv[:h, :w].copy_(scales[:h, :w])


def post_all_gather_processing(model_weights) -> None:
    """TE's ``post_all_gather_processing``, after megatron's all-gather of the parameters:
    a ``Float8Tensor`` gets its transpose made from the gathered data where the GPU's fp8 GEMMs
    need it (:data:`NON_TN_FP8_GEMM_SUPPORTED`), a blockwise tensor its column-wise copy made from
    the gathered row-wise one; MXFP8 needs nothing; another quantized class is refused."""
    if not isinstance(model_weights, list):
        model_weights = [model_weights]
    CALLS["post_all_gather_processing"] += len(model_weights)
    for weight in model_weights:
        if isinstance(weight, toy_fp8.ToyFloat8Tensor):
            if not NON_TN_FP8_GEMM_SUPPORTED:
                create_transpose(weight)
        elif isinstance(weight, toy_fp8.ToyBlockwiseTensor):
            create_columnwise(weight)
        elif isinstance(weight, toy_fp8.ToyMXFP8Tensor):
            pass
        elif isinstance(weight, toy_fp8.ToyQuantizedTensor):
            raise ValueError(f"post_processing for {type(weight)} is not supported")


def _block_amax(
    shape: torch.Size, start: int, values: torch.Tensor, block: Optional[tuple[int, int]]
) -> torch.Tensor:
    """Per-block amax of a weight of ``shape`` [out, in] of which only the flat elements
    ``[start, start + len(values))`` are known (``values``; the rest count as zero): TE's
    ``compute_amax`` / ``fp8_block_scaling_compute_partial_amax`` /
    ``mxfp8_scaling_compute_partial_amax`` of one rank's main-parameter shard."""
    full = torch.zeros(shape.numel(), dtype=torch.float32)
    full[start : start + values.numel()] = values.detach().float().abs().reshape(-1)
    if block is None:
        return full.amax().reshape(1)
    out_dim, in_dim = shape
    rows, cols = block
    return full.view(out_dim // rows, rows, in_dim // cols, cols).amax(dim=(1, 3))


def _scale_inv(amax: torch.Tensor, recipe: str) -> torch.Tensor:
    """Dequantization scales from amaxes, as ``toy_fp8``'s quantizers compute them (fp32, or
    powers of two for ``mxfp8``)."""
    tiny = torch.finfo(torch.float32).tiny
    if recipe == "mxfp8":
        return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(tiny) / toy_fp8.E4M3_MAX)))
    return (amax / toy_fp8.E4M3_MAX).clamp_min(tiny)


def _cast_fragment(
    shape: torch.Size,
    start: int,
    values: torch.Tensor,
    scale_inv: torch.Tensor,
    block: Optional[tuple[int, int]],
) -> torch.Tensor:
    """The e4m3 bytes of the flat elements ``[start, start + len(values))`` of a weight of
    ``shape``, each divided by its block's scale (TE's ``*_partial_cast``)."""
    if block is None:
        per_element = scale_inv.expand(values.numel())
    else:
        rows, cols = block
        per_element = scale_inv.repeat_interleave(rows, 0).repeat_interleave(cols, 1).reshape(-1)
        per_element = per_element[start : start + values.numel()]
    scaled = values.detach().float().reshape(-1) / per_element
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


def cast_master_weights_to_fp8(
    model_weights,
    master_weights,
    start_offsets,
    group,
    fsdp_shard_model_weights=None,
    manual_post_all_gather_processing=False,
) -> None:
    """TE's ``cast_master_weights_to_fp8`` (``quantize_master_weights``) for current scaling:
    each rank holds a shard ``master_weights[i]`` (or None) of weight ``i`` starting at flat
    element ``start_offsets[i]``. Per weight the amaxes of the shards (per tensor, or per scale
    block of the row- and column-wise copies) are reduced with MAX over ``group``, so every rank
    gets the whole weight's scales, written into the weight in place; each shard is cast to the
    model weight's dtype and then quantized into its fragment of the weight's bytes (megatron's
    parameter buffer once mapped there). The caches are left for
    :func:`post_all_gather_processing`: megatron passes ``manual_post_all_gather_processing=True``
    (without it TE drops them; not modelled)."""
    if fsdp_shard_model_weights is not None:
        raise NotImplementedError("the fp8 parameter stand-in has no FSDP shard model weights")
    if not manual_post_all_gather_processing:
        raise NotImplementedError("the fp8 parameter stand-in leaves the caches to the gather")
    CALLS["cast_master_weights_to_fp8"] += len(model_weights)
    by_recipe: dict[str, list] = {}
    for weight, master, start in zip(model_weights, master_weights, start_offsets):
        if callable(getattr(weight, "clear_high_precision_init_val", None)):
            weight.clear_high_precision_init_val()
        if master is not None:  # the main parameter goes through the model's dtype first, as in TE
            master = master.to(weight.dtype)
        by_recipe.setdefault(recipe_of(weight), []).append((weight, master, start))
    for recipe, params in by_recipe.items():
        _cast_current_scaling(recipe, params, group)


def _copies(recipe: str) -> list[tuple[str, str, Optional[tuple[int, int]]]]:
    """(data attribute, scale attribute, scale block) of each copy a recipe's cast writes."""
    rowwise = (
        ("_data", "_scale_inv")
        if recipe == "tensorwise"
        else ("_rowwise_data", "_rowwise_scale_inv")
    )
    copies = [(*rowwise, _ROWWISE_BLOCK[recipe])]
    if recipe in _COLUMNWISE_BLOCK:  # MXFP8 quantizes the column-wise copy in blocks of its own
        copies.append(("_columnwise_data", "_columnwise_scale_inv", _COLUMNWISE_BLOCK[recipe]))
    return copies


def shard_amaxes(recipe: str, params) -> torch.Tensor:
    """Step 1 of TE's cast: the packed per-tensor or per-block amaxes of this rank's shards
    (``params``: (model weight, main-parameter shard or None, start offset)); zero where a block
    holds none of them."""
    return torch.cat(
        [
            _block_amax(
                weight.shape, start or 0, master if master is not None else torch.zeros(0), block
            ).reshape(-1)
            for weight, master, start in params
            for _, _, block in _copies(recipe)
        ]
    )


def cast_shards(recipe: str, params, amaxes: torch.Tensor) -> None:
    """Steps 3 and 4 of TE's cast, with the amaxes reduced over the group: every weight's scales
    written in place, this rank's shards quantized into their fragments of the weights' bytes."""
    offset = 0
    for weight, master, start in params:
        for data_attr, scale_attr, block in _copies(recipe):
            shape = (
                (1,)
                if block is None
                else (weight.shape[0] // block[0], weight.shape[1] // block[1])
            )
            amax = amaxes[offset : offset + math.prod(shape)].view(shape)
            offset += amax.numel()
            scale_inv = _scale_inv(amax, recipe)
            stored = getattr(weight, scale_attr)  # in place: the weight keeps its scale tensor
            values = (
                (torch.log2(scale_inv) + 127).round() if recipe == "mxfp8" else scale_inv
            )  # E8M0
            stored[tuple(slice(0, n) for n in values.shape)].copy_(values.to(stored.dtype))
            if master is not None:
                fragment = getattr(weight, data_attr).reshape(-1)[start : start + master.numel()]
                fragment.copy_(_cast_fragment(weight.shape, start, master, scale_inv, block))


def _cast_current_scaling(recipe: str, params, group) -> None:
    """One recipe's weights: TE's ``_cast_master_weights_to_fp8_{current,blockwise,mxfp8}_scaling``
    (step 2: the amaxes reduced with MAX over ``group``, so every rank gets every weight's)."""
    amaxes = shard_amaxes(recipe, params)
    torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=group)
    cast_shards(recipe, params, amaxes)


# -- TE's fp8_model_init for megatron's experts ---------------------------------------------------


def _recipe_name(config) -> str:
    recipe = config.fp8_recipe
    return getattr(recipe, "value", recipe)


def quantize_expert_weights(experts: torch.nn.Module, config) -> None:
    """What TE's ``fp8_model_init`` does to each linear weight it builds (``reset_parameters``),
    for megatron's ``SequentialMLP`` experts: the initialized weight is kept on the host for the
    optimizer's main parameters (``get_high_precision_init_val`` / ``clear_...``), quantized
    with row- and column-wise usage, and re-registered as a parameter with the attributes megatron
    gave the high-precision one (``allreduce``, tensor-parallel attributes)."""
    quantizer = toy_fp8.ToyQuantizer(_recipe_name(config), columnwise=torch.is_grad_enabled())
    for module in experts.modules():
        weight = module._parameters.get("weight")
        if weight is None or isinstance(weight, toy_fp8.ToyQuantizedTensor):
            continue
        init_value = weight.detach().cpu().clone()
        param = torch.nn.Parameter(
            quantizer.quantize(weight.detach()), requires_grad=weight.requires_grad
        )
        for name, value in vars(weight).items():  # megatron's parameter attributes
            if not name.startswith("_"):
                setattr(param, name, value)
        param._high_precision_init_val = init_value
        param.get_high_precision_init_val = types.MethodType(
            lambda self: getattr(self, "_high_precision_init_val", None), param
        )
        param.clear_high_precision_init_val = types.MethodType(
            lambda self: self.__dict__.pop("_high_precision_init_val", None), param
        )
        module._parameters["weight"] = param


# -- installation into megatron-core ---------------------------------------------------------------


def _te_version_at_least(version, check_equality: bool = True) -> bool:
    from packaging.version import Version

    have, want = Version(TE_VERSION), Version(str(version))
    return have >= want if check_equality else have > want


def _te_modules() -> dict[str, types.ModuleType]:
    """The names megatron's TE >= 2.2 code imports from TE, bound to this module's stand-ins."""
    te = types.ModuleType("transformer_engine")
    te_pytorch = types.ModuleType("transformer_engine.pytorch")
    te_tensor = types.ModuleType("transformer_engine.pytorch.tensor")
    te_utils = types.ModuleType("transformer_engine.pytorch.tensor.utils")
    te_tensor.QuantizedTensor = toy_fp8.ToyQuantizedTensor
    te_utils.replace_raw_data = replace_raw_data
    te_utils.cast_master_weights_to_fp8 = cast_master_weights_to_fp8
    te_utils.post_all_gather_processing = post_all_gather_processing
    te.pytorch, te_pytorch.tensor, te_tensor.utils = te_pytorch, te_tensor, te_utils
    return {m.__name__: m for m in (te, te_pytorch, te_tensor, te_utils)}


def _megatron_te22_branch(fp8_utils) -> dict:
    """Run megatron's own fp8_utils code for TE >= 2.2 (the ``if HAVE_TE and
    is_te_min_version("2.2"):`` branch defining ``_modify_underlying_storage_impl``,
    ``_quantize_param_shard_impl``, ...) in a copy of fp8_utils' namespace whose imports of
    ``transformer_engine`` resolve to the stand-ins; returns that namespace."""
    source = inspect.getsource(fp8_utils)
    tree = ast.parse(source)
    branch = next(
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and "is_te_min_version(\"2.2\")" in ast.unparse(node.test).replace("'", '"')
    )
    modules = _te_modules()

    def te_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and (name == "transformer_engine" or name.startswith("transformer_engine.")):
            module = modules[name]
            return module if fromlist else modules["transformer_engine"]
        return builtins.__import__(name, globals, locals, fromlist, level)

    namespace = dict(vars(fp8_utils))
    namespace["__builtins__"] = {**vars(builtins), "__import__": te_import}
    namespace["te_post_all_gather_processing"] = post_all_gather_processing
    body = ast.Module(body=branch.body, type_ignores=[])
    exec(compile(body, fp8_utils.__file__, "exec"), namespace)
    return namespace


#: (owner, attribute, the value before install()) of every patch, to undo them.
_PATCHED: list[tuple[object, str, object]] = []
_ABSENT = object()


def _set(owner, attribute: str, value) -> None:
    _PATCHED.append((owner, attribute, getattr(owner, attribute, _ABSENT)))
    setattr(owner, attribute, value)


def install() -> None:
    """Make megatron-core (imported after the CPU backend) treat ``toy_fp8``'s quantized tensors
    as TE's and run its TE >= 2.2 fp8-parameter code on them (module docstring). Process-wide
    until :func:`uninstall`; idempotent."""
    if _PATCHED:
        return
    from packaging.version import Version

    from megatron.core import fp8_utils
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.transformer import transformer_config
    from megatron.core.transformer.moe import experts

    namespace = _megatron_te22_branch(fp8_utils)
    for name in (
        "_modify_underlying_storage_impl",
        "_quantize_param_shard_impl",
        "_correct_amax_history_if_needed_impl",
    ):
        _set(fp8_utils, name, namespace[name])
    for name, value in (
        ("HAVE_TE_FP8_TENSOR_CLASS", True),
        ("FP8_TENSOR_CLASS", toy_fp8.ToyQuantizedTensor),
        ("HAVE_TE_MXFP8TENSOR", True),
        ("MXFP8Tensor", toy_fp8.ToyMXFP8Tensor),
        ("te_post_all_gather_processing", post_all_gather_processing),
    ):
        _set(fp8_utils, name, value)
    for module in (fp8_utils, transformer_config):  # TE version checks (no TE installed)
        _set(module, "is_te_min_version", _te_version_at_least)
        _set(module, "get_te_version", lambda: Version(TE_VERSION))

    copy_into = param_and_grad_buffer.copy_tensor_to_quantized_param

    def copy_tensor_to_quantized_param(param, src):  # counted: the reuse flag's re-quantization
        CALLS["copy_tensor_to_quantized_param"] += 1
        copy_into(param, src)

    _set(param_and_grad_buffer, "copy_tensor_to_quantized_param", copy_tensor_to_quantized_param)
    build = experts.SequentialMLP.__init__

    def __init__(self, num_local_experts, config, *args, **kwargs):
        build(self, num_local_experts, config, *args, **kwargs)
        if config.fp8 and config.fp8_param:
            quantize_expert_weights(self, config)

    _set(experts.SequentialMLP, "__init__", __init__)


def uninstall() -> None:
    """Undo :func:`install`."""
    while _PATCHED:
        owner, attribute, value = _PATCHED.pop()
        if value is _ABSENT:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, value)


@contextlib.contextmanager
def installed():
    """:func:`install` for the ``with`` block (in-process tests)."""
    install()
    try:
        yield
    finally:
        uninstall()


def needed_by(argv: Sequence[str]) -> bool:
    """Whether a run with these arguments needs the stand-in: fp8 parameters."""
    return "--fp8-param-gather" in argv and "--fp8-format" in argv
