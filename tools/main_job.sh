#!/usr/bin/env bash
# The README's main job: create or reuse the environment, then train the tiny MoE GPT on 4 CPU ranks
# (EP=4, gloo) with `--moe-balancer ultraep`, printing per-layer expert-load imbalance before and after
# balancing. Extra arguments are passed to pretrain_gpt.py (they override the recipe's).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=$(bash "$repo/tools/ensure_env.sh")
export ULTRAEP_PYTHON=$PY
cd "$repo"
exec bash recipes/tiny_cpu.sh --moe-balancer ultraep "$@"
