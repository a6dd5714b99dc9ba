"""Where one expert's parameters live in megatron-core's experts modules, how they lie in a
redundant slot, and the module that runs the redundant slots (:class:`ReplicaExperts`: the layer's
experts class for S experts over views of the shared buffer, no submodule of the model).
"""

from __future__ import annotations

import copy
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import torch


def expert_param_names(experts: torch.nn.Module, num_experts: int) -> List[List[str]]:
    """Parameter names of each local expert, ``[num_experts][params_per_expert]``, in the same
    order for every expert; ValueError where the parameters are not per-expert tensors."""
    all_names = [name for name, _ in experts.named_parameters()]
    if hasattr(experts, "local_experts"):  # SequentialMLP
        first = [name for name, _ in experts.local_experts[0].named_parameters()]
        names = [[f"local_experts.{j}.{n}" for n in first] for j in range(num_experts)]
    else:  # grouped GEMM: <linear>.weight{j} / <linear>.bias{j}
        pattern = re.compile(r"^(?P<prefix>.+\.(?:weight|bias))0$")
        stems = [m.group("prefix") for m in map(pattern.match, all_names) if m]
        names = [[f"{stem}{j}" for stem in stems] for j in range(num_experts)]
    flat = [n for per_expert in names for n in per_expert]
    if not flat or sorted(flat) != sorted(all_names):
        raise ValueError(
            f"UltraEP cannot find per-expert parameters in {type(experts).__name__} "
            f"(parameters: {all_names[:6]}{' ...' if len(all_names) > 6 else ''}); "
            "supported expert "
            "modules are megatron-core's SequentialMLP and TEGroupedMLP without the TE op fuser"
        )
    return names


class ExpertParamLookup:
    """The parameters named by :func:`expert_param_names`, one dict read each (owners resolved
    once): a parameter replaced between iterations is seen, a replaced submodule is not."""

    def __init__(self, experts: torch.nn.Module, names: Sequence[Sequence[str]]):
        self._owners = [[_owner(experts, n) for n in per_expert] for per_expert in names]

    def __call__(self) -> List[List[torch.Tensor]]:
        """``[local expert][k]`` parameters, nested as the names."""
        return [[table[attr] for table, attr in per_expert] for per_expert in self._owners]


@dataclass(eq=False)
class LayerExperts:
    """What a balanced layer's invocations use of it: data, not the layer."""

    lookup: ExpertParamLookup  # [local expert][k] the main experts' parameters
    layout: "ExpertWeightLayout"
    gradient_accumulation_fusion: bool  # the wgrad kernels write main_grad
    delays_wgrad: bool  # --delay-wgrad-compute
    awaiting_dw: Deque = field(default_factory=deque)  # backward ran, backward_dw not: oldest first

    def main_weights(self, main_params: List[List[torch.Tensor]]) -> List[List[torch.Tensor]]:
        """``[local expert][part]`` what the weight distribution moves of ``main_params``."""
        return [self.layout.main_weights(params) for params in main_params]


def is_quantized(tensor) -> bool:
    """Whether ``tensor`` is a TE quantized parameter, duck-typed: ``get_metadata()`` gives the
    keyword arguments of ``type(t)(shape=, dtype=, requires_grad=, **metadata)`` (rebuilds it)."""
    return callable(getattr(tensor, "get_metadata", None)) and callable(
        getattr(tensor, "dequantize", None)
    )


#: Byte alignment of each part of a quantized expert in a replica weight slot: a part's bytes can be
#: reinterpreted as its own dtype (fp32 scales) in place, aligned as the GPU kernels load them.
PART_ALIGNMENT = 16


class ExpertWeightLayout:
    """How one expert's weights lie in a redundant slot of the shared weight buffer: the
    parameters themselves, or for quantized ones (``--fp8-param-gather``) the bytes of their
    storage tensors (:func:`_parts`), each starting at a multiple of :data:`PART_ALIGNMENT`.

    ``shapes``: ``[part]`` one slot's tensors, padding included; ``parts``: ``[parameter][part]``
    ``(metadata key or None, dtype, shape)``, ``None`` unquantized; ``padding``: per entry of
    ``shapes``, ``None`` for a part, else its byte count."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.quantized = any(is_quantized(p) for p in params)
        self.dtype = torch.uint8 if self.quantized else params[0].dtype
        self.shapes: List[torch.Size] = []
        self.parts: List[Optional[List[Tuple[Optional[str], torch.dtype, torch.Size]]]] = []
        self.padding: List[Optional[int]] = []
        for p in params:
            if not self.quantized:
                self.parts.append(None)
                self.shapes.append(torch.Size(p.shape))
                self.padding.append(None)
                continue
            parts = _parts(p)
            self.parts.append([(key, t.dtype, torch.Size(t.shape)) for key, t in parts])
            for _, t in parts:
                size = t.numel() * t.element_size()
                self.shapes.append(torch.Size([size]))
                self.padding.append(None)
                if size % PART_ALIGNMENT:
                    self.shapes.append(torch.Size([PART_ALIGNMENT - size % PART_ALIGNMENT]))
                    self.padding.append(PART_ALIGNMENT - size % PART_ALIGNMENT)
        self._zeros: Dict[Tuple[int, torch.device], torch.Tensor] = {}

    def main_weights(self, params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """One main expert's tensors as the weight buffer lays them out (``shapes``): its
        parameters, or the bytes of their parts with padding. Raises where a parameter's parts
        differ from the layout (host metadata only)."""
        if not self.quantized:
            return list(params)
        out: List[torch.Tensor] = []
        for p, layout in zip(params, self.parts):
            parts = _parts(p)
            if [(k, t.dtype, torch.Size(t.shape)) for k, t in parts] != layout:
                raise ValueError(
                    "UltraEP: a quantized expert weight's parts "
                    f"{[(k, t.dtype, tuple(t.shape)) for k, t in parts]} "
                    f"differ from the replica slots' layout {layout}"
                )
            out += [t.reshape(-1).view(torch.uint8) for _, t in parts]
        device = out[0].device
        parts = iter(out)
        return [
            next(parts) if pad is None else self._zero_bytes(pad, device) for pad in self.padding
        ]

    def replica_weights(
        self, views: Sequence[torch.Tensor], like: Sequence[torch.Tensor]
    ) -> List[torch.Tensor]:
        """One redundant slot's weights for the replica experts, over the slot's ``views`` (the
        weight buffer's, shaped as ``shapes``): the views (detached) for high-precision weights;
        else each quantized parameter rebuilt as ``like``'s class (a main expert's parameter: its
        non-tensor metadata, e.g. the quantizer) over its parts' bytes reinterpreted in place."""
        if not self.quantized:
            return [v.detach() for v in views]
        parts = iter(v for v, pad in zip(views, self.padding) if pad is None)
        out = []
        for p, layout in zip(like, self.parts):
            tensors = {key: next(parts).view(dtype).view(shape) for key, dtype, shape in layout}
            if not is_quantized(p):
                out.append(tensors[None])
                continue
            metadata = {**p.get_metadata(), **tensors}
            for key in DERIVED_PARTS:  # the main expert's caches are not the replica's: none
                if key in metadata:
                    metadata[key] = None
            out.append(type(p)(shape=p.shape, dtype=p.dtype, requires_grad=False, **metadata))
        return out

    def _zero_bytes(self, size: int, device: torch.device) -> torch.Tensor:
        key = (size, device)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(size, dtype=torch.uint8, device=device)
        return self._zeros[key]


#: Storage tensors of a quantized weight derived from the others, not moved: TE's ``Float8Tensor``
#: ``data_transpose`` (possibly stale); TE rebuilds it from the moved ``data`` when needed.
DERIVED_PARTS = ("data_transpose",)


def _parts(param: torch.Tensor) -> List[Tuple[Optional[str], torch.Tensor]]:
    """A parameter's storage tensors, ``(metadata key, tensor)`` in key order: the tensor-valued
    entries of a quantized one's ``get_metadata()`` but :data:`DERIVED_PARTS`; a plain one is its
    own part (key ``None``)."""
    if not is_quantized(param):
        return [(None, param.detach())]
    metadata = param.get_metadata()
    return [
        (key, metadata[key])
        for key in sorted(metadata)
        if isinstance(metadata[key], torch.Tensor) and key not in DERIVED_PARTS
    ]


def build_replica_experts(experts, config, pg_collection, num_slots: int) -> "ReplicaExperts":
    """The redundant slots' experts: the layer's experts class (``experts``, its spec's builder)
    for ``num_slots`` experts, no parameter storage; the RNG state is restored (same init)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        module = experts(num_slots, replica_experts_config(config), pg_collection=pg_collection)
    return ReplicaExperts(module, expert_param_names(module, num_slots))


def replica_experts_config(config):
    """The copy of a layer's ``TransformerConfig`` the replica experts are built with: no
    initialization (parameters released at once); no gradient-accumulation fusion (no ``main_grad``
    on the views); no transpose cache (fp8/fp4: TE re-quantizes at every call; a cached cast would
    be another layer's, as ``set_is_first_microbatch`` never reaches this module)."""
    config = copy.copy(config)
    config.perform_initialization = False
    config.gradient_accumulation_fusion = False
    config.disable_parameter_transpose_cache = True
    return config


class ReplicaExperts:
    """The module that runs the redundant slots (``module``, S experts), called with the slots'
    weights put in its parameter tables for the call. ``names[s][k]``: slot ``s``'s parameters."""

    def __init__(self, module: torch.nn.Module, names: Sequence[Sequence[str]]):
        self.module, self.names = module, [list(slot) for slot in names]
        self._owners = [_owner(module, name) for slot in self.names for name in slot]
        # shape, dtype and device of each parameter, before its storage is released
        self._shapes = [
            (table[attr].shape, table[attr].dtype, table[attr].device, table[attr].requires_grad)
            for table, attr in self._owners
        ]
        self._grad_holders: Optional[List[torch.Tensor]] = None  # delayed_weight_grads's stand-ins
        for table, attr in self._owners:  # storage comes from the replica buffer at every call
            param = table[attr]
            # built as quantized parameters (TE's fp8_model_init): an empty stand-in
            if is_quantized(param):
                table[attr] = torch.nn.Parameter(
                    torch.empty(0, dtype=param.dtype, device=param.device),
                    requires_grad=param.requires_grad,
                )
            else:
                param.data = param.data.new_empty(0)

    def __call__(
        self,
        slot_weights: Sequence[Sequence[torch.Tensor]],
        tokens: torch.Tensor,
        tokens_per_slot: Sequence[int],
        probs: torch.Tensor,
    ) -> torch.Tensor:
        """Each slot's expert (``slot_weights [S][k]``, as ``names``) on its chunk of ``tokens
        [N, H]`` (sorted by slot, ``tokens_per_slot`` host ints) with ``probs [N]`` -> ``[N, H]``,
        probability-weighted as megatron's experts."""
        weights = [w for slot in slot_weights for w in slot]
        if len(weights) != len(self._owners):
            raise ValueError(f"expected {len(self._owners)} replica weights, got {len(weights)}")
        released = [table[attr] for table, attr in self._owners]
        for (table, attr), weight in zip(self._owners, weights):
            table[attr] = weight
        try:
            counts = torch.tensor(list(tokens_per_slot), dtype=torch.long)
            output, bias = self.module(tokens, counts, probs)
        finally:
            for (table, attr), param in zip(self._owners, released):
                table[attr] = param
        if bias is not None:  # megatron's experts add their biases inside
            raise ValueError(
                "replica experts returned a separate bias; expected it folded into the output"
            )
        return output

    def delayed_weight_grads(self) -> List[Optional[torch.Tensor]]:
        """The replica weights' delayed gradients (``--delay-wgrad-compute``) of the oldest stashed
        call, from the module's ``backward_dw`` run on storage-less stand-ins whose ``.grad`` TE
        sets. Flat, slot-major in ``names`` order; ``None`` where none was set."""
        if self._grad_holders is None:
            self._grad_holders = [
                torch.empty_strided(
                    shape, (0,) * len(shape), dtype=dtype, device=device
                ).requires_grad_(requires_grad)
                for shape, dtype, device, requires_grad in self._shapes
            ]
        released = [table[attr] for table, attr in self._owners]
        for (table, attr), holder in zip(self._owners, self._grad_holders):
            table[attr] = holder
        try:
            self.module.backward_dw()
        finally:
            for (table, attr), param in zip(self._owners, released):
                table[attr] = param
        grads = [holder.grad for holder in self._grad_holders]
        for holder in self._grad_holders:
            holder.grad = None
        return grads


def _owner(module: torch.nn.Module, name: str) -> Tuple[Dict[str, torch.nn.Parameter], str]:
    """(parameter table of the submodule owning ``name``, attribute) for a parameter of
    ``module``."""
    path, _, attr = name.rpartition(".")
    owner = module.get_submodule(path)
    if owner._parameters.get(attr) is None:  # absent, or registered as None (no bias)
        raise ValueError(f"{name} is not a parameter of {type(module).__name__}")
    return owner._parameters, attr
