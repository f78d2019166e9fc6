#!/usr/bin/env bash
# Compile check of the CUDA kernels without a GPU and without a CUDA build of torch.
#
# Compiles csrc/cuda/compile_check.cu (every kernel template, no torch) for sm_80 and sm_90
# in one nvcc call with `-Xptxas -v`, prints registers / spills / shared memory per kernel
# and fails on a compile error or on any register spill in the decode kernels.
#   --bindings   also compile csrc/cuda/cuda_ops.cu against the installed torch's headers
#                (slow: torch headers under nvcc take minutes on a small machine)
#   --arch LIST  comma list of SM targets (default 80,90)
# Env: NVCC (compiler), PYTHON (for --bindings), KVQ_NVCC_THREADS (nvcc --threads, default 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bindings=0
archs="80,90"
while (( $# )); do
  case "$1" in
    --bindings) bindings=1 ;;
    --arch) archs="$2"; shift ;;
    *) echo "usage: $0 [--bindings] [--arch 80,90]" >&2; exit 64 ;;
  esac
  shift
done

nvcc="${NVCC:-}"
if [[ -z "$nvcc" ]]; then
  nvcc="$(command -v nvcc || true)"
  [[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
fi
if [[ -z "$nvcc" ]]; then
  echo "check_cuda_compile: nvcc not found (set NVCC or put it on PATH)" >&2
  exit 3
fi

gencode=()
IFS=',' read -ra arr <<< "$archs"
for a in "${arr[@]}"; do gencode+=(-gencode "arch=compute_${a},code=sm_${a}"); done
# Same code-generation flags as setup.py's nvcc list (IEEE division and no flush-to-zero,
# which the bit-exact quantization of write_cache needs).
flags=(-std=c++17 -O3 -lineinfo -Icsrc --threads "${KVQ_NVCC_THREADS:-2}" -Xptxas -v)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "check_cuda_compile: $("$nvcc" --version | tail -1)"
t0=$SECONDS
set +e
"$nvcc" -c "${flags[@]}" "${gencode[@]}" csrc/cuda/compile_check.cu -o "$tmp/check.o" > "$tmp/ptxas.log" 2>&1
rc=$?
set -e
echo "check_cuda_compile: kernels compiled in $(( SECONDS - t0 ))s (rc=$rc)"
if (( rc != 0 )); then
  grep -v "^ptxas info" "$tmp/ptxas.log" | head -60 >&2
  echo "check_cuda_compile: FAILED to compile csrc/cuda/compile_check.cu" >&2
  exit 1
fi

python3 - "$tmp/ptxas.log" <<'PY'
import re, subprocess, sys
log = open(sys.argv[1]).read().splitlines()
rows, cur = [], None
for line in log:
    m = re.search(r"Compiling entry function '([^']+)' for '(sm_\d+)'", line)
    if m:
        cur = {"mangled": m.group(1), "arch": m.group(2), "regs": 0, "spill_st": 0, "spill_ld": 0,
               "stack": 0, "smem": 0}
        rows.append(cur)
        continue
    if cur is None:
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m:
        cur["stack"], cur["spill_st"], cur["spill_ld"] = map(int, m.groups())
    m = re.search(r"Used (\d+) registers", line)
    if m:
        cur["regs"] = int(m.group(1))
        s = re.search(r"(\d+) bytes smem", line)
        cur["smem"] = int(s.group(1)) if s else 0
try:
    names = subprocess.run(["c++filt"], input="\n".join(r["mangled"] for r in rows), text=True,
                           capture_output=True, check=True).stdout.splitlines()
except Exception:
    names = [r["mangled"] for r in rows]
kinds = ["f16", "bf16", "e4m3", "e5m2", "int2", "int3", "int4", "int8", "nuq2", "nuq3", "nuq4"]
def short(n):
    n = re.sub(r"^void ", "", n).replace("kvq_cuda::", "").replace("(AttnParams)", "").replace("(WriteParams)", "")
    m = re.match(r"decode_kernel<(\d+), (\d+), (\d+)>", n)
    if m:
        return f"decode_kernel<D={m.group(1)}, K={kinds[int(m.group(2))]}, V={kinds[int(m.group(3))]}>"
    return n
for r, n in zip(rows, names):
    r["name"] = short(n)
rows.sort(key=lambda r: (r["name"].split("<")[0], r["arch"], r["name"]))
print(f"{'arch':6s} {'regs':>4s} {'spill st/ld':>11s} {'stack':>5s} {'smem':>6s}  kernel")
bad = []
for r in rows:
    print(f"{r['arch']:6s} {r['regs']:4d} {r['spill_st']:5d}/{r['spill_ld']:<5d} {r['stack']:5d} {r['smem']:6d}  {r['name']}")
    if (r["spill_st"] or r["spill_ld"]) and ("decode_kernel" in r["name"] or "reduce_kernel" in r["name"]):
        bad.append(r)
spills = [r for r in rows if r["spill_st"] or r["spill_ld"]]
print(f"check_cuda_compile: {len(rows)} kernel builds, {len(spills)} with spills, "
      f"{len(bad)} decode kernels with spills")
if not rows:
    print("check_cuda_compile: no ptxas output parsed", file=sys.stderr)
    sys.exit(1)
if bad:
    print("check_cuda_compile: FAILED: register spills in decode kernels", file=sys.stderr)
    sys.exit(1)
PY

if (( bindings )); then
  py="${PYTHON:-python3}"
  inc="$("$py" -c 'from torch.utils import cpp_extension as c; print(" ".join(c.include_paths()))')"
  incs=()
  for d in $inc; do incs+=(-I"$d"); done
  # The CPU wheel of torch lacks c10/cuda's generated config header: supply a stand-in.
  shim="$tmp/shim"
  if ! "$py" -c 'import os,sys; from torch.utils import cpp_extension as c; sys.exit(0 if any(os.path.exists(os.path.join(d, "c10/cuda/impl/cuda_cmake_macros.h")) for d in c.include_paths()) else 1)'; then
    mkdir -p "$shim/c10/cuda/impl"
    printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$shim/c10/cuda/impl/cuda_cmake_macros.h"
    incs=(-I"$shim" "${incs[@]}")
  fi
  t1=$SECONDS
  set +e
  "$nvcc" -c -std=c++17 -O3 -Icsrc -DKVQ_WITH_CUDA "${incs[@]}" "${gencode[@]}" --threads "${KVQ_NVCC_THREADS:-2}" \
    -w csrc/cuda/cuda_ops.cu -o "$tmp/ops.o" > "$tmp/ops.log" 2>&1
  rc=$?
  set -e
  echo "check_cuda_compile: bindings compiled in $(( SECONDS - t1 ))s (rc=$rc)"
  if (( rc != 0 )); then
    grep -E "error|Error" "$tmp/ops.log" | head -40 >&2
    echo "check_cuda_compile: FAILED to compile csrc/cuda/cuda_ops.cu" >&2
    exit 1
  fi
fi
echo "check_cuda_compile: OK"
