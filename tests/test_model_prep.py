"""The prepared default model is a working HF checkpoint with the shape the KV code assumes."""

import json

import pytest

from vllm_kvq.model_prep import ensure_default_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model(verbose=False)


def test_config_shape(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 30
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["head_dim"] == 64
    assert cfg["rope_theta"] == 100000.0
    assert "quantization_config" not in cfg  # plain bf16 weights, not GGUF


def test_greedy_generates_paris(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert tok.chat_template, "chat template must be saved with the tokenizer"
    ids = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text
