"""End to end on the CPU: real vLLM 0.32, the real SmolLM2-135M, real text, our backend.

Each engine runs in its own process (tests/e2e_driver.py); results are cached per session.
Quality is compared with our bf16 through the same backend (same code path), and our bf16
with vLLM's own CPU backend.
"""
import json
import math

import pytest
from conftest import assert_same_up_to_ties, assert_size_bar, assert_within, grid
from conftest import run_engine as run

from vllm_kvq import hugepages
from vllm_kvq.formats import parse_format
from vllm_kvq.tools.evaluate import compare_runs

pytestmark = pytest.mark.e2e
SMOL = dict(layers=30, kv_heads=3, head_dim=64)
BUDGET = 1 << 30  # the quality runs' (tests/e2e_driver.py), at vLLM's default max_num_seqs

# method -> (max mean KL vs bf16, min agreement on confident positions, max ppl change)
# set from measurements on this model and text (see the issue notes); a broken kernel
# (wrong scale, wrong block, stale residual) lands far outside them.
# Measured (fp32 model, 4 x 1024 SOTU tokens): fp8_e4m3 KL 0.0042 / 99.89% / +0.97%;
# int8_token 0.00023 / 100% / -0.02% (int8_group32, 0.00011 / 100% / +0.11%, is left to the
# kernel tests: suite time);
# int4_group32 0.027 / 97.5% / +3.6%; kivi4 0.0018 / 99.96% / +0.16%;
# kivi2 0.082 / 91.2% / +15.5%; nuq3 (shipped calibration) 0.0103 / 99.44% / +1.1%;
# int4_group32_rot (Hadamard-rotated K/V) 0.0201 / 98.6% / +3.9% (int4_group32 in the same
# run: 0.0273 / 97.5% / +3.8%). The same on 3 x 1024 tokens (AVX-512,
# 2026-12-02): fp8_e4m3 0.0043 / 99.95% / +1.1%; int8_token 0.00023 / 100% / -0.06%;
# int4_group32 0.0276 / 97.4% / +4.2%; kivi4 0.0018 / 100% / +0.05%; kivi2 0.084 / 91.4% /
# +17.0%; nuq3 0.0102 / 99.25% / +1.5%; int4_group32_rot 0.0205 / 98.6% / +4.1%;
# nuq3_lm_rot 0.0142 (x1.40 nuq3's; x1.36 on 4 x 1024). On the 2 x 1024 tokens the tests
# use now (AVX2-only Zen 3, 2026-12-06): fp8_e4m3 0.0046 / 100% / +1.1%; int8_token 0.00024
# / 100% / -0.04%; int4_group32 0.0279 / 97.3% / +3.8%; kivi4 0.0018 / 100% / +0.08%; kivi2
# 0.081 / 90.8% / +15.0%; nuq3 0.0096 / 99.25% / +0.96%; int4_group32_rot 0.0211 / 98.4% /
# +3.6% (x0.76 int4_group32's); nuq3_lm_rot 0.0135 (x1.41 nuq3's). 96-token chunks vs whole
# there: int4_group32 KL to bf16 0.0285 vs 0.0279, kivi2 0.0824 vs 0.0815.
QUALITY = {
    "fp8_e4m3": (0.01, 0.995, 0.02),
    "int8_token": (0.001, 0.995, 0.003),
    "int4_group32": (0.05, 0.96, 0.06),
    "kivi4": (0.005, 0.995, 0.01),
    "kivi2": (0.15, 0.88, 0.25),
    "nuq3": (0.02, 0.985, 0.025),
    "int4_group32_rot": (0.035, 0.975, 0.06),
    # The rotation issue's (#14) first bar, <= 5 bits per value with no full-precision
    # window: kivi4's pages (5.00 bits) with its 128-token window stored as int8 (_w8).
    # Measured (bf16 model, 8 x 1024 held-out tokens, reports/window-int8): -0.10% ppl,
    # KL 0.0033, 100% confident agreement (kivi4 with the 16-bit window: -0.05% / 0.0028);
    # here (fp32 model, 2 x 1024, AVX-512): KL 0.00226, 99.85%, -0.06%.
    "kivi4_w8": (0.005, 0.995, 0.01),
    # kivi2 with its first token (the attention sink) kept as an int8 row (_sink).
    # Measured (bf16 model, 8 x 1024 held-out tokens, reports/sink): +6.87% ppl, KL 0.0452,
    # 95.0% confident agreement (kivi2: +14.8%, 0.0892, 90.0%).
    # Here (fp32 model, 2 x 1024, AVX-512): KL 0.0393 (kivi2 0.0816), 95.9%, +6.3%.
    "kivi2_sink": (0.06, 0.94, 0.10),
    # #14's "<= 3.25 bits per value, window <= 32 tokens: <= +8%" on this model (head_dim
    # 64): nuq2's codes with no outlier slots (_o0; 2.75 bits), the sink (2.88) and keys and
    # values rotated (with the sink, rotating the per-channel keys too measures best).
    # Measured (bf16 model, 8 x 1024 held-out tokens, reports/sink/rotated): +5.34% ppl, KL
    # 0.0386, 96.5% confident agreement (nuq2_rotv at 3.25 bits: +8.18%). Here (fp32 model,
    # 2 x 1024, AVX-512): KL 0.0383, 96.3%, +5.6%.
    "nuq2_o0_sink_rot": (0.06, 0.94, 0.08),
    # #14's "<= 4.25 bits per value: <= +2.5%", and the README's pick for capacity at a
    # small loss: nuq3's codes with no outlier slots (3.75 bits), the sink (3.875), keys and
    # values rotated, codebooks fitted on rotated data; no slot corrections in the decode.
    # Measured (bf16 model, 8 x 1024 held-out tokens, reports/rotation/nuq3-no-slots):
    # +0.77% ppl, KL 0.0075, 99.7% confident agreement (nuq3 in that run: +0.84%, 0.0111,
    # 99.4%). Here (fp32 model, 2 x 1024, AVX2-only Zen 3): KL 0.0067, 99.55%, +0.30%.
    "nuq3_o0_sink_rot": (0.015, 0.99, 0.025),
}
# The rotation issue's bars by size: method -> (max bits per value at 128-token blocks, max
# tokens kept in full precision); conftest.assert_size_bar
SIZE_BARS = {"kivi4_w8": (5.0, 0), "nuq2_o0_sink_rot": (3.25, 32),
             "nuq3_o0_sink_rot": (4.25, 32)}


# int4_group32_rot's mean KL vs bf16 over int4_group32's (same bytes, keys and values rotated)
ROTATION_KL_RATIO = 0.9
# kivi2_sink's mean KL vs bf16 over kivi2's, at most (measured 0.51, reports/sink)
SINK_KL_RATIO = 0.7
# calibration-free nuq3_lm_rot's mean KL vs bf16 over nuq3's (shipped calibration), at most
LM_KL_RATIO = 1.5

BF16_MODEL = json.dumps({"dtype": "bfloat16", "windows": 1, "window": 512})
# (max mean KL, min confident agreement, max |ppl change|) of our bf16 cache vs vLLM's,
# bf16 model. Measured on an AVX-512 (VNNI, BF16) machine, 2 x 1024 SOTU tokens: KL
# 0.00113 on our AVX-512 path and 0.00111 with KVQ_SIMD=avx2, 100% confident agreement
# (1379 positions), ppl +0.08% / +0.13%; our two paths differ from each other by as much
# (KL 0.00110): this is bf16 activation noise, not the cache. On an AVX2-only machine
# (1 x 1024, 2026-12-05) the two backends' log-probs are identical (KL 0): neither kernel
# rounds anything to bf16 there, and the bf16 activations absorb the float noise.
BF16_PARITY = (0.004, 0.995, 0.01)


def test_our_bf16_is_vllm_bf16():
    """With a bf16 model both backends store the same bf16 K/V; only the kernels differ
    (summation order; vLLM's own CPU kernels change with AVX512-BF16). Teacher-forced over
    512 tokens, four pages (2 x 1024, then 1 x 1024, until suite time asked for less: a bf16
    model computes ~3x slower on CPUs without AVX512-BF16), the next-token distributions
    must agree up to that float noise.
    Exact greedy tokens are not compared: they held on an AVX2 machine and flipped at a
    0.125-nat margin on an AVX-512 one, so they prove nothing about the cache.
    Measured: see BF16_PARITY below; a stale block or a wrong scale lands at KL ~1."""
    ours, theirs = run("quality", "bf16", BF16_MODEL), run("quality", "vllm", BF16_MODEL)
    cmp = compare_runs(theirs, ours)
    print(json.dumps(cmp))
    assert_within(cmp, BF16_PARITY, min_positions=500)
    assert ours["capacity_tokens"] == pytest.approx(theirs["capacity_tokens"], rel=0.02)


def test_an_engine_served_by_vllm_kvq_has_its_kv_cache_on_huge_pages():
    """Where transparent huge pages are in madvise mode, the plugin puts the KV cache of an
    engine served by vllm-kvq on huge pages (vllm_kvq.hugepages) and leaves vLLM's own
    backend's as vLLM allocated it. The two engines of test_our_bf16_is_vllm_bf16: the
    teacher-forced run writes 2 x 1024 tokens x 30 layers of bf16 K/V (~47 MiB) scattered
    over the pool's blocks, each 2 MiB of the buffer it touches a huge page."""
    if hugepages.thp_mode() != "madvise":
        pytest.skip(f"transparent huge pages mode {hugepages.thp_mode() or 'none'}")
    ours, theirs = run("quality", "bf16", BF16_MODEL), run("quality", "vllm", BF16_MODEL)
    # measured: 70 MiB and 0 (at least 4 huge pages asked: a fragmented machine's kernel
    # may fall back to 4 KiB pages for some)
    assert ours["anon_huge_kib"] >= 8 * 1024
    assert theirs["anon_huge_kib"] < ours["anon_huge_kib"]


@pytest.mark.parametrize("method", list(QUALITY))
def test_quality_against_bf16(method):
    base, other = run("quality", "bf16"), run("quality", method)
    cmp = compare_runs(base, other)
    print(method, json.dumps(cmp))
    assert_within(cmp, QUALITY[method], min_positions=2000)
    if method in SIZE_BARS:
        assert_size_bar(method, SMOL["head_dim"], SIZE_BARS[method])


def expected_capacity(method: str, layers: int = SMOL["layers"]) -> int:
    """Tokens one worker's budget holds: its `layers` (a pipeline stage's share) of pages.
    Running sequences' residual windows take blocks of these pages (vllm_kvq.window_cache),
    nothing is set aside for them."""
    lay = parse_format(method).layout(SMOL["head_dim"], 128)
    block_bytes = layers * SMOL["kv_heads"] * lay.plane_bytes
    return BUDGET // block_bytes * 128


# (variant, its base format, max mean-KL ratio variant / base), the same teacher-forced
# windows against our bf16 cache:
#   int4_group32_rot: the same int4 bytes with keys and values Hadamard-rotated before
#     quantizing (vllm_kvq.rotation: rotated writes, rotated query and staging rows, output
#     rotated back);
#   kivi2_sink: kivi2's pages plus the first token as an int8 row in every block (2 bytes
#     per token more at head_dim 64), read for position 0 by the decode and prefill kernels
#     (csrc/cpu/attn_body.h, dequant.cpp); decode and prefix hits:
#     test_prefix_caching_does_not_change_outputs[kivi2_sink].
LOWER_ERROR = [("int4_group32_rot", "int4_group32", ROTATION_KL_RATIO),
               ("kivi2_sink", "kivi2", SINK_KL_RATIO)]


@pytest.mark.parametrize("variant,plain,ratio", LOWER_ERROR, ids=[v for v, _, _ in LOWER_ERROR])
def test_variant_lowers_the_error_of_its_format(variant, plain, ratio):
    """Through the whole engine, a clearly smaller error against bf16 than the format it
    varies: mean KL below `ratio` times the base's, more confident positions agreeing."""
    base = run("quality", "bf16")
    before = compare_runs(base, run("quality", plain))
    after = compare_runs(base, run("quality", variant))
    print(json.dumps({plain: before, variant: after}))
    assert after["mean_kl"] < ratio * before["mean_kl"], (after, before)
    assert after["agreement_confident"] > before["agreement_confident"], (after, before)


def test_calibration_free_codebooks_come_close_to_calibrated_ones():
    """nuq3_lm_rot: nuq3's bytes with rotated K/V and Lloyd-Max Gaussian codebooks computed
    at engine start (no calibration file); its error stays within LM_KL_RATIO of nuq3 with
    the shipped Fisher-calibrated codebooks."""
    base = run("quality", "bf16")
    calibrated = compare_runs(base, run("quality", "nuq3"))
    free = compare_runs(base, run("quality", "nuq3_lm_rot"))
    print(json.dumps({"nuq3": calibrated, "nuq3_lm_rot": free}))
    assert free["mean_kl"] <= LM_KL_RATIO * calibrated["mean_kl"], (free, calibrated)


@pytest.mark.parametrize("method", list(QUALITY))
def test_capacity_follows_the_format(method):
    """vLLM's own block manager sees the smaller pages: at a 1 GiB budget and vLLM's default
    max_num_seqs, capacity rises by the format's ratio within 2%, residual window or not (a
    window's blocks are claimed per running sequence, not reserved per sequence slot)."""
    bf16, other = run("quality", "bf16"), run("quality", method)
    fmt = parse_format(method)
    assert other["capacity_tokens"] == pytest.approx(expected_capacity(method), rel=0.02)
    assert other["capacity_tokens"] / bf16["capacity_tokens"] == pytest.approx(
        fmt.ratio_vs_bf16(SMOL["head_dim"], 128), rel=0.02)


# The capacity the window formats must reach at a 1 GiB budget with vLLM's default
# max_num_seqs (256), as x bf16's tokens by vLLM's block count. Measured: kivi2 5.33,
# kivi4 3.20, nuq3 3.76 (the formats' own ratios; with the window reserved per sequence
# slot outside the pool they were 1.58, 0.95 and 3.10).
WINDOW_CAPACITY = {"kivi2": 4.5, "kivi4": 2.8, "nuq3": 3.5}


@pytest.mark.parametrize("method", list(WINDOW_CAPACITY))
def test_window_formats_keep_their_capacity_at_vllm_defaults(method):
    bf16, other = run("quality", "bf16"), run("quality", method)
    assert other["max_num_seqs"] == 256
    assert other["capacity_tokens"] / bf16["capacity_tokens"] >= WINDOW_CAPACITY[method]


# Greedy tokens of a prefix-cached run match the uncached run's up to a tie this close.
PREFIX_TIE_NATS = 1.0


# kivi2 only (suite time; it reads shared pages like every format, and has the window):
# int4_group32 measured the same way diverged only at near-ties (see below).
@pytest.mark.parametrize("method", ["kivi2", "kivi2_sink"])
def test_prefix_caching_does_not_change_outputs(method):
    """Shared full blocks are read, never rewritten; the residual window survives hits (and
    the attention sink, which a hit reads from the shared first block: kivi2_sink).
    Six prompts share a 600-token prefix; with caching on, each tail after a hit is
    prefilled with the cached blocks as context (the flash path's context and causal
    calls, merged) instead of in one causal call, so its K/V differ in the last bits and
    some round to the neighbouring code (see the chunked test below). The greedy tokens
    must match the uncached run's up to a near-tie. Measured (AVX-512, flash prefill):
    int4_group32 diverged in 5 of 6 prompts per round, each where the uncached run's top
    two were 0.04-0.42 nats apart; kivi2 identical. A rewritten shared block or a lost
    window turns the output into other text from the first token on, where two prompts'
    margins are > 1 nat (1.95, 1.75): with the cache clobbered after every write
    (VLLM_KVQ_FAULT=clobber_cache) in the cached run, all 12 diverge at token 0 and the
    test fails on those two."""
    plain = run("greedy", method, json.dumps({"enable_prefix_caching": False}))
    cached = run("greedy", method, json.dumps({"enable_prefix_caching": True}))
    assert plain["first"] == plain["second"]  # no cache: the same batches, the same tokens
    for rnd in ("first", "second"):
        assert_same_up_to_ties(cached[rnd], plain["first"], plain["margins"], PREFIX_TIE_NATS)


CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 96, "max_num_seqs": 4}


@pytest.mark.parametrize("method", ["int4_group32", "kivi2"])
def test_small_prefill_chunks_read_the_same_cache(method):
    """Teacher-forced over the quality windows (2 x 1024 tokens; measured below on 4 x 1024),
    prefilled in 96-token chunks vs one chunk per
    window: every chunk's queries read earlier chunks back from the quantized pages (and
    the residual window). A chunk that read a stale or misplaced block, or lost the
    residual window, lands at KL ~1 (see the clobber test below).

    Chunked and whole runs do not store the same codes, and cannot: vLLM's fp32 GEMMs give
    K/V that differ in the last bits on other batch shapes, a value next to a rounding
    boundary lands on the neighbouring code, and the model amplifies each flip into later
    layers' K/V, where more values flip. Two runs therefore carry two draws of the format's
    rounding error, and what must match is how far each is from bf16. Measured (AVX-512,
    2 cores), KL chunked vs whole / chunked vs bf16 / whole vs bf16, paged kernel for every
    row: int4_group32 0.0012 to 0.0166 (six builds differing only in float summation order)
    / 0.0276-0.0280 / 0.0276; kivi2 0.0013-0.0097 / 0.0830 / 0.0833 (bf16: 4e-6, nothing to
    round); flash prefill (the default): int4_group32 0.0166 / 0.0269 / 0.0273, kivi2
    0.0092 / 0.0835 / 0.0829."""
    base = run("quality", "bf16")
    whole = run("quality", method)
    chunked = run("quality", method, json.dumps({"enable_prefix_caching": False, **CHUNKED}))
    cmp = compare_runs(whole, chunked)
    own, own_chunked = compare_runs(base, whole), compare_runs(base, chunked)
    print(json.dumps({"method": method, "chunked_vs_whole": cmp, "whole_vs_bf16": own,
                      "chunked_vs_bf16": own_chunked}))
    assert own_chunked["mean_kl"] == pytest.approx(own["mean_kl"], rel=0.1), (own_chunked, own)
    assert abs(own_chunked["agreement_confident"] - own["agreement_confident"]) < 0.01
    assert cmp["mean_kl"] < own["mean_kl"], (cmp, own)


def test_preemption_completes_every_request():
    """A KV budget of 25 pages for 4 sequences of 700-727 tokens + 64 (6-7 pages each, plus
    6 for a running sequence's residual window: two running sequences need 26): vLLM must
    preempt and recompute (the window's blocks are released and claimed again); every
    request still finishes with all its tokens, and matches an unconstrained run's greedy
    tokens up to a near-tie. Recompute runs other batch shapes, so the recomputed tokens
    carry another draw of kivi2's rounding error (see the chunked test above: KL 0.08 per
    position vs bf16): a tie within PREEMPT_TIE_NATS may flip. Measured (Zen 4): 2
    preemptions, 4 of 4 identical; 64% of the unconstrained run's steps have a margin of
    >= 1 nat, so a recompute that lost the window (garbage from the next token on) is
    caught. (It was 8 sequences x 160 tokens in 28 pages until suite time asked: 5 of 8
    identical, the others at 0.41, 0.03 and 0.10 nats.)
    The unconstrained run is the window's capacity claim too: those 4 and 12 more
    sequences (424-763 tokens + 64, 4-7 pages + 6 window blocks each, 191 blocks in all) at
    vLLM's default max_num_seqs in 208 pages: all 16 decode at once (every request's first
    token comes before any request's last) with no preemption, their windows inside vLLM's
    pool."""
    tight = run("preempt", "kivi2", json.dumps({"kv_pages": 25, "max_num_seqs": 8, "seqs": 4,
                                                "new_tokens": PREEMPT_TOKENS}))
    roomy = run("preempt", "kivi2", json.dumps({"kv_pages": 208, "seqs": 16,
                                                "new_tokens": PREEMPT_TOKENS}))
    assert tight["num_blocks"] <= 25 and roomy["num_blocks"] <= 208
    print(json.dumps({"tight_preemptions": tight["preemptions"]}))
    assert tight["preemptions"] > 0, tight["preemptions"]
    assert roomy["preemptions"] == 0 and roomy["max_num_seqs"] == 256, roomy
    assert [len(t) for t in tight["tokens"]] == [PREEMPT_TOKENS] * 4
    assert [len(t) for t in roomy["tokens"]] == [PREEMPT_TOKENS] * 16
    firsts, lasts = zip(*roomy["spans"])
    assert max(firsts) < min(lasts), roomy["spans"]  # 16 sequences decoding at once
    assert_same_up_to_ties(tight["tokens"], roomy["tokens"][:4], roomy["margins"][:4],
                           PREEMPT_TIE_NATS)


PREEMPT_TOKENS = 64
PREEMPT_TIE_NATS = 1.0


# int4_group32 only (suite time): bf16 goes through the same write/attend calls, and the
# chunked and prefix-caching tests would catch kivi2's window reading anything stale.
@pytest.mark.parametrize("method", ["int4_group32"])
def test_quality_measurement_reads_the_stored_cache(method):
    """Teacher-forced log-probs come from one prefill; they must read K/V back from the
    stored cache as decode does. Clobbering the cache right after each write (a test-only
    fault, vllm_kvq.tools.faults) must therefore change them, for past tokens of the same
    step."""
    good = run("quality", method)
    bad = run("quality", method, json.dumps({"env": {"VLLM_KVQ_FAULT": "clobber_cache"}}))
    cmp = compare_runs(good, bad)
    assert cmp["mean_kl"] > 1.0 and cmp["agreement"] < 0.5, cmp


# Pipeline parallel over SmolLM2's 30 layers: two CPU workers (one core each), stages of 15
# layers. The residual window's slots and the nuq codebooks (by global layer index) are per
# stage; a stage that used stage 0's codebooks or lost its window would land at KL ~1. The
# PP run scores the first of the single-worker runs' two windows (the same 1024 tokens:
# evaluate.default_inputs draws windows in order; ~5 s less per PP engine).
PP2 = json.dumps({"pipeline_parallel_size": 2, "windows": 1,
                  "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}})


# The four formats (~30 s of PP engine each in the suite; the single-worker runs are
# shared with other tests): bf16, int4_group32, kivi2 (a 128-token residual window) and
# nuq3 (a 32-token window, per-layer codebooks).
@pytest.mark.parametrize("method", ["bf16", "int4_group32", "kivi2", "nuq3"])
def test_pipeline_parallel_reads_the_same_cache(method):
    """Teacher-forced log-probs of PP=2 match the single-worker run. Measured (4 x 1024
    tokens, AVX-512 machine): identical (KL 0) for bf16, int4_group32, kivi2 and nuq3. The
    bound allows the chunking-level float noise (see above) a different thread split could
    bring on another machine, far below a wrong stage's KL ~1. Capacity: each worker's
    budget holds its 15 layers' pages (twice the single worker's tokens)."""
    one, two = run("quality", method), run("quality", method, PP2)
    cmp = compare_runs(dict(one, prompt=one["prompt"][:1]), two)
    own_error = compare_runs(run("quality", "bf16"), one)["mean_kl"]
    print(json.dumps({"method": method, "pp2_vs_one": cmp, "format_kl": own_error}))
    assert cmp["agreement_confident"] >= 0.995, cmp
    assert cmp["mean_kl"] < max(0.25 * own_error, 1e-4), (cmp, own_error)
    assert two["capacity_tokens"] == pytest.approx(expected_capacity(method, 15), rel=0.02)


# Decode, teacher-forced: chunked prefill with an 8-token budget, so every position is scored
# by the fused decode kernel, as generation is: a chunk of <= 8 query tokens runs one decode
# task per token (csrc/cpu/attention.cpp kDecodeRowsMax), each the computation of a plain
# decode step at its position, int8 query included (tests/test_kernels.py
# test_short_chunks_equal_decode_steps: bit for bit); 48 engine steps instead of 383.
DECODE_STEPS = {"enable_chunked_prefill": True, "max_num_batched_tokens": 8,
                "max_num_seqs": 1, "windows": 1, "window": 384, "enable_prefix_caching": False}


# int4_group32 (per-group key scales, the most used path) and nuq4 (per-channel keys whose
# codebook levels the integer Q.K reads as bytes, outlier slots corrected after the integer
# dots; nuq3 keys take the same path where 3-bit codes are read as stored, AVX-512 with
# VBMI); ~15 s of engines per method (~50 s with one-token steps), so the suite runs
# int4_group32 and KVQ_FULL_GRID=1 adds nuq4 (measured x1.005-1.035, far inside the bound;
# its integer Q.K and byte-level P.V are held to their references in tests/test_kernels.py
# on both SIMD paths). The per-channel (KIVI) int8 query is held to its reference in
# tests/test_kernels.py, and measured end to end at x1.010 (kivi2).
@pytest.mark.parametrize("method", grid(["int4_group32"], ["int4_group32", "nuq4"]))
def test_decode_approximations_cost_at_most_five_percent_of_the_format_error(method):
    """The decode kernel takes Q.K of int keys with an int8-rounded query and, for a bf16
    query on an AVX-512 CPU with AVX512-BF16 and VBMI, P.V of 4/2-bit values with bf16
    weights (csrc/cpu/attn_body.h pv_bf16), on AVX2 P.V of nuq 4-bit values with their levels
    as bytes (K_B4); KVQ_EXACT_QK=1 KVQ_EXACT_PV=1 is the exact kernel. Against our bf16
    cache, per format, the fast kernel's KL stays within 5% of the exact kernel's (plus 0.001
    for the noise of 383 positions). Measured (AVX-512 machine), both approximations:
    int4_group32 KL 0.0234 vs exact 0.0231 (x1.014), nuq4 0.00180 vs 0.00174 (x1.035);
    int8 query alone: int4_group32 0.0284 vs 0.0274 (x1.037), kivi2 0.0557 vs 0.0552
    (x1.010), nuq4 0.00195 vs 0.00171 (x1.14 but +0.00024, inside the
    noise allowance; nuq3 on the integer path 0.00849 vs 0.00818, x1.038). With nuq key
    levels as 7-bit bytes (kNuqKeyLevelMax, since 96dcbd6) on an AVX2-only machine: nuq4
    0.001882 vs 0.001858 (x1.013), int4_group32 0.0269 vs 0.0257 (x1.044); with nuq4's value
    levels as bytes too (AVX2's P.V, K_B4): nuq4 0.001867 vs 0.001858 (x1.005). With
    8-token chunks (DECODE_STEPS; Zen 4): int4_group32 0.0228 vs exact 0.0245 (AVX-512
    path), 0.0228 vs 0.0259 (KVQ_SIMD=avx2).
    The two runs are close to independent samples of the format's noise: each step's
    rounding differences reach the next layers' quantized K/V, so fast vs exact differ by KL
    0.021 (int4_group32, AVX2), ~0.8x their distance to bf16, and they flip different
    confident tokens (there: 10 vs 3 of 256, 8 of them near-ties of the quantized run). The
    agreement bound is therefore a two-proportion test, 3 standard errors of the pooled flip
    rate (0.042 there), never tighter than the 0.02 it was before."""
    steps = json.dumps(DECODE_STEPS)
    exact = json.dumps({**DECODE_STEPS, "env": {"KVQ_EXACT_QK": "1", "KVQ_EXACT_PV": "1"}})
    # the bf16 baseline scores the same tokens in one prefill (~30 s less than 383 steps):
    # a bf16 cache has nothing to round, so prefill and decode differ by float noise only
    # (KL ~4e-6, see the chunked test), and both kernels are measured against the same run
    base = run("quality", "bf16", json.dumps({"windows": 1, "window": DECODE_STEPS["window"],
                                              "enable_prefix_caching": False}))
    fast, ref = compare_runs(base, run("quality", method, steps)), compare_runs(
        base, run("quality", method, exact))
    print(json.dumps({"method": method, "fast": fast, "exact": ref}))
    assert fast["positions"] >= DECODE_STEPS["window"] - 2
    assert fast["mean_kl"] <= 1.05 * ref["mean_kl"] + 0.001, (fast, ref)
    n = fast["confident_positions"]
    flip_rate = 1.0 - (fast["agreement_confident"] + ref["agreement_confident"]) / 2
    allowed = max(0.02, 3.0 * math.sqrt(2.0 * flip_rate * (1.0 - flip_rate) / n))
    assert fast["agreement_confident"] >= ref["agreement_confident"] - allowed, (fast, ref)


# Speculative decoding: vLLM's n-gram proposer (it runs on the CPU), 4 drafts per step.
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
               "prompt_lookup_min": 2}
# A verification step's rows (1 + 4 per sequence) run as decode tasks (csrc/cpu/attention.cpp
# kDecodeRowsMax), each the computation of a plain decode step at its position, int8 query
# included (tests/test_kernels.py test_short_chunks_equal_decode_steps: bit for bit). What
# still differs is the model's own float noise: its matmuls on other batch shapes give
# q/K/V that differ in the last bits, and a code next to a rounding boundary flips. The
# int8 query turns such last bits into whole int8 steps now and then, so both runs take the
# exact kernel (KVQ_EXACT_QK=1: fp32 Q.K; KVQ_EXACT_PV=1: fp32 P.V weights): what this test
# checks is the cache under drafts and rollbacks, with a tight tie bound.
SPEC_RUN = {"seqs": 4, "new_tokens": 64, "env": {"KVQ_EXACT_QK": "1", "KVQ_EXACT_PV": "1"}}
# Measured (AVX2 machine, 2026-12-05; first divergence of each sequence at the plain run's
# top-1 vs top-2 margin there): SmolLM2 int4_group32 and kivi2 4 of 4 identical (96 tokens
# from (97, 180, 301, 444): kivi2 3 of 4, one at a 0.0004-nat tie); Gemma 3
# (tests/test_gemma.py) int4_group32 and kivi2 4 of 4. On the default kernels: SmolLM2 (96
# tokens) 4 of 4 for both; Gemma 3 int4_group32 3 of 4 (0.009 nats), kivi2 3 of 4 (0.31).
# Before verification rows ran as decodes (prefill tiles, 2026-12-04 and this morning),
# exact kernel both sides: SmolLM2 int4_group32 2 of 4, Gemma 3 int4_group32 0 of 4 (at
# 0.001-0.21 nats); default kernels: divergences up to 0.34 nats. 3% of the plain runs'
# steps are within 0.1 nats: a window that lost the accepted rows (garbage from the next
# step on) is caught.
SPEC_TIE_NATS = 0.1


# The two: kivi2 (a 128-token window and per-channel key groups that fill across
# verification steps) and int4_group32 (no window: rejected drafts' slots are simply
# written again); KVQ_FULL_GRID=1 adds nuq3 (a 32-token window: verification steps cross
# its chunks every few steps; per-layer codebooks). Gemma 3 (sliding window): test_gemma.
@pytest.mark.parametrize("method", grid(["kivi2", "int4_group32"],
                                        ["kivi2", "int4_group32", "nuq3"]))
def test_speculative_decoding_gives_the_same_greedy_tokens(method):
    """Verification steps write 1 + 4 tokens per sequence and the scheduler rolls back the
    rejected drafts; a step may complete a residual chunk with drafts in it, which the next
    step resumes inside (vllm_kvq.residual keeps num_speculative_tokens rows more for
    that). Greedy tokens with speculation equal those without, up to a near-tie of the
    model's float noise (see SPEC_RUN). Measured: nuq3 380 draft tokens, 219 accepted
    (96 tokens); int4_group32 207 / 131, kivi2 216 / 129 (AVX2 machine, 2026-12-05).
    Without the window's lookback rows the nuq3 run raises ResidualStateError (resuming
    inside a chunk the window had left)."""
    check_speculative(method, SPEC_RUN)


def check_speculative(method: str, scenario: dict) -> None:
    """The spec scenario with and without vLLM's n-gram speculator: drafts proposed, some
    accepted and some rejected, every token generated, greedy tokens equal up to a tie."""
    plain = run("spec", method, json.dumps(scenario))
    spec = run("spec", method, json.dumps({**scenario, "speculative_config": SPECULATIVE}))
    print(json.dumps({"method": method, "drafted": spec["spec_draft_tokens"],
                      "accepted": spec["spec_accepted_tokens"],
                      "identical": sum(a == b for a, b in zip(plain["tokens"], spec["tokens"]))}))
    assert 0 < spec["spec_accepted_tokens"] < spec["spec_draft_tokens"], spec
    assert [len(t) for t in spec["tokens"]] == [scenario["new_tokens"]] * scenario["seqs"]
    assert_same_up_to_ties(spec["tokens"], plain["tokens"], plain["margins"], SPEC_TIE_NATS)
