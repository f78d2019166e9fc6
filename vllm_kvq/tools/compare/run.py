"""The parent: one child process per method (bf16 first, the baseline of every ratio), then
the kernel bench; returns everything the report shows."""
from __future__ import annotations

import json
import time
from pathlib import Path

from vllm_kvq.tools.compare.children import engine_cores, run_child
from vllm_kvq.tools.compare.inputs import greedy_prompts, passkey_items
from vllm_kvq.tools.compare.machine import cpu_has_fp8_kv
from vllm_kvq.tools.compare.memory import model_dims
from vllm_kvq.tools.compare.plan import BASELINE, FAULT_SUFFIX, KERNEL_SHAPE, Plan, base_method
from vllm_kvq.tools.compare.report import assemble
from vllm_kvq.tools.corpus import held_out_windows
from vllm_kvq.tools.evaluate import VLLM_PEERS


def worker_spec(plan: Plan, method: str, inputs: dict) -> dict:
    env = {"VLLM_KVQ_FAULT": "clobber_cache"} if method.endswith(FAULT_SUFFIX) else {}
    if plan.cpu_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = plan.cpu_bind
    return {"method": base_method(method), "label": method, "model": plan.model,
            "dtype": plan.dtype, "kv_budget": plan.kv_budget,
            "max_num_seqs": plan.max_num_seqs, "max_model_len": plan.max_model_len,
            "seed": plan.seed, "env": env, "windows": inputs["windows"],
            "greedy_prompts": inputs["greedy_prompts"], "greedy_tokens": plan.greedy_tokens,
            "passkey": inputs["passkey"],
            "speed": {"contexts": plan.contexts, "batches": plan.batches,
                      "decode_tokens": plan.decode_tokens, "repeats": plan.speed_repeats,
                      "timing": plan.speed_timing}
            if plan.contexts else None}


def make_inputs(plan: Plan) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(plan.model)
    windows = (held_out_windows(tok, plan.quality_windows, plan.quality_window, plan.seed)
               if plan.quality_windows else [])
    return {"windows": windows,
            "greedy_prompts": greedy_prompts(windows),
            "passkey": passkey_items(tok, plan.passkey_lengths,
                                     {n: plan.passkey_counts.get(str(n), plan.passkey_positions)
                                      for n in plan.passkey_lengths},
                                     plan.seed, plan.passkey_filler)
            if plan.passkey_lengths else []}


def run_compare(plan: Plan, out: Path) -> dict:
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    (out / "runs").mkdir(exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    methods = list(plan.methods)
    if BASELINE not in methods:
        methods.insert(0, BASELINE)  # every ratio is to our bf16 in the same run
    else:
        methods.remove(BASELINE)
        methods.insert(0, BASELINE)
    dims = model_dims(plan.model)
    if dims["max_position_embeddings"] and plan.max_model_len > dims["max_position_embeddings"]:
        raise SystemExit(f"contexts/passkey lengths need max_model_len={plan.max_model_len} > "
                         f"the model's {dims['max_position_embeddings']}; use shorter ones")
    t_start = time.perf_counter()
    inputs = make_inputs(plan)
    runs, failures, wall = {}, {}, {}
    bar = tqdm(methods, desc="engines", unit="engine", dynamic_ncols=True)
    for method in bar:
        bar.set_description(f"{method:>18}")
        if plan.skip_unsupported and method == "vllm-fp8" and not cpu_has_fp8_kv():
            failures[method] = ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX (not "
                                "started: this CPU has neither; a full run starts it anyway)")
            continue
        spec_path = out / "runs" / f"{method}.spec.json"
        run_path = out / "runs" / f"{method}.json"
        spec_path.write_text(json.dumps(worker_spec(plan, method, inputs)))
        t0 = time.perf_counter()
        rc, err = run_child(["worker", str(spec_path), str(run_path)],
                             out / "logs" / f"{method}.log", plan.timeout_s, bar)
        wall[method] = time.perf_counter() - t0
        spec_path.unlink()
        if rc == 0:
            runs[method] = json.loads(run_path.read_text())
            if not runs[method].get("engine_cores"):  # an engine in child processes
                runs[method]["engine_cores"] = engine_cores(out / "logs" / f"{method}.log")
        else:
            failures[method] = err
            tqdm.write(f"{method}: unavailable: {err}")
    kernel = None
    if plan.kernel:
        kbar = tqdm(total=1, desc="attention kernel alone", dynamic_ncols=True)
        kspec = out / "runs" / "kernel.spec.json"
        kformats = [m for m in methods if m not in VLLM_PEERS and FAULT_SUFFIX not in m]
        kspec.write_text(json.dumps({"shape": list(KERNEL_SHAPE)
                                     if (dims["q_heads"], dims["kv_heads"], dims["head_dim"])
                                     == KERNEL_SHAPE else
                                     [dims["q_heads"], dims["kv_heads"], dims["head_dim"]],
                                     "contexts": plan.kernel_contexts,
                                     "batches": plan.kernel_batches, "formats": kformats,
                                     "threads": plan.kernel_threads}))
        t0 = time.perf_counter()
        rc, err = run_child(["kernel", str(kspec), str(out / "runs" / "kernel.json")],
                             out / "logs" / "kernel.log", plan.timeout_s, kbar)
        wall["kernel"] = time.perf_counter() - t0
        kspec.unlink()
        kbar.update(1)
        kbar.close()
        if rc == 0:
            kernel = json.loads((out / "runs" / "kernel.json").read_text())
        else:
            failures["kernel"] = err
    result = assemble(plan, dims, methods, runs, failures, kernel, wall)
    result["total_s"] = time.perf_counter() - t_start
    return result
