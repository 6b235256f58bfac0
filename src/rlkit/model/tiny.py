"""Tiny Qwen2 / Llama models with a locally trained tokenizer, for tests, benchmarks and e2e runs.

``build_tiny_model(out_dir)`` writes an ordinary Hugging Face folder (``config.json``,
``model.safetensors``, ``tokenizer.json`` + ``tokenizer_config.json`` with a ChatML chat template,
``generation_config.json``) that ``rlkit.model.load`` and ``transformers`` load offline. Nothing is
downloaded: the tokenizer is a byte-level BPE trained by ``tokenizers`` on a small built-in corpus of
digits, arithmetic words and chat markup, so every string (any UTF-8) round-trips through it.

Special tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos: the end of a turn).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch

__all__ = [
    "build_tiny_model",
    "build_tiny_reward_model",
    "build_tiny_tokenizer",
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, as Qwen2 / SmolLM2: each message is `<|im_start|>role\ncontent<|im_end|>\n`.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "zero one two three four five six seven eight nine ten plus minus times divided by equals "
    "what is the answer sum of and result number question solve compute add subtract multiply "
    "system user assistant you are a helpful think step final yes no"
).split()


def _corpus() -> list[str]:
    lines = [" ".join(_WORDS), "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) . , ? ! # :"]
    for a in range(0, 30):
        for b in range(0, 30, 3):
            lines.append(f"What is {a} + {b}? The answer is {a + b}. #### {a + b}")
            lines.append(f"{a} * {b} = {a * b}, {a} - {b} = {a - b}")
    lines.append("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    return lines


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML markup; eos ``<|im_end|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TEMPLATE,
        padding_side="left",
        model_max_length=4096,
    )


def _config(arch: str, vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, tokenizer):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":  # q/k RMSNorms per head
        return Qwen3Config(**common, head_dim=hidden // heads)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    raise ValueError(f"build_tiny_model: arch must be 'qwen2', 'llama', 'qwen3' or 'mistral', got {arch!r}.")


def build_tiny_model(
    out_dir: str | Path,
    arch: Literal["qwen2", "llama", "qwen3", "mistral"] = "qwen2",
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    eos_norm: float | None = None,
) -> Path:
    """Write a randomly initialised ``arch`` causal LM and its tokenizer to ``out_dir``; return the path.

    The vocabulary comes from the tokenizer (rounded up to a multiple of 64). Weights are float32 and
    depend only on ``seed`` and the sizes, so two builds with the same arguments are identical.

    ``eos_norm``: rescale the end-of-turn token's (tied) embedding row to this norm. At init every logit
    is near 0, so a random model almost never ends a turn (p ≈ 1/vocab per token) and every response
    runs to the length limit; with ``eos_norm=3`` the eos logit swings with the context and response
    lengths spread over the whole budget (measured: 16-token budget, 64 samples, lengths 2..16, a
    quarter at the limit) — what DAPO's overlong shaping and group filter need to see in a smoke run.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    vocab = -(-len(tokenizer) // 64) * 64
    config = _config(arch, vocab, hidden, layers, heads, kv_heads, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if eos_norm is not None:
        with torch.no_grad():
            row = model.get_input_embeddings().weight[tokenizer.eos_token_id]
            row.mul_(eos_norm / row.norm())
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "rlkit_tiny.json").write_text(
        json.dumps({"arch": arch, "hidden": hidden, "layers": layers, "seed": seed, "eos_norm": eos_norm})
    )
    return out


def build_tiny_reward_model(
    out_dir: str | Path,
    arch: Literal["qwen2", "llama", "qwen3", "mistral"] = "qwen2",
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 1,
) -> Path:
    """Write a randomly initialised ``arch`` sequence-classification model (one label: a reward model)
    with the same tokenizer as ``build_tiny_model``; return the path. Deterministic in ``seed``."""
    from transformers import AutoModelForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    vocab = -(-len(tokenizer) // 64) * 64
    config = _config(arch, vocab, hidden, layers, heads, kv_heads, tokenizer)
    config.num_labels = 1
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
