"""Real keys/values of the default model (SmolLM2-135M), captured once with transformers and
cached under $KVQ_CACHE/captures: what the cache holds (keys after rotary embedding),
fp32 model, State of the Union text. Used by tests/test_nuq.py and
benchmarks/nuq_measure.py."""
from __future__ import annotations

import fcntl
from pathlib import Path

import torch


def capture_kv(n_windows: int = 1, window: int = 256, seed: int = 5,
               min_year: int = 1990) -> dict:
    """{"k", "v": float16 [layers, n_windows * window, kv_heads, head_dim], "windows":
    token ids [n_windows, window], "model_type"}; cached by its arguments."""
    from vllm_kvq.model_prep import MODEL_NAME, cache_root, default_model_dir

    model_dir = default_model_dir()
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"the default model is not prepared ({model_dir}); run "
                                f"python -m vllm_kvq.model_prep")
    root = cache_root() / "captures"
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"kv-{MODEL_NAME}-{n_windows}x{window}-s{seed}-y{min_year}.pt"
    if path.is_file():
        return torch.load(path)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return torch.load(path)
        out = _capture(model_dir, n_windows, window, seed, min_year)
        tmp = path.with_suffix(".tmp")
        torch.save(out, tmp)
        tmp.rename(path)
    return out


@torch.no_grad()
def _capture(model_dir: Path, n_windows: int, window: int, seed: int, min_year: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_kvq.tools.corpus import token_windows

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    windows = token_windows(tok, n_windows, window, seed=seed, min_year=min_year)
    ks, vs = [], []
    for ids in windows:
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
        # [1, H, T, D] per layer -> [layers, T, H, D]
        ks.append(torch.stack([lay.keys[0].transpose(0, 1) for lay in cache.layers]))
        vs.append(torch.stack([lay.values[0].transpose(0, 1) for lay in cache.layers]))
    return {"k": torch.cat(ks, 1).half(), "v": torch.cat(vs, 1).half(),
            "windows": torch.tensor(windows), "model_type": model.config.model_type}
