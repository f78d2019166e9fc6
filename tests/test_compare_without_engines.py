"""`vllm-kvq compare` without engines: scoring, memory accounting, inputs, the report.

The engine-running tests are in tests/test_compare_engines.py (marked e2e)."""
import json
import math
import random

import pytest

from vllm_kvq.cli import build_parser
from vllm_kvq.tools.compare import children, cli, inputs, memory, report, scoring
from vllm_kvq.tools.compare.plan import preset
from vllm_kvq.tools.corpus import held_out_windows
from vllm_kvq.tools.evaluate import compare_runs
from vllm_kvq.formats import FormatError, parse_format

SMOL = dict(layers=30, kv_heads=3, q_heads=9, head_dim=64, vocab=49152,
            max_position_embeddings=8192)


def fake_run(method, seed=0, noise=0.0, positions=200, capacity=10000, garbage=False):
    """A run dict shaped like evaluate.run_method's: per position the true token's log-prob
    and the top-20. `noise` perturbs the log-probs; `garbage` ranks unrelated tokens."""
    rng = random.Random(seed)
    base = random.Random(1234)  # the same underlying "model" for every run
    rows = []
    for _ in range(positions):
        toks = base.sample(range(1000), 20)
        lps = sorted((base.uniform(-8, 0) for _ in toks), reverse=True)
        lps[0] = 0.0 if base.random() < 0.5 else lps[0]  # some confident positions
        if garbage:
            toks = rng.sample(range(1000, 2000), 20)
        lps = [lp + rng.gauss(0, noise) for lp in lps] if noise else lps
        z = math.log(sum(math.exp(x) for x in lps) + 1e-3)
        top = sorted(zip(toks, (x - z for x in lps)), key=lambda a: -a[1])
        rows.append({"token_lp": top[1][1], "top": top})
    return {"method": method, "capacity_tokens": capacity, "num_blocks": capacity // 128,
            "block_size": 128, "prompt": [rows],
            "greedy": [[1, 2, 3], [4, 5, 6]], "greedy_text": [[7, 8, 9, 10]]}


def test_bf16_against_itself_is_kl_zero_and_same_perplexity():
    run = fake_run("bf16")
    cmp = compare_runs(run, json.loads(json.dumps(run)))  # as read back from a worker's JSON
    assert cmp["mean_kl"] == 0.0
    assert cmp["ppl"] == cmp["ppl_base"] and cmp["ppl_change"] == 0.0
    assert cmp["agreement"] == 1.0 and cmp["greedy_identical"] == 1.0
    scored = scoring.score_quality(run, run)
    assert scored["verdict"] == "near-lossless"
    assert scored["greedy_token_agreement"] == 1.0


def test_verdicts_order_noise_and_flag_garbage():
    base = fake_run("bf16")
    small, big = fake_run("a", 1, noise=0.05), fake_run("b", 1, noise=0.8)
    kl_small = scoring.score_quality(base, small)["mean_kl"]
    kl_big = scoring.score_quality(base, big)["mean_kl"]
    assert 0 < kl_small < kl_big
    bad = scoring.score_quality(base, fake_run("c", 2, garbage=True))
    assert bad["verdict"] == "broken", bad


def test_greedy_token_agreement_counts_until_first_difference():
    assert scoring.greedy_token_agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5
    assert scoring.greedy_token_agreement([[1, 2], [3, 4]], [[1, 2], [0, 4]]) == 0.5


@pytest.mark.parametrize("method", ["bf16", "int8_token", "int4_group32", "int2_token",
                                    "kivi2", "int4_group32_r128", "kivi2_w8"])
def test_memory_row_is_the_page_layout(method):
    fmt = parse_format(method)
    row = memory.memory_row(method, SMOL, "float32")
    assert row["bytes_per_token_head"] == fmt.layout(64, 128).token_bytes
    assert row["bytes_per_token_model"] == row["bytes_per_token_head"] * 30 * 3
    assert row["ratio_vs_bf16"] == pytest.approx(fmt.ratio_vs_bf16(64, 128))
    assert row["residual_bytes_per_seq"] == fmt.residual_bytes_per_seq(30, 3, 64)
    assert (row["residual_bytes_per_seq"] > 0) == (fmt.residual_tokens > 0)
    # the fields (codes, scales, zero-points) add up to the token's bytes less padding
    assert sum(row["fields_per_token_head"].values()) == pytest.approx(
        row["bytes_per_token_head"] - fmt.bytes_per_token(64, 128)["padding"])


def test_an_8bit_window_halves_the_window_memory():
    """kivi2_w8: the same pages as kivi2, its window in 3 pool blocks instead of 6."""
    w16, w8 = (memory.memory_row(m, SMOL, "float32") for m in ("kivi2", "kivi2_w8"))
    assert w8["bytes_per_token_head"] == w16["bytes_per_token_head"]
    assert w8["window_bytes_per_seq"] * 2 == w16["window_bytes_per_seq"]
    assert w8["format"].endswith("128 recent int8") and w16["format"].endswith("recent fp")


def test_memory_row_of_vllm_peers():
    assert memory.memory_row("vllm", SMOL, "float32")["bytes_per_token_head"] == 512
    assert memory.memory_row("vllm", SMOL, "bfloat16")["ratio_vs_bf16"] == 1.0
    assert memory.memory_row("vllm-fp8", SMOL, "float32")["ratio_vs_bf16"] == 2.0


def test_error_line_finds_the_root_cause():
    log = ("(Worker pid=1) ERROR x] NotImplementedError: something specific\n"
           "(EngineCore pid=2) ERROR y] RuntimeError: Engine core initialization failed. "
           "See root cause above.\n")
    assert children.error_line(log) == "NotImplementedError: something specific"
    log2 = ("RuntimeError: Worker failed with error 'FP8 KV cache on CPU requires x86 with "
            "AVX-512 or AMX.', please check the stack trace above for the root cause\n")
    assert children.error_line(log2) == "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."


def synthetic_result(tmp_path):
    runs = {}
    for i, (m, noise) in enumerate([("bf16", 0), ("int4_group32", 0.1), ("kivi2", 0.3),
                                    ("vllm", 0.01)]):
        r = fake_run(m, i, noise=noise, capacity=10000 * (i + 1))
        r["passkey"] = [{"length": 2048, "depth": 0.5, "key": "12345", "output": " 12345",
                         "correct": True}]
        r["speed"] = [{"context": c, "prefill_s": 1.0, "prefill_tok_s": c / (1 + i),
                       "decode": [{"batch": b, "tpot_ms": 20.0 + i, "decode_tok_s":
                                   b * 1000 / (20.0 + i), "cpu_ms_per_step": 10.0 * (1 + i)}
                                  for b in (1, 4)]}
                      for c in (512, 2048)]
        runs[m] = r
    bad = fake_run("int4_group32+clobber_cache", 9, garbage=True)
    runs["int4_group32+clobber_cache"] = bad
    plan = preset(True, None, str(tmp_path / "SmolLM2"))
    kernel = {"shape": [9, 3, 64], "threads": 1, "simd_path": "avx2", "vllm_op": True,
              "rows": [{"batch": 1, "context": c, "ms": {"vllm": 0.1, "bf16": 0.12,
                                                         "int4_group32": 0.08}}
                       for c in (512, 2048)]}
    methods = ["bf16", "int4_group32", "kivi2", "vllm", "vllm-fp8",
               "int4_group32+clobber_cache"]
    failures = {"vllm-fp8": "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."}
    return report.assemble(plan, SMOL, methods, runs, failures, kernel, {})


def test_report_tables_json_and_plots(tmp_path):
    result = synthetic_result(tmp_path)
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["bf16"]["quality"]["mean_kl"] == 0.0
    assert rows["bf16"]["speed_ratio"][0]["decode"]["1"] == 1.0
    assert rows["int4_group32"]["capacity_ratio"] == 2.0
    assert rows["kivi2"]["speed_ratio"][0]["decode_cpu"]["4"] == pytest.approx(1 / 3)
    assert rows["int4_group32+clobber_cache"]["quality"]["verdict"] == "broken"
    assert rows["vllm-fp8"]["unavailable"].startswith("FP8 KV cache on CPU")
    files = report.write_outputs(result, tmp_path, "vllm-kvq compare --quick")
    md = files["report"].read_text()
    for needle in ("## Memory", "## Quality", "## Speed", "## Attention kernel alone",
                   "`kivi2`", "unavailable: FP8 KV cache", "broken", "vllm-kvq compare --quick",
                   "quality_vs_bytes.png", "speed_vs_context.png", "CPU time per decode step",
                   "per-request timestamps"):
        assert needle in md, needle
    assert json.loads(files["json"].read_text())["rows"][0]["method"] == "bf16"
    assert {p.name for p in files["plots"]} == {"quality_vs_bytes.png",
                                                 "speed_vs_context.png",
                                                 "kernel_vs_context.png"}
    for p in files["plots"]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10000
    # the report can be rewritten from results.json alone
    (tmp_path / "report.md").unlink()
    assert cli.main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").read_text() == md


def test_cli_has_compare_and_checks_methods_before_any_engine(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
        "hidden_size": 576, "vocab_size": 49152, "max_position_embeddings": 8192}))
    args = build_parser().parse_args(["compare", str(model), "--quick", "--methods",
                                      "int4_group32,vllm", "--batches", "1,32"])
    plan = cli.plan_from_args(args)
    assert plan.methods == ["int4_group32", "vllm"]
    assert plan.contexts == [512, 2048] and plan.max_num_seqs == 32
    assert plan.max_model_len <= 8192
    full = cli.plan_from_args(build_parser().parse_args(["compare", str(model)]))
    assert full.contexts == [512, 2048, 8000] and "vllm-fp8" in full.methods
    assert full.max_model_len <= 8192
    with pytest.raises(FormatError):
        cli.plan_from_args(build_parser().parse_args(
            ["compare", str(model), "--methods", "int5_group32"]))
    with pytest.raises(SystemExit):
        cli.plan_from_args(build_parser().parse_args(["compare", str(tmp_path / "nope")]))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vllm_kvq.model_prep import ensure_default_model
    return AutoTokenizer.from_pretrained(str(ensure_default_model(verbose=False)))


def test_passkey_prompts_have_exact_lengths_and_one_key(tokenizer):
    items = inputs.passkey_items(tokenizer, [1024, 2048], 3, seed=0)
    assert [it["length"] for it in items] == [1024] * 3 + [2048] * 3
    assert items == inputs.passkey_items(tokenizer, [1024, 2048], 3, seed=0)  # seeded
    depths = [it["depth"] for it in items[:3]]
    assert depths == sorted(depths) and 0 < depths[0] and depths[-1] < 1
    for it in items:
        assert len(it["ids"]) == it["length"]
        text = tokenizer.decode(it["ids"])
        assert text.count(it["key"]) == 2 and text.rstrip().endswith("The pass key is")
    # a shared filler stream: prompts agree up to the earlier needle (prefix-cache reuse)
    a, b = items[0], items[1]
    assert a["ids"][:a["needle_at"]] == b["ids"][:a["needle_at"]]


def test_held_out_windows_are_not_the_tests_windows(tokenizer):
    from vllm_kvq.tools.corpus import token_windows

    held = held_out_windows(tokenizer, 3, 512)
    tests = token_windows(tokenizer, 4, 1024, 0)
    assert all(len(w) == 512 for w in held) and len({tuple(w) for w in held}) == 3
    grams = lambda w: set(zip(*(w[i:] for i in range(8))))  # noqa: E731
    for h in held:
        for t in tests:  # other speeches: at most a stock phrase in common
            assert len(grams(h) & grams(t)) < 0.02 * len(grams(h))
