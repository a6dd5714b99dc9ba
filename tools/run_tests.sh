#!/usr/bin/env bash
# The README's test command: create or reuse the environment, then run the whole suite.
# Extra arguments go to pytest (e.g. `bash tools/run_tests.sh tests/planner -x`).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=$(bash "$repo/tools/ensure_env.sh")
cd "$repo"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=offline WANDB_SILENT=true
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::UserWarning}
exec "$PY" -m pytest "${@:-tests}" -p no:cacheprovider
