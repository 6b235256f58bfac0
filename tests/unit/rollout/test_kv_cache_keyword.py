"""Decoding and the shared-prefix log-prob forward pass the KV cache under the keyword the installed
transformers takes (``rlkit.model.kv_cache``): no deprecation warning from transformers, the same tokens as
the plain loop, a PEFT-wrapped model given its base model's keyword."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from test_decode import assert_same, generate

from rlkit.model.kv_cache import cache_argument, output_cache


@pytest.fixture
def transformers_warnings():
    """Every warning transformers logs while the test runs (its once-only warnings shown again)."""
    from transformers.utils import logging as hf_logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.Logger.warning_once.cache_clear()  # transformers' once-per-process cache of warnings
    handler = Keep(logging.WARNING)
    root = hf_logging.get_logger()
    root.addHandler(handler)
    yield records
    root.removeHandler(handler)


def test_decoding_passes_the_cache_under_the_installed_keyword(tok_and_model, transformers_warnings):
    tok, model = tok_and_model
    keyword = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    assert list(cache_argument(model, None)) == [keyword]
    fast, _ = generate(tok, model, fast=True, n=3, temperature=1.0)
    plain, _ = generate(tok, model, fast=False, n=3, temperature=1.0)
    assert_same(fast, plain)
    assert fast["response_mask"].sum() > len(fast)  # more than one token each: the cache was used
    assert not [w for w in transformers_warnings if "deprecated" in w], transformers_warnings


def test_output_cache_reads_the_cache_the_forward_returned(tok_and_model, transformers_warnings):
    tok, model = tok_and_model
    ids = torch.tensor([[1, 2, 3, 4]])
    out = model(input_ids=ids, use_cache=True)
    cache = output_cache(out)
    assert cache.get_seq_length() == 4
    more = model(input_ids=torch.tensor([[5]]), use_cache=True, **cache_argument(model, cache))
    assert output_cache(more).get_seq_length() == 5
    full = model(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits[:, -1]
    torch.testing.assert_close(more.logits[:, -1], full, atol=1e-5, rtol=1e-5)
    assert not [w for w in transformers_warnings if "deprecated" in w], transformers_warnings


def test_a_peft_model_gets_its_base_models_keyword(tok_and_model):
    import copy

    from peft import LoraConfig, get_peft_model

    _, model = tok_and_model
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj"]))
    assert list(cache_argument(peft_model, None)) == list(cache_argument(model, None))
