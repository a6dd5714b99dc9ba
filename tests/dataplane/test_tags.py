"""Message tags (``tags.py``, single process): a TagSequence numbers transfers in order and refuses a
schedule whose messages do not fit the tag space, taking no number for it."""

from __future__ import annotations

import pytest
import torch

from ultraep_megatron.dataplane import build_schedule
from ultraep_megatron.dataplane.tags import _SEQUENCES, TagSequence


def test_a_sequence_numbers_transfers_in_order_and_wraps():
    plan = torch.tensor([[-1], [0]])  # expert 0 (home rank 0) replicated on rank 1: one edge
    small = build_schedule(plan, 2, 90, chunk_numel=13)
    tags, other = TagSequence(), TagSequence()
    assert [tags.take(small, 2).sequence for _ in range(3)] == [0, 1, 2]
    assert other.take(small, 2).sequence == 0  # each sequence its own
    too_many = build_schedule(plan, 2, 1 << 20, chunk_numel=1)  # 2**20 chunks on one edge
    with pytest.raises(ValueError, match="message tags"):
        tags.take(too_many, 2)
    assert tags.take(small, 2).sequence == 3  # the refused schedule took no number
    for _ in range(_SEQUENCES - 4):
        tags.take(small, 2)
    assert tags.take(small, 2).sequence == 0  # modulo the sequences a tag can carry
