"""Formats: names, validation messages, byte accounting from the one layout header."""
import itertools

import pytest
import torch

from vllm_kvq.config import config_from_dict
from vllm_kvq.formats import EXAMPLE_NAMES, FormatError, parse_format

HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (16, 32, 128)
NAMES = EXAMPLE_NAMES + ("int3_group32", "int2_token", "int8_tensor_sym", "fp8_e5m2_token",
                         "fp8_e4m3_head", "int4_channel16_r32", "kivi2_k16_g16_r16")


def _fits(name, D, B):
    try:
        parse_format(name).check(D, B)
        return True
    except FormatError:
        return False


CASES = [(n, D, B) for n, D, B in itertools.product(NAMES, HEAD_DIMS, BLOCK_SIZES)
         if _fits(n, D, B)]


@pytest.mark.parametrize("name,D,B", CASES)
def test_page_is_the_sum_of_its_fields(name, D, B):
    fmt = parse_format(name)
    lay = fmt.layout(D, B)
    assert sum(lay.fields().values()) + lay.padding == lay.plane_bytes
    assert lay.plane_bytes == lay.token_bytes * B
    assert 0 <= lay.padding < B + 2 * 8 * 16  # alignment gaps + rounding to whole tokens
    # fields do not overlap and lie inside the plane
    spans = sorted((r[f"{f}_off"], r[f"{f}_off"] + r[f"{f}_bytes"])
                   for r in (lay.k, lay.v) for f in ("data", "scale", "zero", "outlier")
                   if r[f"{f}_bytes"])
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert spans[-1][1] <= lay.plane_bytes


@pytest.mark.parametrize("name,D,B", CASES)
def test_declared_bytes_match_the_format(name, D, B):
    fmt = parse_format(name)
    lay = fmt.layout(D, B)
    for c, r in ((fmt.key, lay.k), (fmt.value, lay.v)):
        assert r["data_bytes"] == B * D * c.bits // 8
        n_scales = {"none": 0, "tensor": 0, "head": 0, "token": B, "group": B * D // (c.group or 1),
                    "channel": B // (c.group or 1) * D}[c.granularity]
        assert r["scale_bytes"] == 2 * n_scales
        stored_zero = n_scales and c.encoding == "int" and not c.symmetric
        assert r["zero_bytes"] == (2 * n_scales if stored_zero else 0)


def test_known_sizes_head_dim_128():
    # bytes per token per kv head, K+V, scales included (block 128: no rounding loss)
    expect = {"bf16": 512, "fp8_e4m3": 256, "fp8_e4m3_token": 260, "int8_token": 264,
              "int8_group32": 288, "int4_group32": 160, "int2_group32": 96, "kivi4": 160,
              "kivi2": 96}
    for name, nbytes in expect.items():
        assert parse_format(name).layout(128, 128).token_bytes == nbytes, name
    assert parse_format("int4_group32").ratio_vs_bf16(128, 128) == pytest.approx(3.2)


def test_residual_memory_is_per_sequence():
    fmt = parse_format("kivi2")
    # SmolLM2: 30 layers, 3 kv heads, head_dim 64, bf16 window of 128 tokens for K and V
    assert fmt.residual_bytes_per_seq(30, 3, 64) == 30 * 2 * 3 * 128 * 64 * 2
    assert parse_format("int4_group32").residual_bytes_per_seq(30, 3, 64) == 0
    # _w8: int8 codes and a float32 scale per (token, K or V, kv head) row
    assert parse_format("kivi2_w8").residual_bytes_per_seq(30, 3, 64) == \
        30 * 2 * 3 * 128 * (64 + 4)


def test_an_8bit_window_takes_half_the_blocks():
    """The window's pool blocks (csrc/kvq_layout.h static_asserts: kivi2 6 -> 3, kivi4
    4 -> 2 at head_dim 64, block 128); the pages' bytes do not change."""
    for name, blocks, blocks_w8 in (("kivi2", 6, 3), ("kivi4", 4, 2), ("nuq3", 1, 1)):
        f, f8 = parse_format(name), parse_format(name + "_w8")
        assert (f.window_blocks_per_seq(64, 128), f8.window_blocks_per_seq(64, 128)) == \
            (blocks, blocks_w8), name
        assert f8.layout(64, 128) == f.layout(64, 128) and f8.window_bits == 8
        assert f8.window_rows_per_block(64, 128) == f.layout(64, 128).token_bytes * 128 // \
            (2 * 68)
    assert parse_format("kivi2_w8").window_blocks_per_seq(128, 128, lookback=4) == \
        -(-132 // (96 * 128 // (2 * 132)))


def test_window_suffix_stays_last():
    f = parse_format("int4_token_o1_r32_rot_w8")
    assert (f.rotation, f.residual_tokens, f.window_bits) == ("hadamard", 32, 8)
    assert f.with_outliers(2).name == "int4_token_o2_r32_rot_w8"
    assert f.with_residual(64).name == "int4_token_o1_r64_rot_w8"
    assert f.with_residual(0).name == "int4_token_o1_rot"  # no window, nothing to store
    assert f.with_rotation("none").name == "int4_token_o1_r32_w8"
    assert parse_format("nuq3_lm_rot_w8").codebook == "gaussian"


def test_attention_sink_bytes_and_names():
    """_sink: one int8 row of K and one of V (head_dim + 4 bytes each, 16-byte aligned) per
    (block, kv head), the rest of the page unchanged (csrc/kvq_layout.h static_asserts:
    kivi2 48 -> 50, nuq2 52 -> 54 bytes per token at head_dim 64)."""
    for name, before, after in (("kivi2", 48, 50), ("nuq2", 52, 54), ("kivi4", 80, 82)):
        f, fs = parse_format(name), parse_format(name + "_sink")
        lay, lays = f.layout(64, 128), fs.layout(64, 128)
        assert (lay.token_bytes, lays.token_bytes) == (before, after), name
        assert (lays.k["sink_bytes"], lays.v["sink_bytes"]) == (68, 68)
        # K and V fields where they are without the sink (the sink rows go last)
        assert {k: v for k, v in lays.v.items() if "sink" not in k} == \
            {k: v for k, v in lay.v.items() if "sink" not in k} and fs.sink == 1 and f.sink == 0
        assert lays.k["sink_off"] == lay.v["end"]
        assert sum(lays.fields().values()) + lays.padding == lays.plane_bytes
        assert fs.bytes_per_token(64, 128)["total"] == after
        assert fs.with_sink(0) == f and f.with_sink(1) == fs
    assert parse_format("kivi2_sink").key.describe() == "int2/channel32/+sink"
    f = parse_format("nuq2_sink_lm_rotv_w8")
    assert (f.sink, f.codebook, f.rotation, f.window_bits) == (1, "gaussian",
                                                              "hadamard_values", 8)
    assert f.with_rotation("hadamard").name == "nuq2_sink_lm_rot_w8"
    assert f.with_outliers(2).name == "nuq2_o2_sink_lm_rotv_w8"
    assert f.with_window_bits(16).name == "nuq2_sink_lm_rotv"
    assert f.with_sink(0).name == "nuq2_lm_rotv_w8"
    assert parse_format("int4_group32_sink").with_residual(32).name == "int4_group32_r32_sink"


@pytest.mark.parametrize("name,D,B,match", [
    ("int5_group32", 128, 128, "bits=5 is not allowed; allowed: 2, 3, 4, 8"),
    ("int4_group48", 128, 128, "group size=48 is not allowed; allowed: 16, 32, 64, 128"),
    ("int4_group128", 64, 128, "group size 128 does not divide head_dim 64"),
    ("int4_channel64_r64", 128, 32, "does not divide block_size 32"),
    ("int4_group32", 100, 128, "head_dim=100 is not allowed"),
    ("kivi3", 128, 128, "kivi bits=3 is not allowed; allowed: 2, 4"),
    ("kivi2_r0", 128, 128, "positive multiple of 32"),
    ("int4_group32_r96", 128, 128, "residual_tokens=96 must divide block_size=128"),
    ("int4_tensor", 128, 128, "static .* symmetric"),
    ("q4_0", 128, 128, "unknown format 'q4_0'; allowed"),
    ("int4_token_rot", 96, 32, r"rotation=hadamard needs head_dim in \(64, 128, 256\)"),
    ("int4_group32_rot_rot", 64, 32, r"one rotation suffix \(_rot or _rotv\), once"),
    ("kivi2_rot_rotv", 64, 128, r"one rotation suffix \(_rot or _rotv\), once"),
    ("int4_token_rotv", 80, 32, r"rotation=hadamard_values needs head_dim in \(64, 128, 256\)"),
    ("int4_group32_lm", 64, 32, "_lm .* applies to nuq formats only"),
    ("nuq3_rot_lm", 64, 32, "the suffixes go _lm then _rot, once each"),
    ("int4_group32_w8", 64, 128, "_w8 stores the residual window in 8 bits, and "
                                 "'int4_group32' has none; e.g. kivi4_w8"),
    ("kivi4_w8_w8", 64, 128, "_w8 once, at the end"),
    ("kivi4_w8_rot", 64, 128, r"_w8 goes last \(e.g. kivi2_rot_w8\)"),
    ("bf16_sink", 64, 128, "an attention sink applies to int and nuq formats"),
    ("fp8_e4m3_token_sink", 64, 128, "an attention sink applies to int and nuq formats"),
    ("kivi2_rot_sink", 64, 128, "_sink goes right after the format's own name, once"),
    ("kivi2_sink_sink", 64, 128, "_sink goes right after the format's own name, once"),
    ("kivi2_w8_sink", 64, 128, "_sink goes right after the format's own name, once"),
])
def test_bad_formats_say_what_is_allowed(name, D, B, match):
    with pytest.raises(FormatError, match=match):
        parse_format(name).check(D, B)


@pytest.mark.parametrize("d,name", [
    ({"method": "kivi"}, "kivi2"),
    ({"method": "kivi", "bits": 4}, "kivi4"),
    ({"method": "int", "bits": 4}, "int4_group32"),
    ({"method": "fp8"}, "fp8_e4m3"),
    ({"method": "int4_group32", "residual_tokens": "128"}, "int4_group32[residual_tokens=128]"),
    ({"method": "int4_group32", "rotation": "hadamard"}, "int4_group32_rot"),
    ({"method": "int4_group32_rot", "rotation": "none"}, "int4_group32"),
    ({"method": "kivi", "rotation": "hadamard"}, "kivi2_rot"),
    ({"method": "nuq2", "rotation": "hadamard_values"}, "nuq2_rotv"),
    ({"method": "kivi2_rotv", "rotation": "hadamard"}, "kivi2_rot"),
    ({"method": "nuq3_lm_rotv"}, "nuq3_lm_rotv"),
    ({"method": "kivi", "window_bits": 8}, "kivi2_w8"),
    ({"method": "kivi4_w8", "window_bits": 16}, "kivi4"),
    ({"method": "nuq3_lm_rot", "window_bits": 8}, "nuq3_lm_rot_w8"),
    ({"method": "kivi2_w8", "rotation": "hadamard"}, "kivi2_rot_w8"),
    ({"method": "kivi", "sink_tokens": 1}, "kivi2_sink"),
    ({"method": "nuq2_sink_rotv", "sink_tokens": 0}, "nuq2_rotv"),
    ({"method": "kivi4_w8", "sink_tokens": 1}, "kivi4_sink_w8"),
])
def test_config_maps_to_formats(d, name):
    assert config_from_dict(d).fmt.name == name
    base = name.removesuffix("_w8")
    rotation = {"_rot": "hadamard", "rotv": "hadamard_values"}.get(base[-4:], "none")
    assert config_from_dict(d).fmt.rotation == rotation
    assert config_from_dict(d).fmt.window_bits == (8 if name.endswith("_w8") else 16)


def test_lloyd_max_formats_need_no_calibration_file():
    """_lm: every layer gets the computed Gaussian codebooks (per codec group), with no
    calibration file, for any model; the same levels in every process."""
    from vllm_kvq.config import load_levels, resolve_calibration
    from vllm_kvq.gaussian_codebook import lloyd_max_levels
    cfg = resolve_calibration(config_from_dict({"method": "nuq3_lm_rot"}, head_dim=64),
                              "a/model/with/no/shipped/calibration")
    assert cfg.calibration is None and cfg.fmt.codebook == "gaussian"
    levels = load_levels(cfg, num_layers=3, num_kv_heads=3, head_dim=64)
    k, v = levels[0]  # nuq3: keys per channel over 32 tokens, values per token (64)
    assert torch.equal(k, lloyd_max_levels(3, 32)) and torch.equal(v, lloyd_max_levels(3, 64))
    assert all(torch.equal(a, k) and torch.equal(b, v) for a, b in levels)
    with pytest.raises(FormatError, match="needs a calibration file"):
        resolve_calibration(config_from_dict({"method": "nuq3_rot"}, head_dim=64), "a/model")


def test_lloyd_max_levels_are_the_gaussian_optimum():
    """Symmetric, ascending in [-1, 1], and a lower squared error on range-normalized normal
    groups than the uniform codebook and than levels moved off the fixed point."""
    from vllm_kvq.gaussian_codebook import lloyd_max_levels
    from vllm_kvq.reference import nuq_midpoints, uniform_levels
    x = torch.randn(4000, 64, generator=torch.Generator().manual_seed(1))
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    y = ((x - (hi + lo) / 2) / ((hi - lo) / 2)).flatten()

    def mse(lv):
        q = lv[(y.unsqueeze(-1) > nuq_midpoints(lv)).sum(-1)]
        return ((q - y) ** 2).mean().item()
    for bits in (2, 3, 4):
        lv = lloyd_max_levels(bits, 64)
        assert torch.all(lv[1:] > lv[:-1]) and lv.abs().max() <= 1
        assert torch.allclose(lv, -lv.flip(0), atol=1e-6)
        assert mse(lv) < 0.9 * mse(uniform_levels(bits))
        assert mse(lv) < mse(lv * 1.05) and mse(lv) < mse(lv * 0.95)


def test_rotation_suffix_keeps_the_rest_of_the_name():
    f = parse_format("int4_token_o1_r32_rot")
    assert (f.rotation, f.residual_tokens, f.key.outliers) == ("hadamard", 32, 1)
    assert f.with_residual(0).name == "int4_token_o1_rot"
    assert f.with_outliers(2).name == "int4_token_o2_r32_rot"
    assert parse_format(f.with_outliers(2).name) == f.with_outliers(2)
    assert f.layout(64, 32) == parse_format("int4_token_o1_r32").layout(64, 32)  # same bytes


@pytest.mark.parametrize("d,match", [
    (None, "no \"kvq\" configuration"),
    ({"bits": 4}, "kvq.method=None is required"),
    ({"method": "int", "bits": "four"}, "kvq.bits='four' must be an integer"),
    ({"method": "int", "colour": 1}, r"unknown kvq key\(s\) \['colour'\]"),
    ({"method": "int", "k_scale": -1}, "kvq.k_scale=-1 must be a positive number"),
    ({"method": "int", "key_granularity": "row"}, "granularity='row' is not allowed"),
    ({"method": "int", "rotation": "random"},
     "kvq.rotation='random' is not allowed; allowed: none, hadamard, hadamard_values"),
    ({"method": "kivi", "window_bits": 4}, "kvq.window_bits=4 is not allowed; allowed: 16, 8"),
    ({"method": "kivi", "window_bits": True}, "kvq.window_bits=True is not allowed"),
    ({"method": "int4_group32", "window_bits": 8}, "window_bits=8 needs a residual window"),
    ({"method": "kivi", "sink_tokens": 4}, "kvq.sink_tokens=4 is not allowed; allowed: 0, 1"),
    ({"method": "kivi", "sink_tokens": True}, "kvq.sink_tokens=True is not allowed"),
    ({"method": "bf16", "sink_tokens": 1}, "an attention sink applies to int and nuq formats"),
])
def test_bad_config_names_key_value_and_allowed(d, match):
    with pytest.raises(FormatError, match=match):
        config_from_dict(d)
