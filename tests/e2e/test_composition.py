"""Every composition door leads somewhere, through `rlkit run` in a subprocess (default test run).

- PPO with the actor and the critic colocated in ONE pool (shares that fit) trains its critic (a LoRA
  critic, ``critic.lora``: adapter + value head trained, checkpointed alone).
- A reward model scores what no rule function covers (veRL's fallback), and its scores move the
  advantages; a separate reference worker on its own pool feeds the KL loss; three worker groups run.
- A third-party estimator (the example plugin, installed as a package) receives its own parameter.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rlkit_harness import ray_session, records
from rlkit_harness import run as run_rlkit

BASE = """\
model: {{path: {model}}}
data:
  train_files: [{data}]
  max_prompt_length: 64
  max_response_length: 8
  train_batch_size: 4
actor: {{optim: {{lr: 1.0e-3}}, ppo_micro_batch_size_per_rank: 8}}
rollout: {{n: 2}}
trainer: {{total_steps: 2, val_before_train: false, output_dir: {out}, experiment_name: composition}}
tracking: {{backends: [jsonl]}}
"""


def _run(tmp_path: Path, tiny_assets, extra: str, data: Path | None = None) -> list[dict]:
    model, data_dir = tiny_assets
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(BASE.format(model=model, data=data or data_dir / "train.parquet", out=out) + extra)
    result = run_rlkit("run", str(recipe))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    return steps


def test_ppo_with_actor_and_critic_colocated_in_one_pool(tmp_path, tiny_assets):
    steps = _run(
        tmp_path,
        tiny_assets,
        """\
algorithm: {estimator: {name: ppo, lam: 0.95}}
critic: {lora: {rank: 4, alpha: 8}, optim: {lr: 1.0e-3}}
resources: {object_store_memory_mb: 128, pools: {global: {nodes: 1, bundles_per_node: 1}}}
""",
    )
    for key in ("critic/vf_loss", "critic/values/mean", "critic/vf_explained_var", "actor/pg_loss"):
        assert key in steps[-1], key
    # critic.lora: the adapter (+ value head)
    assert all(s["critic/lora_trainable_params"] > 0 for s in steps)
    assert (tmp_path / "out" / "checkpoints" / "global_step_2" / "critic" / "adapter_config.json").is_file()
    # fast path (one epoch, one mini-batch: no old_log_prob): the update's log-probs give it
    for step in steps:
        assert step["training/rollout_probs_diff_valid"] == 1.0
        assert (
            0.0 <= step["training/rollout_probs_diff_mean"] <= step["training/rollout_probs_diff_max"] < 1e-2
        )
        assert abs(step["rollout_corr/kl"]) < 1e-3
    assert set(ray_session(tmp_path / "out")["worker_pids"]) == {"actor_rollout_ref", "critic"}


def test_reward_model_and_separate_ref_on_their_own_pool(tmp_path, tiny_assets):
    from rlkit.model.tiny import build_tiny_reward_model

    rm = build_tiny_reward_model(tmp_path / "rm")
    # A data_source no compute_score covers: the reward model's score is the whole reward (fallback).
    table = pq.read_table(tiny_assets[1] / "train.parquet")
    table = table.set_column(0, "data_source", pa.array(["open/ended"] * len(table)))
    data = tmp_path / "open.parquet"
    pq.write_table(table, data)
    steps = _run(
        tmp_path,
        tiny_assets,
        f"""\
algorithm: {{estimator: grpo}}
actor: {{optim: {{lr: 1.0e-3}}, ppo_micro_batch_size_per_rank: 8, use_kl_loss: true}}
reward: {{reward_model: {{enable: true, path: {rm}}}}}
resources:
  object_store_memory_mb: 128
  pools: {{train: {{nodes: 1, bundles_per_node: 1}}, aux: {{nodes: 1, bundles_per_node: 1}}}}
  roles: {{actor_rollout_ref: train, ref: aux, reward_model: aux}}
""",
        data=data,
    )
    for step in steps:
        assert step["reward/rm_scores/used_fraction"] == 1.0
        assert step["reward/errors"] == 0.0  # no "unknown data_source" errors: the model covers them
        assert step["critic/score/mean"] == pytest.approx(step["reward/rm_scores/mean"], abs=1e-6)
        # random reward-model scores differ within a group, so GRPO's advantages are not all zero
        assert step["critic/advantages/max"] > 0 > step["critic/advantages/min"]
        assert "actor/kl_loss" in step
    assert set(ray_session(tmp_path / "out")["worker_pids"]) == {"actor_rollout_ref", "ref", "reward_model"}


SCORE = """\
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 3)  # varied scores within a group
"""


def test_third_party_estimator_receives_its_parameter(tmp_path, tiny_assets):
    score = tmp_path / "score.py"
    score.write_text(SCORE)
    # group_quantile (plugins/rlkit-example) with quantile 0: the baseline is each group's minimum,
    # so no advantage is negative; the default (0.5, the median) would make some negative.
    steps = _run(
        tmp_path,
        tiny_assets,
        f"""\
algorithm: {{estimator: {{name: group_quantile, quantile: 0.0}}}}
reward: {{custom_score: {{path: {score}}}}}
resources: {{object_store_memory_mb: 128, pools: {{global: {{nodes: 1, bundles_per_node: 1}}}}}}
""",
    )
    assert all(s["critic/advantages/min"] >= 0.0 for s in steps)
    assert any(s["critic/advantages/max"] > 0.0 for s in steps)


def test_a_pool_that_can_never_be_placed_fails_fast_naming_pool_roles_and_resources(tmp_path, tiny_assets):
    model, data_dir = tiny_assets
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        BASE.format(model=model, data=data_dir / "train.parquet", out=tmp_path / "out")
        + """\
algorithm: {estimator: ppo}
resources: {object_store_memory_mb: 128, pools: {global: {nodes: 2, bundles_per_node: 1}}}
"""
    )
    # One local Ray node: a pool asking for two distinct nodes can never be placed. The check runs before
    # any placement group waits (run_rlkit's own timeout is the hang guard, not a timing assertion).
    result = run_rlkit("run", str(recipe), timeout=120)
    assert result.returncode != 0
    message = result.stderr
    assert "resource pool 'global' (roles 'actor_rollout_ref', 'critic')" in message
    assert "asks for 2 node(s)" in message and "the Ray cluster has 1 node(s)" in message
    assert "resources.pools.global.nodes=1" in message  # how to fix it
    assert "no checkpoint was written yet" in message and "Resume with" not in message  # nothing to resume
