"""DeepSeek-V3 (671B, 37B active) on 1024 H100s, BF16: NVIDIA's perf recipe from
Megatron-Bridge 0.6.2 with real routing and UltraEP.

NVIDIA's ``deepseek_v3_pretrain_1024gpu_h100_bf16_config``
(``megatron.bridge.perf_recipes.deepseek.h100.deepseek_v3``), unchanged except
``cfg.model.moe_router_force_load_balancing = False`` (the perf recipe force-balances its routing
to publish its numbers) and ``enable_ultraep(cfg, **KNOBS)``.
TP2 PP8 VPP4 EP64 on 128 HGX nodes of 8: an EP group spans 8 nodes, so replicas stay inside a
node's NVLink (``domain_size=8``: every 8 consecutive EP ranks are one node), expert-DP 2. The
Hugging Face config the recipe reads comes from ``hf_configs/`` beside this file (published
values), offline.

Check it here (no GPU): ULTRAEP_BRIDGE=1: ultraep check-recipe recipes/bridge/deepseek_v3_h100.py
Run it on the cluster:  torchrun --nnodes 128 --nproc-per-node 8 ... recipes/bridge/deepseek_v3_h100.py
"""

from pathlib import Path

from ultraep_megatron.megatron.bridge import recipes

recipes.use_local_hf_configs(Path(__file__).resolve().parent / "hf_configs")

#: NVIDIA's perf recipe function: (module, name).
PERF_RECIPE = (
    "megatron.bridge.perf_recipes.deepseek.h100.deepseek_v3",
    "deepseek_v3_pretrain_1024gpu_h100_bf16_config",
)
#: The cluster the perf recipe is sized for: its GPUs and GPUs per node (ultraep check-recipe).
NUM_GPUS, GPUS_PER_NODE = 1024, 8
#: enable_ultraep's knobs (the --moe-balancer-* flags' names).
KNOBS = dict(num_slots=2, hardware="h100-hgx", domain_size=8)


def build():
    """(ConfigContainer, callbacks for Bridge's pretrain, the changes: ``field: old -> new``)."""
    cfg = recipes.perf_recipe(*PERF_RECIPE)()
    callbacks, changes = recipes.real_routing(cfg, **KNOBS)
    return cfg, callbacks, changes


def config():
    """The ConfigContainer; prints what changed from NVIDIA's recipe, one line each."""
    cfg, _, changes = build()
    print("\n".join(changes))
    return cfg


if __name__ == "__main__":
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    cfg, callbacks, changes = build()
    print("\n".join(changes))
    pretrain(cfg, forward_step, callbacks=callbacks)
