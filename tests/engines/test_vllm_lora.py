"""A LoRA actor (``actor.lora``) with the ``vllm`` rollout backend, against the real engine (marker
``engines``).

The engine serves the frozen base and takes the adapter through vLLM's own LoRA loading (``enable_lora``, a
``LoRARequest`` per sync): after a sync only the adapter's tensors have moved, and greedy generation equals
rlkit's HF backend sampling from the same LoRA module. Then `rlkit run` with ``actor.lora`` and
``rollout.backend=vllm``. Run with `nox -s engines_vllm` (the vLLM venv needs the ``lora`` extra: PEFT).
Model: the tiny Qwen2 of test_vllm_real.py (head size 32). Shapes: ``B`` prompts, ``T`` response width.
"""

from __future__ import annotations

import os

import pytest
import torch

from rlkit.testing.rollout import assert_same_greedy, hf_greedy

pytestmark = pytest.mark.engines


@pytest.fixture(scope="module", autouse=True)
def vllm_installed():
    from rlkit_vllm.backend import import_vllm

    import_vllm()  # VllmError, saying how to install, when missing
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rlkit.model.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("vllm_lora_tiny"), arch="qwen2", heads=2, kv_heads=1, eos_norm=3.0
    )


def lora_module(model_dir, seed: int):
    """The tiny model with a rank-8 PEFT adapter on every linear layer, ``lora_B`` drawn at random (seeded) so
    the adapter changes the outputs (a fresh adapter is the identity)."""
    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.model.lora import apply_lora
    from rlkit.recipe.schema import LoraConfig, ModelConfig

    tokenizer = load_tokenizer(ModelConfig(path=str(model_dir)))
    torch.manual_seed(0)
    module, _ = apply_lora(
        load_model(ModelConfig(path=str(model_dir)), tokenizer=tokenizer), LoraConfig(rank=8, alpha=16)
    )
    set_adapter(module, seed)
    return module.eval(), tokenizer


def set_adapter(module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def prompts_of(tokenizer):
    from rlkit.testing.rollout import chat_prompts

    return chat_prompts(tokenizer, ("What is 2 + 3?", "Name a colour.", "What is 7 + 1?"))


def test_adapter_sync_moves_the_adapter_alone_and_generation_follows_it(model_dir):
    from rlkit_vllm import VllmParams
    from rlkit_vllm.backend import VllmRollout

    from rlkit.model.lora import adapter_state_dict, state_bytes
    from rlkit.recipe.schema import RolloutConfig

    module, tokenizer = lora_module(model_dir, seed=1)
    prompts = prompts_of(tokenizer)
    params = VllmParams(dtype="float32", kv_cache_gib=0.25, max_model_len=256)
    engine = VllmRollout(
        module=module,
        tokenizer=tokenizer,
        rollout_config=RolloutConfig(n=1),
        max_response_length=12,
        seed=0,
        params=params,
    )
    try:
        adapter_bytes = state_bytes(adapter_state_dict(module))
        full_bytes = state_bytes(module.state_dict())
        assert engine.lora_request is not None and engine.sync_bytes == adapter_bytes < full_bytes / 3
        first = engine.generate(prompts, n=1, do_sample=False)
        # served with the adapter active
        assert_same_greedy(first, hf_greedy(module, tokenizer, prompts, 12), atol=1e-4)
        row = prompts["input_ids"][0][prompts["attention_mask"][0].bool()].tolist()  # [P0], no padding
        with_base = engine.llm.generate(
            [{"prompt_token_ids": row}],  # no LoRARequest: the base model
            engine.sampling_params(temperature=0, max_new_tokens=12, do_sample=False, stop=[], seed=None),
            use_tqdm=False,
        )
        assert (
            list(with_base[0].outputs[0].token_ids)
            != first["responses"][0][first["response_mask"][0].bool()].tolist()
        )

        set_adapter(module, seed=2)  # "an update": new adapter values
        engine.update_weights(module)
        assert (
            engine.sync_bytes == adapter_bytes
            and engine.weight_syncs == 1
            and engine.lora_request.lora_int_id == 2
        )
        assert engine.llm.llm_engine.list_loras() == {2}  # the old adapter is gone
        second = engine.generate(prompts, n=1, do_sample=False)
        assert second.meta["metrics"]["rollout/weight_sync_bytes"] == adapter_bytes
        assert not torch.equal(second["responses"], first["responses"])
        assert_same_greedy(second, hf_greedy(module, tokenizer, prompts, 12), atol=1e-4)

        # a state dict: same
        engine.update_weights({k: v.clone() for k, v in adapter_state_dict(module).items()})
        assert_same_greedy(engine.generate(prompts, n=1, do_sample=False), second, atol=1e-4)
    finally:
        engine.close()


def test_rlkit_run_lora_with_rollout_backend_vllm(model_dir, tmp_path):
    """`rlkit run` with actor.lora and rollout.backend=vllm: two GRPO steps (KL to the base, the adapter
    switched off); the engine took the adapter alone at start and after step 1
    (``rollout/weight_sync_bytes``)."""
    from rlkit_harness import records, write_recipe
    from rlkit_harness import run as run_rlkit

    from rlkit.data import generate_arithmetic
    from rlkit.model.load import load_model
    from rlkit.model.lora import state_bytes
    from rlkit.recipe.schema import ModelConfig

    generate_arithmetic(tmp_path / "data", train_size=16, test_size=4, seed=0)
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "recipe.yaml", model_dir, tmp_path / "data", out, steps=2)
    result = run_rlkit(
        "run",
        str(recipe),
        "rollout.backend=vllm",
        "rollout.backend.kv_cache_gib=0.25",
        "rollout.backend.max_model_len=256",
        "actor.lora={rank: 8, alpha: 16}",
        "actor.use_kl_loss=true",
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    full = state_bytes(load_model(ModelConfig(path=str(model_dir))).state_dict())
    assert [r["rollout/vllm/weight_syncs"] for r in steps] == [0.0, 1.0]
    sent = [r["rollout/weight_sync_bytes"] for r in steps]
    assert sent[0] == sent[1] and 0 < sent[0] < full / 3, (sent, full)  # the adapter, never the full weights
    for r in steps:
        assert r["actor/lora_trainable_params"] * 4 == sent[0]  # fp32 adapter tensors: exactly what was sent
        assert r["response_length/mean"] > 0 and "actor/pg_loss" in r and "actor/kl_loss" in r
