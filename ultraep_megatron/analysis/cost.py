"""The MoE-layer cost model. Every time here is an ESTIMATE.

It turns a plan into per-layer forward/backward times from a model shape and a hardware
description, following the UltraEP objective (paper eq. 1-5):

* expert compute: the busiest rank's instances, each one GEMM of ``max((tokens + M0) * flops / F,
  weights / HBM)``: a roofline whose compute side carries a fixed cost of ``M0 =
  Hardware.gemm_overhead_tokens`` tokens per GEMM (small-M efficiency, see ``Hardware``); backward =
  2 x forward (dgrad + wgrad);
* token all-to-all: the busiest sender or receiver of remote tokens, dispatch + combine, forward and
  backward alike;
* replica transfers: the busiest sender or receiver of replica weights, over the data plane's
  transfer schedule with and without relay trees (``ultraep_megatron.dataplane.schedule``); the
  gradient reduction moves the same edges in the gradient dtype;
* scale-up domains (``Hardware.scale_up_domain``): tokens and weights between ranks of one domain move
  at ``scale_up_gbps``, across domains at ``inter_domain_gbps``; the two links run side by side, so
  a rank's traffic takes the longer of its two link times;
* where the transfers overlap, as the runtime schedules them (``megatron/context.py``,
  docs/integration.md): the forward weight distribution runs while the tokens are dispatched and
  the main experts compute, and a rank's replica experts wait for it; the backward
  re-materialization runs during the combine's backward and the replicas' backward waits for it;
  the gradient reduction runs during the main experts' backward and the layer's backward ends when
  it has arrived. ``Hardware.transfer_overlap`` is the fraction of each such window a transfer
  really hides (1: the device runs the transfer concurrently with that work; 0: it runs after it,
  ``--moe-balancer-no-overlap``), computed per rank: only ranks that host replicas wait;
* plan time: given by the caller (the replay charges the measured or a fixed one to the
  exact-load balancers).

Not modelled: attention and other non-MoE work, kernel launch and latency terms, overlap of
all-to-all with compute, contention between transfers and the work they overlap, DeepEP
deduplication. Ratios between balancers are the useful output.

A balancer's outcome is a ``planner.Plan`` or, for a peer that moves main experts (DeepSeek's
EPLB), a ``planner.baselines.Placement``: both are costed the same way (instances away from their
expert's home are replicas, fed from the home).

No Megatron import; pure functions on load tensors and plans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


from ultraep_megatron import planner
from ultraep_megatron.dataplane.schedule import ScheduleCache, build_schedule
from ultraep_megatron.planner import Plan
from ultraep_megatron.planner.baselines import Placement

__all__ = [
    "DEFAULT_SHAPE",
    "ExpertShape",
    "HARDWARE_PRESETS",
    "Hardware",
    "hardware_preset",
    "ideal_cost",
    "layer_cost",
    "min_quota_from_hardware",
    "slot_memory_bytes",
]

# ---------------------------------------------------------------------------------------------
# Hardware and model shape
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hardware:
    """Per-GPU hardware figures. Defaults: the UltraEP paper's rack-scale node (Table 2).

    Attributes:
        scale_up_gbps: scale-up (NVLink, intra-domain) bandwidth per GPU and direction, GB/s.
        peak_tflops: dense bf16 peak, TFLOP/s.
        hbm_tbps: HBM bandwidth, TB/s.
        compute_efficiency / comm_efficiency: achieved fraction of peak (1.0 = peak; the absolute
            times are then lower bounds).
        transfer_overlap: fraction of its overlap window a replica transfer hides (see the module
            docstring): 1.0, the runtime's schedule on a device that runs transfers concurrently
            with compute (CUDA: its own stream and NCCL communicator); 0.0, every transfer
            serialized (``--moe-balancer-no-overlap``).
        inter_domain_gbps: bandwidth per GPU and direction between scale-up domains (the
            scale-out NIC), GB/s. Paper: 400 Gb/s inter-rack = 50 GB/s.
        scale_up_domain: GPUs per scale-up (NVLink) domain, consecutive EP ranks (``None``: every
            EP group lies inside one domain).
        gemm_overhead_tokens: M0, the fixed cost of one expert's GEMM in tokens of plateau-rate
            compute: a GEMM of M tokens takes as long as ``M + M0`` tokens at the plateau, so it
            runs at ``M / (M + M0)`` of the plateau (half of it at M = M0). 100: fitted to the
            grouped-GEMM efficiencies DeepSeek published for DeepGEMM (the points and the fit:
            docs/traces.md, "Small GEMMs"); Hopper's tiles are 64-256 rows whatever the dtype.
        memory_gb: memory per GPU in GiB (what ``ultraep check-recipe`` budgets a rank against).
            Default: a GB200's 186 (HBM3e).
        gpus_per_node: GPUs per node (one torchrun node): 4 on a GB200 compute tray, 8 on an HGX
            board.
    """

    scale_up_gbps: float = 900.0
    peak_tflops: float = 2250.0
    hbm_tbps: float = 8.0
    compute_efficiency: float = 1.0
    comm_efficiency: float = 1.0
    transfer_overlap: float = 1.0
    inter_domain_gbps: float = 50.0
    scale_up_domain: Optional[int] = None
    gemm_overhead_tokens: float = 100.0
    memory_gb: float = 186.0
    gpus_per_node: int = 4

    def __post_init__(self):
        for name in ("scale_up_gbps", "peak_tflops", "hbm_tbps", "inter_domain_gbps", "memory_gb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("compute_efficiency", "comm_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must lie in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.transfer_overlap <= 1:
            raise ValueError(f"transfer_overlap must lie in [0, 1], got {self.transfer_overlap}")
        if not self.gemm_overhead_tokens >= 0:
            raise ValueError(f"gemm_overhead_tokens must be >= 0, got {self.gemm_overhead_tokens}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) \
                or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be an int >= 1, got {self.gpus_per_node!r}")
        N = self.scale_up_domain
        if N is not None and (isinstance(N, bool) or not isinstance(N, int) or N < 1):
            raise ValueError(f"scale_up_domain must be an int >= 1 or None, got {N!r}")

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.compute_efficiency

    @property
    def link_bytes_per_s(self) -> float:
        return self.scale_up_gbps * 1e9 * self.comm_efficiency

    @property
    def inter_domain_bytes_per_s(self) -> float:
        return self.inter_domain_gbps * 1e9 * self.comm_efficiency

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12

    def ranks_per_domain(self, num_ranks: int) -> int:
        """EP ranks per scale-up domain for an EP group of ``num_ranks`` (all of them when the group
        fits in one domain)."""
        N = self.scale_up_domain
        if N is None or N >= num_ranks:
            if N is not None and N % num_ranks:
                raise ValueError(f"an EP group of {num_ranks} ranks does not fit the scale-up domains of "
                                 f"{N} GPUs evenly")
            return num_ranks
        if num_ranks % N:
            raise ValueError(f"an EP group of {num_ranks} ranks does not split into scale-up domains of {N} GPUs")
        return N


#: Named hardware descriptions (``--moe-balancer-hardware``); sources in docs/traces.md.
HARDWARE_PRESETS: dict[str, Hardware] = {
    # UltraEP paper, Table 2: 64 GPUs per rack on a 900 GB/s scale-up fabric, 2250 TFLOP/s bf16,
    # 8 TB/s HBM, 400 Gb/s between racks; GB200 GPUs (186 GB of HBM3e), 4 per compute tray.
    "paper-rack": Hardware(scale_up_domain=64),
    # NVIDIA H100 SXM5 in an 8-GPU HGX/DGX node: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 at
    # 900 GB/s bidirectional (450 per direction), one 400 Gb/s ConnectX-7 NIC per GPU; 80 GB HBM3;
    # the NVLink domain is the node.
    "h100-hgx": Hardware(scale_up_gbps=450.0, peak_tflops=989.0, hbm_tbps=3.35, inter_domain_gbps=50.0,
                         scale_up_domain=8, memory_gb=80.0, gpus_per_node=8),
    # NVIDIA H200 SXM in an 8-GPU HGX/DGX node (NVIDIA's H200 datasheet): the H100's compute (989
    # TFLOP/s dense bf16) and NVLink 4 (900 GB/s bidirectional), 141 GB of HBM3e at 4.8 TB/s; one
    # 400 Gb/s NIC per GPU; the NVLink domain is the node.
    "h200-hgx": Hardware(scale_up_gbps=450.0, peak_tflops=989.0, hbm_tbps=4.8, inter_domain_gbps=50.0,
                         scale_up_domain=8, memory_gb=141.0, gpus_per_node=8),
}


def hardware_preset(name: str) -> Hardware:
    """The preset ``name`` of :data:`HARDWARE_PRESETS` (errors name ``--moe-balancer-hardware``)."""
    try:
        return HARDWARE_PRESETS[name]
    except KeyError:
        raise ValueError(f"--moe-balancer-hardware: unknown hardware {name!r}; choose from "
                         f"{', '.join(HARDWARE_PRESETS)}") from None


@dataclass(frozen=True)
class ExpertShape:
    """Shape of one expert (an MLP ``hidden -> ffn -> hidden``) and the byte widths that matter.

    Attributes:
        hidden_size / ffn_hidden_size: h and f (Megatron ``--hidden-size``, ``--moe-ffn-hidden-size``).
        gated: SwiGLU-style gated MLP (3 matrices) rather than 2.
        param_bytes: bytes per weight element moved to replicas (bf16: 2).
        grad_bytes: bytes per gradient element reduced from replicas (fp32 main grads: 4).
        activation_bytes: bytes per hidden element of a token on the wire (bf16: 2).
    """

    hidden_size: int
    ffn_hidden_size: int
    gated: bool = True
    param_bytes: int = 2
    grad_bytes: int = 4
    activation_bytes: int = 2

    def __post_init__(self):
        for name in ("hidden_size", "ffn_hidden_size", "param_bytes", "grad_bytes", "activation_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")

    @property
    def numel(self) -> int:
        """Elements of one expert's weights."""
        return (3 if self.gated else 2) * self.hidden_size * self.ffn_hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.numel * self.param_bytes

    @property
    def fwd_flops_per_token(self) -> int:
        """Forward FLOPs of one (token, expert) pair: 2 per weight (multiply-add)."""
        return 2 * self.numel

    @property
    def token_bytes(self) -> int:
        return self.hidden_size * self.activation_bytes

    @classmethod
    def from_meta(cls, meta: dict, *, hidden_size: Optional[int] = None, ffn_hidden_size: Optional[int] = None,
                  gated: Optional[bool] = None, **widths) -> tuple["ExpertShape", str]:
        """Shape from explicit values, else a trace header's ``meta`` (keys ``hidden_size``,
        ``moe_ffn_hidden_size`` or ``ffn_hidden_size``, ``gated_linear_unit`` or ``swiglu``), else
        :data:`DEFAULT_SHAPE`. ``widths``: byte widths (``param_bytes``...), None = default.
        Returns (shape, a phrase saying where h and f came from)."""
        meta_h = meta.get("hidden_size")
        meta_f = meta.get("moe_ffn_hidden_size") or meta.get("ffn_hidden_size")
        meta_g = meta.get("gated_linear_unit", meta.get("swiglu"))
        h, f = hidden_size or meta_h, ffn_hidden_size or meta_f
        if h is None or f is None:
            h, f = DEFAULT_SHAPE.hidden_size, DEFAULT_SHAPE.ffn_hidden_size
            meta_g = DEFAULT_SHAPE.gated
            source = "default: a Qwen3-235B-A22B expert; give --hidden-size and --moe-ffn-hidden-size for yours"
        elif hidden_size is None and ffn_hidden_size is None:
            source = "trace meta"
        else:
            source = "flags" if (hidden_size and ffn_hidden_size) else "flags and trace meta"
        g = gated if gated is not None else (True if meta_g is None else bool(meta_g))
        extra = {k: int(v) for k, v in widths.items() if v is not None}
        return cls(int(h), int(f), g, **extra), source


#: Expert of Qwen3-235B-A22B (one of the paper's models), used when a trace says nothing.
DEFAULT_SHAPE = ExpertShape(hidden_size=4096, ffn_hidden_size=1536, gated=True)


def slot_memory_bytes(shape: ExpertShape, num_slots: int, *, num_layers: int = 1) -> int:
    """Bytes per rank for ``num_slots`` redundant slots: weights + fp32 gradient buffers, no
    optimizer state. UltraEP shares them across layers (``num_layers=1``, paper §4.1); a layout
    with per-layer replicas (EPLB/CRAFT style) pays ``num_layers`` times as much."""
    return int(num_slots) * shape.numel * (shape.param_bytes + shape.grad_bytes) * int(num_layers)


def min_quota_from_hardware(shape: ExpertShape, hardware: Hardware, *, training: bool = True) -> int:
    """Smallest replica quota (tokens) worth its weight transfer and its own GEMM.

    A replica taking q (token, expert) pairs off the busiest rank saves ``k * q * c`` there (c =
    ``2W / F``, one token of one expert's forward at the plateau; k = 3 in training: forward, dgrad,
    wgrad; 1 in inference). It costs its weights' transfer ``T = W * d / B`` once, charged as if
    nothing hid it (``transfer_overlap`` 0: the floor holds whatever the overlap; HarMoEny's
    threshold), and a GEMM of its own on a rank that balancing brings to the new maximum: ``k *
    M0 * c`` beyond its tokens' share (``Hardware.gemm_overhead_tokens``), or, below the roofline's
    knee, ``k * (W / HBM - q * c)``. It pays when ``k q c >= T + k M0 c``, i.e. from
    ``q = F d / (2 B k) + M0`` (above the knee, as on every GPU here), independent of the expert's
    size.
    """
    k = 3 if training else 1
    c = shape.fwd_flops_per_token / hardware.flops_per_s
    transfer = shape.weight_bytes / hardware.link_bytes_per_s
    weight_read = shape.weight_bytes / hardware.hbm_bytes_per_s
    overhead = hardware.gemm_overhead_tokens
    q = transfer / (k * c) + overhead
    if (q + overhead) * c < weight_read:  # the replica's GEMM is memory-bound: it costs the weight read
        q = (transfer / k + weight_read) / (2 * c)
    return max(1, math.ceil(q - 1e-9))


# ---------------------------------------------------------------------------------------------
# Cost model (seconds; estimates)
# ---------------------------------------------------------------------------------------------

def _compute_seconds(tokens_per_instance: torch.Tensor, shape: ExpertShape, hw: Hardware) -> torch.Tensor:
    """Forward expert compute of every instance, float64 like ``tokens_per_instance`` ([E, R] tokens
    of every instance): ``max((tokens + M0) * flops / F, weights / HBM)`` (a roofline whose compute
    side carries the GEMM's fixed cost of M0 tokens); an instance with no token costs nothing
    (grouped GEMM skips it)."""
    tokens = tokens_per_instance.to(torch.float64)
    per_token = shape.fwd_flops_per_token / hw.flops_per_s
    weight_read = shape.weight_bytes / hw.hbm_bytes_per_s
    compute = (tokens + hw.gemm_overhead_tokens) * per_token
    return torch.where(tokens > 0, torch.clamp(compute, min=weight_read), torch.zeros_like(tokens))


def _assemble(main: torch.Tensor, replica: torch.Tensor, a2a_one_way: float, wdist_direct: float,
              wdist_relay: float, plan_seconds: float, shape: ExpertShape, hw: Hardware,
              relay: bool) -> dict:
    """Layer times from each rank's forward compute of its main instances and of its replicas
    (float64 [R]), the busiest one-way token all-to-all and the weight distribution's time."""
    wdist = wdist_relay if relay else wdist_direct
    wred = wdist * shape.grad_bytes / shape.param_bytes  # the same edges, in the gradient dtype
    alpha = hw.transfer_overlap
    hosts = replica > 0  # only ranks that compute replicas wait for the transfers

    def after(window: torch.Tensor, transfer: float) -> torch.Tensor:
        """When a rank can go on: its work of ``window`` seconds has run next to a transfer of
        ``transfer`` seconds started with it, a fraction ``alpha`` of the window hiding it."""
        return torch.where(hosts, torch.maximum(window, transfer + (1.0 - alpha) * window), window)

    zero = torch.zeros_like(main)
    # Forward: dispatch + main experts next to the weight distribution, then the replicas, combine.
    fwd_experts = float((after(a2a_one_way + main, wdist) + replica).max()) if main.numel() else 0.0
    fwd = plan_seconds + fwd_experts + a2a_one_way
    # Backward: combine backward next to the re-materialization, the replicas' backward, the main
    # experts' backward next to the gradient reduction, then the dispatch backward.
    replicas_done = after(zero + a2a_one_way, wdist) + 2.0 * replica
    bwd = float((replicas_done + after(2.0 * main, wred)).max()) + a2a_one_way if main.numel() else 0.0
    moe_fwd = float((main + replica).max()) if main.numel() else 0.0
    moe_bwd = 2.0 * moe_fwd
    bare_fwd = plan_seconds + 2.0 * a2a_one_way + moe_fwd  # with transfers that cost nothing
    bare_bwd = 2.0 * a2a_one_way + moe_bwd
    return {
        "plan": plan_seconds, "wdist_direct": wdist_direct, "wdist_relay": wdist_relay, "wdist": wdist,
        "a2a_fwd": 2.0 * a2a_one_way, "a2a_bwd": 2.0 * a2a_one_way, "moe_fwd": moe_fwd, "moe_bwd": moe_bwd,
        "bwd_replica": wdist + wred, "fwd_exposed": max(0.0, fwd - bare_fwd),
        "bwd_exposed": max(0.0, bwd - bare_bwd), "fwd": fwd, "bwd": bwd, "total": fwd + bwd,
        "total_excl_plan": fwd + bwd - plan_seconds, "transfer_overlap": alpha,
    }


def _main_and_replica(per_instance: torch.Tensor, experts_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, R] per-instance seconds -> per-rank seconds of its main instances and of its replicas."""
    E, R = per_instance.shape
    home = torch.arange(E) // experts_per_rank
    is_main = home.unsqueeze(1) == torch.arange(R).unsqueeze(0)  # [E, R]
    return (per_instance * is_main).sum(0), (per_instance * ~is_main).sum(0)


def _busiest_link_seconds(traffic: torch.Tensor, unit_bytes: float, N: int, hw: Hardware) -> float:
    """Time of the busiest rank's remote traffic ``traffic`` [src, dst] (in units of ``unit_bytes``):
    per rank the longer of its intra-domain (``scale_up_gbps``) and inter-domain
    (``inter_domain_gbps``) link time, sending or receiving; the max over ranks."""
    R = traffic.shape[0]
    traffic = traffic.to(torch.float64) * (1 - torch.eye(R, dtype=torch.float64))
    domain = torch.arange(R) // N
    inside = domain.unsqueeze(1) == domain.unsqueeze(0)
    seconds = 0.0
    for mask, rate in ((inside, hw.link_bytes_per_s), (~inside, hw.inter_domain_bytes_per_s)):
        part = traffic * mask
        busiest = max(float(part.sum(1).max()), float(part.sum(0).max())) if R else 0.0
        seconds = max(seconds, busiest * unit_bytes / rate)
    return seconds


def _replica_edges(slot_expert: torch.Tensor, num_experts: int, N: int,
                   schedules: Optional[ScheduleCache]) -> list[tuple[torch.Tensor, int]]:
    """For the direct and the relayed schedule of a replica layout: its edges as a [src, dst] count
    matrix (what the busiest link carries follows from it) and how many cross a domain of N ranks."""
    R = slot_expert.shape[0]
    out = []
    for mode in ("off", "adaptive"):
        build = schedules.get if schedules is not None else build_schedule
        s = build(slot_expert.cpu(), num_experts, 1, relay=mode)
        counts = torch.zeros((R, R), dtype=torch.int64)
        counts.index_put_((s.edge_src, s.edge_dst), torch.ones_like(s.edge_src), accumulate=True)
        out.append((counts, int((s.edge_src // N != s.edge_dst // N).sum())))
    return out


def remote_slot_table(placement: Placement) -> torch.Tensor:
    """int64 [R, W]: the experts each rank holds away from their home, packed left (-1 padding): the
    replicas a placement needs fed from the homes, as a redundant-slot table for the data plane's schedule."""
    inst = placement.instances  # [E, R]
    E, R = inst.shape
    home = torch.arange(E) // (E // R)
    remote = (inst.cpu() & (home.unsqueeze(1) != torch.arange(R).unsqueeze(0))).T  # [R, E]
    width = int(remote.sum(1).max()) if remote.numel() else 0
    order = torch.argsort((~remote).to(torch.int8), dim=1, stable=True)[:, :width]  # remote experts first
    table = torch.where(torch.gather(remote, 1, order), order, torch.full_like(order, -1))
    return table


def layer_cost(load: torch.Tensor, plan: Plan | Placement, shape: ExpertShape, hardware: Hardware, *,
               plan_seconds: float = 0.0, relay: bool = True, schedules: Optional[ScheduleCache] = None) -> dict:
    """Estimated seconds of one MoE layer invocation (one microbatch) under ``plan``.

    Args:
        load: int64 [R, E], the load the plan serves.
        plan: a planner Plan (``identity_plan`` for ``none``) or a peer's ``Placement`` (instances
            away from their home are replicas, fed from the home: a moved main expert is one).
        plan_seconds: time to solve the plan (forward critical path).
        relay: charge weight distribution with relay trees (else direct fan-out).
        schedules: the data plane's schedules of recurring replica layouts, kept by the caller (a
            replay keeps one for its run); ``None``: built anew.

    Returns:
        dict of seconds: ``moe_fwd``/``moe_bwd`` (busiest rank's expert compute), ``a2a_fwd``/
        ``a2a_bwd`` (token dispatch + combine of the busiest remote sender/receiver),
        ``wdist_direct``/``wdist_relay``/``wdist`` (weight distribution; busiest sender/receiver),
        ``bwd_replica`` (backward replica traffic: re-materialization + gradient reduction),
        ``fwd_exposed``/``bwd_exposed`` (what the transfers add to the forward / backward under
        ``hardware.transfer_overlap``), ``plan``, ``fwd``, ``bwd``, ``total``; ``transfer_overlap``,
        the overlap assumed; and ``xdom_bytes``, the replica weight and gradient bytes that cross a
        scale-up domain (forward distribution, backward re-materialization and reduction), a byte
        count, not seconds.
    """
    R, E = planner.validate_load(load)
    if isinstance(plan, Placement):
        if tuple(plan.split.shape) != (R, E, R):
            raise ValueError("placement and load have different shapes")
        quota, traffic, slots = plan.quota, plan.split.sum(1), remote_slot_table(plan)
    else:
        if plan.num_ranks != R or plan.num_experts != E:
            raise ValueError("plan and load have different shapes")
        P = plan.physical_slots_per_rank
        quota, traffic, slots = plan.quota, plan.physical_split.view(R, R, P).sum(2), plan.slot_expert
    N = hardware.ranks_per_domain(R)
    main, replica = _main_and_replica(_compute_seconds(quota.cpu(), shape, hardware), E // R)
    a2a = _busiest_link_seconds(traffic.cpu(), shape.token_bytes, N, hardware)
    wdist, crossing = [0.0, 0.0], 0
    if slots.numel() and bool((slots >= 0).any()):
        for i, (edges, cross) in enumerate(_replica_edges(slots, E, N, schedules)):
            wdist[i] = _busiest_link_seconds(edges, shape.weight_bytes, N, hardware)
            if (i == 1) == relay:
                crossing = cross
    cost = _assemble(main, replica, a2a, wdist[0], wdist[1], float(plan_seconds), shape, hardware, relay)
    cost["xdom_bytes"] = float(crossing * shape.numel * (2 * shape.param_bytes + shape.grad_bytes))
    return cost


def ideal_cost(load: torch.Tensor, shape: ExpertShape, hardware: Hardware) -> dict:
    """Estimated seconds of one MoE layer under force-balanced dispatch (the paper's ideal): every
    expert gets total/E pairs, every source sends its pairs to uniformly spread destinations;
    no plan, no replicas. load int64 [R, E]; keys as :func:`layer_cost`."""
    R, E = planner.validate_load(load)
    total = float(load.sum())
    per_instance = torch.full((E // R, R), total / E, dtype=torch.float64)
    main = _compute_seconds(per_instance, shape, hardware).sum(0)
    # Source s spreads its pairs evenly over the R ranks; rank t receives total / R.
    traffic = load.sum(1).to(torch.float64).unsqueeze(1).expand(R, R) / R
    a2a = _busiest_link_seconds(traffic, shape.token_bytes, hardware.ranks_per_domain(R), hardware)
    cost = _assemble(main, torch.zeros_like(main), a2a, 0.0, 0.0, 0.0, shape, hardware, True)
    cost["xdom_bytes"] = 0.0
    return cost
