"""Compile check of the CUDA kernels (no GPU, no CUDA torch needed): runs
scripts/check_cuda_compile.sh, which compiles every kernel template for sm_80 and sm_90 and
fails on compile errors or register spills in the decode kernels.

Skipped only when nvcc is absent. KVQ_TEST_CUDA_BINDINGS=1 also compiles the torch binding
(csrc/cuda/cuda_ops.cu) against the installed torch headers (several minutes)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "check_cuda_compile.sh")


def _nvcc():
    return os.environ.get("NVCC") or shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found: the CUDA compile check needs the CUDA toolkit")
def test_cuda_kernels_compile_without_decode_spills():
    args = ["bash", SCRIPT]
    if os.environ.get("KVQ_TEST_CUDA_BINDINGS") == "1":
        args.append("--bindings")
    env = dict(os.environ, NVCC=_nvcc(), PYTHON=sys.executable)
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    print(r.stdout)
    print(r.stderr, file=sys.stderr)
    assert r.returncode == 0, r.stderr[-4000:] or r.stdout[-4000:]
    assert "check_cuda_compile: OK" in r.stdout
    rows = [l for l in r.stdout.splitlines() if "decode_kernel<" in l]
    # 11 kinds (f16, bf16, e4m3, e5m2, int2/3/4/8, nuq2/3/4) x 3 head sizes x 2 architectures
    assert len(rows) == 66, len(rows)
    for line in rows:
        m = re.match(r"(sm_\d+)\s+(\d+)\s+(\d+)/(\d+)", line)
        assert m and m.group(3) == "0" and m.group(4) == "0", line
