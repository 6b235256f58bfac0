"""The HF rollout on a CUDA device: fp32 weights and the bf16 decode copy a GPU run uses, log-probs a plain
forward reproduces, greedy equal to transformers' generate. Marked ``cuda``: skipped, with the reason, where
torch sees no GPU (tests/conftest.py); benchmarks/gpu_check.sh runs it on a GPU."""

from __future__ import annotations

import pytest
import torch
from test_hf import prompts  # the tests/unit/rollout prompts: left-padded, lengths differ

from rlkit.model.load import load_model, load_tokenizer
from rlkit.recipe.schema import ModelConfig, RolloutConfig
from rlkit.rollout.hf import HFRollout

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def tok_and_cuda_model(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    return tok, load_model(cfg, tokenizer=tok).eval().to(CUDA)


def _recomputed_log_probs(model, out, temperature: float) -> torch.Tensor:
    """Log-probs of the sampled tokens from one plain forward over prompt + response (no cache)."""
    ids, mask, pos = (out[k].to(CUDA) for k in ("input_ids", "attention_mask", "position_ids"))
    width = out["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    logits = logits[:, -width - 1 : -1] / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, -width:, None].long()).squeeze(-1)
    return lp * out["response_mask"].to(CUDA)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_rollout_on_cuda_samples_log_probs_a_forward_reproduces(tok_and_cuda_model, dtype):
    """The HF rollout decoding on cuda (fp32 weights, and the bf16 decode copy a GPU run uses): layout,
    every tensor on the device the batch asked for, and rollout log-probs a plain forward reproduces."""
    from rlkit.builtin.params import HFRolloutParams

    tok, model = tok_and_cuda_model
    ro = HFRollout(
        module=model,
        tokenizer=tok,
        rollout_config=RolloutConfig(n=4, temperature=0.8),
        max_response_length=12,
        device=CUDA,
        seed=1,
        params=HFRolloutParams(dtype=dtype),
    )
    out = ro.generate(prompts(tok))
    assert out["responses"].shape == (12, 12)
    rm = out["response_mask"]
    assert rm.sum() > 0 and torch.equal(rm, rm.cummin(1).values)
    assert len({tuple(r.tolist()) for r in out["responses"][:4].cpu()}) > 1  # the samples of a prompt differ
    want = _recomputed_log_probs(model, out, 0.8)
    got = out["rollout_log_probs"].to(CUDA)
    tol = 1e-3 if dtype == "float32" else 0.1  # bf16 decode against the fp32 forward
    assert (got - want).abs().max() < tol
    assert (got[rm.to(CUDA) == 1] < 0).all()


def test_hf_rollout_greedy_on_cuda_matches_transformers_generate(tok_and_cuda_model):
    tok, model = tok_and_cuda_model
    p = prompts(tok)
    ro = HFRollout(
        module=model, tokenizer=tok, rollout_config=RolloutConfig(n=1), max_response_length=12, device=CUDA
    )
    first = ro.generate(p, do_sample=False)
    ref = model.generate(
        input_ids=p["input_ids"].to(CUDA),
        attention_mask=p["attention_mask"].to(CUDA),
        do_sample=False,
        max_new_tokens=12,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )[:, p["input_ids"].shape[1] :]
    assert torch.equal(first["responses"][:, : ref.shape[1]].cpu(), ref.cpu())
