"""Off-policy parts through `rlkit run` in a subprocess (default test run; tiny model, 2 steps, one run).

A rollout correction (token-level TIS, through the parameter door) weights the actor's loss: its
``rollout_corr/*`` metrics and the every-step mismatch metrics (``training/rollout_probs_diff_*``) are
logged, and the HF backend's log-probs agree with the trainer's up to numerics. In the same run,
Clip-Cov (its mini-batch selection over two micro-batches) and the optimal token baseline (with
``sum_pi_squared`` from the actor's log-prob pass) train. The on-policy fast path's mismatch metrics
are checked in tests/e2e/test_composition.py (its PPO run skips old_log_prob).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlkit_harness import records
from rlkit_harness import run as run_rlkit

BASE = """\
model: {{path: {model}}}
data:
  train_files: [{data}]
  max_prompt_length: 64
  max_response_length: 8
  train_batch_size: 4
rollout: {{n: 2}}
resources: {{object_store_memory_mb: 128, pools: {{global: {{nodes: 1, bundles_per_node: 1}}}}}}
trainer: {{total_steps: 2, val_before_train: false, output_dir: {out}, experiment_name: offpolicy}}
tracking: {{backends: [jsonl]}}
"""


def _run(tmp_path: Path, tiny_assets, extra: str) -> list[dict]:
    model, data_dir = tiny_assets
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(BASE.format(model=model, data=data_dir / "train.parquet", out=out) + extra)
    result = run_rlkit("run", str(recipe))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # the old_log_prob pass ran (forced: one epoch over one mini-batch would skip it)
    assert all("timing_s/old_log_prob" in r for r in raw if "training/global_step" in r)
    return steps


def test_correction_clip_cov_and_optimal_token_baseline_in_one_run(tmp_path, tiny_assets):
    """One run for three doors (each run is mostly start-up): a token-TIS correction weights the loss and
    feeds OTB its weights; Clip-Cov's selection is made over the mini-batch (two micro-batches of 4)."""
    steps = _run(tmp_path, tiny_assets, """\
algorithm: {estimator: optimal_token_baseline, rollout_correction: {name: token_tis, threshold: 1.5}}
actor:
  optim: {lr: 1.0e-3}
  ppo_micro_batch_size_per_rank: 4
  policy_loss: {name: clip_cov, clip_cov_ratio: 0.2, clip_cov_lb: -10.0, clip_cov_ub: 10.0}
""")
    for step in steps:
        # the HF backend samples from the actor's own weights: pi_old / pi_rollout = 1 up to float noise
        assert 0.99 < step["rollout_corr/rollout_is_mean"] < 1.01
        assert step["rollout_corr/rollout_is_min"] <= step["rollout_corr/rollout_is_mean"] <= step["rollout_corr/rollout_is_max"]
        assert step["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0  # nothing near the cap 1.5
        assert abs(step["rollout_corr/kl"]) < 1e-3 and 0.0 <= step["rollout_corr/k3_kl"] < 1e-3
        assert step["training/rollout_probs_diff_valid"] == 1.0
        assert 0.0 <= step["training/rollout_probs_diff_mean"] <= step["training/rollout_probs_diff_max"] < 1e-2
        assert step["training/rollout_actor_probs_pearson_corr"] > 0.99
        # Clip-Cov cut floor(0.2 N) tokens (fewer where the ratio clip binds): the selection reached the loss
        assert 0.0 < step["actor/clip_cov_frac"] <= 0.2 + 1e-6
        assert step["critic/advantages/max"] >= step["critic/advantages/min"]
