"""A tiny word-level tokenizer (built locally, no hub) and a helper that builds response batches."""

from __future__ import annotations

import pytest
import torch

from rlkit.batch import Batch

WORDS = "the answer is #### sleep crash nan none str raise dict ok 0 1 2 3 4 5 6 7 8 9 10 11 12 = +"


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS.split())}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>"
    )


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def make_batch(tokenizer):
    """``make_batch(["#### 3", ...], ["3", ...], data_source=...)`` → responses right-padded to ``width``."""

    def make(texts, truths, data_source="openai/gsm8k", width=None, eos=True, **tensors):
        rows = [
            tokenizer(t, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
            for t in texts
        ]
        width = width or max(len(r) for r in rows)
        responses = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            responses[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        n = len(rows)
        sources = data_source if isinstance(data_source, list) else [data_source] * n
        return Batch(
            {"responses": responses, "response_mask": mask, **tensors},
            {
                "data_source": sources,
                "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
                "extra_info": [{"index": i} for i in range(n)],
            },
        )

    return make
