"""Report assembly: every row of the report from the raw per-engine runs (pure, tested
without engines), re-assembly from a results folder, and writing report.md, results.json
and the plots."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from vllm_kvq.tools.compare.machine import machine_description
from vllm_kvq.tools.compare.markdown import markdown
from vllm_kvq.tools.compare.memory import memory_row
from vllm_kvq.tools.compare.plan import BASELINE, Plan
from vllm_kvq.tools.compare.plots import plots
from vllm_kvq.tools.compare.scoring import passkey_summary, score_quality, speed_ratios


def assemble(plan: Plan, dims: dict, methods: list[str], runs: dict, failures: dict,
             kernel: dict | None, wall: dict) -> dict:
    """Everything the report shows, from the raw runs (pure: tested without engines)."""
    base = runs.get(BASELINE)
    rows = []
    for method in methods:
        row = {"method": method, **memory_row(method, dims, plan.dtype)}
        row["wall_s"] = wall.get(method)
        if method in failures:
            row["unavailable"] = failures[method]
            rows.append(row)
            continue
        run = runs[method]
        row.update(num_blocks=run["num_blocks"], block_size=run["block_size"],
                   capacity_tokens=run["capacity_tokens"],
                   startup_s=run.get("startup_s"), engine_cores=run.get("engine_cores"),
                   stage_s={k: run.get(k) for k in ("startup_s", "quality_s", "passkey_s",
                                                     "speed_s")})
        if base:
            row["capacity_ratio"] = run["capacity_tokens"] / base["capacity_tokens"]
            if run.get("prompt") and base.get("prompt"):
                row["quality"] = score_quality(base, run)
        if run.get("passkey"):
            row["passkey"] = passkey_summary(run["passkey"])
            row["passkey_items"] = run["passkey"]
        if run.get("speed"):
            row["speed"] = run["speed"]
            if base and base.get("speed"):
                row["speed_ratio"] = speed_ratios(base["speed"], run["speed"])
        rows.append(row)
    return {"plan": dataclasses.asdict(plan), "model_dims": dims, "rows": rows,
            "kernel": kernel, "failures": failures,
            "greedy_prompts": len(base.get("greedy_text") or []) if base else 0}


def rebuild(out: Path) -> dict:
    """results.json re-assembled from the raw per-engine runs in out/runs (as the run left
    them), so scoring and report changes need no new engine runs."""
    result = json.loads((out / "results.json").read_text())
    methods = [r["method"] for r in result["rows"]]
    if not all((out / "runs" / f"{m}.json").exists() for m in methods
               if m not in result["failures"]):
        return result
    runs = {}
    for m in methods:
        if m not in result["failures"]:
            runs[m] = json.loads((out / "runs" / f"{m}.json").read_text())
            runs[m].setdefault("engine_cores", next(
                (r.get("engine_cores") for r in result["rows"] if r["method"] == m), None))
    plan = Plan(**{"speed_timing": "wall", **result["plan"]})  # older runs: wall timing
    wall = {r["method"]: r.get("wall_s") for r in result["rows"]}
    new = assemble(plan, result["model_dims"], methods, runs, result["failures"],
                   result.get("kernel"), wall)
    for key in ("total_s", "machine", "command", "notes"):
        if key in result:
            new[key] = result[key]
    return new


def write_outputs(result: dict, out: Path, command: str) -> dict:
    light = json.loads(json.dumps(result))
    machine = result.get("machine") or machine_description()
    light["machine"] = machine
    light["command"] = command
    (out / "results.json").write_text(json.dumps(light, indent=1))
    files = plots(result, out)
    md = markdown(result, command, machine)
    if files:
        md += "\n## Plots\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in files) + "\n"
    (out / "report.md").write_text(md)
    return {"report": out / "report.md", "json": out / "results.json", "plots": files}
