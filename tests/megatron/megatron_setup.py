"""megatron's config and parallel state for the layer-level tests and their workers, built one way.

``moe_config`` makes the ``TransformerConfig`` of a small MoE layer on the CPU (megatron's fused
CUDA paths off); ``model_parallel`` makes megatron's groups for an EP size, once per process. The
workers' shared helpers: the weights (``moe_weights``) and tokens (``moe_inputs``) of a seed, and
loading weights into a layer (``load_moe_weights``).
"""

#: What every CPU layer test sets: no aux loss (it would change gradients between layouts), no bias,
#: parameters made on the CPU, and megatron's fused CUDA paths (bias-dropout fusion, gradient
#: accumulation into main_grad by the fused wgrad kernel) off.
CPU_FIELDS = dict(
    num_attention_heads=4,
    moe_aux_loss_coeff=0.0,
    add_bias_linear=False,
    use_cpu_initialization=True,
    bias_dropout_fusion=False,
    gradient_accumulation_fusion=False,
)


def moe_config(
    *,
    hidden: int,
    ffn: int,
    experts: int,
    topk: int,
    ep: int = 1,
    num_layers: int = 1,
    dispatcher: str = "alltoall",
    **fields,
):
    """A ``TransformerConfig`` for ``num_layers`` MoE layers of ``experts`` experts of hidden size
    ``hidden`` and expert FFN size ``ffn`` (also the dense FFN size unless ``ffn_hidden_size`` is
    given), top-``topk`` routing, EP size ``ep``, megatron's ``dispatcher``; ``fields`` override
    :data:`CPU_FIELDS` or set any other field."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {**CPU_FIELDS, "ffn_hidden_size": ffn, **fields}
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        moe_ffn_hidden_size=ffn,
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=ep,
        **fields,
    )


def model_parallel(ep: int = 1, seed: int = 123) -> None:
    """megatron's groups for EP size ``ep`` (tensor and pipeline 1), made again only when the EP
    size changes: groups are never freed and each holds gloo threads, so re-creating them for each
    of a worker's layers made every build slower than the last. Seeds megatron's RNG tracker with
    ``seed`` on every call."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if (
        not parallel_state.model_parallel_is_initialized()
        or parallel_state.get_expert_model_parallel_world_size() != ep
    ):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(seed)


def moe_weights(experts: int, hidden: int, ffn: int, seed: int) -> dict:
    """A small MoE layer's weights from ``seed``, identical on every rank. Shapes: router [E, H],
    fc1 [E, F, H], fc2 [E, H, F] (scaled as a linear's initialization)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(experts, hidden, generator=gen) * 0.5,
        "fc1": torch.randn(experts, ffn, hidden, generator=gen) * hidden**-0.5,
        "fc2": torch.randn(experts, hidden, ffn, generator=gen) * ffn**-0.5,
    }


def moe_inputs(seed: int, seq: int, batch: int, hidden: int) -> tuple:
    """Tokens and their upstream gradient, both [seq, batch, hidden], from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, batch, hidden, generator=gen)
    return x, torch.randn(seq, batch, hidden, generator=gen)


def load_moe_weights(layer, weights: dict, expert_order=None) -> list:
    """Copy :func:`moe_weights`' ``weights`` into ``layer`` (router and local experts): local expert
    i gets global expert ``expert_order[local_expert_indices[i]]`` (by default its own). Returns
    those global expert ids."""
    import torch

    loaded = []
    with torch.no_grad():
        layer.router.weight.copy_(weights["router"])
        for local, expert_index in enumerate(layer.local_expert_indices):
            source = expert_index if expert_order is None else expert_order[expert_index]
            fc1, fc2 = expert_linears(layer, local)
            fc1.copy_(weights["fc1"][source])
            fc2.copy_(weights["fc2"][source])
            loaded.append(source)
    return loaded


def expert_linears(layer, local: int) -> tuple:
    """(fc1, fc2) weights of ``layer``'s local expert ``local``, for ``SequentialMLP`` or
    ``TEGroupedMLP`` experts."""
    experts = layer.experts
    if hasattr(experts, "local_experts"):
        mlp = experts.local_experts[local]
        return mlp.linear_fc1.weight, mlp.linear_fc2.weight
    return getattr(experts.linear_fc1, f"weight{local}"), getattr(
        experts.linear_fc2, f"weight{local}"
    )
