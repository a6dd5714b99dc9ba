"""Helpers shared by the data-plane tests: a local gloo world, plans, and seeded expert tensors.

* :func:`run_world`: run a function on a local gloo world of N processes (127.0.0.1, free port) and
  collect the per-rank results.
* Plans: skewed (Zipf) loads, an EPLB-like slot filler, random plans. The EPLB-like rule stands in
  for ``ultraep_megatron.planner.solve``: it only has to produce realistic ``slot_expert`` tables
  (hot experts with many replicas, no duplicates per rank, no replica on the home rank).
* Seeded tensors: every rank regenerates every expert's tensors from seeds, so expectations are
  computed independently of the schedule (:func:`expected_grad`).
* Reference runs of the transfers (``test_transfers.py``, ``test_handle.py``): a buffer whose
  transfers the caller's thread issues, one distribution checked against the seeded weights, one
  reduction's outcome.
"""

from __future__ import annotations

import functools
import multiprocessing.forkserver
import os
import pickle
import socket
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ultraep_megatron.dataplane import ReplicaBuffer
from ultraep_megatron.traces.synthetic import zipf_topk_load


# -- a local gloo world ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    # A hang turns into an error after this long instead of stalling the suite.
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # report, so the parent shows the traceback of the failing rank
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def under_nccl_rules(rank: int, world_size: int, rules_dir: str, fn, *args):
    """``fn(rank, world_size, *args)`` with every distributed operation recorded
    (tests/nccl_rules.py), the rank's log written to ``rules_dir`` for tests/nccl_check.py."""
    import nccl_rules

    nccl_rules.install()
    try:
        return fn(rank, world_size, *args)
    finally:
        nccl_rules.dump(rules_dir, rank)


def run_world(world_size: int, fn, *args, timeout_s: float = 150.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``fn`` must be a picklable module-level function. Raises AssertionError with the failing rank's
    traceback if any rank raised, and on timeout.
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A fork server imports torch once and forks every rank from it (a fresh interpreter that has not
    # started any thread pool), instead of 8 interpreters importing torch on 2 cores.
    multiprocessing.forkserver.set_forkserver_preload(["torch", "torch.distributed"])
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(world_size, _free_port(), out_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise AssertionError(f"{world_size}-rank world did not finish within {timeout_s} s")
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results


# -- plans ----------------------------------------------------------------------------------------


@functools.lru_cache(
    maxsize=32
)  # shared by tests that plan the same loads; callers must not modify
def zipf_loads(
    num_ranks: int,
    num_experts: int,
    *,
    tokens_per_rank: int = 4096,
    top_k: int = 8,
    exponent: float = 1.0,
    seed: int = 0,
) -> torch.Tensor:
    """``traces.synthetic.zipf_topk_load``, cached."""
    return zipf_topk_load(
        num_ranks,
        num_experts,
        tokens_per_rank=tokens_per_rank,
        top_k=top_k,
        exponent=exponent,
        seed=seed,
    )


def random_plan(
    num_ranks: int,
    num_experts: int,
    num_slots: int,
    *,
    seed: int,
    hot_expert: int | tuple[int, ...] | None = None,
    empty_fraction: float = 0.2,
    local_replica: bool = False,
) -> torch.Tensor:
    """A random valid ``slot_expert`` ``[R, num_slots]``.

    Each hot expert (one or a tuple) gets a replica on every rank except its home (fan-out R-1), in
    the first slots. ``local_replica`` puts one expert into the last slot of its own home rank (filled
    by a local copy).
    """
    gen = torch.Generator().manual_seed(seed)
    per_rank = num_experts // num_ranks
    hot = (
        ()
        if hot_expert is None
        else (hot_expert,)
        if isinstance(hot_expert, int)
        else tuple(hot_expert)
    )
    slot_expert = torch.full((num_ranks, num_slots), -1, dtype=torch.int64)
    for r in range(num_ranks):
        taken = set()
        first = 0
        for e in hot:
            if e // per_rank != r:
                slot_expert[r, first] = e
                taken.add(e)
                first += 1
        candidates = [e for e in range(num_experts) if e // per_rank != r and e not in taken]
        order = torch.randperm(len(candidates), generator=gen).tolist()
        for s in range(first, num_slots):
            if torch.rand((), generator=gen).item() < empty_fraction:
                continue
            slot_expert[r, s] = candidates[order.pop()]
    if local_replica:
        rank = num_ranks - 1
        slot_expert[rank, num_slots - 1] = rank * per_rank  # its own first main expert
    return slot_expert


# -- seeded expert tensors -------------------------------------------------------------------------

SHAPES = [
    (6, 10),
    (10, 3),
]  # like linear_fc1 [ffn*2, hidden] and linear_fc2 [hidden, ffn]; 90 elements
NUMEL = 90
SENTINEL = -777.0


def expert_weights(seed: int, expert: int, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 100_003 + expert)
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


def main_grad(seed: int, expert: int, integer: bool, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 100_003 + 50_000 + expert)
    if integer:
        return [torch.randint(-8, 9, s, generator=gen).to(dtype) for s in SHAPES]
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


def replica_grad(seed: int, rank: int, slot: int, integer: bool) -> torch.Tensor:
    """fp32 ``[NUMEL]`` gradient that rank ``rank`` computed in slot ``slot``."""
    gen = torch.Generator().manual_seed(seed * 100_003 + 70_000 + rank * 64 + slot)
    if integer:
        return torch.randint(-8, 9, (NUMEL,), generator=gen).float()
    return torch.randn(NUMEL, generator=gen)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def expected_grad(rank, slot_expert, num_experts, seed, local_index, integer) -> torch.Tensor:
    """fp64 ``[NUMEL]``: main gradient plus every hosting slot's gradient (independent sum)."""
    per_rank = num_experts // slot_expert.shape[0]
    e = rank * per_rank + local_index
    total = flat(main_grad(seed, e, integer)).double()
    for r, row in enumerate(slot_expert.tolist()):
        for s, x in enumerate(row):
            if x == e:
                total += replica_grad(seed, r, s, integer).double()
    return total


# -- reference runs of the transfers --------------------------------------------------------------


def caller_thread_buffer(
    num_slots: int, weight_dtype=torch.float32, *, shapes=SHAPES, grad_dtype=torch.float32
) -> ReplicaBuffer:
    """A ReplicaBuffer whose transfers the caller's thread issues (``comm_stream`` ``None``: a relay's
    later rounds in ``wait()``), not a HostCommStream. Collective, like every buffer."""
    buffer = ReplicaBuffer(num_slots, shapes, weight_dtype, grad_dtype=grad_dtype)
    buffer.comm_stream = None
    return buffer


def run_distribution(
    rank, slot_expert, num_experts, seed, sched, dtype=torch.float32, twice=False
) -> list[str]:
    per_rank = num_experts // slot_expert.shape[0]
    main = [expert_weights(seed, rank * per_rank + i, dtype) for i in range(per_rank)]
    buffer = caller_thread_buffer(slot_expert.shape[1], dtype)
    replica = buffer.replica_weights.fill_(SENTINEL)
    buffer.distribute_weights(sched, main)
    if twice:  # backward re-materialization after later layers overwrote the shared buffer
        replica.normal_()
        replica[slot_expert[rank] < 0] = SENTINEL
        buffer.distribute_weights(sched, main)
    failures = []
    for s, e in enumerate(slot_expert[rank].tolist()):
        if e < 0:
            if not bool((replica[s] == SENTINEL).all()):
                failures.append(f"empty slot {s} was written")
        elif not torch.equal(replica[s], flat(expert_weights(seed, e, dtype))):
            failures.append(f"slot {s} (expert {e}) differs from its main expert")
    for i in range(per_rank):  # the sender's main weights are untouched
        if not all(
            torch.equal(a, b)
            for a, b in zip(main[i], expert_weights(seed, rank * per_rank + i, dtype))
        ):
            failures.append(f"main expert {rank * per_rank + i} was modified")
    return failures


def reduced_grads(rank, slot_expert, num_experts, seed, sched, integer, main_dtype=torch.float32):
    """Run one reduction; return (main grads after, replica buffer after)."""
    per_rank = num_experts // slot_expert.shape[0]
    mains = [main_grad(seed, rank * per_rank + i, integer, main_dtype) for i in range(per_rank)]
    buffer = caller_thread_buffer(slot_expert.shape[1])
    replica = buffer.replica_grads
    replica.copy_(
        torch.stack([replica_grad(seed, rank, s, integer) for s in range(slot_expert.shape[1])])
    )
    replica[slot_expert[rank] < 0] = float("nan")  # never read: it would poison a main gradient
    buffer.reduce_gradients(sched, mains)
    return mains, replica


def unhosted_slots_touched(rank, slot_expert, replica) -> bool:
    """Whether a reduction wrote a slot that hosts no replica on this rank (NaN before it)."""
    return not bool(replica[slot_expert[rank] < 0].isnan().all())
