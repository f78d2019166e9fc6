#!/usr/bin/env python3
"""One prepared check of the vllm-kvq CUDA kernels, for a session that has a GPU.

Made for the H200 machines (torch CUDA, nvcc, ninja, pybind11; no vLLM, no network), to
run as ONE command well inside 10 minutes:

    python3 scripts/gpu_check.py            # results under $OUT (or --out DIR)

(with the device tool: run(command="python3 scripts/gpu_check.py", timeout_s=600); if time
is short, `--quick` does the build and correctness only; `--only bench --skip-build` reruns
a step on a warm machine.)

Steps (each printed with a timestamp; results are saved after every step, so a run cut
short still leaves what it did):
  1. environment; CPU-side prep: format layouts, reference expectations (vllm_kvq/reference.py)
  2. build: `setup.py build_ext --inplace` for sm_90 only (KVQ_CUDA_ARCHS, MAX_JOBS); if that
     fails, a standalone module of just the CUDA ops (csrc/cuda/standalone) is built instead
  3. write_cache: byte-identical planes vs the reference, every format (EXAMPLE_NAMES +
     int3/int2 token + static-scale codecs), int64 and int32 slot_mapping, the slot check
  4. paged_attention vs the reference (decode batches, mixed prefill/chunked prefill/decode
     batches with residual staging; head sizes 64/128/256; GQA 4 and 8), once with the
     default dispatch (tensor-core decode kernel) and once with KVQ_CUDA_ATTN=generic
  5. consistency at long contexts: decode kernel vs the generic CUDA kernel
  6. benchmark: device-to-device copy bandwidth, then decode attention at contexts 4k..128k
     and batch 1..64 (bf16, fp8_e4m3, int8_token, int4_group32, kivi2) against torch's bf16
     scaled_dot_product_attention on contiguous K/V (GQA via q reshaped to [B, H, G, D]),
     CUDA events, warm-up; plus one prefill timing of the generic kernel.
Without a GPU it stops after step 1 with exit code 2.

Exit code: 0 all checks passed, 1 a check failed (or the build failed), 2 no GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
T0 = time.time()
RESULTS: dict = {"env": {}, "build": {}, "write": [], "attention": [], "consistency": [],
                 "copy_bw_GBps": None, "bench": [], "prefill": [], "failures": []}
OUT_DIR: str | None = None
EMULATE = False


def log(msg: str) -> None:
    print(f"[gpu_check +{time.time() - T0:6.1f}s] {msg}", flush=True)


def fail(what: str) -> None:
    RESULTS["failures"].append(what)
    log(f"FAIL: {what}")


def save() -> None:
    if not OUT_DIR:
        return
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "gpu_check.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    with open(os.path.join(OUT_DIR, "gpu_check.md"), "w") as f:
        f.write(markdown())


def markdown() -> str:
    r = RESULTS
    lines = ["# vllm-kvq CUDA check", "", "## Environment", ""]
    lines += [f"- {k}: {v}" for k, v in r["env"].items()]
    lines += ["", "## Build", ""] + [f"- {k}: {v}" for k, v in r["build"].items()]
    lines += ["", f"## write_cache ({sum(w['ok'] for w in r['write'])}/{len(r['write'])} byte-identical)", ""]
    lines += [f"- {w['name']} D={w['D']}: {'ok' if w['ok'] else 'DIFF ' + str(w.get('ndiff'))}"
              for w in r["write"] if not w["ok"]]
    lines += ["", "## paged_attention vs reference", "",
              "| format | D | Hq/H | case | path | max abs err | tol | ok |", "|---|---|---|---|---|---|---|---|"]
    for a in r["attention"]:
        lines.append(f"| {a['name']} | {a['D']} | {a['Hq']}/{a['H']} | {a['case']} | {a['path']} | "
                     f"{a['err']:.2e} | {a['tol']:.0e} | {'ok' if a['ok'] else 'FAIL'} |")
    lines += ["", "## decode kernel vs generic kernel (long contexts)", ""]
    lines += [f"- {c['name']}: max abs diff {c['err']:.2e} ({'ok' if c['ok'] else 'FAIL'})" for c in r["consistency"]]
    lines += ["", f"## Decode benchmark (copy bandwidth {r['copy_bw_GBps']} GB/s, read+write)", "",
              "| format | batch | ctx | us | GB/s | % copy BW | vs SDPA bf16 |", "|---|---|---|---|---|---|---|"]
    for b in r["bench"]:
        lines.append(f"| {b['name']} | {b['batch']} | {b['ctx']} | {b['us']:.1f} | {b['GBps']:.0f} | "
                     f"{b['pct_copy']:.0f}% | {b.get('speedup_vs_sdpa', float('nan')):.2f}x |")
    if r["prefill"]:
        lines += ["", "## Prefill (generic CUDA-core kernel)", ""]
        lines += [f"- {p['name']} {p['tokens']} tokens: {p['ms']:.2f} ms (SDPA causal bf16 {p['sdpa_ms']:.2f} ms)"
                  for p in r["prefill"]]
    lines += ["", "## Failures", ""] + ([f"- {x}" for x in r["failures"]] or ["- none"])
    return "\n".join(lines) + "\n"


# --- cases ---------------------------------------------------------------------------------
def codebooks(fmt):
    """(k_levels, v_levels) of a nuq format, None for the other codecs (the tests' ones)."""
    from vllm_kvq.tools.paged_attention_case import nonuniform_codebooks
    return nonuniform_codebooks(fmt)


def make_attention_case(fmt, D, Hq, H, B, qlens, ctx, dtype, seed):
    """CPU tensors of one mixed batch; pages written by the reference, garbage elsewhere
    (vllm_kvq/tools/paged_attention_case.py, shared with tests/test_cuda_emulated.py)."""
    from vllm_kvq.tools.paged_attention_case import attention_case
    return attention_case(fmt, D, Hq, H, B, qlens, ctx, dtype, seed, levels=codebooks(fmt))


def static_scales(fmt, H, seed):
    from vllm_kvq.tools.paged_attention_case import static_scales as scales
    return scales(fmt, H, seed)


def make_write_case(fmt, D, H, B, seed):
    import torch
    from vllm_kvq import reference as ref
    g = torch.Generator().manual_seed(seed)
    lay = fmt.layout(D, B)
    nb = 9
    G = max([c.group for c in (fmt.key, fmt.value) if c.granularity == "channel"] or [1])
    if G > 1:
        slots = torch.cat([torch.full((3,), -1), torch.arange(G) + 2 * B, torch.arange(G),
                           torch.arange(2 * G) + 5 * B + (B - 2 * G if B >= 2 * G else 0)])
    else:
        slots = torch.randperm(nb * B, generator=g)[:77]
        slots[[3, 40]] = -1
    N = slots.numel()
    k = (torch.randn(N, H, D, generator=g) * 2.0)
    v = torch.randn(N, H, D, generator=g) + 0.3
    k[5, 0, :7] *= 40.0  # outliers
    if not (fmt.key.is_float or fmt.value.is_float):  # non-finite policy (bf16 NaN bits differ, see README)
        k[7, 0, 3] = float("nan")
        v[8, H - 1, 9] = float("inf")
        k[9, 0, 1] = -float("inf")
    k = k.to(torch.bfloat16)
    v = v.to(torch.bfloat16)
    ks, vs = static_scales(fmt, H, seed)
    kl, vl = codebooks(fmt)
    expected = torch.zeros(nb, H, B, lay.token_bytes, dtype=torch.uint8)
    ref.write_cache(k, v, expected, slots, fmt, lay, ks if fmt.key.static_scale else None,
                    vs if fmt.value.static_scale else None, kl, vl)
    return dict(k=k, v=v, slots=slots, ks=ks, vs=vs, kl=kl, vl=vl, expected=expected, lay=lay,
                nb=nb)


# --- ops -------------------------------------------------------------------------------------
class Ops:
    """torch.ops.vllm_kvq.* from the built package, or the standalone fallback module."""

    def __init__(self, mod=None):
        import torch
        self.mod = mod
        self.ops = None if mod else torch.ops.vllm_kvq

    @staticmethod
    def _levels(levels, dev):
        """(k_levels, v_levels) on dev; empty tensors for the codecs that take none."""
        import torch
        return [torch.empty(0, dtype=torch.float32, device=dev) if x is None else x.to(dev)
                for x in levels]

    def write(self, k, v, cache, slots, fmt, ks, vs, levels=(None, None)):
        f = self.mod.write_cache if self.mod else self.ops.write_cache
        f(k, v, cache, slots, fmt.key.as_ints(), fmt.value.as_ints(), ks, vs,
          *self._levels(levels, cache.device))

    def attn(self, out, c, fmt, ks, vs):
        f = self.mod.paged_attention if self.mod else self.ops.paged_attention
        f(out, c["q"], c["cache"], c["bt"], c["sl"], c["qsl"], c["sk"], c["sv"], c["ssl"], c["sp0"],
          c["R"], c.get("window", 0), c["scale"], c.get("soft_cap", 0.0), fmt.key.as_ints(), fmt.value.as_ints(),
          ks, vs, *self._levels((c.get("kl"), c.get("vl")), c["cache"].device))


class EmuOps(Ops):
    """--emulate: the same kernels through the CPU emulator (csrc/cuda/emu), tiny sizes."""

    def __init__(self):
        from torch.utils import cpp_extension
        cache = os.path.join(os.environ.get("KVQ_CACHE", os.path.expanduser("~/.cache/vllm-kvq")), "cuda_emu_build")
        import torch
        cpp_extension.load(
            name="kvq_cuda_emu", sources=[os.path.join(ROOT, "csrc/cuda/emu/emu_ops.cpp")],
            extra_cflags=["-O2", "-ffp-contract=off", "-fno-math-errno", "-Wno-unknown-pragmas"],
            extra_include_paths=[os.path.join(ROOT, "csrc")], build_directory=_mkdir(cache),
            is_python_module=False)
        self.emu = torch.ops.kvq_cuda_emu
        self.mod, self.ops = None, None

    def write(self, k, v, cache, slots, fmt, ks, vs, levels=(None, None)):
        flag = self.emu.write_cache(k, v, cache, slots, fmt.key.as_ints(), fmt.value.as_ints(), ks, vs,
                                    kl=levels[0], vl=levels[1])
        if flag and os.environ.get("KVQ_CUDA_CHECK_SLOTS") == "1":
            raise RuntimeError("slot_mapping rejected")

    def attn(self, out, c, fmt, ks, vs):
        self.emu.paged_attention(out, c["q"], c["cache"], c["bt"], c["sl"], c["qsl"], c["sk"], c["sv"], c["ssl"],
                                 c["sp0"], c["R"], c.get("window", 0), c["scale"], c.get("soft_cap", 0.0), fmt.key.as_ints(),
                                 fmt.value.as_ints(), ks, vs, False, 0, 132, kl=c.get("kl"), vl=c.get("vl"))


def build(args) -> Ops | None:
    import torch
    env = dict(os.environ, KVQ_CUDA_ARCHS=args.archs, MAX_JOBS=str(os.cpu_count() or 8))
    log(f"building the extension (setup.py build_ext --inplace, sm_{args.archs}) ...")
    t = time.time()
    log_path = os.path.join(OUT_DIR or "/tmp", "build.log")
    with open(log_path, "w") as lf:
        r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT, env=env,
                           stdout=lf, stderr=subprocess.STDOUT, timeout=args.build_timeout)
    RESULTS["build"]["package_build_s"] = round(time.time() - t, 1)
    RESULTS["build"]["package_build_rc"] = r.returncode
    if r.returncode == 0:
        try:
            from vllm_kvq import _C
            RESULTS["build"]["with_cuda"] = bool(_C.with_cuda)
            if _C.with_cuda:
                log(f"package built in {time.time() - t:.0f}s, with CUDA")
                return Ops()
            fail("package built without CUDA (torch.version.cuda / nvcc not found by setup.py)")
        except Exception as e:  # noqa: BLE001
            fail(f"import vllm_kvq._C after build: {e!r}")
    else:
        tail = open(log_path).read()[-3000:]
        print(tail)
        fail(f"package build failed (rc={r.returncode}); log {log_path}")
    # fallback: just the CUDA ops
    log("building the standalone CUDA module instead ...")
    t = time.time()
    try:
        from torch.utils import cpp_extension
        mod = cpp_extension.load(
            name="kvq_cuda_standalone",
            sources=[os.path.join(ROOT, "csrc/cuda/standalone/standalone_ops.cpp"),
                     os.path.join(ROOT, "csrc/cuda/cuda_ops.cu")],
            extra_include_paths=[os.path.join(ROOT, "csrc")],
            extra_cflags=["-O2"],
            extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo", "--threads=2"] +
                              [f"-gencode=arch=compute_{a},code=sm_{a}" for a in args.archs.split(",")],
            build_directory=_mkdir(os.path.join("/tmp", "kvq_cuda_standalone")), verbose=False)
        sys.modules["vllm_kvq._C"] = mod
        import vllm_kvq
        vllm_kvq._C = mod
        RESULTS["build"]["standalone_build_s"] = round(time.time() - t, 1)
        log(f"standalone module built in {time.time() - t:.0f}s")
        return Ops(mod)
    except Exception as e:  # noqa: BLE001
        fail(f"standalone build failed: {e!r}"[:3000])
        return None


def _mkdir(p):
    os.makedirs(p, exist_ok=True)
    return p


# --- checks ----------------------------------------------------------------------------------
WRITE_FORMATS = None


def check_writes(ops, names, dev):
    import torch
    from vllm_kvq.formats import parse_format
    for name in names:
        fmt = parse_format(name)
        for D in (128, 64):
            B = 128 if fmt.residual_tokens > 32 else 32
            try:
                c = make_write_case(fmt, D, 4, B, seed=zlib.crc32(f"{name}{D}".encode()) % 1000)
            except Exception as e:  # noqa: BLE001
                log(f"skip write {name} D={D}: {e}")
                continue
            for sdt in (torch.int64, torch.int32) if name in ("int4_group32", "kivi2") else (torch.int64,):
                cache = torch.zeros_like(c["expected"]).to(dev)
                ops.write(c["k"].to(dev), c["v"].to(dev), cache, c["slots"].to(sdt).to(dev), fmt,
                          c["ks"].to(dev), c["vs"].to(dev), (c["kl"], c["vl"]))
                got = cache.cpu()
                ok = torch.equal(got, c["expected"])
                nd = int((got != c["expected"]).sum())
                RESULTS["write"].append(dict(name=name, D=D, slots=str(sdt), ok=ok, ndiff=nd))
                if not ok:
                    fail(f"write_cache {name} D={D} slots {sdt}: {nd} bytes differ")
    # the optional slot check: a broken per-channel group must raise with KVQ_CUDA_CHECK_SLOTS=1
    fmt = parse_format("kivi2")
    lay = fmt.layout(128, 128)
    cache = torch.zeros(4, 2, 128, lay.token_bytes, dtype=torch.uint8, device=dev)
    k = torch.randn(32, 2, 128, device=dev, dtype=torch.bfloat16)
    bad = torch.arange(32, device=dev) + 5  # not aligned to 32
    os.environ["KVQ_CUDA_CHECK_SLOTS"] = "1"
    try:
        ops.write(k, k, cache, bad, fmt, torch.ones(2, device=dev), torch.ones(2, device=dev))
        fail("KVQ_CUDA_CHECK_SLOTS=1 did not reject a misaligned per-channel group")
    except RuntimeError:
        RESULTS["write"].append(dict(name="kivi2 misaligned group rejected", D=128, ok=True))
    finally:
        del os.environ["KVQ_CUDA_CHECK_SLOTS"]
    n_ok = sum(w["ok"] for w in RESULTS["write"])
    log(f"write_cache: {n_ok}/{len(RESULTS['write'])} byte-identical")


ATTN_CASES = {
    "decode": ([1, 1, 1, 1], [40, 700, 97, 0]),
    "mixed": ([1, 37, 5, 1], [300, 0, 64, 129]),
}


def check_attention(ops, plan, dev):
    import torch
    from vllm_kvq.formats import parse_format
    for (name, D, Hq, H, cname, dtype) in plan:
        fmt = parse_format(name)
        B = 128 if fmt.residual_tokens > 32 else 32
        qlens, ctx = ATTN_CASES[cname]
        c = make_attention_case(fmt, D, Hq, H, B, qlens, ctx, dtype, seed=zlib.crc32(f"{name}{D}{cname}".encode()) % 1000)
        ks, vs = c["ks"], c["vs"]
        g = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in c.items() if k != "expected"}
        for path in ("default", "generic"):
            if path == "generic":
                os.environ["KVQ_CUDA_ATTN"] = "generic"
            try:
                out = torch.full_like(g["q"], float("nan"))
                ops.attn(out, g, fmt, ks.to(dev), vs.to(dev))
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                err = float((out.float().cpu() - c["expected"]).abs().max())
            except Exception as e:  # noqa: BLE001
                err = float("inf")
                log(f"attention {name} D={D} {cname} {path}: {e!r}"[:500])
            finally:
                os.environ.pop("KVQ_CUDA_ATTN", None)
            tol = 4e-2 if dtype == torch.bfloat16 else 1e-2
            ok = err <= tol
            RESULTS["attention"].append(dict(name=name, D=D, Hq=Hq, H=H, case=cname, path=path, err=err,
                                             tol=tol, ok=ok, dtype=str(dtype)))
            if not ok:
                fail(f"paged_attention {name} D={D} Hq/H={Hq}/{H} {cname} {path}: max err {err:.3e}")
    n_ok = sum(a["ok"] for a in RESULTS["attention"])
    log(f"paged_attention: {n_ok}/{len(RESULTS['attention'])} within tolerance")


def fill_cache(ops, fmt, K, V, nseq, L, B, H, D, dev, seed):
    """Paged cache of nseq sequences of L tokens (token-major K/V [nseq*L, H, D]), blocks
    in a random order. Returns cache, block_table."""
    import torch
    lay = fmt.layout(D, B)
    nblk = L // B
    nb = nseq * nblk
    cache = torch.empty(nb, H, B, lay.token_bytes, dtype=torch.uint8, device=dev)
    g = torch.Generator(device="cpu").manual_seed(seed)
    perm = torch.randperm(nb, generator=g).to(torch.int32).to(dev)
    bt = perm.view(nseq, nblk)
    # slots of token j of seq s: bt[s, j // B] * B + j % B
    j = torch.arange(L, device=dev)
    slots = (bt[:, j // B].long() * B + (j % B)).reshape(-1)
    ones = torch.ones(H, device=dev)
    step = 1 << 20
    for i in range(0, slots.numel(), step):
        ops.write(K[i:i + step], V[i:i + step], cache, slots[i:i + step], fmt, ones, ones)
    return cache, bt, lay


def time_cuda(fn, warmup=3, iters=10, graph=True):
    """Median microseconds per call, CUDA events. With graph=True the call is captured in a
    CUDA graph first, so the host-side cost of the op (checks, launches) is not timed; if
    capture fails, calls are timed back to back."""
    import torch
    if EMULATE:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                fn()
            run = g.replay
            run()
        except Exception as e:  # noqa: BLE001
            RESULTS.setdefault("notes", []).append(f"graph capture failed, timing eagerly: {e!r}"[:300])
            run = fn
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def check_consistency(ops, dev):
    import torch
    from vllm_kvq.formats import parse_format
    D, Hq, H = 128, 32, 8
    lens = [5000, 16000, 777, 3000] if not EMULATE else [250, 800, 39, 150]
    for name in ("bf16", "fp8_e4m3", "int8_token", "int4_group32", "kivi2"):
        fmt = parse_format(name)
        B = 128 if fmt.residual_tokens else 16
        L = max(lens) // B * B + B
        K = torch.randn(len(lens) * L, H, D, device=dev, dtype=torch.bfloat16)
        V = torch.randn(len(lens) * L, H, D, device=dev, dtype=torch.bfloat16)
        cache, bt, lay = fill_cache(ops, fmt, K, V, len(lens), L, B, H, D, dev, 7)
        R = fmt.residual_chunk
        sl = torch.tensor(lens, dtype=torch.int32, device=dev)
        pos0 = [x // R * R if R > 1 else x for x in lens]
        rows = [torch.arange(s * L + p0, s * L + x, device=dev) for s, (p0, x) in enumerate(zip(pos0, lens))]
        ridx = torch.cat(rows)
        ssl = torch.tensor([0] + [int(x) for x in torch.tensor([len(r) for r in rows]).cumsum(0)],
                           dtype=torch.int32, device=dev)
        c = dict(q=torch.randn(len(lens), Hq, D, device=dev, dtype=torch.bfloat16), cache=cache, bt=bt, sl=sl,
                 qsl=torch.arange(len(lens) + 1, dtype=torch.int32, device=dev), sk=K[ridx].contiguous(),
                 sv=V[ridx].contiguous(), ssl=ssl, sp0=torch.tensor(pos0, dtype=torch.int32, device=dev),
                 R=R, scale=1.0 / math.sqrt(D))
        ones = torch.ones(H, device=dev)
        a = torch.zeros_like(c["q"])
        ops.attn(a, c, fmt, ones, ones)
        os.environ["KVQ_CUDA_ATTN"] = "generic"
        b = torch.zeros_like(c["q"])
        try:
            ops.attn(b, c, fmt, ones, ones)
        finally:
            os.environ.pop("KVQ_CUDA_ATTN", None)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        err = float((a.float() - b.float()).abs().max())
        ok = err <= 3e-2
        RESULTS["consistency"].append(dict(name=name, lens=lens, err=err, ok=ok))
        if not ok:
            fail(f"decode vs generic kernel {name}: max diff {err:.3e}")
        del K, V, cache
    log("consistency: " + ", ".join(f"{c['name']} {c['err']:.1e}" for c in RESULTS["consistency"]))


def copy_bandwidth(dev):
    import torch
    n = 1 << 31  # 2 GiB
    x = torch.empty(n, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    us = time_cuda(lambda: y.copy_(x), warmup=3, iters=10, graph=False)
    del x, y
    return 2 * n / (us * 1e-6) / 1e9


def bench(ops, dev, args):
    import torch
    import torch.nn.functional as F
    from vllm_kvq.formats import parse_format
    D, Hq, H = 128, 32, 8
    G = Hq // H
    bw = copy_bandwidth(dev) if not EMULATE else 10.0
    RESULTS["copy_bw_GBps"] = round(bw, 1)
    log(f"device-to-device copy: {bw:.0f} GB/s (read + write)")
    save()
    names = args.bench_formats.split(",")
    for ctx in (4096, 16384, 32768, 65536, 131072) if not EMULATE else (256, 512):
        for batch in (1, 8, 32, 64) if not EMULATE else (1, 2):
            if batch * ctx > args.max_tokens:
                continue
            if time.time() - T0 > args.budget_s:
                log(f"time budget reached: skipping the rest of the benchmark (ctx={ctx}, batch={batch})")
                return
            N = batch * ctx
            K = torch.randn(N, H, D, device=dev, dtype=torch.bfloat16)
            V = torch.randn(N, H, D, device=dev, dtype=torch.bfloat16)
            q = torch.randn(batch, Hq, D, device=dev, dtype=torch.bfloat16)
            # baseline: contiguous bf16 K/V [batch, H, ctx, D]; GQA by viewing the G query
            # heads of a kv head as G query rows (no expansion of K/V)
            kc = K.view(batch, ctx, H, D).transpose(1, 2).contiguous()
            vc = V.view(batch, ctx, H, D).transpose(1, 2).contiguous()
            qs = q.view(batch, H, G, D)
            sdpa_us = time_cuda(lambda: F.scaled_dot_product_attention(qs, kc, vc))
            sdpa_bytes = 2 * N * H * D * 2
            row0 = dict(name="sdpa_bf16", batch=batch, ctx=ctx, us=sdpa_us, GBps=sdpa_bytes / sdpa_us / 1e3,
                        pct_copy=100 * sdpa_bytes / sdpa_us / 1e3 / bw, speedup_vs_sdpa=1.0)
            RESULTS["bench"].append(row0)
            del kc, vc
            line = [f"ctx={ctx:6d} batch={batch:2d}  sdpa {sdpa_us:8.1f}us {row0['GBps']:5.0f}GB/s"]
            for name in names:
                fmt = parse_format(name)
                B = 128 if fmt.residual_tokens else 16
                cache, bt, lay = fill_cache(ops, fmt, K, V, batch, ctx, B, H, D, dev, ctx + batch)
                R = fmt.residual_chunk
                c = dict(q=q, cache=cache, bt=bt, sl=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
                         qsl=torch.arange(batch + 1, dtype=torch.int32, device=dev),
                         sk=torch.zeros(0, H, D, device=dev, dtype=torch.bfloat16),
                         sv=torch.zeros(0, H, D, device=dev, dtype=torch.bfloat16),
                         ssl=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
                         sp0=torch.full((batch,), ctx, dtype=torch.int32, device=dev), R=R, scale=D ** -0.5)
                ones = torch.ones(H, device=dev)
                out = torch.empty_like(q)
                us = time_cuda(lambda: ops.attn(out, c, fmt, ones, ones))
                nbytes = N * H * lay.token_bytes
                row = dict(name=name, batch=batch, ctx=ctx, us=us, GBps=nbytes / us / 1e3,
                           pct_copy=100 * nbytes / us / 1e3 / bw, speedup_vs_sdpa=sdpa_us / us,
                           bytes_per_token_head=lay.token_bytes)
                RESULTS["bench"].append(row)
                line.append(f"{name} {us:8.1f}us {row['GBps']:5.0f}GB/s x{row['speedup_vs_sdpa']:.2f}")
                del cache
            log(" | ".join(line))
            del K, V
            save()


def bench_prefill(ops, dev):
    import torch
    import torch.nn.functional as F
    from vllm_kvq.formats import parse_format
    D, Hq, H, L = 128, 32, 8, 4096 if not EMULATE else 64
    fmt = parse_format("int4_group32")
    K = torch.randn(L, H, D, device=dev, dtype=torch.bfloat16)
    V = torch.randn(L, H, D, device=dev, dtype=torch.bfloat16)
    cache, bt, lay = fill_cache(ops, fmt, K, V, 1, L, 16, H, D, dev, 1)
    q = torch.randn(L, Hq, D, device=dev, dtype=torch.bfloat16)
    c = dict(q=q, cache=cache, bt=bt, sl=torch.tensor([L], dtype=torch.int32, device=dev),
             qsl=torch.tensor([0, L], dtype=torch.int32, device=dev),
             sk=torch.zeros(0, H, D, device=dev, dtype=torch.bfloat16), sv=torch.zeros(0, H, D, device=dev, dtype=torch.bfloat16),
             ssl=torch.zeros(2, dtype=torch.int32, device=dev), sp0=torch.tensor([L], dtype=torch.int32, device=dev),
             R=1, scale=D ** -0.5)
    ones = torch.ones(H, device=dev)
    out = torch.empty_like(q)
    us = time_cuda(lambda: ops.attn(out, c, fmt, ones, ones), warmup=1, iters=3, graph=False)
    qs = q.view(L, Hq, D).transpose(0, 1).unsqueeze(0)
    kc = K.transpose(0, 1).unsqueeze(0).repeat_interleave(Hq // H, 1)
    vc = V.transpose(0, 1).unsqueeze(0).repeat_interleave(Hq // H, 1)
    sd = time_cuda(lambda: F.scaled_dot_product_attention(qs, kc, vc, is_causal=True), warmup=1, iters=3,
                   graph=False)
    RESULTS["prefill"].append(dict(name="int4_group32", tokens=L, ms=us / 1e3, sdpa_ms=sd / 1e3))
    log(f"prefill {L} tokens int4_group32 (generic kernel): {us / 1e3:.2f} ms; SDPA causal bf16 {sd / 1e3:.2f} ms")


# --- main ------------------------------------------------------------------------------------
def main() -> int:
    global OUT_DIR, EMULATE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="results folder (default $OUT)")
    ap.add_argument("--archs", default="90", help="SM targets to build (default 90)")
    ap.add_argument("--skip-build", action="store_true", help="use the already built vllm_kvq._C")
    ap.add_argument("--build-timeout", type=int, default=420)
    ap.add_argument("--budget-s", type=float, default=480, help="stop benchmarking after this many seconds")
    ap.add_argument("--max-tokens", type=int, default=1 << 21, help="largest batch*ctx benchmarked")
    ap.add_argument("--bench-formats", default="bf16,fp8_e4m3,int8_token,int4_group32,kivi2")
    ap.add_argument("--quick", action="store_true", help="fewer correctness cases, no benchmark")
    ap.add_argument("--only", default="", help="comma list of steps to run: write,attention,consistency,bench,prefill")
    ap.add_argument("--emulate", action="store_true",
                    help="dry run of the GPU steps on the CPU through the kernel emulator (tiny sizes)")
    args = ap.parse_args()
    OUT_DIR = args.out
    EMULATE = args.emulate

    import torch
    RESULTS["env"] = dict(torch=torch.__version__, torch_cuda=torch.version.cuda, python=sys.version.split()[0],
                          cuda_available=torch.cuda.is_available())
    try:
        RESULTS["env"]["nvcc"] = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    except Exception:  # noqa: BLE001
        RESULTS["env"]["nvcc"] = "not found"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        RESULTS["env"].update(gpu=p.name, sms=p.multi_processor_count, mem_GiB=round(p.total_memory / 2**30, 1),
                              cc=f"{p.major}.{p.minor}")
    log("env: " + ", ".join(f"{k}={v}" for k, v in RESULTS["env"].items()))

    # 1. CPU-side prep that needs no GPU
    from vllm_kvq.formats import EXAMPLE_NAMES, parse_format
    write_names = list(EXAMPLE_NAMES) + ["int3_token", "int2_token", "fp8_e5m2_token", "int4_tensor_sym",
                                         "int8_head_sym", "fp8_e4m3_head", "int4_group16_sym", "int8_channel16_r16",
                                         "kivi2_sink", "int3_token_sink", "nuq2_o0", "nuq3_o0",
                                         "nuq4_group32_o0", "nuq2_o0_sink", "nuq3", "int4_token_o1",
                                         "nuq2_sink"]
    attn_plan = [(n, 128, 32, 8, "decode", torch.bfloat16) for n in write_names]
    attn_plan += [(n, 128, 32, 8, "mixed", torch.float16) for n in write_names]
    for n in ("bf16", "fp8_e4m3", "int8_token", "int4_group32", "kivi2", "int3_token"):
        attn_plan += [(n, 64, 16, 2, "decode", torch.bfloat16), (n, 256, 16, 2, "mixed", torch.bfloat16)]
    attn_plan += [("int4_group32", 128, 64, 8, "mixed", torch.bfloat16), ("int8_token", 96, 12, 3, "mixed", torch.float16)]
    if args.quick:
        attn_plan = [a for a in attn_plan if a[0] in ("bf16", "int4_group32", "kivi2", "fp8_e4m3")]
    try:
        layouts = {n: parse_format(n).layout(128, 128).token_bytes for n in write_names}
        log("layouts (bytes per token per kv head, D=128): " + ", ".join(f"{k}={v}" for k, v in layouts.items()))
        t = time.time()
        make_attention_case(parse_format("int4_group32_r128"), 64, 8, 2, 128, [1, 3], [200, 5], torch.float16, 0)
        log(f"reference sanity case ok ({time.time() - t:.1f}s)")
    except Exception as e:  # noqa: BLE001
        log(f"CPU-side prep needs the built package (vllm_kvq._C): {e!r}")
    save()
    if not torch.cuda.is_available() and not EMULATE:
        log("STOP: no CUDA device visible (torch.cuda.is_available() is False). The CPU-side checks "
            "above are all this machine can do; run this script on a GPU host (it builds the "
            "extension itself).")
        RESULTS["failures"].append("no GPU")
        save()
        return 2

    # 2. build
    ops = None
    if EMULATE:
        ops = EmuOps()
    elif args.skip_build:
        import vllm_kvq._C  # noqa: F401
        ops = Ops()
    else:
        ops = build(args)
    save()
    if ops is None:
        return 1
    dev = torch.device("cpu" if EMULATE else "cuda")
    steps = [("write", lambda: check_writes(ops, write_names, dev)),
             ("attention", lambda: check_attention(ops, attn_plan, dev))]
    if not args.quick:
        steps += [("consistency", lambda: check_consistency(ops, dev)),
                  ("bench", lambda: bench(ops, dev, args)),
                  ("prefill", lambda: bench_prefill(ops, dev))]
    if args.only:
        steps = [st for st in steps if st[0] in args.only.split(",")]
    for what, fn in steps:
        log(f"--- {what}")
        try:
            fn()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            fail(f"{what} raised: {traceback.format_exc()[-1500:]}")
        save()
    log(f"done: {len(RESULTS['failures'])} failures")
    print(markdown())
    return 0 if not RESULTS["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
