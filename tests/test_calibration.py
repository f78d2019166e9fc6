"""Calibration (issue 5): weighted k-means, the serve-time normalization, the file format
and its checks, the shipped file, and `vllm-kvq calibrate` end to end on a tiny model."""
import json
import math
from pathlib import Path

import pytest
import torch

from vllm_kvq.codebook_file import (CALIBRATION_VERSION, SHIPPED_DIR, SIDES, WEIGHTINGS,
                                    CalibrationError, default_calibration_path,
                                    load_calibration, read_calibration)
from vllm_kvq.reference import uniform_levels
from vllm_kvq.tools.calibrate import normalize as N
from vllm_kvq.tools.calibrate.collect import OUTLIER_FRACTIONS, Accumulator
from vllm_kvq.tools.calibrate.evaluate import evaluate, evaluation_markdown
from vllm_kvq.tools.calibrate.hooks import load_model, set_hook
from vllm_kvq.tools.calibrate.kmeans import weighted_kmeans_1d

SMOL = dict(num_layers=30, num_kv_heads=3, head_dim=64)


# --- k-means ----------------------------------------------------------------------------
# Lloyd-Max quantizer of a unit Gaussian (Max 1960): the positive levels.
LLOYD_MAX = {4: [0.4528, 1.5104], 8: [0.2451, 0.7560, 1.3440, 2.1520]}


@pytest.mark.parametrize("k", [4, 8])
def test_kmeans_finds_lloyd_max_levels_of_a_gaussian(k):
    sigma = 0.2
    x = torch.linspace(-1, 1, 8193, dtype=torch.float64)
    w = torch.exp(-x ** 2 / (2 * sigma ** 2))  # density on a grid = weights
    levels = weighted_kmeans_1d(x, w, k)
    want = torch.tensor(LLOYD_MAX[k], dtype=torch.float64) * sigma
    want = torch.cat([-want.flip(0), want])
    assert torch.allclose(levels, want, atol=2e-3), (levels, want)


def test_kmeans_weights_pull_levels():
    # three clusters, two levels: the heavy cluster gets its own level
    x = torch.tensor([-0.9, -0.8, 0.0, 0.1, 0.8, 0.9], dtype=torch.float64)
    light = weighted_kmeans_1d(x, torch.tensor([1, 1, 1, 1, 100, 100.]), 2)
    assert light[1] == pytest.approx(0.85, abs=1e-9)
    assert light[0] == pytest.approx(-0.4, abs=1e-9)  # mean of the four others
    heavy = weighted_kmeans_1d(x, torch.tensor([100, 100, 1, 1, 1, 1.]), 2)
    assert heavy[0] == pytest.approx(-0.85, abs=1e-9)
    # unsorted input and zero weights are fine
    xz = torch.cat([x, torch.tensor([0.5], dtype=torch.float64)])
    wz = torch.tensor([1, 1, 1, 1, 100, 100, 0.])
    perm = torch.tensor([3, 0, 6, 5, 1, 4, 2])
    assert torch.allclose(weighted_kmeans_1d(xz[perm], wz[perm], 2), light, atol=1e-12)
    with pytest.raises(ValueError):
        weighted_kmeans_1d(x, torch.zeros(6), 2)


def test_kmeans_is_the_global_optimum_on_small_sets():
    """Against brute force over every split into contiguous clusters (optimal 1-D clusters
    are contiguous): Lloyd alone gets stuck on such multimodal weighted sets."""
    import itertools

    g = torch.Generator().manual_seed(1)
    for trial in range(20):
        n, k = 10, 2 + trial % 3
        x = torch.rand(n, generator=g, dtype=torch.float64).sort().values * 2 - 1
        w = torch.rand(n, generator=g, dtype=torch.float64) ** 4 * 100
        best = min(
            sum(float((w[a:b] * (x[a:b] - (w[a:b] * x[a:b]).sum() / w[a:b].sum()) ** 2).sum())
                for a, b in zip((0,) + cuts, cuts + (n,)))
            for cuts in itertools.combinations(range(1, n), k - 1))
        lv = weighted_kmeans_1d(x, w, k)
        got = float((w * (x[:, None] - lv).abs().min(1).values ** 2).sum())
        assert got == pytest.approx(best, rel=1e-9, abs=1e-12), trial


def test_kmeans_on_two_point_masses_keeps_the_ends():
    # every scale group has its min at -1 and max at +1: with enough levels they are exact
    x = torch.linspace(-1, 1, 41, dtype=torch.float64)
    w = torch.full_like(x, 0.01)
    w[0] = w[-1] = 50.0
    lv = weighted_kmeans_1d(x, w, 8)
    assert lv[0] == pytest.approx(-1, abs=2e-3) and lv[-1] == pytest.approx(1, abs=2e-3)


# --- normalization ----------------------------------------------------------------------
def test_normalization_groups_match_the_spec():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 70, 64, generator=g, dtype=torch.float64)
    # token: one head vector
    xn, zero, scale, valid = N.normalize(x, N.parse_granularity("token"))
    v = x[1, 2, 5]
    assert torch.allclose(zero[1, 2, 5, 0, 0], (v.max() + v.min()) / 2)
    assert torch.allclose(xn[1, 2, 5, 0], (v - (v.max() + v.min()) / 2) / ((v.max() - v.min()) / 2))
    assert valid.all() and xn.min() == -1 and xn.max() == 1
    # group32: channels 32..63 of one token
    gr = N.parse_granularity("group32")
    xn, _, _, _ = N.normalize(x, gr)
    v = x[0, 1, 7, 32:]
    assert torch.allclose(xn[0, 1, 7, 1], (v - (v.max() + v.min()) / 2) / ((v.max() - v.min()) / 2))
    # channel32: channel 9 over tokens 32..63, a partial tail (64..69) is left out
    ch = N.parse_granularity("channel32")
    xg = N.to_groups(x, ch)
    assert xg.shape == (2, 3, 2, 64, 32)
    xn, _, _, _ = N.normalize(x, ch)
    v = x[1, 0, 32:64, 9]
    assert torch.allclose(xn[1, 0, 1, 9], (v - (v.max() + v.min()) / 2) / ((v.max() - v.min()) / 2))
    back = N.from_groups(xg, ch, x)
    assert torch.equal(back, x)


def test_constant_groups_and_outliers_are_left_out():
    x = torch.randn(1, 1, 4, 64, dtype=torch.float64)
    x[0, 0, 1] = 3.0  # constant head vector
    x[0, 0, 2, 5] = 40.0  # one outlier
    tok = N.parse_granularity("token")
    _, _, _, valid = N.normalize(x, tok)
    assert not valid[0, 0, 1].any() and valid[0, 0, 2].all()
    o1 = N.parse_granularity("token_o1")
    xn, _, scale, valid = N.normalize(x, o1)
    assert not valid[0, 0, 2, 0, 5] and valid[0, 0, 2, 0].sum() == 63
    assert scale[0, 0, 2, 0, 0] < 5  # the outlier did not set the range
    # quantize-dequantize: the outlier and the constant vector come back exact
    y = N.quantize_dequantize(x.float(), uniform_levels(3), "token_o1")
    assert y[0, 0, 2, 5] == 40.0 and torch.equal(y[0, 0, 1], x[0, 0, 1].float())


def test_normalization_of_a_codec_as_the_cache_stores_it():
    """The one normalization also serves benchmarks/nuq_measure.py: any codec's scale groups
    (outliers per head vector, left out of their group), fp16-rounded scale and zero."""
    from vllm_kvq.formats import parse_format
    from vllm_kvq.reference import _fp16_round

    codec = parse_format("nuq3_group32_o1").key
    g = N.codec_granularity(codec)
    assert (g.kind, g.size, g.outliers) == ("group", 32, 1)
    x = torch.randn(1, 1, 8, 64)
    x[0, 0, 3, 40] = 30.0                       # token 3's outlier, in its second group
    x[0, 0, 5, 2] = float("nan")                # non-finite: left out
    xn, zero, scale, valid = N.normalize(x, g, fp16_stats=True)
    assert not valid[0, 0, 3, 1, 8] and valid[0, 0, 3, 1].sum() == 31
    assert not valid[0, 0, 5, 0, 2] and valid[0, 0, 5].sum() == 62  # NaN and the outlier
    v = x[0, 0, 3, 32:].clone()
    v[8] = float("nan")
    lo, hi = v.nan_to_num(nan=1e9).min(), v.nan_to_num(nan=-1e9).max()
    assert scale[0, 0, 3, 1, 0] == _fp16_round((hi - lo) / 2)
    assert zero[0, 0, 3, 1, 0] == _fp16_round((hi + lo) / 2)
    assert xn.abs().max() <= 1


def test_quantize_dequantize_picks_the_nearest_level():
    x = torch.randn(1, 2, 64, 64)
    lv = torch.tensor([-1.0, -0.3, 0.1, 1.0])
    for gran in ("token", "group32", "channel32"):
        g = N.parse_granularity(gran)
        y = N.quantize_dequantize(x, lv, gran)
        xn, zero, scale, _ = N.normalize(x, g)
        yn = (N.to_groups(y, g) - zero) / scale
        best = lv[(xn[..., None] - lv).abs().argmin(-1)]
        assert torch.allclose(yn, best, atol=1e-5), gran
        assert torch.allclose(N.quantize_dequantize(x, uniform_levels(8), gran), x,
                              atol=float(scale.max()) / 255 + 1e-6)


def test_granularity_names():
    assert N.parse_granularity("group16") == N.Granularity("group16", "group", 16, 0)
    assert N.parse_granularity("channel128").size == 128
    for bad in ("tok", "group", "channel32_o1", "group0"):
        with pytest.raises(CalibrationError):
            N.parse_granularity(bad)


# --- the file ---------------------------------------------------------------------------
def make_calibration(num_layers=3, heads=2, head_dim=64, seed=0, grans=("token", "channel32")):
    g = torch.Generator().manual_seed(seed)
    acc = Accumulator(num_layers, grans)
    for layer in range(num_layers):
        for side in SIDES:
            x = torch.randn(1, heads, 64, head_dim, generator=g) * (1 + layer)
            acc.add(layer, side, x, torch.randn(x.shape, generator=g))
    return acc.fit((2, 3), dict(model="tiny", model_type="llama", architecture="LlamaForCausalLM",
                                num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim))


def test_fit_levels_sorted_in_range_and_thresholds(tmp_path):
    cal = make_calibration()
    for layer in range(3):
        for side in "kv":
            for gran in ("token", "channel32"):
                for bits in (2, 3):
                    for wt in WEIGHTINGS:
                        lv = cal.levels(layer, side, bits, gran, weighting=wt)
                        assert lv.dtype == torch.float32 and lv.shape == (2 ** bits,)
                        assert (lv[1:] > lv[:-1]).all() and lv.min() >= -1 and lv.max() <= 1
            # layer l's values are scaled by 1+l: thresholds scale with them
            t = [cal.outlier_threshold(layer, side, fraction=f) for f in OUTLIER_FRACTIONS]
            assert t == sorted(t, reverse=True)
            assert 2.0 * (1 + layer) < cal.outlier_threshold(layer, side) < 3.2 * (1 + layer)
    # N(0,1): |x| > 2.576 for 1% of values
    assert cal.outlier_threshold(0, "k") == pytest.approx(2.576, rel=0.1)


def test_rotated_codebooks_are_fitted_on_rotated_data_and_gradients():
    """The `.hadamard` codebooks (what `_rot` / `_rotv` formats read) are fitted on x R with
    Fisher weights (g R)^2: the same as an unrotated fit of data and gradients rotated
    beforehand; they differ from the unrotated ones where a large channel sets the range."""
    from vllm_kvq import rotation
    g = torch.Generator().manual_seed(3)
    both = Accumulator(1, ("token", "channel32"))
    pre = Accumulator(1, ("token", "channel32"), rotations=("none",))
    for side in SIDES:
        x = torch.randn(1, 2, 64, 64, generator=g)
        x[..., 5] *= 20  # one large channel: per-token ranges are set by it until rotated
        grad = torch.randn(x.shape, generator=g)
        both.add(0, side, x, grad)
        pre.add(0, side, rotation.rotate(x), rotation.rotate(grad))
    meta = dict(model="tiny", num_layers=1, num_kv_heads=2, head_dim=64)
    a, b = both.fit((2, 3), meta), pre.fit((2, 3), meta)
    assert a.meta["rotations"] == ["none", "hadamard"] and a.has_rotation("hadamard")
    assert b.meta["rotations"] == ["none"] and not b.has_rotation("hadamard")
    for side in SIDES:
        for gran in ("token", "channel32"):
            for wt in WEIGHTINGS:
                rot = a.levels(0, side, 3, gran, weighting=wt, rotation="hadamard")
                assert torch.equal(rot, b.levels(0, side, 3, gran, weighting=wt)), (side, gran)
        plain = a.levels(0, side, 3, "token")
        assert (a.levels(0, side, 3, "token", rotation="hadamard") - plain).abs().max() > 0.1
    with pytest.raises(CalibrationError, match="rotation=hadamard.*available"):
        b.levels(0, "k", 3, "token", rotation="hadamard")
    with pytest.raises(CalibrationError, match="rotation 'givens' is not allowed; allowed: "
                                               "none, hadamard"):
        a.levels(0, "k", 3, "token", rotation="givens")


def test_missing_codebook_lists_what_is_available():
    cal = make_calibration()
    with pytest.raises(CalibrationError, match=r"available.*k\.channel32\.b2.*v\.token\.b3"):
        cal.levels(0, "k", 4, "token")
    with pytest.raises(CalibrationError, match="group32"):
        cal.levels(0, "k", 3, "group32")
    with pytest.raises(CalibrationError, match="out of range"):
        cal.levels(3, "k", 3, "token")
    with pytest.raises(CalibrationError, match="available: 0.005, 0.01, 0.02, 0.05"):
        cal.outlier_threshold(0, "v", fraction=0.1)


def test_save_load_round_trip(tmp_path):
    cal = make_calibration()
    path = cal.save(tmp_path / "c.safetensors")
    back = load_calibration(path, num_layers=3, num_kv_heads=2, head_dim=64, model_type="llama")
    assert back.meta == json.loads(json.dumps(cal.meta))
    assert back.meta["version"] == CALIBRATION_VERSION
    assert set(back.tensors) == set(cal.tensors)
    for k, v in cal.tensors.items():
        assert torch.equal(back.tensors[k], v), k
    assert back.levels(2, "v", 3, "channel32").tolist() == cal.levels(2, "v", 3, "channel32").tolist()
    assert torch.equal(back.levels(1, "k", 2, "group64"), back.levels(1, "k", 2, "token"))


@pytest.mark.parametrize("field,kwargs", [
    ("num_layers", dict(num_layers=4, num_kv_heads=2, head_dim=64)),
    ("num_kv_heads", dict(num_layers=3, num_kv_heads=3, head_dim=64)),
    ("head_dim", dict(num_layers=3, num_kv_heads=2, head_dim=128)),
    ("model_type", dict(num_layers=3, num_kv_heads=2, head_dim=64, model_type="qwen2")),
])
def test_mismatch_names_file_and_model(tmp_path, field, kwargs):
    path = make_calibration().save(tmp_path / "c.safetensors")
    with pytest.raises(CalibrationError) as e:
        load_calibration(path, **kwargs)
    want = {"num_layers": "file 3, model 4", "num_kv_heads": "file 2, model 3",
            "head_dim": "file 64, model 128", "model_type": "file 'llama', model 'qwen2'"}
    assert f"{field}: {want[field]}" in str(e.value)
    assert "vllm-kvq calibrate" in str(e.value)


def test_missing_wrong_version_and_foreign_files(tmp_path):
    with pytest.raises(CalibrationError, match="not found"):
        load_calibration(tmp_path / "nope.safetensors", **SMOL)
    cal = make_calibration()
    cal.meta["version"] = CALIBRATION_VERSION + 1
    path = cal.save(tmp_path / "v2.safetensors")
    with pytest.raises(CalibrationError, match=r"version 2, this vllm-kvq reads version 1"):
        load_calibration(path, num_layers=3, num_kv_heads=2, head_dim=64)
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(CalibrationError, match="not a vllm-kvq calibration"):
        read_calibration(tmp_path / "w.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CalibrationError, match="not a safetensors calibration"):
        read_calibration(tmp_path / "junk.safetensors")
    assert issubclass(CalibrationError, ValueError)


# --- the shipped calibration ------------------------------------------------------------
# model_prep's models: (source, dimensions, model_type, a layer of each kind)
SHIPPED = {"smollm2": (SMOL, "llama", (0, 29)),
           # Gemma 3: 5 sliding-window layers (rope theta 1e4) to every global one (1e6)
           "gemma3": (dict(num_layers=18, num_kv_heads=1, head_dim=256), "gemma3_text",
                      (0, 5, 17))}


@pytest.mark.parametrize("model", list(SHIPPED))
def test_shipped_file_loads_for_its_model(model):
    from vllm_kvq.model_prep import MODELS, model_dir

    dims, model_type, layers = SHIPPED[model]
    path = default_calibration_path(model_dir(MODELS[model]))
    assert path is not None and path.is_file() and path.parent == SHIPPED_DIR
    assert path.name == f"{MODELS[model].name}.safetensors"
    assert path.stat().st_size < 200_000
    cal = load_calibration(path, model_type=model_type, **dims)
    assert cal.meta["tokens"] >= 2048 and cal.meta["sensitivity"].startswith("fisher")
    assert cal.has_rotation("hadamard")  # what the _rot / _rotv formats read
    for layer in layers:
        for side in "kv":
            for bits in (2, 3, 4):
                for gran in ("token", "group32", "channel32", "token_o1"):
                    for rotation in ("none", "hadamard"):
                        lv = cal.levels(layer, side, bits, gran, rotation=rotation)
                        assert lv.shape == (2 ** bits,) and (lv[1:] > lv[:-1]).all()
                        assert -1 <= lv.min() and lv.max() <= 1
            assert cal.outlier_threshold(layer, side) > 0
    # a folder of another name is recognized by model_prep's completion marker
    other = SHIPPED[next(m for m in SHIPPED if m != model)]
    with pytest.raises(CalibrationError, match="made for another model"):
        load_calibration(path, model_type=other[1], **other[0])


def test_shipped_files_are_found_by_name_marker_or_hub_name(tmp_path):
    from vllm_kvq.model_prep import MARKER, MODELS, SMOLLM2

    smol = default_calibration_path(f"/anywhere/{SMOLLM2.name}/")
    assert smol == SHIPPED_DIR / f"{SMOLLM2.name}.safetensors"
    assert default_calibration_path("HuggingFaceTB/SmolLM2-135M-Instruct") == smol
    renamed = tmp_path / "my-gemma"
    renamed.mkdir()
    (renamed / MARKER).write_text(f"sha256 {MODELS['gemma3'].sha256}\n")
    assert default_calibration_path(renamed) == SHIPPED_DIR / f"{MODELS['gemma3'].name}.safetensors"
    assert default_calibration_path(tmp_path) is None  # no marker
    assert default_calibration_path("/models/Llama-3-8B") is None
    assert default_calibration_path(None) is None


def test_calibration_windows_start_as_served_text_does():
    """Gemma 3's tokenizer starts every text with <bos> (without it the model babbles):
    each calibration window starts with it too, so the keys fitted are the ones served."""
    from transformers import AutoTokenizer

    from vllm_kvq.model_prep import GEMMA3, SMOLLM2, model_dir
    from vllm_kvq.tools.corpus import calibration_windows

    for source, head in ((GEMMA3, [2]), (SMOLLM2, [])):
        tok = AutoTokenizer.from_pretrained(model_dir(source))
        windows, _ = calibration_windows(tok, 2, 256)
        assert [len(w) for w in windows] == [256, 256]
        assert [w[:len(head)] for w in windows] == [head, head]
        assert tok.encode("", add_special_tokens=True) == head  # and nothing else first


def test_shipped_file_is_package_data():
    setup = (Path(__file__).parents[1] / "setup.py").read_text()
    assert '"calibrations/*.safetensors"' in setup


def test_default_corpus_is_disjoint_from_evaluation_text():
    from vllm_kvq.tools.corpus import TRAIN_YEARS, speech_year, speeches

    assert TRAIN_YEARS[1] < 1990  # corpus.token_windows and corpus.held_out_windows: >= 1990
    assert sum(TRAIN_YEARS[0] <= speech_year(f) <= TRAIN_YEARS[1] for f in speeches()) >= 16


# --- end to end -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama (GQA 4:2, head_dim 64) with the default model's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from vllm_kvq.model_prep import ensure_default_model

    d = tmp_path_factory.mktemp("tiny")
    tok = AutoTokenizer.from_pretrained(str(ensure_default_model(verbose=False)))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    text = d / "corpus.txt"
    text.write_text(" ".join(f"The {i}th speech on the state of the union was long." for i in range(200)))
    return d, text


def test_captured_keys_are_post_rope_and_gradients_are_exact(tiny_model):
    """The hook sees the cache's K (after RoPE) and V; the zero-leaf gradients are the
    gradient of the loss w.r.t. K and V (directional finite differences, float64)."""
    d, _ = tiny_model
    model = load_model(str(d)).double()
    ids = torch.tensor([[5, 17, 300, 42, 9, 1000, 7, 3]])
    seen = {}

    def loss_of(out):  # in float64 (transformers' loss casts to float32)
        return torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:])

    def hook(layer, k, v):
        zk = torch.zeros_like(k, requires_grad=True)
        zv = torch.zeros_like(v, requires_grad=True)
        seen[layer] = (k.detach(), v.detach(), zk, zv)
        return k + zk, v + zv

    with set_hook(hook):
        loss_of(model(input_ids=ids)).backward()
    attn = model.model.layers[0].self_attn
    h = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    k = attn.k_proj(h).view(1, 8, 2, 64).transpose(1, 2)
    cos, sin = model.model.rotary_emb(h, torch.arange(8)[None])
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    _, k_rope = apply_rotary_pos_emb(k, k, cos, sin)
    assert torch.allclose(seen[0][0], k_rope, atol=1e-6)
    assert not torch.allclose(seen[0][0][:, :, 1:], k[:, :, 1:], atol=1e-3)
    direction = torch.randn(1, 2, 8, 64, generator=torch.Generator().manual_seed(0),
                            dtype=torch.float64)

    def loss_with(layer, side, eps):
        def bump(l, kk, vv):
            if l == layer:
                kk, vv = (kk + eps * direction, vv) if side == 0 else (kk, vv + eps * direction)
            return kk, vv
        with torch.no_grad(), set_hook(bump):
            return loss_of(model(input_ids=ids)).item()

    for layer in (0, 1):  # layer 0's K and V reach the loss through layer 1 too
        for side in (0, 1):
            fd = (loss_with(layer, side, 1e-3) - loss_with(layer, side, -1e-3)) / 2e-3
            grad = float((seen[layer][2 + side].grad * direction).sum())
            assert grad != 0 and fd == pytest.approx(grad, rel=2e-3), (layer, side)


def test_cli_end_to_end_writes_a_loadable_file(tiny_model, tmp_path, capsys):
    from vllm_kvq.cli import main

    d, text = tiny_model
    out = tmp_path / "tiny.safetensors"
    rc = main(["calibrate", "--model", str(d), "--corpus", str(text), "--tokens", "256",
               "--seq-len", "64", "--bits", "2,3", "--out", str(out)])
    assert rc == 0
    err = capsys.readouterr().err
    assert "calibrate" in err and "4 x 64 tokens" in err and "wrote" in err
    cal = load_calibration(out, num_layers=2, num_kv_heads=2, head_dim=64, model_type="llama")
    assert cal.meta["tokens"] == 256 and cal.meta["sequences"] == 4
    assert cal.meta["architecture"] == "LlamaForCausalLM"
    assert "corpus.txt" in cal.meta["corpus"]
    assert cal.levels(1, "k", 3, "channel32").shape == (8,)
    assert cal.levels(0, "v", 2, "token_o1").shape == (4,)
    assert cal.levels(0, "k", 2, "channel32", rotation="hadamard").shape == (4,)
    with pytest.raises(CalibrationError, match="bits=4"):
        cal.levels(0, "v", 4, "token")
    # fisher and unweighted codebooks differ (the weights matter)
    assert not torch.equal(cal.levels(0, "k", 3, "token"),
                           cal.levels(0, "k", 3, "token", weighting="unweighted"))
    # bad arguments fail with our message
    assert main(["calibrate", "--model", str(d), "--corpus", str(text), "--bits", "5",
                 "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "allowed: 2, 3, 4" in capsys.readouterr().err


def test_evaluate_runs_and_fp_levels_are_lossless(tiny_model):
    d, text = tiny_model
    model = load_model(str(d))
    cal = make_calibration(num_layers=2, heads=2, grans=("token",))
    ids = [list(range(100, 164))]
    rows = evaluate(model, ids, cal, [dict(bits=3, k="token", v="token", levels="fisher"),
                                        dict(bits=3, k="token", v="token", levels="uniform")],
                      progress=False)
    assert rows[0]["ppl_change"] == 0 and len(rows) == 3
    assert all(r["mean_kl"] >= -1e-6 and math.isfinite(r["ppl"]) for r in rows)
    assert "| 3 | token | token | fisher |" in evaluation_markdown(rows, 1, 64)
