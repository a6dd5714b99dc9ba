#!/usr/bin/env bash
# Every GPU-only check that needs no Transformer Engine, in one call, with one table at the end.
#
#   bash tools/gpu_check.sh              # on a machine with a CUDA GPU (about 5 minutes on one H200)
#   bash tools/gpu_check.sh --list       # what it runs, anywhere (also what it prints without CUDA)
#   bash tools/gpu_check.sh --help       # this text
#
# Whoever is lent a GPU runs it in one call. Without CUDA it says what it would run and exits 0.
# The interpreter is the project's, found as the README's commands find it: $ULTRAEP_PYTHON, else
# the environment tools/ensure_env.sh creates or reuses ($ULTRAEP_VENV, default
# ~/.cache/ultraep-megatron/venv); never a bare python3 off PATH. An interpreter without torch stops
# it with one line, exit status 2. It needs torch with CUDA, Triton, megatron-core and the project's
# test dependencies (pytest, hypothesis, numba). Logs go to $GPU_CHECK_LOGS
# (default: a new temporary folder), one file per check; the exit status is 1 if any check failed.
# GPU_CHECK_ONLY=1,3 runs only those checks (numbered as --list shows them).
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
case "${1:-}" in
  -h|--help) sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
  ''|--list) ;;
  *) echo "gpu_check: unknown argument $1 (usage: bash tools/gpu_check.sh [--list | --help])" >&2; exit 2 ;;
esac
if [ "${1:-}" = --list ]; then  # names the interpreter only: runs anywhere, installs nothing
  PY=${ULTRAEP_PYTHON:-${ULTRAEP_VENV:-$HOME/.cache/ultraep-megatron/venv}/bin/python}
elif [ -n "${ULTRAEP_PYTHON:-}" ]; then
  PY=$ULTRAEP_PYTHON
else
  PY=$(bash "$repo/tools/ensure_env.sh") || {
    echo "gpu_check: tools/ensure_env.sh found no project environment (see above); set ULTRAEP_VENV or ULTRAEP_PYTHON" >&2
    exit 2
  }
fi
if [ "${1:-}" != --list ] && ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "gpu_check: $PY has no torch: not the project's environment; set ULTRAEP_PYTHON to it, or ULTRAEP_VENV (bash tools/ensure_env.sh creates it)" >&2
  exit 2
fi
logs=${GPU_CHECK_LOGS:-$(mktemp -d -t gpu_check.XXXXXX)}
mkdir -p "$logs"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::UserWarning} PYTHONUNBUFFERED=1

# name | seconds allowed | command | what the table shows (a regex on the log; its last match)
CHECKS=(
  "balanced layer on CUDA, host and device planners (sync check, vs megatron)|300|$PY -m pytest -q -p no:cacheprovider tests/megatron/test_cuda_layer.py|[0-9]+ passed[^\n]*"
  "capture + replay of the balanced preprocess (device planner)|180|$PY tests/megatron/workers/capture_preprocess.py --device cuda|capture_replay_device_planner: [^\n]*"
  "fused ops: self-check fresh (new Triton cache) and cached, R=64 E=256|150|$PY tools/bench_planner.py --only self-check|R=64 E=256 S=2: [^\n]*|R=64 E=256 S=2 domains of 8: [^\n]*"
  "critical path, T=4096, both planners (device: eager and graphed)|180|$PY tools/bench_critical_path.py --tokens 4096 --iters 100|added by balancing:[^\n]*|CUDA graph[^\n]*"
  "critical path, T=4096, per-phase profile (torch.profiler: CPU issue / device per phase)|180|$PY tools/bench_critical_path.py --tokens 4096 --iters 20 --profile|phases of ultraep host [^\n]*|phases of ultraep device \([^\n]*|phases of ultraep device graphed[^\n]*"
  "critical path, T=16384, both planners (device: eager and graphed)|180|$PY tools/bench_critical_path.py --tokens 16384 --iters 100|added by balancing:[^\n]*|CUDA graph[^\n]*"
  "fused plan kernel alone EP8..64, E 256/512, + fused reroute, vs the host planner bit for bit|240|$PY tools/bench_fused_kernels.py --device cuda --check --iters 50|fused R=64 E=256[^\n]*|fused R=64 E=512[^\n]*"
  "fused ops self-check on CUDA (plan record, table, reroute vs host)|120|$PY -c 'import sys, torch; from ultraep_megatron.planner import BalancerConfig; from ultraep_megatron.planner.self_check import self_check; p = [x for N in (None, 8) for x in self_check(torch.device(\"cuda\"), BalancerConfig(\"ultraep\", domain_size=N))]; print(\"self-check problems:\", len(p), p[:3]); sys.exit(1 if p else 0)'|self-check problems:[^\n]*"
  "fused plan and reroute tests (their Triton kernels under TRITON_INTERPRET vs the host, bit for bit; no CUDA case in them)|300|$PY -m pytest -q -p no:cacheprovider tests/planner/test_fused_plan.py tests/planner/test_fused_reroute.py -s|[0-9]+ passed[^\n]*|\{.cases.[^}]*\}"
)

if [ "${1:-}" = "--list" ] || ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  [ "${1:-}" = "--list" ] || echo "gpu_check: no CUDA device for $PY: nothing run. On a GPU machine it runs:"
  n=0
  for check in "${CHECKS[@]}"; do
    IFS='|' read -r name limit command _ <<<"$check"
    n=$((n + 1))
    printf '  [%s] %-75s (<= %ss)\n      %s\n' "$n" "$name" "$limit" "$command"
  done
  exit 0
fi

"$PY" - <<'EOF'
import torch
print(f"gpu_check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF
status=0
results=()
i=0
for check in "${CHECKS[@]}"; do
  IFS='|' read -r name limit command figure_regex <<<"$check"
  i=$((i + 1))
  case ",${GPU_CHECK_ONLY:-$i}," in *",$i,"*) ;; *) continue ;; esac
  log="$logs/check$i.log"
  echo "== [$i/${#CHECKS[@]}] $name: $command"
  start=$SECONDS
  timeout --kill-after=10 "$limit" bash -c "$command" >"$log" 2>&1
  rc=$?
  seconds=$((SECONDS - start))
  tail -n 5 "$log"
  if [ $rc -eq 0 ]; then verdict=PASS; elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict=TIMEOUT; status=1; else verdict=FAIL; status=1; fi
  figure=$("$PY" - "$log" "$figure_regex" <<'EOF'
import re, sys
text = open(sys.argv[1], errors="replace").read()
found = []
for pattern in sys.argv[2].split("|"):
    matches = re.findall(pattern, text)
    if matches:
        found.append(matches[-1].strip())
print(" ; ".join(found)[:400] or "(no figure in the log)")
EOF
)
  results+=("$verdict|$seconds|$name|$figure")
  echo "-> | $name | $verdict | $seconds | $figure |"
done

echo
echo "| check | verdict | seconds | figure |"
echo "| --- | --- | --- | --- |"
for row in "${results[@]}"; do
  IFS='|' read -r verdict seconds name figure <<<"$row"
  echo "| $name | $verdict | $seconds | $figure |"
done
echo "logs: $logs"
exit $status
