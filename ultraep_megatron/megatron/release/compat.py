"""The megatron-core releases the integration runs on, and everything that differs between them.

Supported: 0.19.x (tested: 0.19.2, the whole suite) and 0.18.x (tested: 0.18.2, the layer-level
equivalence tests and the main job; ``requirements/lock-mcore018.txt``). Every release switch of the
package is here, keyed on the installed megatron-core's version (:func:`release`); the modules that
differ ask this one by name, never the version.

What differs (docs/integration.md, "megatron-core releases"):

* the training API. 0.19 builds the GPT model from a ``GPTModelConfig``
  (``megatron.training.argument_utils.gpt_config_from_args``; Megatron's default layer spec is
  ``megatron.training.models.gpt.default_layer_spec``; hooks run on the built model through the
  config's ``post_wrap_hooks``). 0.18's wheel has neither: ``pretrain`` takes a model provider, and
  Megatron-LM's checkout (``gpt_builders.py``) holds the spec choice. :func:`gpt_model_from_args`
  returns the one or the other (0.18: :class:`~.legacy_model.GPTModelProvider`, which follows the
  0.18 checkout's ``gpt_builder``), and :func:`pretrain` calls 0.18's or 0.19's ``pretrain``;
* ``get_batch_on_this_tp_rank``'s packed-sequence argument (0.18 ``is_sft``, 0.19
  ``has_cu_seqlens``): ``pretrain_gpt.py`` passes it by position;
* what fails on 0.18 and runs on 0.19 (:data:`REFUSED_ON_018`; the startup check refuses it,
  :func:`release_problems`).

Reads the version without importing ``megatron.core`` (its ``package_info.py`` is parsed), so the
``ultraep`` command and the startup checks stay light.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Any, Callable, Optional

#: Supported releases (major, minor) -> the patch release tested here.
SUPPORTED = {(0, 18): 2, (0, 19): 2}


@functools.cache
def mcore_version() -> tuple[int, int, int]:
    """The installed megatron-core's (major, minor, patch), from ``megatron/core/package_info.py``
    (a wheel's or a Megatron-LM checkout's, whichever ``import megatron.core`` would take)."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "megatron-core is not installed (pip install 'megatron-core>=0.18,<0.20')"
        )
    info = Path(next(iter(spec.submodule_search_locations))) / "package_info.py"
    fields = {}
    for node in ast.parse(info.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            if node.targets[0].id in ("MAJOR", "MINOR", "PATCH") and isinstance(
                node.value, ast.Constant
            ):
                fields[node.targets[0].id] = int(node.value.value)
    return fields["MAJOR"], fields["MINOR"], fields["PATCH"]


def release() -> str:
    """The installed megatron-core's release line, e.g. ``"0.19"``."""
    major, minor, _ = mcore_version()
    return f"{major}.{minor}"


def version_string() -> str:
    return ".".join(map(str, mcore_version()))


def is_018() -> bool:
    """megatron-core 0.18.x: the model-provider training API (no ``GPTModelConfig``)."""
    return mcore_version()[:2] == (0, 18)


def unsupported_release_problem() -> Optional[str]:
    """Why the installed megatron-core cannot run the integration (``None`` when it can)."""
    if mcore_version()[:2] in SUPPORTED:
        return None
    supported = " and ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
    return (
        f"megatron-core {version_string()} is not supported: ultraep-megatron subclasses its MoE "
        f"layer and dispatchers as of {supported}; install one of those "
        "(pip install 'megatron-core>=0.18,<0.20')"
    )


#: Settings that run on 0.19 but fail on 0.18, each (test on a getter of Megatron's args or a
#: TransformerConfig: the attribute names are the same, the flags, why). The flags 0.18 lacks (e.g.
#: --moe-hybridep-pad-uneven-dispatch-inputs, --moe-routing-trace-path) its own parser refuses.
REFUSED_ON_018: tuple[tuple[Callable[[Callable], bool], str, str], ...] = (
    (
        lambda get: bool(get("mtp_num_layers")) and get("recompute_granularity") == "full",
        "--mtp-num-layers with --recompute-granularity full",
        "megatron-core 0.18's multi-token-prediction layer fails in its first recomputed forward (its "
        "forward passes padding_mask to _checkpointed_forward, which does not take it; with or without a "
        "balancer); use --recompute-granularity selective, or megatron-core 0.19",
    ),
)


def release_problems(config: Any) -> list[str]:
    """What ``config`` (Megatron's args or a TransformerConfig) asks for that the installed
    megatron-core release cannot run, one line each naming the flags and the release."""
    problem = unsupported_release_problem()
    if problem:
        return [problem]
    if not is_018():
        return []
    get = lambda name: getattr(config, name, None)  # noqa: E731
    return [
        f"{flags} is not supported on megatron-core {version_string()}: {why}"
        for refused, flags, why in REFUSED_ON_018
        if refused(get)
    ]


# The training API ----------------------------------------------------------------------------------


def default_layer_spec(model_cfg: Any, vp_stage: Optional[int]):
    """Megatron's default layer spec for ``model_cfg`` (the object :func:`gpt_model_from_args`
    returned) and the virtual pipeline stage ``vp_stage``."""
    if is_018():
        from ultraep_megatron.megatron.release.legacy_model import default_layer_spec as spec_018

        return spec_018(model_cfg, vp_stage)
    from megatron.training.models.gpt import default_layer_spec as spec_019

    return spec_019(model_cfg, vp_stage)


def gpt_model_from_args(args: Any):
    """What ``pretrain`` builds the GPT model from, with a ``transformer_layer_spec`` to set and
    ``post_wrap_hooks`` (each ``hook(model_chunks) -> model_chunks``, run once the model is built):
    0.19's ``GPTModelConfig``; on 0.18 a :class:`~.legacy_model.GPTModelProvider`."""
    if is_018():
        from ultraep_megatron.megatron.release.legacy_model import GPTModelProvider

        return GPTModelProvider(args)
    from megatron.training.argument_utils import gpt_config_from_args

    return gpt_config_from_args(args)


def wrap_mtp_block_spec(wrap: Callable[[Callable], Callable]) -> None:
    """Have the model builder take the multi-token-prediction block spec through ``wrap``
    (``wrap(mtp_block_spec) -> mtp_block_spec``, same signature ``(model_cfg, transformer_layer_spec,
    vp_stage)``); idempotent by the wrapper's ``ultraep_balanced`` attribute. The builder calls a
    module-level function: 0.19's ``megatron.training.models.gpt.mtp_block_spec``, 0.18's
    :func:`.legacy_model.mtp_block_spec`."""
    if is_018():
        from ultraep_megatron.megatron.release import legacy_model as module
    else:
        from megatron.training.models import gpt as module
    if not getattr(module.mtp_block_spec, "ultraep_balanced", False):
        module.mtp_block_spec = wrap(module.mtp_block_spec)


def pretrain(
    args: Any, model: Any, datasets_provider: Callable, forward_step: Callable, **kwargs
) -> None:
    """megatron's ``pretrain`` of the GPT ``model`` (from :func:`gpt_model_from_args`)."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain as megatron_pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    if is_018():
        import warnings

        with warnings.catch_warnings():
            # 0.18 recommends a ModelConfig, which it has for hybrid models only.
            warnings.filterwarnings("ignore", message=".*recommended to use a ModelConfig")
            container = pretrain_cfg_container_from_args(args)
        megatron_pretrain(
            container,
            datasets_provider,
            model,
            ModelType.encoder_or_decoder,
            forward_step,
            **kwargs,
        )
        return
    megatron_pretrain(
        pretrain_cfg_container_from_args(args, model),
        datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        **kwargs,
    )
