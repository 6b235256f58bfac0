"""The decode tests' models (a model folder loaded in eval mode with its weights perturbed) and prompts."""

from __future__ import annotations

import torch

from rlkit.batch import Batch
from rlkit.model.load import load_model, load_tokenizer
from rlkit.recipe.schema import ModelConfig


def perturbed_model(path, seed: int):
    """(tokenizer, model) of the model at ``path`` in eval mode, every weight moved by 0.2 · N(0, 1): a
    freshly initialised model's greedy path repeats one token."""
    torch.set_num_threads(1)  # as the rest of the unit tests (two threads on a loaded 2-core machine crawl)
    cfg = ModelConfig(path=str(path))
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tok).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return tok, model


def chat_prompts(tok, k: int = 3, question: str = "What is 2 + 3?") -> Batch:
    """``k`` chat prompts, the i-th asking ``question`` i + 1 times: left-padded, of different lengths."""
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": question * (i + 1)}], tokenize=False, add_generation_prompt=True
        )
        for i in range(k)
    ]
    enc = tok(texts, return_tensors="pt", padding=True)
    return Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
