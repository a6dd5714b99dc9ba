"""The router's top-k expert indices ``[T, k]`` for the balanced dispatchers: tapped in the
router's ``router_replay`` hook (:class:`TopKIndicesTap`), else a top-k over the routing map
(:func:`topk_indices`) where the routing never asks the hook.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class TopKIndicesTap:
    """A router's ``router_replay`` hook that keeps the top-k expert indices it hands out.

    Args:
        replay: megatron's ``RouterReplay`` of the router, or ``None``; the indices come from it
            when set, else from megatron's own top-k (``default_compute_topk``).
    """

    def __init__(self, replay=None):
        self.replay = replay
        self.indices: Optional[torch.Tensor] = None  # [T, k] int64, of the latest routing
        self._layer_number = None

    @property
    def layer_number(self):
        return self.replay.layer_number if self.replay is not None else self._layer_number

    @layer_number.setter
    def layer_number(self, value):  # TopKRouter.set_layer_number sets it on its hook
        if self.replay is not None:
            self.replay.layer_number = value
        self._layer_number = value

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: Optional[int] = None,
        group_topk: Optional[int] = None,
        default_compute_topk: Callable = None,
    ):
        if self.replay is not None:
            values, indices = self.replay.get_replay_topk(
                scores, topk, num_groups, group_topk, default_compute_topk
            )
        else:
            values, indices = default_compute_topk(
                scores, topk, num_groups=num_groups, group_topk=group_topk
            )
        self.indices = indices
        return values, indices


def install_topk_tap(router) -> Optional[TopKIndicesTap]:
    """Put a :class:`TopKIndicesTap` in ``router``'s ``router_replay`` hook (a megatron
    ``TopKRouter``); ``None`` for a router without that hook."""
    if not hasattr(router, "router_replay"):
        return None
    tap = TopKIndicesTap(router.router_replay)
    router.router_replay = tap
    return tap


def topk_indices(
    tap: Optional[TopKIndicesTap], routing_map: torch.Tensor, topk: int
) -> torch.Tensor:
    """The ``[T, k]`` int64 expert indices of ``routing_map`` ([T, E] bool, exactly ``topk`` per
    token): the tap's, when it saw this routing, else a top-k over the map (order within a token
    is irrelevant to the dispatchers). Device work only: no host read."""
    if tap is not None:
        indices, tap.indices = tap.indices, None  # each routing's indices are used once
        if indices is not None and tuple(indices.shape) == (routing_map.size(0), topk):
            return indices if indices.dtype == torch.int64 else indices.long()
    # A bool map viewed as bytes: ones at the routed experts, so its top-k are exactly them.
    return routing_map.view(torch.uint8).topk(topk, dim=1, sorted=False).indices
