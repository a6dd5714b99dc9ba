"""What the gradient-dump worker (``pretrain_grad_dump.py``) reads of megatron's model and DDP:
layout-independent parameter names (decoder layers by their global number, routed experts by their
global index, wrapper prefixes dropped), the reduced gradients a rank holds, the routers' expert
biases, and DDP's own order of gradient readiness (:class:`GradReadyOrder`). Imported by the worker
from its folder (on its ``sys.path`` as a script's)."""

import re

import torch


def global_parameter_names(model_chunks) -> dict[tuple[int, str], str]:
    """{(chunk index, parameter name): global name}: ``decoder.layers.<global layer - 1>``,
    ``local_experts.<global expert>``, no ``module.`` wrapper prefixes."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    names = {}
    for c, chunk in enumerate(model_chunks):
        layer_renames, expert_renames = [], []
        for name, module in chunk.named_modules():
            if isinstance(module, TransformerLayer) and not module.is_mtp_layer:
                layer_renames.append((f"{name}.", f"decoder.layers.{module.layer_number - 1}."))
            if isinstance(module, BaseMoELayer):
                expert_renames += [
                    (f"{name}.experts.local_experts.{j}.", f"{name}.experts.local_experts.{e}.")
                    for j, e in enumerate(module.local_expert_indices)
                ]
        for name, _ in chunk.named_parameters():
            new = name
            for renames in (expert_renames, layer_renames):  # expert index, then layer prefix
                for prefix, replacement in renames:
                    if new.startswith(prefix):
                        new = replacement + new[len(prefix) :]
                        break
            names[(c, name)] = re.sub(r"^(module\.)+", "", new)
    return names


def reduced_gradients(model_chunks, names) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{global name: (main_grad, owned)} after a step: ``owned`` [same shape, bool] marks the
    elements whose reduced value this rank holds. Without the distributed optimizer that is every
    element; with it, the elements in this rank's shard of each gradient bucket (the rest of its
    buffer holds local sums), so the ranks' dumps together give every reduced gradient."""
    out = {}
    for c, chunk in enumerate(model_chunks):
        param_names = {id(p): names[(c, name)] for name, p in chunk.named_parameters()}
        groups = [
            *getattr(chunk, "bucket_groups", []),
            *getattr(chunk, "expert_parallel_bucket_groups", []),
        ]
        sharded = bool(groups) and groups[0].ddp_config.use_distributed_optimizer
        for group in groups:
            # Without the distributed optimizer every rank holds whole reduced buckets.
            shards, rank = (
                (
                    group.intra_distributed_optimizer_instance_size,
                    group.intra_distributed_optimizer_instance_rank,
                )
                if sharded
                else (1, 0)
            )
            for bucket in group.buckets:
                shard = bucket.grad_data.numel() // shards
                for param in bucket.params_list:
                    grad = param.main_grad.detach()
                    start = (grad.data_ptr() - bucket.grad_data.data_ptr()) // grad.element_size()
                    index = torch.arange(start, start + grad.numel()).view(grad.shape)
                    owned = (index >= rank * shard) & (index < (rank + 1) * shard)
                    out[param_names[id(param)]] = (grad.clone(), owned)
    return out


def set_expert_bias(model_chunks, values) -> None:
    """Every router's ``expert_bias`` buffer := ``values`` [E]."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
    assert routers and all(r.expert_bias is not None for r in routers), (
        "--moe-router-enable-expert-bias"
    )
    with torch.no_grad():
        for router in routers:
            router.expert_bias.copy_(torch.tensor(values))


def expert_biases(model_chunks, names) -> dict:
    """{global router name: expert bias} of ``model_chunks`` (routers with an expert bias)."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = {}
    for c, chunk in enumerate(model_chunks):
        for name, module in chunk.named_modules():
            if isinstance(module, TopKRouter) and module.expert_bias is not None:
                out[names[(c, f"{name}.weight")].rsplit(".", 1)[0]] = (
                    module.expert_bias.detach().clone()
                )
    return out


class GradReadyOrder:
    """Megatron DDP's view of the backward, recorded per iteration: every call of
    ``_ParamAndGradBucketGroup.register_grad_ready`` (DDP's backward post-hook of a parameter calls
    it in every microbatch, once the parameter's gradient is accumulated; it counts only in the
    last microbatch, where a bucket group whose every parameter is ready starts its gradient
    collective) and every collective it starts.

    ``result()``: ``{"events": {iteration: [event]}, "buckets": [bucket group], "plans":
    {iteration: [(layer, replicated experts)]}}``. An event is ``("ready", family, group, name,
    last_microbatch)`` or ``("sync", family, group)``; ``family`` is ``"dense"`` (DDP's
    ``bucket_groups``, reduced over the data-parallel group) or ``"expert"``
    (``expert_parallel_bucket_groups``, over the expert-data-parallel group), ``group`` the bucket
    group's index there, ``name`` the parameter's name in its model chunk (``chunk index/name``: the
    same expert on every rank of an expert-data-parallel group). A bucket group is ``{"family",
    "index", "ranks": the global ranks its collectives run over, "buckets": [[parameter name]]}``.
    """

    def __init__(self):
        self.names = {}  # id(parameter) -> name
        self.groups = {}  # id(bucket group) -> (family, index)
        self.buckets = []
        self.events = {}
        self.plans = {}
        self.iteration = None

    def install(self) -> None:
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

        original = _ParamAndGradBucketGroup.register_grad_ready
        recorder = self

        def register_grad_ready(group, param, force_all_reduce=False):
            started = group.grad_reduce_handle is not None
            result = original(group, param, force_all_reduce)
            events = recorder.events.setdefault(recorder.iteration, [])
            family, index = recorder.groups[id(group)]
            events.append(
                ("ready", family, index, recorder.names[id(param)], bool(group.is_last_microbatch))
            )
            if not started and group.grad_reduce_handle is not None:
                events.append(("sync", family, index))
            return result

        _ParamAndGradBucketGroup.register_grad_ready = register_grad_ready

    def begin(self, iteration: int, model_chunks) -> None:
        self.iteration = iteration
        if self.names:
            return
        import torch.distributed as dist

        for c, chunk in enumerate(model_chunks):
            self.names.update({id(p): f"{c}/{name}" for name, p in chunk.named_parameters()})
            for family, groups in (
                ("dense", chunk.bucket_groups),
                ("expert", chunk.expert_parallel_bucket_groups),
            ):
                for group in groups:
                    self.groups[id(group)] = (
                        family,
                        len([b for b in self.buckets if b["family"] == family]),
                    )
                    self.buckets.append(
                        {
                            "family": family,
                            "index": self.groups[id(group)][1],
                            "ranks": dist.get_process_group_ranks(
                                group.intra_distributed_optimizer_instance_group
                            ),
                            "buckets": [
                                [self.names[id(p)] for p in bucket.params_list]
                                for bucket in group.buckets
                            ],
                        }
                    )

    def on_plan(self, layer_number: int, slot_expert) -> None:
        experts = sorted(int(e) for e in slot_expert.reshape(-1).tolist() if e >= 0)
        self.plans.setdefault(self.iteration, []).append((layer_number, experts))

    def result(self) -> dict:
        return {"events": self.events, "buckets": self.buckets, "plans": self.plans}
