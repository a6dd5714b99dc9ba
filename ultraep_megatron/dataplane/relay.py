"""Relay trees (§6.2 of the UltraEP paper): which replica hosts of a hot expert forward it to the others.

A relayed expert's home sends to a small relay set (frontier ``round(sqrt(n))`` for ``n`` remote
replicas); each relay is itself a replica host and forwards to its leaves from its own replica slot.

Relay trees are load-aware: per-rank send volumes under the direct schedule are tracked, relays are
the expert's replica hosts with the least send volume, and each leaf is attached to the relay that
stays least loaded. In ``"adaptive"`` mode a tree is built only where it lowers the send volume of a
current bottleneck rank without creating a new bottleneck, and kept only if the max per-rank send
volume would be higher without it: relay is either absent or strictly lowers the max.
"""

from __future__ import annotations

import math

__all__ = ["RELAY_MODES", "relay_trees"]

RELAY_MODES = ("off", "adaptive", "always")


def _frontier_size(num_replicas: int) -> int:
    """Relay frontier ≈ sqrt(n): balances the source's fan-out against each relay's."""
    return max(1, int(math.floor(math.sqrt(num_replicas) + 0.5)))


def _relay_tree(
    hosts: list[int], home: int, volume: list[int]
) -> tuple[list[int], dict[int, int], list[int]]:
    """Choose relays and attach leaves for one expert, load-aware.

    Args:
        hosts: remote replica host ranks of the expert, ascending.
        home: its home rank.
        volume: current per-rank send volume in experts (length R); not modified.

    Returns:
        ``(relays, parent_of_leaf, new_volume)``.
    """
    n = len(hosts)
    frontier = _frontier_size(n)
    relays = sorted(sorted(hosts, key=lambda r: (volume[r], r))[:frontier])
    new_volume = list(volume)
    new_volume[home] -= n - frontier
    parent_of_leaf: dict[int, int] = {}
    for leaf in hosts:
        if leaf in relays:
            continue
        # The relay whose send volume stays smallest after taking this leaf (ties: lower rank).
        best = min(relays, key=lambda r: (new_volume[r] + 1, r))
        new_volume[best] += 1
        parent_of_leaf[leaf] = best
    return relays, parent_of_leaf, new_volume


def relay_trees(
    hosts_of: dict[int, list[tuple[int, int]]],
    volume: list[int],
    experts_per_rank: int,
    relay: str,
    relay_threshold: int,
) -> dict[int, dict[int, int]]:
    """The relay trees of a plan, ``{expert: {leaf rank: relay rank}}`` (relayed experts only).

    Args:
        hosts_of: ``{expert: [(rank, slot), ...]}``, its remote replica hosts, ascending rank.
        volume: per-rank send volume in experts under the direct schedule (length R); not modified.
        experts_per_rank: E // R (expert ``e``'s home is ``e // experts_per_rank``).
        relay: one of :data:`RELAY_MODES`.
        relay_threshold: an expert is relay-eligible when it has more than this many remote replicas.
    """
    volume = list(volume)
    parent: dict[int, dict[int, int]] = {}  # expert -> {leaf: relay}, relayed experts only
    if relay != "off":
        candidates = {e for e, hs in hosts_of.items() if len(hs) > relay_threshold}
        while candidates:
            # Hottest source first: the expert whose home currently sends the most.
            e = max(candidates, key=lambda x: (volume[x // experts_per_rank], len(hosts_of[x]), -x))
            candidates.discard(e)
            home = e // experts_per_rank
            old_home_volume = volume[home]
            if relay == "adaptive" and old_home_volume < max(volume):
                # The bottleneck rank has no eligible expert left; relaying elsewhere cannot lower the max.
                break
            hosts = [r for r, _ in hosts_of[e]]
            relays, parent_of_leaf, new_volume = _relay_tree(hosts, home, volume)
            if (
                relay == "adaptive"
                and max(new_volume[r] for r in [home, *relays]) >= old_home_volume
            ):
                continue  # would not lower the bottleneck
            volume = new_volume
            parent[e] = parent_of_leaf
        if relay == "adaptive":
            # A tree that lowered one of several tied bottleneck ranks is useless if another of them
            # could not be lowered: drop (latest first) every tree whose removal keeps the final max.
            final_max = max(volume)
            for e in reversed(list(parent)):
                home, tree = e // experts_per_rank, parent[e]
                if volume[home] + len(tree) <= final_max:
                    volume[home] += len(tree)
                    for relay_rank in tree.values():
                        volume[relay_rank] -= 1
                    del parent[e]
    return parent
