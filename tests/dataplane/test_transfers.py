"""Weight distribution and gradient reduction (``distribute.py``, ``reduce.py``, ``handle.py``) on
real gloo worlds of 4 and 8 ranks.

One process spawn per world size runs every case: direct, relay and adaptive schedules, fan-out R-1,
odd chunk counts (90 elements in chunks of 13 = 7 chunks), one chunk, local replicas, empty plans,
bf16 weights, uint8 weights in a layout of their own (quantized parameters), bf16 and fp32 main
grads, strided main weights and hosted gradients, bad inputs (the asynchronous handle API:
``test_handle.py``).

Every rank regenerates every expert's tensors from seeds (``dataplane_helpers``), so expectations
are computed independently of the schedule: a replica must equal its expert's generated weights, a
main gradient must equal its generated gradient plus the generated gradients of the slots that host
the expert. The transfers run through :class:`ReplicaBuffer`; where a case needs what a buffer does
not offer (several transfers in flight into tensors of their own, a non-contiguous destination), it
calls the transfers themselves, numbered by one ``TagSequence`` as a buffer's would be.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dataplane_helpers import (
    NUMEL,
    SENTINEL,
    SHAPES,
    caller_thread_buffer,
    expected_grad,
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
from ultraep_megatron.dataplane import ReplicaBuffer, build_schedule
from ultraep_megatron.dataplane import distribute
from ultraep_megatron.dataplane.tags import TagSequence


def run_reduction(rank, slot_expert, num_experts, seed, sched) -> list[str]:
    failures = []
    per_rank = num_experts // slot_expert.shape[0]
    # Integer-valued gradients: every order of additions is exact, so the sum must match bitwise.
    for main_dtype in (torch.float32, torch.bfloat16):
        mains, replica = reduced_grads(
            rank, slot_expert, num_experts, seed, sched, True, main_dtype
        )
        if unhosted_slots_touched(rank, slot_expert, replica):
            failures.append("the reduction wrote a slot that hosts no replica here")
        for i in range(per_rank):
            want = expected_grad(rank, slot_expert, num_experts, seed, i, True).to(main_dtype)
            if not torch.equal(flat(mains[i]), want):
                failures.append(
                    f"{main_dtype} main grad of local expert {i} != main + sum of replicas"
                )
    # Random gradients: close to the fp64 sum, and bit-identical across two runs.
    first, _ = reduced_grads(rank, slot_expert, num_experts, seed + 1, sched, False)
    second, _ = reduced_grads(rank, slot_expert, num_experts, seed + 1, sched, False)
    for i in range(per_rank):
        want = expected_grad(rank, slot_expert, num_experts, seed + 1, i, False).float()
        if not torch.allclose(flat(first[i]), want, rtol=1e-5, atol=1e-5):
            failures.append(f"random main grad of local expert {i} not close to the fp64 sum")
        if not torch.equal(flat(first[i]), flat(second[i])):
            failures.append(f"reduction of local expert {i} not bit-identical across runs")
    return failures


def plan_cases(world_size: int) -> list[dict]:
    """(plan, schedule options) combinations; every rank builds the same list."""
    num_experts = 2 * world_size
    slots = 3
    cases = []
    # Two hot experts on different homes: ranks are relays of one tree and leaves of the other.
    two_hot = (1, num_experts - 2)
    for seed, (hot, local) in enumerate(
        [(1, False), (world_size + 1, True), (None, False), (two_hot, False)]
    ):
        plan = random_plan(
            world_size, num_experts, slots, seed=seed, hot_expert=hot, local_replica=local
        )
        for relay, chunk in [
            ("off", 13),
            ("always", 13),
            ("adaptive", 13),
            ("always", 1000),
            ("off", 30),
        ]:
            threshold = 2 if world_size == 4 else 3
            cases.append(
                dict(
                    name=f"plan{seed}-{relay}-chunk{chunk}",
                    plan=plan,
                    seed=seed,
                    relay=relay,
                    chunk=chunk,
                    threshold=threshold,
                    hot=hot is not None,
                )
            )
    cases.append(
        dict(
            name="empty-plan",
            plan=torch.full((world_size, slots), -1, dtype=torch.int64),
            seed=9,
            relay="adaptive",
            chunk=13,
            threshold=2,
            hot=False,
        )
    )
    return cases


def check_bad_inputs(rank, world_size) -> list[str]:
    """Each bad call must raise ValueError on every rank before communicating."""
    num_experts = 2 * world_size
    plan = random_plan(world_size, num_experts, 2, seed=5, hot_expert=0)
    sched = build_schedule(
        plan, num_experts, NUMEL, chunk_numel=13, relay="always", relay_threshold=2
    )
    main = [expert_weights(5, rank * 2 + i) for i in range(2)]
    good = caller_thread_buffer(2)
    wrong_world = build_schedule(
        torch.full((world_size // 2, 2), -1, dtype=torch.int64), world_size, NUMEL
    )
    slots, numel = caller_thread_buffer(3), caller_thread_buffer(2, shapes=[(NUMEL + 1,)])
    bf16, int32 = (
        caller_thread_buffer(2, torch.bfloat16),
        caller_thread_buffer(2, grad_dtype=torch.int32),
    )
    bad_calls = {
        "slots": lambda: slots.distribute_weights(sched, main),
        "numel": lambda: numel.distribute_weights(sched, main),
        "dtype": lambda: bf16.distribute_weights(sched, main),
        "experts": lambda: good.distribute_weights(sched, main[:1]),
        "shapes": lambda: good.distribute_weights(sched, [main[0], [main[1][0]]]),
        "world": lambda: good.distribute_weights(wrong_world, main),
        "grad-int": lambda: int32.reduce_gradients(sched, main),
        "grad-none": lambda: good.reduce_gradients(sched, [main[0], [None, None]]),
        # A buffer's own replica_weights are contiguous: the transfer itself checks any destination.
        "noncontig": lambda: distribute.distribute_weights(
            sched, main, torch.zeros(NUMEL, 2).t(), group=None, tags=TagSequence()
        ),
    }
    failures = []
    for name, call in bad_calls.items():
        try:
            call()
            failures.append(f"bad input '{name}' was accepted")
        except ValueError:
            pass
    # The group is still usable and nothing stray is in flight: a valid transfer succeeds.
    failures += run_distribution(rank, plan, num_experts, 5, sched)
    return failures


def check_replica_buffer(rank, world_size) -> list[str]:
    """Integration-style use: bf16 weights as separate parameters, fp32 main_grad views into a bucket."""
    hidden, ffn = 4, 3
    shapes = [(2 * ffn, hidden), (hidden, ffn)]
    num_experts = 2 * world_size
    plan = random_plan(
        world_size, num_experts, 2, seed=11, hot_expert=num_experts - 1, local_replica=True
    )
    buffer = ReplicaBuffer(
        2, shapes, torch.bfloat16, chunk_numel=5, relay="always", relay_threshold=2
    )
    sched = buffer.schedule(plan, num_experts)

    def weights(e):
        gen = torch.Generator().manual_seed(900 + e)
        return [torch.randn(s, generator=gen).bfloat16() for s in shapes]

    main = [
        [torch.nn.Parameter(w) for w in weights(rank * 2 + i)] for i in range(2)
    ]  # requires grad
    buffer.distribute_weights(sched, main)
    failures = []
    if buffer.replica_weights.requires_grad:
        failures.append("replica_weights started tracking autograd")
    for s, e in enumerate(plan[rank].tolist()):
        if e >= 0 and not all(
            torch.equal(v, w) for v, w in zip(buffer.weight_views(s), weights(e))
        ):
            failures.append(f"ReplicaBuffer slot {s} != expert {e}")
    # Main grads: views into one flat fp32 bucket, as Megatron DDP's param.main_grad.
    bucket = torch.zeros(2 * 2 * ffn * hidden * 2)
    views, offset = [], 0
    for _ in range(2):
        expert = []
        for s in shapes:
            n = torch.Size(s).numel()
            expert.append(bucket[offset : offset + n].view(s))
            offset += n
        views.append(expert)
    bucket.fill_(float(rank))
    for s, e in enumerate(plan[rank].tolist()):
        for v in buffer.grad_views(
            s
        ):  # the caller writes each hosted slot; the others are never read
            v.fill_(1.0 if e >= 0 else float("nan"))
    buffer.reduce_gradients(sched, views)
    for i in range(2):
        e = rank * 2 + i
        hosts = int((plan == e).sum())
        if not bool((flat(views[i]) == rank + hosts).all()):
            failures.append(f"main_grad of expert {e} != {rank} + {hosts}")
    if unhosted_slots_touched(rank, plan, buffer.replica_grads):
        failures.append("ReplicaBuffer.reduce_gradients wrote a slot that hosts no replica here")
    return failures


def run_hosted_reduction(rank, slot_expert, num_experts, seed, sched) -> list[str]:
    """``hosted_grads`` (the transfer copies each hosted slot's gradient itself) and
    ``fold_on_stream``, on the caller's thread and on a HostCommStream, synchronous and not: the
    same main gradients, bit for bit, as the caller writing the slots itself; a slot given ``None``
    (or a ``None`` tensor) reduces zeros; slots that do not match the hosted ones raise before any
    communication."""
    failures = []
    per_rank, num_slots = num_experts // slot_expert.shape[0], slot_expert.shape[1]
    hosted = sched.rank_transfers(rank).hosted_slots
    written, _ = reduced_grads(rank, slot_expert, num_experts, seed, sched, False)
    for on_host_stream in (False, True):
        for fold_on_stream in (False, True):
            where = f"comm_stream={'HostCommStream' if on_host_stream else None}, fold_on_stream={fold_on_stream}"
            buffer = (
                ReplicaBuffer(num_slots, SHAPES, torch.float32)
                if on_host_stream
                else caller_thread_buffer(num_slots)
            )
            mains = [main_grad(seed, rank * per_rank + i, False) for i in range(per_rank)]
            replica = buffer.replica_grads.fill_(float("nan"))  # written by the transfer alone
            grads = {
                s: [
                    g.view(shape)
                    for g, shape in zip(
                        replica_grad(seed, rank, s, False).split(
                            [torch.Size(x).numel() for x in SHAPES]
                        ),
                        SHAPES,
                    )
                ]
                for s in hosted
            }
            handle = buffer.reduce_gradients(
                sched, mains, async_op=True, hosted_grads=grads, fold_on_stream=fold_on_stream
            )
            handle.wait()
            if not all(torch.equal(flat(a), flat(b)) for a, b in zip(mains, written)):
                failures.append(
                    f"{where}: hosted_grads reduced differently from caller-written slots"
                )
            if unhosted_slots_touched(rank, slot_expert, replica):
                failures.append(f"{where}: a slot that hosts no replica here was written")
    # None: zeros, for a whole slot or one of its tensors (every rank gives the same answer).
    mains = [main_grad(seed, rank * per_rank + i, True) for i in range(per_rank)]
    grads = {s: [None, torch.ones(SHAPES[1])] if s % 2 else None for s in hosted}
    buffer = caller_thread_buffer(num_slots)
    buffer.replica_grads.fill_(float("nan"))
    buffer.reduce_gradients(sched, mains, hosted_grads=grads)
    for i in range(per_rank):
        e = rank * per_rank + i
        want = flat(main_grad(seed, e, True))
        for r, row in enumerate(slot_expert.tolist()):
            for s, x in enumerate(row):
                if x == e and s % 2:
                    want[-torch.Size(SHAPES[1]).numel() :] += 1.0
        if not torch.equal(flat(mains[i]), want):
            failures.append(
                f"hosted_grads None: main grad of local expert {i} != main + the ones given"
            )
    wrong = {s: None for s in range(num_slots) if s not in hosted} or {num_slots: None}
    try:
        caller_thread_buffer(num_slots).reduce_gradients(sched, mains, hosted_grads=wrong)
        failures.append("hosted_grads naming other slots than the hosted ones was accepted")
    except ValueError:
        pass
    return failures


def check_tensor_layouts(rank, world_size) -> list[str]:
    """Direct edges send the main experts' tensors and the replicas' gradients themselves, not a
    packed copy: main weights that are not contiguous, and hosted gradients that are not contiguous
    or not in the buffer's dtype, take a packed row or their slot instead, with the same replicas
    and reductions bit for bit (direct and relayed experts, local replicas)."""
    failures = []
    num_experts = 2 * world_size
    plan = random_plan(world_size, num_experts, 3, seed=31, hot_expert=1, local_replica=True)
    for relay in ("off", "always"):
        sched = build_schedule(
            plan, num_experts, NUMEL, chunk_numel=13, relay=relay, relay_threshold=2
        )
        main = [
            [w.t().contiguous().t() for w in expert_weights(31, rank * 2 + j)] for j in range(2)
        ]
        if any(w.is_contiguous() for expert in main for w in expert):
            failures.append("the strided main weights are contiguous: the case tests nothing")
        buffer = caller_thread_buffer(3)
        replica = buffer.replica_weights.fill_(SENTINEL)
        buffer.distribute_weights(sched, main)
        for s, e in enumerate(plan[rank].tolist()):
            if e >= 0 and not torch.equal(replica[s], flat(expert_weights(31, e))):
                failures.append(f"relay={relay}: strided main weights: slot {s} != expert {e}")
        written, _ = reduced_grads(rank, plan, num_experts, 32, sched, True)
        hosted = sched.rank_transfers(rank).hosted_slots
        for name, layout in (
            ("strided", lambda g: g.t().contiguous().t()),
            ("float64", torch.Tensor.double),
        ):
            grads = {
                s: [
                    layout(g.view(shape))
                    for g, shape in zip(
                        replica_grad(32, rank, s, True).split(
                            [torch.Size(x).numel() for x in SHAPES]
                        ),
                        SHAPES,
                    )
                ]
                for s in hosted
            }
            mains = [main_grad(32, rank * 2 + j, True) for j in range(2)]
            buffer = caller_thread_buffer(3)
            buffer.replica_grads.fill_(float("nan"))
            buffer.reduce_gradients(sched, mains, hosted_grads=grads)
            if not all(torch.equal(flat(a), flat(b)) for a, b in zip(mains, written)):
                failures.append(
                    f"relay={relay}: {name} hosted_grads reduced differently from caller-written slots"
                )
    return failures


def _weight_bytes(seed: int, expert: int) -> list[torch.Tensor]:
    """An expert's weights in a layout of their own: the bytes of its fp32 tensors (as fp8 data
    would be) and 12 bytes standing for its scales; uint8 ``[360]``, ``[12]``."""
    scales = torch.arange(12, dtype=torch.uint8) + 3 * expert + seed
    return [flat(expert_weights(seed, expert)).view(torch.uint8), scales]


def check_weight_layout(rank, world_size) -> list[str]:
    """A buffer whose weights (376 bytes per expert) are laid out apart from its gradients (90 fp32
    values): chunks, relay rounds and tags of the distribution follow the weights' size, the
    reduction the gradients' (quantized parameters: uint8 weights, fp32 gradients)."""
    num_experts, seed = 2 * world_size, 5
    plan = random_plan(world_size, num_experts, 2, seed=seed, hot_expert=1, local_replica=True)
    buffer = ReplicaBuffer(
        2,
        SHAPES,
        torch.uint8,
        weight_shapes=[(360,), (12,)],
        chunk_numel=13,
        relay="always",
        relay_threshold=1,
    )
    failures = []
    if buffer.replica_weights.shape != (2, 372) or buffer.replica_grads.shape != (2, 90):
        failures.append(f"buffers {buffer.replica_weights.shape}, {buffer.replica_grads.shape}")
    sched = buffer.schedule(plan, num_experts)
    resized = sched.with_expert_numel(372)
    if (
        sched.expert_numel != 90
        or resized.expert_numel != 372
        or sched.with_expert_numel(372) is not resized
    ):
        failures.append("the weight schedule is not the gradient schedule resized once")
    if not sched.uses_relay or resized.num_rounds != 30 or sched.num_rounds != 8:
        failures.append(
            f"rounds {sched.num_rounds}, {resized.num_rounds}: the relayed chunks do not follow the size"
        )
    main = [_weight_bytes(seed, 2 * rank + j) for j in range(2)]
    for attempt in range(2):  # the second: a re-materialization after the buffer was overwritten
        buffer.replica_weights.fill_(111)
        buffer.distribute_weights(sched, main)
        for s, e in enumerate(plan[rank].tolist()):
            want = (
                flat(_weight_bytes(seed, e))
                if e >= 0
                else torch.full((372,), 111, dtype=torch.uint8)
            )
            if not torch.equal(buffer.replica_weights[s], want):
                failures.append(f"attempt {attempt}: slot {s} (expert {e}) holds other bytes")
            if e >= 0 and not torch.equal(buffer.weight_views(s)[1], _weight_bytes(seed, e)[1]):
                failures.append(f"slot {s}: its scale view is not the expert's")
    grads = [main_grad(seed, 2 * rank + j, True) for j in range(2)]
    buffer.replica_grads.copy_(torch.stack([replica_grad(seed, rank, s, True) for s in range(2)]))
    buffer.reduce_gradients(sched, grads)
    for j in range(2):
        if not torch.equal(
            flat(grads[j]), expected_grad(rank, plan, num_experts, seed, j, True).float()
        ):
            failures.append(f"main grad of local expert {j} != main + sum of replicas")
    return failures


def run_all(rank: int, world_size: int) -> dict[str, list[str]]:
    """Entry point per rank: case name -> failures seen by this rank."""
    results = {}
    for case in plan_cases(world_size):
        sched = build_schedule(
            case["plan"],
            2 * world_size,
            NUMEL,
            chunk_numel=case["chunk"],
            relay=case["relay"],
            relay_threshold=case["threshold"],
        )
        failures = run_distribution(
            rank, case["plan"], 2 * world_size, case["seed"], sched, twice=True
        )
        failures += run_distribution(
            rank, case["plan"], 2 * world_size, case["seed"], sched, dtype=torch.bfloat16
        )
        failures += run_reduction(rank, case["plan"], 2 * world_size, case["seed"], sched)
        failures += run_hosted_reduction(rank, case["plan"], 2 * world_size, case["seed"], sched)
        if case["relay"] == "off" and sched.uses_relay:
            failures.append("relay='off' built a relay tree")
        if case["relay"] == "always" and case["hot"] and not sched.uses_relay:
            failures.append("relay='always' built no tree for the hot expert")
        results[case["name"]] = failures
    results["bad-inputs"] = check_bad_inputs(rank, world_size)
    results["replica-buffer"] = check_replica_buffer(rank, world_size)
    results["tensor-layouts"] = check_tensor_layouts(rank, world_size)
    results["weight-layout"] = check_weight_layout(rank, world_size)
    dist.barrier()
    return results


@pytest.mark.parametrize("world_size", [4, 8])
def test_distribution_and_reduction(world_size):
    per_rank = run_world(world_size, run_all)
    expected_cases = {c["name"] for c in plan_cases(world_size)} | {
        "bad-inputs",
        "replica-buffer",
        "tensor-layouts",
        "weight-layout",
    }
    for rank, results in enumerate(per_rank):
        assert set(results) == expected_cases
        failures = {name: f for name, f in results.items() if f}
        assert not failures, f"rank {rank}: {failures}"


def test_distribution_and_reduction_keep_nccl_s_rules(tmp_path):
    """The same plans (relay trees, several transfers in flight waited in any order, the replica-
    gradient reduction) with every operation recorded (tests/nccl_rules.py) and checked against
    NCCL's rules (tests/nccl_check.py); the recorder's logs are real: a skipped collective and a
    reordered round in them fail the check (its negative controls on hand-written logs:
    tests/test_nccl_check.py)."""
    import copy

    from dataplane_helpers import under_nccl_rules
    from nccl_check import NcclRuleError, check_logs
    from nccl_rules import read_logs

    per_rank = run_world(4, under_nccl_rules, str(tmp_path), run_all)
    assert all(not any(r.values()) for r in per_rank), per_rank
    logs = read_logs(str(tmp_path))
    assert sorted(logs) == [0, 1, 2, 3]
    batches = [e for e in logs[0] if e["kind"] == "batch"]
    assert len(batches) > 5 and any(e["kind"] == "coll" for e in logs[0])
    check_logs(logs)
    # Negative controls on the recorded logs: rank 1 skips its last collective ...
    skipped = copy.deepcopy(logs)
    last = max(i for i, e in enumerate(skipped[1]) if e["kind"] == "coll")
    del skipped[1][last]
    with pytest.raises(NcclRuleError, match="rank 1: nothing \\(skipped\\)"):
        check_logs(skipped)
    # ... and one rank issues a pair's two batches with sends to the same peer in swapped order.
    swapped = copy.deepcopy(logs)
    for rank, log in swapped.items():
        idx = [i for i, e in enumerate(log) if e["kind"] == "batch" and e["ops"]]
        pairs = [
            (a, b)
            for a, b in zip(idx, idx[1:])
            if {(o["kind"], o["peer"], o["numel"]) for o in log[a]["ops"]}
            != {(o["kind"], o["peer"], o["numel"]) for o in log[b]["ops"]}
            and {(o["kind"], o["peer"]) for o in log[a]["ops"]}
            & {(o["kind"], o["peer"]) for o in log[b]["ops"]}
        ]
        if pairs:
            a, b = pairs[0]
            log[a], log[b] = log[b], log[a]
            break
    else:
        pytest.fail("no two batches of one rank to the same peer with different sizes")
    with pytest.raises(NcclRuleError, match=f"rank {rank}"):
        check_logs(swapped)
