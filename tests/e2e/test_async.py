"""trainer.mode async through `rlkit run`: resume from a checkpoint whose rollout pool had batches generated
ahead.

(The default run covers one async run: the grpo_async entry of tests/e2e/test_smoke_matrix.py, decoupled in
bypass mode. This one runs three, with decoupled PPO's weights (no bypass), and sits behind the e2e marker:
`nox -s e2e`.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rlkit_harness import ray_session, recipe_text, records
from rlkit_harness import run as run_rlkit


def async_overrides(out: Path) -> dict:
    """Async on top of the tiny base: 4 prompts x 4 samples of at most 8 tokens, decoupled PPO (no bypass),
    an actor pool and a rollout pool, 3 steps with a checkpoint each, at most 2 versions stale."""
    return {
        "data.max_response_length": 8,
        "data.train_batch_size": 4,
        "algorithm.rollout_correction": {"name": "decoupled", "cap": 5.0},
        "actor.ppo_micro_batch_size_per_rank": 8,
        "rollout.n": 4,
        "resources": {
            "object_store_memory_mb": 256,
            "pools": {"train": {}, "gen": {}},
            "roles": {"actor_rollout_ref": "train", "rollout": "gen"},
        },
        "trainer.mode": "async",
        "trainer.max_staleness": 2,
        "trainer.total_steps": 3,
        "trainer.save_freq": 1,
        "trainer.max_ckpt_to_keep": 10,
        "trainer.output_dir": str(out),
        "trainer.experiment_name": "async",
    }


@pytest.mark.e2e
def test_async_resume_trains_on_the_saved_batches_and_drops_what_a_smaller_bound_refuses(
    tiny_assets, tmp_path
):
    model, data = tiny_assets
    recipe = tmp_path / "async.yaml"
    straight = tmp_path / "straight"
    recipe.write_text(recipe_text(model, data, straight, async_overrides(straight)))
    result = run_rlkit("run", str(recipe))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in records(straight) if "training/global_step" in r]
    # batch k was generated on the weights of update max(k - 1 - 2, 0): 0, 1 and 2 versions behind the actor
    assert [s["async/staleness_mean"] for s in steps] == [0.0, 1.0, 2.0]
    # decoupled PPO without bypass (grpo_async.yaml's smoke run covers bypass): the stale rows were weighted
    assert all(s["rollout_corr/bypass"] == 0.0 and s["rollout_corr/rollout_is_mean"] > 0 for s in steps)
    pids = ray_session(straight)["worker_pids"]
    assert pids["rollout"] and not set(pids["rollout"]) & set(pids["actor_rollout_ref"])
    step1 = straight / "checkpoints" / "global_step_1"
    queued = torch.load(step1 / "trainer_state.pt", weights_only=False)["rollout_queue"]
    assert [(version, serial) for _, _, version, serial in queued["items"]] == [(0, 1), (0, 2)]

    # resumed from step 1: the two batches generated ahead are trained on, so the run ends where the straight
    # one did
    resumed = tmp_path / "resumed"
    result = run_rlkit("run", str(recipe), f"trainer.output_dir={resumed}", f"trainer.resume={step1}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in records(resumed) if "training/global_step" in r] == [2, 3]
    assert records(resumed)[-1] == records(straight)[-1]
    from rlkit.runtime.merge import load_actor_state_dict

    a = load_actor_state_dict(straight / "checkpoints" / "global_step_3")
    b = load_actor_state_dict(resumed / "checkpoints" / "global_step_3")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # resumed in one_step_off (bound 1): step 3's saved batch is 2 versions behind, so it is dropped and
    # regenerated
    strict = tmp_path / "strict"
    result = run_rlkit(
        "run",
        str(recipe),
        f"trainer.output_dir={strict}",
        f"trainer.resume={step1}",
        "trainer.mode=one_step_off",
        "~trainer.max_staleness",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in records(strict) if "training/global_step" in r]
    assert [(s["async/dropped_stale"], s["async/staleness_max"]) for s in steps] == [(0.0, 1.0), (1.0, 0.0)]
