# Source this (bash): sets KVQ_CACHE, KVQ_VENV, KVQ_REQ_HASH and puts the venv first on PATH.
# The venv name is the one place the cache key is computed; scripts/setup.sh sources this file.
# Key = python version + hash of requirements/cpu.txt, so changing a pin makes a fresh venv
# instead of mutating one that other checkouts may still use.

_kvq_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export KVQ_CACHE="${KVQ_CACHE:-$HOME/.cache/vllm-kvq}"
export KVQ_PYTHON="${KVQ_PYTHON:-python3}"  # the base interpreter the venv is made from
_kvq_pyver="$("$KVQ_PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
# Comments and blank lines are left out of the hash: editing them must not cost a new venv.
export KVQ_REQ_HASH="$(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$_kvq_repo/requirements/cpu.txt" \
  | sha256sum | cut -d' ' -f1)"
export KVQ_VENV="$KVQ_CACHE/venv-py${_kvq_pyver}-${KVQ_REQ_HASH:0:12}"
case ":$PATH:" in
  *":$KVQ_VENV/bin:"*) ;;  # already there: sourcing twice must not grow PATH
  *) export PATH="$KVQ_VENV/bin:$PATH" ;;
esac
unset _kvq_repo _kvq_pyver
