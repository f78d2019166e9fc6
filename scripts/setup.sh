#!/usr/bin/env bash
# Idempotent CPU setup: cached venv with pinned deps, the editable package (builds the
# C++ extension), and the default model. Safe to rerun; only changed parts do work.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

t0=$SECONDS
log() { echo "[setup] +$(( SECONDS - t0 ))s $*"; }
py="$KVQ_VENV/bin/python"
if [[ ! -x "$py" ]]; then
  log "creating venv $KVQ_VENV"
  mkdir -p "$KVQ_CACHE"
  "$KVQ_PYTHON" -m venv "$KVQ_VENV"
fi

# The install steps themselves live in scripts/install.sh, shared with the Dockerfiles.
install() { PY="$py" bash scripts/install.sh "$@"; }

# The stamp is written only after a complete install, so an interrupted one is retried.
stamp="$KVQ_VENV/.kvq-requirements.sha256"
if [[ "$(cat "$stamp" 2>/dev/null || true)" == "$KVQ_REQ_HASH" ]]; then
  log "requirements up to date (stamp matches)"
else
  log "installing requirements/cpu.txt"
  install requirements requirements/cpu.txt
  echo "$KVQ_REQ_HASH" > "$stamp"
fi

# The compiler cache (requirements/build-tools.txt, used by install.sh package): a fresh
# clone's extension build links objects an earlier build of the same sources left. Without
# it the build is only slower.
install build-tools || log "WARNING: no build tools; the extension compiles uncached"

if [[ -f setup.py ]]; then
  # Run every time; cheap when nothing changed (ninja reuses build/editable-temp).
  log "pip install -e . (recompiles only changed extension sources)"
  install package --editable
else
  log "WARNING: no setup.py yet; skipping the editable install"
fi

log "preparing the default model"
model_dir="$(install model)"
log "model: $model_dir"
log "preparing the second model (Gemma 3 270M: sliding-window layers; the tests use it)"
log "model: $(install model gemma3)"
log "done"
log "venv: $KVQ_VENV"
