"""Benchmark: the balancing control path of one MoE layer, counted: launches, bytes between host and
device, host waits, and the host time to issue the preprocessing, per planner and megatron stage.

One process plays EP rank 0 of an R-rank expert-parallel group (torch's ``fake`` process group:
collectives return at once, the other ranks' loads are synthetic, a Zipf-skewed router). The same
layer is built three ways, from the same weights and tokens: megatron's own ``MoELayer``
(``none``), and the balanced layer with the host and the device planner. A ``TorchDispatchMode``
over one forward and backward counts, per stage (megatron's ``route``, ``preprocess``,
``dispatch``, ``routed_experts_compute``, ``combine``, ``postprocess``):

* launches: aten ops that launch a kernel (views and allocations left out) plus each custom op of
  the planner (``ultraep::``) as the kernels it launches on CUDA;
* host waits: event and device synchronizations (where megatron waits for its splits, and the
  plan's one wait);
* bytes host -> device and device -> host: the balanced layer's crossings (``invocation.to_host``,
  ``invocation.upload``) and megatron's (its dispatcher's ``maybe_move_tensor_to_cpu``);
* ``preprocess_issue_us``: the host time of the preprocess stage minus the time spent inside ops
  (their bodies), median of ``--repeats`` forwards: what the host needs to issue the stage.

The backward's launches are counted without the matrix multiplications (the expert GEMMs and their
gradients, identical work in every layer); ``backward_ops`` lists them per op. Ops whose outputs
are all empty count no launch (CUDA's kernels return before launching). The data plane's transfers
(the replica weights' distribution and re-materialization, the replica gradients' reduction) run on
the CPU on its communication thread, on a GPU on a side stream issued from the main thread: counted
apart, as ``transfer_launches`` per pass (each point-to-point operation, copy and fold one launch).

    python tools/bench_control_path.py                 # EP64, E=256, T=4096, top-8, S=2
    python tools/bench_control_path.py --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ultraep_megatron.planner.baselines.registry import ULTRAEP  # noqa: E402
from ultraep_megatron.planner.fused_plan import OP_NAMESPACE  # noqa: E402

STAGES = ("route", "preprocess", "dispatch", "routed_experts_compute", "combine", "postprocess")
PLANNERS = ("none", "host", "device")
#: Kernels each custom op of the planner launches on CUDA (its Triton kernels).
CUSTOM_OP_LAUNCHES = {"plan_invocation": 1, "reroute_permute": 2, "unpermute_add": 1}
#: Ops that launch no kernel besides views: allocations and metadata.
NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "is_nonzero",
    "_local_scalar_dense",
}
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "_grouped_mm", "linear"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ep-size", type=int, default=64, help="R")
    p.add_argument("--num-experts", type=int, default=256, help="E")
    p.add_argument("--num-slots", type=int, default=2, help="S")
    p.add_argument("--tokens", type=int, default=4096, help="T, tokens of this rank")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--ffn-hidden-size", type=int, default=32)
    p.add_argument("--zipf", type=float, default=1.0, help="the other ranks' loads' Zipf exponent")
    p.add_argument("--repeats", type=int, default=5, help="forwards timed for the issue time")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


class Counter(TorchDispatchMode):
    """Counts launches per stage, and the time spent inside ops.

    A launch is an op on device tensors: the layer's parameters and inputs, and whatever ops make
    from them or create (on the CPU every tensor is a CPU tensor, so the device's are tracked). An
    op on host tensors only (the plan's host metadata: numpy-made, or copied to the host) is host
    work, no launch."""

    def __init__(self, device_tensors):
        super().__init__()
        self.stage = "other"
        self.launches: dict = {}
        self.backward_non_gemm = 0
        self.backward_ops: dict = {}
        self.in_backward = False
        self.inside_seconds = 0.0
        self.device = WeakIdKeyDictionary({t: True for t in device_tensors})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.inside_seconds += time.perf_counter() - t0
        name = func.__name__.split(".")[0]
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = name != "lift_fresh" and (not inputs or any(t in self.device for t in inputs))
        if on_device:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.device[t] = True
        if func.namespace == OP_NAMESPACE:
            launches = CUSTOM_OP_LAUNCHES.get(name, 1)
        elif not on_device or func.is_view or name in NO_KERNEL or _empty(out):
            launches = 0
        else:
            launches = 1
        if self.in_backward:
            if name not in GEMMS and launches:
                self.backward_non_gemm += launches
                self.backward_ops[name] = self.backward_ops.get(name, 0) + launches
        else:
            self.launches[self.stage] = self.launches.get(self.stage, 0) + launches
        return out


def _empty(out) -> bool:
    """Whether every tensor ``out`` holds has no element: CUDA's kernels return without a launch
    (autograd's backward of a concatenation makes such tensors for the empty chunks)."""
    tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.numel() == 0 for t in tensors)


@contextlib.contextmanager
def crossings(figures: dict):
    """Bytes and waits at the crossing points, into ``figures``."""
    from megatron.core.transformer.moe import token_dispatcher

    from ultraep_megatron.megatron.balanced_layer import invocation

    start, wait, upload, move = (
        invocation.PlanHandle.start,
        invocation.PlanHandle.wait,
        invocation.upload,
        token_dispatcher.maybe_move_tensor_to_cpu,
    )
    event_cls = torch.cuda.Event
    synchronize = event_cls.synchronize
    device_synchronize = torch.cuda.synchronize

    def nbytes(tensor):
        return tensor.numel() * tensor.element_size() if torch.is_tensor(tensor) else 0

    def counting_wait(handle):  # without CUDA the crossing has no event to count: its first wait
        if handle._plan is None and handle._event is None:
            figures["host_waits"] += 1
        return wait(handle)

    def counting_start(handle, *args, **kwargs):  # the plan's one crossing to the host
        figures["d2h_bytes"] += nbytes(handle.crossing)
        return start(handle, *args, **kwargs)

    def counting_upload(tensor, *args, **kwargs):
        figures["h2d_bytes"] += nbytes(tensor)
        return upload(tensor, *args, **kwargs)

    def counting_move(tensor, *args, **kwargs):
        if torch.is_tensor(tensor) and tensor.device.type != "cpu" or figures["cpu_counts_moves"]:
            figures["d2h_bytes"] += nbytes(tensor)
        return move(tensor, *args, **kwargs)

    def counting_synchronize(event, *args):
        figures["host_waits"] += 1
        return synchronize(event, *args)

    def counting_device_synchronize(*args):
        figures["host_waits"] += 1
        return device_synchronize(*args)

    invocation.PlanHandle.start, invocation.upload = counting_start, counting_upload
    invocation.PlanHandle.wait = counting_wait
    token_dispatcher.maybe_move_tensor_to_cpu = counting_move
    event_cls.synchronize = counting_synchronize
    torch.cuda.synchronize = counting_device_synchronize
    try:
        yield
    finally:
        invocation.PlanHandle.start, invocation.upload = start, upload
        invocation.PlanHandle.wait = wait
        token_dispatcher.maybe_move_tensor_to_cpu = move
        event_cls.synchronize, torch.cuda.synchronize = synchronize, device_synchronize


def build(cfg, planner: str, device):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ultraep_megatron.megatron.balanced_layer.balanced_moe import BalancedMoELayer
    from ultraep_megatron.megatron.balanced_layer.context import BalancingContext
    from ultraep_megatron.planner import BalancerConfig

    model_parallel_cuda_manual_seed(1234)
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
        use_cpu_initialization=device.type == "cpu",
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        moe_router_force_biased=1.0,
    )
    builder = get_moe_module_spec(use_te=False, num_experts=cfg.num_experts, moe_grouped_gemm=False)
    if planner != "none":
        balancing = BalancingContext(
            BalancerConfig(name=ULTRAEP, num_slots=cfg.num_slots), planner=planner
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
    return layer.to(device)


@contextlib.contextmanager
def transfers_counted(counter: Counter, figures: dict):
    """Count the launches of the transfers handed to the data plane's communication thread into
    ``figures["transfer_launches"][pass]``, ``pass`` the main thread's when handed over."""
    from ultraep_megatron.dataplane.host_stream import HostCommStream

    submit = HostCommStream.submit
    totals = figures.setdefault("transfer_launches", {"forward": 0, "backward": 0})

    def counted(stream, issue):
        where = "backward" if counter.in_backward else "forward"

        def issue_counted():
            comm = Counter([])
            comm.device = counter.device  # the same device tensors, seen from this thread
            with comm:
                try:
                    return issue()
                finally:
                    totals[where] += sum(comm.launches.values())

        return submit(stream, issue_counted)

    HostCommStream.submit = counted
    try:
        yield
    finally:
        HostCommStream.submit = submit


def synthetic_loads(cfg):
    """The other ranks' rows of the gathered load (Zipf-skewed, seeded)."""
    from ultraep_megatron.traces.synthetic import zipf_topk_load

    return zipf_topk_load(
        cfg.ep_size,
        cfg.num_experts,
        tokens_per_rank=cfg.tokens,
        top_k=cfg.topk,
        exponent=cfg.zipf,
        seed=0,
    )


@contextlib.contextmanager
def other_ranks(others: torch.Tensor):
    """The balanced layer's load gather returns the synthetic rows with this rank's own."""
    from ultraep_megatron.megatron.balanced_layer.dispatchers import PhysicalSlots

    gather = PhysicalSlots.gather_load

    def gather_load(slots, routing_map, group):
        load = gather(slots, routing_map, group)
        rows = others.to(load.device).clone()
        rows[slots.ep_rank] = load[slots.ep_rank]
        return rows

    PhysicalSlots.gather_load = gather_load
    try:
        yield
    finally:
        PhysicalSlots.gather_load = gather


def staged(layer, counter: Counter, stage_seconds: dict):
    """Wrap ``layer``'s stage methods: label ``counter``'s ops, time each stage."""
    for stage in STAGES:
        original = getattr(layer, stage)

        def wrapped(*args, _original=original, _stage=stage, **kwargs):
            outer, counter.stage = counter.stage, _stage
            inside0, t0 = counter.inside_seconds, time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                wall = time.perf_counter() - t0
                stage_seconds.setdefault(_stage, []).append(
                    (wall, counter.inside_seconds - inside0)
                )
                counter.stage = outer

        setattr(layer, stage, wrapped)


def shared(layer) -> list:
    """The replica buffer's tensors (weights and gradients): device memory the layers share."""
    slots = getattr(getattr(layer, "balancing", None), "slots", None)
    if slots is None:
        return []
    return [slots.buffer.replica_weights, slots.buffer.replica_grads]


def measure(cfg, planner: str, device, x: torch.Tensor, others: torch.Tensor) -> dict:
    layer = build(cfg, planner, device)
    layer.train()
    for _ in range(2):  # warm-up: compiled kernels, allocator, ring sizing
        with other_ranks(others):
            out, _ = layer(x)
            out.sum().backward()
    figures = {"d2h_bytes": 0, "h2d_bytes": 0, "host_waits": 0, "cpu_counts_moves": True}
    counter, stage_seconds = Counter([x, *layer.parameters(), *layer.buffers(), *shared(layer)]), {}
    staged(layer, counter, stage_seconds)
    with other_ranks(others), crossings(figures), transfers_counted(counter, figures), counter:
        out, _ = layer(x)
        counter.in_backward = True
        out.sum().backward()
        torch.cuda.synchronize() if device.type == "cuda" else None
    counts = dict(figures)
    launches = {stage: counter.launches.get(stage, 0) for stage in STAGES}
    backward_non_gemm = counter.backward_non_gemm
    issue = []
    for _ in range(cfg.repeats):
        stage_seconds.clear()
        with other_ranks(others), counter:
            counter.in_backward = False
            out, _ = layer(x)
        wall, inside = stage_seconds["preprocess"][0]
        issue.append(wall - inside)
        out.sum().backward()
    return {
        "preprocess_launches": launches["preprocess"],
        "forward_launches": sum(launches.values()),
        "launches_per_stage": launches,
        "backward_launches_non_gemm": backward_non_gemm,
        "backward_ops": dict(sorted(counter.backward_ops.items())),
        "transfer_launches": counts.get("transfer_launches", {"forward": 0, "backward": 0}),
        "h2d_bytes": counts["h2d_bytes"],
        "d2h_bytes": counts["d2h_bytes"],
        "host_waits": counts["host_waits"],
        "preprocess_issue_us": statistics.median(issue) * 1e6,
    }


def main():
    cfg = parse_args()
    warnings.filterwarnings("ignore")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        from ultraep_megatron.megatron.cpu import backend as cpu_backend

        cpu_backend.activate()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cfg.ep_size)
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=cfg.ep_size, create_gloo_process_groups=False
    )
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(cfg.tokens, 1, cfg.hidden_size, generator=generator).to(device)
    x.requires_grad_(True)
    others = synthetic_loads(cfg)
    results = {planner: measure(cfg, planner, device, x, others) for planner in PLANNERS}
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    print(
        f"Control path of one MoE layer, EP rank 0 of R={cfg.ep_size}, E={cfg.num_experts}, "
        f"S={cfg.num_slots}, T={cfg.tokens}, top-{cfg.topk}, on {where} (torch {torch.__version__})"
    )
    header = ["", *PLANNERS]
    rows = [
        ("preprocess launches", "preprocess_launches", "{}"),
        ("forward launches, all stages", "forward_launches", "{}"),
        ("backward launches (non-GEMM)", "backward_launches_non_gemm", "{}"),
        ("transfer launches, forward", ("transfer_launches", "forward"), "{}"),
        ("transfer launches, backward", ("transfer_launches", "backward"), "{}"),
        ("bytes host -> device", "h2d_bytes", "{}"),
        ("bytes device -> host", "d2h_bytes", "{}"),
        ("host waits", "host_waits", "{}"),
        ("preprocess issue time (us, median)", "preprocess_issue_us", "{:.0f}"),
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))

    def figure(planner, key):
        value = results[planner]
        for part in key if isinstance(key, tuple) else (key,):
            value = value[part]
        return value

    for label, key, fmt in rows:
        print(f"| {label} | " + " | ".join(fmt.format(figure(p, key)) for p in PLANNERS) + " |")
    for planner in PLANNERS:
        per_stage = results[planner]["launches_per_stage"]
        print(
            f"  {planner}: launches per stage "
            + ", ".join(f"{k} {v}" for k, v in per_stage.items())
        )
    baseline = results["none"]["backward_ops"]
    for planner in PLANNERS[1:]:
        ops = results[planner]["backward_ops"]
        change = {op: ops.get(op, 0) - baseline.get(op, 0) for op in sorted({*ops, *baseline})}
        print(
            f"  {planner}: backward launches beyond none's, per op: "
            + ", ".join(f"{op} {n:+d}" for op, n in change.items() if n)
        )
    if cfg.json is not None:
        cfg.json.write_text(
            json.dumps(
                {"config": vars(cfg) | {"json": str(cfg.json)}, "planners": results},
                indent=2,
                default=str,
            )
        )
        print(f"wrote {cfg.json}")


if __name__ == "__main__":
    main()
