"""Pure-torch grouped linears for megatron-core's ``TEGroupedMLP`` (tests without TE).

``TEGroupedMLP`` is megatron-core's grouped-GEMM expert class; its ``linear_fc1`` / ``linear_fc2``
are normally Transformer Engine's ``GroupedLinear`` (TE 2.x, in ``transformer_engine/pytorch/``:
``module/grouped_linear.py``) through megatron's ``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear`` (megatron-core 0.19.2 and 0.18,
``extensions/transformer_engine.py``), which needs a CUDA build of TE. The classes here are drop-in
replacements that follow the ``GroupedLinearFc1Builder`` / ``GroupedLinearFc2Builder`` protocols of
``megatron/core/transformer/moe/experts.py`` and keep TE's parameter layout, so code that reads or swaps expert weights sees what it would see with TE:

* one parameter per local expert, ``weight{i}`` of shape [out, in] (the TP partition), and
  ``bias{i}`` of shape [out] when ``bias=True``; no ``_extra_state`` (no FP8 metadata);
* the attributes megatron's DDP / optimizer / grad-norm read, as the TE wrapper of the installed
  megatron-core leaves them (:func:`mark_expert_parameters`). 0.19: megatron's own
  ``_set_expert_parameter_attributes``: ``allreduce`` (False when the parameter is reduced over
  the expert-DP group), ``tensor_model_parallel``, ``partition_dim``, ``partition_stride``;
  row-parallel biases also get ``sequence_parallel=False`` (TE's value once megatron makes expert
  TP communication explicit). 0.18: TE's ``GroupedLinear.reset_parameters`` marking for the
  parallel mode megatron hands TE (none when expert communication is explicit), then 0.18's
  ``allreduce`` (False with EP > 1) and its ``partition_dim`` / ``partition_stride`` stamp;
* weights initialised as megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` do
  (``use_cpu_initialization``: a full [out, in] master weight per expert, init_method, then this
  TP rank's slice; otherwise the rank's slice under the expert-parallel RNG tracker); biases zero;
* ``sharded_state_dict`` that maps local expert ``i`` to global expert ``ep_rank * G + i`` as the
  TE wrapper does, so distributed checkpoints interchange with ``SequentialMLP``'s.

Forward is :func:`grouped_matmul`, a loop of per-expert matmuls over the token chunks
(``torch.split`` by ``tokens_per_expert``; no CUDA grouped-GEMM path); autograd computes every
weight gradient during the normal backward, and ``backward_dw`` has nothing to do, unless
``config.delay_wgrad_compute``.

Delayed weight gradients (``config.delay_wgrad_compute``) follow Transformer Engine's contract: see
:mod:`grouped_gemm`, which holds the GEMMs (plain, quantized-weight and delayed-wgrad) and the
``WeightGradStore``. Under fp8 the backward stashes the fp8 weight-gradient GEMMs (the quantized
column-wise inputs and output gradients, ``te_grouped_fp8``) in the same store and ``backward_dw``
runs them, as TE's; with fp8 parameters (``config.fp8_param``) too (the weight-gradient GEMM
reads no weight).

fp8 (``config.fp8`` with a current-scaling ``config.fp8_recipe``: tensorwise, blockwise, mxfp8):
the GEMMs are ``te_grouped_fp8.fp8_grouped_linear``, which quantizes each group's input, weight and
output gradient as TE's grouped GEMM does (one quantizer per group; see that module for what it
follows and leaves out), following the contract of TE's
``GroupedLinear.forward(inp, m_splits, is_first_microbatch)`` and of megatron's wrapper around it
(``TEGroupedLinear``) for the weight casts:

* the wrapper passes ``is_first_microbatch=None`` when ``config.disable_parameter_transpose_cache``
  (read at construction into ``disable_parameter_transpose_cache``), else its own
  ``is_first_microbatch`` attribute, and sets that attribute False after every call; megatron's
  ``MegatronModule.set_is_first_microbatch`` sets it True again on the model's modules each step;
* TE with ``is_first_microbatch=True`` quantizes the weights and caches the cast, with ``False``
  computes with the cached cast (the weights are assumed unchanged within a step), with ``None``
  quantizes and caches nothing.

The output and the input gradient use the cast, the weight gradient (computed from the quantized
input and output gradient) flows to the high-precision weight in its dtype, as TE's.

fp8 parameters (``config.fp8_param``, megatron's ``--fp8-param-gather``; in megatron TE's
``fp8_model_init`` context around the layer's construction does this): every ``weight{i}`` is a
quantized tensor (``toy_fp8.ToyQuantizedTensor``, TE's ``QuantizedTensor`` contract) with row- and
column-wise copies, and the GEMMs compute with them as given, cast nowhere: the forward with the
row-wise values, the input gradient with the column-wise ones, the weight gradient in high
precision (returned as a plain tensor of the weight's shape and dtype, as TE's). Their block
layout is ``toy_fp8``'s (smaller blocks than TE's for blockwise weights).

Fails (``ValueError``) where TE refuses fp8 rows per expert that are not padded to the GEMM's
alignment, and on what it leaves out: non-expert use, FP4, fp8 recipes without current scaling,
fused gradient accumulation, a single grouped weight or bias, overlapping the dispatch's backward
with the weight gradients. Leaves out besides: TE's CUDA grouped GEMM kernels (a loop of matmuls),
its fp8 metadata (``_extra_state``), communication overlap (userbuffers).

Usage (megatron's MoELayer with grouped experts)::

    spec = grouped_moe_layer_spec()                 # partial(MoELayer, submodules=...)
    layer = spec(config=config, pg_collection=pg_collection)   # config.moe_grouped_gemm=True
    layer.experts.linear_fc1.weight3                # expert 3's fc1 weight, [F or 2F, H]
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

import te_grouped_fp8
import toy_fp8
from grouped_gemm import DelayedWgradGroupedLinear, WeightGradStore, grouped_matmul
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import divide, get_pg_rank, get_pg_size

from ultraep_megatron.megatron.release import compat

__all__ = [
    "grouped_matmul",
    "TorchGroupedLinear",
    "TorchColumnGroupedLinear",
    "TorchRowGroupedLinear",
    "grouped_mlp_submodules",
    "grouped_experts_builder",
    "grouped_moe_layer_spec",
]


class TorchGroupedLinear(torch.nn.Module):
    """``G`` linears ``y_i = x_i @ weight{i}.T (+ bias{i})`` over contiguous chunks of tokens.

    Args:
        num_gemms: G, the number of local experts.
        input_size: full input width (``in``, before TP partitioning).
        output_size: full output width (``out``, before TP partitioning).
        parallel_mode: ``"column"`` (out split over expert-TP) or ``"row"`` (in split).
        config: megatron TransformerConfig (``params_dtype``, ``use_cpu_initialization``,
            ``perform_initialization``, ``expert_model_parallel_size``, ...).
        init_method: in-place initialiser for a full [out, in] weight.
        bias: create ``bias{i}`` [out_partition] per expert (zero-initialised).
        skip_bias_add: return the biases instead of adding them (``forward`` then returns
            ``(out, [bias0, ..., bias{G-1}])``, which ``TEGroupedMLP._apply_bias`` scales by the
            router probabilities); otherwise they are added inside and ``None`` is returned.
        is_expert: must be True (grouped linears only exist for experts, as in TE's wrapper).
        tp_comm_buffer_name, name: accepted for protocol compatibility; unused.
        pg_collection: process groups (``expt_tp``, ``ep``, ``expt_dp``); megatron's mpu groups
            when None.

    Parameters: ``weight{i}`` [out_p, in_p] and optionally ``bias{i}`` [out_p], where out_p / in_p
    are the widths after expert-TP partitioning.

    Raises:
        ValueError: for an unsupported configuration (non-expert use, FP4, an fp8 recipe without
            current scaling, fused gradient accumulation, single grouped weight/bias
            parameters).
    """

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str,
        config: TransformerConfig,
        init_method: Callable[[torch.Tensor], None],
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        name: Optional[str] = None,
    ):
        super().__init__()
        if parallel_mode not in ("column", "row"):
            raise ValueError(f"parallel_mode must be 'column' or 'row', got {parallel_mode!r}")
        if not is_expert:
            raise ValueError("TorchGroupedLinear only supports experts (is_expert=True)")
        if num_gemms < 1:
            raise ValueError(f"num_gemms must be >= 1, got {num_gemms}")
        unsupported = [
            flag
            for flag in (
                "fp4",
                "gradient_accumulation_fusion",
                "overlap_dispatch_backward_with_experts_wgrad",
                "moe_single_grouped_weight",
                "moe_single_grouped_bias",
            )
            if getattr(config, flag, None)
        ]
        if unsupported:
            raise ValueError(f"TorchGroupedLinear does not support config flags {unsupported}")
        if (
            getattr(config, "fp8", None)
            and config.fp8_recipe not in toy_fp8.CURRENT_SCALING_RECIPES
        ):
            raise ValueError(
                f"TorchGroupedLinear: fp8 recipe {config.fp8_recipe!r} is not modelled "
                f"(current scaling only: {toy_fp8.CURRENT_SCALING_RECIPES})"
            )
        # Megatron's TEGroupedLinear wrapper state (see the module docstring).
        self.is_first_microbatch = True
        self.disable_parameter_transpose_cache = config.disable_parameter_transpose_cache
        self._fp8_weight_cache: Optional[list] = None  # TE's _fp8_workspaces
        self.fp8_quantizations = 0  # forwards that cast the weights (not served from the cache)
        # TE's attribute, which megatron sets (set_save_original_input) where the experts' inputs
        # are offloaded or recomputed; this module always saves its original input.
        self.save_original_input = False

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self._pg_collection = pg_collection
        self._tp_group = pg_collection.expt_tp
        tp_size, tp_rank = get_pg_size(self._tp_group), get_pg_rank(self._tp_group)

        self.config = config
        self.parallel_mode = parallel_mode
        self.num_gemms = num_gemms
        # TE's attribute names, which megatron code reads on grouped linears.
        self.in_features = divide(input_size, tp_size) if parallel_mode == "row" else input_size
        self.out_features = (
            divide(output_size, tp_size) if parallel_mode == "column" else output_size
        )
        self.use_bias = bias
        self.te_return_bias = bias and skip_bias_add
        self.delay_wgrad_compute = bool(getattr(config, "delay_wgrad_compute", False))
        self.wgrad_store = WeightGradStore(self.delay_wgrad_compute)
        self.wgrad_accumulation_and_reduce_hooks: list = []
        partition_dim = 0 if parallel_mode == "column" else 1
        device = None if config.use_cpu_initialization else torch.cuda.current_device()

        for i in range(num_gemms):
            weight = torch.nn.Parameter(
                torch.empty(
                    self.out_features, self.in_features, dtype=config.params_dtype, device=device
                )
            )
            if not config.perform_initialization:
                set_tensor_model_parallel_attributes(weight, True, partition_dim, 1)
            elif config.use_cpu_initialization:
                _initialize_affine_weight_cpu(
                    weight,
                    output_size,
                    input_size,
                    self.out_features if parallel_mode == "column" else self.in_features,
                    partition_dim,
                    init_method,
                    params_dtype=config.params_dtype,
                    rank=tp_rank,
                    world_size=tp_size,
                )
            else:
                _initialize_affine_weight_gpu(weight, init_method, partition_dim, is_expert=True)
            if getattr(config, "fp8", None) and getattr(config, "fp8_param", False):
                quantized = toy_fp8.ToyQuantizer(config.fp8_recipe).quantize(
                    weight.data, requires_grad=True
                )
                for attr, value in vars(weight).items():  # megatron's TP attributes
                    setattr(quantized, attr, value)
                weight = torch.nn.Parameter(quantized)
            self.register_parameter(f"weight{i}", weight)
            if bias:
                bias_param = torch.nn.Parameter(
                    torch.zeros(self.out_features, dtype=config.params_dtype, device=device)
                )
                self.register_parameter(f"bias{i}", bias_param)
        mark_expert_parameters(self, config, parallel_mode)
        if self.delay_wgrad_compute:  # TE: DDP's hook goes to the module, run by backward_dw
            for param in self.parameters():
                param.skip_backward_post_hook = True

    def weights(self) -> list[torch.Tensor]:
        """The G expert weights, each [out_p, in_p]."""
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def biases(self) -> Optional[list[torch.Tensor]]:
        """The G expert biases, each [out_p], or None without bias."""
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else None

    def forward(
        self, x: torch.Tensor, tokens_per_expert: list[int]
    ) -> tuple[torch.Tensor, Optional[list[torch.Tensor]]]:
        """Apply expert i's linear to the i-th chunk of rows.

        Args:
            x: [T, in_p] (or [..., in_p]) tokens sorted by local expert.
            tokens_per_expert: G ints summing to T, rows of each expert in order.

        Returns:
            (out [T, out_p] (leading dims as x), biases): biases is the list of G [out_p] bias
            parameters when ``skip_bias_add`` and bias, else None (added inside or absent).
        """
        tokens_per_expert = [int(n) for n in tokens_per_expert]
        if len(tokens_per_expert) != self.num_gemms:
            raise ValueError(
                f"tokens_per_expert has {len(tokens_per_expert)} entries, expected {self.num_gemms}"
            )
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has width {x.shape[-1]}, expected {self.in_features}")
        recipe = (
            getattr(self.config, "fp8_recipe", None) if getattr(self.config, "fp8", None) else None
        )
        if recipe is not None:  # TE's fp8 grouped GEMM takes row counts of the alignment only
            align = toy_fp8.align_size(getattr(recipe, "value", recipe))
            if any(n % align for n in tokens_per_expert):
                raise ValueError(
                    f"fp8 grouped GEMM: rows per expert {tokens_per_expert} are not multiples "
                    f"of {align} (the caller must pad them, as megatron's Fp8Padding does)"
                )
        rows = x.reshape(-1, self.in_features)
        biases = self.biases()
        is_first_microbatch = (
            None if self.disable_parameter_transpose_cache else self.is_first_microbatch
        )
        self.is_first_microbatch = False
        added = None if self.te_return_bias else biases
        delayed = self.wgrad_store.delay_wgrad_compute()
        if recipe is None and delayed:
            out = DelayedWgradGroupedLinear.apply(
                rows,
                self.wgrad_store,
                tokens_per_expert,
                self.num_gemms,
                *self.weights(),
                *(added or ()),
            )
        elif recipe is None:
            out = grouped_matmul(rows, self.weights(), tokens_per_expert, added)
        else:
            fp8_recipe = te_grouped_fp8.Fp8Recipe.of_config(self.config)
            out = te_grouped_fp8.fp8_grouped_linear(
                rows,
                tokens_per_expert,
                self.weights(),
                self._fp8_weight_operands(is_first_microbatch, fp8_recipe),
                fp8_recipe,
                self.wgrad_store if delayed else None,
            )
            if added is not None:
                out = out + torch.cat([b.expand(n, -1) for b, n in zip(added, tokens_per_expert)])
        return out.view(*x.shape[:-1], self.out_features), (biases if self.te_return_bias else None)

    def _fp8_weight_operands(
        self, is_first_microbatch: Optional[bool], recipe: "te_grouped_fp8.Fp8Recipe"
    ) -> list["te_grouped_fp8.WeightOperand"]:
        """What the fp8 GEMMs compute with: quantized parameters as they are, or the casts of the
        high-precision weights (TE's caching contract, module docstring)."""
        weights = self.weights()
        if isinstance(weights[0], toy_fp8.ToyQuantizedTensor):
            return [te_grouped_fp8.WeightOperand.of_quantized_parameter(w) for w in weights]
        if is_first_microbatch is False and self._fp8_weight_cache is not None:
            return self._fp8_weight_cache
        casts = [te_grouped_fp8.WeightOperand.of_cast(w, recipe) for w in weights]
        self.fp8_quantizations += 1
        self._fp8_weight_cache = casts if is_first_microbatch is not None else None
        return casts

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        """TE's: ``hook`` runs at the end of every :meth:`backward_dw` (megatron's DDP registers its
        gradient hook here for parameters marked ``skip_backward_post_hook``)."""
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self) -> bool:
        return self.wgrad_store.delay_wgrad_compute()

    def _trigger_wgrad_accumulation_and_reduce_hooks(self) -> None:
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    def backward_dw(self) -> None:
        """The oldest delayed weight-gradient computation (module docstring); nothing without
        delayed weight gradients (autograd computed them in the backward) or with none stashed."""
        if not self.need_backward_dw() or self.wgrad_store.context.empty():
            return
        (weight_grads, bias_grads), _ = self.wgrad_store.pop()
        for weight, grad in zip(self.weights(), weight_grads):
            weight.grad = grad.to(weight.dtype)
        for bias, grad in zip(self.biases() or (), bias_grads):
            if bias.grad is None and grad is not None:
                bias.grad = grad.to(bias.dtype)
        self._trigger_wgrad_accumulation_and_reduce_hooks()

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> dict:
        """Per-expert ShardedTensors keyed like TE's grouped wrapper (``{prefix}weight{i}``).

        Local expert i is global expert ``ep_rank * G + i`` along a new leading expert axis, with
        TP sharding on dim 0 (column: weight and bias) or dim 1 (row: weight only), so the
        checkpoint keys and layouts match ``SequentialMLP``'s.
        """
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton_local_shards = metadata.get("singleton_local_shards", False)
        ep_group = self._pg_collection.ep
        num_global_experts = get_pg_size(ep_group) * self.num_gemms
        first_global_expert = get_pg_rank(ep_group) * self.num_gemms
        tp_axis = {"weight": 0 if self.parallel_mode == "column" else 1}
        if self.parallel_mode == "column":
            tp_axis["bias"] = 0
        sharded = {}
        for i in range(self.num_gemms):
            global_expert = first_global_expert + i
            local = {f"{i}.weight": getattr(self, f"weight{i}")}
            if self.use_bias:
                local[f"{i}.bias"] = getattr(self, f"bias{i}")
            if singleton_local_shards:
                expert_prefix, offsets = f"{global_expert}.{prefix}", sharded_offsets
            else:
                expert_prefix = prefix
                offsets = (
                    *sharded_offsets,
                    (len(sharded_offsets), global_expert, num_global_experts),
                )
            sub = make_sharded_tensors_for_checkpoint(
                local,
                "",
                {f"{i}.{k}": axis for k, axis in tp_axis.items()},
                offsets,
                tp_group=self._tp_group,
                dp_cp_group=metadata["dp_cp_group"],
            )
            replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
            for kind in ("weight", "bias") if self.use_bias else ("weight",):
                sharded[f"{prefix}{kind}{i}"] = sub[f"{i}.{kind}"]
        # Replicas of an expert live across expert-DP, not DP.
        edp_rank = get_pg_rank(self._pg_collection.expt_dp)
        for tensor in sharded.values():
            tensor.replica_id = (*tensor.replica_id[:2], edp_rank)
        return sharded


class TorchColumnGroupedLinear(TorchGroupedLinear):
    """``linear_fc1`` builder: column-parallel (out split over expert-TP); TorchGroupedLinear."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, **kwargs):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", **kwargs)


def mark_expert_parameters(
    module: TorchGroupedLinear, config: TransformerConfig, parallel_mode: str
) -> None:
    """The attributes megatron's DDP / optimizer / grad-norm read on a grouped linear's
    parameters (``weight{i}`` already carry the TP attributes of their initialisation), as the
    installed megatron-core's ``TEGroupedLinear`` leaves them."""
    if not compat.is_018():
        from megatron.core.extensions.transformer_engine import _set_expert_parameter_attributes

        for i in range(module.num_gemms) if module.use_bias and parallel_mode == "row" else ():
            getattr(module, f"bias{i}").sequence_parallel = False
        # Expert params go to the expert-DP grad buckets when EP > 1 or expert TP differs from TP.
        use_expert_pgs = (
            config.expert_model_parallel_size > 1
            or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        _set_expert_parameter_attributes(module, parallel_mode, use_expert_pgs)
        return
    # 0.18: megatron hands TE no parallel mode when it communicates expert TP / EP itself.
    expert_parallel = config.expert_model_parallel_size > 1
    explicit_expert_comm = get_pg_size(module._tp_group) > 1 or expert_parallel
    te_mode = None if explicit_expert_comm else parallel_mode
    for i in range(module.num_gemms) if module.use_bias else ():
        bias = getattr(module, f"bias{i}")
        if te_mode == "row":
            bias.sequence_parallel = config.sequence_parallel
        elif te_mode == "column":
            set_tensor_model_parallel_attributes(bias, True, 0, 1)
    for param in module.parameters(recurse=False):
        param.allreduce = not expert_parallel
    if explicit_expert_comm:
        for i in range(module.num_gemms):
            weight = getattr(module, f"weight{i}")
            weight.partition_dim = 0 if parallel_mode == "column" else 1
            weight.partition_stride = 1


class TorchRowGroupedLinear(TorchGroupedLinear):
    """``linear_fc2`` builder: row-parallel (in split over expert-TP); see TorchGroupedLinear."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, **kwargs):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", **kwargs)


def grouped_mlp_submodules() -> GroupedMLPSubmodules:
    """``TEGroupedMLP`` submodules with the torch grouped linears (activation from the config)."""
    return GroupedMLPSubmodules(
        linear_fc1=TorchColumnGroupedLinear, linear_fc2=TorchRowGroupedLinear
    )


def grouped_experts_builder() -> Callable[..., TEGroupedMLP]:
    """``MoESubmodules.experts`` builder: ``TEGroupedMLP`` over the torch grouped linears."""
    return functools.partial(TEGroupedMLP, submodules=grouped_mlp_submodules())


def grouped_moe_layer_spec() -> Callable[..., MoELayer]:
    """``partial(MoELayer, submodules=...)`` like ``get_moe_module_spec(use_te=False)`` but with
    grouped experts (shared experts, if configured, use megatron's local linears)."""
    local = LocalSpecProvider()
    shared_mlp = MLPSubmodules(
        linear_fc1=local.column_parallel_linear(),
        linear_fc2=local.row_parallel_linear(),
        activation_func=local.activation_func(),
    )
    if compat.is_018():  # 0.18's get_moe_module_spec builds SharedExpertMLP directly
        from megatron.core.transformer.moe.shared_experts import SharedExpertMLP as shared_experts
    else:
        from megatron.core.models.gpt.moe_module_specs import (
            _build_shared_experts as shared_experts,
        )
    return functools.partial(
        MoELayer,
        submodules=MoESubmodules(
            experts=grouped_experts_builder(),
            shared_experts=functools.partial(shared_experts, submodules=shared_mlp),
        ),
    )
