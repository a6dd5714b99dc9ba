"""CPU stand-ins for what Transformer Engine's CUDA graphs use of its fp8 machinery, for
``te_graph_standin``: the recipe objects (``transformer_engine/common/recipe``), the autocast state
(``FP8GlobalStateManager`` and ``fp8_autocast``, ``transformer_engine/pytorch/fp8.py``), TE's
``wrap_autocast`` of ``make_graphed_callables`` (``graph.py``), and megatron's
``fp8_utils.get_fp8_recipe`` as it runs with TE.

What ``te_graph_standin.make_graphed_callables`` follows of TE's under fp8 (``fp8_enabled``, a
bool or one per callable, ``fp8_recipe``, ``fp8_group``, ``fp8_weight_caching``): each callable's class
``__call__`` is wrapped in ``fp8_autocast(enabled=..., calibrating=..., fp8_recipe=...,
fp8_group=..., _graph=True)`` for the warm-up and the capture, and unwrapped afterwards (so the
captured region runs under the recipe, its TE modules reading it from :class:`FP8GlobalStateManager`,
and the replay path does not); with ``fp8_weight_caching`` the skip-weight-update flag is set to
``False`` before the warm-up, the graphed callable refuses a call without a ``bool``
``is_first_microbatch`` keyword (megatron's replay passes ``current_microbatch == 0``), and
``Graphed.forward`` of the first fp8 module of its autocast sets the flag to ``not
is_first_microbatch`` (the tensor TE's modules read inside the graph to skip re-casting their
weights); after the backward replay the first module calls
``FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)``. :class:`FP8GlobalStateManager`
follows TE's ``fp8.py`` for the autocast state (enter, exit, ``is_first_fp8_module``, the saved and
restored state of ``fp8_autocast``); its amax reduction is what TE's is for the current-scaling
recipes, whose global amax buffer is empty: nothing to reduce (it counts the calls). The recipes
(``transformer_engine.common.recipe``: ``Format``, ``Float8CurrentScaling``, ``Float8BlockScaling``,
``MXFP8BlockScaling``, ``DelayedScaling``) are dataclasses with the fields megatron sets, and
:func:`get_fp8_recipe` is megatron's ``fp8_utils.get_fp8_recipe`` as it runs with TE (megatron
decides at import that TE is absent here, and its TE-less version returns ``None``), so
``TECudaGraphHelper`` hands the stand-in the recipe object it would hand TE.

The TE release followed is ``te_graph_standin.TE_VERSION`` (2.7). Fails as megatron's
``get_fp8_recipe`` does on an fp8 format other than ``e4m3`` / ``hybrid`` (``ValueError``), and
refuses the recipes it leaves out (``NotImplementedError``).

Left out (``te_graph_standin``'s module docstring has the whole list): delayed scaling, TE's fp8
meta of the TE modules a graph visits, the device's fp8 availability checks.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Callable, Optional

import torch


# -- fp8: TE's recipes (``common/recipe``), autocast state (``pytorch/fp8.py``) --------------------


class Format(enum.Enum):
    """TE's ``recipe.Format``: the fp8 formats of the forward and backward tensors."""

    E4M3 = "e4m3"
    HYBRID = "hybrid"  # e4m3 forward, e5m2 backward


@dataclass
class DelayedScaling:
    """TE's ``recipe.DelayedScaling`` (its default recipe): under fp8 the stand-in refuses it."""

    fp8_format: Format = Format.HYBRID


@dataclass
class Float8CurrentScaling:
    """TE's ``recipe.Float8CurrentScaling`` (``--fp8-recipe tensorwise``), as megatron builds it."""

    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass
class Float8BlockScaling:
    """TE's ``recipe.Float8BlockScaling`` (``--fp8-recipe blockwise``), as megatron builds it."""

    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass
class MXFP8BlockScaling:
    """TE's ``recipe.MXFP8BlockScaling`` (``--fp8-recipe mxfp8``), as megatron builds it."""

    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


class FP8GlobalStateManager:
    """TE's ``FP8GlobalStateManager``: the autocast state (``fp8_autocast_enter`` / ``_exit``,
    ``is_first_fp8_module``, ``get_fp8_autocast_state`` / ``set_fp8_autocast_state``) and the
    skip-weight-update flag of fp8 weight caching. The amax reductions are the current-scaling ones:
    nothing is registered in the global amax buffer, so there is nothing to reduce (counted)."""

    FP8_ENABLED = False
    FP8_CALIBRATION = False
    FP8_RECIPE = None
    FP8_DISTRIBUTED_GROUP = None
    IS_FIRST_FP8_MODULE = False
    FP8_GRAPH_CAPTURING = False
    FP8_AUTOCAST_DEPTH = 0
    skip_fp8_weight_update_tensor: Optional[torch.Tensor] = None
    #: for tests: (forward, calls) of ``reduce_and_update_fp8_tensors``.
    reductions = {True: 0, False: 0}

    @classmethod
    def reset(cls) -> None:
        cls.FP8_ENABLED = cls.FP8_CALIBRATION = cls.IS_FIRST_FP8_MODULE = (
            cls.FP8_GRAPH_CAPTURING
        ) = False
        cls.FP8_RECIPE = cls.FP8_DISTRIBUTED_GROUP = cls.skip_fp8_weight_update_tensor = None
        cls.FP8_AUTOCAST_DEPTH = 0
        cls.reductions = {True: 0, False: 0}

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """``True`` once per outermost autocast: for the first module that asks."""
        first, cls.IS_FIRST_FP8_MODULE = cls.IS_FIRST_FP8_MODULE, False
        return first

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool) -> None:
        if cls.skip_fp8_weight_update_tensor is None:
            cls.skip_fp8_weight_update_tensor = torch.empty(1, dtype=torch.float32, device="cuda")
        cls.skip_fp8_weight_update_tensor.fill_(skip)

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        cls.reductions[forward] += 1  # current scaling: the global amax buffer is empty

    @classmethod
    def get_fp8_autocast_state(cls) -> tuple:
        return (
            cls.FP8_ENABLED,
            cls.FP8_CALIBRATION,
            cls.FP8_RECIPE,
            cls.FP8_DISTRIBUTED_GROUP,
            cls.IS_FIRST_FP8_MODULE,
            cls.FP8_GRAPH_CAPTURING,
        )

    @classmethod
    def set_fp8_autocast_state(cls, state: tuple) -> None:
        (
            cls.FP8_ENABLED,
            cls.FP8_CALIBRATION,
            cls.FP8_RECIPE,
            cls.FP8_DISTRIBUTED_GROUP,
            cls.IS_FIRST_FP8_MODULE,
            cls.FP8_GRAPH_CAPTURING,
        ) = state

    @classmethod
    def fp8_autocast_enter(
        cls, enabled=False, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False
    ) -> None:
        cls.FP8_ENABLED, cls.FP8_CALIBRATION = enabled, calibrating
        cls.FP8_RECIPE = DelayedScaling() if fp8_recipe is None else fp8_recipe
        cls.FP8_DISTRIBUTED_GROUP, cls.FP8_GRAPH_CAPTURING = fp8_group, _graph
        if cls.FP8_AUTOCAST_DEPTH == 0:
            cls.IS_FIRST_FP8_MODULE = True
        cls.FP8_AUTOCAST_DEPTH += 1

    @classmethod
    def fp8_autocast_exit(cls, enabled: bool, _graph: bool) -> None:
        cls.FP8_AUTOCAST_DEPTH -= 1
        # Non-weight amaxes are reduced on leaving the outermost eager autocast (not in a graph).
        if enabled and cls.FP8_AUTOCAST_DEPTH == 0 and not _graph and torch.is_grad_enabled():
            cls.reduce_and_update_fp8_tensors(forward=True)


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe=None,
    fp8_group=None,
    _graph: bool = False,
):
    """TE's ``fp8_autocast``: the state entered, and the previous state restored on exit."""
    state = FP8GlobalStateManager.get_fp8_autocast_state()
    FP8GlobalStateManager.fp8_autocast_enter(
        enabled=enabled,
        calibrating=calibrating,
        fp8_recipe=fp8_recipe,
        fp8_group=fp8_group,
        _graph=_graph,
    )
    try:
        yield
    finally:
        FP8GlobalStateManager.set_fp8_autocast_state(state)
        FP8GlobalStateManager.fp8_autocast_exit(enabled, _graph=_graph)


_IS_GRAPH_CAPTURING = False


def set_capture_start() -> None:
    """TE's ``graph.set_capture_start``: inside ``make_graphed_callables``."""
    global _IS_GRAPH_CAPTURING
    _IS_GRAPH_CAPTURING = True


def set_capture_end() -> None:
    global _IS_GRAPH_CAPTURING
    _IS_GRAPH_CAPTURING = False


def is_graph_capturing() -> bool:
    return _IS_GRAPH_CAPTURING


def get_fp8_recipe(config):
    """megatron's ``fp8_utils.get_fp8_recipe`` with TE (>= 2.3): the recipe object of
    ``config.fp8`` (format) and ``config.fp8_recipe``; the current-scaling recipes only (megatron's
    ``delayed`` and ``custom`` are refused for a balanced layer at startup)."""
    if config.fp8 == "e4m3":
        fp8_format = Format.E4M3
    elif config.fp8 == "hybrid":
        fp8_format = Format.HYBRID
    else:
        raise ValueError("E4M3 and HYBRID are the only supported FP8 formats.")
    recipe = getattr(config.fp8_recipe, "value", config.fp8_recipe)
    if recipe == "tensorwise":
        return Float8CurrentScaling(fp8_format=fp8_format, fp8_dpa=config.fp8_dot_product_attention)
    if recipe == "blockwise":
        return Float8BlockScaling(fp8_format=fp8_format)
    if recipe == "mxfp8":
        return MXFP8BlockScaling(fp8_format=fp8_format, fp8_dpa=config.fp8_dot_product_attention)
    raise NotImplementedError(
        f"fp8 recipe {recipe!r}: the stand-in builds the current-scaling recipes only"
    )


def _wrap_autocast(modules, fp8_enabled, calibrating, recipe, group) -> Callable[[], None]:
    """TE's ``wrap_autocast``: each callable's class ``__call__`` runs inside ``fp8_autocast`` with
    its ``fp8_enabled`` entry (per instance, as TE's per-callable tuple), ``_graph=True``. Returns
    the function that restores the classes' ``__call__``."""
    enabled_of = {id(m): bool(e) for m, e in zip(modules, fp8_enabled)}
    old_calls = {}
    for module in modules:
        cls = type(module)
        if cls in old_calls:
            continue
        old_calls[cls] = (cls.__dict__.get("__call__"), cls.__call__)

        def call(self, *args, _cls=cls, **kwargs):
            with fp8_autocast(
                enabled=enabled_of.get(id(self), False),
                calibrating=calibrating,
                fp8_recipe=recipe,
                fp8_group=group,
                _graph=True,
            ):
                return old_calls[_cls][1](self, *args, **kwargs)

        cls.__call__ = call

    def unwrap():
        for cls, (own, _) in old_calls.items():
            if own is None:
                del cls.__call__  # inherited before: inherit again
            else:
                cls.__call__ = own

    return unwrap
