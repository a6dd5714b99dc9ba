"""UltraEP's quota-driven planner: exact post-gating load -> replication plan + token reroute.

Pure functions on tensors (torch and numpy; no flags, no torch.distributed, nothing of the package
above it). Every rank of an EP group solves the same gathered load and gets the same plan bit for
bit, with no communication.

    plan = solve(load, num_slots)                        # load int64 [R, E]  (solve.py)
    plan = solve(load, num_slots, domain_size=8)         # replicas inside 8-rank NVLink domains
    fused = plan_invocation(load, config, rank)          # one op on load's device (fused_plan.py)
    reroute = rank_reroute(plan, load, rank)             # one rank's splits, reroute table (reroute.py)
    balancer = BalancerConfig("ultraep").build()         # one MoE layer's loop (balancer.py)

Balancers compared with it and the registry of every balancer's name: ``planner.baselines``.
See ``docs/planner.md`` for the algorithm, ``min_quota`` and the benchmark.
"""

from .balancer import BalancerConfig, LayerBalancer
from .baselines import registry
from .metrics import load_imbalance, metrics, rank_imbalance
from .plan import Plan
from .reroute import RankReroute, rank_reroute
from .solve import domain_lower_bound, solve, validate_load

__all__ = [
    "Plan",
    "solve",
    "domain_lower_bound",
    "validate_load",
    "RankReroute",
    "rank_reroute",
    "metrics",
    "load_imbalance",
    "rank_imbalance",
    "BalancerConfig",
    "LayerBalancer",
    "registry",
]
