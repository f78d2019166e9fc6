"""vllm_kvq/serving.py (KV gauges + GET /kvq/config) and `vllm-kvq serve`'s command line,
without an engine: a stand-in vllm_config carries the fields the API server reads."""
import asyncio
import os
import re
from types import SimpleNamespace

import pytest
import torch

from vllm_kvq import cli
from vllm_kvq.serve_defaults import MAX_BUDGET, MIN_BUDGET, parallel_env, with_defaults
from vllm_kvq.serving import ROUTE, KVQEndpointPlugin, kv_summary

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 128


def fake_vllm_config(kvq: dict | None, cache_dtype="auto", dtype=torch.float32,
                     num_blocks=100, max_num_seqs=8, budget=None):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model = SimpleNamespace(
        get_num_layers=lambda par: LAYERS, get_num_kv_heads=lambda par: HEADS,
        get_head_size=lambda: HEAD_DIM, dtype=dtype, served_model_name=["smol"], model="/m")
    cache = SimpleNamespace(block_size=BLOCK, num_gpu_blocks=num_blocks,
                            kv_cache_memory_bytes=budget, cache_dtype=cache_dtype)
    return SimpleNamespace(
        model_config=model, cache_config=cache, parallel_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        attention_config=SimpleNamespace(
            backend=AttentionBackendEnum.CUSTOM if kvq else None),
        additional_config={"kvq": kvq} if kvq else {})


def test_summary_of_a_quantized_cache():
    s = kv_summary(fake_vllm_config({"method": "kivi2"}))
    assert (s["method"], s["backend"], s["model"]) == ("kivi2", "vllm_kvq", "smol")
    assert s["bytes_per_token"] == 48 * LAYERS * HEADS == 4320  # scales included
    assert s["bits_per_value"] == 3.0 and s["ratio_vs_bf16"] == pytest.approx(16 / 3)
    assert s["capacity_tokens"] == 100 * BLOCK
    # the window's 128 tokens x (K+V) x 64 values in 16 bits (an fp32 model too) per layer
    # and head, in 6 pool blocks of 24 rows per running sequence (csrc/kvq_layout.h)
    assert s["residual_bytes_per_seq"] == 128 * 2 * HEAD_DIM * 2 * LAYERS * HEADS
    assert s["window_blocks_per_seq"] == 6
    assert s["window_bytes_per_seq"] == 6 * BLOCK * s["bytes_per_token"]
    assert s["window_bytes_per_seq"] >= s["residual_bytes_per_seq"]
    assert s["window_bytes_at_max_num_seqs"] == 8 * s["window_bytes_per_seq"]
    assert s["bf16_bytes_per_token"] == 23040


def test_summary_of_vllms_own_cache():
    s = kv_summary(fake_vllm_config(None, cache_dtype="fp8"))
    assert s["method"] == "vllm:fp8" and s["backend"] == "vllm"
    assert s["bytes_per_token"] == 11520 and s["ratio_vs_bf16"] == 2.0
    assert s["residual_tokens"] == 0 and s["config"] is None
    s = kv_summary(fake_vllm_config(None, dtype=torch.float32))  # auto = the model's dtype
    assert s["bytes_per_token"] == 46080 and s["ratio_vs_bf16"] == 0.5


def test_endpoint_plugin_serves_route_and_gauges():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from prometheus_client import REGISTRY, generate_latest

    app = FastAPI()
    plugin = KVQEndpointPlugin()
    assert plugin.required_tasks == ("generate",)  # not on the engine-less render server
    plugin.attach_router(app)
    client = TestClient(app)
    assert client.get(ROUTE).status_code == 503  # before the engine reported its blocks
    engine = SimpleNamespace(vllm_config=fake_vllm_config({"method": "int4_group32"},
                                                          num_blocks=7))
    asyncio.run(plugin.init_state(engine, app.state, None))
    body = client.get(ROUTE).json()
    assert body["method"] == "int4_group32" and body["capacity_tokens"] == 7 * BLOCK
    text = generate_latest(REGISTRY).decode()
    for name, value in (("bytes_per_token", 7200.0), ("bits_per_value", 5.0),
                        ("ratio_vs_bf16", 3.2), ("residual_tokens", 0.0),
                        ("capacity_tokens", 896.0)):
        assert f'kvq:{name}{{method="int4_group32"}} {value}' in text, name
    assert re.search(r'kvq:method_info\{key="int4/group32",method="int4_group32",'
                     r'value="int4/group32"\} 1\.0', text)


def test_serve_plugins_allows_ours_and_keeps_the_rest():
    assert cli.serve_plugins("a, b") == "a,b,vllm_kvq,vllm_kvq_routes"
    assert cli.serve_plugins("vllm_kvq_routes,vllm_kvq") == "vllm_kvq_routes,vllm_kvq"
    names = cli.serve_plugins(None).split(",")
    assert names[-1] == "vllm_kvq_routes" and "vllm_kvq" in names
    assert len(names) == len(set(names))


class Exec(Exception):
    pass


@pytest.fixture
def serve_argv(monkeypatch):
    def fake_exec(path, argv):
        raise Exec(argv)

    monkeypatch.setattr(os, "execv", fake_exec)
    monkeypatch.setattr("vllm_kvq.model_prep.ensure_default_model", lambda: "/default")
    monkeypatch.setenv("VLLM_PLUGINS", "")  # records the old value: cmd_serve sets it
    monkeypatch.delenv("VLLM_PLUGINS")

    def run(*args):
        with pytest.raises(Exec) as e:
            cli.main(["serve", *args])
        argv = e.value.args[0]
        return argv[argv.index("serve"):]
    return run


def test_serve_model_is_first_and_flags_pass_through(serve_argv, monkeypatch):
    argv = serve_argv("--kv-method", "int4_group32", "--host", "127.0.0.1", "--port", "1")
    assert argv[:2] == ["serve", "/default"]  # --host's value is not taken for the model
    assert argv[-4:] == ["--host", "127.0.0.1", "--port", "1"]
    assert '{"kvq": {"method": "int4_group32"}}' in argv
    argv = serve_argv("/my/model", "--kv-method", "kivi2", "--port", "2")
    assert argv[:2] == ["serve", "/my/model"] and argv[-2:] == ["--port", "2"]
    assert {"vllm_kvq", "vllm_kvq_routes"} <= set(os.environ["VLLM_PLUGINS"].split(","))


def test_serve_defaults_hold_flag_by_flag(serve_argv, monkeypatch):
    """One extra flag keeps every other default (16 sequences, a budget that fits)."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    argv = serve_argv("--port", "8011")
    assert argv[argv.index("--max-num-seqs") + 1] == "16"
    budget = int(argv[argv.index("--kv-cache-memory-bytes") + 1])
    assert MIN_BUDGET <= budget <= MAX_BUDGET
    argv = serve_argv("--max-num-seqs", "4", "--kv-cache-memory-bytes", "123456789")
    assert argv.count("--max-num-seqs") == 1 and argv.count("--kv-cache-memory-bytes") == 1
    assert "--kv-cache-memory-bytes=5" in serve_argv("--kv-cache-memory-bytes=5")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert "--kv-cache-memory-bytes" not in serve_argv()
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert "--kv-cache-memory-bytes" not in serve_argv("--gpu-memory-utilization", "0.5")


def test_serve_budget_fits_what_is_free():
    gib = 1 << 30
    # half of what is left after weights (x2) and the margin, in 64 MiB steps
    flags, notes = with_defaults("/nonexistent", [], {}, available=6 * gib)
    assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str((6 - 1 - 2) * gib // 2)
    assert "no KV budget given" in notes[0]
    flags, _ = with_defaults("/nonexistent", [], {}, available=100 * gib)
    assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(MAX_BUDGET)
    with pytest.raises(ValueError, match="pass --kv-cache-memory-bytes"):
        with_defaults("/nonexistent", [], {}, available=3 * gib)


def test_parallel_workers_get_a_thread_binding():
    assert parallel_env(["--port", "1"], {}, [0, 1]) == {}
    assert parallel_env(["--pipeline-parallel-size", "2"], {}, [0, 1]) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert parallel_env(["-tp=2"], {}, [0, 1, 2, 3]) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}
    assert parallel_env(["-tp", "2"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, [0, 1]) == {}
    with pytest.raises(ValueError, match="need at least 4 cores"):
        parallel_env(["-tp", "2", "-pp", "2"], {}, [0, 1])


def test_vllm_main_reports_the_cpu_build_as_vllm(monkeypatch):
    """vllm-cpu installs no "vllm" distribution; vLLM's CLI asks for one."""
    import importlib.metadata as md

    calls = {}

    def fake_cli():
        calls["version"] = md.version("vllm")
        return 0

    monkeypatch.setattr("vllm.entrypoints.cli.main.main", fake_cli)
    monkeypatch.setattr(md, "version", md.version)  # restored after the test
    with pytest.raises(SystemExit):
        cli.vllm_main()
    try:
        expect = md.distribution("vllm").version
    except md.PackageNotFoundError:
        expect = md.distribution("vllm-cpu").version + "+cpu"
    assert calls["version"] == expect
