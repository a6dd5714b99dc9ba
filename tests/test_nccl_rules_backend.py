"""Why tests/nccl_rules.py wraps torch.distributed's functions and is not (only) a backend
registered with ``torch.distributed.Backend.register_backend``: what a Python backend over gloo can
and cannot do in the installed torch, asserted in a fresh process (its own default group).

A registered Python ``Backend`` sees every collective and point-to-point call, megatron's own
included; but it cannot carry batch boundaries: ``batch_isend_irecv`` groups operations only for a
backend whose ``supports_coalescing`` is true, and then calls the C++ ``startCoalescing``, which a
Python subclass cannot override (torch's default raises). A Python ``ProcessGroup`` returned by the
creator has no per-device backend, so ``batch_isend_irecv`` fails on it before any operation. When
this test starts failing, torch has gained what the recorder needs: move it to a registered backend.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_PROBE = textwrap.dedent(
    """
    import datetime, torch, torch.distributed as dist
    from torch._C._distributed_c10d import Backend as C10dBackend
    seen = []

    class Recording(C10dBackend):
        supports_coalescing = COALESCING

        def __init__(self, store, rank, size, timeout):
            super().__init__(rank, size)
            self.gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

        def getBackendName(self):
            return "nccl_rules_probe"

        def allreduce(self, tensors, opts):
            seen.append("allreduce")
            return self.gloo.allreduce(tensors, opts)

    def creator(store, rank, size, timeout):
        return Recording(store, rank, size, timeout)

    dist.Backend.register_backend("nccl_rules_probe", creator, devices=["cpu"])
    dist.init_process_group(
        "nccl_rules_probe", store=dist.HashStore(), rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    dist.all_reduce(torch.ones(3))
    group = dist.new_group([0])
    dist.all_reduce(torch.ones(3), group=group)
    print("seen", seen)
    op = dist.P2POp(dist.isend, torch.ones(2), 0)
    try:
        dist.batch_isend_irecv([op])
        print("batch ok")
    except Exception as error:
        print("batch error:", error)
    # Torn down while the interpreter is whole: Gloo's worker threads left to interpreter
    # finalization can abort the process after every line above is printed (seen once in CI).
    dist.destroy_process_group()
    """
)


def _probe(coalescing: bool) -> str:
    code = _PROBE.replace("COALESCING", str(coalescing))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_registered_python_backend_sees_collectives_but_cannot_mark_batches():
    out = _probe(coalescing=True)
    # Both all-reduces (the default group's and a new group's) reached the Python backend ...
    assert "seen ['allreduce', 'allreduce']" in out
    # ... but a batch, which would reach it as one coalesced call, cannot start.
    assert "does not implement startCoalescing" in out, out
