"""DeepSeek-V3 (671B, 37B active) on 256 GB200s, BF16: NVIDIA's perf recipe from
Megatron-Bridge 0.6.2 with real routing and UltraEP.

NVIDIA's ``deepseek_v3_pretrain_256gpu_gb200_bf16_config``
(``megatron.bridge.perf_recipes.deepseek.gb200.deepseek_v3``), unchanged except:
``cfg.model.moe_router_force_load_balancing = False`` (the perf recipe force-balances its routing
to publish its numbers); its CUDA graphs without the MoE preprocessing (``MODEL_OVERRIDES``:
enable_ultraep refuses capturing HybridEP's preprocessing); ``enable_ultraep(cfg, **KNOBS)``.
TP1 PP4 VPP4 EP64 on four GB200 NVL72 racks (64 GPUs in use each, 4 per node): every EP group is
one rack (NVLink), expert-DP 1. The Hugging Face config the recipe reads comes from
``hf_configs/`` beside this file (published values), offline.

Check it here (no GPU): ULTRAEP_BRIDGE=1: ultraep check-recipe recipes/bridge/deepseek_v3_gb200.py
Run it on the cluster:  torchrun --nnodes 64 --nproc-per-node 4 ... recipes/bridge/deepseek_v3_gb200.py
"""

from pathlib import Path

from ultraep_megatron.megatron.bridge import recipes

recipes.use_local_hf_configs(Path(__file__).resolve().parent / "hf_configs")

#: NVIDIA's perf recipe function: (module, name).
PERF_RECIPE = (
    "megatron.bridge.perf_recipes.deepseek.gb200.deepseek_v3",
    "deepseek_v3_pretrain_256gpu_gb200_bf16_config",
)
#: The cluster the perf recipe is sized for: its GPUs and GPUs per node (ultraep check-recipe).
NUM_GPUS, GPUS_PER_NODE = 256, 4
#: enable_ultraep's knobs (the --moe-balancer-* flags' names).
KNOBS = dict(num_slots=2, hardware="paper-rack")
#: The one setting of the perf recipe a balancer cannot run: its Transformer Engine CUDA graphs
#: capture the MoE preprocessing (``moe_preprocess``) of the flex dispatcher (HybridEP), which has
#: not been checked under capture with the balanced layer (enable_ultraep refuses it); the graphs
#: keep attention and the router.
MODEL_OVERRIDES = dict(cuda_graph_scope=["attn", "moe_router"])


def build():
    """(ConfigContainer, callbacks for Bridge's pretrain, the changes: ``field: old -> new``)."""
    cfg = recipes.perf_recipe(*PERF_RECIPE)()
    callbacks, changes = recipes.real_routing(cfg, model_overrides=MODEL_OVERRIDES, **KNOBS)
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
