"""UltraEP's peers as pure planners on the exact load of one layer-microbatch.

Re-implemented from the peers' public code and descriptions (facts only, own code):

- ``deepseek_eplb(load, S)``: DeepSeek's EPLB (github.com/deepseek-ai/EPLB, ``rebalance_experts``)
  as DeepSeek runs it: it **re-places every expert**. The E + R*S physical experts (G + S per rank)
  are chosen and packed from scratch, so main experts move too.
- ``llep(load)``: Least-Loaded Expert Parallelism (Salesforce AI Research, LeastLoadedEP; the same
  planner in torchtitan PR 2465): main experts stay at home; an overloaded rank's excess tokens,
  with the expert's weights, spill to the least-loaded ranks; no slot limit.

The fixed-layout EPLB baselines (mains at home, the paper's EPLB) are ``baselines.eplb`` and
``baselines.eplb_exact``.

A balancer that moves main experts cannot be written as a ``Plan`` (whose physical slot ``t*L+j``
is main expert ``t*G+j``), so outcomes are compared as ``Placement``s (``Placement.from_plan`` for
the others) with ``placement_metrics``: imbalance, memory spread, weight copies relative to the
home layout (main-expert moves included), cross-domain copies, fan-out, in-flight tokens.

Not on the hot path: plain numpy/torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from . import load_imbalance, rank_imbalance, validate_domain_size, validate_load
from .baselines import _check_slots, identity_plan, round_robin_split
from .plan import Plan, plan_from_split

__all__ = ["Placement", "deepseek_eplb", "llep", "weight_copies", "main_moves",
           "cross_domain_copies", "placement_metrics", "LABELS", "LLEP_CAPACITY_FACTOR",
           "LLEP_MIN_TOKENS_PER_GEMM", "LLEP_TRIGGER"]

#: LLEP's defaults (LeastLoadedEP: ``max_tokens_factor``, ``min_tokens_per_gemm``,
#: ``MOE_ADAPTIVE_LPT_ROUTING_RATIO``).
LLEP_CAPACITY_FACTOR, LLEP_MIN_TOKENS_PER_GEMM, LLEP_TRIGGER = 1.1, 1024, 1.3

#: Display labels, with each peer's parameters.
LABELS = {
    "deepseek-eplb": "deepseek-eplb (re-places all experts; E + R*S physical experts)",
    "llep": "llep (alpha capacity factor, m min tokens per GEMM, lambda trigger)",
}


@dataclass(frozen=True, eq=False)
class Placement:
    """Where a balancer puts the experts and computes the tokens of one layer-microbatch.

    Attributes:
        physical_expert: int64 [R, L] logical expert of each physical expert slot of each rank, -1
            if empty. A rank may hold several copies of one expert (DeepSeek's EPLB allows it).
        split: int64 [R, E, R] tokens of expert e from source rank s computed on rank t.
    """

    physical_expert: torch.Tensor
    split: torch.Tensor

    @classmethod
    def from_plan(cls, plan: Plan) -> "Placement":
        return cls(plan.physical_expert, plan.split)

    @property
    def quota(self) -> torch.Tensor:
        """[E, R] tokens of expert e computed on rank t."""
        return self.split.sum(0)

    @cached_property
    def instances(self) -> torch.Tensor:
        """bool [E, R]: rank t holds expert e's weights (one copy or more)."""
        R, E = self.physical_expert.shape[0], self.split.shape[1]
        out = torch.zeros((E + 1, R), dtype=torch.bool, device=self.split.device)
        ranks = torch.arange(R, device=out.device).view(R, 1).expand_as(self.physical_expert)
        out[self.physical_expert.reshape(-1) % (E + 1), ranks.reshape(-1)] = True  # -1: spare row
        return out[:E]


def _home_mask(num_experts: int, num_ranks: int, device) -> torch.Tensor:
    """bool [E, R]: rank t is expert e's home (e // G)."""
    home = torch.arange(num_experts, device=device) // (num_experts // num_ranks)
    return home.view(-1, 1) == torch.arange(num_ranks, device=device).view(1, -1)


def weight_copies(placement: Placement) -> int:
    """Expert weights sent to reach this placement from the home layout (expert e on rank e // G):
    one per (expert, rank) where the rank holds the expert and is not its home. Replicas and moved
    main experts alike; several copies on one rank count once (one transfer, then a local copy)."""
    inst = placement.instances
    return int((inst & ~_home_mask(*inst.shape, inst.device)).sum())


def main_moves(placement: Placement) -> int:
    """Experts whose home rank no longer holds them (re-placed main experts)."""
    inst = placement.instances
    return int((~inst & _home_mask(*inst.shape, inst.device)).any(1).sum())


def cross_domain_copies(placement: Placement, domain_size: int | None) -> int:
    """Weight copies (``weight_copies``) landing outside the expert's home NVLink domain."""
    inst = placement.instances
    E, R = inst.shape
    N = validate_domain_size(domain_size, R)
    home_domain = torch.arange(E, device=inst.device) // (E // R) // N
    rank_domain = torch.arange(R, device=inst.device) // N
    return int((inst & (home_domain.view(E, 1) != rank_domain.view(1, R))).sum())


def placement_metrics(load: torch.Tensor, placement: Placement, *,
                      domain_size: int | None = None) -> dict:
    """Comparison metrics of any balancer's ``placement`` on ``load`` [R, E] (Python scalars).

    imbalance_before / imbalance_after (max / mean rank load without balancing / computed under
    the placement), memory_spread_before / memory_spread_after (max / mean rows each rank receives;
    equal to the imbalances, see ``planner.metrics``), weight_copies, main_moves,
    cross_domain_copies (``domain_size`` ranks per NVLink domain), max_fanout (most ranks holding
    one expert), inflight_ratio (share of tokens computed off their source rank).
    """
    R, E = validate_load(load)
    split = placement.split
    if tuple(split.shape) != (R, E, R) or placement.physical_expert.shape[0] != R:
        raise ValueError("placement and load have different shapes")
    if not torch.equal(split.sum(2), load):
        raise ValueError("placement does not compute exactly the load")
    total = int(load.sum())
    imbalance_before = rank_imbalance(load)
    return {
        "imbalance_before": imbalance_before,
        "imbalance_after": float(load_imbalance(placement.quota.sum(0))),
        "memory_spread_before": imbalance_before,
        "memory_spread_after": float(load_imbalance(split.sum((0, 1)))),  # rows received [R]
        "weight_copies": weight_copies(placement),
        "main_moves": main_moves(placement),
        "cross_domain_copies": cross_domain_copies(placement, domain_size),
        "max_fanout": int(placement.instances.sum(1).max()),
        "inflight_ratio": 1.0 - int(split.diagonal(dim1=0, dim2=2).sum()) / total if total else 0.0,
    }


# ---- DeepSeek's EPLB (re-placing) ---------------------------------------------------------------

def _replicate(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray]:
    """EPLB's replication: ``num_physical - n`` times give one more copy to the expert with the
    largest load per copy (ties: lowest id; no cap on copies). weight float [n] ->
    (phy2log int64 [num_physical]: the n experts then the added copies, count int64 [n])."""
    n = weight.shape[0]
    phy2log = np.concatenate([np.arange(n), np.zeros(num_physical - n, np.int64)])
    count = np.ones(n, np.int64)
    for i in range(n, num_physical):
        e = int(np.argmax(weight / count))  # first maximum
        phy2log[i] = e
        count[e] += 1
    return phy2log, count


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


def deepseek_eplb(load: torch.Tensor, num_slots: int, *, num_groups: int | None = None,
                  num_nodes: int = 1) -> Placement:
    """DeepSeek's EPLB on the exact load: every expert re-placed, mains included.

    Args:
        load: int64 [R, E].
        num_slots: S; there are E + R*S physical experts, L = G + S on every rank (as many
            physical slots as UltraEP's layout, none reserved for the home experts).
        num_groups, num_nodes: DeepSeek's hierarchical policy when ``num_groups`` is given and a
            multiple of ``num_nodes`` (EPLB's condition): the E experts form ``num_groups`` groups
            of consecutive ids, groups are packed to nodes (R / num_nodes ranks each, e.g. NVLink
            domains) balancing their load, then replicas are made and packed inside each node.
            Otherwise (the default) the global policy: replicate over all experts, pack to all
            ranks.

    Replication gives the R*S extra copies one at a time to the expert with the largest load per
    copy; packing puts the copies, by descending load per copy, on the least-loaded rank that still
    has a free physical slot (``_replicate``, ``_balanced_packing``; ties by lowest index where
    EPLB's unstable sort leaves them open). Tokens of an expert are spread round-robin over its
    copies (``baselines.round_robin_split``), so each carries its load / copies (+-1), as the
    packing assumes. Weight copies relative to the home layout: ``weight_copies``.

    Returns:
        A ``Placement`` (physical_expert [R, G + S], split [R, E, R]).
    """
    R, E = validate_load(load)
    _check_slots(num_slots)
    if bool((load < 0).any()):
        raise ValueError("load has negative entries")
    L = E // R + num_slots
    for name, value in (("num_groups", num_groups), ("num_nodes", num_nodes)):
        if value is not None and (isinstance(value, bool)
                                  or not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if num_groups is None or num_groups % num_nodes:
        num_groups, num_nodes = 1, 1  # EPLB's global policy
    if E % num_groups or R % num_nodes:
        raise ValueError(f"num_groups must divide E={E} and num_nodes must divide R={R}, got "
                         f"num_groups={num_groups}, num_nodes={num_nodes}")
    lam = load.sum(0).cpu().numpy().astype(np.float64)  # [E]

    # Groups to nodes: node k gets the experts node_experts[k] (in EPLB's node-major order).
    group_size, groups_per_node = E // num_groups, num_groups // num_nodes
    group_pack, group_position = _balanced_packing(lam.reshape(num_groups, group_size).sum(1),
                                                   num_nodes)
    slot_of_group = group_pack * groups_per_node + group_position  # [num_groups]
    node_experts = np.empty(E, np.int64)
    node_experts[(slot_of_group.repeat(group_size) * group_size
                  + np.tile(np.arange(group_size), num_groups))] = np.arange(E)
    node_experts = node_experts.reshape(num_nodes, E // num_nodes)

    ranks_per_node = R // num_nodes
    physical_expert = np.empty((R, L), np.int64)
    for k in range(num_nodes):
        experts = node_experts[k]
        phy2log, count = _replicate(lam[experts], ranks_per_node * L)
        pack, position = _balanced_packing((lam[experts] / count)[phy2log], ranks_per_node)
        physical_expert[k * ranks_per_node + pack, position] = experts[phy2log]

    # Instances of each expert in physical-slot order -> host_rank [E, M] padded with R.
    flat = physical_expert.reshape(-1)
    order = np.argsort(flat, kind="stable")
    copies = np.bincount(flat, minlength=E)
    host_rank = np.full((E, int(copies.max())), R, np.int64)
    host_rank[flat[order], np.arange(R * L) - np.repeat(np.cumsum(copies) - copies, copies)] = (
        order // L)
    split = round_robin_split(load, torch.from_numpy(host_rank))
    return Placement(torch.from_numpy(physical_expert).to(load.device), split)


# ---- LLEP --------------------------------------------------------------------------------------

def llep(load: torch.Tensor, *, capacity_factor: float = LLEP_CAPACITY_FACTOR,
         min_tokens_per_gemm: int = LLEP_MIN_TOKENS_PER_GEMM, trigger: float | None = LLEP_TRIGGER) -> Plan:
    """Least-Loaded Expert Parallelism's plan (LPT with weight spilling) on the exact load.

    Args:
        load: int64 [R, E].
        capacity_factor: alpha; a rank's capacity is ``int(alpha * (total // R))`` tokens (LLEP's
            ``max_tokens_factor``, default 1.1).
        min_tokens_per_gemm: m; a spilled chunk smaller than m is skipped in favour of a helper
            with more room (default 1024).
        trigger: lambda; when the rank imbalance (max / mean rank load, home layout) is below it,
            no balancing at all: the identity plan (LLEP's ``MOE_ADAPTIVE_LPT_ROUTING_RATIO``,
            default 1.3). ``None`` or <= 0: always balance.

    Experts by descending load (ties: lowest id). A rank's effective load is what it has been
    assigned plus its not-yet-processed home experts. The expert's home takes what fits under the
    capacity; the rest spills, in chunks of ``min(remaining, room)``, to the rank with the least
    effective load that has room (one rank after another while the home is full before it starts).
    Neither limit is hard: a chunk below m is taken when it is the expert's last one, the home's
    own share may be any size, and when no rank has room the remainder is forced onto the least
    loaded rank, capacity or not. Tokens of an expert, ordered by source rank, fill its chunks in
    order (home first).

    Returns:
        A ``Plan``: main experts at home (a main instance may carry 0), the spilled experts in
        ``slot_expert`` [R, S'], S' = most distinct spilled experts on one rank (0 without
        spills). LLEP may send one expert twice to a rank (two chunks); it is one instance here.
    """
    R, E = validate_load(load)
    if bool((load < 0).any()):
        raise ValueError("load has negative entries")
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor!r}")
    if (isinstance(min_tokens_per_gemm, bool)
            or not isinstance(min_tokens_per_gemm, (int, np.integer)) or min_tokens_per_gemm < 0):
        raise ValueError(f"min_tokens_per_gemm must be an int >= 0, got {min_tokens_per_gemm!r}")
    G = E // R
    lam = load.sum(0).tolist()
    rank_load = [sum(lam[r * G:(r + 1) * G]) for r in range(R)]
    if trigger is not None and trigger > 0 and rank_imbalance(load) < trigger:
        return identity_plan(load, 0)
    total = sum(lam)
    balanced = total // R
    capacity = max(int(capacity_factor * balanced) if balanced > 0 else total, 1)
    m = int(min_tokens_per_gemm)
    pending, assigned = list(rank_load), [0] * R

    def by_effective_load(home):
        """Other ranks as (rank, room), least effective load first (ties: lowest rank)."""
        others = sorted((g for g in range(R) if g != home), key=lambda g: assigned[g] + pending[g])
        return [(g, capacity - assigned[g] - pending[g]) for g in others]

    chunks: dict[int, list[tuple[int, int]]] = {}  # expert -> [(rank, tokens)] in token order
    for e in sorted(range(E), key=lambda x: -lam[x]):
        tokens, home = lam[e], e // G
        if tokens == 0:
            continue
        pending[home] -= tokens
        room = capacity - assigned[home] - pending[home]
        mine = []
        if room > 0:  # the home takes what fits; each further chunk to the best helper ranked now
            mine.append((home, min(tokens, room)))
            assigned[home] += mine[0][1]
            remaining = tokens - mine[0][1]
            while remaining > 0:
                helpers = by_effective_load(home)
                # a chunk is min(remaining, room); one below m only when it is the last
                fits = [(g, min(remaining, r)) for g, r in helpers
                        if r > 0 and (r >= remaining or r >= m)]
                g, c = fits[0] if fits else (helpers[0][0] if helpers else home, remaining)
                mine.append((g, c))
                assigned[g] += c
                remaining -= c
        else:  # the home is full: one pass over the helpers as ranked now
            remaining = tokens
            helpers = by_effective_load(home)
            for g, r in helpers:
                if remaining > 0 and r > 0 and (r >= remaining or r >= m):
                    c = min(remaining, r)
                    mine.append((g, c))
                    assigned[g] += c
                    remaining -= c
            if remaining > 0:  # forced: no room (or only chunks below m) left
                g = helpers[0][0] if helpers else home
                mine.append((g, remaining))
                assigned[g] += remaining
        chunks[e] = mine

    # Source s's tokens of e occupy [cum[s], cum[s+1]) in source order; chunks take consecutive
    # intervals. split[s, e, t] = overlap.
    load_np = load.cpu().numpy()
    split = np.zeros((R, E, R), np.int64)
    slots: list[list[int]] = [[] for _ in range(R)]
    for e, mine in chunks.items():
        cum = np.concatenate([[0], np.cumsum(load_np[:, e])])
        ends = np.cumsum([c for _, c in mine])
        starts = ends - np.array([c for _, c in mine])
        overlap = (np.minimum(cum[1:, None], ends[None]) - np.maximum(cum[:-1, None], starts[None]))
        np.add.at(split[:, e], (slice(None), [g for g, _ in mine]), np.maximum(overlap, 0))
        for g, _ in mine:
            if g != e // G and e not in slots[g]:
                slots[g].append(e)
    width = max(len(s) for s in slots)
    slot_expert = torch.full((R, width), -1, dtype=torch.int64)
    for g, s in enumerate(slots):
        slot_expert[g, :len(s)] = torch.tensor(s, dtype=torch.int64)
    return plan_from_split(slot_expert.to(load.device), torch.from_numpy(split).to(load.device))
