"""actor.lora (PEFT) in one process, world size 1 (real gloo, tiny Qwen2): frozen base, adapter-only
optimizer, reference = adapter off, adapter-only checkpoints with exact resume, adapter-only rollout sync,
merge outputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlkit.model.lora import LoraRef, is_adapter_key
from rlkit.recipe.schema import ActorConfig, LoraConfig, ModelConfig, OptimConfig, RefConfig
from rlkit.workers.actor import FSDPActor

sys.path.insert(0, str(Path(__file__).parent))
from _fsdp_ranks import global_batch, resolved_policy_loss  # noqa: E402

sys.path.pop(0)

LORA = LoraConfig(rank=4, alpha=8)


def make_actor(model_dir, lora: LoraConfig | None = LORA, **overrides) -> FSDPActor:
    cfg = ActorConfig(
        ppo_mini_batch_size=2,
        ppo_micro_batch_size_per_rank=4,
        lora=lora,
        optim=OptimConfig(lr=1e-2, weight_decay=0.0),
        **overrides,
    )
    return FSDPActor(
        ModelConfig(path=str(model_dir)), cfg, resolved_policy_loss(cfg), rollout_n=2, total_steps=10
    )


def prepared(actor: FSDPActor):
    batch = global_batch(actor.tokenizer)  # 8 samples, response lengths 1..8
    batch["old_log_prob"] = actor.compute_log_prob(batch)["old_log_prob"] - 0.3 * batch["response_mask"]
    return batch


def test_base_frozen_optimizer_holds_adapter_only_and_ref_is_the_base(tiny_model_dir, gloo_world1):
    actor = make_actor(tiny_model_dir)
    trainable = {n for n, p in actor.module.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_key(n) for n in trainable)
    held = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in actor.module.parameters() if p.requires_grad}
    base_before = {n: p.detach().clone() for n, p in actor.module.named_parameters() if not p.requires_grad}

    ref = LoraRef(actor, RefConfig(log_prob_micro_batch_size_per_rank=3))
    batch = prepared(actor)
    ref_lp = ref.compute_ref_log_prob(batch)["ref_log_prob"]
    # lora_B starts at zero: before any update the adapter changes nothing
    torch.testing.assert_close(ref_lp, actor.compute_log_prob(batch)["old_log_prob"], atol=1e-6, rtol=0)
    metrics = actor.update(batch)
    assert metrics["actor/lora_trainable_params"] == sum(
        p.numel() for n, p in actor.module.named_parameters() if n in trainable
    )
    after = actor.compute_log_prob(batch)["old_log_prob"]
    assert (after - ref_lp).abs().max() > 1e-3  # the adapter moved the policy ...
    # ... not the ref
    torch.testing.assert_close(ref.compute_ref_log_prob(batch)["ref_log_prob"], ref_lp, atol=1e-6, rtol=0)
    for n, p in actor.module.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]), n


def test_checkpoint_holds_adapter_only_and_resume_is_exact(tiny_model_dir, gloo_world1, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    actor = make_actor(tiny_model_dir, lora=LoraConfig(rank=4, alpha=8, dropout=0.1), shuffle=True)
    batch = prepared(actor)
    actor.update(batch)
    actor.save_checkpoint(tmp_path / "actor")
    continued = [actor.update(batch) for _ in range(2)]

    dcp_to_torch_save(str(tmp_path / "actor" / "dcp"), str(tmp_path / "full.pt"))
    saved = torch.load(tmp_path / "full.pt", weights_only=False)
    assert saved["model"] and all(is_adapter_key(k) for k in saved["model"])
    assert (tmp_path / "actor" / "adapter_config.json").is_file()
    total = sum(p.numel() for p in actor.module.parameters())
    assert sum(v.numel() for v in saved["model"].values()) < total / 10

    resumed = make_actor(tiny_model_dir, lora=LoraConfig(rank=4, alpha=8, dropout=0.1), shuffle=True)
    resumed.load_checkpoint(tmp_path / "actor")
    again = [resumed.update(batch) for _ in range(2)]
    assert again == continued  # bit-identical metrics (dropout and shuffling RNGs restored too)
    torch.testing.assert_close(resumed.rollout_state_dict(), actor.rollout_state_dict(), atol=0, rtol=0)


def test_rollout_sync_sends_adapter_tensors_only(tiny_model_dir, gloo_world1):
    from rlkit.batch import Batch
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.rollout.hf import HFRollout

    actor = make_actor(tiny_model_dir)
    actor.update(prepared(actor))
    sent = actor.rollout_state_dict()
    full = actor.full_state_dict()
    assert set(sent) == {n for n, p in actor.module.named_parameters() if p.requires_grad}
    assert sum(v.numel() for v in sent.values()) < sum(v.numel() for v in full.values()) / 10

    torch.manual_seed(123)  # another adapter init: the sync must overwrite it
    copy = make_actor(tiny_model_dir)
    cfg = RolloutConfig(n=1)
    mine = HFRollout(
        module=actor.module, tokenizer=actor.tokenizer, rollout_config=cfg, max_response_length=6
    )
    theirs = HFRollout(
        module=copy.module, tokenizer=copy.tokenizer, rollout_config=cfg, max_response_length=6
    )
    theirs.update_weights(sent)
    batch = global_batch(actor.tokenizer)
    width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    rows = torch.arange(0, len(batch), 2)  # one row per prompt
    prompts = Batch(
        {
            "input_ids": batch["input_ids"][rows, :width],
            "attention_mask": batch["attention_mask"][rows, :width],
        }
    )
    a = mine.generate(prompts, do_sample=False)
    b = theirs.generate(prompts, do_sample=False)
    assert torch.equal(a["responses"], b["responses"])


def test_bad_target_modules_is_a_clear_error(tiny_model_dir, gloo_world1):
    from rlkit.errors import WorkerError

    with pytest.raises(WorkerError, match="target_modules"):
        make_actor(tiny_model_dir, lora=LoraConfig(target_modules=["no_such_layer"]))


def test_merge_lora_flag_on_a_full_weight_checkpoint_is_an_error(tiny_model_dir, tmp_path):
    import shutil

    from rlkit.runtime.merge import MergeError, merge_checkpoint

    (tmp_path / "ckpt" / "hf_config").mkdir(parents=True)
    shutil.copy(Path(tiny_model_dir) / "config.json", tmp_path / "ckpt" / "hf_config" / "config.json")
    with pytest.raises(MergeError, match="--merge-lora needs a LoRA checkpoint"):
        merge_checkpoint(tmp_path / "ckpt", tmp_path / "out", merge_lora=True)


def test_fsdp_world_size_2_gives_the_same_adapter_update(tiny_model_dir, gloo_world1, tmp_path):
    """FSDP2 over 2 gloo ranks (frozen base and adapter sharded together) vs world size 1: same metrics and
    the same adapter after the update within 1e-4 (see test_fsdp_world_size.py for the full-weight
    version)."""
    import os
    import subprocess

    script = Path(__file__).with_name("_lora_ranks.py")
    out = tmp_path / "ws2.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir), "2", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = torch.load(out, weights_only=False)
    sys.path.insert(0, str(script.parent))
    try:
        from _lora_ranks import lora_update_once
    finally:
        sys.path.remove(str(script.parent))
    one = lora_update_once(str(tiny_model_dir))
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
        assert one["metrics"][key] == pytest.approx(two["metrics"][key], rel=1e-4, abs=1e-6), key
    assert one["adapter"].keys() == two["adapter"].keys() and all(is_adapter_key(k) for k in one["adapter"])
    for name, value in one["adapter"].items():
        torch.testing.assert_close(value, two["adapter"][name], atol=1e-4, rtol=0, msg=name)
    moved = max(float(v.abs().max()) for k, v in one["adapter"].items() if ".lora_B." in k)
    assert moved > 1e-3  # lora_B starts at zero: the update moved it


def test_engine_helpers_adapter_folder_base_and_merged_weights(tiny_model_dir, gloo_world1, tmp_path):
    """What the vLLM / SGLang backends send: a PEFT adapter folder that PeftModel loads to the actor's
    outputs, the base under plain names (= the model on disk), and merged weights equal to PEFT's own
    merge."""
    import peft
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlkit.model.lora import (
        base_state_dict,
        lora_config_of,
        merged_state_dict,
        state_bytes,
        write_adapter_folder,
    )

    actor = make_actor(tiny_model_dir)
    actor.update(prepared(actor))
    config = lora_config_of(actor.module)
    assert (
        config is not None
        and config.r == 4
        and lora_config_of(make_actor(tiny_model_dir, lora=None).module) is None
    )
    state = actor.full_state_dict()
    sent = actor.rollout_state_dict()
    nbytes = write_adapter_folder(tmp_path / "adapter", sent, config)
    assert nbytes == state_bytes(sent) < state_bytes(state) / 3
    assert all(
        k.startswith("base_model.model.") and ".default." not in k
        for k in load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    )

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    plain = base.state_dict()
    assert {k: v for k, v in base_state_dict(state).items() if k in plain}.keys() == plain.keys()
    torch.testing.assert_close(
        base_state_dict(state)["model.layers.0.self_attn.q_proj.weight"],
        plain["model.layers.0.self_attn.q_proj.weight"],
        atol=0,
        rtol=0,
    )
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        want = actor.module(input_ids=ids).logits
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, atol=1e-5, rtol=0)
        merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        merged.load_state_dict(merged_state_dict(state, config), strict=False)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=0)


def test_critic_lora_trains_adapter_and_value_head_and_resumes(tiny_model_dir, gloo_world1, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from rlkit.recipe.schema import CriticConfig
    from rlkit.workers.critic import FSDPCritic

    def critic():
        cfg = CriticConfig(
            ppo_micro_batch_size_per_rank=8,
            lora=LoraConfig(rank=4, alpha=8),
            optim=OptimConfig(lr=1e-2, weight_decay=0.0),
        )
        return FSDPCritic(
            ModelConfig(path=str(tiny_model_dir)), cfg, rollout_n=2, total_steps=4, ppo_mini_batch_size=4
        )

    one = critic()
    trainable = {n for n, p in one.module.named_parameters() if p.requires_grad}
    # the value head, in full
    assert {n for n in trainable if not is_adapter_key(n)} == {"score.weight", "score.bias"}
    assert not any("score" in n and is_adapter_key(n) for n in trainable)  # no adapter on the head itself
    assert {id(p) for g in one.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in one.module.parameters() if p.requires_grad
    }
    base_before = {n: p.detach().clone() for n, p in one.module.named_parameters() if not p.requires_grad}
    batch = global_batch(one.tokenizer)
    batch["values"] = one.compute_values(batch)["values"]
    batch["returns"] = (batch["values"] + torch.linspace(-1, 1, 8)[:, None]) * batch["response_mask"]
    metrics = one.update(batch)
    assert metrics["critic/lora_trainable_params"] == sum(
        p.numel() for n, p in one.module.named_parameters() if n in trainable
    )
    assert not torch.allclose(one.compute_values(batch)["values"], batch["values"])  # the values moved
    assert all(torch.equal(p, base_before[n]) for n, p in one.module.named_parameters() if n in base_before)

    one.save_checkpoint(tmp_path / "critic")
    assert (tmp_path / "critic" / "adapter_config.json").is_file()
    dcp_to_torch_save(str(tmp_path / "critic" / "dcp"), str(tmp_path / "full.pt"))
    # adapter + head only
    assert set(torch.load(tmp_path / "full.pt", weights_only=False)["model"]) == trainable
    saved = one.compute_values(batch)["values"]
    two = critic()
    two.load_checkpoint(tmp_path / "critic")
    torch.testing.assert_close(two.compute_values(batch)["values"], saved, atol=0, rtol=0)
