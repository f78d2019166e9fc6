"""The prefill path (vllm_kvq.prefill): pages dequantized once by
torch.ops.vllm_kvq.dequantize_pages, then vLLM's CPU attention op (with a residual window:
one request per run of R queries) or torch's CPU flash attention with the residual window's
masks, equals reference.paged_attention for every codec kind, R 1/16/32/128, chunked prefill
with context, GQA, D 64/128, fp32 and bf16 queries; mixed batches split between the paged
kernel (decodes, short chunks) and the flash path."""

import itertools

import pytest
import torch
from test_kernels import PATHS, simd

from vllm_kvq import ops, prefill
from vllm_kvq import reference as ref
from vllm_kvq.formats import parse_format
from vllm_kvq.reference import uniform_codebooks
from vllm_kvq.tools.paged_attention_case import attention_case

CODECS = ["bf16", "fp8_e4m3", "fp8_e4m3_token", "int8_token", "int4_group32", "int2_group32",
          "int8_head_sym", "kivi2", "kivi4", "nuq3", "int4_token_o1", "kivi2_rotv",
          "kivi2_sink", "int4_group32_sink"]
# (max abs error vs the reference) fp32: the flash kernel's fp32 rounding; bf16: the bf16
# output itself (|out| < 4, so one bf16 ulp is <= 2^-6) plus K/V rounded to bf16.
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def case_for(fmt, D, Hq, H, B, **kw):
    lv = uniform_codebooks(fmt)
    return attention_case(fmt, D, Hq, H, B, levels=(lv["k_levels"], lv["v_levels"]), **kw)


def run(fmt, D, Hq, H, qlens, ctx, dtype, seed=0, B=128, min_query=prefill.PREFILL_MIN_QUERY):
    case = case_for(fmt, D, Hq, H, B, qlens=qlens, ctx=ctx, dtype=dtype, seed=seed)
    lops = ops.LayerOps(fmt, H, D, torch.device("cpu"), k_scale=case["ks"], v_scale=case["vs"],
                        **uniform_codebooks(fmt))
    R = case["R"]
    split = prefill.plan(case["qsl"].tolist(), case["sl"].tolist(),
                         case["ssl"].tolist() if R > 1 else None,
                         case["sp0"].tolist() if R > 1 else None, min_query=min_query)
    staging = () if R == 1 else (case["sk"], case["sv"], case["ssl"], case["sp0"])
    case.update(lops=lops, staging=staging)
    out = torch.full_like(case["q"], float("nan"))
    lops.attend(case["q"], case["cache"], case["bt"], case["sl"], case["qsl"], case["scale"],
                out, *staging, split=split)
    return case, out, split


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", CODECS)
def test_prefill_equals_reference(name, dtype):
    """A fresh prompt and a chunk with context (starting mid residual chunk), GQA, after a
    decode and a short chunk that stay on the paged kernel."""
    fmt = parse_format(name)
    case, out, split = run(fmt, 64, 6, 2, qlens=[1, 9, 300, 200], ctx=[140, 33, 0, 261],
                           dtype=dtype)
    assert split.num_decodes == 2 and [p.s for p in split.prefills] == [2, 3]
    n = split.num_decode_tokens
    err = (out[n:].float() - case["expected"][n:]).abs().max().item()
    assert err <= TOL[dtype], f"{name} {dtype}: max abs error {err}"
    # the decode and the short chunk: the paged kernel's own result (its int8 Q.K for
    # decodes is not exact, so the kernel, not the reference, is the check here)
    kernel = torch.zeros_like(out)
    case["lops"].attend(case["q"], case["cache"], case["bt"], case["sl"], case["qsl"],
                        case["scale"], kernel, *case["staging"])
    torch.testing.assert_close(out[:n], kernel[:n], atol=1e-5, rtol=1e-5)


# (R, D, op): every window through vLLM's op, R = 16 (R % 32 != 0) falling back to torch's
# flash attention, and the flash path with and without a window (trimmed to keep the suite
# inside its time budget; the full 4 x 2 x 2 cross product passed at 0bc7351)
@pytest.mark.parametrize("R, D, op", [(1, 64, "vllm"), (32, 64, "vllm"), (128, 64, "vllm"),
                                      (32, 128, "vllm"), (16, 64, "vllm"), (1, 128, "sdpa"),
                                      (32, 64, "sdpa"), (128, 128, "sdpa")])
def test_residual_windows_and_head_sizes(R, D, op, monkeypatch):
    """int4_group32 with every residual window, the SmolLM2 GQA ratio, chunks whose edges
    fall on and off residual-chunk and tile edges; through vLLM's op (one request per run of
    R queries when R % 32 == 0; R = 16 stays on torch's flash attention) and with vLLM's op
    unavailable."""
    if op == "sdpa":
        monkeypatch.setattr(prefill, "_vllm_op", False)
    called = []
    real = prefill._attend_vllm_op
    monkeypatch.setattr(prefill, "_attend_vllm_op", lambda *a: called.append(1) or real(*a))
    fmt = parse_format("int4_group32").with_residual(R if R > 1 else 0)
    for qlens, ctx in (([385], [0]), ([256, 131], [128, 1001]), ([70], [127]), ([97], [31])):
        case, out, _ = run(fmt, D, 9, 3, qlens=qlens, ctx=ctx, dtype=torch.float32, seed=R + D)
        err = (out - case["expected"]).abs().max().item()
        assert err <= TOL[torch.float32], f"R={R} D={D} {op} {qlens}/{ctx}: {err}"
    assert bool(called) == (op == "vllm" and R != 16)


@pytest.mark.parametrize("op", ["vllm", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_formats_without_a_window_take_vllms_op(op, dtype, monkeypatch):
    """R == 1: vLLM's CPU attention op over the dequantized pages (one call for the step's
    prefills, also a chunk with context and decodes through it with min_query=1), or with
    vLLM's op unavailable (as under KVQ_PREFILL_OP=sdpa) torch's flash attention; both are
    the reference."""
    assert prefill.vllm_attention_op() is not None  # the CPU build of vLLM has the op
    if op == "sdpa":
        monkeypatch.setattr(prefill, "_vllm_op", False)
    called = []
    real = prefill._attend_vllm_op
    monkeypatch.setattr(prefill, "_attend_vllm_op", lambda *a: called.append(1) or real(*a))
    fmt = parse_format("int4_group32")
    for qlens, ctx, mq in (([300, 200], [0, 261], prefill.PREFILL_MIN_QUERY),
                           ([150, 1, 3], [0, 300, 129], 1)):
        case, out, _ = run(fmt, 64, 9, 3, qlens=qlens, ctx=ctx, dtype=dtype, min_query=mq)
        err = (out.float() - case["expected"]).abs().max().item()
        assert err <= TOL[dtype], f"{op} {dtype} {qlens}/{ctx}: {err}"
    assert bool(called) == (op == "vllm")


def test_every_sequence_on_the_flash_path():
    """min_query=1: decodes (query_len 1) through the flash path too (an unordered batch
    puts them after a prefill); still the reference."""
    fmt = parse_format("kivi2")
    case, out, split = run(fmt, 64, 4, 4, qlens=[150, 1, 3], ctx=[0, 300, 129],
                           dtype=torch.float32, min_query=1)
    assert split.num_decodes == 0
    assert (out - case["expected"]).abs().max().item() <= TOL[torch.float32]


def test_plan_splits_at_the_first_long_sequence():
    sp = prefill.plan([0, 1, 2, 70, 71], [10, 20, 70, 30], min_query=64)
    assert (sp.num_decodes, sp.num_decode_tokens) == (2, 2)
    assert [(p.s, p.q0, p.q1, p.L) for p in sp.prefills] == [(2, 2, 70, 70), (3, 70, 71, 30)]
    assert prefill.plan([0, 1, 5], [10, 20], min_query=64) is None


@pytest.mark.parametrize("name", CODECS)
def test_dequantize_pages_equals_reference_decode(name):
    """The op's values (the kernel's own tile decode) are the reference's decoded values,
    rounded once to the dtype, on every SIMD path the CPU has."""
    fmt = parse_format(name)
    D, H, B = 64, 2, 128
    case = case_for(fmt, D, 4, H, B, qlens=[1], ctx=[299], dtype=torch.float32, seed=4)
    lv = uniform_codebooks(fmt)
    lops = ops.LayerOps(fmt, H, D, torch.device("cpu"), k_scale=case["ks"], v_scale=case["vs"],
                        **lv)
    L = 300 // case["R"] * case["R"]
    lay, row = case["lay"], case["bt"][0]
    kr = case["ks"] if fmt.key.static_scale else None
    vr = case["vs"] if fmt.value.static_scale else None
    blocks = [[ref.read_block(case["cache"], int(row[j]), h, fmt, lay, kr, vr, **lv)
               for h in range(H)] for j in range((L + B - 1) // B)]
    want = [torch.cat([torch.stack([blk[h][i] for h in range(H)]) for blk in blocks], 1)[:, :L]
            for i in (0, 1)]
    if fmt.sink:  # position 0 from the first block's int8 sink rows
        for h in range(H):
            sk, sv = ref.read_sink(case["cache"], int(row[0]), h, lay)
            want[0][h, 0], want[1][h, 0] = sk[0], sv[0]
    for path, dt in itertools.product(PATHS, (torch.float32, torch.bfloat16, torch.float16)):
        k = torch.zeros(H, L + 5, D, dtype=dt)
        v = torch.zeros(H, L + 5, D, dtype=dt)
        with simd(path):
            torch.ops.vllm_kvq.dequantize_pages(case["cache"], row, L, lops.k_codec,
                                                lops.v_codec, lops.k_scale, lops.v_scale,
                                                lops.k_levels, lops.v_levels, k, v)
        assert torch.equal(k[:, :L], want[0].to(dt)), (path, dt)
        assert torch.equal(v[:, :L], want[1].to(dt)), (path, dt)
        assert not k[:, L:].any()


def test_dequantize_pages_checks_block_ids():
    fmt = parse_format("int8_token")
    lops = ops.LayerOps(fmt, 2, 64, torch.device("cpu"))
    cache = torch.zeros(2, 2, 16, fmt.layout(64, 16).token_bytes, dtype=torch.uint8)
    k = torch.zeros(2, 40, 64)
    with pytest.raises(RuntimeError, match="outside the cache's 2 blocks"):
        torch.ops.vllm_kvq.dequantize_pages(cache, torch.tensor([0, 1, 5], dtype=torch.int32),
                                            40, lops.k_codec, lops.v_codec, lops.k_scale,
                                            lops.v_scale, lops.k_levels, lops.v_levels, k, k)
