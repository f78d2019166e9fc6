"""Small random models for backend paths the two real models do not reach. A Gemma 2-shaped
model (logit soft-capping on every attention layer, sliding window on every other one) is
built from its config with a fixed seed and saved beside the e2e engines' files, with Gemma
3's tokenizer (same vocabulary size), so the e2e driver runs it like a prepared model."""
from __future__ import annotations

import shutil
from pathlib import Path

# query/key projections scaled up so that the attention logits reach the cap: with the
# config's initialization (std 0.02) they stay near 0, where c * tanh(x / c) = x
QK_GAIN = 12.0
SOFT_CAP = 5.0
# the final norm's gain (the head is the tied embedding) so that next-token distributions are
# peaked enough for the engines' comparisons (KL, confident positions) to see attention
HEAD_GAIN = 40.0
MARK = ".tiny-complete"


def tiny_gemma2(folder: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """A 4-layer Gemma 2 (Gemma2ForCausalLM: attn_logit_softcapping SOFT_CAP, final logit
    soft-capping, sliding window 256 on layers 0 and 2), saved in bf16 at `folder`."""
    folder = Path(folder)
    if (folder / MARK).exists():
        return folder
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=262144, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, query_pre_attn_scalar=64, sliding_window=256,
                       attn_logit_softcapping=SOFT_CAP, final_logit_softcapping=30.0,
                       max_position_embeddings=4096, bos_token_id=2, eos_token_id=1,
                       pad_token_id=0, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_GAIN)
            layer.self_attn.k_proj.weight.mul_(QK_GAIN)
        model.model.norm.weight.fill_(HEAD_GAIN - 1.0)  # Gemma's RMSNorm scales by 1 + w
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_from) / name, folder / name)
    (folder / MARK).write_text("ok\n")
    return folder
