"""`vllm-kvq serve`: vLLM's own OpenAI server with our backend, talked to with `openai`."""
import contextlib
import json
import os
import subprocess
import sys

import httpx
import openai
import pytest

from serve_process import API_KEY, free_port, running

from vllm_kvq.cli import serve_command
from vllm_kvq.formats import FormatError, parse_format
from vllm_kvq.model_prep import MODELS, ensure_model
from vllm_kvq.serve_defaults import MAX_BUDGET, MIN_BUDGET
from vllm_kvq.tools.evaluate import GREEDY_PROMPTS

pytestmark = pytest.mark.e2e
# One server per model: SmolLM2 with a residual window (kivi2, also the OpenAI-API and
# load-test server) and Gemma 3 (sliding-window layers, head_dim 256, one kv head) with
# kivi2 given as a model folder, served by two tensor-parallel ranks (its kv head
# replicated on both; serve sets the CPU thread binding). Every method's engine path
# (quality, capacity; nuq3 finding its shipped calibration by itself) is covered by
# tests/test_engine_cache.py and tests/test_gemma.py through the same engine; these prove
# the server wiring. (A nuq3 server was dropped for suite time: 41 s, the same wiring.)
# (model, method, tensor-parallel ranks, a word its greedy answer to GREEDY_PROMPTS[0] holds)
SERVED = [("smollm2", "kivi2", 1, "Paris"),
          ("gemma3", "kivi2", 2, "France")]


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)


@pytest.mark.parametrize("model,method,tp,word", SERVED,
                         ids=[f"{m}-{k}" + (f"-tp{n}" if n > 1 else "") for m, k, n, _ in SERVED])
def test_every_method_serves_sensible_deterministic_text(model, method, tp, word, servers):
    folder = None if model == "smollm2" else str(ensure_model(MODELS[model], verbose=False))
    base = servers(method, folder, ("--tensor-parallel-size", str(tp)) if tp > 1 else ())
    cfg = httpx.get(f"{base}/kvq/config").json()
    assert cfg["method"] == method and cfg["tensor_parallel_size"] == tp, cfg
    c = client(base)
    served = c.models.list().data[0].id
    texts = [c.completions.create(model=served, prompt=GREEDY_PROMPTS[0], max_tokens=12,
                                  temperature=0.0).choices[0].text for _ in range(2)]
    assert word in texts[0] and texts[0] == texts[1], texts


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


def meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(key + ":"))


@contextlib.contextmanager
def memory_held_elsewhere(nbytes: int):
    """Another process holding (touching) nbytes of memory while the block runs."""
    code = ("import sys, time; n = int(sys.argv[1]); b = bytearray(n); "
            "b[::4096] = b'\\x01' * len(range(0, n, 4096)); print('ready', flush=True); "
            "time.sleep(3600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(nbytes)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield
    finally:
        proc.kill()
        proc.wait()


def test_readme_serve_command_keeps_its_defaults_flag_by_flag():
    """The README's command with extra flags (a port, two pipeline stages), started while
    another process holds several GiB (so that vLLM's own default, 0.92 of the node for the
    KV cache, would refuse to start): every other default holds (kivi2, 16 sequences, a KV
    budget that fits what is free), the CPU workers get their thread binding by themselves,
    the startup log and /kvq/config give the window's memory from the layout, and it
    answers."""
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}
    cmd = ["bash", os.path.join(root, "scripts", "serve.sh"), "--port", str(port),
           "--pipeline-parallel-size", "2", "--dtype", "float32"]
    held = min(6 << 30, meminfo("MemAvailable") // 4)
    with memory_held_elsewhere(held), running(cmd, port, "kvq-serve-readme", env=env) as base:
        assert meminfo("MemAvailable") < 0.92 * meminfo("MemTotal")
        cfg = httpx.get(f"{base}/kvq/config").json()
        assert cfg["method"] == "kivi2" and cfg["max_num_seqs"] == 16, cfg
        assert cfg["pipeline_parallel_size"] == 2 and cfg["num_layers"] == 30, cfg
        budget = cfg["kv_cache_memory_bytes"]
        assert MIN_BUDGET <= budget <= MAX_BUDGET, cfg
        # the window's blocks per running sequence, and the capacity of each stage's budget
        # (15 layers of pages), both from the layout
        fmt = parse_format("kivi2")
        assert cfg["window_blocks_per_seq"] == fmt.window_blocks_per_seq(64, 128) == 6, cfg
        assert cfg["window_bytes_per_seq"] == 6 * 128 * cfg["bytes_per_token"], cfg
        page = fmt.layout(64, 128).plane_bytes * 3 * 15
        assert cfg["capacity_tokens"] == budget // page * 128, cfg
        log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "kvq-serve-readme.log")).read()
        assert (f"window 128 tokens in 6 blocks = {cfg['window_bytes_per_seq']} bytes per "
                f"running sequence") in log
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        model = c.models.list().data[0].id
        text = c.completions.create(model=model, prompt=GREEDY_PROMPTS[0], max_tokens=12,
                                    temperature=0.0).choices[0].text
        assert "Paris" in text, text


def test_serve_rejects_a_bad_method_before_vllm_starts():
    with pytest.raises(FormatError, match="kvq.method='int5_group32'"):
        serve_command("/model", {"method": "int5_group32"}, [])


def test_serve_flags_reach_the_kvq_config():
    """`vllm-kvq serve --kv-window-bits 8` (and the other --kv-* flags) become keys of the
    kvq config vLLM receives; a bad value fails before vLLM starts."""
    from vllm_kvq.cli import build_parser, kvq_from_flags
    args, rest = build_parser().parse_known_args(
        ["serve", "/model", "--kv-method", "kivi4", "--kv-window-bits", "8", "--port", "9"])
    kvq = kvq_from_flags(args)
    assert kvq == {"method": "kivi4", "window_bits": 8} and rest == ["/model", "--port", "9"]
    cmd = serve_command("/model", kvq, [])
    assert json.loads(cmd[cmd.index("--additional-config") + 1]) == {"kvq": kvq}
    with pytest.raises(FormatError, match="kvq.window_bits=4 is not allowed"):
        serve_command("/model", {"method": "kivi4", "window_bits": 4}, [])
    args, _ = build_parser().parse_known_args(["serve", "--kv-sink-tokens", "1"])
    assert kvq_from_flags(args) == {"method": "kivi2", "sink_tokens": 1}
    with pytest.raises(FormatError, match="kvq.sink_tokens=2 is not allowed; allowed: 0, 1"):
        serve_command("/model", {"method": "kivi2", "sink_tokens": 2}, [])
