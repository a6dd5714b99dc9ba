"""The virtual-layer ring: in-flight invocations, stale ids, and the order in which activation
recompute replays take their parked forwards (pipeline microbatches first in, first out; the runs
of one model forward of the MTP block's shared layer last in, first out)."""

from types import SimpleNamespace

import pytest

from ultraep_megatron.megatron.balanced_layer.ring import (
    RingFullError,
    VirtualLayerRing,
    invocations_per_forward,
)


def test_payloads_travel_by_id_and_released_ids_go_stale():
    ring = VirtualLayerRing(2)
    a, b = ring.acquire(1), ring.acquire(2)
    ring.store(a, "plan a")
    ring.store(b, "plan b")
    assert (ring.get(a), ring.get(b), ring.live) == ("plan a", "plan b", 2)
    with pytest.raises(RingFullError, match="--moe-balancer-ring-size"):
        ring.acquire(3)
    ring.release(a)
    c = ring.acquire(3)  # reuses a's ring slot under a new generation
    assert c != a and ring.live == 2
    with pytest.raises(KeyError, match="not live"):
        ring.get(a)


def park_forwards(ring, layer, forwards, runs_per_forward):
    """Park ``forwards`` model forwards of ``layer``, each running it ``runs_per_forward`` times;
    return {vid: (forward, run)}."""
    parked = {}
    for forward in range(forwards):
        for run in range(runs_per_forward):
            vid = ring.acquire(layer)
            ring.park_for_recompute(layer, vid, runs_per_forward)
            parked[vid] = (forward, run)
    return parked


def test_pipeline_replays_take_forwards_oldest_first():
    """1F1B: a stage's backwards (and their replays) run in its forwards' order."""
    ring = VirtualLayerRing(8)
    parked = park_forwards(ring, layer=3, forwards=3, runs_per_forward=1)
    replayed = [parked[ring.pop_for_recompute(3)] for _ in range(3)]
    assert replayed == [(0, 0), (1, 0), (2, 0)]
    with pytest.raises(RuntimeError, match="no checkpointed forward"):
        ring.pop_for_recompute(3)


def test_repeated_layer_replays_one_forward_in_reverse():
    """The MTP block's shared layer runs once per depth, each depth feeding the next, so one
    forward's runs are replayed last depth first; forwards stay oldest first."""
    ring = VirtualLayerRing(8)
    parked = park_forwards(ring, layer=5, forwards=2, runs_per_forward=3)
    replayed = [parked[ring.pop_for_recompute(5)] for _ in range(6)]
    assert replayed == [(0, 2), (0, 1), (0, 0), (1, 2), (1, 1), (1, 0)]


def test_a_forward_parked_during_replays_of_the_previous_one_stays_apart():
    """A forward half replayed is not refilled by the next forward's runs."""
    ring = VirtualLayerRing(8)
    parked = park_forwards(ring, layer=5, forwards=1, runs_per_forward=2)
    assert parked[ring.pop_for_recompute(5)] == (0, 1)
    later = park_forwards(ring, layer=5, forwards=1, runs_per_forward=2)
    assert parked[ring.pop_for_recompute(5)] == (0, 0)
    assert [later[ring.pop_for_recompute(5)] for _ in range(2)] == [(0, 1), (0, 0)]


def test_layers_park_apart():
    ring = VirtualLayerRing(8)
    first = park_forwards(ring, layer=1, forwards=2, runs_per_forward=1)
    mtp = park_forwards(ring, layer=5, forwards=1, runs_per_forward=2)
    assert [mtp[ring.pop_for_recompute(5)] for _ in range(2)] == [(0, 1), (0, 0)]
    assert [first[ring.pop_for_recompute(1)] for _ in range(2)] == [(0, 0), (1, 0)]


def layer(is_mtp_layer, repeated, depths=3):
    config = SimpleNamespace(mtp_use_repeated_layer=repeated, mtp_num_layers=depths)
    return SimpleNamespace(is_mtp_layer=is_mtp_layer, config=config)


def test_only_the_repeated_mtp_layer_runs_more_than_once_per_forward():
    assert invocations_per_forward(layer(is_mtp_layer=True, repeated=True)) == 3
    assert invocations_per_forward(layer(is_mtp_layer=True, repeated=False)) == 1
    assert invocations_per_forward(layer(is_mtp_layer=False, repeated=True)) == 1


def test_the_overlapped_schedule_has_one_more_microbatch_in_flight():
    """megatron's combined 1F1B schedule runs microbatch i + 1's forward of a layer before
    microbatch i's backward of it ends (without a pipeline: two in flight, not one), and under
    interleaving schedules one more warm-up forward (megatron's get_pp_rank_microbatches)."""
    from ultraep_megatron.megatron.balanced_layer.ring import max_inflight_microbatches

    assert [max_inflight_microbatches(1, 0, 8, overlapped=o) for o in (False, True)] == [1, 2]
    assert max_inflight_microbatches(1, 0, 1, overlapped=True) == 1  # a single microbatch
    for rank in range(2):
        plain = max_inflight_microbatches(2, rank, 16, vpp_size=2)
        assert max_inflight_microbatches(2, rank, 16, vpp_size=2, overlapped=True) == plain + 1
