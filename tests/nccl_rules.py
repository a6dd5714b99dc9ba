"""A recorder of every rank's collectives and point-to-point operations, for tests/nccl_check.py.

:func:`install` wraps torch.distributed's functions in this process (the ones the data plane and
the balanced layer call: collectives, ``send``/``recv``, ``batch_isend_irecv`` (``isend``/``irecv`` inside it),
``new_group``) so that each call appends an event (communicator, operation, peer, element count,
dtype; a batch with its operations) and each ``Work.wait`` a wait event naming it; a synchronous
call is its event and an immediate wait. :func:`dump` writes the rank's log as JSON lines; the
parent checks every rank's logs after the run (``nccl_check.check_logs``). Gloo still carries the
data: the recorder changes no result, only what gloo tolerates (tags, order across pairs) is
checked against NCCL's rules afterwards.

Not a torch.distributed backend registered by name, because such a backend cannot carry batch
boundaries in the installed torch (2.14; tests/test_nccl_rules_backend.py asserts it, and fails once
torch can): a Python ``Backend`` registered with ``torch.distributed.Backend.register_backend(...,
devices=["cpu"])`` over a ``ProcessGroupGloo`` does see every collective and point-to-point call,
megatron's groups included; but ``batch_isend_irecv`` groups a batch only for a backend whose
``supports_coalescing`` is true, and then calls ``startCoalescing``, which pybind does not let a
Python subclass override ("does not implement startCoalescing"); with it false the batch arrives
as separate sends and receives, its boundary lost. A Python ``ProcessGroup`` returned by the creator
instead has no per-device backend (``batch_isend_irecv`` raises "No backend type associated with
device type cpu"). Batches are what NCCL matches batch by batch, so the recorder stays a wrapper:
operations megatron issues inside ``torch.distributed.distributed_c10d`` itself (its internal calls,
its coalescing manager) are not seen; the runs under it are the data plane's own worlds
(``dataplane_helpers.run_world`` honours ``ULTRAEP_NCCL_RULES_DIR``) and the megatron runs that
``tests/rank_server.py`` starts with that variable set.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import torch.distributed as dist

ENV = "ULTRAEP_NCCL_RULES_DIR"


class _Events(list):
    """The rank's events; each notes the thread that issued it (a wait holds that thread only)."""

    def append(self, event: dict) -> None:
        super().append({**event, "thread": threading.current_thread().name})


_events: list[dict] = _Events()
_state: dict[str, Any] = {"in_batch": False, "next_id": 0, "groups": {}}
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
)


def _comm(group) -> tuple[str, list[int]]:
    ranks = (
        list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    )
    ordinal = _state["groups"].get(id(group), ((), 0))[1] if group is not None else 0
    return f"{'world' if group is None else 'g'}[{','.join(map(str, ranks))}]#{ordinal}", ranks


def _tensor_of(args, kwargs):
    for value in (*args, *kwargs.values()):
        if hasattr(value, "numel") and hasattr(value, "dtype"):
            return value
    return None


class _Recorded:
    """A Work whose wait is recorded (everything else goes to the real one)."""

    def __init__(self, work, id_):
        self._work, self._id = work, id_

    def wait(self, *args, **kwargs):
        _events.append({"kind": "wait", "id": self._id})
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _new_id() -> int:
    _state["next_id"] += 1
    return _state["next_id"]


def _wrap_collective(name, real):
    def recorded(*args, **kwargs):
        tensor = _tensor_of(args, kwargs)
        comm, ranks = _comm(kwargs.get("group"))
        id_ = _new_id()
        _events.append(
            {
                "kind": "coll",
                "op": name,
                "comm": comm,
                "ranks": ranks,
                "numel": int(tensor.numel()) if tensor is not None else 0,
                "dtype": str(tensor.dtype) if tensor is not None else None,
                "id": id_,
            }
        )
        work = real(*args, **kwargs)
        if kwargs.get("async_op"):
            return _Recorded(work, id_)
        _events.append({"kind": "wait", "id": id_})
        return work

    return recorded


def _p2p_event(kind, tensor, peer, group) -> dict:
    comm, ranks = _comm(group)
    return {
        "kind": kind,
        "op": "i" + kind,
        "peer": int(peer),
        "numel": int(tensor.numel()),
        "dtype": str(tensor.dtype),
        "comm": comm,
        "ranks": ranks,
    }


def _wrap_p2p(kind, real, blocking):
    def recorded(tensor, peer=None, group=None, tag=0, **kwargs):
        if _state["in_batch"]:
            return real(tensor, peer, group, tag, **kwargs)
        id_ = _new_id()
        _events.append({**_p2p_event(kind, tensor, peer, group), "id": id_})
        work = real(tensor, peer, group, tag, **kwargs)
        if blocking:
            _events.append({"kind": "wait", "id": id_})
            return work
        return _Recorded(work, id_)

    return recorded


def _peer(op) -> int:
    """A P2POp's peer as a global rank (it may name it by its rank in the group)."""
    if getattr(op, "peer", None) is not None:
        return op.peer
    return dist.get_global_rank(op.group, op.group_peer) if op.group is not None else op.group_peer


def install() -> None:
    """Wrap this process's torch.distributed functions (once; before the process groups are used)."""
    if getattr(dist, "_ultraep_nccl_rules", False):
        return
    dist._ultraep_nccl_rules = True
    for name in _COLLECTIVES:
        setattr(dist, name, _wrap_collective(name, getattr(dist, name)))
    # isend / irecv stay torch's own: P2POp accepts only them (a batch records its operations);
    # the blocking send / recv are recorded.
    dist.send = _wrap_p2p("send", dist.send, True)
    dist.recv = _wrap_p2p("recv", dist.recv, True)
    real_batch, real_new_group = dist.batch_isend_irecv, dist.new_group

    def batch_isend_irecv(p2p_op_list):
        id_ = _new_id()
        ops = [
            _p2p_event(
                "send" if op.op is dist.isend else "recv",
                op.tensor,
                _peer(op),
                op.group,
            )
            for op in p2p_op_list
        ]
        comm, ranks = _comm(p2p_op_list[0].group if p2p_op_list else None)
        _events.append(
            {
                "kind": "batch",
                "op": "batch_isend_irecv",
                "ops": ops,
                "comm": comm,
                "ranks": ranks,
                "id": id_,
            }
        )
        _state["in_batch"] = True
        try:
            works = real_batch(p2p_op_list)
        finally:
            _state["in_batch"] = False
        return [_Recorded(w, id_) for w in works]

    def new_group(*args, **kwargs):
        group = real_new_group(*args, **kwargs)
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
            ranks = tuple(dist.get_process_group_ranks(group))
            same = sum(1 for r in _state["groups"].values() if r[0] == ranks)
            _state["groups"][id(group)] = (ranks, same)
        return group

    dist.batch_isend_irecv = batch_isend_irecv
    dist.new_group = new_group


def dump(directory: str, rank: int) -> None:
    """Write this rank's events to ``directory/rank{rank}.jsonl``."""
    with open(os.path.join(directory, f"rank{rank}.jsonl"), "w") as handle:
        for event in _events:
            handle.write(json.dumps(event) + "\n")


def read_logs(directory: str) -> dict[int, list[dict]]:
    """rank -> events, as :func:`dump` wrote them."""
    logs = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as handle:
                logs[int(name[4:-6])] = [json.loads(line) for line in handle]
    return logs
