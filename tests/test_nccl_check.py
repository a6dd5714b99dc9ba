"""tests/nccl_check.py on hand-written logs: what NCCL runs passes; what it would hang on or
mis-deliver fails, naming the operation and the ranks (the negative controls of the rules)."""

from __future__ import annotations

import pytest

from nccl_check import NcclRuleError, check_logs

EP = [0, 1, 2]


def coll(op, numel, comm="ep", ranks=EP, **kw):
    return {
        "kind": "coll",
        "op": op,
        "numel": numel,
        "dtype": "float32",
        "comm": comm,
        "ranks": ranks,
        **kw,
    }


def p2p(kind, peer, numel):
    return {"kind": kind, "op": f"i{kind}", "peer": peer, "numel": numel, "dtype": "bfloat16"}


def batch(ops, id_, comm="ep"):
    return {
        "kind": "batch",
        "op": "batch_isend_irecv",
        "ops": ops,
        "comm": comm,
        "ranks": EP,
        "id": id_,
    }


def wait(id_):
    return {"kind": "wait", "id": id_}


def relay_logs(order_on_rank_2=("a", "b")):
    """Two relay rounds from rank 0 (a: 4 elements to 1 and 2; b: rank 1 relays 8 to 2), after a
    load all-gather, every rank in the first batch; both waited in reverse order."""
    rounds_2 = {"a": batch([p2p("recv", 0, 4)], "a"), "b": batch([p2p("recv", 1, 8)], "b")}
    return {
        0: [coll("all_gather", 12), batch([p2p("send", 1, 4), p2p("send", 2, 4)], "a"), wait("a")],
        1: [
            coll("all_gather", 12),
            batch([p2p("recv", 0, 4)], "a"),
            batch([p2p("send", 2, 8)], "b"),
            wait("b"),
            wait("a"),
        ],
        2: [coll("all_gather", 12), *(rounds_2[k] for k in order_on_rank_2), wait("b"), wait("a")],
    }


def test_relay_rounds_waited_in_any_order_pass():
    check_logs(relay_logs())


def test_negative_control_a_relay_round_issued_in_another_order_on_one_rank():
    """Rounds to different pairs may be issued in any order (NCCL matches per pair); one pair's
    rounds issued in another order on one rank match the wrong messages, which is refused."""
    logs = relay_logs(("b", "a"))
    check_logs(logs)  # different pairs (0->2, 1->2): issue order across pairs is free
    # The same pair in another order: rank 0 sends 4 then 8 to rank 2, rank 2 receives 8 first.
    logs = {
        0: [batch([p2p("send", 2, 4)], "a"), batch([p2p("send", 2, 8)], "b")],
        1: [batch([], "a"), batch([], "b")],
        2: [batch([p2p("recv", 0, 8)], "b"), batch([p2p("recv", 0, 4)], "a")],
    }
    with pytest.raises(
        NcclRuleError,
        match=r"send #0 rank 0->2 isend\(bfloat16\[4\] peer 2\).*rank 2's irecv\(bfloat16\[8\] peer 0\)",
    ):
        check_logs(logs)


def test_negative_control_a_collective_skipped_by_one_rank():
    logs = relay_logs()
    logs[1] = [e for e in logs[1] if e["kind"] != "coll"]
    with pytest.raises(
        NcclRuleError,
        match=r"communicator ep \[0, 1, 2\]: collective #0 .*rank 1: nothing \(skipped\)",
    ):
        check_logs(logs)
    logs = relay_logs()
    logs[2][0] = coll("all_reduce", 12)
    with pytest.raises(NcclRuleError, match=r"rank 2: all_reduce\(float32\[12\]\)"):
        check_logs(logs)


def test_negative_control_a_wait_cycle_through_stream_order():
    """Unbatched blocking-style pairs: both ranks send first, then receive, on one communicator:
    each send waits for a receive queued behind the peer's own send."""
    two = [0, 1]

    def op(kind, peer, id_):
        return {**p2p(kind, peer, 4), "comm": "pair", "ranks": two, "id": id_}

    logs = {
        0: [op("send", 1, "s"), op("recv", 1, "r"), wait("r")],
        1: [op("send", 0, "s"), op("recv", 0, "r"), wait("r")],
    }
    with pytest.raises(
        NcclRuleError, match=r"wait cycle .*rank 0 waits on irecv\(bfloat16\[4\] peer 1\) \(pair\)"
    ):
        check_logs(logs)
    logs[1] = [op("recv", 0, "r"), op("send", 0, "s"), wait("r")]  # the control: opposite order
    check_logs(logs)


def test_negative_control_the_first_batch_without_every_rank():
    logs = relay_logs()
    for r in logs:
        logs[r] = logs[r][1:]  # no all-gather first: the batches are the first calls
    logs[2] = [coll("barrier", 0, comm="ep"), *logs[2]]
    for r in (0, 1):
        logs[r] = [*logs[r], coll("barrier", 0, comm="ep")]
    with pytest.raises(
        NcclRuleError,
        match=r"first batched point-to-point call is issued first by ranks \[0, 1\] only, ranks \[2\]",
    ):
        check_logs(logs)


def test_negative_control_a_batch_against_lone_receives():
    logs = {
        0: [batch([p2p("send", 1, 4), p2p("send", 1, 4)], "a"), wait("a")],
        1: [batch([p2p("recv", 0, 4)], "a"), batch([p2p("recv", 0, 4)], "b"), wait("a"), wait("b")],
        2: [batch([], "a"), batch([], "b")],
    }
    with pytest.raises(NcclRuleError, match="grouped in batches differently"):
        check_logs(logs)
