#!/usr/bin/env bash
# Create or reuse the project's Python environment, then print its python path on stdout.
#
#   PY=$(bash tools/ensure_env.sh)
#
# The venv lives outside the checkout (default ~/.cache/ultraep-megatron/venv, override with
# ULTRAEP_VENV) so fresh clones on the same machine reuse the ~5 GB torch install. Dependencies come
# from the exact, hashed lock (requirements/lock.txt; pyproject.toml holds the ranges): they are
# reinstalled when the lock or pyproject.toml changes, and the package is (re)installed in editable
# mode, without dependencies, when the checkout moves.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${ULTRAEP_VENV:-$HOME/.cache/ultraep-megatron/venv}
log() { echo "[ensure_env] $*" >&2; }

find_python312() {
  local c
  for c in "${ULTRAEP_BASE_PYTHON:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys, venv; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  return 1
}

lock="$repo/requirements/lock.txt"
deps_stamp=$(cat "$repo/pyproject.toml" "$lock" | sha256sum | cut -c1-16)
stamp_file="$venv/.ultraep-deps"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp_file" 2>/dev/null)" != "$deps_stamp" ]; then
  base=$(find_python312) || {
    log "Python 3.12 not found (megatron-core 0.19.2 ships cp312 wheels only)."
    log "Install it (e.g. 'pyenv install 3.12') or point ULTRAEP_BASE_PYTHON at a python3.12."
    exit 1
  }
  if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv with $base"
    mkdir -p "$(dirname "$venv")"
    "$base" -m venv "$venv"
  fi
  log "installing the locked dependencies ($lock: torch + megatron-core + tools; a few minutes on a fresh machine)"
  "$venv/bin/python" -m pip install -q --progress-bar off --require-hashes --no-deps -r "$lock" >&2
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$repo" >&2
  "$venv/bin/python" -m pip check >&2 || { log "the lock does not satisfy pyproject.toml's ranges: run tools/update_lock.py"; exit 1; }
  echo "$deps_stamp" > "$stamp_file"
  echo "$repo" > "$venv/.ultraep-src"
fi
if [ "$(cat "$venv/.ultraep-src" 2>/dev/null)" != "$repo" ]; then
  log "pointing the editable install at $repo"
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$repo" >&2
  echo "$repo" > "$venv/.ultraep-src"
fi
echo "$venv/bin/python"
