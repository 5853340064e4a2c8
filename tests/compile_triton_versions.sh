#!/usr/bin/env bash
# Compiles every Triton kernel for sm_90 and sm_80 (tests/compile_triton.py) under each Triton
# release that pyproject admits, each in a venv of its own that holds triton alone (the compile
# check needs neither torch nor specengine; triton has no dependencies).
#
#   bash tests/compile_triton_versions.sh [VERSION ...]    # default: 3.6.0 3.7.1 3.9.0
#
# The venvs, and each one's Triton cache, live outside the clone, in
# ${SPECENGINE_TRITON_VENVS:-~/.cache/specengine-triton-venvs}/<version>: a rerun downloads nothing
# (a wheel is 150-300 MB) and recompiles only kernels whose source changed. A venv counts once its
# install finished (.installed); a cut install is redone. PYTHON picks the interpreter (python3).
# Exit status: 0 all compiled; 1 a version failed to compile; 3 a version could not be installed
# (no network and no cached venv), nothing failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="${SPECENGINE_TRITON_VENVS:-$HOME/.cache/specengine-triton-venvs}"
PY="${PYTHON:-python3}"
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(3.6.0 3.7.1 3.9.0)
status=0
for version in "${VERSIONS[@]}"; do
  venv="$ROOT/$version"
  t0=$SECONDS
  if [ ! -f "$venv/.installed" ]; then
    rm -rf "$venv"
    mkdir -p "$ROOT"
    if ! { "$PY" -m venv "$venv" && "$venv/bin/python" -m pip install --quiet --no-cache-dir --disable-pip-version-check \
        "triton==$version"; } > "$ROOT/$version.install.log" 2>&1; then
      echo "triton $version: could not install (see $ROOT/$version.install.log)"
      tail -3 "$ROOT/$version.install.log"
      [ "$status" -eq 1 ] || status=3
      continue
    fi
    touch "$venv/.installed"
  fi
  installed=$((SECONDS - t0))
  # -I: the clone's own modules only through the script's path (no user site, no PYTHONPATH).
  TRITON_CACHE_DIR="$venv/triton-cache" env -u TRITON_INTERPRET "$venv/bin/python" -I tests/compile_triton.py \
    --arch 90 80 > "$venv/compile.log" 2>&1
  rc=$?
  grep -v '^ok ' "$venv/compile.log" | tail -40
  echo "triton $version: exit $rc (install ${installed} s, compile $((SECONDS - t0 - installed)) s; log $venv/compile.log)"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
