"""The child processes (one engine each, or the kernel bench): how they are run with a
timeout, their `@@stage` progress lines, and the root cause read from a failed one's log."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

STAGE = "@@stage "


def progress(stage: str) -> None:
    """In a child: tell the parent's progress bar which stage runs."""
    print(f"{STAGE}{stage}", flush=True)


def run_child(args: list[str], log: Path, timeout: int, bar=None) -> tuple[int, str]:
    """Runs `python -m vllm_kvq.tools.compare ...`; stage lines go to the progress bar, the rest
    (vLLM's logs) to `log`. Returns (returncode, last error line)."""
    import threading

    with open(log, "w") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "vllm_kvq.tools.compare", *args],
                                stdout=subprocess.PIPE, stderr=logf, text=True,
                                start_new_session=True)
        fired = []

        def kill():  # a hung engine must not hang the run (nor leave its engine core)
            fired.append(True)
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            for line in proc.stdout:
                if line.startswith(STAGE) and bar is not None:
                    bar.set_postfix_str(line[len(STAGE):].strip()[:40])
                else:
                    logf.write(line)
                    logf.flush()
            rc = proc.wait()
        except BaseException:  # interrupted: take the engine down with us
            kill()
            raise
        finally:
            timer.cancel()
    if fired:
        return rc, f"timed out after {timeout} s"
    return rc, error_line(log.read_text(errors="replace")) if rc else ""


GENERIC_ERRORS = ("Engine core initialization failed", "please check the stack trace",
                  "died unexpectedly")


def error_line(text: str) -> str:
    """The root cause in an engine's log: vLLM wraps a worker's exception in generic ones
    ("Engine core initialization failed"); prefer the innermost specific message."""
    m = re.findall(r"Worker failed with error '(.+?)', please check", text)
    if m:
        return m[0][:400]
    causes = []
    for ln in text.splitlines():
        c = re.search(r"\b([A-Za-z_.]*(?:Error|Exception)): (.+)$", ln)
        if c and not any(g in ln for g in GENERIC_ERRORS):
            causes.append(f"{c.group(1)}: {c.group(2).strip()}")
    if causes:
        return causes[0][:400]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:400] if lines else "no output"


def engine_cores(log: Path) -> str | None:
    """The cores vLLM's CPU worker bound its OpenMP threads to (from its log)."""
    m = re.search(r"core ids=\[([^\]]*)\]", log.read_text(errors="replace"))
    return m.group(1) if m else None
