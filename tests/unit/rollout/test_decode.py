"""The fast decode loop (rlkit.rollout.decode: slab KV cache, finished rows dropped, lean sampling) gives the
same tokens and log-probs as the plain loop (transformers' DynamicCache, every row to the end) under one
seed."""

from __future__ import annotations

import pytest
import torch
from _models import chat_prompts

from rlkit.batch import Batch
from rlkit.recipe.schema import RolloutConfig
from rlkit.rollout.bf16_kv import BF16_KV_MIN_POSITIONS
from rlkit.rollout.decode import DecodePlan, Decoding, SlabCache, slab_layers
from rlkit.rollout.hf import HFRollout
from rlkit.rollout.sampling import _inverse_cdf_sample, _log_prob, _truncated_probs, sample_next

T = 12  # response width


def prompts(tok, k: int = 3) -> Batch:
    return chat_prompts(tok, k, "Add 2 and 3.")


class Recorder:
    """Counts the rows of every forward the model runs (a forward hook on the real module)."""

    def __init__(self, model):
        self.rows: list[int] = []
        self.handle = model.register_forward_hook(
            lambda _m, _a, kw, _o: self.rows.append(kw["input_ids"].shape[0]), with_kwargs=True
        )


def generate(
    tok,
    model,
    *,
    fast: bool,
    share: bool = True,
    lean: bool = False,
    scripted: bool = True,
    bf16_kv_from: int | None = BF16_KV_MIN_POSITIONS,
    bf16_kv_probe: bool = True,
    attention_kernel: bool = True,
    attention_kernel_probe: bool = True,
    fused_glue: bool = True,
    fused_sampling: bool = True,
    eos=None,
    cls=HFRollout,
    **kw,
) -> tuple[Batch, list[int]]:
    cfg = {k: kw.pop(k) for k in ("n", "temperature", "top_k", "top_p", "stop") if k in kw}
    ro = cls(
        module=model,
        tokenizer=tok,
        rollout_config=RolloutConfig(**cfg),
        max_response_length=T,
        seed=5,
        eos_token_ids=eos,
        decode_plan=DecodePlan(
            slab_cache=fast,
            share_prefill=share,
            lean_step=lean,
            scripted_layers=scripted,
            bf16_kv_from=bf16_kv_from,
            bf16_kv_probe=bf16_kv_probe,
            attention_kernel=attention_kernel,
            attention_kernel_probe=attention_kernel_probe,
            fused_glue=fused_glue,
            fused_sampling=fused_sampling,
        ),
    )
    rec = Recorder(model)
    try:
        return ro.generate(prompts(tok), **kw), rec.rows
    finally:
        rec.handle.remove()


def assert_same(fast: Batch, plain: Batch) -> None:
    assert torch.equal(fast["responses"], plain["responses"])
    assert torch.equal(fast["response_mask"], plain["response_mask"])
    torch.testing.assert_close(fast["rollout_log_probs"], plain["rollout_log_probs"], atol=1e-5, rtol=1e-5)


def ending_tokens(tok, model, **kw) -> list[int]:
    """Tokens that, as eos, end rows at different steps: row i's token at step 2 + i mod 9 (plain loop, no
    eos), unless it is among any row's first two tokens."""
    free = generate(tok, model, fast=False, eos=[], **kw)[0]["responses"]
    early = set(free[:, :2].flatten().tolist())
    return sorted({int(free[i, 2 + i % 9]) for i in range(len(free))} - early)


CASES = {
    "greedy": {"do_sample": False},
    "sampled": {"temperature": 1.0},
    "temperature_top_k_top_p": {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
    "top_k": {"temperature": 1.3, "top_k": 7},
    "top_p": {"temperature": 1.0, "top_p": 0.8},
}


@pytest.mark.parametrize(
    ("case", "share"),
    [
        ("greedy", True),
        ("greedy", False),
        ("sampled", True),
        ("temperature_top_k_top_p", False),
        ("top_k", True),
        ("top_p", False),
    ],
)
def test_fast_loop_matches_plain_loop_with_rows_ending_at_different_steps(tok_and_model, case, share):
    """eos tokens end rows at different steps, so the fast loop drops rows mid-way (fewer rows per
    forward)."""
    tok, model = tok_and_model
    kw = {"n": 4, **CASES[case]}
    eos = ending_tokens(tok, model, **kw)
    (fast, fast_rows), (plain, plain_rows) = (
        generate(tok, model, fast=f, share=share, eos=eos, **kw) for f in (True, False)
    )
    assert_same(fast, plain)
    lengths = plain["response_mask"].sum(1)
    assert lengths.min() < lengths.max()  # rows did end at different steps
    decode_rows = fast_rows[1:]  # after the prefill
    # the fast loop dropped rows
    assert min(decode_rows) < len(fast) == max(plain_rows[1:]) == min(plain_rows[1:])
    assert len(fast_rows) == len(plain_rows)  # the same number of forwards (FSDP ranks stay in step)


def test_the_prefill_head_gets_a_contiguous_last_position_and_the_full_forwards_logits(tok_and_model):
    """The prefill asks for the last position's logits by index: the head's input is a contiguous [B, 1, H]
    (HF's ``logits_to_keep=1`` slices a strided view, on which a bf16 linear took 100x as long), and the
    logits are the full forward's last position."""
    tok, model = tok_and_model
    seen: list[bool] = []
    hook = model.get_output_embeddings().register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].is_contiguous() and args[0].shape[1] == 1)
    )
    batch = prompts(tok)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    run = Decoding(tok, torch.tensor([0]), 0, torch.Generator(), {}, [], False, False, DecodePlan())
    try:
        with torch.no_grad():
            _, logits = run.prefill(model, ids, mask, pos)
    finally:
        hook.remove()
    assert seen == [True]
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)


def test_stop_strings_end_rows_in_the_fast_loop_as_in_the_plain_loop(tok_and_model):
    tok, model = tok_and_model
    free, _ = generate(tok, model, fast=False, eos=[], n=2, temperature=1.0)
    stop = sorted({tok.decode([int(free["responses"][i, 3 + i])]) for i in range(4)} - {""})
    (fast, fast_rows), (plain, _) = (
        generate(tok, model, fast=f, eos=[], n=2, temperature=1.0, stop=stop) for f in (True, False)
    )
    assert_same(fast, plain)
    assert plain["response_mask"].sum() < plain["response_mask"].numel() and min(fast_rows[1:]) < len(fast)


class NeverAllDone(Decoding):
    def all_done(self, finished: torch.Tensor) -> bool:
        return False


class OtherRankStillRunning(HFRollout):
    """As on an FSDP rank whose rows are all done while another rank's are not: never all done here."""

    def _decoding(self, stop: list[str], sampling: dict) -> Decoding:
        return NeverAllDone(**vars(super()._decoding(stop, sampling)))


def test_a_rank_with_every_row_done_keeps_forwarding_one_row(tok_and_model):
    """FSDP: every rank runs the same number of forwards; the fast loop keeps one (finished) row to
    forward."""
    tok, model = tok_and_model
    free = generate(tok, model, fast=False, eos=[], n=2, temperature=1.0)[0]["responses"]
    # every row ends early
    eos = sorted(set(free[:, 1 : T - 2].flatten().tolist()) - set(free[:, 0].tolist()))
    kw = {"eos": eos, "n": 2, "temperature": 1.0, "cls": OtherRankStillRunning}
    (fast, fast_rows), (plain, plain_rows) = (generate(tok, model, fast=f, **kw) for f in (True, False))
    assert_same(fast, plain)
    assert plain["response_mask"].sum(1).max() < T  # every row ended before the last step
    assert len(fast_rows) == len(plain_rows) == T and fast_rows[-1] == 1


def test_slab_cache_fits_the_model_and_holds_the_prompt_and_response(tok_and_model):
    tok, model = tok_and_model
    layers = slab_layers(model)
    assert layers == model.config.num_hidden_layers
    cache = SlabCache(layers, 5)
    k = torch.randn(2, 1, 3, 4)
    keys, _ = cache.layers[0].update(k, k)
    assert keys is k and cache.get_seq_length() == 3  # the prefill attends over its own states
    keys, _ = cache.layers[0].update(k[:, :, :1] + 1, k[:, :, :1])
    assert torch.equal(keys, torch.cat([k, k[:, :, :1] + 1], 2))
    cache.batch_select_indices(torch.tensor([1, 1, 0]))  # repeat / reorder rows, the prefix carried over
    assert torch.equal(cache.layers[0].keys[2], keys[0]) and torch.equal(cache.layers[0].keys[0], keys[1])
    with pytest.raises(Exception, match="holds 5 positions"):
        cache.layers[0].update(k, k)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (5, 1.0), (5, 0.7), (0, 0.7), (300, 0.95)])
def test_lean_sampling_draws_what_the_full_vocabulary_path_draws(top_k, top_p):
    """sample_next (top-k on its candidates, no copy of the logits) against the reference form (softmax over
    the full vocabulary after masking, float64 inverse CDF) with the same uniform draws: the same tokens."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=g) * 3
    u = torch.rand(64, 1, generator=g, dtype=torch.float64)
    tokens, logp = sample_next(
        logits, temperature=0.8, top_p=top_p, top_k=top_k, do_sample=True, generator=None, uniform=u
    )
    probs = _truncated_probs(logits / 0.8, top_k, top_p)
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=999).squeeze(-1)
    assert torch.equal(tokens, want) and torch.equal(_inverse_cdf_sample(probs, None, u), want)
    want_logp = torch.log_softmax(logits.double() / 0.8, -1).gather(1, want[:, None])[:, 0]
    torch.testing.assert_close(logp.double(), want_logp, rtol=0, atol=2e-6)


@pytest.mark.parametrize("vocab", [256, 1000, 49152 + 37])
def test_two_level_cdf_draws_the_token_of_the_one_level_scan(vocab):
    """The untruncated draw (block sums, then one block's cumulative sum) against the float64 scan over the
    whole vocabulary, with the same uniform draws: the same tokens, for a vocabulary of whole blocks, one with
    a short tail block, blocks of zero probability (-inf logits) and rows with one dominant token."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(512, vocab, generator=g) * 4
    logits[:, 300:812] = float("-inf")  # whole blocks (and a tail, for the small vocabularies) never drawn
    logits[::7, 5] = 40.0  # every 7th row: one token holds nearly all the mass
    u = torch.rand(512, 1, generator=g, dtype=torch.float64)
    u[:4] = torch.tensor([[0.0], [1 - 1e-12], [0.5], [1e-12]], dtype=torch.float64)
    tokens, logp = sample_next(
        logits, temperature=1.0, top_p=1.0, top_k=0, do_sample=True, generator=None, uniform=u
    )
    want = _inverse_cdf_sample(torch.softmax(logits, -1), None, u)
    assert torch.equal(tokens, want)
    assert not bool(((tokens >= 300) & (tokens < 812)).any())
    # the log-prob: as close to float64 log_softmax as float32 log_softmax is (~1e-5 at 49k tokens)
    exact = torch.log_softmax(logits.double(), -1).gather(1, want[:, None])[:, 0]
    float32_error = (torch.log_softmax(logits, -1).gather(1, want[:, None])[:, 0] - exact).abs().max()
    assert (logp.double() - exact).abs().max() <= 1.5 * float32_error + 1e-6


def test_top_k_ties_with_the_kth_logit_keep_every_tie():
    """A row whose k-th logit is tied keeps all the ties (the reference rule), through the full path."""
    logits = torch.tensor([[5.0, 1.0, 1.0, 1.0, 0.0]]).repeat(4000, 1)
    tokens, _ = sample_next(
        logits * 0,
        temperature=1.0,
        top_p=1.0,
        top_k=2,
        do_sample=True,
        generator=torch.Generator().manual_seed(0),
    )
    assert set(tokens.tolist()) == {0, 1, 2, 3, 4}  # all five tied at 0: none cut
    tokens, _ = sample_next(
        logits - 4.0,
        temperature=1.0,
        top_p=1.0,
        top_k=2,
        do_sample=True,
        generator=torch.Generator().manual_seed(0),
    )
    assert set(tokens.tolist()) == {0, 1, 2, 3}


def test_a_token_too_improbable_for_float32_gets_its_log_prob_from_log_softmax():
    """A token whose softmax probability underflows float32 (e^-120) still gets its finite log-prob."""
    logits = torch.tensor([[0.0, -120.0, 1.0], [0.0, -20.0, 1.0]])
    tokens = torch.tensor([1, 1])
    want = torch.log_softmax(logits.double(), -1)[:, 1].float()
    got = _log_prob(logits, torch.softmax(logits, -1), tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
