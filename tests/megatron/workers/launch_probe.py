"""Worker for the launcher tests: what a rank was given (environment, paths, session, generators,
warning filters), as JSON in OUT_DIR/rank<RANK>.json; with FAIL_RANK=r, rank r exits with status 3
after writing, and the others wait to be stopped."""

import json
import os
import sys
import time
import warnings
from pathlib import Path

import megatron.core  # noqa: F401  (what every worker imports: its warning filters)
import megatron.training  # noqa: F401
import torch

rank = int(os.environ["RANK"])
record = {
    "env": {name: value for name, value in os.environ.items()},
    "argv": sys.argv,
    "path": sys.path,
    "cwd": os.getcwd(),
    "session_leader": os.getsid(0) == os.getpid(),
    "torch_seed": torch.initial_seed(),
    "warning_filters": sorted(str(f) for f in warnings.filters),
    "main_module": __name__,
}
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(record))
print(f"probe rank {rank} out", flush=True)
print(f"probe rank {rank} err", file=sys.stderr, flush=True)
if os.environ.get("FAIL_RANK") == str(rank):
    sys.exit(3)
if os.environ.get("FAIL_RANK"):
    time.sleep(600)
