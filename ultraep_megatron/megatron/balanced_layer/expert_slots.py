"""Where one expert's parameters live in megatron-core's experts modules (``SequentialMLP``:
``local_experts.{j}.linear_fc1.weight``; ``TEGroupedMLP``: ``linear_fc1.weight{j}``), and the module
that runs the redundant slots: the layer's own experts class built for S experts
(:func:`build_replica_experts`), whose parameters are released at construction and replaced by views
of the shared replica buffer at every call (no memory of its own, no submodule of the model: no DDP
bucket, optimizer state or checkpoint key).
"""

from __future__ import annotations

import copy
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import torch


def expert_param_names(experts: torch.nn.Module, num_experts: int) -> List[List[str]]:
    """Parameter names of each local expert, ``[num_experts][params_per_expert]``.

    Every expert lists its parameters in the same order, and every parameter of ``experts`` belongs
    to exactly one expert.

    Raises:
        ValueError: for an experts module whose parameters are not per-expert tensors (e.g. TE's
            fused op-fuser layout), naming the class.
    """
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
    """The parameter tensors named by :func:`expert_param_names`, for every forward: each name
    resolved once to the submodule that owns the parameter, so a lookup is one dict read per
    parameter, not a walk of the module tree (``experts.get_parameter``: a few hundred Python calls
    per layer and microbatch). It reads the owner's parameter table at every call, so a parameter
    replaced between iterations (a checkpoint load) is seen; replacing a whole submodule is not.
    """

    def __init__(self, experts: torch.nn.Module, names: Sequence[Sequence[str]]):
        self._owners = [[_owner(experts, n) for n in per_expert] for per_expert in names]

    def __call__(self) -> List[List[torch.Tensor]]:
        """``[local expert][k]`` parameters, nested as the names."""
        return [[table[attr] for table, attr in per_expert] for per_expert in self._owners]


@dataclass(eq=False)
class LayerExperts:
    """What a balanced layer's invocations use of it: data, not the layer.

    Attributes:
        lookup: ``[local expert][k]`` its main experts' parameters.
        layout: how one expert's weights lie in a redundant slot.
        gradient_accumulation_fusion: the experts' weight-gradient kernels write ``main_grad``.
        delays_wgrad: ``--delay-wgrad-compute``: weight gradients in ``backward_dw``.
        awaiting_dw: the invocations whose experts' backward ran and whose ``backward_dw`` has not,
            oldest first.
    """

    lookup: ExpertParamLookup
    layout: "ExpertWeightLayout"
    gradient_accumulation_fusion: bool
    delays_wgrad: bool
    awaiting_dw: Deque = field(default_factory=deque)

    def main_weights(self, main_params: List[List[torch.Tensor]]) -> List[List[torch.Tensor]]:
        """``[local expert][part]`` what the weight distribution moves of ``main_params``."""
        return [self.layout.main_weights(params) for params in main_params]


def is_quantized(tensor) -> bool:
    """Whether ``tensor`` is a quantized parameter of Transformer Engine's contract
    (``--fp8-param-gather``: its ``QuantizedTensor`` classes), duck-typed: ``get_metadata()``
    returns its constructor's keyword arguments, storage tensors included, and
    ``type(t)(shape=, dtype=, requires_grad=, **metadata)`` rebuilds it."""
    return callable(getattr(tensor, "get_metadata", None)) and callable(
        getattr(tensor, "dequantize", None)
    )


#: Byte alignment of each part of a quantized expert in a replica weight slot: a part's bytes can be
#: reinterpreted as its own dtype (fp32 scales) in place, aligned as the GPU kernels load them.
PART_ALIGNMENT = 16


class ExpertWeightLayout:
    """How one expert's weights lie in a redundant slot of the shared weight buffer, and how the
    replica experts get them back.

    High-precision parameters: the parameters themselves (``shapes``, their dtype); the gradient
    layout is the same. Quantized parameters (``--fp8-param-gather``): bytes (``dtype`` uint8),
    per parameter the tensor-valued entries of its ``get_metadata()`` (fp8 data, scales, row- and
    column-wise where the recipe keeps both), in key order, each as its flat bytes starting at a
    multiple of :data:`PART_ALIGNMENT` (padding parts between them; a plain parameter beside
    quantized ones is one part). The replica weight transfer then moves exactly what the main
    expert holds; the replica is rebuilt over the views (:meth:`replica_weights`).

    Attributes:
        quantized: whether the weights move as bytes.
        dtype: the weight buffer's dtype.
        shapes: ``[part]`` shapes of one slot's tensors, padding included (the data plane's
            ``weight_shapes``).
        parts: ``[parameter][part]`` ``(metadata key or None, dtype, shape)``; ``None`` per
            parameter without quantization.
        padding: per entry of ``shapes``: ``None`` for a part, the byte count of a padding entry.
    """

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


#: Storage tensors of a quantized weight that are a cache derived from the others, not moved: TE's
#: ``Float8Tensor`` transpose (``data_transpose``) is a byte transpose of ``data``, which TE marks
#: stale (``_transpose_invalid``) without clearing it when the parameter is re-quantized, and which
#: ``get_metadata()`` returns either way. A replica is rebuilt without it; TE makes it from the
#: moved ``data`` when the replica's backward needs it (``update_usage``), bit for bit the main
#: expert's.
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
    """The redundant slots' experts: a module of the layer's experts class (``experts``, its spec's
    builder) for ``num_slots`` experts and no parameter storage.

    Built with initialization off and the RNG state restored, so building it never changes the
    model's own initialization (``--moe-balancer none`` and ``ultraep`` start from the same
    weights).
    """
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        module = experts(num_slots, replica_experts_config(config), pg_collection=pg_collection)
    return ReplicaExperts(module, expert_param_names(module, num_slots))


def replica_experts_config(config):
    """The copy of a layer's ``TransformerConfig`` the replica experts are built with.

    What differs from the main experts', and why:

    * ``perform_initialization`` off: its parameters are released at once (no storage of its own).
    * ``gradient_accumulation_fusion`` off: replica weight gradients come back through autograd
      into the shared fp32 gradient buffer; they must not be fused into a ``main_grad`` the views
      do not have.
    * ``disable_parameter_transpose_cache`` on (fp8/fp4): megatron's TE linears then pass
      ``is_first_microbatch=None`` to Transformer Engine, which quantizes the weights at every call
      and caches no cast. The module is shared by every MoE layer and every microbatch and is no
      submodule of the model, so megatron's ``set_is_first_microbatch`` never resets it: with the
      cache on it would quantize once, at its first call, and from then on compute with that cast
      of another layer's (or an earlier step's) weights. With current scaling (``tensorwise``,
      ``blockwise``, ``mxfp8``) a weight's quantization is a function of that weight alone, so
      re-quantizing the replica's copy gives exactly the main expert's quantized weight. The cost:
      one cast of the S replica weights per layer and microbatch (the main experts cast theirs
      once per step).
    """
    config = copy.copy(config)
    config.perform_initialization = False
    config.gradient_accumulation_fusion = False
    config.disable_parameter_transpose_cache = True
    return config


class ReplicaExperts:
    """The module that runs the redundant slots, called with the slots' weights: each call puts them
    in the owning submodules' parameter tables, runs the module and puts the released parameters
    back (``torch.func.functional_call`` without its per-call walk of the module tree: the owners
    are resolved once, here).

    Attributes:
        module: the experts module (``layer``'s class, ``S`` experts).
        names: ``names[s][k]``, slot ``s``'s ``k``-th parameter name in ``module``, in the order of
            :func:`expert_param_names` of the main experts.
    """

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
            if is_quantized(
                param
            ):  # built as quantized parameters (TE's fp8_model_init): an empty stand-in
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
        """Apply each redundant slot's expert to its chunk of tokens.

        Args:
            slot_weights: ``[num_slots][params_per_expert]`` tensors, ordered as ``names``.
            tokens: [N, H], sorted by slot; ``N == sum(tokens_per_slot)``.
            tokens_per_slot: length ``num_slots`` (host integers).
            probs: [N], the router probabilities of those (token, expert) pairs.

        Returns:
            [N, H] expert outputs (probability-weighted, as megatron's experts return them).
        """
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
        if (
            bias is not None
        ):  # megatron's experts add their biases inside; keep that invariant explicit
            raise ValueError(
                "replica experts returned a separate bias; expected it folded into the output"
            )
        return output

    def delayed_weight_grads(self) -> List[Optional[torch.Tensor]]:
        """The replica weights' gradients of the latest call whose weight gradients the experts
        delayed (``--delay-wgrad-compute``): the module's own ``backward_dw`` computes them
        (Transformer Engine's linears: the oldest computation they stashed in the backward, a
        queue per linear). Transformer Engine sets each gradient as ``.grad`` of the parameter the
        linear holds at that moment, so the call puts stand-ins of the parameters' shapes and
        dtypes in their place (no storage), and reads their ``.grad``.

        Returns:
            flat, slot-major in ``names`` order: each gradient, ``None`` where none was set."""
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
