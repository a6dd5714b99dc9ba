"""The rendezvous of a multi-node launch: every node must name the same host, node 0's.

A launch of more than one node whose torchrun rendezvous is ``localhost`` (torchrun's default
``--master-addr 127.0.0.1``, or a recipe's fallback) starts one rendezvous per node that never meet:
on a cluster that is a hang at start, not an error. The recipes (``recipes/common.sh``) refuse it
themselves: without ``MASTER_ADDR`` and without Slurm's node list they stop with one line naming
``MASTER_ADDR``. The checker checks the rest of such a launch with a placeholder host
(:data:`PLACEHOLDER`), so its layout and memory are still shown, and says what is missing: of a
recipe checked on its own a NOTE (its user sets ``MASTER_ADDR`` on the nodes), of a job script (an
sbatch file running the recipe with ``srun``) a PROBLEM, since the job's environment is what every
node gets. A torchrun line of several nodes at a local host is a PROBLEM wherever it comes from.
"""

from __future__ import annotations

import re
from typing import Optional

#: The line ``recipes/common.sh`` stops with (after the recipe's name): several nodes, no host.
REFUSAL = re.compile(r"^(\S+): (MASTER_ADDR is not set and NNODES=\d+.*)$", re.M)
#: The host the checker gives a recipe that refused for want of MASTER_ADDR, to check the rest.
PLACEHOLDER = "master-addr-unset.invalid"
#: What the checker's ``scontrol show hostnames`` answers: node 0 of a Slurm job (the MASTER_ADDR
#: line of the sbatch example); the checker does not assume the rest of Slurm's environment.
SLURM_NODE = "slurm-node-0.invalid"
#: The body of the checker's ``scontrol`` shim (after it records its command line).
SCONTROL = f"""if sys.argv[1:3] == ["show", "hostnames"]:
    print({SLURM_NODE!r})
"""
#: Hosts that are this node only.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "")


def refusal(stderr: str) -> Optional[str]:
    """The recipe's MASTER_ADDR line in ``stderr`` (the recipe's name and the message), else
    ``None``."""
    found = REFUSAL.search(stderr)
    return f"{found.group(1)}: {found.group(2)}" if found else None


def local_rendezvous_problem(
    nnodes: int, master_addr: str, rdzv_endpoint: str, rdzv_backend: str
) -> Optional[str]:
    """One PROBLEM line when a torchrun launch of ``nnodes`` > 1 meets on this node only (its
    static rendezvous at a local host, or a c10d endpoint at one), else ``None``."""
    if nnodes <= 1:
        return None
    if rdzv_backend not in ("", "static") and rdzv_endpoint:
        host = rdzv_endpoint.rsplit(":", 1)[0] if ":" in rdzv_endpoint else rdzv_endpoint
        where = f"--rdzv-endpoint {rdzv_endpoint}"
    else:
        host, where = master_addr, f"--master-addr {master_addr or '(none)'}"
    if host.strip("[]") not in LOCAL_HOSTS:
        return None
    return (
        f"{nnodes} nodes rendezvous at {where}: each node would wait for the others on itself "
        "(a hang at start); set MASTER_ADDR to node 0's address, the same on every node (under "
        'Slurm: export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1))'
    )


def torchrun_problems(nnodes: int, options) -> list[str]:
    """The PROBLEM lines of a torchrun command line read by torchrun's parser (``options``)."""
    found = local_rendezvous_problem(
        nnodes, options.master_addr, options.rdzv_endpoint, options.rdzv_backend
    )
    return [found] if found else []
