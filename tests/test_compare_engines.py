"""`vllm-kvq compare` on real engines: the real model, real text, our backend.

The quality runs are tests/e2e_driver.py's "quality" scenario (2 x 1024 tokens), shared
through conftest.run_engine with tests/test_engine_cache.py: the same engine runs serve both.
The scoring, report and plots without engines are tested in
tests/test_compare_without_engines.py.
"""
import json
import subprocess
import sys

import pytest
from conftest import run_engine as run

from vllm_kvq.tools.compare.scoring import score_quality
from vllm_kvq.formats import parse_format

pytestmark = pytest.mark.e2e
# the same extra JSON as tests/test_engine_cache.py, so the session's cached runs are shared
FAULT = json.dumps({"env": {"VLLM_KVQ_FAULT": "clobber_cache"}})


def kl(method, extra="{}"):
    return score_quality(run("quality", "bf16"), run("quality", method, extra))


def test_bf16_against_itself_real_run():
    base = run("quality", "bf16")
    cmp = score_quality(base, base)
    assert cmp["mean_kl"] == 0.0 and cmp["ppl"] == cmp["ppl_base"]
    assert cmp["positions"] >= 2000 and cmp["verdict"] == "near-lossless"


def test_a_broken_cache_is_detected():
    """Every stored byte clobbered (VLLM_KVQ_FAULT): the comparison must call it broken,
    while the same format intact is not."""
    good = kl("int4_group32")
    bad = kl("int4_group32", FAULT)
    assert good["verdict"] != "broken", good
    assert bad["verdict"] == "broken", bad
    assert bad["mean_kl"] > 10 * good["mean_kl"]


def test_quality_orders_by_bits():
    """8, 4 and 2 bits (runs the other tests need too: int8_token and int4_group32 are
    QUALITY formats of tests/test_engine_cache.py, int2_token the per-token 2-bit one the
    KIVI test below compares with)."""
    kls = {m: kl(m)["mean_kl"] for m in ("int8_token", "int4_group32", "int2_token")}
    print(json.dumps(kls))
    assert 0 < kls["int8_token"] < kls["int4_group32"] < kls["int2_token"], kls


def test_kivi2_beats_per_token_int2_at_similar_bytes():
    kivi, tok = parse_format("kivi2"), parse_format("int2_token")
    ratio = kivi.layout(64, 128).token_bytes / tok.layout(64, 128).token_bytes
    assert 0.8 <= ratio <= 1.25, ratio  # similar bytes per token (48 vs 40)
    a, b = kl("kivi2"), kl("int2_token")
    print(json.dumps({"kivi2": a, "int2_token": b}))
    assert a["mean_kl"] < b["mean_kl"], (a, b)
    assert a["agreement"] > b["agreement"], (a, b)


def test_compare_command_end_to_end(tmp_path):
    """The real command, tiny: bf16 through a real engine (quality, speed, passkey,
    capacity); report, JSON and the speed plot come out, bf16 scores KL 0 against itself.
    That a clobbered cache is called broken is test_a_broken_cache_is_detected's (same
    scoring code; the command's --inject-fault only names that run), the quality plot and
    a broken row's report are tests/test_compare_without_engines.py's."""
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "vllm_kvq.cli", "compare", "--methods", "bf16",
           "--quality-windows", "1", "--quality-window", "512",
           "--contexts", "512", "--batches", "1", "--decode-tokens", "4",
           "--passkey-lengths", "1024", "--passkey-positions", "1", "--no-kernel",
           "--kv-budget", str(256 << 20), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["bf16"]["quality"]["mean_kl"] == 0.0
    assert rows["bf16"]["speed"][0]["decode"][0]["decode_tok_s"] > 0
    assert rows["bf16"]["capacity_tokens"] > 0
    assert (out / "speed_vs_context.png").exists()  # quality plot: none without a format
    assert "`bf16`" in (out / "report.md").read_text()
