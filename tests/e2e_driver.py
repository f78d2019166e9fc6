"""Runs one real vLLM engine (one scenario, one method) and writes what it saw as JSON.

Every engine gets a process of its own, so a clean start and teardown:
`python tests/e2e_driver.py SCENARIO METHOD OUT [EXTRA_JSON]` runs one, and
`python tests/e2e_driver.py --fork-server` imports vLLM once and forks a fresh child per
engine asked for on stdin (one JSON line each, see serve_forks), as vLLM's own test suite
forks a process per test: `from vllm import LLM` alone takes ~10 s on 2 cores, ~30 times a
suite.
"""
import gc
import json
import os
import signal
import sys
import traceback

from vllm_kvq.tools.evaluate import (anon_huge_kib, capacity, default_inputs, engine_kwargs,
                                     greedy_with_margins, run_method)
from vllm_kvq.model_prep import MODELS, ensure_model
from vllm_kvq.tools.faults import install_from_env as install_fault_from_env

# The quality windows: 2k tokens of real text (2 x 1024; 4, then 3 x 1024 until suite time
# asked for ~5 s less per engine each time: every bound kept its margin, the measured errors
# moved by <= 10%, see test_engine_cache).
N_WINDOWS, WINDOW = 2, 1024
# The quality runs' KV budget, with vLLM's default max_num_seqs (256): capacity figures at
# the defaults a user meets (tests/test_engine_cache.py)
QUALITY_BUDGET = 1 << 30


# the speculative-decoding scenario's prompt lengths: continuations of 64 tokens that cross
# residual-chunk boundaries (32: nuq3; 128: kivi2, each of 128..512 once) at different offsets
SPEC_PROMPT_LENS = (97, 220, 350, 480)


def shared_prefix_prompts(windows):
    """Prompts sharing long prefixes (full blocks and a partial one) with distinct tails."""
    base = windows[0][:600]
    return [base + windows[1 + i % 3][i * 7:i * 7 + 5 + 13 * i] for i in range(6)]


def pages_budget(method: str, pages: int) -> int:
    """KV bytes for `pages` pages of 128 tokens of the default model (a running sequence's
    residual window takes some of them: vllm_kvq.window_cache)."""
    from vllm_kvq.formats import parse_format

    layers, heads, head_dim = 30, 3, 64
    return pages * parse_format(method).layout(head_dim, 128).token_bytes * 128 * heads * layers


def session_inputs(folder: str, model: str, n_windows: int, window: int) -> dict:
    """evaluate.default_inputs, tokenized once per test session (the engines' folder): the
    same corpus and tokenizer every time, and Gemma 3's tokenizer takes ~5 s to load."""
    path = os.path.join(folder, f"inputs-{os.path.basename(model)}-{n_windows}x{window}.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    inputs = default_inputs(model, n_windows, window)
    with open(path + ".tmp", "w") as f:
        json.dump(inputs, f)
    os.replace(path + ".tmp", path)  # whole or absent, for the next engine
    return inputs


def main(argv: list[str]):
    scenario, method, out = argv[:3]
    extra = json.loads(argv[3]) if len(argv) > 3 else {}
    os.environ.update(extra.pop("env", {}))  # inherited by the engine's processes
    # vLLM's engine core runs in this process (one process fewer that imports torch and
    # vLLM again, ~8 s per engine on 2 cores). One worker: the worker too, and its OpenMP
    # threads use every core (a child worker reserves one for the frontend); pipeline /
    # tensor parallel: the executor spawns its workers from here, as in a server.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    install_fault_from_env()  # test-only faults (VLLM_KVQ_FAULT), patched into this process
    # the other scenarios' prompts are cut from 4 windows (their measurements were made so)
    n_windows = extra.pop("windows", N_WINDOWS if scenario == "quality" else 4)
    window = extra.pop("window", WINDOW)
    # These CPUs lack AVX512-BF16: a bf16 model computes ~3x slower than fp32. The cache
    # format (bf16 baseline, quantized ones) is independent of the model's dtype.
    extra.setdefault("dtype", "float32")
    model = extra.pop("model", "smollm2")  # a model_prep name, or a folder (tests/tiny_models)
    model = model if os.path.isdir(model) else str(ensure_model(MODELS[model], verbose=False))
    inputs = session_inputs(os.path.dirname(out), model, n_windows, window)
    windows = inputs["windows"]
    if scenario == "quality":  # run_method starts it without a tokenizer (ids only)
        # no greedy continuations unless asked ("greedy": true): the tests compare the
        # teacher-forced log-probs only (the greedy scenarios below test generation), and
        # they cost 24 engine steps (~120 in the one-token-per-step decode runs)
        greedy_prompts = inputs["greedy"] if extra.pop("greedy", False) else []
        result = run_method(method, model, windows, greedy_prompts=greedy_prompts,
                            **{"kv_budget": QUALITY_BUDGET, **extra})
    else:
        from vllm import LLM

        budget = extra.pop("kv_budget", 256 << 20)
        new_tokens = extra.pop("new_tokens", 0)
        seqs = extra.pop("seqs", 8)
        prompt_lens = extra.pop("prompt_lens", SPEC_PROMPT_LENS)  # the spec scenario's
        # the greedy scenario's tokens per prompt and rounds (1: no second, cached round)
        greedy_tokens, rounds = extra.pop("greedy_tokens", 40), extra.pop("rounds", 2)
        if "kv_pages" in extra:  # a budget of exactly this many pages
            budget = pages_budget(method, extra.pop("kv_pages"))
        extra.setdefault("disable_log_stats", False)  # preemption counts
        # every prompt is token ids: no tokenizer (Gemma 3's takes ~20 s a start)
        extra.setdefault("skip_tokenizer_init", True)
        llm = LLM(**engine_kwargs(method, model, budget, 2048, **extra))
        result = {"method": method, **capacity(llm)}
        if scenario == "short":
            result["greedy"], result["margins"] = greedy_with_margins(llm, inputs["greedy"], 32)
        elif scenario == "greedy":
            prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts(windows)]
            # twice: with prefix caching on, the second round is served from cached blocks
            result["first"], result["margins"] = greedy_with_margins(llm, prompts,
                                                                     greedy_tokens)
            if rounds == 2:
                result["second"], _ = greedy_with_margins(llm, prompts, greedy_tokens)
        elif scenario == "preempt":
            # `seqs` prompts (the first 8: 700-763 tokens; 16: the next 8 are 424-624) +
            # new_tokens generated, all at once (distinct text: no prefix-cache sharing
            # between them); spans: each request's first and last token times
            prompts = [windows[i % 4][200 * (i // 4):200 * (i // 4) + 700 + 9 * i]
                       for i in range(seqs)]
            result["spans"] = []
            result["tokens"], result["margins"] = greedy_with_margins(
                llm, [{"prompt_token_ids": p} for p in prompts], new_tokens, ignore_eos=True,
                spans=result["spans"])
        elif scenario == "spec":
            # greedy continuations of real text, with or without speculative decoding
            # (extra's speculative_config); margins from the run without it
            prompts = [windows[i % 4][:n] for i, n in enumerate(prompt_lens[:seqs])]
            result["tokens"], result["margins"] = greedy_with_margins(
                llm, [{"prompt_token_ids": p} for p in prompts], new_tokens, ignore_eos=True,
                margins="speculative_config" not in extra)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        stats = llm.llm_engine.get_metrics() if hasattr(llm.llm_engine, "get_metrics") else []
        counters = {}
        for m in stats:
            counters[m.name] = counters.get(m.name, 0) + getattr(m, "value", 0)
        result["preemptions"] = counters.get("vllm:num_preemptions", 0)
        result["spec_draft_tokens"] = counters.get("vllm:spec_decode_num_draft_tokens", 0)
        result["spec_accepted_tokens"] = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
        result["anon_huge_kib"] = anon_huge_kib()
    with open(out, "w") as f:
        json.dump(result, f)


def serve_forks():
    """Per stdin line {"argv": [...], "log": path, "timeout": s}: fork, run main(argv) in
    the child with its stdout/stderr in `log`, answer {"rc": exit code} on stdout. The
    child ends with os._exit (no interpreter teardown), after a garbage collection that
    runs vLLM's own engine teardown: a pipeline / tensor parallel engine stops its workers."""
    import vllm.v1.worker.cpu_worker  # noqa: F401  the expensive imports, done once
    from vllm import LLM  # noqa: F401

    # The imports' objects out of the cyclic collector's reach: a child's collections (vLLM
    # runs ~7 per engine start) then skip them instead of walking, and copy on write, the
    # whole inherited heap: ~1.1 s less per engine on 2 cores (Zen 4: 0.27 s per collection).
    # vLLM itself freezes its startup heap the same way (gc.freeze), and unfreezes it at
    # shutdown, before the child's last collection below.
    gc.freeze()
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            signal.alarm(req["timeout"])  # SIGALRM ends a hung engine
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = 1
            try:
                main(req["argv"])
                gc.collect()  # the engine is unreachable now: its finalizer stops workers
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown of the frozen heap (nanobind reports "leaks")


if __name__ == "__main__":
    if sys.argv[1:] == ["--fork-server"]:
        serve_forks()
    else:
        main(sys.argv[1:])
