"""The data plane's one object, ReplicaBuffer (``buffer.py``): its buffers and views, its schedule
cache, and the sequence numbering its transfers' message tags, with the handles its transfers return
(the transfers themselves: ``test_transfers.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dataplane_helpers import SHAPES, expert_weights, flat, main_grad, random_plan, run_world
from ultraep_megatron.dataplane import ReplicaBuffer, build_schedule
from ultraep_megatron.dataplane.tags import _TAG_BITS


def test_replica_buffer_allocates_both_buffers():
    buffer = ReplicaBuffer(3, [(6, 4), (4, 3)], torch.bfloat16)
    assert (
        buffer.replica_weights.shape == (3, 36) and buffer.replica_weights.dtype == torch.bfloat16
    )
    assert buffer.replica_grads.shape == (3, 36) and buffer.replica_grads.dtype == torch.float32
    assert bool((buffer.replica_grads == 0).all())
    assert [tuple(v.shape) for v in buffer.grad_views(2)] == [(6, 4), (4, 3)]
    # The views are made once and stay views of the buffers: what lands in them lands in the slot.
    assert buffer.weight_views(1)[0] is buffer.weight_views(1)[0]
    buffer.grad_views(2)[1].fill_(5.0)
    buffer.weight_views(0)[0].fill_(3.0)
    assert buffer.replica_grads[2].tolist() == [0.0] * 24 + [5.0] * 12
    assert bool((buffer.replica_weights[0, :24] == 3).all()) and bool(
        (buffer.replica_weights[1:] == 0).all()
    )
    with pytest.raises(ValueError, match="slots per rank"):
        buffer.schedule(torch.full((2, 2), -1, dtype=torch.int64), 4)


def _same_schedule(a, b) -> bool:
    """Field by field: the edges, local copies and relays of two schedules."""
    names = (
        "slot_expert",
        "edge_expert",
        "edge_src",
        "edge_src_slot",
        "edge_dst",
        "edge_dst_slot",
        "edge_hop",
        "local_expert",
        "local_rank",
        "local_slot",
        "relayed_experts",
    )
    return all(torch.equal(getattr(a, n), getattr(b, n)) for n in names) and (
        (a.num_experts, a.expert_numel, a.chunk_numel)
        == (b.num_experts, b.expert_numel, b.chunk_numel)
    )


def test_replica_buffer_reuses_the_schedule_of_a_recurring_placement():
    buffer = ReplicaBuffer(
        2, [(6, 4), (4, 3)], torch.float32, chunk_numel=7, relay="always", relay_threshold=1
    )
    placement = torch.tensor([[-1, 5], [0, 6], [0, -1], [0, 1]])
    first = buffer.schedule(placement, 8)
    assert buffer.schedule(placement.clone(), 8) is first  # same contents, another tensor: reused
    assert _same_schedule(
        first, build_schedule(placement, 8, 36, chunk_numel=7, relay="always", relay_threshold=1)
    )
    # Keyed on the contents: a placement changed in place gets its own schedule.
    placement[1, 1] = 2
    changed = buffer.schedule(placement, 8)
    assert changed is not first and not _same_schedule(changed, first)
    assert _same_schedule(
        changed, build_schedule(placement, 8, 36, chunk_numel=7, relay="always", relay_threshold=1)
    )
    # Bounded: the least recently used placement is dropped (and rebuilt, equal, on its return).
    buffer._schedules.capacity = 3  # its ScheduleCache, bounded lower for the test
    kept = buffer.schedule(placement, 8)
    for e in range(3):
        buffer.schedule(torch.tensor([[-1, -1], [e, -1], [-1, -1], [-1, -1]]), 8)
    rebuilt = buffer.schedule(placement, 8)
    assert rebuilt is not kept and _same_schedule(rebuilt, kept)
    # An invalid placement is refused every time, never cached.
    for _ in range(2):
        with pytest.raises(ValueError, match="more than one slot"):
            buffer.schedule(torch.tensor([[-1, -1], [2, 2], [-1, -1], [-1, -1]]), 8)


def _numbered_transfers(rank, world_size):
    """Two buffers on the default group: the sequence numbers in the message tags of each transfer
    (from every batch it issued), whether its handle was done before and after ``wait()``, and
    whether the replicas arrived."""
    numbers = []  # per batch issued: the sequence numbers of its tags
    original = dist.batch_isend_irecv

    def recording(ops):  # the batches of a HostCommStream's thread too
        numbers.append({op.tag >> _TAG_BITS for op in ops})
        return original(ops)

    num_experts = 2 * world_size
    plan = random_plan(world_size, num_experts, 2, seed=7, hot_expert=1)
    first, second = (
        ReplicaBuffer(2, SHAPES, torch.float32, chunk_numel=13, relay="always", relay_threshold=2)
        for _ in range(2)
    )
    sched = first.schedule(plan, num_experts)
    main = [expert_weights(7, rank * 2 + j) for j in range(2)]
    grads = [main_grad(7, rank * 2 + j, True) for j in range(2)]
    steps = [
        ("first: distribute", lambda: first.distribute_weights(sched, main)),
        ("first: reduce", lambda: first.reduce_gradients(sched, grads)),
        ("second: distribute", lambda: second.distribute_weights(sched, main)),
        ("first: distribute async", lambda: first.distribute_weights(sched, main, async_op=True)),
        ("first: bad input", lambda: first.distribute_weights(sched, main[:1])),
        ("first: distribute again", lambda: first.distribute_weights(sched, main)),
        ("second: reduce async", lambda: second.reduce_gradients(sched, grads, async_op=True)),
    ]
    seen = {}
    dist.batch_isend_irecv = recording
    try:
        for name, call in steps:
            numbers.clear()
            done = None
            try:
                handle = call()
                if handle is not None:
                    done = [handle.done()]
                    handle.wait()
                    done.append(handle.done())
            except ValueError:
                done = "ValueError"
            seen[name] = (sorted(set().union(*numbers)), done)
    finally:
        dist.batch_isend_irecv = original
    arrived = all(
        torch.equal(buffer.replica_weights[s], flat(expert_weights(7, e)))
        for buffer in (first, second)
        for s, e in enumerate(plan[rank].tolist())
        if e >= 0
    )
    return seen, arrived


def test_each_buffer_numbers_its_own_transfers_and_handles_are_done_after_wait():
    """Every transfer takes the next number of its buffer's own sequence (distributions and
    reductions alike, synchronous or not; a call refused before communicating takes none), and a
    second buffer on the same group starts its own from 0. ``done()`` is False until ``wait()``."""
    expected = {
        "first: distribute": ([0], None),
        "first: reduce": ([1], None),
        "second: distribute": ([0], None),
        "first: distribute async": ([2], [False, True]),
        "first: bad input": ([], "ValueError"),
        "first: distribute again": ([3], None),
        "second: reduce async": ([1], [False, True]),
    }
    for rank, (seen, arrived) in enumerate(run_world(4, _numbered_transfers)):
        assert seen == expected, f"rank {rank}"
        assert arrived, f"rank {rank}: a replica differs from its expert"
