"""Where one expert's parameters live inside megatron-core's experts modules, and the module that
runs the redundant slots.

Two expert classes are supported, with the same code path:

* ``SequentialMLP`` (the local spec; what runs on CPU): expert ``j``'s parameters are
  ``local_experts.{j}.linear_fc1.weight``, ``local_experts.{j}.linear_fc2.weight`` (and biases);
* ``TEGroupedMLP`` (``--moe-grouped-gemm`` with Transformer Engine): one grouped GEMM over all local
  experts, expert ``j``'s parameters are ``linear_fc1.weight{j}``, ``linear_fc2.weight{j}`` (and
  ``bias{j}``).

The redundant slots run an instance of the *same* experts class built for ``num_slots`` experts
(:func:`build_replica_experts`): with TE present its grouped GEMM runs the replicas, on CPU the
SequentialMLP loop does. Its own parameters are released right after construction; every call
substitutes views of the shared replica buffer (``torch.func.functional_call``), so it owns no
memory and is never part of the model (not a submodule: no DDP bucket, optimizer state or
checkpoint key).
"""

from __future__ import annotations

import copy
import re
from typing import Dict, List, Sequence, Tuple

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
            f"(parameters: {all_names[:6]}{' ...' if len(all_names) > 6 else ''}); supported expert "
            "modules are megatron-core's SequentialMLP and TEGroupedMLP without the TE op fuser"
        )
    return names


def expert_params(experts: torch.nn.Module, names: Sequence[Sequence[str]]) -> List[List[torch.Tensor]]:
    """The parameter tensors named by :func:`expert_param_names`, same nesting."""
    return [[experts.get_parameter(n) for n in per_expert] for per_expert in names]


class ExpertParamLookup:
    """:func:`expert_params` for every forward: each name resolved once to the submodule that owns
    the parameter, so a lookup is one dict read per parameter, not a walk of the module tree (a
    few hundred Python calls per layer and microbatch). It reads the owner's parameter table at
    every call, so a parameter replaced between iterations (a checkpoint load) is seen; replacing a
    whole submodule is not.
    """

    def __init__(self, experts: torch.nn.Module, names: Sequence[Sequence[str]]):
        def owner(name: str) -> Tuple[Dict[str, torch.nn.Parameter], str]:
            path, _, attr = name.rpartition(".")
            module = experts.get_submodule(path)
            if module._parameters.get(attr) is None:  # absent, or registered as None (no bias)
                raise ValueError(f"{name} is not a parameter of {type(experts).__name__}")
            return module._parameters, attr

        self._owners = [[owner(n) for n in per_expert] for per_expert in names]

    def __call__(self) -> List[List[torch.Tensor]]:
        """``[local expert][k]`` parameters, as :func:`expert_params`."""
        return [[table[attr] for table, attr in per_expert] for per_expert in self._owners]


def build_replica_experts(layer, num_slots: int) -> Tuple[torch.nn.Module, List[List[str]]]:
    """An experts module of ``layer``'s class with ``num_slots`` experts and no parameter storage.

    Built with initialization off and the RNG state restored, so building it never changes the
    model's own initialization (``--moe-balancer none`` and ``ultraep`` start from the same weights).

    Returns:
        (module, names): ``names[s][k]`` is slot ``s``'s ``k``-th parameter name in ``module``, in the
        order of :func:`expert_param_names` of the main experts.
    """
    config = copy.copy(layer.config)
    config.perform_initialization = False
    # Replica weight gradients come back through autograd into the shared fp32 buffer; they must not
    # be fused into a ``main_grad`` the views do not have.
    config.gradient_accumulation_fusion = False
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        module = layer.submodules.experts(num_slots, config, pg_collection=layer.balancer_pg_collection)
    names = expert_param_names(module, num_slots)
    for param in module.parameters():  # storage comes from the replica buffer at every call
        param.data = param.data.new_empty(0)
    return module, names


def run_replica_experts(
    module: torch.nn.Module,
    names: Sequence[Sequence[str]],
    slot_weights: Sequence[Sequence[torch.Tensor]],
    tokens: torch.Tensor,
    tokens_per_slot: Sequence[int],
    probs: torch.Tensor,
) -> torch.Tensor:
    """Apply each redundant slot's expert to its chunk of tokens.

    Args:
        module, names: from :func:`build_replica_experts`.
        slot_weights: ``[num_slots][params_per_expert]`` tensors (views of the replica buffer).
        tokens: [N, H], sorted by slot; ``N == sum(tokens_per_slot)``.
        tokens_per_slot: length ``num_slots``.
        probs: [N], the router probabilities of those (token, expert) pairs.

    Returns:
        [N, H] expert outputs (probability-weighted, as megatron's experts return them).
    """
    params: Dict[str, torch.Tensor] = {
        name: weight
        for slot_names, weights in zip(names, slot_weights)
        for name, weight in zip(slot_names, weights)
    }
    counts = torch.tensor(list(tokens_per_slot), dtype=torch.long)
    # No tied weights in a module built for the redundant slots: skip the search for them (a walk
    # over all its modules and parameters on every call).
    output, bias = torch.func.functional_call(module, params, (tokens, counts, probs), tie_weights=False)
    if bias is not None:  # megatron's experts add their biases inside; keep that invariant explicit
        raise ValueError("replica experts returned a separate bias; expected it folded into the output")
    return output
