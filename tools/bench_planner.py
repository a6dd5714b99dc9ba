"""Planner benchmark: balancing quality and solve time on power-law loads (UltraEP Fig. 15/Table 4).

    python tools/bench_planner.py              # three tables (markdown) + solve-time summary
    python tools/bench_planner.py --quick      # one seed, fewer settings
    python tools/bench_planner.py --only domains   # one part: main, domains, peers, timing, device
    python tools/bench_planner.py --only self-check   # the fused ops' self-check, fresh and cached

For every setting (R ranks, E experts, S slots per rank, target initial rank imbalance) and seed it
draws a Zipf load (``traces.synthetic.zipf_load``: top-8, 4096 tokens per rank) and plans it with
``ultraep`` (``planner.solve``), ``eplb++`` (``baselines.eplb_exact``) and ``none``
(``baselines.identity_plan``); it also runs ``alg1``, a plain transcription of the paper's Algorithm 1 (largest-slack greedy) with
u_min = 1, its most favourable setting, for its threshold only (with UltraEP's default 1 % floor it
fails on small remainders and averages 1.25). Columns (means over seeds):

    init       measured initial imbalance (max/mean rank load)
    imb        imbalance after reroute;  tau/LB: ultraep's threshold over ceil(total / R)
    rep        replicas (filled redundant slots; EPLB fills all R*S it can)
    fan        max instances of one expert;  infl: in-flight token ratio
    us         median solve time per call in microseconds (wall clock, this process, one thread)

The device planner has no columns: its plan (``planner.fused_plan.plan_invocation``, one op) is
bit-identical to the host planner's (``host_plan``: the same record and reroute table), which
``tests/planner/test_fused_plan.py`` checks, so its quality is the ultraep columns'. Its speed on a
GPU: ``--only device`` here (one op per call, synchronized) and ``tools/bench_fused_kernels.py``.

Timing runs one thread (torch/numba single-threaded, OMP_NUM_THREADS=1). On a shared machine wall
times are noisy: the summary also gives CPU time (thread_time) for the R=64, E=256, S=2 case, with
one NVLink domain and with domains of 8 ranks, and the host stretch of one invocation in that case:
the trigger, the solve and the rank's record and reroute table (``fused_plan.host_parts``, what
the host planner runs), the host work between the load reaching the host and the table being ready,
while a GPU waits.

``--only self-check`` times the fused ops' self-check (``planner.self_check.self_check``: the
plan op and the fused reroute on the device against the host planner on the probe loads and a load
of the model's shape), at R=64 E=256 S=2 with one domain and with domains of 8: the first call in
the process (on CUDA in a fresh Triton cache, as on a new node: the kernels compile; set
``TRITON_CACHE_DIR`` to time a warm one) and the cached one (``self_check.OUTCOMES``: what every
later layer pays). On a machine without CUDA it times the CPU path (the op's host planner).

A second table plans the R = 32/64 loads with NVLink domains of N = 8 and 16 ranks
(``solve(..., domain_size=N)``: replicas only inside their home's domain):

    LB_N       domain bound max_d ceil(total_d / N) over the mean rank load: the best any
               domain-respecting plan can do
    imb        imbalance after (one domain: first table's ultraep imb)
    tau/LB_N   threshold over LB_N
    rep, us    replicas, median solve time (microseconds)

A third table puts the peers side by side on the same loads (S = 2; copies = expert weights sent
to reach the placement from the home layout, moved mains included; xdom = those crossing an
8-rank domain): ultraep (one domain and N = 8), eplb++-fixed (EPLB's rule, mains at home),
DeepSeek's re-placing EPLB (global policy; hierarchical with R/8 nodes and R/8 groups = the home
domains), and LLEP (alpha 1.1, m 1024, lambda 1.3).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ultraep_megatron.planner import (  # noqa: E402
    BalancerConfig,
    domain_lower_bound,
    metrics,
    solve,
)
from ultraep_megatron.planner.baselines import (  # noqa: E402
    Placement,
    deepseek_eplb,
    eplb_exact,
    identity_plan,
    llep,
    placement_metrics,
    registry,
)
from ultraep_megatron.traces.synthetic import zipf_load  # noqa: E402

SHAPES = [(32, 128), (32, 160), (32, 256), (40, 160), (64, 128), (64, 256)]
SLOTS = [1, 2, 4]
IMBALANCES = [1.3, 2.0, 3.0, 4.0]
DOMAIN_SHAPES = [(32, 128), (32, 256), (64, 128), (64, 256)]
DOMAIN_SIZES = [8, 16]
PEER_SLOTS = 2
PEER_DOMAIN = 8


def algorithm1_threshold(load: torch.Tensor, num_slots: int, min_quota: int) -> int:
    """Max rank load of the paper's Algorithm 1 (SolveReplication), transcribed as written:
    binary search on tau; overloaded ranks by descending excess, their experts by descending load,
    each transfer to the admissible rank with the largest slack, stop when a transfer is below
    min_quota. Returns the final threshold (quotas only; no reroute needed for the metric)."""
    R, E = load.shape
    G = E // R
    lam = load.sum(0).tolist()
    ell = [sum(lam[r * G : (r + 1) * G]) for r in range(R)]
    lo, hi = -(-sum(ell) // R), max(ell)

    def feasible(tau: int) -> bool:
        exc = [max(x - tau, 0) for x in ell]
        slk = [max(tau - x, 0) for x in ell]
        free = [num_slots] * R
        hosts = [set() for _ in range(E)]
        for r in sorted(range(R), key=lambda r: -exc[r]):
            if exc[r] == 0:
                break
            for e in sorted(range(r * G, (r + 1) * G), key=lambda e: -lam[e]):
                cap = lam[e]
                while exc[r] > 0 and cap > 0:
                    admissible = [
                        t
                        for t in range(R)
                        if t != r and slk[t] > 0 and (t in hosts[e] or free[t] > 0)
                    ]
                    if not admissible:
                        break
                    t = max(admissible, key=lambda x: slk[x])
                    delta = min(exc[r], slk[t], cap)
                    if delta < min_quota:
                        break
                    if t not in hosts[e]:
                        hosts[e].add(t)
                        free[t] -= 1
                    exc[r] -= delta
                    slk[t] -= delta
                    cap -= delta
        return sum(exc) == 0

    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def median_time_us(fn, repeats: int) -> float:
    fn()  # warm (compile / caches)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1e3


def run_setting(R: int, E: int, S: int, imbalance: float, seeds: list[int], repeats: int) -> dict:
    rows = []
    for seed in seeds:
        load = zipf_load(R, E, imbalance, seed=seed)
        mean = load.sum().item() / R
        ultra, eplbpp, identity = solve(load, S), eplb_exact(load, S), identity_plan(load, S)
        mu, me, mn = metrics(load, ultra), metrics(load, eplbpp), metrics(load, identity)
        alg1 = algorithm1_threshold(load, S, 1)
        exact_floor = metrics(load, solve(load, S, min_quota=1))
        rows.append(
            {
                "init": mu["imbalance_before"],
                "u_imb": mu["imbalance_after"],
                "u_gap": mu["threshold"] / mu["lower_bound"],
                "u_rep": mu["replicas"],
                "u_fan": mu["max_fanout"],
                "u_infl": mu["inflight_ratio"],
                "u_us": median_time_us(lambda: solve(load, S), repeats),
                "a_imb": alg1 / mean,
                "u1_imb": exact_floor["imbalance_after"],
                "u1_rep": exact_floor["replicas"],
                "e_imb": me["imbalance_after"],
                "e_rep": me["replicas"],
                "e_fan": me["max_fanout"],
                "e_infl": me["inflight_ratio"],
                "e_us": median_time_us(lambda: eplb_exact(load, S), max(3, repeats // 50)),
                "n_infl": mn["inflight_ratio"],
            }
        )
    return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}


def run_domain_setting(
    R: int, E: int, S: int, N: int, imbalance: float, seeds: list[int], repeats: int
) -> dict:
    rows = []
    for seed in seeds:
        load = zipf_load(R, E, imbalance, seed=seed)
        mean = load.sum().item() / R
        bound = domain_lower_bound(load, N)
        plan = solve(load, S, domain_size=N)
        m = metrics(load, plan, domain_size=N)
        assert m["cross_domain_replicas"] == 0
        rows.append(
            {
                "init": m["imbalance_before"],
                "lb": bound / mean,
                "imb": m["imbalance_after"],
                "gap": plan.threshold / bound,
                "rep": m["replicas"],
                "us": median_time_us(lambda: solve(load, S, domain_size=N), repeats),
            }
        )
    return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}


def run_peer_setting(R: int, E: int, imbalance: float, seeds: list[int]) -> dict:
    """Per balancer: means of placement_metrics on the loads of this setting."""
    S, N = PEER_SLOTS, PEER_DOMAIN
    balancers = {
        registry.ULTRAEP: lambda load: Placement.from_plan(solve(load, S)),
        f"{registry.ULTRAEP} N={N}": lambda load: Placement.from_plan(
            solve(load, S, domain_size=N)
        ),
        "eplb++-fixed": lambda load: Placement.from_plan(eplb_exact(load, S)),
        "deepseek-eplb": lambda load: deepseek_eplb(load, S),
        "deepseek-eplb hier.": lambda load: deepseek_eplb(
            load, S, num_groups=R // N, num_nodes=R // N
        ),
        "llep": lambda load: Placement.from_plan(llep(load)),
    }
    sums: dict[str, list[dict]] = {name: [] for name in balancers}
    for seed in seeds:
        load = zipf_load(R, E, imbalance, seed=seed)
        for name, balance in balancers.items():
            sums[name].append(placement_metrics(load, balance(load), domain_size=N))
    return {
        name: {k: statistics.fmean(m[k] for m in ms) for k in ms[0]} for name, ms in sums.items()
    }


def cpu_time_summary(repeats: int, domain_size: int | None = None) -> str:
    """Median wall and CPU time of solve for R=64, E=256, S=2 over several loads."""
    wall, cpu = [], []
    for imbalance in IMBALANCES:
        for seed in range(3):
            load = zipf_load(64, 256, imbalance, seed=100 + seed)
            solve(load, 2, domain_size=domain_size)
            for _ in range(repeats):
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                solve(load, 2, domain_size=domain_size)
                cpu.append(time.thread_time_ns() - c0)
                wall.append(time.perf_counter_ns() - w0)
    wall_us, cpu_us = statistics.median(wall) / 1e3, statistics.median(cpu) / 1e3
    p10_us = sorted(wall)[len(wall) // 10] / 1e3
    domains = "" if domain_size is None else f" domain {domain_size}"
    return (
        f"solve R=64 E=256 S=2{domains} over {len(wall)} calls: median wall {wall_us:.1f} us, "
        f"median CPU {cpu_us:.1f} us, p10 wall {p10_us:.1f} us"
    )


def host_stretch_summary(repeats: int) -> str:
    """Median CPU time of the host work between a layer's load reaching the host and its reroute
    table being ready (what a GPU waits for): the trigger, solve and one rank's record and int32
    reroute table (``host_parts``, as the host planner packs them), R=64, E=256, S=2, over the loads
    of cpu_time_summary."""
    from ultraep_megatron.planner.fused_plan import host_parts
    from ultraep_megatron.planner.solve import default_min_quota

    balancer = BalancerConfig(name=registry.ULTRAEP, num_slots=2).build()
    parts: dict[str, list[int]] = {"trigger": [], "solve": [], "record and table": [], "total": []}
    for imbalance in IMBALANCES:
        for seed in range(3):
            load = zipf_load(64, 256, imbalance, seed=100 + seed)
            array = load.numpy()
            floor = default_min_quota(int(array.sum()), 64)

            def pack(plan, balanced):
                host_parts(array, plan, 0, balanced=balanced, min_quota=floor, domain_size=64)

            pack(solve(load, 2), True)  # compiled once
            for _ in range(repeats):
                c0 = time.thread_time_ns()
                balanced = balancer.balances(load)
                c1 = time.thread_time_ns()
                plan = balancer.plan(load, balances=balanced)
                c2 = time.thread_time_ns()
                pack(plan, balanced)
                c3 = time.thread_time_ns()
                for name, ns in zip(parts, (c1 - c0, c2 - c1, c3 - c2, c3 - c0)):
                    parts[name].append(ns)
    median_us = {name: statistics.median(ns) / 1e3 for name, ns in parts.items()}
    return (
        "host stretch per invocation (load on the host -> reroute tables), R=64 E=256 S=2, median CPU: "
        + " + ".join(
            f"{name} {median_us[name]:.1f} us" for name in ("trigger", "solve", "record and table")
        )
        + f"; total {median_us['total']:.1f} us"
    )


def device_timing_summary(repeats: int) -> str:
    """Median time of the device plan (``plan_invocation``, one op) on the GPU, R=64, E=256, S=2,
    over the loads of cpu_time_summary, one and 8-rank domains: per call, synchronized (the
    latency a layer waits when nothing overlaps it), each load's record and table checked equal to
    the host planner's (``host_plan``) first."""
    if not torch.cuda.is_available():
        return "plan_invocation on a GPU: no CUDA device here"
    from ultraep_megatron.planner.fused_plan import host_plan, plan_invocation

    lines = []
    for domain_size in (None, 8):
        config = BalancerConfig(registry.ULTRAEP, num_slots=2, domain_size=domain_size)
        samples = []
        for imbalance in IMBALANCES:
            for seed in range(3):
                host_load = zipf_load(64, 256, imbalance, seed=100 + seed)
                load = host_load.cuda()
                fused = plan_invocation(load, config, 0)  # compiles on first use
                record, table = host_plan(host_load, config, 0)
                assert torch.equal(fused.record.cpu(), torch.from_numpy(record))
                assert torch.equal(fused.table.cpu(), torch.from_numpy(table))
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                for _ in range(max(3, repeats // 10)):
                    torch.cuda.synchronize()
                    start.record()
                    plan_invocation(load, config, 0)
                    end.record()
                    end.synchronize()
                    samples.append(start.elapsed_time(end) * 1e3)
        domains = "" if domain_size is None else f" domain {domain_size}"
        lines.append(
            f"plan_invocation on {torch.cuda.get_device_name()} R=64 E=256 S=2{domains} over "
            f"{len(samples)} calls: median {statistics.median(samples):.0f} us, "
            f"p90 {sorted(samples)[len(samples) * 9 // 10]:.0f} us (record and table = host_plan's)"
        )
    return "\n".join(lines)


SELF_CHECK_SHAPE = (64, 256)  # R, E of the self-check's model-shaped probe
SELF_CHECK_DOMAINS = [None, 8]  # NVLink domain sizes


def self_check_summary() -> str:
    """The fused ops' self-check, fresh and cached, per SELF_CHECK_DOMAINS (module docstring)."""
    import tempfile

    from ultraep_megatron.planner import self_check

    fresh_cache = "TRITON_CACHE_DIR" not in os.environ
    if fresh_cache:  # read when a kernel compiles: a new node's first run compiles everything
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="ultraep-triton-")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.zeros(1, device=device)  # the CUDA context exists before a layer registers
        where = torch.cuda.get_device_name(device)
        sync = torch.cuda.synchronize
    else:
        where = "CPU (no CUDA device)"

        def sync():
            return None

    R, E = SELF_CHECK_SHAPE
    lines = []
    for N in SELF_CHECK_DOMAINS:
        config = BalancerConfig(registry.ULTRAEP, num_slots=2, domain_size=N)
        config.build().warm_up()  # the host planner's kernels: loaded before any layer registers
        seconds, outcomes = [], []
        for _ in range(2):  # fresh, then cached (self_check.OUTCOMES)
            sync()
            t0 = time.perf_counter()
            outcomes.append(self_check.self_check(device, config, shape=(R, E)))
            sync()
            seconds.append(time.perf_counter() - t0)
        problems = outcomes[0] or outcomes[1]
        verdict = "passed" if not problems else f"FAILED: {len(problems)} problems: {problems[:3]}"
        domains = f" domains of {N}" if N else ""
        fresh = ", fresh Triton cache" if fresh_cache and device.type == "cuda" else ""
        lines.append(
            f"fused ops self-check (plan_invocation + reroute_permute vs the host planner, on "
            f"{where}{fresh}) R={R} E={E} S=2{domains}: fresh {seconds[0]:.2f} s, cached "
            f"{seconds[1] * 1e6:.1f} us, {verdict}"
        )
    return "\n".join(lines)


def main_table(shapes, slots, seeds, repeats) -> None:
    """The first table: ultraep, Algorithm 1 and eplb++ with one domain."""
    header = (
        "| R | E | S | init | ultraep imb | tau/LB | rep | fan | infl | us "
        "| alg1 imb | eplb++ imb | rep | fan | infl | us | none infl |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    totals = []
    for R, E in shapes:
        for S in slots:
            for imbalance in IMBALANCES:
                m = run_setting(R, E, S, imbalance, seeds, repeats)
                totals.append((S, m))
                print(
                    f"| {R} | {E} | {S} | {m['init']:.2f} | {m['u_imb']:.4f} | {m['u_gap']:.4f} "
                    f"| {m['u_rep']:.1f} | {m['u_fan']:.1f} | {m['u_infl']:.3f} | {m['u_us']:.0f} "
                    f"| {m['a_imb']:.3f} | {m['e_imb']:.3f} | {m['e_rep']:.1f} | {m['e_fan']:.1f} "
                    f"| {m['e_infl']:.3f} | {m['e_us']:.0f} | {m['n_infl']:.3f} |",
                    flush=True,
                )
    ms = [m for _, m in totals]

    def avg(key):
        return statistics.fmean(m[key] for m in ms)

    def worst(key):
        return max(m[key] for m in ms)

    print()
    print(f"averages over {len(ms)} settings x {len(seeds)} seeds:")
    print(
        f"  imbalance after: ultraep {avg('u_imb'):.4f} (worst {worst('u_imb'):.4f}), "
        f"alg1 {avg('a_imb'):.4f} (worst {worst('a_imb'):.4f}), "
        f"eplb++ {avg('e_imb'):.4f} (worst {worst('e_imb'):.4f})"
    )
    print(f"  threshold / lower bound: mean {avg('u_gap'):.4f}, worst {worst('u_gap'):.4f}")
    print(
        f"  ultraep with min_quota=1 (no floor): imbalance {avg('u1_imb'):.4f} "
        f"(worst {worst('u1_imb'):.4f}), replicas {avg('u1_rep'):.1f}"
    )
    per_slots = ", ".join(
        f"S={s}: {statistics.fmean(m['u_rep'] / m['e_rep'] for S, m in totals if S == s):.2f}"
        for s in slots
    )
    print(
        f"  replicas: ultraep {avg('u_rep'):.1f}, eplb++ {avg('e_rep'):.1f} "
        f"(ratio of means {avg('u_rep') / avg('e_rep'):.2f}; mean ratio by slots: {per_slots})"
    )
    print(f"  max fan-out: ultraep {avg('u_fan'):.1f}, eplb++ {avg('e_fan'):.1f}")
    print(
        f"  in-flight ratio: ultraep {avg('u_infl'):.3f}, eplb++ {avg('e_infl'):.3f}, "
        f"none {avg('n_infl'):.3f}"
    )
    print(
        f"  solve time (median us): ultraep {avg('u_us'):.0f}, "
        f"eplb++ {avg('e_us'):.0f} (Python baseline)"
    )


def domain_table(shapes, slots, seeds, repeats) -> None:
    """The second table: ultraep with NVLink domains of DOMAIN_SIZES ranks."""
    print()
    header = "| R | E | S | N | init | LB_N | imb | tau/LB_N | rep | us |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows = []
    for R, E in shapes:
        for N in DOMAIN_SIZES:
            for S in slots:
                for imbalance in IMBALANCES:
                    m = run_domain_setting(R, E, S, N, imbalance, seeds, repeats)
                    rows.append((R, N, m))
                    print(
                        f"| {R} | {E} | {S} | {N} | {m['init']:.2f} | {m['lb']:.4f} "
                        f"| {m['imb']:.4f} | {m['gap']:.4f} | {m['rep']:.1f} | {m['us']:.0f} |",
                        flush=True,
                    )
    print()
    print(f"domain summary ({len(seeds)} seeds per row):")
    for R in sorted({r for r, _, _ in rows}):
        for N in DOMAIN_SIZES:
            ms = [m for r, n, m in rows if (r, n) == (R, N)]
            if ms:
                print(
                    f"  R={R} N={N}: imbalance {statistics.fmean(m['imb'] for m in ms):.4f} "
                    f"(worst {max(m['imb'] for m in ms):.4f}), bound LB_N "
                    f"{statistics.fmean(m['lb'] for m in ms):.4f}, tau/LB_N mean "
                    f"{statistics.fmean(m['gap'] for m in ms):.4f} worst "
                    f"{max(m['gap'] for m in ms):.4f}, replicas "
                    f"{statistics.fmean(m['rep'] for m in ms):.1f}, solve "
                    f"{statistics.median(m['us'] for m in ms):.0f} us (median of rows)"
                )


def peer_table(shapes, seeds) -> None:
    """The third table: the peers on the same loads."""
    print()
    print(
        f"| R | E | init | balancer | imb | copies | main moves | xdom (N={PEER_DOMAIN}) | fan "
        f"| infl |"
    )
    print("|" + "---|" * 10)
    totals: dict[str, list[dict]] = {}
    for R, E in shapes:
        for imbalance in IMBALANCES:
            per = run_peer_setting(R, E, imbalance, seeds)
            for name, m in per.items():
                totals.setdefault(name, []).append(m)
                print(
                    f"| {R} | {E} | {m['imbalance_before']:.2f} | {name} "
                    f"| {m['imbalance_after']:.4f} | {m['weight_copies']:.1f} "
                    f"| {m['main_moves']:.1f} | {m['cross_domain_copies']:.1f} "
                    f"| {m['max_fanout']:.1f} | {m['inflight_ratio']:.3f} |",
                    flush=True,
                )
    print()
    print(
        f"peer summary (S={PEER_SLOTS}, means over {len(shapes) * len(IMBALANCES)} settings x "
        f"{len(seeds)} seeds):"
    )
    for name, ms in totals.items():
        print(
            f"  {name:20s} imbalance {statistics.fmean(m['imbalance_after'] for m in ms):.4f} "
            f"(worst {max(m['imbalance_after'] for m in ms):.4f}), weight copies "
            f"{statistics.fmean(m['weight_copies'] for m in ms):.1f}, main moves "
            f"{statistics.fmean(m['main_moves'] for m in ms):.1f}, cross-domain "
            f"{statistics.fmean(m['cross_domain_copies'] for m in ms):.1f}, fan-out "
            f"{statistics.fmean(m['max_fanout'] for m in ms):.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed, S in {1, 2}, R=64 only")
    parser.add_argument("--seeds", type=int, default=3, help="loads per setting")
    parser.add_argument("--repeats", type=int, default=200, help="timed solve calls per load")
    parser.add_argument(
        "--only",
        choices=["main", "domains", "peers", "timing", "device", "self-check"],
        help="run one part only (default: all)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes, slots, seeds = SHAPES, SLOTS, list(range(args.seeds))
    domain_shapes = DOMAIN_SHAPES
    if args.quick:
        shapes, slots, seeds = [s for s in SHAPES if s[0] == 64], [1, 2], [0]
        domain_shapes = [s for s in DOMAIN_SHAPES if s[0] == 64]

    if args.only == "self-check":
        summary = self_check_summary()
        print(summary)
        if "FAILED" in summary:
            raise SystemExit(1)
        return
    solve(zipf_load(8, 16, 2.0), 1)  # compile or load the numba cache before timing
    if args.only in (None, "main"):
        main_table(shapes, slots, seeds, args.repeats)
    if args.only in (None, "domains"):
        domain_table(domain_shapes, slots, seeds, args.repeats)
    if args.only in (None, "peers"):
        peer_table(domain_shapes, seeds)
    if args.only in (None, "timing"):
        print()
        print(cpu_time_summary(args.repeats))
        print(cpu_time_summary(args.repeats, domain_size=8))
        print(host_stretch_summary(args.repeats))
    if args.only in (None, "device"):
        print(device_timing_summary(args.repeats))


if __name__ == "__main__":
    main()
