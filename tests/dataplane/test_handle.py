"""Transfer handles (``handle.py``) on real gloo worlds of 4 and 8 ranks: the asynchronous API of
the transfers and of :class:`ReplicaBuffer` (transfers in flight together, waited out of order,
``start_after``, a HostCommStream running them, bad inputs in ``wait()``), bit-identical to the
synchronous calls. One process spawn per world size runs every case; expectations come from the
seeded tensors and reference runs of ``dataplane_helpers``.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from dataplane_helpers import (
    NUMEL,
    SENTINEL,
    SHAPES,
    caller_thread_buffer,
    expert_weights,
    flat,
    main_grad,
    random_plan,
    reduced_grads,
    replica_grad,
    run_distribution,
    run_world,
    unhosted_slots_touched,
)
from ultraep_megatron.dataplane import HostCommStream, ReplicaBuffer, build_schedule
from ultraep_megatron.dataplane import distribute, reduce
from ultraep_megatron.dataplane.tags import TagSequence


def check_buffer_async(rank, world_size) -> list[str]:
    """ReplicaBuffer's asynchronous calls on the CPU run whole on its HostCommStream's thread:
    bit-identical to the synchronous calls (every transfer of the buffer goes through that thread,
    in call order, so synchronous and asynchronous ones may alternate); bad inputs raise in
    ``wait()``, before any communication, and the buffer stays usable; the reduction's fold happens
    in ``wait()`` unless ``fold_on_stream``."""
    failures = []
    num_experts = 2 * world_size
    plan = random_plan(world_size, num_experts, 3, seed=23, hot_expert=0, local_replica=True)
    buffer = ReplicaBuffer(
        3, SHAPES, torch.float32, chunk_numel=13, relay="always", relay_threshold=2
    )
    if not isinstance(buffer.comm_stream, HostCommStream):
        return ["ReplicaBuffer on the CPU has no HostCommStream"]
    sched = buffer.schedule(plan, num_experts)
    main = [expert_weights(50, rank * 2 + j) for j in range(2)]
    handle = buffer.distribute_weights(sched, main, async_op=True)
    handle.wait()
    reference = caller_thread_buffer(3)  # the reference, on this thread (same group: after)
    synchronous = reference.replica_weights.fill_(SENTINEL)
    reference.distribute_weights(sched, main)
    for s, e in enumerate(plan[rank].tolist()):
        if e >= 0 and not torch.equal(buffer.replica_weights[s], synchronous[s]):
            failures.append(f"async ReplicaBuffer slot {s} != the synchronous distribution")
    hosted = sched.rank_transfers(rank).hosted_slots
    grads = {
        s: [
            g.view(shape)
            for g, shape in zip(
                replica_grad(51, rank, s, False).split([torch.Size(x).numel() for x in SHAPES]),
                SHAPES,
            )
        ]
        for s in hosted
    }
    written, _ = reduced_grads(rank, plan, num_experts, 51, sched, False)
    for fold_on_stream in (False, True):
        mains = [main_grad(51, rank * 2 + j, False) for j in range(2)]
        before = [flat(m).clone() for m in mains]
        handle = buffer.reduce_gradients(
            sched, mains, async_op=True, hosted_grads=grads, fold_on_stream=fold_on_stream
        )
        handle._issuing.result()  # the transfer is complete on the stream; the fold only if asked
        if not fold_on_stream and not all(torch.equal(flat(m), b) for m, b in zip(mains, before)):
            failures.append("fold_on_stream=False: the main grads were written before wait()")
        if fold_on_stream and not all(
            torch.equal(flat(a), flat(b)) for a, b in zip(mains, written)
        ):
            failures.append("fold_on_stream=True: the main grads were not folded on the stream")
        handle.wait()
        if not all(torch.equal(flat(a), flat(b)) for a, b in zip(mains, written)):
            failures.append(
                f"async ReplicaBuffer reduction (fold_on_stream={fold_on_stream}) differs"
            )
    bad = buffer.distribute_weights(sched, main[:1], async_op=True)  # one local expert short
    try:
        bad.wait()
        failures.append("a bad input to an asynchronous ReplicaBuffer call was accepted")
    except ValueError:
        pass
    bad.wait()  # raised once: the handle is done
    if (
        hosted
    ):  # a gradient on another device (meta) is refused at the call, before any communication
        odd = {s: [torch.empty(SHAPES[0], device="meta"), None] for s in hosted}
        try:
            reference.reduce_gradients(
                sched, [main_grad(52, rank * 2 + j, False) for j in range(2)], hosted_grads=odd
            )
            failures.append("hosted_grads on another device was accepted")
        except ValueError:
            pass
    buffer.distribute_weights(sched, main)  # still usable, tags in step on every rank
    if not all(
        torch.equal(buffer.replica_weights[s], synchronous[s])
        for s, e in enumerate(plan[rank].tolist())
        if e >= 0
    ):
        failures.append("ReplicaBuffer after a bad asynchronous call: replicas differ")
    return failures


def check_handles(rank, world_size, comm_stream=None) -> list[str]:
    """The asynchronous API: transfers started, overlapped with other work and waited later (in any
    order) give bit-identical replicas and reductions; a reduction touches the main gradients only
    in ``wait()``; an empty plan's handle works; bad inputs raise before any communication."""
    num_experts = 2 * world_size
    failures = []
    # Several transfers in flight together into tensors of their own: the transfers themselves,
    # numbered in call order by one sequence, as one buffer's are.
    tags = TagSequence()
    distribute_weights = functools.partial(distribute.distribute_weights, group=None, tags=tags)
    reduce_gradients = functools.partial(reduce.reduce_gradients, group=None, tags=tags)
    relayed = random_plan(world_size, num_experts, 3, seed=21, hot_expert=1)
    direct = random_plan(world_size, num_experts, 3, seed=22, hot_expert=None, local_replica=True)
    empty = torch.full((world_size, 3), -1, dtype=torch.int64)
    scheds = {
        "relayed": (
            relayed,
            build_schedule(
                relayed, num_experts, NUMEL, chunk_numel=13, relay="always", relay_threshold=2
            ),
        ),
        "direct": (direct, build_schedule(direct, num_experts, NUMEL, chunk_numel=13, relay="off")),
        "empty": (empty, build_schedule(empty, num_experts, NUMEL)),
    }
    if not scheds["relayed"][1].uses_relay:
        failures.append("the relayed plan built no relay tree")
    main = {
        name: [expert_weights(30 + i, rank * 2 + j) for j in range(2)]
        for i, name in enumerate(scheds)
    }

    # Distributions of three plans in flight together, waited in reverse order, other work between.
    replicas = {name: torch.full((3, NUMEL), SENTINEL) for name in scheds}
    handles = {
        name: distribute_weights(
            sched, main[name], replicas[name], async_op=True, comm_stream=comm_stream
        )
        for name, (_, sched) in scheds.items()
    }
    torch.randn(64, 64).matmul(torch.randn(64, 64)).sum()  # the caller's own work meanwhile
    for name in reversed(list(scheds)):
        handles[name].wait()
        handles[name].wait()  # a second wait is a no-op
        if not handles[name].done():
            failures.append(f"{name}: handle not done after wait()")
    for i, (name, (plan, sched)) in enumerate(scheds.items()):
        synchronous = torch.full((3, NUMEL), SENTINEL)
        distribute_weights(sched, main[name], synchronous)
        if not torch.equal(replicas[name], synchronous):
            failures.append(f"{name}: asynchronous distribution differs from the synchronous one")
        for slot, e in enumerate(plan[rank].tolist()):
            if e >= 0 and not torch.equal(replicas[name][slot], flat(expert_weights(30 + i, e))):
                failures.append(f"{name}: slot {slot} != expert {e}")

    # Reductions in flight together; the main gradients stay untouched until wait().
    for name, (plan, sched) in scheds.items():
        mains, replica = [], []
        for trial in range(2):
            per_rank = [main_grad(40, rank * 2 + j, False) for j in range(2)]
            grads = torch.stack([replica_grad(40, rank, s, False) for s in range(3)])
            grads[plan[rank] < 0] = float("nan")  # never read
            mains.append(per_rank), replica.append(grads)
        before = [flat(m).clone() for m in mains[0]]
        handle = reduce_gradients(
            sched,
            mains[0],
            replica[0],
            async_op=True,
            comm_stream=comm_stream,
            start_after=handles[name],
        )  # already done: start_after is a no-op
        if not all(torch.equal(flat(m), b) for m, b in zip(mains[0], before)):
            failures.append(f"{name}: an asynchronous reduction wrote the main grads before wait()")
        reduce_gradients(
            sched, mains[1], replica[1]
        )  # synchronous, same inputs, in flight with the first
        handle.wait()
        if not all(torch.equal(flat(a), flat(b)) for a, b in zip(mains[0], mains[1])):
            failures.append(
                f"{name}: asynchronous reduction not bit-identical to the synchronous one"
            )
        if unhosted_slots_touched(rank, plan, replica[0]) or unhosted_slots_touched(
            rank, plan, replica[1]
        ):
            failures.append(f"{name}: a reduction wrote a slot that hosts no replica here")
    # start_after orders a transfer after another one (which is then complete).
    first = distribute_weights(
        scheds["relayed"][1],
        main["relayed"],
        torch.zeros(3, NUMEL),
        async_op=True,
        comm_stream=comm_stream,
    )
    second = reduce_gradients(
        scheds["relayed"][1],
        [main_grad(41, rank * 2 + j, True) for j in range(2)],
        torch.zeros(3, NUMEL),
        async_op=True,
        start_after=first,
        comm_stream=comm_stream,
    )
    if not first.done():
        failures.append("start_after did not complete the earlier transfer first")
    second.wait()
    # Bad inputs raise before any communication, also asynchronously; the group stays usable.
    sched = scheds["relayed"][1]
    for what, call in {
        "slots": lambda: distribute_weights(
            sched, main["relayed"], torch.zeros(2, NUMEL), async_op=True, comm_stream=comm_stream
        ),
        "experts": lambda: reduce_gradients(
            sched,
            main["relayed"][:1],
            torch.zeros(3, NUMEL),
            async_op=True,
            comm_stream=comm_stream,
        ),
    }.items():
        try:
            call()
            failures.append(f"bad input '{what}' was accepted by the asynchronous API")
        except ValueError:
            pass
    failures += run_distribution(rank, relayed, num_experts, 21, sched)
    return failures


def run_all(rank: int, world_size: int) -> dict[str, list[str]]:
    """Entry point per rank: case name -> failures seen by this rank."""
    results = {
        "replica-buffer-async": check_buffer_async(rank, world_size),
        "handles": check_handles(rank, world_size),
        # The same with the transfers handed to a HostCommStream (the CPU's stand-in for a
        # communication stream).
        "handles-host-comm-stream": check_handles(rank, world_size, HostCommStream()),
    }
    dist.barrier()
    return results


@pytest.mark.parametrize("world_size", [4, 8])
def test_transfers_in_flight_together_and_waited_later(world_size):
    for rank, results in enumerate(run_world(world_size, run_all)):
        assert set(results) == {"replica-buffer-async", "handles", "handles-host-comm-stream"}
        failures = {name: f for name, f in results.items() if f}
        assert not failures, f"rank {rank}: {failures}"
