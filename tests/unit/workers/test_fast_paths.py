"""Speed paths of the actor give the plain path's numbers: log-probs and gradients under a fixed seed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlkit.algos.entropy import log_probs_from_logits
from rlkit.model import fsdp
from rlkit.model.attention import grouped_eager_name
from rlkit.model.forward import ForwardPlan, forward_response
from rlkit.model.load import load_model, load_tokenizer
from rlkit.recipe.schema import ModelConfig

sys.path.insert(0, str(Path(__file__).parent))
from _fsdp_ranks import global_batch  # noqa: E402

sys.path.pop(0)


def plain_log_prob(module, micro, temperature: float) -> torch.Tensor:
    """The reference: logits at every position, sliced to the response, then log-softmax [b, T]."""
    ids, mask, pos, p_keep, t = fsdp.trim_padding(micro)
    logits = module(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    lp = log_probs_from_logits(
        logits[:, p_keep - 1 : p_keep - 1 + t].float() / temperature, micro["responses"][:, :t]
    )
    width = micro["responses"].shape[1]
    return torch.nn.functional.pad(lp, (0, width - t)) * micro["response_mask"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_on_response_positions_only_matches_the_full_forward(tiny_model_dir, temperature):
    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    module = load_model(cfg, tokenizer=tok)
    batch = global_batch(tok)  # 8 samples, left-padded prompts, response lengths 1..8
    fast, _ = forward_response(
        module, batch, temperature=temperature, with_entropy=False, device=torch.device("cpu")
    )
    fast.sum().backward()
    fast_grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    plain = plain_log_prob(module, batch, temperature)
    plain.sum().backward()
    assert fast.shape == plain.shape == batch["responses"].shape
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    for got, want in zip(fast_grads, (p.grad for p in module.parameters()), strict=True):
        # atol 1e-5: gradients of O(1e-2); an AVX-512 CPU sums a near-zero element 1.03e-6 apart
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mixed_precision", ["fp32", "bf16"])
def test_shared_prompt_pass_matches_one_pass_per_row(tiny_model_dir, mixed_precision):
    """A group's rows share one prompt forward/backward: the same log-probs, entropies and gradients as
    running every row's prompt (2 prompts of different lengths × 3 sampled responses of varying length)."""
    from rlkit.batch import Batch
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.rollout.hf import HFRollout

    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    module = load_model(cfg, tokenizer=tok)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("What is 2 + 3?", "What is 12 + 30? Answer with the number.")
    ]
    enc = tok(texts, return_tensors="pt", padding=True)
    eos = int(tok.convert_tokens_to_ids("7"))  # a common token ends some responses early: lengths vary
    batch = HFRollout(
        module=module,
        tokenizer=tok,
        rollout_config=RolloutConfig(n=3),
        max_response_length=10,
        eos_token_ids=[eos],
        seed=2,
    ).generate(Batch(dict(enc)))
    results = {}
    for share in (True, False):
        module.zero_grad(set_to_none=True)
        lp, ent = forward_response(
            module,
            batch,
            temperature=0.9,
            with_entropy=True,
            entropy_grad=True,
            mixed_precision=mixed_precision,
            device=torch.device("cpu"),
            plan=ForwardPlan(share_prefix=share),
        )
        (lp.sum() + 0.1 * ent.sum()).backward()
        results[share] = (lp.detach(), ent.detach(), [p.grad.clone() for p in module.parameters()])
    tol = {"rtol": 1e-4, "atol": 1e-5} if mixed_precision == "fp32" else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(results[True][0], results[False][0], **tol)
    torch.testing.assert_close(results[True][1], results[False][1], **tol)
    for got, want in zip(results[True][2], results[False][2], strict=True):
        torch.testing.assert_close(got, want, rtol=tol["rtol"] * 10, atol=tol["atol"] * 10)


@pytest.mark.parametrize(("mixed_precision", "share"), [("fp32", True), ("fp32", False), ("bf16", False)])
def test_fused_head_matches_the_logits_path(tiny_model_dir, mixed_precision, share):
    """Log-probs, entropies (with their gradient) and Σπ² from hidden states in chunks (no [b, t, V] logits)
    equal the logits path's, and so do the gradients, the tied embedding's included (tiny Qwen2 ties its
    head)."""
    from rlkit.model.forward import response_outputs
    from rlkit.model.lm_head import plain_head

    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    module = load_model(cfg, tokenizer=tok)
    assert (
        plain_head(module) is not None and plain_head(module).weight is module.get_input_embeddings().weight
    )
    batch = global_batch(tok)  # 4 prompts × 2, left-padded prompts, response lengths 1..8
    results = {}
    plans = {  # fused head keeping its logits for backward (the default), recomputing them; logits path
        "kept": ForwardPlan(share_prefix=share),
        "recomputed": ForwardPlan(keep_head_logits=False, share_prefix=share),
        "logits": ForwardPlan(fused_head=False, share_prefix=share),
    }
    for name, plan in plans.items():
        module.zero_grad(set_to_none=True)
        out = response_outputs(
            module,
            batch,
            temperature=0.8,
            with_entropy=True,
            entropy_grad=True,
            with_sum_pi_squared=True,
            mixed_precision=mixed_precision,
            device=torch.device("cpu"),
            plan=plan,
        )
        (out["log_prob"] * batch["advantages"]).sum().add(0.1 * out["entropy"].sum()).backward()
        results[name] = (
            {k: v.detach() for k, v in out.items()},
            [p.grad.clone() for p in module.parameters()],
        )
    tol = {"rtol": 1e-4, "atol": 1e-5} if mixed_precision == "fp32" else {"rtol": 2e-2, "atol": 2e-2}
    assert results["kept"][0].keys() == {"log_prob", "entropy", "sum_pi_squared"}
    for fused in ("kept", "recomputed"):
        for name, value in results[fused][0].items():
            assert value.shape == batch["responses"].shape
            assert (value[batch["response_mask"] == 0] == 0).all()
            torch.testing.assert_close(value, results["logits"][0][name], **tol, msg=name)
        for got, want in zip(results[fused][1], results["logits"][1], strict=True):
            torch.testing.assert_close(got, want, rtol=tol["rtol"] * 10, atol=tol["atol"] * 10)


@pytest.mark.parametrize("attn", ["sdpa", "eager", "grouped"])
def test_packed_groups_match_the_padded_rows(tiny_model_dir, monkeypatch, attn):
    """One padding-free packed row per group (prompt once, responses after it, a 4-D mask) gives the padded
    rows' log-probs, entropies and gradients."""
    from rlkit.model import forward, packing

    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    module = load_model(cfg, tokenizer=tok)
    module.set_attn_implementation(grouped_eager_name() if attn == "grouped" else attn)
    # 4 prompts of different lengths × 2, response lengths 1..8: padding on both sides
    batch = global_batch(tok)
    chosen = []
    monkeypatch.setattr(forward, "packing_plan", lambda *a, **k: chosen.append(forced) or forced)
    results = {}
    for forced in ("packed", "padded"):
        module.zero_grad(set_to_none=True)
        lp, ent = forward_response(
            module,
            batch,
            temperature=0.9,
            with_entropy=True,
            entropy_grad=True,
            device=torch.device("cpu"),
            plan=ForwardPlan(share_prefix=False),
        )
        (lp * batch["advantages"]).sum().add(0.1 * ent.sum()).backward()
        results[forced] = (lp.detach(), ent.detach(), [p.grad.clone() for p in module.parameters()])
    assert chosen == ["packed", "padded"]
    ids, mask, pos, p_keep, t = fsdp.trim_padding(batch)
    packed = packing.pack_groups(ids, mask, pos, p_keep, t)
    assert packed.input_ids.shape[0] == 4  # one row per prompt
    assert packed.tokens < ids.numel()  # fewer tokens than the padded rows
    torch.testing.assert_close(results["packed"][0], results["padded"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results["packed"][1], results["padded"][1], rtol=1e-5, atol=1e-5)
    for got, want in zip(results["packed"][2], results["padded"][2], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_plan_packs_short_unequal_responses_and_shares_long_ones():
    """The FLOP estimate: groups with short, unequal responses pack (no padding); 8 full 256-token responses
    per prompt share the prompt through the KV cache (a packed row's dense attention grows with its
    square)."""
    from rlkit.model.packing import plan

    def micro(prompt_lens, resp_lens, width_t):
        width_p = max(prompt_lens)
        rows = []
        for p, lengths in zip(prompt_lens, resp_lens, strict=True):
            for r in lengths:
                rows.append([0] * (width_p - p) + [1] * p + [1] * r + [0] * (width_t - r))
        mask = torch.tensor(rows)
        # prompt id per group
        ids = mask * torch.tensor([[i // len(resp_lens[0]) + 5] for i in range(len(rows))])
        return ids, mask, width_p, width_t

    smol = {"body_params": 106_000_000, "pair_flops": 4.0 * 576 * 30}
    ids, mask, p, t = micro([40, 47], [[3, 16, 5, 9, 2, 12, 7, 4]] * 2, 16)
    assert plan(ids, mask, p, t, shared_ok=True, **smol) == "packed"
    ids, mask, p, t = micro([40, 47], [[256] * 8] * 2, 256)
    assert plan(ids, mask, p, t, shared_ok=True, **smol) == "shared"
    assert plan(ids, mask, p, t, shared_ok=False, **smol) in ("padded", "packed")


def test_packed_micro_batch_splits_give_the_same_gradient(tiny_model_dir, monkeypatch):
    """Packed, the gradient of a per-token loss summed over micro-batches of 3 + 3 + 2 samples equals the
    gradient of the whole batch in one micro-batch (groups cut across micro-batches included)."""
    from rlkit.model import forward

    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    module = load_model(cfg, tokenizer=tok)
    batch = global_batch(tok)  # 4 prompts × 2 samples, response lengths 1..8
    monkeypatch.setattr(forward, "packing_plan", lambda *a, **k: "packed")
    grads = []
    for pieces in ([torch.arange(8)], [torch.arange(0, 3), torch.arange(3, 6), torch.arange(6, 8)]):
        module.zero_grad(set_to_none=True)
        for idx in pieces:
            micro = batch[idx]
            lp, _ = forward_response(
                module,
                micro,
                temperature=0.9,
                with_entropy=False,
                device=torch.device("cpu"),
                plan=ForwardPlan(share_prefix=False),
            )
            (lp * micro["advantages"]).sum().backward()
        grads.append([p.grad.clone() for p in module.parameters()])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
