"""The hybrid-engine role on a real Ray cluster: a 2-rank FSDP2 actor group does generate -> log-prob ->
ref log-prob -> update -> sync -> generate, and checkpoints; a critic group computes and updates values."""

from __future__ import annotations

import time

import pytest
import torch

from rlkit.batch import Batch
from rlkit.plugin.registry import build_registries, load_object
from rlkit.recipe.compose import resolve
from rlkit.recipe.schema import (
    ActorConfig,
    CriticConfig,
    ModelConfig,
    OptimConfig,
    PoolConfig,
    RefConfig,
    ResourcesConfig,
    RolloutConfig,
)
from rlkit.workers import ResourcePoolManager, WorkerGroup


@pytest.fixture(scope="module")
def pools(ray_cluster):
    manager = ResourcePoolManager(
        ResourcesConfig(device="cpu", pools={"global": PoolConfig(bundles_per_node=2)})
    )
    yield manager
    manager.remove_all()


def prompts(tok, k: int = 4) -> Batch:
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"What is {i} + {i + 2}?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(k)
    ]
    enc = tok(texts, return_tensors="pt", padding=True)
    return Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def test_hybrid_actor_group_step(tiny_model_dir, pools, tmp_path):
    from rlkit.model.load import load_tokenizer

    model = ModelConfig(path=str(tiny_model_dir))
    n = 2
    registries = build_registries()
    rollout = RolloutConfig(n=n, temperature=0.8, backend={"name": "hf", "dtype": "float32"})  # on any CPU
    actor = ActorConfig(
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_rank=2,
        use_kl_loss=True,
        optim=OptimConfig(lr=1e-2),
        mixed_precision="fp32",  # the rollout's log-probs checked against the actor's in fp32 on any CPU
    )
    # the components the driver resolves once (rlkit.recipe.compose) and hands to the role, as Runtime does
    policy_loss, problems = resolve("actor.policy_loss", "policy_losses", actor.policy_loss, registries)
    backend, more = resolve("rollout.backend", "rollout_backends", rollout.backend, registries)
    assert not problems and not more, problems + more
    kwargs = dict(
        model_config=model,
        rollout_config=rollout,
        actor_config=actor,
        ref_config=RefConfig(),
        max_response_length=16,
        total_steps=2,
        policy_loss=policy_loss,
        rollout_backend=backend,
    )
    cls = load_object(registries.roles.get("actor_rollout_ref").cls)
    t0 = time.perf_counter()
    group = WorkerGroup(
        cls, pools.pool_for("actor_rollout_ref"), role="actor_rollout_ref", role_kwargs=kwargs
    )
    timings = {"start": time.perf_counter() - t0}
    try:
        batch = prompts(load_tokenizer(model)).repeat(n, interleave=True)  # 8 samples, 4 per rank

        def timed(name, *args, **kw):
            t = time.perf_counter()
            out = group.call(*args, **kw)
            timings[name] = time.perf_counter() - t
            return out

        gen = timed("generate", "generate_sequences", batch, n=1)
        assert gen["responses"].shape == (8, 16) and torch.equal(gen["prompts"], batch["input_ids"])
        old = timed("log_prob", "compute_log_prob", gen, balance=True)["old_log_prob"]
        torch.testing.assert_close(old, gen["rollout_log_probs"], atol=1e-4, rtol=1e-4)
        ref = timed("ref_log_prob", "compute_ref_log_prob", gen, balance=True)["ref_log_prob"]
        torch.testing.assert_close(ref, old, atol=1e-5, rtol=1e-5)
        train = gen.union(
            Batch(
                {
                    "old_log_prob": old,
                    "ref_log_prob": ref,
                    "advantages": torch.linspace(-1, 1, 8)[:, None].expand(8, 16).contiguous(),
                }
            )
        )
        metrics = timed("update", "update_actor", train, balance=True)
        assert metrics[0] == metrics[1]  # reduced over ranks: identical everywhere
        assert metrics[0]["actor/grad_norm"] > 0 and metrics[0]["actor/kl_loss"] == pytest.approx(0, abs=1e-6)
        group.call("sync_weights", dispatch="all")
        new = group.call("compute_log_prob", gen)["old_log_prob"]
        assert not torch.allclose(new, old, atol=1e-3)  # the update moved the policy
        again = group.call("generate_sequences", batch, n=1, do_sample=False)  # rollout sees the new weights
        torch.testing.assert_close(
            group.call("compute_log_prob", again)["old_log_prob"] * again["response_mask"],
            again["rollout_log_probs"],
            atol=1e-4,
            rtol=1e-4,
        )
        state = group.call("full_state_dict", dispatch="rank0")
        assert "model.embed_tokens.weight" in state
        group.call("save_checkpoint", str(tmp_path / "ckpt"), dispatch="all")
        group.call("update_actor", train, balance=True)
        group.call("load_checkpoint", str(tmp_path / "ckpt"), dispatch="all")
        torch.testing.assert_close(group.call("compute_log_prob", gen)["old_log_prob"], new, atol=0, rtol=0)
    finally:
        group.shutdown()
    print("\nhybrid 2-rank step (s): " + ", ".join(f"{k} {v:.2f}" for k, v in timings.items()))


def test_critic_group(tiny_model_dir, pools):
    from rlkit.workers.roles import CriticWorker

    kwargs = dict(
        model_config=ModelConfig(path=str(tiny_model_dir)),
        critic_config=CriticConfig(),
        rollout_n=2,
        ppo_mini_batch_size=4,
    )
    group = WorkerGroup(CriticWorker, pools.pool_for("critic"), role="critic", role_kwargs=kwargs)
    try:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parent))
        from _fsdp_ranks import global_batch

        sys.path.pop(0)
        from rlkit.model.load import load_tokenizer

        batch = global_batch(load_tokenizer(kwargs["model_config"]))
        values = group.call("compute_values", batch, balance=True)["values"]
        assert values.shape == (8, 8) and (values[batch["response_mask"] == 0] == 0).all()
        batch = batch.union(Batch({"values": values, "returns": values + 1.0 * batch["response_mask"]}))
        metrics = group.call("update_critic", batch, balance=True)
        assert metrics[0]["critic/vf_loss"] == pytest.approx(0.5, rel=1e-4)  # 0.5 * mean(1^2)
    finally:
        group.shutdown()
