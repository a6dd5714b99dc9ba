"""Run the code that a patch of patches/ adds to Megatron-LM's pretrain_gpt.py, in the context it
expects there, and print what it set up as JSON.

Megatron-LM's own file is not on this machine, so the patch's added lines are taken from the patch
itself: the import block, the ``extra_args_provider=`` expression given to Megatron's
``parse_and_validate_args``, and the block that configures the model: on 0.19 the lines after
``model_cfg = gpt_config_from_args(args)``; on 0.18 the lines before ``pretrain`` and the model
provider handed to it (``partial(model_provider, ...)``), with stand-ins for the checkout's
``model_provider`` and ``gpt_builder`` that do what theirs do (call the builder; build Megatron's
default GPT model).

    python patch_hook.py {0.19,0.18} PATCH [pretrain_gpt.py arguments]
"""

import functools
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

from ultraep_megatron.megatron.cpu import backend as cpu_backend
from ultraep_megatron.megatron.cpu.megatron_patches import skip_dataset_helper_build

cpu_backend.activate()
skip_dataset_helper_build()


def added_blocks(patch_text: str) -> list[str]:
    """The runs of consecutive added lines of the patch, without their '+'."""
    blocks, current = [], []
    for line in patch_text.splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            current.append(line[1:])
        elif current:
            blocks.append("\n".join(current))
            current = []
    if current:
        blocks.append("\n".join(current))
    return blocks


def one_rank() -> None:
    import torch
    from megatron.core import parallel_state

    init_file = Path(tempfile.mkdtemp(prefix="patch_hook_")) / "init"
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel()


def parse(namespace: dict, provider_arg: str, argv: list[str]):
    from megatron.training.arguments import parse_and_validate_args

    expression = textwrap.dedent(provider_arg).strip()
    assert expression.startswith("extra_args_provider=") and expression.endswith(","), expression
    provider = eval(expression[len("extra_args_provider=") : -1], namespace)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    sys.argv = ["pretrain_gpt.py", *argv]
    return parse_and_validate_args(
        extra_args_provider=provider, args_defaults={"tokenizer_type": "GPT2BPETokenizer"}
    )


def run_019(blocks: list[str], argv: list[str]) -> dict:
    imports, provider_arg, setup = blocks
    namespace = {
        "partial": functools.partial,
        "has_nvidia_modelopt": False,
        "add_modelopt_args": None,
    }
    exec(textwrap.dedent(imports), namespace)
    args = parse(namespace, provider_arg, argv)
    from megatron.training.argument_utils import gpt_config_from_args

    model_cfg = gpt_config_from_args(args)
    namespace.update(args=args, model_cfg=model_cfg)
    exec(textwrap.dedent(setup), namespace)
    # Build the layer spec as Megatron's GPT builder would, for a 1-rank job.
    one_rank()
    spec_fn = model_cfg.transformer_layer_spec
    if spec_fn is None:
        from megatron.training.models.gpt import default_layer_spec

        spec = default_layer_spec(model_cfg, None)
    else:
        spec = spec_fn(model_cfg, vp_stage=None)
    mlps = [layer.submodules.mlp for layer in spec.layer_specs]
    from megatron.training.models import gpt

    return {
        "moe_balancer": args.moe_balancer,
        "spec_replaced": spec_fn is not None,
        "mlp_classes": [getattr(m, "func", getattr(m, "module", m)).__name__ for m in mlps],
        "balancer_configs": [
            [m.keywords["balancing"].config.name, m.keywords["balancing"].config.num_slots]
            if "balancing" in getattr(m, "keywords", {})
            else None
            for m in mlps
        ],
        "mtp_spec_balanced": getattr(gpt.mtp_block_spec, "ultraep_balanced", False),
        "post_wrap_hooks": [h.__name__ for h in model_cfg.post_wrap_hooks],
    }


def run_018(blocks: list[str], argv: list[str]) -> dict:
    imports, provider_arg, setup, provider_line = blocks
    from ultraep_megatron.megatron.release import legacy_model

    checkout_builds = []

    def gpt_builder(
        args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None
    ):
        """The checkout's builder: Megatron's default GPT model (recorded)."""
        checkout_builds.append(vp_stage)
        return legacy_model.GPTModelProvider(args)._build(
            pre_process, post_process, vp_stage, config, pg_collection
        )

    def model_provider(
        model_builder,
        pre_process=True,
        post_process=True,
        vp_stage=None,
        config=None,
        pg_collection=None,
    ):
        """The checkout's model_provider: the builder, called with Megatron's arguments."""
        from megatron.training import get_args

        return model_builder(
            get_args(),
            pre_process,
            post_process,
            vp_stage,
            config=config,
            pg_collection=pg_collection,
        )

    namespace = {
        "partial": functools.partial,
        "has_nvidia_modelopt": False,
        "add_modelopt_args": None,
        "gpt_builder": gpt_builder,
        "model_provider": model_provider,
    }
    exec(textwrap.dedent(imports), namespace)
    args = parse(namespace, provider_arg, argv)
    namespace["args"] = args
    exec(textwrap.dedent(setup), namespace)
    provider = eval(textwrap.dedent(provider_line).strip().rstrip(","), namespace)
    # Build the model as megatron's get_model would, for a 1-rank job.
    one_rank()
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.global_vars import set_args

    set_args(args)
    model_parallel_cuda_manual_seed(args.seed)
    model = provider(
        pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None
    )
    ultraep_model = namespace["ultraep_model"]
    mlps = [layer.mlp for layer in model.decoder.layers]
    return {
        "moe_balancer": args.moe_balancer,
        "spec_replaced": ultraep_model.transformer_layer_spec is not None,
        "checkout_builder_used": bool(checkout_builds),
        "mlp_classes": [type(m).__name__ for m in mlps],
        "balancer_configs": [
            [m.balancing.config.name, m.balancing.config.num_slots]
            if hasattr(m, "balancing")
            else None
            for m in mlps
        ],
        "mtp_spec_balanced": getattr(legacy_model.mtp_block_spec, "ultraep_balanced", False),
        "post_wrap_hooks": [h.__name__ for h in ultraep_model.post_wrap_hooks],
    }


def main() -> None:
    release, patch, argv = sys.argv[1], Path(sys.argv[2]).read_text(), sys.argv[3:]
    report = (run_018 if release == "0.18" else run_019)(added_blocks(patch), argv)
    import torch
    from megatron.training import training

    hook = training.training_log
    report.update(
        training_log=type(hook).__name__, dashboard=type(getattr(hook, "dashboard", None)).__name__
    )
    print("PATCH_HOOK " + json.dumps(report), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
