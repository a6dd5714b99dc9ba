"""What a reader must hold for one balanced invocation: the files of ``ultraep_megatron`` whose code
runs in one warm forward and backward of a balanced MoE layer, and the classes defined there that it
meets: whose methods run, or whose instances its functions are given (docs/architecture.md, "One balanced invocation").

One process, EP rank 0 of a fake R-rank group (``tools/bench_control_path.py``'s layer, the other
ranks' loads synthetic), every thread profiled (``sys.setprofile`` and ``threading.setprofile``);
the CPU backend's emulation (``megatron/cpu/``) left out, as it does not run on a GPU.

    python tools/invocation_footprint.py [--planner host|device] [--ep-size 8] [--list]
"""

from __future__ import annotations

import argparse
import sys
import threading
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

PACKAGE = REPO / "ultraep_megatron"
EMULATION = PACKAGE / "megatron" / "cpu"


def footprint(run) -> tuple[set, set]:
    """(files, classes) of ``ultraep_megatron`` met in ``run()``: the files whose code runs
    (relative to the package), and as ``file:Class`` the classes whose methods run or whose
    instances are passed to its functions (data classes too)."""
    files, classes = set(), set()

    def profile(frame, event, arg):
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if PACKAGE not in path.parents or EMULATION in path.parents:
            return
        relative = path.relative_to(PACKAGE).as_posix()
        files.add(relative)
        owner = frame.f_code.co_qualname.split(".")[0]
        if owner[:1].isupper():
            classes.add(f"{relative}:{owner}")
        for value in frame.f_locals.values():  # the arguments: data classes too
            kind = type(value)
            module = sys.modules.get(kind.__module__)
            where = Path(getattr(module, "__file__", None) or "/")
            if PACKAGE in where.parents and EMULATION not in where.parents:
                classes.add(f"{where.relative_to(PACKAGE).as_posix()}:{kind.__qualname__}")

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return files, classes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--planner", default="host", choices=("host", "device"))
    parser.add_argument("--ep-size", type=int, default=8)
    parser.add_argument("--list", action="store_true", help="print every file and class")
    cli = parser.parse_args()
    warnings.filterwarnings("ignore")

    import bench_control_path as bench
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ultraep_megatron.megatron.cpu import backend as cpu_backend

    cfg = bench.parse_args(
        ["--ep-size", str(cli.ep_size), "--num-experts", str(4 * cli.ep_size), "--tokens", "256"]
    )
    cpu_backend.activate()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cfg.ep_size)
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=cfg.ep_size, create_gloo_process_groups=False
    )
    layer = bench.build(cfg, cli.planner, torch.device("cpu"))
    layer.train()
    x = torch.randn(cfg.tokens, 1, cfg.hidden_size, requires_grad=True)
    others = bench.synthetic_loads(cfg)

    def step():
        with bench.other_ranks(others):
            out, _ = layer(x)
            out.sum().backward()

    for _ in range(2):  # warm: compiled kernels, ring sizing, schedule caches
        step()
    files, classes = footprint(step)
    by_package: dict = {}
    for name in files:
        by_package.setdefault(name.rsplit("/", 1)[0] if "/" in name else ".", []).append(name)
    print(
        f"One balanced invocation ({cli.planner} planner, EP rank 0 of {cfg.ep_size}, warm "
        f"forward + backward): {len(files)} files, {len(classes)} classes of ultraep_megatron"
    )
    for package, names in sorted(by_package.items()):
        print(f"  {package}: {len(names)} files")
    if cli.list:
        for name in sorted(files):
            print("   ", name)
        for name in sorted(classes):
            print("   ", name)


if __name__ == "__main__":
    main()
