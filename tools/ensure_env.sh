#!/usr/bin/env bash
# Create or reuse the project's Python environment, then print its python path on stdout.
#
#   PY=$(bash tools/ensure_env.sh)
#   PY=$(ULTRAEP_MCORE=0.18 bash tools/ensure_env.sh)   # the same with megatron-core 0.18
#
# The venv lives outside the checkout (default ~/.cache/ultraep-megatron/venv, override with
# ULTRAEP_VENV) so fresh clones on the same machine reuse the ~5 GB torch install. Dependencies come
# from the exact, hashed lock (requirements/lock.txt; pyproject.toml holds the ranges): they are
# reinstalled when the lock or pyproject.toml changes, and the package is (re)installed in editable
# mode, without dependencies, when the checkout moves.
#
# ULTRAEP_MCORE=0.18 (default 0.19): megatron-core 0.18's environment (requirements/lock-mcore018.txt),
# a small venv layered on the main one (default <main venv>-mcore018, override with
# ULTRAEP_VENV_MCORE018): it sees the main environment's packages (torch, the editable install of
# this checkout) and installs only the lines of its lock that differ from lock.txt (megatron-core);
# it is remade when either lock or pyproject.toml changes.
#
# ULTRAEP_BRIDGE=1: Megatron-Bridge 0.6.2's environment (requirements/lock-bridge.txt), layered the
# same way (default <main venv>-bridge, override with ULTRAEP_VENV_BRIDGE): megatron-bridge without
# its declared dependencies and the prebuilt packages its imports need, plus a .pth file that
# installs ultraep_megatron.megatron.bridge.imports (the import hook for Bridge's CUDA-only imports).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${ULTRAEP_VENV:-$HOME/.cache/ultraep-megatron/venv}
mcore=${ULTRAEP_MCORE:-0.19}
log() { echo "[ensure_env] $*" >&2; }
case "$mcore" in
  0.19|0.18) ;;
  *) log "ULTRAEP_MCORE=$mcore: the megatron-core releases supported are 0.19 (the default) and 0.18"; exit 1 ;;
esac
bridge=${ULTRAEP_BRIDGE:-0}
case "$bridge" in
  0|1) ;;
  *) log "ULTRAEP_BRIDGE=$bridge: 1 adds Megatron-Bridge 0.6.2, 0 (the default) does not"; exit 1 ;;
esac
if [ "$bridge" = 1 ] && [ "$mcore" != 0.19 ]; then
  log "ULTRAEP_BRIDGE=1 runs on megatron-core 0.19 only (Bridge 0.6.2's release); unset ULTRAEP_MCORE"
  exit 1
fi

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
    log "Python 3.12 not found (megatron-core 0.18 and 0.19 ship cp312 wheels only)."
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
if [ "$mcore" = 0.19 ] && [ "$bridge" = 0 ]; then
  echo "$venv/bin/python"
  exit 0
fi

# megatron-core 0.18 or Megatron-Bridge: a venv layered on the main one.
if [ "$bridge" = 1 ]; then
  layer=${ULTRAEP_VENV_BRIDGE:-$venv-bridge}
  layer_lock="$repo/requirements/lock-bridge.txt"
  what="Megatron-Bridge 0.6.2"
else
  layer=${ULTRAEP_VENV_MCORE018:-$venv-mcore018}
  layer_lock="$repo/requirements/lock-mcore018.txt"
  what="megatron-core 0.18"
fi
base_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
layer_stamp=$(cat "$repo/pyproject.toml" "$lock" "$layer_lock" <(echo "$base_site") | sha256sum | cut -c1-16)
if [ ! -x "$layer/bin/python" ] || [ "$(cat "$layer/.ultraep-deps" 2>/dev/null)" != "$layer_stamp" ]; then
  base=$(find_python312) || { log "Python 3.12 not found"; exit 1; }
  log "creating $layer ($what: $layer_lock), layered on $venv"
  rm -rf "$layer"
  "$base" -m venv "$layer"
  layer_site=$("$layer/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # After the layer's own packages: the main environment's, its .pth files processed (its editable
  # install of this checkout, and its own layers).
  echo "import site; site.addsitedir('$base_site')" > "$layer_site/zz_ultraep_main_venv.pth"
  differing=$(mktemp)
  trap 'rm -f "$differing"' EXIT
  "$layer/bin/python" - "$lock" "$layer_lock" > "$differing" <<'PY'
import sys

def requirements(path):
    """name -> its lines (requirement and hashes) in a hashed lock file."""
    found, name = {}, None
    for line in open(path):
        if line.startswith("#") or not line.strip():
            continue
        if not line[0].isspace():
            name = line.split("==")[0].lower()
            found[name] = ""
        found[name] += line
    return found

main, layer = requirements(sys.argv[1]), requirements(sys.argv[2])
missing = sorted(set(main) - set(layer))
if missing:
    sys.exit(f"{sys.argv[2]} lacks {', '.join(missing)} of {sys.argv[1]}: a layer cannot remove them")
sys.stdout.write("".join(lines for name, lines in layer.items() if main.get(name) != lines))
PY
  log "installing what differs from $lock: $(grep -o '^[^ ]*==[^ ]*' "$differing" | tr '\n' ' ')"
  "$layer/bin/python" -m pip install -q --progress-bar off --only-binary=:all: --require-hashes --no-deps -r "$differing" >&2
  if [ "$bridge" = 1 ]; then
    # Bridge declares CUDA-only dependencies (transformer-engine, ...) it is installed without:
    # pip check would name them. The import hook is what makes `import megatron.bridge` work here.
    echo "import ultraep_megatron.megatron.bridge.imports as m; m.install()" > "$layer_site/zzz_ultraep_bridge_imports.pth"
    "$layer/bin/python" -c 'import megatron.bridge' >&2 || { log "megatron.bridge does not import in $layer"; exit 1; }
  else
    "$layer/bin/python" -m pip check >&2 || { log "$layer_lock does not satisfy pyproject.toml's ranges: run tools/update_lock.py"; exit 1; }
  fi
  echo "$layer_stamp" > "$layer/.ultraep-deps"
fi
echo "$layer/bin/python"
