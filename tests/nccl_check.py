"""NCCL's rules, checked on the per-rank logs of collective and point-to-point operations (the
tests' recorder, ``tests/nccl_rules.py``, writes them; gloo itself keeps none of these rules).

A log is one rank's events in issue order, each a dict: ``kind`` (``"coll"``, ``"send"``,
``"recv"``, ``"batch"`` (its ``ops``: send/recv dicts), ``"wait"``), ``comm`` (the communicator: a
name shared by its ranks), ``ranks`` (its global ranks), ``op`` (the operation's name), ``peer``
(a global rank), ``numel``, ``dtype`` and ``id`` (per rank, what a ``wait`` names). Rules, each
failing with a message naming the operation and the ranks (:class:`NcclRuleError`):

* collectives: the same sequence (operation, element count, dtype; the count free where it may
  differ: :data:`VARIABLE_SIZE`) on every rank of a communicator;
* point-to-point: per pair of ranks and communicator, the k-th send matches the k-th receive in
  issue order, whatever the tag, with the same element count and dtype; a batched send is matched
  by a batched receive, and two sends in one batch by two receives in one batch;
* the first batched point-to-point call on a communicator: where one rank's first operation on it
  is a batch, every rank's is;
* no wait cycle: a simulation of each communicator's stream in issue order (an operation starts
  once the ones before it on that rank's stream are done, and is done once its matches on the
  other ranks have started; a wait holds the rank's host until its operation is done).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence


#: Collectives whose element count may differ across ranks (uneven all-to-all splits, objects).
VARIABLE_SIZE = {"all_to_all_single", "all_gather_object", "broadcast_object_list"}


def _coll_key(e: dict) -> tuple:
    return (e["op"], e["dtype"]) if e["op"] in VARIABLE_SIZE else (e["op"], e["numel"], e["dtype"])


class NcclRuleError(AssertionError):
    """An operation NCCL would hang on or mis-deliver; the message names it and the ranks."""


def _desc(event: dict) -> str:
    peer = f" peer {event['peer']}" if "peer" in event else ""
    return f"{event['op']}({event.get('dtype')}[{event.get('numel')}]{peer})"


def _units(log: Sequence[dict]) -> list[dict]:
    """The operations a rank issues (collectives, lone sends/receives, batches), in order."""
    return [e for e in log if e["kind"] != "wait"]


def check_collectives(logs: dict[int, list[dict]]) -> None:
    seqs: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    ranks_of: dict[str, list[int]] = {}
    for rank, log in logs.items():
        for e in log:
            if e["kind"] == "coll":
                seqs[e["comm"]][rank].append(e)
                ranks_of[e["comm"]] = e["ranks"]
    for comm, per_rank in seqs.items():
        ranks = ranks_of[comm]
        longest = max(len(per_rank.get(r, [])) for r in ranks)
        for k in range(longest):
            seen = {r: per_rank[r][k] if k < len(per_rank.get(r, [])) else None for r in ranks}
            keys = {r: None if e is None else _coll_key(e) for r, e in seen.items()}
            if len(set(keys.values())) > 1:
                ref = next(r for r in ranks if seen[r] is not None)
                odd = [r for r in ranks if keys[r] != keys[ref]]
                said = ", ".join(
                    f"rank {r}: {'nothing (skipped)' if seen[r] is None else _desc(seen[r])}"
                    for r in [ref, *odd]
                )
                raise NcclRuleError(
                    f"communicator {comm} {ranks}: collective #{k} differs across ranks ({said}): "
                    "NCCL would hang or mix the collectives"
                )


def _p2p(log: Sequence[dict]) -> list[tuple[dict, int | None, int]]:
    """(send/recv event, the batch index or None, the unit index) in issue order."""
    out = []
    for unit_index, e in enumerate(_units(log)):
        if e["kind"] == "batch":
            out += [
                ({**op, "comm": e["comm"], "ranks": e["ranks"]}, unit_index, unit_index)
                for op in e["ops"]
            ]
        elif e["kind"] in ("send", "recv"):
            out.append((e, None, unit_index))
    return out


def match_p2p(logs: dict[int, list[dict]]) -> dict[tuple[int, int], tuple[int, int]]:
    """Check the point-to-point rules; return (rank, unit index) -> (peer, unit index) of every
    matched operation (a send's unit to its receive's unit and back)."""
    lanes: dict[tuple, list] = defaultdict(list)  # (comm, src, dst, kind) -> [(event, batch, unit)]
    for rank, log in logs.items():
        for e, batch, unit in _p2p(log):
            src, dst = (rank, e["peer"]) if e["kind"] == "send" else (e["peer"], rank)
            lanes[(e["comm"], src, dst, e["kind"])].append((e, batch, unit))
    matches: dict[tuple[int, int], set] = defaultdict(set)
    for (comm, src, dst, kind), sends in list(lanes.items()):
        if kind != "send":
            continue
        recvs = lanes.get((comm, src, dst, "recv"), [])
        for k in range(max(len(sends), len(recvs))):
            if k >= len(recvs) or k >= len(sends):
                have = sends[k][0] if k < len(sends) else recvs[k][0]
                who = src if k < len(sends) else dst
                raise NcclRuleError(
                    f"communicator {comm}: rank {who}'s {_desc(have)} #{k} between ranks {src}->{dst} "
                    "has no match on the peer: NCCL would hang"
                )
            (s, sb, su), (r, rb, ru) = sends[k], recvs[k]
            if (s["numel"], s["dtype"]) != (r["numel"], r["dtype"]):
                raise NcclRuleError(
                    f"communicator {comm}: send #{k} rank {src}->{dst} {_desc(s)} is matched by rank "
                    f"{dst}'s {_desc(r)} (NCCL matches in issue order, ignoring tags): sizes or "
                    "dtypes differ, it would mis-deliver"
                )
            if (sb is None) != (rb is None):
                raise NcclRuleError(
                    f"communicator {comm}: send #{k} rank {src}->{dst} is {'' if sb is not None else 'not '}"
                    f"batched, its receive on rank {dst} is{'' if rb is not None else ' not'}: a batch "
                    "must be matched by a batch"
                )
            if k and sb is not None and (sends[k - 1][1] == sb) != (recvs[k - 1][1] == rb):
                raise NcclRuleError(
                    f"communicator {comm}: sends #{k - 1} and #{k} rank {src}->{dst} and their receives "
                    f"on rank {dst} are grouped in batches differently: batches must match batches"
                )
            matches[(src, su)].add((dst, ru))
            matches[(dst, ru)].add((src, su))
    return matches


def check_first_batch(logs: dict[int, list[dict]]) -> None:
    first: dict[str, dict[int, dict]] = defaultdict(dict)
    ranks_of = {}
    for rank, log in logs.items():
        for e in _units(log):
            first[e["comm"]].setdefault(rank, e)
            ranks_of[e["comm"]] = e["ranks"]
    for comm, per_rank in first.items():
        batched = [r for r, e in per_rank.items() if e["kind"] == "batch"]
        if batched and len(batched) != len(ranks_of[comm]):
            others = [r for r in ranks_of[comm] if r not in batched]
            raise NcclRuleError(
                f"communicator {comm} {ranks_of[comm]}: the first batched point-to-point call is "
                f"issued first by ranks {batched} only, ranks {others} start otherwise: NCCL needs "
                "every rank of the communicator in its first batched call"
            )


def check_wait_cycles(logs: dict[int, list[dict]], matches) -> None:
    """Simulate each rank's host and its communicators' streams; raise on a rank that can never
    get past a wait."""
    units = {r: _units(log) for r, log in logs.items()}
    unit_of_id = {r: {e["id"]: i for i, e in enumerate(units[r]) if "id" in e} for r in logs}
    coll_index = {}
    colls = defaultdict(list)  # (comm, k) -> [(rank, unit)]
    for r in logs:
        count = defaultdict(int)
        for i, e in enumerate(units[r]):
            if e["kind"] == "coll":
                key = (e["comm"], count[e["comm"]])
                count[e["comm"]] += 1
                coll_index[(r, i)] = key
                colls[key].append((r, i))
    # One host program per thread that issued: a wait holds its own thread only (the CPU's
    # stand-in for a communication stream is a thread; a wait there holds that stream, not the
    # caller's, as a wait on NCCL's stream does).
    hosts: dict[tuple, list[tuple[dict, int | None]]] = defaultdict(list)
    for r, log in logs.items():
        unit = 0
        for e in log:
            hosts[(r, e.get("thread", "main"))].append((e, None if e["kind"] == "wait" else unit))
            unit += e["kind"] != "wait"
    issued: dict[int, set] = {r: set() for r in logs}
    pos = {h: 0 for h in hosts}
    done: set = set()

    def started(r, i):
        if i not in issued[r]:
            return False
        comm = units[r][i]["comm"]
        return all((r, j) in done for j in range(i) if units[r][j]["comm"] == comm)

    def partners(r, i):
        if (r, i) in coll_index:
            return [p for p in colls[coll_index[(r, i)]] if p != (r, i)]
        return list(matches.get((r, i), ()))

    progress = True
    while progress:
        progress = False
        for (r, _), program in hosts.items():
            h = (r, _)
            while pos[h] < len(program):
                e, unit = program[pos[h]]
                if e["kind"] == "wait":
                    i = unit_of_id[r].get(e["id"])
                    if i is not None and (r, i) not in done:
                        break
                else:
                    issued[r].add(unit)
                pos[h] += 1
                progress = True
        for r in logs:
            for i in issued[r]:
                if (
                    (r, i) not in done
                    and started(r, i)
                    and all(started(*p) for p in partners(r, i))
                ):
                    done.add((r, i))
                    progress = True
    stuck_hosts = [h for h, program in hosts.items() if pos[h] < len(program)]
    if stuck_hosts:
        lines = []
        for h in stuck_hosts:
            r = h[0]
            e = hosts[h][pos[h]][0]
            i = unit_of_id[r][e["id"]]
            waiting = [
                f"rank {p}'s {_desc(units[p][j]) if units[p][j]['kind'] != 'batch' else 'batch'}"
                for p, j in partners(r, i)
                if not started(p, j)
            ]
            unit = units[r][i]
            what = (
                _desc(unit)
                if unit["kind"] != "batch"
                else "batch " + ", ".join(_desc(o) for o in unit["ops"])
            )
            lines.append(
                f"rank {r} waits on {what} ({unit['comm']}), not started on: {', '.join(waiting) or 'its own stream (an earlier operation)'}"
            )
        raise NcclRuleError("wait cycle (NCCL would hang): " + "; ".join(lines))


def check_logs(logs: dict[int, list[dict]]) -> None:
    """Every rule above on one run's logs (rank -> events)."""
    check_collectives(logs)
    matches = match_p2p(logs)
    check_first_batch(logs)
    check_wait_cycles(logs, matches)
