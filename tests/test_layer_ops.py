"""The serving path's per-layer kernels (ops.LayerOps) are the checked ops, bound once:
the same bytes written, the same outputs, the same up-front errors (at bind time)."""
import pytest
import torch

from vllm_kvq import ops
from vllm_kvq.formats import parse_format
from vllm_kvq.reference import uniform_codebooks
from vllm_kvq.tools.paged_attention_case import attention_case

FORMATS = ["bf16", "fp8_e4m3_token", "int8_token", "int4_group32", "int8_head_sym",
           "kivi2", "int4_token_o1"]


@pytest.mark.parametrize("name", FORMATS)
def test_bound_ops_equal_checked_ops(name):
    fmt = parse_format(name)
    D, Hq, H, B = 64, 6, 2, 128
    case = attention_case(fmt, D, Hq, H, B, qlens=[1, 40, 1], ctx=[300, 0, 150],
                          dtype=torch.float32, seed=3)
    kw = dict(k_scale=case["ks"], v_scale=case["vs"], **uniform_codebooks(fmt))
    bound = ops.LayerOps(fmt, H, D, torch.device("cpu"), **kw)
    staging = {} if case["R"] == 1 else dict(
        staging_k=case["sk"], staging_v=case["sv"], staging_start_loc=case["ssl"],
        staging_pos0=case["sp0"])
    want = ops.paged_attention(case["q"], case["cache"], case["bt"], case["sl"], case["qsl"],
                               fmt, case["scale"], **kw, **staging)
    got = bound.attend(case["q"], case["cache"], case["bt"], case["sl"], case["qsl"],
                       case["scale"], torch.zeros_like(case["q"]), *staging.values())
    assert torch.equal(got, want)

    g = torch.Generator().manual_seed(5)
    n = 2 * fmt.residual_chunk if fmt.residual_chunk > 1 else 37
    n = max(n, 64) if fmt.key.granularity == "channel" else n
    k, v = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
    slots = torch.arange(B * 2, B * 2 + n, dtype=torch.int64)
    c1, c2 = case["cache"].clone(), case["cache"].clone()
    ops.write_cache(k, v, c1, slots, fmt, **kw)
    bound.write(k, v, c2, slots)
    assert torch.equal(c1, c2)


def test_bound_ops_with_codebooks():
    """nuq: the bound codebooks are the ones the checked ops take per call."""
    fmt = parse_format("nuq3")
    H, D, B, n = 2, 64, 128, 256
    kw = uniform_codebooks(fmt)
    bound = ops.LayerOps(fmt, H, D, torch.device("cpu"), **kw)
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
    cache = torch.zeros(3, H, B, fmt.layout(D, B).token_bytes, dtype=torch.uint8)
    c2 = cache.clone()
    R = fmt.residual_chunk
    slots = torch.arange(B, B + n // R * R, dtype=torch.int64)
    ops.write_cache(k[:len(slots)], v[:len(slots)], cache, slots, fmt, **kw)
    bound.write(k[:len(slots)], v[:len(slots)], c2, slots)
    assert torch.equal(cache, c2)
    q = torch.randn(1, 6, D, generator=g)
    args = (q, cache, torch.tensor([[1, 2]], dtype=torch.int32),
            torch.tensor([n], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    st = (k[len(slots) - (n % R):], v[len(slots) - (n % R):],
          torch.tensor([0, n % R], dtype=torch.int32),
          torch.tensor([len(slots)], dtype=torch.int32))
    want = ops.paged_attention(*args, fmt, 0.125, staging_k=st[0], staging_v=st[1],
                               staging_start_loc=st[2], staging_pos0=st[3], **kw)
    got = bound.attend(*args, 0.125, torch.zeros_like(q), *st)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["kivi2_sink_rot", "int4_group32_r64_rotv"])
def test_a_window_kept_rotated_reads_and_writes_as_before(name):
    """The backend rotates a rotated format's new rows once (rotate_rows) and keeps its window
    rotated: attention over those staging rows and chunks quantized from them are what the
    unrotated rows give (bit for bit in fp32, where rotating is the same op either way)."""
    fmt = parse_format(name)
    D, Hq, H, B = 64, 6, 2, 128
    case = attention_case(fmt, D, Hq, H, B, qlens=[1, 40, 1], ctx=[300, 0, 150],
                          dtype=torch.float32, seed=4)
    bound = ops.LayerOps(fmt, H, D, torch.device("cpu"))
    st = (case["ssl"], case["sp0"])
    args = (case["q"], case["cache"], case["bt"], case["sl"], case["qsl"], case["scale"])
    want = bound.attend(*args, torch.zeros_like(case["q"]), case["sk"], case["sv"], *st)
    sk, sv = bound.rotate_rows(case["sk"], case["sv"])
    assert not torch.equal(sv, case["sv"])
    got = bound.attend(*args, torch.zeros_like(case["q"]), sk, sv, *st, staging_rotated=True)
    assert torch.equal(got, want)

    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(64, H, D, generator=g), torch.randn(64, H, D, generator=g)
    slots = torch.arange(B * 2, B * 2 + 64, dtype=torch.int64)
    c1, c2 = case["cache"].clone(), case["cache"].clone()
    bound.write(k, v, c1, slots)
    bound.write(*bound.rotate_rows(k, v), c2, slots, rotated=True)
    assert torch.equal(c1, c2) and not torch.equal(c1, case["cache"])


def test_bind_time_errors_name_the_problem():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="head_dim=48 is not allowed"):
        ops.LayerOps(parse_format("int4_group32"), 2, 48, cpu)
    with pytest.raises(ValueError, match="k_levels is required for the nuq codec"):
        ops.LayerOps(parse_format("nuq3"), 2, 64, cpu)
    with pytest.raises(ValueError, match="k_scale is required"):
        ops.LayerOps(parse_format("int8_head_sym"), 2, 64, cpu)


def test_bound_ops_still_guarded_by_the_extension():
    """No Python checks per call; the C++ checks still refuse what does not fit."""
    fmt = parse_format("kivi2")
    bound = ops.LayerOps(fmt, 2, 64, torch.device("cpu"))
    lay = fmt.layout(64, 128)
    cache = torch.zeros(2, 2, 128, lay.token_bytes, dtype=torch.uint8)
    k = torch.randn(5, 2, 64)
    with pytest.raises(RuntimeError, match="whole aligned groups of 32"):
        bound.write(k, k, cache, torch.arange(5, dtype=torch.int64))
