"""A real `vllm-kvq serve` process for the serving tests (fp32 model, 256 MiB of KV, 8
sequences, an API key); conftest's session fixture `servers` shares them across files."""
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx

API_KEY = "kvq-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(method: str, model: str | None = None, extra: tuple[str, ...] = ()):
    """`vllm-kvq serve [model]` (default: the default model) with the tests' fixed settings,
    then `extra` flags (e.g. --tensor-parallel-size 2: the thread binding is serve's job)."""
    port = free_port()
    exe = shutil.which("vllm-kvq") or os.path.join(os.path.dirname(sys.executable), "vllm-kvq")
    cmd = [exe, "serve", *([model] if model else []), "--kv-method", method, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-num-seqs", "8", "--max-model-len", "2048",
           "--kv-cache-memory-bytes", str(256 << 20), "--api-key", API_KEY, "--seed", "0",
           *extra]
    name = (f"kvq-serve-{method}" + (f"-{os.path.basename(model)}" if model else "") +
            "".join(f"-{x.strip('-')}" for x in extra))
    with running(cmd, port, name) as base:
        yield base


@contextlib.contextmanager
def running(cmd: list[str], port: int, name: str, env: dict | None = None):
    """A server command until it answers /health on `port`; stopped on exit."""
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"{name}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                log.flush()
                raise AssertionError(f"server exited {proc.returncode}: "
                                     f"{open(log.name).read()[-4000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not become healthy"
            time.sleep(2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
