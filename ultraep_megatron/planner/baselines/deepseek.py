"""DeepSeek's EPLB as DeepSeek runs it (github.com/deepseek-ai/EPLB, ``rebalance_experts``),
re-implemented from its public code (facts only): it **re-places every expert**. The E + R*S
physical experts (P = G + S per rank) are chosen and packed from scratch, so main experts move too.
The fixed-layout EPLB of the paper (mains at home) is :mod:`.fixed_layout`.

Not on the hot path: plain numpy/torch.
"""

from __future__ import annotations

import numpy as np
import torch

from ..solve import validate_load
from .fixed_layout import check_num_slots, replicate, round_robin_split
from .placement import Placement

__all__ = ["deepseek_eplb"]


def _balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """EPLB's packing: items by descending weight (ties: lowest index) each go to the lightest
    pack (ties: lowest index) that holds fewer than n / num_packs; with one item per pack, item i
    goes to pack i. weight float [n] -> (pack int64 [n], position in the pack int64 [n])."""
    n = weight.shape[0]
    per_pack = n // num_packs
    if per_pack == 1:
        return np.arange(n), np.zeros(n, np.int64)
    pack, position = np.empty(n, np.int64), np.empty(n, np.int64)
    pack_weight, items = np.zeros(num_packs), np.zeros(num_packs, np.int64)
    for i in np.argsort(-weight, kind="stable"):
        open_packs = np.flatnonzero(items < per_pack)
        p = open_packs[np.argmin(pack_weight[open_packs])]
        pack[i], position[i] = p, items[p]
        pack_weight[p] += weight[i]
        items[p] += 1
    return pack, position


def deepseek_eplb(
    load: torch.Tensor, num_slots: int, *, num_groups: int | None = None, num_nodes: int = 1
) -> Placement:
    """DeepSeek's EPLB on the exact load: every expert re-placed, mains included.

    Args:
        load: int64 [R, E].
        num_slots: S; there are E + R*S physical experts, P = G + S on every rank (as many
            physical slots as UltraEP's layout, none reserved for the home experts).
        num_groups, num_nodes: DeepSeek's hierarchical policy when ``num_groups`` is given and a
            multiple of ``num_nodes`` (EPLB's condition): the E experts form ``num_groups`` groups
            of consecutive ids, groups are packed to nodes (R / num_nodes ranks each, e.g. NVLink
            domains) balancing their load, then replicas are made and packed inside each node.
            Otherwise (the default) the global policy: replicate over all experts, pack to all
            ranks.

    Replication gives the R*S extra copies one at a time to the expert with the largest load per
    copy; packing puts the copies, by descending load per copy, on the least-loaded rank that still
    has a free physical slot (``fixed_layout.replicate``, ``_balanced_packing``; ties by lowest index where
    EPLB's unstable sort leaves them open). Tokens of an expert are spread round-robin over its
    copies (``baselines.round_robin_split``), so each carries its load / copies (+-1), as the
    packing assumes. Weight copies relative to the home layout: ``weight_copies``.

    Returns:
        A ``Placement`` (physical_expert [R, G + S], split [R, E, R]).
    """
    R, E = validate_load(load)
    check_num_slots(num_slots)
    if bool((load < 0).any()):
        raise ValueError("load has negative entries")
    P = E // R + num_slots
    for name, value in (("num_groups", num_groups), ("num_nodes", num_nodes)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1
        ):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if num_groups is None or num_groups % num_nodes:
        num_groups, num_nodes = 1, 1  # EPLB's global policy
    if E % num_groups or R % num_nodes:
        raise ValueError(
            f"num_groups must divide E={E} and num_nodes must divide R={R}, got "
            f"num_groups={num_groups}, num_nodes={num_nodes}"
        )
    lam = load.sum(0).cpu().numpy().astype(np.float64)  # [E]

    # Groups to nodes: node k gets the experts node_experts[k] (in EPLB's node-major order).
    group_size, groups_per_node = E // num_groups, num_groups // num_nodes
    group_pack, group_position = _balanced_packing(
        lam.reshape(num_groups, group_size).sum(1), num_nodes
    )
    slot_of_group = group_pack * groups_per_node + group_position  # [num_groups]
    node_experts = np.empty(E, np.int64)
    node_experts[
        (slot_of_group.repeat(group_size) * group_size + np.tile(np.arange(group_size), num_groups))
    ] = np.arange(E)
    node_experts = node_experts.reshape(num_nodes, E // num_nodes)

    ranks_per_node = R // num_nodes
    physical_expert = np.empty((R, P), np.int64)
    for k in range(num_nodes):
        experts = node_experts[k]
        phy2log, count = replicate(lam[experts], ranks_per_node * P)
        pack, position = _balanced_packing((lam[experts] / count)[phy2log], ranks_per_node)
        physical_expert[k * ranks_per_node + pack, position] = experts[phy2log]

    # Instances of each expert in physical-slot order -> host_rank [E, M] padded with R.
    flat = physical_expert.reshape(-1)
    order = np.argsort(flat, kind="stable")
    copies = np.bincount(flat, minlength=E)
    host_rank = np.full((E, int(copies.max())), R, np.int64)
    host_rank[flat[order], np.arange(R * P) - np.repeat(np.cumsum(copies) - copies, copies)] = (
        order // P
    )
    split = round_robin_split(load, torch.from_numpy(host_rank))
    return Placement(torch.from_numpy(physical_expert).to(load.device), split)
