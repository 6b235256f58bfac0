"""The HF rollout backend: layout, log-probs the actor reproduces, n samples, greedy, eos and stop strings."""

from __future__ import annotations

import pytest
import torch
from _models import chat_prompts as prompts

from rlkit.model.attention import grouped_eager_name
from rlkit.model.load import load_model, load_tokenizer
from rlkit.recipe.schema import ActorConfig, ModelConfig, RolloutConfig
from rlkit.rollout.base import RolloutBackend
from rlkit.rollout.decode import DecodePlan
from rlkit.rollout.hf import HFRollout
from rlkit.rollout.sampling import sample_next


@pytest.fixture(scope="module")
def tok_and_model(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    return tok, load_model(cfg, tokenizer=tok).eval()


def resolved(key: str, kind: str, component):
    """A recipe component as the driver resolves it (``rlkit.recipe.compose.resolve``)."""
    from rlkit.plugin.manager import make_plugin_manager
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve

    out, problems = resolve(key, kind, component, build_registries(make_plugin_manager(entry_points=False)))
    assert not problems, problems
    return out


def rollout(tok, module, decode_plan: DecodePlan = DecodePlan(), **cfg) -> HFRollout:
    return HFRollout(
        module=module,
        tokenizer=tok,
        rollout_config=RolloutConfig(**cfg),
        max_response_length=12,
        seed=1,
        decode_plan=decode_plan,
    )


def test_layout_and_n_samples(tok_and_model):
    tok, model = tok_and_model
    ro = rollout(tok, model, n=4, temperature=1.0)
    assert isinstance(ro, RolloutBackend)
    p = prompts(tok)
    out = ro.generate(p)
    b, width_p, width_t = 3 * 4, p["input_ids"].shape[1], 12
    assert out["responses"].shape == (b, width_t) and out["input_ids"].shape == (b, width_p + width_t)
    assert torch.equal(out["prompts"], p["input_ids"].repeat_interleave(4, 0))  # interleaved: a a a a b b ...
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    assert torch.equal(out["attention_mask"][:, width_p:], out["response_mask"])
    pos, mask = out["position_ids"], out["attention_mask"]
    first = mask[:, :width_p].argmax(1)  # first real prompt column
    assert all(pos[i, first[i]] == 0 for i in range(b))
    assert torch.equal(
        pos[:, width_p:] - pos[:, width_p - 1 : width_p], torch.arange(1, width_t + 1).expand(b, -1)
    )
    # response mask is a prefix; after it only pad ids and zero log-probs
    rm = out["response_mask"]
    assert torch.equal(rm, rm.cummin(1).values)
    assert (out["responses"][rm == 0] == tok.pad_token_id).all() and (
        out["rollout_log_probs"][rm == 0] == 0
    ).all()
    assert len({tuple(r.tolist()) for r in out["responses"][:4]}) > 1  # the 4 samples of a prompt differ
    metrics = out.meta.pop("metrics")
    assert out.meta == {"temperature": 1.0, "do_sample": True}
    assert metrics.pop("perf/decode_weights_s") >= 0
    # whether this machine's compiled attention kernel ran: tests/unit/rollout/test_attention_kernel.py
    assert metrics.pop("rollout/attention_kernel") in (0.0, 1.0)
    # whether its compiled glue operators ran: tests/unit/rollout/test_cpu_kernels.py
    assert metrics.pop("rollout/fused_glue") in (0.0, 1.0)
    # whether its compiled draw ran: tests/unit/rollout/test_fused_sampling.py
    assert metrics.pop("rollout/fused_sampling") in (0.0, 1.0)
    assert metrics == {"rollout/lean_step": 1.0, "rollout/scripted_layers": 1.0, "rollout/bf16_kv_cache": 0.0}


def test_rollout_log_probs_match_the_actor(tiny_model_dir, gloo_world1):
    """Sample from the FSDP actor's own module (hybrid engine) with temperature, top-k and top-p; the
    actor's recomputed log-probs (same temperature, full distribution) equal the rollout's."""
    from rlkit.workers.actor import FSDPActor

    loss = resolved("actor.policy_loss", "policy_losses", ActorConfig().policy_loss)
    actor = FSDPActor(
        ModelConfig(path=str(tiny_model_dir)),
        ActorConfig(mixed_precision="fp32"),  # the rollout built directly decodes in the weights' fp32
        loss,
        rollout_n=2,
        total_steps=1,
        log_prob_micro_batch_size=5,
    )
    ro = HFRollout(
        module=actor.module,
        tokenizer=actor.tokenizer,
        rollout_config=RolloutConfig(n=2, temperature=0.7, top_k=50, top_p=0.9),
        max_response_length=12,
        seed=0,
    )
    out = ro.generate(prompts(actor.tokenizer))
    assert out.meta["temperature"] == 0.7
    recomputed = actor.compute_log_prob(out)["old_log_prob"]
    torch.testing.assert_close(recomputed, out["rollout_log_probs"], atol=1e-4, rtol=1e-4)
    assert (out["rollout_log_probs"][out["response_mask"] == 1] < 0).all()


def test_greedy_is_deterministic_and_matches_transformers_generate(tok_and_model):
    tok, model = tok_and_model
    p = prompts(tok)
    first = rollout(tok, model).generate(p, do_sample=False)
    second = rollout(tok, model).generate(p, do_sample=False)
    assert torch.equal(first["responses"], second["responses"]) and first.meta["temperature"] == 1.0
    ref = model.generate(
        input_ids=p["input_ids"],
        attention_mask=p["attention_mask"],
        do_sample=False,
        max_new_tokens=12,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    ref = ref[:, p["input_ids"].shape[1] :]
    got = first["responses"][:, : ref.shape[1]]
    assert torch.equal(got, ref)


def test_eos_ends_a_response_and_is_kept(tok_and_model):
    tok, model = tok_and_model
    p = prompts(tok, 1)
    free = rollout(tok, model).generate(p, do_sample=False)["responses"][0]
    eos = int(free[3])  # pretend the 4th greedy token is the end of turn
    ro = HFRollout(
        module=model,
        tokenizer=tok,
        rollout_config=RolloutConfig(),
        max_response_length=12,
        eos_token_ids=[eos],
    )
    out = ro.generate(p, do_sample=False)
    stop_at = int((free == eos).nonzero()[0])
    assert out["response_mask"][0].sum() == stop_at + 1
    assert torch.equal(out["responses"][0, : stop_at + 1], free[: stop_at + 1])


def test_ignore_eos_keeps_every_response_at_full_length(tok_and_model):
    """Benchmarks: rollout.ignore_eos samples on through eos (greedy: the same tokens as without eos)."""
    tok, model = tok_and_model
    p = prompts(tok, 1)
    free = rollout(tok, model).generate(p, do_sample=False)["responses"][0]
    eos = int(free[3])  # the 4th greedy token would end the response
    ro = HFRollout(
        module=model,
        tokenizer=tok,
        rollout_config=RolloutConfig(ignore_eos=True),
        max_response_length=12,
        eos_token_ids=[eos],
    )
    out = ro.generate(p, do_sample=False)
    assert out["response_mask"].sum() == 12 and torch.equal(out["responses"][0], free)


def test_stop_string_masks_everything_after_it(tok_and_model):
    tok, model = tok_and_model
    p = prompts(tok, 1)
    free = rollout(tok, model).generate(p)["responses"][0]  # seeded sampling: the same tokens every time
    # the first token (after the first two) whose text has not appeared before becomes the stop string
    k, stop = next(
        (k, tok.decode([int(free[k])]))
        for k in range(2, 12)
        if tok.decode([int(free[k])]).strip()
        and tok.decode([int(free[k])]) not in tok.decode(free[:k].tolist())
    )
    out = rollout(tok, model, stop=[stop]).generate(p)
    kept = int(out["response_mask"][0].sum())
    assert kept == k + 1
    assert torch.equal(out["responses"][0, :kept], free[:kept])
    assert (out["responses"][0, kept:] == tok.pad_token_id).all()


def test_sample_next_truncation():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    tokens, logp = sample_next(logits, temperature=1.0, top_p=1.0, top_k=2, do_sample=True, generator=g)
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])
    # top_p = 0.6: p(0) = 0.64 already covers it, so only token 0 survives
    tokens, _ = sample_next(logits, temperature=1.0, top_p=0.6, top_k=0, do_sample=True, generator=g)
    assert set(tokens.tolist()) == {0}
    tokens, _ = sample_next(logits, temperature=0.0, top_p=1.0, top_k=0, do_sample=True, generator=g)
    assert set(tokens.tolist()) == {0}


def test_sampling_frequencies_follow_the_distribution():
    """The inverse-CDF sampler draws token v with probability softmax(logits)_v: frequencies over 40k draws
    lie within 4 standard errors of p, and a zero-probability token (top-k cut) is never drawn."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -30.0]]).repeat(40000, 1)
    g = torch.Generator().manual_seed(0)
    tokens, _ = sample_next(logits, temperature=1.0, top_p=1.0, top_k=4, do_sample=True, generator=g)
    p = torch.softmax(logits[0, :4], -1).double()
    freq = torch.bincount(tokens, minlength=5).double() / len(tokens)
    assert freq[4] == 0
    assert ((freq[:4] - p).abs() <= 4 * (p * (1 - p) / len(tokens)).sqrt()).all()


def test_update_weights_from_a_full_state_dict(tiny_model_dir, gloo_world1, tok_and_model):
    """A rollout with its own copy takes the actor's full state dict and then samples like the actor."""
    from rlkit.workers.actor import FSDPActor

    tok, _ = tok_and_model
    loss = resolved("actor.policy_loss", "policy_losses", ActorConfig().policy_loss)
    actor = FSDPActor(ModelConfig(path=str(tiny_model_dir)), ActorConfig(), loss, rollout_n=1, total_steps=1)
    with torch.no_grad():
        for param in actor.module.parameters():
            param.add_(0.05)  # weights the rollout's own copy does not have yet
    copy = load_model(ModelConfig(path=str(tiny_model_dir)), tokenizer=tok).eval()
    ro = rollout(tok, copy)
    p = prompts(tok)
    before = ro.generate(p, do_sample=False)
    ro.update_weights(actor.full_state_dict())
    after = ro.generate(p, do_sample=False)
    hybrid = rollout(tok, actor.module).generate(p, do_sample=False)
    assert torch.equal(after["responses"], hybrid["responses"])
    torch.testing.assert_close(after["rollout_log_probs"], hybrid["rollout_log_probs"], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(before["rollout_log_probs"], after["rollout_log_probs"])


def _bf16_copy(model):
    import copy

    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.data = p.data.to(torch.bfloat16)
    twin.set_attn_implementation("sdpa")
    return twin


def test_bf16_weights_are_unavailable_where_onednn_cannot_pack_bf16(monkeypatch):
    """On an AVX2-only CPU oneDNN's bf16 reorder raises (it needs avx512bw/vl/dq or avx_ne_convert): the
    probe reports it, so dtype: bfloat16 decodes with the plain bf16 copy instead of failing in Bf16Linear."""
    from rlkit.rollout import bf16_weights

    def refuse(weight):
        raise RuntimeError(
            "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or ..."
        )

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    bf16_weights.bf16_weights_unavailable.cache_clear()
    try:
        why = bf16_weights.bf16_weights_unavailable()
    finally:
        monkeypatch.undo()
        bf16_weights.bf16_weights_unavailable.cache_clear()
    assert why is not None and "cannot pack bf16 weights on this CPU" in why and "avx_ne_convert" in why


@pytest.mark.parametrize("actor_attention", ["eager", "grouped"])
def test_bf16_decode_copy_matches_decoding_a_bf16_model_and_follows_updates(
    tiny_model_dir, tok_and_model, monkeypatch, actor_attention
):
    """rollout.backend: {name: hf, dtype: bfloat16} where the CPU's oneDNN packed linear is missing (or on
    CUDA) decodes with a plain bf16 copy of the current fp32 weights: the same tokens and log-probs (same
    seed) as the plain loop over a bf16 model made by hand, before and after an update. (Where oneDNN is
    there, the CPU decodes with packed bf16 weights: tests/unit/rollout/test_bf16_weights.py.)"""
    import rlkit.rollout.hf as hf

    monkeypatch.setattr(hf, "bf16_weights_unavailable", lambda: "no oneDNN (this test)")
    tok, _ = tok_and_model
    cfg = ModelConfig(path=str(tiny_model_dir))
    model = load_model(cfg, tokenizer=tok).eval()
    # the actor's choices under bf16 on a CPU (rlkit.model.attention); the copy decodes with sdpa
    attention = "eager" if actor_attention == "eager" else grouped_eager_name()
    model.set_attn_implementation(attention)
    backend = {"name": "hf", "dtype": "bfloat16"}
    fast = resolved("rollout.backend", "rollout_backends", backend).build(  # built as the worker builds it
        module=model,
        tokenizer=tok,
        max_response_length=12,
        seed=3,
        rollout_config=RolloutConfig(n=3, temperature=1.0, backend=backend),
    )
    assert isinstance(fast, HFRollout) and fast.decode_dtype == torch.bfloat16
    p = prompts(tok)
    for _ in range(2):
        plain = HFRollout(
            module=_bf16_copy(model),
            tokenizer=tok,
            max_response_length=12,
            seed=3,
            rollout_config=RolloutConfig(n=3, temperature=1.0),
        )
        fast.generator.manual_seed(3)
        got, want = fast.generate(p), plain.generate(p)
        assert fast._decode_copy.config._attn_implementation == "sdpa"
        assert model.config._attn_implementation == attention  # the actor's own is untouched
        assert torch.equal(got["responses"], want["responses"])
        assert torch.equal(got["rollout_log_probs"], want["rollout_log_probs"])
        assert next(model.parameters()).dtype == torch.float32  # the actor's weights are untouched
        with torch.no_grad():  # an "update" of the fp32 weights; the next generate must see it
            for param in model.parameters():
                param.add_(0.05 * torch.randn_like(param))
        fast.update_weights(model)


@pytest.mark.parametrize("do_sample", [False, True])
def test_shared_prefill_matches_one_prefill_per_row(tok_and_model, do_sample):
    """n samples of a prompt share one prefill (KV cache copied to each row): the same tokens as prefilling
    every row, and the same log-probs up to float rounding, under one seed."""
    tok, model = tok_and_model
    p = prompts(tok, 2)
    out = {}
    for share in (True, False):
        ro = rollout(tok, model, n=4, temperature=1.0, decode_plan=DecodePlan(share_prefill=share))
        out[share] = ro.generate(p, do_sample=do_sample)
    assert torch.equal(out[True]["responses"], out[False]["responses"])
    torch.testing.assert_close(
        out[True]["rollout_log_probs"], out[False]["rollout_log_probs"], atol=1e-5, rtol=1e-5
    )


def test_decode_dtype_auto_follows_the_hardware_decision(tok_and_model):
    """rollout.backend.dtype=auto (the default) is this machine's decision (rlkit.hardware): bfloat16 where
    bf16 is fast, else float32; an unknown dtype is refused with the valid values."""
    from types import SimpleNamespace

    from rlkit.builtin.params import HFRolloutParams
    from rlkit.errors import RlkitError
    from rlkit.hardware import precision_decision

    tok, model = tok_and_model

    def build(params):
        return HFRollout(
            module=model,
            tokenizer=tok,
            rollout_config=RolloutConfig(),
            max_response_length=12,
            seed=1,
            params=params,
        )

    assert HFRolloutParams().dtype == "auto"
    assert build(HFRolloutParams()).decode_dtype == getattr(torch, precision_decision("cpu").decode_dtype)
    assert build(None).decode_dtype is None  # built without params: the weights' own dtype
    with pytest.raises(RlkitError, match="auto, float32, bfloat16 or float16"):
        build(SimpleNamespace(dtype="float8"))
