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
E2E_DIR.mkdir(parents=True, exist_ok=True)


ENGINE_TIMEOUT_S = 1200
# KVQ_FULL_GRID=1: a test's extra formats beyond the suite's (the CUDA emulation's full grid,
# nuq3_lm under tensor parallelism); the suite runs the formats its issue names
FULL_GRID = os.environ.get("KVQ_FULL_GRID") == "1"


def grid(reduced: list, full: list) -> list:
    assert all(x in full for x in reduced), reduced
    return full if FULL_GRID else reduced


@lru_cache(maxsize=1)
def _fork_server() -> subprocess.Popen:
    """tests/e2e_driver.py --fork-server: vLLM imported once, a forked child per engine."""
    return subprocess.Popen([sys.executable, str(DRIVER), "--fork-server"], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=open(E2E_DIR / "fork-server.log", "w"))


@lru_cache(maxsize=None)
def run_engine(scenario: str, method: str, extra: str = "{}") -> dict:
    """One real vLLM engine in a process of its own (tests/e2e_driver.py), forked from the
    fork server; cached per session. Pipeline / tensor parallel engines spawn their workers
    from that child, as vLLM does on the CPU."""
    out = E2E_DIR / f"{scenario}-{method}-{abs(hash(extra))}.json"
    log_path = out.with_suffix(".log")
    server = _fork_server()
    server.stdin.write(json.dumps({"argv": [scenario, method, str(out), extra],
                                   "log": str(log_path), "timeout": ENGINE_TIMEOUT_S}) + "\n")
    server.stdin.flush()
    answer = server.stdout.readline()
    rc = json.loads(answer)["rc"] if answer else "fork server gone"
    log = log_path.read_text() if log_path.exists() else ""
    if not answer:
        log += (E2E_DIR / "fork-server.log").read_text()
    if rc:
        raise AssertionError(f"{scenario}/{method} {extra} failed ({rc}):\n{log[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def servers():
    """(method, model folder or None, extra serve flags) -> base URL of a live `vllm-kvq
    serve` (tests/serve_process.py); each starts on first use and stops at the end of the
    session, so test files share them."""
    import contextlib

    from serve_process import server

    with contextlib.ExitStack() as stack:
        started = {}

        def get(method: str, model: str | None = None, extra: tuple[str, ...] = ()) -> str:
            extra = tuple(extra)
            key = (method, model, extra)
            if key not in started:
                started[key] = stack.enter_context(server(method, model, extra))
            return started[key]

        yield get


def assert_within(cmp: dict, bounds: tuple, min_positions: int = 0) -> None:
    """A comparison (vllm_kvq.tools.evaluate.compare_runs) within (max mean KL, min
    confident agreement, max |ppl change|)."""
    max_kl, min_agree, max_ppl = bounds
    assert cmp["positions"] >= min_positions, cmp
    assert cmp["mean_kl"] <= max_kl, cmp
    assert cmp["agreement_confident"] >= min_agree, cmp
    assert abs(cmp["ppl_change"]) <= max_ppl, cmp


def assert_size_bar(method: str, head_dim: int, bar: tuple) -> None:
    """A format within a size bar of the rotation issue (#14): (max bits per value at
    128-token blocks, max tokens kept in 16-bit precision: its residual window unless _w8)."""
    from vllm_kvq.formats import parse_format

    fmt, (max_bits, max_window) = parse_format(method), bar
    assert fmt.bits_per_value(head_dim, 128) <= max_bits, (method, fmt.bits_per_value(
        head_dim, 128))
    assert (fmt.residual_tokens if fmt.window_bits == 16 else 0) <= max_window, method


def assert_same_up_to_ties(got, want, margins, tie_nats):
    """Per sequence, `got`'s greedy tokens equal `want`'s until, if ever, a step where
    `want`'s top two log-probs (`margins`) were less than `tie_nats` apart."""
    from vllm_kvq.tools.evaluate import first_divergence

    for a, b, m in zip(got, want, margins, strict=True):
        i = first_divergence(a, b)
        assert i is None or m[i] < tie_nats, (i, m[:i + 1])
