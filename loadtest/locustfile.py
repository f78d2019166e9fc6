"""Locust load against a local `vllm-kvq serve`: completions and chat, streaming and not,
prompts cut from real text (State of the Union speeches, vllm_kvq/tools/corpus.py).

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000 \
        -u 4 -r 2 --run-time 30s --kvq-api-key KEY

Bounded and loopback only: the host must resolve to a loopback address; without
`--run-time` the test stops after --kvq-max-seconds; it stops after --kvq-max-requests
requests. Every user pauses 0 s between requests unless --kvq-think-time says otherwise.

Prompts: --kvq-prompt-min..--kvq-prompt-max tokens (uniform, seeded per user) from a random
window of a random speech; completions send the token ids themselves (exact length), chat
sends the decoded text. Requests cycle through the --kvq-mix kinds in order across all users
(the n-th request of the run is kind n mod the mix's length). Outputs: --kvq-max-tokens (with --kvq-ignore-eos, exactly that
many). Streaming requests also record time to first token ("ttft") and time per output
token after the first ("tpot") as entries of request type METRIC; --kvq-samples PATH writes
every request as a JSON line (what loadtest/capacity.py reads).
"""
from __future__ import annotations

import ipaddress
import json
import logging
import random
import socket
import time
from urllib.parse import urlparse

import gevent
from locust import HttpUser, events, task
from locust.exception import StopUser

KINDS = ("completion", "completion_stream", "chat", "chat_stream")
log = logging.getLogger("kvq.locust")


@events.init_command_line_parser.add_listener
def _options(parser):
    g = parser.add_argument_group("vllm-kvq")
    g.add_argument("--kvq-api-key", default="", env_var="KVQ_API_KEY",
                   help="bearer token (vllm serve --api-key)")
    g.add_argument("--kvq-mix", default=",".join(KINDS),
                   help=f"comma list of request kinds, picked uniformly: {', '.join(KINDS)}")
    g.add_argument("--kvq-prompt-min", type=int, default=64)
    g.add_argument("--kvq-prompt-max", type=int, default=512)
    g.add_argument("--kvq-max-tokens", type=int, default=32)
    g.add_argument("--kvq-ignore-eos", action="store_true",
                   help="generate exactly --kvq-max-tokens (vLLM's ignore_eos)")
    g.add_argument("--kvq-think-time", type=float, default=0.0,
                   help="seconds a user waits between requests")
    g.add_argument("--kvq-seed", type=int, default=0)
    g.add_argument("--kvq-tokenizer", default="",
                   help="folder with tokenizer.json (default: the served model's folder)")
    g.add_argument("--kvq-max-requests", type=int, default=2000,
                   help="stop after this many requests")
    g.add_argument("--kvq-max-seconds", type=float, default=300,
                   help="stop after this long when --run-time is not given")
    g.add_argument("--kvq-samples", default="", help="write one JSON line per request here")


class Prompts:
    """Token windows of real text; shared by all users of this process."""

    def __init__(self, tokenizer_dir: str, longest: int, seed: int, n_windows: int = 16):
        from pathlib import Path

        from tokenizers import Tokenizer

        from vllm_kvq.tools.corpus import token_windows

        tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))

        class _Encode:  # the encode() that corpus.token_windows expects
            @staticmethod
            def encode(text, add_special_tokens=False):
                return tok.encode(text, add_special_tokens=add_special_tokens).ids

        self.decode = tok.decode
        # room for a random start offset, so that no two prompts share whole blocks
        self.slack = 512
        self.windows = token_windows(_Encode, n_windows, longest + self.slack, seed=seed)

    def draw(self, rng: random.Random, lo: int, hi: int) -> list[int]:
        w = rng.choice(self.windows)
        n = rng.randint(lo, hi)
        start = rng.randrange(0, self.slack)
        return w[start:start + n]


STATE: dict = {"prompts": None, "model": None, "count": 0, "samples": [], "error": None}


def _check_loopback(host: str) -> None:
    name = urlparse(host).hostname or ""
    addrs = {a[4][0] for a in socket.getaddrinfo(name, None)} if name else set()
    bad = [a for a in addrs if not ipaddress.ip_address(a.split("%")[0]).is_loopback]
    if not addrs or bad:
        raise SystemExit(f"kvq locustfile: --host {host!r} is not a loopback address "
                         f"({sorted(addrs) or 'unresolved'}); this load test only targets "
                         f"a server on this machine")


@events.test_start.add_listener
def _on_start(environment, **_):
    # locust logs an exception raised here and spawns the users anyway: record it, stop
    # the run, and let every user refuse to start (KVQUser.on_start)
    STATE.update(prompts=None, model=None, count=0, samples=[], error=None)
    try:
        _setup(environment)
    except BaseException as e:  # noqa: BLE001 - includes the SystemExit of bad options
        STATE["error"] = f"{type(e).__name__}: {e}"
        log.error("kvq locustfile: %s", STATE["error"])
        environment.process_exit_code = 2
        _stop(environment, "setup failed")


def _setup(environment) -> None:
    opts = environment.parsed_options
    _check_loopback(environment.host or "")
    if opts.kvq_prompt_min < 1 or opts.kvq_prompt_max < opts.kvq_prompt_min:
        raise SystemExit("kvq locustfile: need 1 <= --kvq-prompt-min <= --kvq-prompt-max")
    import requests

    headers = {"Authorization": f"Bearer {opts.kvq_api_key}"} if opts.kvq_api_key else {}
    models = requests.get(f"{environment.host}/v1/models", headers=headers, timeout=30)
    models.raise_for_status()
    STATE["model"] = models.json()["data"][0]["id"]
    tok_dir = opts.kvq_tokenizer or STATE["model"]
    STATE["prompts"] = Prompts(tok_dir, opts.kvq_prompt_max, opts.kvq_seed)
    if not opts.run_time:
        gevent.spawn_later(opts.kvq_max_seconds, _stop, environment, "--kvq-max-seconds")


def _stop(environment, why: str) -> None:
    log.info("kvq locustfile: stopping (%s)", why)
    if environment.runner is not None:
        environment.runner.quit()


@events.test_stop.add_listener
def _on_stop(environment, **_):
    path = environment.parsed_options.kvq_samples
    if path:
        with open(path, "w") as f:
            for s in STATE["samples"]:
                f.write(json.dumps(s) + "\n")


class KVQUser(HttpUser):
    def wait_time(self) -> float:
        return self.opts.kvq_think_time

    def on_start(self):
        if STATE["error"] or STATE["prompts"] is None:
            raise StopUser()
        _check_loopback(self.host or "")
        opts = self.environment.parsed_options
        self.opts = opts
        self.kinds = [k.strip() for k in opts.kvq_mix.split(",") if k.strip()]
        unknown = set(self.kinds) - set(KINDS)
        if unknown or not self.kinds:
            raise SystemExit(f"kvq locustfile: unknown --kvq-mix kinds {sorted(unknown)}; "
                             f"allowed: {', '.join(KINDS)}")
        self.rng = random.Random(opts.kvq_seed * 100003 + id(self) % 100003)
        if opts.kvq_api_key:
            self.client.headers["Authorization"] = f"Bearer {opts.kvq_api_key}"

    @task
    def one_request(self):
        if STATE["count"] >= self.opts.kvq_max_requests:
            _stop(self.environment, "--kvq-max-requests")
            return
        # one round robin over the whole run, not per user: any len(kinds) consecutive
        # requests cover every kind, however the users' request counts fall
        kind = self.kinds[STATE["count"] % len(self.kinds)]
        STATE["count"] += 1
        ids = STATE["prompts"].draw(self.rng, self.opts.kvq_prompt_min, self.opts.kvq_prompt_max)
        body = {"model": STATE["model"], "max_tokens": self.opts.kvq_max_tokens,
                "temperature": 0.0, "ignore_eos": self.opts.kvq_ignore_eos}
        stream = kind.endswith("_stream")
        if kind.startswith("chat"):
            url = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": STATE["prompts"].decode(ids)}]
        else:
            url = "/v1/completions"
            body["prompt"] = ids
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        sample = {"kind": kind, "t_start": time.time(), "ok": False, "prompt_ids": len(ids)}
        t0 = time.perf_counter()
        with self.client.post(url, json=body, stream=stream, catch_response=True,
                              name=kind, timeout=600) as resp:
            try:
                if resp.status_code != 200:
                    raise ValueError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                if stream:
                    usage, first, last, chunks = None, None, None, 0
                    for line in resp.iter_lines():
                        if not line or not line.startswith(b"data: "):
                            continue
                        data = line[6:]
                        if data == b"[DONE]":
                            break
                        msg = json.loads(data)
                        if msg.get("error"):
                            raise ValueError(f"stream error: {msg['error']}")
                        if msg.get("usage"):
                            usage = msg["usage"]
                        for ch in msg.get("choices") or []:
                            piece = ch.get("text") if "text" in ch else \
                                (ch.get("delta") or {}).get("content")
                            if piece:
                                now = time.perf_counter()
                                first = first if first is not None else now
                                last = now
                                chunks += 1
                    if usage is None or first is None:
                        raise ValueError("stream ended without text or usage")
                    sample["ttft_s"] = first - t0
                    n_out = usage["completion_tokens"]
                    if n_out > 1:
                        sample["tpot_s"] = (last - first) / (n_out - 1)
                else:
                    usage = resp.json()["usage"]
                    n_out = usage["completion_tokens"]
                sample.update(ok=True, prompt_tokens=usage["prompt_tokens"],
                              completion_tokens=n_out)
                elapsed = time.perf_counter() - t0
                # the whole request, not just its headers (what locust timed for a stream)
                resp.request_meta["response_time"] = elapsed * 1000
                resp.success()
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                elapsed = time.perf_counter() - t0
                sample["error"] = f"{type(e).__name__}: {e}"[:300]
                resp.failure(sample["error"])
        sample["latency_s"] = elapsed
        STATE["samples"].append(sample)
        if sample.get("ttft_s") is not None:
            self._metric("ttft", sample["ttft_s"])
        if sample.get("tpot_s") is not None:
            self._metric("tpot", sample["tpot_s"])

    def _metric(self, name: str, seconds: float) -> None:
        self.environment.events.request.fire(
            request_type="METRIC", name=name, response_time=seconds * 1000,
            response_length=0, exception=None, context={})
