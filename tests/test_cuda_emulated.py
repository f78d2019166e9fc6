"""The CUDA kernels, run on the CPU through the emulator (csrc/cuda/kvq_cuda_emu.h), against
the PyTorch reference: byte-identical cache planes from write_cache, and paged_attention
within the tolerances of fp16/bf16 tensor-core math.

The same kernel source, dispatch and argument checks as the real CUDA build; only the
thread scheduling, the warp collectives and the PTX instructions (mma.sync, f16x2 math,
prmt) are emulated. It checks indexing, fragment layouts, the split-KV merge and the
residual staging rules on machines without a GPU; speed and real-hardware behaviour are
for scripts/gpu_check.py on a GPU host.

Builds csrc/cuda/emu/emu_ops.cpp once (about 15 s; cached in $KVQ_CACHE or
~/.cache/vllm-kvq). KVQ_SKIP_CUDA_EMU=1 skips this module.

By default each test runs the cases that exercise distinct code paths: every codec kind
(f16, bf16, e4m3, e5m2, int2/3/4/8) and scale granularity (tensor, head, token, group,
channel; symmetric and not) once, GQA 4 and 16, head sizes 64/80/128/256, the residual
window, one mixed batch, both partitioning extremes; nuq codebooks and the attention sink
on the decode and generic paths (about 1.5 minutes on 2 cores, build cached). The full grid (every format x head size; about 4-8 minutes):

    KVQ_FULL_GRID=1 python -m pytest -q tests/test_cuda_emulated.py
"""
import itertools
import os

import pytest
import torch

from vllm_kvq import reference as ref
from vllm_kvq.formats import EXAMPLE_NAMES, parse_format
from vllm_kvq.tools.paged_attention_case import attention_case, static_scales, nonuniform_codebooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(os.environ.get("KVQ_SKIP_CUDA_EMU") == "1", reason="KVQ_SKIP_CUDA_EMU=1")

EXTRA = ["int3_token", "int2_token", "fp8_e5m2_token", "int4_tensor_sym", "int8_head_sym",
         "fp8_e4m3_head", "int4_group16_sym", "int8_channel16_r16", "int4_channel16_sym_r32"]
NAMES = list(EXAMPLE_NAMES) + EXTRA
FULL_GRID = os.environ.get("KVQ_FULL_GRID") == "1"


def cases(full, reduced):
    """The full grid with KVQ_FULL_GRID=1, else `reduced` (which must be part of it)."""
    full = list(full)
    assert all(c in full for c in reduced), [c for c in reduced if c not in full]
    return full if FULL_GRID else list(reduced)


# One format per codec kind and scale granularity (tensor/head static, token, group,
# channel; symmetric and asymmetric; int2/3/4/8, e4m3/e5m2, f16/bf16).
KINDS = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2_token", "fp8_e4m3_head", "int8_token",
         "int4_group32", "int3_token", "int2_group32", "int4_tensor_sym", "int8_head_sym",
         "int4_group16_sym", "kivi2", "int4_channel16_sym_r32"]


EMU_CFLAGS = ["-O2", "-ffp-contract=off", "-fno-math-errno", "-Wno-unknown-pragmas"]


@pytest.fixture(scope="module")
def emu():
    """The emulator build (~15 s on 2 cores), kept per content of csrc/ and the flags: a
    fresh clone's new file times would make ninja rebuild an unchanged one. Its ops are
    torch.ops.kvq_cuda_emu.*."""
    import hashlib

    from torch.utils import cpp_extension
    h = hashlib.sha256(repr((EMU_CFLAGS, torch.__version__)).encode())
    for d, _, files in sorted(os.walk(os.path.join(ROOT, "csrc"))):
        for f in sorted(files):
            h.update(f.encode())
            with open(os.path.join(d, f), "rb") as fh:
                h.update(fh.read())
    build = os.path.join(os.environ.get("KVQ_CACHE", os.path.expanduser("~/.cache/vllm-kvq")),
                         "cuda_emu_build", h.hexdigest()[:16])
    built = os.path.join(build, "kvq_cuda_emu.so")
    if os.path.exists(built):
        torch.ops.load_library(built)
    else:
        os.makedirs(build, exist_ok=True)
        cpp_extension.load(
            name="kvq_cuda_emu", sources=[os.path.join(ROOT, "csrc/cuda/emu/emu_ops.cpp")],
            extra_cflags=EMU_CFLAGS, extra_include_paths=[os.path.join(ROOT, "csrc")],
            build_directory=build, is_python_module=False)
    return torch.ops.kvq_cuda_emu


def _block(fmt):
    return 128 if fmt.residual_tokens > 32 else 32


@pytest.mark.parametrize("name,D", cases(
    itertools.product(NAMES, [64, 128, 80]),
    [(n, 128) for n in KINDS] + [("int4_group32", 64), ("kivi2", 64), ("int8_token", 80),
                                 ("int4_group16_sym", 80)]))
def test_write_cache_byte_identical(emu, name, D):
    fmt = parse_format(name)
    B = _block(fmt)
    try:
        lay = fmt.layout(D, B)
    except ValueError as e:
        pytest.skip(str(e))
    g = torch.Generator().manual_seed(D)
    H, nb = 3, 7
    G = max([c.group for c in (fmt.key, fmt.value) if c.granularity == "channel"] or [1])
    if G > 1:
        slots = torch.cat([torch.full((2,), -1), torch.arange(G) + 2 * B, torch.arange(2 * G) + 4 * B])
    else:
        slots = torch.randperm(nb * B, generator=g)[:41]
        slots[[3, 17]] = -1
    N = slots.numel()
    for dt in (torch.bfloat16, torch.float32, torch.float16):
        k = torch.randn(N, H, D, generator=g) * 2.0
        v = torch.randn(N, H, D, generator=g) + 0.3
        k[4, 0, :5] *= 50.0
        if not (fmt.key.is_float or fmt.value.is_float):
            # non-finite policy. (Float baselines: kvq::float_to_bf16 writes NaN as 0x7FC0,
            # torch 2.13 as 0xFFFF; CPU and CUDA kernels share the former.)
            k[5, 1, 3] = float("nan")
            v[6, 2, 9] = float("inf")
            k[7, 0, 1] = -float("inf")
        k, v = k.to(dt), v.to(dt)
        ks, vs = static_scales(fmt, H, D)
        want = torch.zeros(nb, H, B, lay.token_bytes, dtype=torch.uint8)
        ref.write_cache(k, v, want, slots, fmt, lay, ks if fmt.key.static_scale else None,
                        vs if fmt.value.static_scale else None)
        for sdt in (torch.int64, torch.int32):
            got = torch.zeros_like(want)
            flag = emu.write_cache(k, v, got, slots.to(sdt), fmt.key.as_ints(), fmt.value.as_ints(), ks, vs)
            assert flag == 0
            assert torch.equal(got, want), f"{dt} {sdt}: {(got != want).sum().item()} bytes differ"


def test_write_cache_flags_broken_channel_groups(emu):
    fmt = parse_format("kivi2")
    lay = fmt.layout(128, 128)
    k = torch.randn(40, 2, 128)
    for slots in (torch.arange(32) + 5,                             # not aligned
                  torch.cat([torch.arange(16), torch.arange(16) + 64]),  # not consecutive
                  torch.arange(16)):                                 # incomplete group
        cache = torch.zeros(3, 2, 128, lay.token_bytes, dtype=torch.uint8)
        assert emu.write_cache(k[:slots.numel()], k[:slots.numel()], cache, slots, fmt.key.as_ints(),
                               fmt.value.as_ints(), torch.ones(1), torch.ones(1)) == 1
        # a broken group is never partially written (values are per-group too, so V rows of
        # the same entries may be; the key region stays untouched)
        assert not cache.view(3, 2, -1)[:, :, lay.k["data_off"]:lay.k["end"]].any()


def _case(fmt, D, Hq, H, B, qlens, ctx, dtype, seed):
    c = attention_case(fmt, D, Hq, H, B, qlens, ctx, dtype, seed, spare_blocks=2)
    return c, c["expected"]


def _run(emu, fmt, c, force_generic=False, part_tokens=0, num_sms=132):
    out = torch.full_like(c["q"], float("nan"))
    emu.paged_attention(out, c["q"], c["cache"], c["bt"], c["sl"], c["qsl"], c["sk"], c["sv"],
                        c["ssl"], c["sp0"], c["R"], c["window"], c["scale"], c["soft_cap"],
                        fmt.key.as_ints(),
                        fmt.value.as_ints(), c["ks"], c["vs"], force_generic, part_tokens,
                        num_sms, kl=c.get("kl"), vl=c.get("vl"))
    return out.float()


def _tol(dtype, want):
    # outputs are rounded to the query dtype; bf16 keeps 8 bits
    return (2 ** -7 if dtype == torch.bfloat16 else 2 ** -9) * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("name", cases(NAMES, [
    "bf16", "fp16", "fp8_e4m3", "fp8_e5m2_token", "int8_token", "int4_group32", "int3_token",
    "int2_group32_r128", "kivi2", "int4_tensor_sym"]))
def test_decode_batch_tensor_core_kernel(emu, name):
    """Decode steps only: split-KV partitions (64 tokens), staging slot, GQA 4."""
    fmt = parse_format(name)
    D = 128
    assert emu.decode_supported(D, fmt.key.as_ints(), fmt.value.as_ints())
    args, want = _case(fmt, D, 8, 2, _block(fmt), [1, 1, 1, 1], [40, 300, 97, 0], torch.bfloat16, 1)
    got = _run(emu, fmt, args, part_tokens=64)
    assert (got - want).abs().max() <= _tol(torch.bfloat16, want)


@pytest.mark.parametrize("name,D", cases(
    itertools.product(["bf16", "fp8_e4m3", "int8_token", "int4_group32", "kivi2", "int3_token",
                       "int2_group32_r128", "int8_channel32_r128"], [64, 256]),
    # D=256: 16-bit and int8 kinds load V's codes after QK (registers), low-bit ones before
    [("bf16", 256), ("int8_token", 256), ("int4_group32", 256), ("kivi2", 64),
     ("fp8_e4m3", 64)]))
def test_decode_head_sizes(emu, name, D):
    fmt = parse_format(name)
    args, want = _case(fmt, D, 16, 1, _block(fmt), [1, 1, 1], [500, 33, 130], torch.bfloat16, 2)
    got = _run(emu, fmt, args, part_tokens=128)  # G = 16: two head tiles per kv head
    assert (got - want).abs().max() <= _tol(torch.bfloat16, want)


@pytest.mark.parametrize("name,num_sms", cases(
    itertools.product(["int4_group32", "kivi2", "bf16"], [1, 132]),
    [("kivi2", 1), ("bf16", 132)]))
def test_decode_auto_partitions_wide_block_table(emu, name, num_sms):
    """Partitioning from the batch shape, with a block_table much wider than the sequences
    (vLLM passes max_model_len / block_size columns); the extra entries are garbage."""
    fmt = parse_format(name)
    c, want = _case(fmt, 128, 8, 2, _block(fmt), [1, 1, 1], [1500, 40, 700], torch.bfloat16, 5)
    bt = c["bt"]
    wide = torch.cat([bt, torch.full((bt.shape[0], 3 * bt.shape[1]), 1 << 30, dtype=torch.int32)], 1)
    got = _run(emu, fmt, dict(c, bt=wide), num_sms=num_sms)
    assert (got - want).abs().max() <= _tol(torch.bfloat16, want)


@pytest.mark.parametrize("name,D,W", [("bf16", 256, 512), ("int4_group32", 256, 512),
                                      ("kivi2", 64, 160)])
def test_sliding_window(emu, name, D, W):
    """A sliding window (Gemma 3's shape: head_dim 256, one kv head, 4 query heads; and
    SmolLM2's): decodes far past the window and prefill chunks crossing it go through the
    generic kernel, which starts at the window and masks each row; blocks wholly before the
    window are another sequence's (vLLM's null block)."""
    fmt = parse_format(name)
    Hq, H = (4, 1) if D == 256 else (6, 2)
    c = attention_case(fmt, D, Hq, H, _block(fmt), [1, 24, 1], [899, 500, 129],
                       torch.bfloat16, 4, spare_blocks=2, window=W)
    assert (c["bt"][0, :2] == 0).all()
    got = _run(emu, fmt, c)
    assert (got - c["expected"]).abs().max() <= _tol(torch.bfloat16, c["expected"])


@pytest.mark.parametrize("name,D,cap", [("int4_group32", 128, 2.0), ("kivi2", 64, 5.0),
                                        ("bf16", 256, 5.0)])
def test_logit_soft_capping(emu, name, D, cap):
    """Gemma 2's logit soft-capping (x -> c tanh(x / c)) in the decode kernel (paged and
    staging rows) and the generic one (prefill chunks), with a cap small enough to bend
    most logits of these scaled-up queries."""
    fmt = parse_format(name)
    Hq, H = (4, 1) if D == 256 else (6, 2)
    c = attention_case(fmt, D, Hq, H, _block(fmt), [1, 24, 1], [300, 70, 129],
                       torch.bfloat16, 5, spare_blocks=2, soft_cap=cap, expected=False)
    c["q"] = (c["q"].float() * 4).to(torch.bfloat16)
    want = ref.paged_attention(c["q"], c["cache"], c["bt"], c["sl"], c["qsl"], fmt, c["lay"],
                               c["scale"], c["ks"] if fmt.key.static_scale else None,
                               c["vs"] if fmt.value.static_scale else None, c["sk"], c["sv"],
                               c["ssl"], c["sp0"], logits_soft_cap=cap).float()
    plain = ref.paged_attention(c["q"], c["cache"], c["bt"], c["sl"], c["qsl"], fmt, c["lay"],
                                c["scale"], None, None, c["sk"], c["sv"], c["ssl"],
                                c["sp0"]).float()
    assert (want - plain).abs().max() > 0.05  # the cap matters here
    got = _run(emu, fmt, c)
    assert (got - want).abs().max() <= _tol(torch.bfloat16, want)


@pytest.mark.parametrize("name", cases(NAMES, ["kivi2"]))
def test_mixed_batch(emu, name):
    """Prefill, chunked prefill and decodes in one batch (fp16): generic + decode kernels."""
    fmt = parse_format(name)
    args, want = _case(fmt, 128, 12, 3, _block(fmt), [1, 37, 5, 1], [260, 0, 70, 129], torch.float16, 3)
    got = _run(emu, fmt, args)
    assert (got - want).abs().max() <= _tol(torch.float16, want)


@pytest.mark.parametrize("name,D", cases(
    itertools.product(["bf16", "int8_token", "int4_group32", "kivi2", "fp8_e4m3_token"], [80, 128]),
    [("bf16", 80), ("fp8_e4m3_token", 80), ("int4_group32", 128), ("kivi2", 128)]))
def test_generic_kernel(emu, name, D):
    """The CUDA-core kernel alone (also the path for head sizes the decode kernel lacks)."""
    fmt = parse_format(name)
    try:
        fmt.layout(D, _block(fmt))
    except ValueError as e:
        pytest.skip(str(e))
    args, want = _case(fmt, D, 4, 2, _block(fmt), [1, 19, 1], [150, 40, 0], torch.bfloat16, 4)
    got = _run(emu, fmt, args, force_generic=True)
    assert (got - want).abs().max() <= _tol(torch.bfloat16, want)


SINK_FORMATS = ["kivi2_sink", "int4_group32_sink", "int3_token_sink"]


def _sink_tokens(D, H):
    """K/V of a sequence whose first token is an attention sink: a large key along every
    query (so it takes much of each row's weight) and a large value; 2-bit codes of that
    token differ visibly from its int8 sink row."""
    def tokens(s, L):
        g = torch.Generator().manual_seed(100 + s)
        k = torch.randn(L, H, D, generator=g) * 1.5
        v = torch.randn(L, H, D, generator=g)
        k[0] = torch.linspace(-6, 9, D) + torch.randn(H, D, generator=g)
        v[0] = torch.linspace(8, -5, D)
        return k, v
    return tokens


@pytest.mark.parametrize("name", SINK_FORMATS)
def test_write_cache_sink_rows_byte_identical(emu, name):
    """Tokens at a block's offset 0 also go to the sink rows (int8 codes + float32 scale,
    quantize_window_rows), with the non-finite rules: NaN wins the max, inf stores codes 0."""
    fmt = parse_format(name)
    D, H, B, nb = 64, 3, _block(fmt), 5
    lay = fmt.layout(D, B)
    G = max([c.group for c in (fmt.key, fmt.value) if c.granularity == "channel"] or [1])
    slots = torch.cat([torch.arange(G) + 2 * B, torch.arange(2 * G) + 4 * B,
                       torch.arange(G) + B + G])  # two first tokens, one not
    N = slots.numel()
    g = torch.Generator().manual_seed(9)
    for dt in (torch.bfloat16, torch.float32):
        k = torch.randn(N, H, D, generator=g) * 3
        v = torch.randn(N, H, D, generator=g)
        k[G, 1, 5] = float("nan")   # slot 4B: a sink row with a NaN (bf16: torch's 0xFFFF)
        v[0, 2, 7] = float("inf")   # slot 2B: an infinite value
        k[0, 0] = 0.0               # an all-zero row: scale 1
        k, v = k.to(dt), v.to(dt)
        want = torch.zeros(nb, H, B, lay.token_bytes, dtype=torch.uint8)
        ref.write_cache(k, v, want, slots, fmt, lay)
        got = torch.zeros_like(want)
        assert emu.write_cache(k, v, got, slots, fmt.key.as_ints(), fmt.value.as_ints(),
                               torch.ones(1), torch.ones(1)) == 0
        assert torch.equal(got, want), f"{dt}: {(got != want).sum().item()} bytes differ"
        sink = want.view(nb, H, -1)[:, :, lay.k["sink_off"]:]
        assert sink[2].any() and sink[4].any() and not sink[1].any()


@pytest.mark.parametrize("name", SINK_FORMATS)
@pytest.mark.parametrize("generic", [False, True], ids=["decode", "generic"])
def test_attention_reads_the_sink(emu, name, generic):
    """Position 0 from the first block's sink rows: decodes (split-KV partitions, the sink on
    the staging CTA, with and without a residual window), a prefill chunk and a fresh
    prompt (generic kernel), against the reference; the same data read without the sink
    would be off by more than the tolerance."""
    fmt = parse_format(name)
    D, Hq, H = 64, 6, 2
    c = attention_case(fmt, D, Hq, H, _block(fmt), [1, 24, 1, 1], [300, 70, 129, 0],
                       torch.bfloat16, 6, spare_blocks=2, tokens=_sink_tokens(D, H))
    plain = parse_format(name.replace("_sink", ""))  # the same pages read without the sink
    no_sink = ref.paged_attention(c["q"], c["cache"], c["bt"], c["sl"], c["qsl"], plain,
                                  c["lay"], c["scale"], None, None, c["sk"], c["sv"],
                                  c["ssl"], c["sp0"]).float()
    assert (no_sink - c["expected"]).abs().max() > 4 * _tol(torch.bfloat16, c["expected"])
    got = _run(emu, fmt, c, force_generic=generic, part_tokens=64)
    assert (got - c["expected"]).abs().max() <= _tol(torch.bfloat16, c["expected"])


# nuq codebooks: channel keys / token values with a window, group scales with none, 2/3/4
# bits, with the sink too; outlier slots (the nuq defaults have one per token and side; an
# INT format with two).
NUQ_FORMATS = ["nuq2_o0", "nuq3_o0", "nuq4_group32_o0", "nuq2_o0_sink"]
OUTLIER_FORMATS = ["nuq2", "nuq3_group32_o1", "int4_token_o2", "nuq2_sink"]


@pytest.mark.parametrize("name", NUQ_FORMATS + OUTLIER_FORMATS)
def test_write_cache_codebooks_and_outliers_byte_identical(emu, name):
    """nuq codes through the codebook, outlier slots (channel + fp16 correction, the values
    left out of the statistics), non-finite values: the reference's bytes."""
    fmt = parse_format(name)
    D, H, B, nb = 64, 3, _block(fmt), 7
    lay = fmt.layout(D, B)
    kl, vl = nonuniform_codebooks(fmt)
    G = max([c.group for c in (fmt.key, fmt.value) if c.granularity == "channel"] or [1])
    slots = (torch.cat([torch.arange(G) + 2 * B, torch.arange(2 * G) + 4 * B]) if G > 1 else
             torch.randperm(nb * B, generator=torch.Generator().manual_seed(1))[:41])
    N = slots.numel()
    g = torch.Generator().manual_seed(11)
    for dt in (torch.bfloat16, torch.float32):
        k = torch.randn(N, H, D, generator=g) * 2
        v = torch.randn(N, H, D, generator=g) + 0.3
        k[4, 0, :5] *= 30.0
        k[5, 1, 3] = float("nan")
        v[6, 2, 9] = float("inf")
        k, v = k.to(dt), v.to(dt)
        want = torch.zeros(nb, H, B, lay.token_bytes, dtype=torch.uint8)
        ref.write_cache(k, v, want, slots, fmt, lay, k_levels=kl, v_levels=vl)
        got = torch.zeros_like(want)
        assert emu.write_cache(k, v, got, slots, fmt.key.as_ints(), fmt.value.as_ints(),
                               torch.ones(1), torch.ones(1), kl=kl, vl=vl) == 0
        assert torch.equal(got, want), f"{dt}: {(got != want).sum().item()} bytes differ"


@pytest.mark.parametrize("name", NUQ_FORMATS + OUTLIER_FORMATS)
@pytest.mark.parametrize("generic", [False, True], ids=["decode", "generic"])
def test_attention_codebooks_and_outliers(emu, name, generic):
    """nuq pages through the tensor-core decode kernel (codebook as an fp16 table in shared
    memory) and the generic kernel, outlier slots through the generic kernel (decodes too),
    against the reference; read with the uniform grid, or without the outlier corrections,
    the same pages would be off by more than the tolerance."""
    fmt = parse_format(name)
    D, Hq, H = 64, 6, 2
    kl, vl = nonuniform_codebooks(fmt)
    tokens = _sink_tokens(D, H) if fmt.sink else None
    c = attention_case(fmt, D, Hq, H, _block(fmt), [1, 24, 1, 1], [300, 70, 129, 0],
                       torch.bfloat16, 7, spare_blocks=2, levels=(kl, vl), tokens=tokens)
    if fmt.key.outliers:  # the same pages read with every outlier slot empty
        bare = c["cache"].clone()
        planes = bare.view(bare.shape[0], H, -1)
        for r in (c["lay"].k, c["lay"].v):
            planes[:, :, r["outlier_off"]:r["outlier_off"] + r["outlier_bytes"]] = 255
        other = ref.paged_attention(c["q"], bare, c["bt"], c["sl"], c["qsl"], fmt, c["lay"],
                                    c["scale"], None, None, c["sk"], c["sv"], c["ssl"],
                                    c["sp0"], kl, vl).float()
        assert (other - c["expected"]).abs().max() > 4 * _tol(torch.bfloat16, c["expected"])
    if fmt.needs_levels:  # the same pages read with the uniform grid
        uniform = (ref.uniform_levels(fmt.key.bits), ref.uniform_levels(fmt.value.bits))
        other = ref.paged_attention(c["q"], c["cache"], c["bt"], c["sl"], c["qsl"], fmt,
                                    c["lay"], c["scale"], None, None, c["sk"], c["sv"],
                                    c["ssl"], c["sp0"], *uniform).float()
        assert (other - c["expected"]).abs().max() > 4 * _tol(torch.bfloat16, c["expected"])
    if not generic and not fmt.key.outliers:
        assert emu.decode_supported(D, fmt.key.as_ints(), fmt.value.as_ints())
    got = _run(emu, fmt, c, force_generic=generic, part_tokens=64)
    assert (got - c["expected"]).abs().max() <= _tol(torch.bfloat16, c["expected"])


def test_nuq_needs_its_codebook(emu):
    fmt = parse_format("nuq2_o0")
    lay = fmt.layout(64, 32)
    x = torch.randn(32, 2, 64)
    cache = torch.zeros(2, 2, 32, lay.token_bytes, dtype=torch.uint8)
    one = torch.ones(1)
    with pytest.raises(RuntimeError, match=r"nuq codec needs its codebook of 2\^bits = 4 float32"):
        emu.write_cache(x, x, cache, torch.arange(32), fmt.key.as_ints(), fmt.value.as_ints(),
                        one, one)
    with pytest.raises(RuntimeError, match=r"k_levels must be a contiguous float32"):
        emu.write_cache(x, x, cache, torch.arange(32), fmt.key.as_ints(), fmt.value.as_ints(),
                        one, one, kl=torch.zeros(4, dtype=torch.float64), vl=torch.zeros(4))


def test_too_many_outlier_slots_are_refused(emu):
    fmt = parse_format("int4_token_o9")
    x = torch.randn(4, 2, 64)
    cache = torch.zeros(2, 2, 32, fmt.layout(64, 32).token_bytes, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="at most 8 outlier slots per token, got 9"):
        emu.write_cache(x, x, cache, torch.arange(4), fmt.key.as_ints(), fmt.value.as_ints(),
                        torch.ones(1), torch.ones(1))
