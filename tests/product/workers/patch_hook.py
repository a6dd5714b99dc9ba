"""Run the code that patches/megatron-lm-core_v0.19.0-pretrain_gpt.patch adds to Megatron-LM's
pretrain_gpt.py, in the context it expects there, and print what it set up as JSON.

Megatron-LM's own file is not on this machine, so the patch's added lines are taken from the patch
itself: the import block, the ``extra_args_provider=`` expression given to Megatron's
``parse_and_validate_args``, and the block after ``model_cfg = gpt_config_from_args(args)``.

    python patch_hook.py PATCH [pretrain_gpt.py arguments]
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


def main() -> None:
    patch, argv = Path(sys.argv[1]).read_text(), sys.argv[2:]
    imports, provider_arg, setup = added_blocks(patch)
    namespace = {"partial": functools.partial, "has_nvidia_modelopt": False,
                 "add_modelopt_args": None}
    exec(textwrap.dedent(imports), namespace)
    expression = textwrap.dedent(provider_arg).strip()
    assert expression.startswith("extra_args_provider=") and expression.endswith(","), expression
    provider = eval(expression[len("extra_args_provider="):-1], namespace)

    import torch
    from megatron.core import parallel_state
    from megatron.training import training
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_and_validate_args(extra_args_provider=provider,
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    model_cfg = gpt_config_from_args(args)
    namespace.update(args=args, model_cfg=model_cfg)
    exec(textwrap.dedent(setup), namespace)

    # Build the layer spec as Megatron's GPT builder would, for a 1-rank job.
    init_file = Path(tempfile.mkdtemp(prefix="patch_hook_")) / "init"
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=0,
                                         world_size=1)
    parallel_state.initialize_model_parallel()
    spec_fn = model_cfg.transformer_layer_spec
    if spec_fn is None:
        from megatron.training.models.gpt import default_layer_spec

        spec = default_layer_spec(model_cfg, None)
    else:
        spec = spec_fn(model_cfg, vp_stage=None)
    mlps = [layer.submodules.mlp for layer in spec.layer_specs]
    hook = training.training_log
    from megatron.training.models import gpt
    print("PATCH_HOOK " + json.dumps({
        "moe_balancer": args.moe_balancer,
        "spec_replaced": spec_fn is not None,
        "mlp_classes": [getattr(m, "func", getattr(m, "module", m)).__name__ for m in mlps],
        "balancer_configs": [
            [m.keywords["balancing"].config.name, m.keywords["balancing"].config.num_slots]
            if "balancing" in getattr(m, "keywords", {}) else None for m in mlps],
        "training_log": type(hook).__name__,
        "dashboard": type(getattr(hook, "dashboard", None)).__name__,
        "mtp_spec_balanced": getattr(gpt.mtp_block_spec, "ultraep_balanced", False),
        "post_wrap_hooks": [h.__name__ for h in model_cfg.post_wrap_hooks],
    }), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
