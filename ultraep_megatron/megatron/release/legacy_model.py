"""The GPT model of megatron-core 0.18's training API: a model provider (0.18 only; see :mod:`.compat`).

megatron-core 0.18's ``pretrain`` builds the model by calling a *model provider* per (virtual)
pipeline stage, and its wheel ships no GPT builder: Megatron-LM's checkout does
(``gpt_builders.gpt_builder`` and ``model_provider.model_provider`` of tag ``core_v0.18.x``).
:class:`GPTModelProvider` builds the same ``GPTModel`` from the same arguments, with the two
attributes of 0.19's ``GPTModelConfig`` that the integration sets, so ``pretrain_gpt.py`` (and the
patch for a 0.18 checkout), ``layer_spec.balance_moe_layers`` and ``telemetry.install`` treat both
releases alike:

* ``transformer_layer_spec``: ``None`` (Megatron's default spec, :func:`default_layer_spec`) or a
  callable ``(provider, vp_stage) -> spec``;
* ``post_wrap_hooks``: ``hook(model_chunks) -> model_chunks``, each run on every model chunk as it
  is built (0.19 runs them once on all chunks after wrapping: the integration's hooks only look at
  the modules inside).

Left out: what Megatron-LM's ``model_provider`` adds around the builder (ModelOpt's builder,
``--record-memory-history``); the 0.18 patch keeps that ``model_provider`` around this builder.
"""

from __future__ import annotations

from typing import Any, Callable, Optional


def _te_or_local_layer_spec(config: Any):
    """One transformer layer's spec (gpt_builders._get_transformer_layer_spec of 0.18)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_inference_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if config.transformer_impl == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec(
            config.num_moe_experts,
            config.moe_grouped_gemm,
            config.qk_layernorm,
            config.multi_latent_attention,
            config.experimental_attention_variant,
            qk_l2_norm=config.qk_l2_norm,
            use_kitchen=config.use_kitchen,
            use_te_activation_func=config.use_te_activation_func,
            use_kitchen_attention=config.use_kitchen_attention,
            kitchen_attention_backend=config.kitchen_attention_backend,
            mla_down_proj_fusion=getattr(config, "mla_down_proj_fusion", False),
            use_grouped_gemm_for_dense_mlp=config.use_grouped_gemm_for_dense_mlp,
        )
    if config.transformer_impl == "inference_optimized":
        return get_gpt_layer_with_inference_spec(
            config.qk_layernorm, config.multi_latent_attention, qk_l2_norm=config.qk_l2_norm
        )
    return get_gpt_layer_local_spec(
        config.num_moe_experts,
        config.moe_grouped_gemm,
        config.qk_layernorm,
        config.multi_latent_attention,
        config.experimental_attention_variant,
        normalization=config.normalization,
        use_kitchen=config.use_kitchen,
        use_kitchen_attention=config.use_kitchen_attention,
        kitchen_attention_backend=config.kitchen_attention_backend,
    )


def default_layer_spec(provider: "GPTModelProvider", vp_stage: Optional[int]):
    """Megatron's default decoder spec for ``provider``'s arguments (gpt_builders.gpt_builder of
    0.18 without ``--spec``): the MoE block spec for an MoE model, else one layer's spec."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import (
        get_gpt_heterogeneous_layer_spec,
    )

    args, config = provider.args, provider.transformer
    use_te = args.transformer_impl == "transformer_engine"
    if args.experimental_attention_variant is not None:
        return get_transformer_block_with_experimental_attention_variant_spec(
            config=config, vp_stage=vp_stage
        )
    if args.num_experts:
        return get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=use_te,
            normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm,
            vp_stage=vp_stage,
        )
    if args.heterogeneous_layers_config_path is not None:
        return get_gpt_heterogeneous_layer_spec(config, use_te)
    return _te_or_local_layer_spec(config)


def mtp_block_spec(
    provider: "GPTModelProvider", transformer_layer_spec: Any, vp_stage: Optional[int] = None
):
    """The multi-token-prediction block's spec (``None`` without ``--mtp-num-layers``), as 0.18's
    gpt_builder makes it: from the last decoder layer's spec of Megatron's default specs."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_layer_specs,
        get_gpt_mtp_block_spec,
    )

    args, config = provider.args, provider.transformer
    if args.mtp_num_layers is None:
        return None
    use_te = args.transformer_impl == "transformer_engine"
    if (
        hasattr(transformer_layer_spec, "layer_specs")
        and len(transformer_layer_spec.layer_specs) == 0
    ):
        # A last pipeline stage without decoder layers (a block spec): one layer's spec.
        layer_spec = _te_or_local_layer_spec(config)
    else:
        layer_spec = get_gpt_decoder_layer_specs(
            config,
            use_transformer_engine=use_te,
            normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm,
            vp_stage=vp_stage,
        )[-1]
    return get_gpt_mtp_block_spec(
        config, layer_spec, use_transformer_engine=use_te, vp_stage=vp_stage
    )


class GPTModelProvider:
    """megatron-core 0.18's model provider for a GPT model: ``pretrain``'s ``model_provider``
    itself (this repository's ``pretrain_gpt.py``), or, in a Megatron-LM 0.18 checkout's
    ``pretrain_gpt.py``, its builder: ``partial(model_provider, provider.gpt_builder)``.

    Args:
        args: Megatron's parsed arguments.
        builder: the checkout's ``gpt_builders.gpt_builder``, which builds the model when no
            ``transformer_layer_spec`` is set (``--moe-balancer none``: the checkout's model,
            unchanged); ``None``: this module's equivalent of it.
    """

    def __init__(self, args: Any, builder: Optional[Callable] = None):
        self.args = args
        self.builder = builder
        self.transformer_layer_spec: Optional[Callable] = None
        self.post_wrap_hooks: list[Callable] = []
        self.transformer = None  # the TransformerConfig of the latest stage built

    def __call__(
        self,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: Optional[int] = None,
        config: Any = None,
        pg_collection: Any = None,
    ):
        from megatron.training import get_args

        return self.gpt_builder(
            get_args(),
            pre_process,
            post_process,
            vp_stage,
            config=config,
            pg_collection=pg_collection,
        )

    def gpt_builder(
        self,
        args: Any,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: Optional[int] = None,
        config: Any = None,
        pg_collection: Any = None,
    ):
        """One (virtual) pipeline stage of the model, with ``gpt_builders.gpt_builder``'s signature;
        the ``post_wrap_hooks`` run on it."""
        self.args = args  # after Megatron's initialization: the arguments it validated
        if self.builder is not None and self.transformer_layer_spec is None:
            model = self.builder(
                args,
                pre_process,
                post_process,
                vp_stage,
                config=config,
                pg_collection=pg_collection,
            )
        else:
            model = self._build(pre_process, post_process, vp_stage, config, pg_collection)
        chunks = [model]
        for hook in self.post_wrap_hooks:
            chunks = hook(chunks)
        return chunks[0]

    def _build(self, pre_process, post_process, vp_stage, config, pg_collection):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.spec_utils import import_module
        from megatron.training import print_rank_0
        from megatron.training.arguments import core_transformer_config_from_args

        print_rank_0("building GPT model ...")
        args = self.args
        if config is None and args.yaml_cfg is not None:
            from megatron.training.yaml_arguments import core_transformer_config_from_yaml

            config = core_transformer_config_from_yaml(args, "language_model")
        self.transformer = config if config is not None else core_transformer_config_from_args(args)
        if self.transformer_layer_spec is not None:
            layer_spec = self.transformer_layer_spec(self, vp_stage=vp_stage)
        elif args.spec is not None:
            layer_spec = import_module(args.spec)
        else:
            layer_spec = default_layer_spec(self, vp_stage)
        return GPTModel(
            config=self.transformer,
            transformer_layer_spec=layer_spec,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            rope_scaling=args.use_rope_scaling,
            # The module's attribute at call time: layer_spec.balance_moe_layers may have wrapped it.
            mtp_block_spec=mtp_block_spec(self, layer_spec, vp_stage=vp_stage),
            vp_stage=vp_stage,
            pg_collection=pg_collection,
        )
