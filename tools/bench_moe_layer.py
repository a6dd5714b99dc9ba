"""Benchmark: one megatron-core MoE layer on CPU ranks over gloo, skewed routing.

Measures forward+backward throughput (tokens/s over the EP group) of, in one run:
  none           megatron-core's MoELayer with the skewed router (the straggler case),
  ultraep        the same layer balanced by UltraEP (BalancedMoELayer),
  eplb-exact     EPLB's replication rule on the exact load, through the same dispatcher,
  force-balanced megatron-core's MoELayer with --moe-router-force-load-balancing (the ideal),
  force-balanced again, a second instance of it: its ratio to the first is the noise floor of this
                 run (what the same layer scores against itself on this machine, now),
  ultraep no transfers, a measurement control: the ultraep layer with every replica transfer skipped
                 (replicas computed with whatever the shared buffer holds, replica gradients dropped:
                 numerically wrong); its ratio is what ultraep would score if its transfers cost
                 nothing here, where their copies and gloo's socket work share the ranks' two cores,
and, for the balanced layers, the balancing overheads per iteration: planning on the host, the
replica transfers (weight distribution, re-materialization, gradient reduction) and the reroute.
Transfers are reported twice: "exposed", the host time the overlapped layer spends issuing and
waiting for them (what compute did not hide), and "total", the same with every transfer waited for
where it is issued (``--moe-balancer-no-overlap``; measured on its own layer in the same run; it
includes waiting for the peer to reach the same transfer). On the CPU the transfers run on the
replica buffer's HostCommStream, a thread standing in for a GPU's communication stream (packing,
issuing gloo's sends and receives, whose bytes gloo's own threads move): its CPU time is not a
rank's critical path, as a communication stream's is not, but it shares these two cores with the
ranks, which the wall-time columns show; the "other CPU" column is the CPU time of every thread of
a rank but its main one (gloo's for every layer, and a balanced layer's HostCommStream).

Two more rows split ultraep's ratio: "experts only" runs, interleaved with the layers, just the
expert compute of the latest iteration of ultraep and of force-balanced (megatron's experts module
on the rows each local expert received, and for ultraep the redundant slots' module on theirs,
forward and backward on random tokens). Their ratio is what the difference between the two
distributions of rows over experts, and the redundant slots' extra expert call, cost on this
machine; the layer's ratio over it is the rest: the balancing's host work, the transfers' share of
the cores, the token exchange.

    bash tools/ensure_env.sh >/dev/null && ~/.cache/ultraep-megatron/venv/bin/python tools/bench_moe_layer.py

Skew: megatron-core's --moe-router-force-biased (a fixed random per-expert logit bias shared by all
ranks; negative std = the same bias every step). One thread per rank; on this 2-core machine use
EP=2. The layers run interleaved iteration by iteration, in a fresh order each iteration, and each
ratio compares iterations that ran back to back; figures are only comparable within one run.

Page faults: glibc serves PyTorch's large CPU tensors from fresh pages again and again (tensors above
its mmap threshold are unmapped when freed, freed heap memory is trimmed), and on this VM a fault
costs about 17 us, so which layer's allocations happened to fault moved the large-expert ratios by
0.1 between layers running the same code. A GPU's caching allocator takes no such faults: it keeps
its blocks for the next allocation. The ranks therefore run with CACHING_ALLOCATOR_ENV, for every
layer alike: PyTorch's THP_MEM_ALLOC_ENABLE=1 (large tensors on transparent huge pages) and glibc
tunables that keep freed memory up to 32 MiB per tensor in the heap; ``--plain-allocator`` measures
without them, and the ``faults`` column shows what is left.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ultraep_megatron.planner.baselines import registry  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ep-size", type=int, default=2)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--ffn-hidden-size", type=int, default=512)
    p.add_argument("--tokens-per-rank", type=int, default=2048)
    p.add_argument("--num-slots", type=int, default=1)
    p.add_argument(
        "--router-bias-std",
        type=float,
        default=-2.0,
        help="--moe-router-force-biased std (negative: fixed bias per layer)",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=16,
        help="timed iterations per repeat (per-iteration ratios vary by several percent here)",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--no-ddp",
        action="store_true",
        help="plain autograd gradients instead of megatron-core's DistributedDataParallel "
        "(whose fp32 main_grad buffers every Megatron training run has)",
    )
    p.add_argument(
        "--plain-allocator",
        action="store_true",
        help="PyTorch's and glibc's default CPU allocation: 4 KiB pages (unless the kernel's "
        "transparent huge pages are 'always'; the report says), a heap glibc trims, "
        "its dynamic mmap threshold (by default the ranks run with CACHING_ALLOCATOR_ENV, "
        "see the module docstring)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="measure every layer this many times (interleaved); ratios are medians",
    )
    args = p.parse_args()
    if args.warmup < 1:  # every timed iteration must find rows of an earlier one to replay
        p.error(
            "--warmup must be at least 1: the experts-only rows replay the latest iteration of a layer"
        )
    return args


def build(
    cfg, balancer: str | None, force_balanced: bool, overlap: bool = True, transfers: bool = True
):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ultraep_megatron.megatron.balanced_layer.balanced_moe import BalancedMoELayer
    from ultraep_megatron.megatron.balanced_layer.context import BalancingContext
    from ultraep_megatron.planner import BalancerConfig

    model_parallel_cuda_manual_seed(1234)  # every layer starts from the same weights
    config = TransformerConfig(
        num_layers=1,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        moe_ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=4,
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.topk,
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=cfg.ep_size,
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        moe_router_force_load_balancing=force_balanced,
        moe_router_force_biased=None if force_balanced else cfg.router_bias_std,
    )
    builder = get_moe_module_spec(use_te=False, num_experts=cfg.num_experts, moe_grouped_gemm=False)
    if balancer is not None:
        balancing = BalancingContext(
            BalancerConfig(name=balancer, num_slots=cfg.num_slots), overlap=overlap
        )
        builder = functools.partial(
            BalancedMoELayer, submodules=builder.keywords["submodules"], balancing=balancing
        )
    layer = builder(
        config=config,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        is_mtp_layer=False,
    )
    layer.set_layer_number(1)
    if not transfers:
        skip_transfers(layer)
    if cfg.no_ddp:
        return layer
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    # As in training: gradients accumulate into DDP's fp32 main_grad buffers (its bucket
    # reduction runs at the end of an iteration, outside what is timed here).
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    return DistributedDataParallel(config, ddp_config, module=layer)


def skip_transfers(layer) -> None:
    """The measurement control: ``layer`` issues no replica transfer. The replica experts
    compute with whatever the shared weight buffer holds and their weight gradients are dropped (the
    reduction's copy of them into the gradient buffer runs on the transfer's stream, so it goes
    too): numerically wrong; everything else (plan, reroute, the replica compute) runs as in the
    ultraep layer."""

    slots = layer.balancing.slots

    def fill(invocation, main_weights):
        slots.holder = invocation

    slots.fill = fill
    slots.wait_filled = lambda invocation: None
    slots.reduce = lambda invocation, targets, hosted_grads, fold_on_stream: None


class Measurement:
    """One layer's timed iterations on this rank.

    Per forward+backward: wall, seconds of the group (max over ranks); cpu, the busiest rank's critical
    path; faults, the most minor page faults a rank's main thread took (memory the host allocator
    got fresh or had returned, touched again: critical-path CPU time that a GPU's caching allocator
    does not spend); other_cpu, the most CPU time a rank's other threads took (gloo's, and a balanced
    layer's HostCommStream: work sharing this VM's cores with the ranks' main threads); rows, rows
    its experts received (last iteration). A rank's critical path is its main thread's CPU time
    (``time.thread_time``: compute, not time descheduled while this VM's cores run other work) plus
    the time it was blocked waiting for a replica transfer: what a rank with a device of its own
    would spend. With ``record_expert_rows``, also the rows each local expert and redundant slot
    received in the latest iteration, which :class:`ExpertsOnly` replays.
    """

    #: The label of the measurement this one's ratios are against.
    reference = "force-balanced"

    def __init__(self, cfg, model, *, record_expert_rows: bool = False):
        self.cfg, self.model = cfg, model
        self.layer = layer = getattr(model, "module", model)  # inside DDP or not
        self.balancing = getattr(layer, "balancing", None)
        self.x = torch.randn(
            cfg.tokens_per_rank,
            1,
            cfg.hidden_size,
            generator=torch.Generator().manual_seed(torch.distributed.get_rank()),
        )
        self._start_records()
        compute = type(layer).routed_experts_compute.__get__(
            layer
        )  # not an earlier repeat's wrapper

        def counting(h, p):
            self.rows = h.shape[0]
            invocation = getattr(layer.token_dispatcher, "invocation", None)
            self.replica_rows = invocation.plan.replica_rows if invocation is not None else ()
            return compute(h, p)

        layer.routed_experts_compute = counting
        if record_expert_rows:
            experts = type(layer.experts).forward.__get__(
                layer.experts
            )  # not an earlier repeat's wrapper

            def recording(hidden, tokens_per_expert, probs, **kwargs):
                # Host counts: the balanced layer's plan, megatron's own copy for its layer.
                self.expert_rows = (
                    tokens_per_expert.tolist()
                    if torch.is_tensor(tokens_per_expert)
                    else list(tokens_per_expert)
                )
                return experts(hidden, tokens_per_expert, probs, **kwargs)

            layer.experts.forward = recording

    def _start_records(self) -> None:
        self.rows = 0
        self.expert_rows: list = []  # per local expert, latest iteration (record_expert_rows)
        self.replica_rows: tuple = ()  # per redundant slot, latest iteration
        self.wall, self.cpu, self.faults, self.other_cpu = [], [], [], []

    def forward_backward(self) -> None:
        out, _ = self.model(self.x.clone().requires_grad_(True))
        out.sum().backward()

    def step(self, timed: bool) -> None:
        balancing = self.balancing
        if hasattr(self.model, "zero_grad_buffer"):  # as the training loop does between iterations
            self.model.zero_grad_buffer()
        torch.distributed.barrier()
        blocked0 = balancing.overheads.transfer_blocked_seconds if balancing is not None else 0.0
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        self.forward_backward()
        cpu = torch.tensor([time.thread_time() - c0])
        # Every thread's CPU but this one's; every transfer of the step was waited for.
        other = torch.tensor([time.process_time() - p0 - float(cpu)])
        faults = torch.tensor([float(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)])
        wall = torch.tensor([time.perf_counter() - t0])
        if balancing is not None:  # the time this rank sat waiting for a replica transfer
            cpu += balancing.overheads.transfer_blocked_seconds - blocked0
        for value in (wall, cpu, faults, other):  # the slowest rank's
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        if timed:
            self.wall.append(float(wall))
            self.faults.append(float(faults))
            self.cpu.append(float(cpu))
            self.other_cpu.append(float(other))
        elif balancing is not None:  # overheads of the timed iterations only
            balancing.overheads.reset()

    def result(self, ideal: "Measurement") -> dict:
        """Medians over the timed iterations; ``x_fb``: ``ideal``'s time (this measurement's
        ``reference``) over this layer's, iteration by iteration (the two ran back to back), then
        the median."""
        cfg = self.cfg
        cpu_max, ideal_max = self.cpu, ideal.cpu
        gathered = [torch.zeros(1) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(gathered, torch.tensor([float(self.rows)]))
        loads = torch.cat(gathered)
        result = dict(
            wall=median(self.wall),
            cpu_max=median(cpu_max),
            wall_x_fb=median([i / m for i, m in zip(ideal.wall, self.wall)]),
            cpu_x_fb=median([i / m for i, m in zip(ideal_max, cpu_max)]),
            faults=median(self.faults),
            other_cpu=median(self.other_cpu),
            imbalance=float(loads.max() / loads.mean()),
        )
        if self.balancing is not None:
            o = self.balancing.overheads
            mine = (
                torch.tensor(
                    [o.plan_seconds, o.host_seconds, o.transfer_seconds, o.reroute_seconds]
                )
                / cfg.iters
            )
            torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
            result.update(zip(("plan", "host", "transfers", "reroute"), mine.tolist()))
        return result


class ExpertsOnly(Measurement):
    """The expert compute of another measurement's latest iteration, alone: on each rank, megatron's
    experts module (and, for a balanced layer, its redundant slots' module on the replica buffer)
    forward and backward on random tokens and probabilities, with the rows each local expert and
    redundant slot received there. Against the same for force-balanced: what the difference between
    the two distributions of rows over experts, and the balanced layer's extra expert call for its
    redundant slots, cost on this machine, apart from the balancing's own work (planning, reroute,
    transfers) and the token exchange."""

    reference = "force-balanced experts only"

    def __init__(self, cfg, source: Measurement):
        """``source``: a :class:`Measurement` with ``record_expert_rows``, run in the same iterations."""
        self.cfg, self.model, self.layer, self.source = cfg, source.model, source.layer, source
        self.balancing = None
        self._start_records()
        most = (
            cfg.tokens_per_rank * cfg.topk * cfg.ep_size
        )  # every (token, expert) pair of the group
        generator = torch.Generator().manual_seed(1000 + torch.distributed.get_rank())
        self.tokens = torch.randn(most, cfg.hidden_size, generator=generator)
        self.probs = torch.rand(most, generator=generator)

    def forward_backward(self) -> None:
        layer, rows, replica_rows = self.layer, self.source.expert_rows, self.source.replica_rows
        if not rows:  # the source has not run yet (first warm-up iteration; the same on every rank)
            return
        main, total = sum(rows), sum(rows) + sum(replica_rows)
        self.rows = total
        # Leaves over the stored rows (no copy), differentiable as the router's are.
        tokens = self.tokens[:total].detach().requires_grad_(True)
        probs = self.probs[:total].detach().requires_grad_(True)
        out, _ = layer.experts(tokens[:main], torch.tensor(rows), probs[:main])
        loss = out.sum()
        if total > main:  # the redundant slots' module on (leaves over) the replica buffer's views
            slots, layout = layer.balancing.slots.buffer, layer.layer_experts.layout
            views = [
                layout.replica_weights(slots.weight_views(s), None) for s in range(slots.num_slots)
            ]
            leaves = [[w.detach().requires_grad_() for w in slot] for slot in views]
            replicas = layer.balancing.replica_experts
            loss = loss + replicas(leaves, tokens[main:], replica_rows, probs[main:]).sum()
        loss.backward()


#: The CPU allocation the ranks run with by default, for every layer alike (module docstring).
CACHING_ALLOCATOR_ENV = {
    # PyTorch: tensors of 2 MiB and more 2 MiB-aligned, on transparent huge pages.
    "THP_MEM_ALLOC_ENABLE": "1",
    # glibc: tensors up to 32 MiB (its largest mmap threshold; a fixed one also stops the dynamic
    # adjustment) from the heap, and freed heap memory kept for the next allocation, not trimmed.
    "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=68719476736",
}


def allocator_settings() -> str:
    """The CPU allocation settings this rank runs with, for the report."""
    settings = [
        f"{name}={os.environ[name]}" for name in CACHING_ALLOCATOR_ENV if os.environ.get(name)
    ]
    described = ", ".join(settings) if settings else "PyTorch's and glibc's defaults"
    try:  # "always" puts large heap and mmap regions on huge pages without PyTorch asking
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split()
        described += f"; kernel transparent huge pages: {next(w.strip('[]') for w in thp if w.startswith('['))}"
    except (OSError, StopIteration):
        pass
    return described


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


#: The second force-balanced layer: its ratio to the first is the run's noise floor.
NOISE_FLOOR = "force-balanced again"
#: The measurement control without transfers (skip_transfers).
NO_TRANSFERS = f"{registry.ULTRAEP} no transfers"

# (row label, balancer, force-balanced router, overlapped transfers, transfers at all)
LAYERS = (
    (registry.NONE, None, False, True, True),
    (registry.ULTRAEP, registry.ULTRAEP, False, True, True),
    (f"{registry.ULTRAEP} no-overlap", registry.ULTRAEP, False, False, True),
    (NO_TRANSFERS, registry.ULTRAEP, False, True, False),
    (registry.EPLB_EXACT, registry.EPLB_EXACT, False, True, True),
    (f"{registry.EPLB_EXACT} no-overlap", registry.EPLB_EXACT, False, False, True),
    ("force-balanced", None, True, True, True),
    (NOISE_FLOOR, None, True, True, True),
)

#: Expert compute alone (ExpertsOnly), each on the rows of the layer named: label -> source label.
EXPERTS_ONLY = {
    f"{registry.ULTRAEP} experts only": registry.ULTRAEP,
    "force-balanced experts only": "force-balanced",
}


def worker(cfg):
    from ultraep_megatron.megatron.cpu import backend as cpu_backend

    cpu_backend.activate()
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(expert_model_parallel_size=cfg.ep_size)
    rank = torch.distributed.get_rank()
    tokens = cfg.tokens_per_rank * cfg.ep_size
    layers = {
        label: build(cfg, balancer, force, overlap, transfers)
        for label, balancer, force, overlap, transfers in LAYERS
    }
    runs = {label: [] for label in [*layers, *EXPERTS_ONLY]}
    for repeat in range(cfg.repeats):
        measurements = {
            label: Measurement(cfg, layer, record_expert_rows=label in EXPERTS_ONLY.values())
            for label, layer in layers.items()
        }
        for label, source in EXPERTS_ONLY.items():
            measurements[label] = ExpertsOnly(cfg, measurements[source])
        # Interleaved iteration by iteration, so that drifting machine load hits every layer alike
        # and each ratio compares iterations that ran back to back; in a fresh order each iteration,
        # the same on every rank (the layers' collectives must match), so that no layer always
        # follows the same one (a rotation keeps each layer's predecessor, and what it left in the
        # caches, fixed).
        for i in range(cfg.warmup + cfg.iters):
            order = random.Random(repeat * 100_003 + i).sample(
                list(measurements.values()), len(measurements)
            )
            for m in order:
                m.step(timed=i >= cfg.warmup)
        for label, m in measurements.items():
            runs[label].append(m.result(measurements[m.reference]))
    if rank == 0:
        report(cfg, tokens, runs)
    torch.distributed.destroy_process_group()


def report(cfg, tokens, runs) -> None:
    print(
        f"\nMoE layer fwd+bwd, EP={cfg.ep_size} (gloo, 1 thread/rank), E={cfg.num_experts}, top-{cfg.topk}, "
        f"hidden {cfg.hidden_size}, ffn {cfg.ffn_hidden_size}, {cfg.tokens_per_rank} tokens/rank, "
        f"{cfg.num_slots} slot(s)/rank, router bias std {cfg.router_bias_std}; {cfg.repeats} repeats x "
        f"{cfg.iters} timed iterations, medians; CPU allocator: "
        f"{allocator_settings()}"
    )
    print(
        "x f-b: force-balanced's time / this layer's (the experts-only rows: force-balanced experts only's), "
        "higher is better, per iteration (run back to back), median per repeat, then the median of the repeats; "
        "wall: slowest rank; critical: the busiest rank's compute (main-thread CPU time) plus its "
        "time blocked on replica transfers (the critical path with a device per rank); faults: the most minor page "
        "faults a rank's main thread took per iteration (their cost is part of its critical time); other CPU: "
        "the most CPU time a rank's other threads took (gloo's, the replica transfers' HostCommStream)"
    )
    print(
        f"| {'layer':<27} | {'wall ms':>8} | {'tokens/s':>9} | {'wall x f-b':>10} | {'critical ms':>14} "
        f"| {'critical x f-b (repeats)':>26} | {'faults':>7} | {'other CPU ms':>12} | {'imbalance':>9} "
        f"| {'plan ms':>7} | {'host ms':>7} | {'transfers ms':>12} | {'reroute ms':>10} |"
    )
    print(
        f"|{'-' * 29}|{'-' * 10}|{'-' * 11}|{'-' * 12}|{'-' * 16}|{'-' * 28}|{'-' * 9}|{'-' * 14}|{'-' * 11}"
        f"|{'-' * 9}|{'-' * 9}|{'-' * 14}|{'-' * 12}|"
    )
    for label, measured in runs.items():
        wall_ratios = [m["wall_x_fb"] for m in measured]
        cpu_ratios = [m["cpu_x_fb"] for m in measured]
        wall = median([m["wall"] for m in measured])
        per_repeat = " ".join(f"{r:.2f}" for r in cpu_ratios)
        overheads = ""
        if "plan" in measured[0]:
            overheads = " | ".join(
                f"{median([m[k] for m in measured]) * 1e3:{w}.2f}"
                for k, w in (("plan", 7), ("host", 7), ("transfers", 12), ("reroute", 10))
            )
        else:
            overheads = " | ".join(f"{'':>{w}}" for w in (7, 7, 12, 10))
        print(
            f"| {label:<27} | {wall * 1e3:8.1f} | {tokens / wall:9.0f} | {median(wall_ratios):10.2f} "
            f"| {median([m['cpu_max'] for m in measured]) * 1e3:14.1f} "
            f"| {median(cpu_ratios):5.3f} ({per_repeat:>18}) "
            f"| {median([m['faults'] for m in measured]):7.0f} "
            f"| {median([m['other_cpu'] for m in measured]) * 1e3:12.2f} "
            f"| {median([m['imbalance'] for m in measured]):9.2f} | {overheads} |"
        )
    floor = [m["cpu_x_fb"] for m in runs[NOISE_FLOOR]]
    print(
        f"noise floor: force-balanced against itself, critical x f-b {median(floor):.2f} (repeats "
        f"{' '.join(f'{r:.2f}' for r in floor)}): the same layer's per-repeat ratios varied by up to "
        f"{max(abs(r - 1) for r in floor):.2f} in this run"
    )
    label = f"{registry.ULTRAEP} experts only"
    experts = median([m["cpu_x_fb"] for m in runs[label]])
    layer = median([m["cpu_x_fb"] for m in runs[registry.ULTRAEP]])
    print(
        f"expert compute alone ({label} / force-balanced experts only: megatron's experts module, and the "
        f"redundant slots' module, fwd+bwd on the rows each expert and slot received in the layers' "
        f"latest iteration): critical x f-b {experts:.2f} (repeats "
        f"{' '.join(f'{m['cpu_x_fb']:.2f}' for m in runs[label])}); the layer's {layer:.2f} over it, "
        f"{layer / experts:.3f}, is the rest: the balancing's host work, the transfers' share of the cores, "
        f"the token exchange"
    )
    other = {
        label: median([m["other_cpu"] for m in runs[label]])
        for label in (registry.ULTRAEP, "force-balanced")
    }
    print(
        f"other threads' CPU per iteration (busiest rank): {registry.ULTRAEP} {other[registry.ULTRAEP] * 1e3:.2f} ms, "
        f"force-balanced {other['force-balanced'] * 1e3:.2f} ms; the difference, "
        f"{(other[registry.ULTRAEP] - other['force-balanced']) * 1e3:.2f} ms, is what the replica transfers "
        f"take off the main threads, from the two cores the ranks compute on"
    )
    control = median([m["cpu_x_fb"] for m in runs[NO_TRANSFERS]])
    print(
        f"without transfers ({NO_TRANSFERS}: the measurement control, numerically wrong): critical x f-b "
        f"{control:.3f} (repeats {' '.join(f'{m['cpu_x_fb']:.2f}' for m in runs[NO_TRANSFERS])}); "
        f"{registry.ULTRAEP}'s {layer:.3f} over it, {layer / control:.3f}, is what its transfers cost on this "
        f"machine, exposed or not (their host calls, their copies and gloo's socket work on the two cores "
        f"the ranks compute on)"
    )
    for name in (registry.ULTRAEP, registry.EPLB_EXACT):
        exposed = median([m["transfers"] for m in runs[name]])
        total = median([m["transfers"] for m in runs[f"{name} no-overlap"]])
        print(
            f"{name}: transfers {total * 1e3:.2f} ms per iteration when waited where issued (including the "
            f"wait for the peer to reach them), {exposed * 1e3:.2f} ms exposed when overlapped"
        )


def main():
    cfg = parse_args()
    if "RANK" in os.environ:
        return worker(cfg)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
        MASTER_ADDR="127.0.0.1",
        PYTHONWARNINGS="ignore",
    )
    for name, value in CACHING_ALLOCATOR_ENV.items():
        if cfg.plain_allocator:  # the defaults, whatever the calling shell set
            env.pop(name, None)
        else:
            env[name] = ":".join(
                filter(None, [env.get(name) if name == "GLIBC_TUNABLES" else None, value])
            )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.ep_size}",
        __file__,
        *sys.argv[1:],
    ]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
