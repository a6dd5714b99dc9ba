"""Packing of per-expert tensors into flat rows and back (single process)."""

from __future__ import annotations

import pytest
import torch

from ultraep_megatron.dataplane import ReplicaBuffer, expert_views, pack_experts


def test_pack_concatenates_each_expert_in_order_and_casts():
    experts = [[torch.arange(6.0).view(2, 3) + 10 * i, torch.arange(4.0).view(4, 1) - i] for i in range(3)]
    packed = pack_experts(experts, torch.float64)
    assert packed.shape == (3, 10) and packed.dtype == torch.float64
    for i in range(3):
        assert packed[i].tolist() == [float(x + 10 * i) for x in range(6)] + [float(x - i) for x in range(4)]


def test_pack_of_parameters_does_not_track_autograd():
    experts = [[torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(5))]]
    packed = pack_experts(experts)
    assert not packed.requires_grad and packed.grad_fn is None


def test_expert_views_invert_one_packed_row():
    shapes = [(4, 3), (3, 2)]
    expert = [torch.randn(s) for s in shapes]
    row = pack_experts([expert])[0]
    views = expert_views(row, shapes)
    assert all(torch.equal(v, t) for v, t in zip(views, expert))
    views[1].fill_(7.0)  # views share storage with the row
    assert bool((row[12:] == 7.0).all())
    with pytest.raises(ValueError, match="18 elements"):
        expert_views(torch.zeros(17), shapes)


def test_replica_buffer_allocates_both_buffers():
    buffer = ReplicaBuffer(3, [(6, 4), (4, 3)], torch.bfloat16)
    assert buffer.replica_weights.shape == (3, 36) and buffer.replica_weights.dtype == torch.bfloat16
    assert buffer.replica_grads.shape == (3, 36) and buffer.replica_grads.dtype == torch.float32
    assert bool((buffer.replica_grads == 0).all())
    assert [tuple(v.shape) for v in buffer.grad_views(2)] == [(6, 4), (4, 3)]
    # The views are made once and stay views of the buffers: what lands in them lands in the slot.
    assert buffer.weight_views(1)[0] is buffer.weight_views(1)[0]
    buffer.grad_views(2)[1].fill_(5.0)
    buffer.weight_views(0)[0].fill_(3.0)
    assert buffer.replica_grads[2].tolist() == [0.0] * 24 + [5.0] * 12
    assert bool((buffer.replica_weights[0, :24] == 3).all()) and bool((buffer.replica_weights[1:] == 0).all())
    with pytest.raises(ValueError, match="slots per rank"):
        buffer.schedule(torch.full((2, 2), -1, dtype=torch.int64), 4)


def _same_schedule(a, b) -> bool:
    """Field by field: the edges, local copies and relays of two schedules."""
    names = ("slot_expert", "edge_expert", "edge_src", "edge_src_slot", "edge_dst", "edge_dst_slot",
             "edge_hop", "local_expert", "local_rank", "local_slot", "relayed_experts")
    return all(torch.equal(getattr(a, n), getattr(b, n)) for n in names) and (
        (a.num_experts, a.expert_numel, a.chunk_numel) == (b.num_experts, b.expert_numel, b.chunk_numel))


def test_replica_buffer_reuses_the_schedule_of_a_recurring_placement():
    from ultraep_megatron.dataplane import build_schedule

    buffer = ReplicaBuffer(2, [(6, 4), (4, 3)], torch.float32, chunk_numel=7, relay="always", relay_threshold=1)
    placement = torch.tensor([[-1, 5], [0, 6], [0, -1], [0, 1]])
    first = buffer.schedule(placement, 8)
    assert buffer.schedule(placement.clone(), 8) is first  # same contents, another tensor: reused
    assert _same_schedule(first, build_schedule(placement, 8, 36, chunk_numel=7, relay="always",
                                                relay_threshold=1))
    # Keyed on the contents: a placement changed in place gets its own schedule.
    placement[1, 1] = 2
    changed = buffer.schedule(placement, 8)
    assert changed is not first and not _same_schedule(changed, first)
    assert _same_schedule(changed, build_schedule(placement, 8, 36, chunk_numel=7, relay="always",
                                                  relay_threshold=1))
    # Bounded: the least recently used placement is dropped (and rebuilt, equal, on its return).
    buffer.SCHEDULE_CACHE_SIZE = 3
    kept = buffer.schedule(placement, 8)
    for e in range(3):
        buffer.schedule(torch.tensor([[-1, -1], [e, -1], [-1, -1], [-1, -1]]), 8)
    rebuilt = buffer.schedule(placement, 8)
    assert rebuilt is not kept and _same_schedule(rebuilt, kept)
    # An invalid placement is refused every time, never cached.
    for _ in range(2):
        with pytest.raises(ValueError, match="more than one slot"):
            buffer.schedule(torch.tensor([[-1, -1], [2, 2], [-1, -1], [-1, -1]]), 8)


def test_host_comm_stream_runs_in_order_reports_errors_and_ends_with_its_owner():
    import gc
    import threading
    import time

    from ultraep_megatron.dataplane import HostCommStream

    stream = HostCommStream()
    order = []
    futures = [stream.submit(lambda i=i: (time.sleep(0.01 * (3 - i)), order.append(i))) for i in range(3)]
    failed = stream.submit(lambda: 1 / 0)
    assert [f.result(timeout=10) for f in futures] and order == [0, 1, 2]  # in order, whatever each takes
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=10)
    assert threading.get_ident() not in {stream.submit(threading.get_ident).result(timeout=10)}
    thread = stream._thread
    del stream, futures, failed
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def _group_ranks_on_subgroups(rank, world_size):
    import gc

    import torch.distributed as dist

    from ultraep_megatron.dataplane import engine

    upper, odd = dist.new_group([2, 3]), dist.new_group([1, 3])  # every rank creates both
    seen = {}
    for name, group, members in (("upper", upper, [2, 3]), ("odd", odd, [1, 3])):
        if rank in members:
            first = engine._group_rank(group)
            assert group in engine._group_ranks and engine._group_rank(group) == first
            seen[name] = first
    cached = len(engine._group_ranks)
    for group in (upper, odd):
        dist.destroy_process_group(group)
    del upper, odd, group
    gc.collect()
    return seen, cached, len(engine._group_ranks)


def test_group_rank_is_the_rank_in_the_group_and_not_kept_past_the_group():
    from _dataplane_world import run_world

    per_rank = run_world(4, _group_ranks_on_subgroups)
    assert [seen for seen, _, _ in per_rank] == [{}, {"odd": (0, 2)}, {"upper": (0, 2)},
                                                 {"upper": (1, 2), "odd": (1, 2)}]
    assert [(cached, left) for _, cached, left in per_rank] == [(0, 0), (1, 0), (1, 0), (2, 0)]
