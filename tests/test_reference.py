"""The PyTorch reference (the oracle of every kernel): checked against torch's own attention,
and its quantization error measured, bounded and ordered."""
import pytest
import torch

from vllm_kvq import reference as ref
from vllm_kvq.formats import parse_format


def rel_rmse(a, b):
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def kv_like(T=256, D=128, seed=0):
    """Gaussian values plus a few large fixed channels, as keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    x[:, [3, 17, 90]] *= 12.0
    return x


def roundtrip(name, x, D=128, B=128):
    fmt = parse_format(name)
    lay = fmt.layout(D, B)
    T = x.shape[0]
    nblk = (T + B - 1) // B
    cache = ref.new_cache(nblk, 1, lay)
    ref.write_cache(x.view(T, 1, D), x.view(T, 1, D), cache, torch.arange(T), fmt, lay)
    kv = [ref.read_block(cache, b, 0, fmt, lay) for b in range(nblk)]
    return torch.cat([k for k, _ in kv])[:T], torch.cat([v for _, v in kv])[:T]


def scale_group(fmt, shape, t, d):
    """Mask of the values that share the scale of value (t, d)."""
    m = torch.zeros(shape, dtype=torch.bool)
    c = fmt.key
    if c.granularity == "channel":
        m[t // c.group * c.group:(t // c.group + 1) * c.group, d] = True
    elif c.granularity == "group":
        m[t, d // c.group * c.group:(d // c.group + 1) * c.group] = True
    elif c.granularity == "token":
        m[t] = True
    else:  # static scale: each value on its own
        m[t, d] = True
    return m


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_roundtrip(bits):
    codes = torch.randint(0, 2 ** bits, (5, 64), dtype=torch.int32)
    assert torch.equal(ref.unpack_rows(ref.pack_rows(codes, bits), bits, 64), codes)


def test_pack_order_is_little_endian_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]], dtype=torch.int32)
    assert ref.pack_rows(codes, 4).tolist() == [[0x21, 0x43, 0x65, 0x07]]


def test_int8_per_token_error_well_under_one_percent():
    x = torch.randn(128, 128)
    k, _ = roundtrip("int8_token", x)
    assert rel_rmse(k, x) < 0.0075  # 1/255 of a Gaussian row's range ~ 0.6%


@pytest.mark.parametrize("chain", [
    ("int8_group32", "int4_group32", "int3_group32", "int2_group32"),
    ("int4_group16", "int4_group32", "int4_group64", "int4_token"),
    ("int2_group16", "int2_group32", "int2_group64", "int2_token"),
    ("fp8_e4m3_token", "int4_token"),
])
def test_error_is_ordered(chain):
    x = kv_like()
    errs = [rel_rmse(roundtrip(n, x)[0], x) for n in chain]
    assert errs == sorted(errs), dict(zip(chain, errs))


def test_per_channel_keys_beat_per_token_on_channel_outliers():
    # KIVI's observation: key outliers sit in fixed channels
    x = kv_like()
    per_channel = rel_rmse(roundtrip("int2_channel32_r32", x)[0], x)
    per_token = rel_rmse(roundtrip("int2_token", x)[0], x)
    assert per_channel < 0.5 * per_token


@pytest.mark.parametrize("name", ["int8_token", "int4_group32", "int2_channel16_r16",
                                  "int4_group32_sym", "fp8_e4m3_token", "fp8_e5m2"])
def test_constant_groups_are_finite_and_asymmetric_ones_exact(name):
    x = torch.full((32, 128), 0.75)
    x[5:9] = -3.0
    x[16:32] = 0.0
    k, _ = roundtrip(name, x)
    assert torch.isfinite(k).all()
    assert torch.equal(k[16:], x[16:])  # an all-zero group decodes to exact zeros
    fmt = parse_format(name)
    if fmt.key.encoding == "int" and not fmt.key.symmetric:  # zero range: scale 0, zero = value
        assert torch.equal(k, x)
    else:
        assert (k - x).abs().max() < 0.08 * x.abs().max()


@pytest.mark.parametrize("name", ["int8_token", "int4_group32", "int2_channel16_r16",
                                  "fp8_e4m3_token", "fp8_e5m2", "int4_token_sym"])
def test_non_finite_values_stay_local(name):
    """Policy: NaN is stored as the level nearest 0, +-Inf as the group's extreme level;
    neither widens the group's range nor turns anything into NaN."""
    x = torch.randn(32, 128)
    clean, _ = roundtrip(name, x)
    bad = x.clone()
    bad[3, 7], bad[3, 40], bad[20, 100] = float("nan"), float("inf"), float("-inf")
    k, _ = roundtrip(name, bad)
    assert torch.isfinite(k).all()
    fmt = parse_format(name)
    bad_at = ((3, 7), (3, 40), (20, 100))
    groups = [scale_group(fmt, x.shape, t, d) for t, d in bad_at]
    touched = groups[0] | groups[1] | groups[2]
    assert torch.equal(k[~touched], clean[~touched])
    assert k[3, 40] == k[groups[1]].max() and k[20, 100] == k[groups[2]].min()
    assert k[3, 40] > 0 > k[20, 100]


@pytest.mark.parametrize("Hq,H", [(4, 4), (9, 3), (8, 1)])
def test_reference_attention_matches_torch_sdpa(Hq, H):
    """bf16 pages through the reference == torch's causal SDPA (shuffled blocks, chunked)."""
    torch.manual_seed(0)
    D, B = 64, 16
    fmt = parse_format("fp16")
    lay = fmt.layout(D, B)
    lens = [37, 5, 50]  # prompt lengths; request 1 is a decode, request 2 a chunk
    qlens = [37, 1, 14]
    nblk = [(L + B - 1) // B for L in lens]
    perm = torch.randperm(sum(nblk)).tolist()
    tables, k_all, v_all = [], [], []
    cache = ref.new_cache(sum(nblk), H, lay)
    for s, L in enumerate(lens):
        blocks = [perm.pop() for _ in range(nblk[s])]
        tables.append(blocks + [0] * (4 - len(blocks)))
        k, v = torch.randn(L, H, D).half(), torch.randn(L, H, D).half()
        slots = torch.tensor([blocks[p // B] * B + p % B for p in range(L)])
        ref.write_cache(k, v, cache, slots, fmt, lay)
        k_all.append(k), v_all.append(v)
    q = torch.randn(sum(qlens), Hq, D).half()
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)))
    out = ref.paged_attention(q, cache, torch.tensor(tables), torch.tensor(lens), qsl, fmt,
                              lay, D ** -0.5)
    for s, L in enumerate(lens):
        qs = q[qsl[s]:qsl[s + 1]].float().transpose(0, 1)          # [Hq, q, D]
        k = k_all[s].float().repeat_interleave(Hq // H, 1).transpose(0, 1)
        v = v_all[s].float().repeat_interleave(Hq // H, 1).transpose(0, 1)
        n = qs.shape[1]
        mask = torch.ones(n, L, dtype=torch.bool).tril(L - n)
        want = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask)
        got = out[qsl[s]:qsl[s + 1]].float().transpose(0, 1)
        assert (got - want).abs().max() < 2e-3
