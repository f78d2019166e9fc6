"""nuq (codebook) formats and sparse outlier slots (issue 5).

- names, bytes and config: nuq{2,3,4}_{token,group<g>,channel<G>}, the nuq{b} alias, the
  _o<N> suffix on int and nuq, kvq.outlier_fraction, calibration resolution and its errors;
- the reference's rules: nuq with the uniform codebook is int asymmetric, the outlier rule
  (largest finite |x|, ties to the lower channel), outliers exact and out of the dense scale,
  overflow counting when more values are large than there are slots;
- the CPU kernels against the reference: byte-identical writes (scalar and AVX2 paths) and
  attention on mixed batches, for nuq2/3/4 x granularities x 0/1/3 outlier slots and for
  int formats with outlier slots, on random, adversarial and crowded rows (more candidate
  outliers than slots) and on real K/V captured from SmolLM2 (tests/kv_capture.py).
"""
from __future__ import annotations

import logging

import pytest
import torch

from vllm_kvq import ops
from vllm_kvq import reference as ref
from vllm_kvq.config import config_from_dict, load_levels, resolve_calibration
from vllm_kvq.formats import Codec, FormatError, KVFormat, parse_format
from vllm_kvq.tools.calibrate.normalize import codec_granularity, normalize
from test_kernels import (PATHS, _seed, _slots_for, assert_attn_close, assert_paths_match,
                          assert_same_cache, build_case, make_tokens, run_mine, run_refs, simd)

pytest.importorskip("vllm_kvq._C")


def powered_levels(bits: int, p: float = 1.7) -> torch.Tensor:
    """A non-uniform codebook, denser near 0, ends at +-1."""
    u = torch.linspace(-1, 1, 2 ** bits, dtype=torch.float64)
    return (u.sign() * u.abs() ** p).to(torch.float32)


def random_levels(bits: int, seed: int) -> torch.Tensor:
    """Sorted random levels (ends not at +-1), one pair repeated (a zero-width bin)."""
    g = torch.Generator().manual_seed(seed)
    lv = torch.sort(torch.rand(2 ** bits, generator=g) * 1.9 - 0.95).values
    lv[2] = lv[1]
    return lv


def levels_for(fmt: KVFormat, kind: str = "powered"):
    def one(c, seed):
        if c.encoding != "nuq":
            return None
        return powered_levels(c.bits) if kind == "powered" else random_levels(c.bits, seed)
    return one(fmt.key, 1), one(fmt.value, 2)


# --- names, bytes, config ------------------------------------------------------------------
@pytest.mark.parametrize("name,k,v,r", [
    ("nuq3_token", "nuq3/token", "nuq3/token", 0),
    ("nuq4_group32_o2", "nuq4/group32/+2outl", "nuq4/group32/+2outl", 0),
    ("nuq2_channel32_o1_r32", "nuq2/channel32/+1outl", "nuq2/channel32/+1outl", 32),
    ("int4_token_o1", "int4/token/+1outl", "int4/token/+1outl", 0),
    ("int4_group32_sym_o3_r128", "int4/group32/sym/+3outl", "int4/group32/sym/+3outl", 128),
    ("nuq3", "nuq3/channel32/+1outl", "nuq3/token/+1outl", 32),  # formats.NUQ_DEFAULTS
    ("nuq3_o2_r128", "nuq3/channel32/+2outl", "nuq3/token/+2outl", 128),
])
def test_names(name, k, v, r):
    fmt = parse_format(name)
    assert (fmt.key.describe(), fmt.value.describe(), fmt.residual_tokens) == (k, v, r)
    assert fmt.needs_levels == name.startswith("nuq")


@pytest.mark.parametrize("name,D,B", [("nuq3_token_o1", 64, 128), ("nuq4_group32", 128, 16),
                                      ("int4_token_o2", 64, 32), ("nuq2_channel32_o4_r32", 128, 32)])
def test_bytes_include_the_sparse_area(name, D, B):
    fmt = parse_format(name)
    lay = fmt.layout(D, B)
    for c, r in ((fmt.key, lay.k), (fmt.value, lay.v)):
        assert r["data_bytes"] == B * D * c.bits // 8
        assert r["outlier_bytes"] == B * c.outliers * 4
        n_scales = {"token": B, "group": B * D // (c.group or 1),
                    "channel": B // (c.group or 1) * D}[c.granularity]
        assert r["scale_bytes"] == r["zero_bytes"] == 2 * n_scales
    assert sum(lay.fields().values()) + lay.padding == lay.plane_bytes
    # nuq3 + 1 slot per token at head_dim 64: 24 B codes + 4 B scale/zero + 4 B slot, K and V
    if name == "nuq3_token_o1":
        assert lay.token_bytes == 64 == parse_format("int3_group32").layout(64, 128).token_bytes


@pytest.mark.parametrize("make,match", [
    (lambda: parse_format("nuq5_token"), "nuq bits=5 is not allowed; allowed: 2, 3, 4"),
    (lambda: parse_format("nuq5"), "nuq bits=5 is not allowed; allowed: 2, 3, 4"),
    (lambda: parse_format("nuq3_tensor"), "unknown format 'nuq3_tensor'; allowed: .*nuq"),
    (lambda: parse_format("int4_token_o65"), r"outliers=65 per token is not allowed; allowed: 0..64"),
    (lambda: Codec("nuq", 3, "head"), "nuq granularity='head' is not allowed"),
    (lambda: Codec("nuq", 3, "token", symmetric=True), "nuq scales are asymmetric"),
    (lambda: Codec("fp8_e4m3", 8, "token", outliers=1), "outlier slots apply to int and nuq"),
    (lambda: parse_format("nuq3_group48"), "group size=48 is not allowed"),
])
def test_bad_names_say_what_is_allowed(make, match):
    with pytest.raises(FormatError, match=match):
        make()


@pytest.mark.parametrize("d,head_dim,name", [
    ({"method": "nuq"}, None, "nuq3"),
    ({"method": "nuq", "bits": 4}, 64, "nuq4"),
    ({"method": "nuq", "bits": 2, "outlier_fraction": 0.01}, 64, "nuq2_o1"),
    ({"method": "nuq", "outlier_fraction": 0.05}, 128, "nuq3_o7"),
    ({"method": "int4_token", "outlier_fraction": 0.01}, 128, "int4_token_o2"),
    ({"method": "int4_group32_r128", "outlier_fraction": "0.02"}, 64, "int4_group32_o2_r128"),
])
def test_config_nuq_and_outlier_fraction(d, head_dim, name):
    cfg = config_from_dict(d, head_dim=head_dim)
    assert cfg.fmt.name == name
    assert parse_format(name) == cfg.fmt  # the resolved name parses back to the same format
    if head_dim is None and "outlier_fraction" in d:
        assert cfg.for_head_dim(64).fmt.outliers >= 1


def test_config_nuq_granularity_overrides():
    cfg = config_from_dict({"method": "nuq", "key_granularity": "channel", "group_size": 32,
                            "residual_tokens": 32})
    assert cfg.fmt.key.describe() == "nuq3/channel32/+1outl"
    assert cfg.fmt.value.describe() == "nuq3/token/+1outl"


@pytest.mark.parametrize("d,match", [
    ({"method": "nuq", "bits": 8}, "kvq.method='nuq': nuq bits=8 is not allowed; allowed: 2, 3, 4"),
    ({"method": "int", "outlier_fraction": 0.5},
     r"kvq.outlier_fraction=0.5 is not allowed; allowed: a number in \(0, 0.1\]"),
    ({"method": "int", "outlier_fraction": 0}, "kvq.outlier_fraction=0 is not allowed"),
    ({"method": "int", "outlier_fraction": "lots"}, "kvq.outlier_fraction='lots' is not allowed"),
    ({"method": "fp8", "outlier_fraction": 0.01}, "allowed with int and nuq formats"),
    ({"method": "nuq", "symmetric": True}, "nuq scales are asymmetric"),
    ({"method": "nuq", "calibration": 7}, "kvq.calibration=7 must be the path"),
])
def test_bad_config_names_key_value_and_allowed(d, match):
    with pytest.raises(FormatError, match=match):
        config_from_dict(d)


def test_nuq_needs_a_calibration(tmp_path):
    cfg = config_from_dict({"method": "nuq3"})
    with pytest.raises(FormatError, match="needs a calibration file for model '/m/other'.*"
                                          "vllm-kvq calibrate"):
        resolve_calibration(cfg, "/m/other")
    missing = config_from_dict({"method": "nuq3", "calibration": str(tmp_path / "no.safetensors")})
    with pytest.raises(FormatError, match="does not exist"):
        resolve_calibration(missing, "/m/other")
    # int formats need none
    assert resolve_calibration(config_from_dict({"method": "int4_token"}), "/m/x").calibration is None


def _calibration_file(tmp_path, layers=4, grans=("token", "token_o1", "group32", "channel32"),
                      rotated=False):
    """Levels powered_levels(b, p): p 1.0, 1.1 for codebooks fitted with outliers left out
    (_o1), +0.5 for those fitted on rotated data (`.hadamard`, written if `rotated`)."""
    from vllm_kvq.codebook_file import CALIBRATION_VERSION, Calibration
    tensors = {}
    for side in ("k", "v"):
        for g in grans:
            for b in (2, 3, 4):
                lv = powered_levels(b, 1.0 + 0.1 * ("_o1" in g))
                tensors[f"levels.fisher.{side}.{g}.b{b}"] = lv.repeat(layers, 1)
                if rotated:
                    lv = powered_levels(b, 1.5 + 0.1 * ("_o1" in g))
                    tensors[f"levels.fisher.{side}.{g}.b{b}.hadamard"] = lv.repeat(layers, 1)
    meta = {"version": CALIBRATION_VERSION, "num_layers": layers, "num_kv_heads": 3,
            "head_dim": 64, "model_type": "llama", "model": "test"}
    return Calibration(meta, tensors).save(tmp_path / "cal.safetensors")


def test_load_levels_per_layer_and_mismatch(tmp_path):
    pytest.importorskip("safetensors")
    path = _calibration_file(tmp_path)
    cfg = config_from_dict({"method": "nuq3", "calibration": str(path)})
    levels = load_levels(cfg, num_layers=4, num_kv_heads=3, head_dim=64, model_type="llama")
    assert len(levels) == 4
    # nuq3: keys per channel32 + 1 slot (no channel32_o1 codebook: the channel32 one),
    # values per token + 1 slot (the codebook fitted with the outlier left out)
    assert torch.equal(levels[2][0], powered_levels(3, 1.0))
    assert torch.equal(levels[2][1], powered_levels(3, 1.1))
    cfg = config_from_dict({"method": "nuq4_group32_o2", "calibration": str(path)})
    k, v = load_levels(cfg, num_layers=4, num_kv_heads=3, head_dim=64)[0]
    assert torch.equal(v, powered_levels(4, 1.0))  # no group32_o*: the plain group32 one
    with pytest.raises(FormatError, match="made for another model.*num_layers: file 4, model 30"):
        load_levels(cfg, num_layers=30, num_kv_heads=3, head_dim=64)
    cfg = config_from_dict({"method": "nuq3_group16", "calibration": str(path)})
    with pytest.raises(FormatError, match="no fisher codebook for side=k bits=3 granularity="
                                          "'group16'"):
        load_levels(cfg, num_layers=4, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize("method, k_power, v_power", [
    ("nuq3", 1.0, 1.1), ("nuq3_rotv", 1.0, 1.6), ("nuq3_rot", 1.5, 1.6),
    ("nuq2_o0_sink_rot", 1.5, 1.5)])
def test_rotated_formats_read_the_codebooks_fitted_on_rotated_data(tmp_path, method, k_power,
                                                                   v_power):
    """A side that a format quantizes rotated (values under _rotv, both under _rot) reads
    the `.hadamard` codebooks; the other side the unrotated ones."""
    pytest.importorskip("safetensors")
    path = _calibration_file(tmp_path, rotated=True)
    cfg = config_from_dict({"method": method, "calibration": str(path)})
    bits = cfg.fmt.key.bits
    k, v = load_levels(cfg, num_layers=4, num_kv_heads=3, head_dim=64)[3]
    assert torch.equal(k, powered_levels(bits, k_power))
    assert torch.equal(v, powered_levels(bits, v_power))


def test_a_file_without_rotated_codebooks_serves_rotated_formats_unrotated_ones(tmp_path,
                                                                               caplog):
    """Files made before the rotated codebooks were added: the rotated side falls back to
    the unrotated codebooks, with a warning that says to recalibrate."""
    pytest.importorskip("safetensors")
    path = _calibration_file(tmp_path)
    cfg = config_from_dict({"method": "nuq3_rot", "calibration": str(path)})
    caplog.set_level("WARNING", logger="vllm.vllm_kvq.config")
    caplog.handler.setLevel("WARNING")
    logging.getLogger("vllm.vllm_kvq.config").addHandler(caplog.handler)
    try:
        k, v = load_levels(cfg, num_layers=4, num_kv_heads=3, head_dim=64)[0]
    finally:
        logging.getLogger("vllm.vllm_kvq.config").removeHandler(caplog.handler)
    assert torch.equal(k, powered_levels(3, 1.0)) and torch.equal(v, powered_levels(3, 1.1))
    assert "no codebooks fitted on rotated" in caplog.text and "vllm-kvq calibrate" in caplog.text


def test_layer_index_from_layer_name():
    from vllm_kvq.config import layer_index
    assert layer_index("model.layers.12.self_attn.attn") == 12
    with pytest.raises(ValueError, match="layer index"):
        layer_index("model.attn")


# --- reference rules -----------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("gran", ["token", "group32", "channel32"])
def test_uniform_codebook_is_int_asymmetric(bits, gran):
    """Same grid as int asymmetric: values agree within the fp16 rounding of scale and zero,
    except near-ties (a value this close to a midpoint may round either way), rare."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(128, 64, generator=g) * 3 + 1
    kind = gran.rstrip("0123456789")
    size = int(gran[len(kind):] or 0)
    a = ref.fake_quantize(x, Codec("nuq", bits, kind, size), levels=ref.uniform_levels(bits))
    b = ref.fake_quantize(x, Codec("int", bits, kind, size))
    tol = 4e-3 * x.abs().max()
    differ = (a - b).abs() > tol
    assert differ.float().mean() < 0.005
    # where they differ, x lies halfway between the two choices (a tie up to rounding)
    assert ((x - (a + b) / 2)[differ].abs() <= tol).all()


def test_nuq_code_is_the_nearest_level_ties_low():
    lv = torch.tensor([-1.0, -0.5, 0.25, 1.0])
    c = Codec("nuq", 2, "token")
    # scale = 1, zero = 0: the row spans exactly [-1, 1]
    x = torch.tensor([[-1.0, -0.75, -0.7, -0.125, 0.6, 0.625, 0.7, 1.0]])
    codes, scale, zero = ref.quantize_groups(x, c, levels=lv)
    assert (scale.item(), zero.item()) == (1.0, 0.0)
    assert codes.tolist() == [[0, 0, 1, 1, 2, 2, 3, 3]]  # -0.75 and 0.625: midpoints -> low


def test_outlier_rule():
    x = torch.tensor([[1.0, -3.0, 3.0, 2.0, -3.0, 0.5, float("inf"), float("nan")]])
    assert ref.select_outliers(x, 4).tolist() == [[1, 2, 4, 3]]  # |x| desc, ties low channel
    y = torch.tensor([[float("nan"), 2.0, float("-inf"), float("nan")]])
    assert ref.select_outliers(y, 3).tolist() == [[1, -1, -1]]  # non-finite never selected


def test_outliers_are_exact_and_leave_the_scale():
    """A slot stores x - (the dense decode there) in fp16 (|x - dense| <= 2|x|): the value
    comes back within 2^-10 |x|."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g)
    x[:, 7] += 40.0  # one huge channel
    x[5, 20] = -55.5
    for c in (Codec("nuq", 3, "token", outliers=2), Codec("int", 3, "token", outliers=2)):
        lv = powered_levels(3) if c.encoding == "nuq" else None
        y = ref.fake_quantize(x, c, levels=lv)
        assert ((y[:, 7] - x[:, 7]).abs() <= x[:, 7].abs() * 2 ** -10).all()
        assert abs(y[5, 20].item() + 55.5) <= 55.5 * 2 ** -10
        plain = ref.fake_quantize(x, Codec(c.encoding, 3, "token"), levels=lv)
        dense = torch.ones_like(x, dtype=torch.bool)
        dense[:, 7] = False
        dense[5, 20] = False
        err_o = (y - x)[dense].pow(2).mean()
        err_p = (plain - x)[dense].pow(2).mean()
        assert err_o < err_p / 20  # the dense range no longer spans the outliers


def test_more_large_values_than_slots_fall_back_to_dense():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=g)
    x[:, [3, 9, 30, 41, 60]] = torch.tensor([50.0, -60.0, 70.0, -80.0, 90.0])
    c = Codec("nuq", 4, "token", outliers=2)
    y = ref.fake_quantize(x, c, levels=powered_levels(4))
    assert ((y[:, [41, 60]] - x[:, [41, 60]]).abs() <= 90 * 2 ** -10).all()  # the two largest
    assert (y[:, [3, 9, 30]] - x[:, [3, 9, 30]]).abs().max() < 15  # dense, range [-60, 70]
    assert ref.outlier_overflow(x, 2, threshold=10.0) == 3 * 32
    assert ref.outlier_overflow(x, 5, threshold=10.0) == 0
    assert ref.outlier_overflow(x, 0, threshold=10.0) == 5 * 32


def test_levels_are_checked():
    c = Codec("nuq", 2, "token")
    with pytest.raises(ValueError, match="needs 4"):
        ref.check_levels(torch.zeros(8), c)
    with pytest.raises(ValueError, match="sorted ascending"):
        ref.check_levels(torch.tensor([0.5, -0.5, 0.6, 0.7]), c)
    with pytest.raises(ValueError, match=r"within \[-1, 1\]"):
        ref.check_levels(torch.tensor([-1.5, -0.5, 0.6, 0.7]), c)
    with pytest.raises(ValueError, match="required"):
        ref.check_levels(None, c)


# --- kernels vs reference --------------------------------------------------------------------
NUQ_NAMES = [f"nuq{b}_{g}{o}" + ("_r32" if g == "channel32" else "") for b in (2, 3, 4)
             for g in ("token", "group32", "channel32") for o in ("", "_o1", "_o3")]
INT_OUTLIER_NAMES = ["int4_token_o1", "int3_group32_o2", "int2_channel16_o1_r32",
                     "int8_token_sym_o2", "int4_head_sym_o1", "int4_group32_o1_r128",
                     "nuq3", "nuq2_group16_o1_r128", "nuq2_sink", "nuq4_token_o1_sink"]


def crowded_tokens(n, H, D, gen):
    """Every token has 6 large values at random channels (more than any slot count here)."""
    x = torch.randn(n, H, D, generator=gen)
    for i in range(n):
        for h in range(H):
            ch = torch.randperm(D, generator=gen)[:6]
            x[i, h, ch] = (torch.rand(6, generator=gen) * 80 + 20) * torch.where(
                torch.rand(6, generator=gen) < 0.5, -1.0, 1.0)
    return x


WRITE_CASES = ([(n, "normal", "powered") for n in NUQ_NAMES + INT_OUTLIER_NAMES] +
               [(n, "adversarial", "random") for n in NUQ_NAMES[1::2] + INT_OUTLIER_NAMES] +
               [(n, "crowded", "powered") for n in ("nuq3_token_o3", "nuq4_group32_o1",
                                                    "nuq2_channel32_o3_r32", "int4_token_o1",
                                                    "int3_group32_o2")])


@pytest.mark.parametrize("name,kind,lv", WRITE_CASES, ids=[f"{n}-{k}-{l}" for n, k, l in WRITE_CASES])
def test_write_cache_matches_reference(name, kind, lv):
    fmt = parse_format(name)
    D, H, nblocks = 64, 2, 5
    B = max(32, fmt.residual_chunk)
    gen = torch.Generator().manual_seed(_seed(name, kind))
    lay = fmt.layout(D, B)
    slots = _slots_for(fmt, 96, nblocks, B, gen)
    N = slots.numel()
    if kind == "crowded":
        x, y = crowded_tokens(N, H, D, gen), crowded_tokens(N, H, D, gen)
    else:
        x = make_tokens(kind, N, H, D, gen)
        y = make_tokens(kind, N, H, D, gen).flip(0) + 0
    kl, vl = levels_for(fmt, lv)
    ks = vs = None
    if fmt.key.static_scale:
        ks, vs = 0.02 + 0.05 * torch.rand(H, generator=gen), 0.03 + 0.05 * torch.rand(H, generator=gen)
    init = torch.randint(0, 256, (nblocks, H, B, lay.token_bytes), dtype=torch.uint8, generator=gen)
    want = init.clone()
    ref.write_cache(x, y, want, slots, fmt, lay, ks, vs, kl, vl)
    for path in PATHS:
        got = init.clone()
        with simd(path):
            ops.write_cache(x, y, got, slots, fmt, ks, vs, kl, vl)
        assert_same_cache(got, want, fmt)


ATTN_NAMES = ["nuq2_token", "nuq3_token_o1", "nuq4_group32_o3", "nuq3_channel32_o1_r32",
              "nuq2_group16_r32", "nuq4_channel16_r128", "int4_token_o1", "int3_group32_o2",
              "int2_channel32_o1_r32", "nuq3", "nuq2_sink", "nuq4_sink", "nuq3_sink",
              "nuq4_token_o1_sink"]
ATTN_CASES = [(n, dt) for n in ATTN_NAMES for dt in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("name,dtype", ATTN_CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in ATTN_CASES])
def test_attention_matches_reference(name, dtype):
    fmt = parse_format(name)
    c = build_case(name, 64, max(32, fmt.residual_chunk), gq=3, H=2, dtype=dtype,
                   seed=_seed(name), levels=levels_for(fmt, "random" if "2" in name else "powered"))
    want = run_refs(c)
    assert_paths_match(c, want, dtype, what=name)


@pytest.mark.parametrize("name", ["nuq3_token_o3", "int4_group32_o1"])
def test_attention_crowded_and_shapes(name):
    """Crowded rows (6 large values per token, fewer slots), head_dim 128, GQA 8."""
    fmt = parse_format(name)
    gen = torch.Generator().manual_seed(9)
    c = build_case(name, 128, 16, gq=8, H=1, dtype=torch.float32, seqs=[(50, 50), (70, 1)],
                   seed=9, levels=levels_for(fmt), tokens=lambda s, L: (
                       crowded_tokens(L, 1, 128, gen), crowded_tokens(L, 1, 128, gen)))
    want = run_refs(c)
    for path in PATHS:
        assert_attn_close(run_mine(c, path), want, torch.float32, scale=10, what=path)


def test_attention_reads_the_outlier_slots():
    """A changed slot value changes the output (the tolerance would catch a kernel that
    ignored the slots), and the reference agrees with the kernel after the change."""
    name = "nuq3_token_o1"
    fmt = parse_format(name)
    c = build_case(name, 64, 32, gq=3, H=2, dtype=torch.float32, seqs=[(40, 1)], seed=3,
                   levels=levels_for(fmt))
    before = run_mine(c)
    lay = c["lay"]
    blk = int(c["block_table"][0, 0])
    plane = c["cache"].view(c["cache"].shape[0], 2, -1)[blk, 0]
    for side in ("k", "v"):  # token 5's slot: value += 8.0 (fp16 bits of the same sign)
        off = lay.__dict__[side]["outlier_off"] + 5 * 4 + 2
        val = plane[off:off + 2].view(torch.float16).float() + 8.0
        plane[off:off + 2] = val.half().view(torch.uint8)
    after = run_mine(c)
    assert (after - before).abs().max() > 1e-3
    assert_attn_close(after, run_refs(c), torch.float32)


# --- real K/V ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_kv():
    from kv_capture import capture_kv
    try:
        return capture_kv(n_windows=1, window=256, seed=5)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def quantile_levels(x: torch.Tensor, codec: Codec) -> torch.Tensor:
    """Levels at evenly spaced quantiles of x's [T, D] normalized values in its codec's scale
    groups (vllm_kvq.tools.calibrate.normalize: the quantizer's own normalization; outliers,
    non-finite values and constant groups left out); ends pinned at +-1."""
    xn, _, _, valid = normalize(x[None, None], codec_granularity(codec))
    xn = xn[valid]
    q = torch.quantile(xn[::max(1, xn.numel() // 50000)], torch.linspace(0, 1, 2 ** codec.bits))
    q[0], q[-1] = -1.0, 1.0
    return torch.sort(q).values.float()


REAL_NAMES = ["nuq3_token_o1", "nuq2_channel32_o1_r32", "nuq4_group32", "int4_token_o1"]


@pytest.mark.parametrize("layer", [0, 15, 29])
def test_real_kv_kernels_match_reference(real_kv, layer):
    K, V = real_kv["k"][layer].float(), real_kv["v"][layer].float()  # [T, 3, 64]
    T, H, D = K.shape
    for name in REAL_NAMES:
        fmt = parse_format(name)
        kl = quantile_levels(K[:, 0], fmt.key) if fmt.key.encoding == "nuq" else None
        vl = quantile_levels(V[:, 0], fmt.value) if fmt.value.encoding == "nuq" else None
        # writes: the first 128 tokens into shuffled slots
        B = 32
        lay = fmt.layout(D, B)
        slots = (torch.randperm(4, generator=torch.Generator().manual_seed(layer))[:, None] * B
                 + torch.arange(B)).reshape(-1)
        want = torch.zeros(4, H, B, lay.token_bytes, dtype=torch.uint8)
        ref.write_cache(K[:128], V[:128], want, slots, fmt, lay, None, None, kl, vl)
        for path in PATHS:
            got = torch.zeros_like(want)
            with simd(path):
                ops.write_cache(K[:128], V[:128], got, slots, fmt, None, None, kl, vl)
            assert_same_cache(got, want, fmt)
        # attention: a prefill of 96, a chunk continuing mid-block, a decode at 256
        c = build_case(fmt, D, B, gq=3, H=H, dtype=torch.float32,
                       seqs=[(96, 96), (200, 17), (256, 1)], seed=layer, levels=(kl, vl),
                       tokens=lambda s, L: (K[:L], V[:L]))
        want_o = run_refs(c)
        for path in PATHS:
            assert_attn_close(run_mine(c, path), want_o, torch.float32, what=f"{name} {path}")


def test_real_kv_fitted_levels_beat_uniform(real_kv):
    """On real keys, per-token nuq3 with levels fitted to the data reconstructs better than
    with the uniform grid (= int3 per token), and an outlier slot helps further."""
    errs = {}
    for layer in (3, 15, 27):
        K = real_kv["k"][layer].float().reshape(-1, 64)
        for name, codec, fit in (("uniform", Codec("nuq", 3, "token"), False),
                                 ("fitted", Codec("nuq", 3, "token"), True),
                                 ("fitted_o1", Codec("nuq", 3, "token", outliers=1), True)):
            lv = quantile_levels(K, codec) if fit else ref.uniform_levels(3)
            y = ref.fake_quantize(K, codec, levels=lv)
            errs[name] = errs.get(name, 0.0) + (y - K).pow(2).mean().item()
    assert errs["fitted"] < errs["uniform"]
    assert errs["fitted_o1"] < errs["fitted"]


def test_shipped_calibration_serves_the_nuq_aliases():
    """The default model's shipped calibration is found without kvq.calibration and holds
    codebooks for nuq2/3/4 (keys per channel32, values per token with an outlier slot)."""
    from vllm_kvq.codebook_file import default_calibration_path
    from vllm_kvq.model_prep import default_model_dir
    model = str(default_model_dir())
    if default_calibration_path(model) is None:
        pytest.skip("no shipped calibration for the default model")
    for b in (2, 3, 4):
        cfg = resolve_calibration(config_from_dict({"method": f"nuq{b}"}), model)
        levels = load_levels(cfg, num_layers=30, num_kv_heads=3, head_dim=64,
                             model_type="llama")
        assert len(levels) == 30
        assert all(k.numel() == v.numel() == 2 ** b for k, v in levels)
