"""The hardware a run is planned for, as plain numbers: the GPU figures (:class:`Hardware`) and the
named presets of ``--moe-balancer-hardware``, the expert's shape (:class:`ExpertShape`), and the
quota floor derived from them (:func:`min_quota_from_hardware`: the smallest replica that pays for
its weight transfer and its GEMM).

The training run derives ``--moe-balancer-min-quota`` from a preset (:func:`hardware_min_quota`),
``ultraep check-recipe`` budgets memory and nodes against one, and the offline cost model
(``analysis/cost.py``) prices plans on one. No torch, no Megatron.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = [
    "DEFAULT_SHAPE",
    "ExpertShape",
    "HARDWARE_PRESETS",
    "Hardware",
    "hardware_min_quota",
    "hardware_preset",
    "min_quota_from_hardware",
]


@dataclass(frozen=True)
class Hardware:
    """Per-GPU hardware figures. Defaults: the UltraEP paper's rack-scale node (Table 2).

    Attributes:
        scale_up_gbps: scale-up (NVLink, intra-domain) bandwidth per GPU and direction, GB/s.
        peak_tflops: dense bf16 peak, TFLOP/s.
        hbm_tbps: HBM bandwidth, TB/s.
        compute_efficiency / comm_efficiency: achieved fraction of peak (1.0 = peak; the absolute
            times are then lower bounds).
        transfer_overlap: fraction of its overlap window a replica transfer hides (the windows:
            ``analysis/cost.py``): 1.0, the runtime's schedule on a device that runs transfers concurrently
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
        if (
            isinstance(self.gpus_per_node, bool)
            or not isinstance(self.gpus_per_node, int)
            or self.gpus_per_node < 1
        ):
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
                raise ValueError(
                    f"an EP group of {num_ranks} ranks does not fit the scale-up domains of "
                    f"{N} GPUs evenly"
                )
            return num_ranks
        if num_ranks % N:
            raise ValueError(
                f"an EP group of {num_ranks} ranks does not split into scale-up domains of {N} GPUs"
            )
        return N


#: Named hardware descriptions (``--moe-balancer-hardware``); sources in docs/traces.md.
HARDWARE_PRESETS: dict[str, Hardware] = {
    # UltraEP paper, Table 2: 64 GPUs per rack on a 900 GB/s scale-up fabric, 2250 TFLOP/s bf16,
    # 8 TB/s HBM, 400 Gb/s between racks; GB200 GPUs (186 GB of HBM3e), 4 per compute tray.
    "paper-rack": Hardware(scale_up_domain=64),
    # NVIDIA H100 SXM5 in an 8-GPU HGX/DGX node: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 at
    # 900 GB/s bidirectional (450 per direction), one 400 Gb/s ConnectX-7 NIC per GPU; 80 GB HBM3;
    # the NVLink domain is the node.
    "h100-hgx": Hardware(
        scale_up_gbps=450.0,
        peak_tflops=989.0,
        hbm_tbps=3.35,
        inter_domain_gbps=50.0,
        scale_up_domain=8,
        memory_gb=80.0,
        gpus_per_node=8,
    ),
    # NVIDIA H200 SXM in an 8-GPU HGX/DGX node (NVIDIA's H200 datasheet): the H100's compute (989
    # TFLOP/s dense bf16) and NVLink 4 (900 GB/s bidirectional), 141 GB of HBM3e at 4.8 TB/s; one
    # 400 Gb/s NIC per GPU; the NVLink domain is the node.
    "h200-hgx": Hardware(
        scale_up_gbps=450.0,
        peak_tflops=989.0,
        hbm_tbps=4.8,
        inter_domain_gbps=50.0,
        scale_up_domain=8,
        memory_gb=141.0,
        gpus_per_node=8,
    ),
}


def hardware_preset(name: str) -> Hardware:
    """The preset ``name`` of :data:`HARDWARE_PRESETS` (errors name ``--moe-balancer-hardware``)."""
    try:
        return HARDWARE_PRESETS[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(str(name), list(HARDWARE_PRESETS), n=2, cutoff=0.6)
        raise ValueError(
            f"--moe-balancer-hardware: unknown hardware {name!r}"
            + (f" (did you mean {' or '.join(close)}?)" if close else "")
            + f"; choose from {', '.join(HARDWARE_PRESETS)}"
        ) from None


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
        for name in (
            "hidden_size",
            "ffn_hidden_size",
            "param_bytes",
            "grad_bytes",
            "activation_bytes",
        ):
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
    def from_meta(
        cls,
        meta: dict,
        *,
        hidden_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        gated: Optional[bool] = None,
        **widths,
    ) -> tuple["ExpertShape", str]:
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


def min_quota_from_hardware(
    shape: ExpertShape, hardware: Hardware, *, training: bool = True
) -> int:
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
    if (
        q + overhead
    ) * c < weight_read:  # the replica's GEMM is memory-bound: it costs the weight read
        q = (transfer / k + weight_read) / (2 * c)
    return max(1, math.ceil(q - 1e-9))


def hardware_min_quota(name: str) -> int:
    """The training quota floor derived from ``--moe-balancer-hardware`` preset ``name`` (the floor
    does not depend on the expert's size: :func:`min_quota_from_hardware`)."""
    return min_quota_from_hardware(DEFAULT_SHAPE, hardware_preset(name), training=True)
