"""Worker (GPU check, ``tools/gpu_check.sh``): the balanced layer's preprocessing with the device
planner, captured in a CUDA graph (``torch.cuda.graph``) and replayed, against the same work run
eagerly.

One process on one GPU, one rank (``--rank``) of an R-rank expert-parallel group: what
``--cuda-graph-modules moe_preprocess`` with ``--moe-balancer-planner device`` captures of a
balanced MoE layer, less the load all-gather (a collective: the other ranks' rows of the ``[R, E]``
load are a static input standing in for it, as in ``bench_critical_path.py``):

  this rank's per-expert counts from its ``[T, k]`` routed pairs, the ``[R, E]`` load, the device
  plan's record and reroute table (one op, ``planner.fused_plan.plan_invocation``: the fused Triton
  kernel on CUDA), the balanced all-to-all dispatcher's permutation over the routed pairs (one op,
  ``planner.fused_reroute.reroute_permute``) into its send order.

After a warm-up (Triton compiles there) the work is captured once; then for each of ``--trials``
routings, each skewed towards other experts, the inputs are copied into the graph's static buffers,
the graph is replayed, and every output (permuted tokens, their probabilities, the send order, the
plan's record) must equal the eager run's on the same inputs, bit for bit. The trials must
produce different plans (a replay that reproduced the capture's plan would show), and the plan must
balance the load it was solved for (``imbalance after <= 1.05``). Prints one line::

    capture_replay_device_planner: PASS|FAIL <detail>

``--device cpu`` (the default without CUDA) is a dry run: the same capture and replay on the CPU
through the tests' graph stand-in (``tests/megatron/te_graph_standin.py``, which refuses what CUDA's
capture refuses), small sizes; it prints ``SKIP`` with that result. Exit status 0 on PASS or SKIP
(a dry run that passed), 1 otherwise.

    python tests/megatron/workers/capture_preprocess.py --device cuda   # on a GPU (a minute with Triton's compile)
    python tests/megatron/workers/capture_preprocess.py --device cpu    # the dry run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

NAME = "capture_replay_device_planner"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda: the check; cpu: its dry run on the CPU graph stand-in (the default without CUDA)",
    )
    p.add_argument("--ep-size", type=int, default=None, help="R (default 8; 4 in the dry run)")
    p.add_argument(
        "--num-experts", type=int, default=None, help="E (default 64; 16 in the dry run)"
    )
    p.add_argument("--num-slots", type=int, default=2, help="S, redundant slots per rank")
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="T, tokens of this rank's microbatch (default 2048; 256 in the dry run)",
    )
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--rank", type=int, default=0, help="this rank's index in the EP group")
    p.add_argument("--trials", type=int, default=4, help="replays, each with another routing")
    cfg = p.parse_args()
    # The dry run is small: the device planner's torch reference runs step by step on the CPU.
    on_gpu = cfg.device == "cuda" and torch.cuda.is_available()
    for name, gpu, cpu in (("ep_size", 8, 4), ("num_experts", 64, 16), ("tokens", 2048, 256)):
        if getattr(cfg, name) is None:
            setattr(cfg, name, gpu if on_gpu else cpu)
    return cfg


def routing_inputs(cfg, trial: int, device):
    """(the other ranks' load [R, E], this rank's top-k [T, k], probs [T, E], tokens [T, H]) of one
    trial: Zipf-skewed over another expert order per trial, so the straggler and the plan move."""
    from ultraep_megatron.traces.synthetic import zipf_topk_load

    R, E, T, k = cfg.ep_size, cfg.num_experts, cfg.tokens, cfg.topk
    gen = torch.Generator().manual_seed(100 + trial)
    order = torch.randperm(E, generator=gen)
    popularity = torch.empty(E)
    popularity[order] = 1.0 / torch.arange(1, E + 1, dtype=torch.float64).pow(1.2).float()
    logits = popularity.log() - torch.log(-torch.log(torch.rand(T, E, generator=gen)))
    top = logits.topk(k, dim=-1)
    probs = torch.zeros(T, E).scatter_(1, top.indices, torch.softmax(top.values, dim=-1))
    others = zipf_topk_load(R, E, tokens_per_rank=T, top_k=k, exponent=1.2, seed=100 + trial)
    tokens = torch.randn(T, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    return [t.to(device) for t in (others, top.indices, probs, tokens)]


def preprocess_function(cfg, static, config):
    """The captured work, on the static input buffers; returns its outputs."""
    from ultraep_megatron.planner.fused_plan import plan_invocation
    from ultraep_megatron.planner.fused_reroute import reroute_permute

    others, topk_ids, probs, tokens = static
    E = cfg.num_experts

    def preprocess():
        local = torch.zeros(E, dtype=torch.int64, device=topk_ids.device).scatter_add_(
            0, topk_ids.reshape(-1), torch.ones_like(topk_ids.reshape(-1))
        )
        load = torch.cat([others[: cfg.rank], local.view(1, E), others[cfg.rank + 1 :]])
        fused = plan_invocation(load, config, cfg.rank)
        out = reroute_permute(
            topk_ids, tokens, probs.gather(1, topk_ids), fused.table, num_experts=E
        )
        return out.permuted, out.permuted_probs, out.send_token, fused.record

    return preprocess


class _CudaGraph:
    """``torch.cuda.graph`` capture with a warm-up on a side stream, as TE's make_graphed_callables."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()

    def warm_up(self, function, iterations: int = 3):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(iterations):
                function()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def capture(self):
        return torch.cuda.graph(self.graph)

    def replay(self):
        self.graph.replay()
        torch.cuda.synchronize()


class _StandinGraph:
    """The CPU dry run's graph: the tests' stand-in (same capture rules, replays recorded ops)."""

    def __init__(self):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import te_graph_standin

        self.graph = te_graph_standin.StandinGraph()

    def warm_up(self, function, iterations: int = 1):
        function()

    def capture(self):
        return self.graph.capture()

    def replay(self):
        self.graph.replay()


def run_check(cfg, device) -> tuple[bool, str]:
    from ultraep_megatron.planner import BalancerConfig
    from ultraep_megatron.planner.record_layout import unpack_record
    from ultraep_megatron.planner.baselines import registry

    R, E, S = cfg.ep_size, cfg.num_experts, cfg.num_slots
    config = BalancerConfig(name=registry.ULTRAEP, num_slots=S)
    static = routing_inputs(cfg, trial=0, device=device)
    preprocess = preprocess_function(cfg, static, config)
    graph = _CudaGraph() if device.type == "cuda" else _StandinGraph()
    t0 = time.perf_counter()
    graph.warm_up(preprocess)
    with graph.capture():
        captured = preprocess()
    capture_seconds = time.perf_counter() - t0
    plans, worst_imbalance = set(), 0.0
    for trial in range(1, cfg.trials + 1):
        inputs = routing_inputs(cfg, trial, device)
        with torch.no_grad():
            for buffer, value in zip(static, inputs):
                buffer.copy_(value)
        graph.replay()
        replayed = [t.clone() for t in captured]
        eager = preprocess() if device.type != "cuda" else _eager(preprocess)
        names = ("permuted tokens", "permuted probs", "send order", "plan record")
        for name, a, b in zip(names, replayed, eager):
            if a.shape != b.shape or not torch.equal(a, b):
                return False, f"trial {trial}: the replayed {name} differs from the eager run's"
        host = replayed[3].cpu()
        record = unpack_record(host, R, E, S)
        plans.add(tuple(host.tolist()))
        figures = record.metrics()
        imbalance = figures["imbalance_after"]
        if record.balanced and imbalance > 1.05:
            return (
                False,
                f"trial {trial}: the replayed plan leaves imbalance {imbalance:.3f} (before "
                f"{figures['imbalance_before']:.3f})",
            )
        worst_imbalance = max(worst_imbalance, imbalance)
    if len(plans) != cfg.trials:
        return False, f"{len(plans)} distinct plans in {cfg.trials} replays with different routings"
    return True, (
        f"{cfg.trials} replays (R={R} E={E} S={S} T={cfg.tokens} k={cfg.topk}) equal the eager "
        f"runs bit for bit, {len(plans)} distinct plans, imbalance after <= {worst_imbalance:.3f}; "
        f"warm-up and capture {capture_seconds:.1f} s"
    )


def _eager(function):
    out = function()
    torch.cuda.synchronize()
    return out


def main() -> int:
    cfg = parse_args()
    if cfg.device == "cuda" and torch.cuda.is_available():
        try:
            ok, detail = run_check(cfg, torch.device("cuda"))
        except Exception as error:  # the check's one line says why, whatever failed
            ok, detail = False, f"{type(error).__name__}: {error}"
        print(f"{NAME}: {'PASS' if ok else 'FAIL'} {detail}")
        return 0 if ok else 1
    try:
        ok, detail = run_check(cfg, torch.device("cpu"))
        dry = f"dry run on the CPU graph stand-in: {'pass' if ok else 'FAIL'}, {detail}"
    except Exception as error:
        ok, dry = (
            False,
            f"dry run on the CPU graph stand-in failed: {type(error).__name__}: {error}",
        )
    why = "no CUDA device" if not torch.cuda.is_available() else "--device cpu"
    print(f"{NAME}: SKIP {why} ({dry})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
