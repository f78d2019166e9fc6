"""`vllm-kvq serve`: vLLM's own OpenAI server with our backend, talked to with `openai`."""
import os

import httpx
import openai
import pytest

from serve_process import API_KEY, free_port, running

from vllm_kvq.cli import serve_command
from vllm_kvq.formats import FormatError
from vllm_kvq.serve_defaults import MAX_BUDGET, MIN_BUDGET
from vllm_kvq.tools.evaluate import GREEDY_PROMPTS

pytestmark = pytest.mark.e2e
# One server per kind of cache path: plain per-group int, a residual window (kivi2, also
# the OpenAI-API test's server), and a nuq codebook format whose calibration, shipped for
# the default model, is found by itself. Every method's engine path (quality, capacity) is
# covered by tests/test_engine_cache.py; these prove the server wiring, started once each.
METHODS = ["int4_group32", "kivi2", "nuq3"]


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_serves_sensible_deterministic_text(method, servers):
    base = servers(method)
    c = client(base)
    model = c.models.list().data[0].id
    texts = [c.completions.create(model=model, prompt=GREEDY_PROMPTS[0], max_tokens=12,
                                  temperature=0.0).choices[0].text for _ in range(2)]
    assert "Paris" in texts[0] and texts[0] == texts[1], texts


def test_openai_api_and_bad_input_on_a_quantized_cache(servers):
    base = servers("kivi2")
    c = client(base)
    model = c.models.list().data[0].id
    chat = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0.0)
    assert "Paris" in chat.choices[0].message.content
    stream = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=16, temperature=0.0, stream=True)
    pieces = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert len(pieces) > 3 and "".join(pieces).strip()
    # bad input: the proper 4xx, and the server keeps serving
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=model, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=model, prompt="word " * 5000, max_tokens=4)
    r = httpx.post(f"{base}/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {API_KEY}",
                            "Content-Type": "application/json"})
    assert 400 <= r.status_code < 500
    metrics = httpx.get(f"{base}/metrics").text
    assert "vllm:num_requests_running" in metrics
    again = c.completions.create(model=model, prompt="The capital of France is",
                                 max_tokens=8, temperature=0.0)
    assert "Paris" in again.choices[0].text


def test_readme_serve_command_keeps_its_defaults_flag_by_flag():
    """The README's command with extra flags (a port, two pipeline stages): every other
    default holds (kivi2, 16 sequences, a KV budget that fits what is free), the CPU
    workers get their thread binding by themselves, and it answers."""
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}
    cmd = ["bash", os.path.join(root, "scripts", "serve.sh"), "--port", str(port),
           "--pipeline-parallel-size", "2", "--dtype", "float32"]
    with running(cmd, port, "kvq-serve-readme", env=env) as base:
        cfg = httpx.get(f"{base}/kvq/config").json()
        assert cfg["method"] == "kivi2" and cfg["max_num_seqs"] == 16, cfg
        assert cfg["pipeline_parallel_size"] == 2 and cfg["num_layers"] == 30, cfg
        assert MIN_BUDGET <= cfg["kv_budget_bytes"] <= MAX_BUDGET, cfg
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        model = c.models.list().data[0].id
        text = c.completions.create(model=model, prompt=GREEDY_PROMPTS[0], max_tokens=12,
                                    temperature=0.0).choices[0].text
        assert "Paris" in text, text


def test_serve_rejects_a_bad_method_before_vllm_starts():
    with pytest.raises(FormatError, match="kvq.method='int5_group32'"):
        serve_command("/model", {"method": "int5_group32"}, [])
