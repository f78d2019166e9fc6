import json
import os
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests import conftest's helpers
DRIVER = Path(__file__).with_name("e2e_driver.py")
E2E_DIR = Path(os.environ.get("KVQ_E2E_DIR") or tempfile.mkdtemp(prefix="kvq-e2e-"))


@lru_cache(maxsize=None)
def run_engine(scenario: str, method: str, extra: str = "{}") -> dict:
    """One real vLLM engine in its own process (tests/e2e_driver.py); cached per session."""
    out = E2E_DIR / f"{scenario}-{method}-{abs(hash(extra))}.json"
    proc = subprocess.run([sys.executable, str(DRIVER), scenario, method, str(out), extra],
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise AssertionError(f"{scenario}/{method} {extra} failed:\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def servers():
    """method -> base URL of a live `vllm-kvq serve` (tests/serve_process.py); each starts
    on first use and stops at the end of the session, so test files share them."""
    import contextlib

    from serve_process import server

    with contextlib.ExitStack() as stack:
        started = {}

        def get(method: str) -> str:
            if method not in started:
                started[method] = stack.enter_context(server(method))
            return started[method]

        yield get
