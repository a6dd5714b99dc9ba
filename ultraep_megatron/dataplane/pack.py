"""Expert state as flat rows: one expert's tensors flattened and concatenated in order.

The replica buffers hold one such row per slot (``[num_slots, expert_numel]``); an expert streamed
through a relay tree is packed into one at its home, since its chunks cross tensor boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ExpertTensors", "pack_experts", "expert_views", "unpack_experts"]

#: Experts as sequences of tensors (e.g. ``[linear_fc1.weight, linear_fc2.weight]``), same shapes
#: for every expert.
ExpertTensors = Sequence[Sequence[torch.Tensor]]


@torch.no_grad()
def pack_experts(experts: ExpertTensors, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Flatten experts into rows.

    Args:
        experts: ``n`` experts, each a sequence of tensors (same shapes for every expert).
        dtype: output dtype (default: the tensors' dtype).

    Returns:
        ``[n, expert_numel]`` contiguous tensor; row ``i`` is expert ``i``'s tensors flattened and
        concatenated in order.
    """
    if len(experts) == 0:
        raise ValueError("pack_experts needs at least one expert")
    first = experts[0]
    dtype = dtype or first[0].dtype
    numel = sum(t.numel() for t in first)
    out = torch.empty(len(experts), numel, dtype=dtype, device=first[0].device)
    for row, expert in zip(out, experts):
        offset = 0
        for t in expert:  # one pass per tensor: copy and cast together
            row[offset : offset + t.numel()].view(t.shape).copy_(t)
            offset += t.numel()
    return out


def expert_views(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of a flat ``[expert_numel]`` row as tensors of ``shapes`` (inverse of one packed row)."""
    sizes = [torch.Size(s).numel() for s in shapes]
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise ValueError(
            f"flat must be 1-D with {sum(sizes)} elements, got shape {tuple(flat.shape)}"
        )
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]


def unpack_experts(experts: ExpertTensors, rows: torch.Tensor) -> None:
    """Copy ``rows`` (``[n, expert_numel]``) back into the per-expert tensors, casting to their dtype."""
    for expert, row in zip(experts, rows):
        offset = 0
        for t in expert:
            t.copy_(row[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
