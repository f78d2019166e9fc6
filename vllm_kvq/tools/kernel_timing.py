"""Decode attention timed alone on the CPU: a format through our kernel, and vLLM's bf16 CPU
attention op (`torch.ops._C.cpu_attention_with_kv_cache`) on the same queries, K/V and
block tables. Every sequence decodes one token at position ctx-1 of a paged cache (block
size 128, shuffled block tables, distinct blocks per sequence); only BASE_TOKENS tokens are
quantized, their pages repeated over the rest of the cache (distinct memory, real data).

One definition of each case, used by the compare tool and by benchmarks/
bench_cpu_attention.py / bench_prefill.py (which print wider tables)."""
from __future__ import annotations

import time

import torch

from vllm_kvq import hugepages, ops
from vllm_kvq.formats import parse_format
from vllm_kvq.reference import uniform_codebooks

BLOCK = 128
BASE_TOKENS = 2048
# Both sides' caches on transparent huge pages (vllm_kvq.hugepages; what an engine served by
# vllm-kvq gets, and vLLM's own with THP `always` or KVQ_HUGE_PAGES=all); off: as allocated.
HUGE_PAGES = False


def cache_tensor(*shape, dtype, huge: bool | None = None) -> torch.Tensor:
    """A cache buffer for a case: zeroed, on huge pages where `huge` (default HUGE_PAGES)
    asks for them."""
    t = torch.zeros(*shape, dtype=dtype)
    if HUGE_PAGES if huge is None else huge:
        if hugepages.thp_mode() != "madvise" or hugepages.MODE == "0":
            raise RuntimeError(f"huge pages asked for but not available (transparent huge "
                               f"pages mode: {hugepages.thp_mode() or 'none'}, needs madvise; "
                               f"KVQ_HUGE_PAGES={hugepages.MODE}, needs 1 or all)")
        hugepages.advise_huge_pages([t])  # 0 bytes for a buffer without a whole 2 MiB page
    return t


def timeit(fn, min_time=0.4, min_reps=3, max_reps=2000) -> tuple[float, float]:
    """(wall ms, process CPU ms) per call, each the minimum over repeats (the least
    disturbed run on a shared machine). Calls of tens of microseconds repeat until
    min_time too: with at most 50 repeats their minimum still moved by 1.5x between runs."""
    fn()  # warm-up
    fn()
    times, cpu = [], []
    t_end = time.perf_counter() + min_time
    while len(times) < min_reps or (time.perf_counter() < t_end and len(times) < max_reps):
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return min(times) * 1e3, min(cpu) * 1e3


def block_tables(batch: int, ctx: int, gen):
    nblk = (ctx + BLOCK - 1) // BLOCK
    total = batch * nblk
    return torch.randperm(total, generator=gen).to(torch.int32).reshape(batch, nblk), total


def repeat_pages(cache, nbase: int) -> None:
    """Repeat the first nbase blocks over the whole cache."""
    for i in range(nbase, cache.shape[0], nbase):
        m = min(nbase, cache.shape[0] - i)
        cache[i:i + m].copy_(cache[:m])


def staging_inputs(fmt, batch, ctx, H, D, gen=None) -> dict:
    """The attend() staging arguments of `batch` sequences decoding at position ctx-1: with
    a residual window (R > 1) positions >= floor(ctx/R)*R come from random staging rows;
    none without one. A rotated format's rows count as rotated already, as the backend
    keeps its window (LayerOps.rotate_rows: each token rotated once, when it arrives)."""
    R = fmt.residual_chunk
    if R == 1:
        return {}
    p0 = ctx // R * R
    n_st = ctx - p0
    rows = batch * max(n_st, 1)
    return dict(staging_k=torch.randn(rows, H, D, generator=gen).to(torch.bfloat16),
                staging_v=torch.randn(rows, H, D, generator=gen).to(torch.bfloat16),
                staging_start_loc=torch.arange(batch + 1, dtype=torch.int32) * n_st,
                staging_pos0=torch.full((batch,), p0, dtype=torch.int32),
                staging_rotated=fmt.rotation != "none")


def decode_case(name: str, H, D, batch, ctx, gen, q, k, v):
    """(fmt, layout, run, out): format `name`'s paged cache filled from k/v, and `run()`
    decoding q at position ctx-1 into `out` (nuq: the uniform codebook; the speed of a
    codebook does not depend on its levels)."""
    fmt = parse_format(name)
    lay = fmt.layout(D, BLOCK)
    bt, total = block_tables(batch, ctx, gen)
    cache = cache_tensor(total, H, BLOCK, lay.token_bytes, dtype=torch.uint8)
    nbase = min(total, BASE_TOKENS // BLOCK)
    lv = uniform_codebooks(fmt)
    ops.write_cache(k[:nbase * BLOCK], v[:nbase * BLOCK], cache, torch.arange(nbase * BLOCK),
                    fmt, **lv)
    repeat_pages(cache, nbase)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    extra = staging_inputs(fmt, batch, ctx, H, D)
    out = torch.empty_like(q)
    # The serving path's call (the backend's LayerOps: the extension op, arguments resolved
    # once), as vLLM's op is called directly below; ops.paged_attention's Python checks
    # (~50 us a call on 2 cores) are not what a served step pays.
    layer = ops.LayerOps(fmt, H, D, q.device, **lv)

    def run():
        layer.attend(q, cache, bt, seq_lens, qsl, D ** -0.5, out, **extra)

    return fmt, lay, run, out


def time_ours(name: str, Hq, H, D, batch, ctx, gen, q, k, v) -> float:
    """ms per decode call of format `name`."""
    return timeit(decode_case(name, H, D, batch, ctx, gen, q, k, v)[2])[0]


VLLM_BUILD = "auto"  # the build of vLLM's CPU ops vllm_available() loaded


def vllm_available(build: str = "auto") -> bool:
    """Whether vLLM's CPU attention op loads. build "auto": the build vLLM picks for this CPU
    (_C / _C_AVX512 / _C_AVX2); "avx2": its AVX2 build, what an AVX2-only machine runs, to
    compare our AVX2 path with it like for like on an AVX-512 machine. One build a process
    (each registers the same ops)."""
    global VLLM_BUILD
    try:
        if build == "avx2":
            try:
                import vllm._C_AVX2  # noqa: F401
            except ImportError as e:
                # the library loads and registers its ops but defines no Python module
                # (vLLM's own import_kernels ignores this message too)
                if "module export function" not in str(e):
                    raise
        else:
            from vllm.platforms.cpu import CpuPlatform
            CpuPlatform.import_kernels()
        VLLM_BUILD = build
        return hasattr(torch.ops._C, "cpu_attention_with_kv_cache")
    except Exception as e:  # noqa: BLE001
        print(f"vLLM CPU attention unavailable: {e!r}")
        return False


def _amx_permitted() -> bool:
    """Linux gives a process AMX tile state only after arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA); without it vLLM's AMX kernel dies with SIGILL on some kernels/VMs."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM
    except Exception:  # noqa: BLE001
        return False


def vllm_isa() -> str:
    """The ISA vLLM's CPU attention uses here: AMX where the CPU and kernel allow it (not in
    its AVX2 build)."""
    if VLLM_BUILD == "avx2":
        return "vec"
    if torch.cpu._is_amx_tile_supported() and _amx_permitted():
        return "amx"
    return "vec"  # block size 128 is a multiple of 32


def vllm_decode_case(Hq, H, D, batch, ctx, gen, q, k, v):
    """(run, out, kv_bytes): vLLM's bf16 paged cache filled from k/v like decode_case's, and
    `run()` calling its CPU attention op for q at position ctx-1 into `out`."""
    isa = vllm_isa()
    bt, total = block_tables(batch, ctx, gen)
    kv = cache_tensor(total, H, BLOCK, 2 * D, dtype=torch.bfloat16)
    kc, vc = kv.view(total, H, 2 * BLOCK, D).chunk(2, dim=2)
    nbase = min(total, BASE_TOKENS // BLOCK)
    torch.ops._C.cpu_attn_reshape_and_cache(k[:nbase * BLOCK], v[:nbase * BLOCK], kc, vc,
                                            torch.arange(nbase * BLOCK), isa, 1.0, 1.0, "auto")
    repeat_pages(kv, nbase)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    meta = torch.ops._C.get_scheduler_metadata(batch, Hq, H, D, seq_lens, torch.bfloat16, qsl,
                                               True, -1, isa, True, None, "auto")
    out = torch.empty_like(q)

    def run():
        torch.ops._C.cpu_attention_with_kv_cache(q, kc, vc, out, qsl, seq_lens, D ** -0.5, True,
                                                 None, -1, bt, 0.0, meta, None, None, 1.0, 1.0,
                                                 "auto")

    return run, out, batch * H * ctx * 2 * D * 2


def time_vllm(Hq, H, D, batch, ctx, gen, q, k, v) -> float:
    """ms per decode call of vLLM's bf16 CPU attention op."""
    return timeit(vllm_decode_case(Hq, H, D, batch, ctx, gen, q, k, v)[0])[0]
