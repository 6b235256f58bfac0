"""The tests' one recipe builder (tests/rlkit_harness.py: ``tiny_recipe``): what its base holds, how
overrides apply, and that what it builds passes rlkit's own validation."""

from __future__ import annotations

from pathlib import Path

import yaml
from rlkit_harness import recipe_text, reliability_overrides, tiny_recipe

from rlkit.recipe.validate import validate_recipe

MODEL, DATA, OUT = Path("/models/tiny"), Path("/data"), Path("/out")


def test_the_base_is_the_tiny_one_step_run_and_validates():
    base = tiny_recipe(MODEL, DATA, OUT)
    assert base["data"]["train_files"] == ["/data/train.parquet"]
    assert (base["data"]["train_batch_size"], base["rollout"]["n"], base["data"]["max_response_length"]) == (
        2,
        2,
        6,
    )
    assert base["trainer"]["total_steps"] == 1 and base["trainer"]["output_dir"] == "/out"
    recipe = validate_recipe(base, check_files=False)
    assert recipe.trainer.val_before_train is False and [b.name for b in recipe.tracking.backends] == [
        "jsonl"
    ]


def test_a_dotted_key_replaces_one_value_and_a_dict_replaces_its_whole_section():
    built = tiny_recipe(
        MODEL,
        DATA,
        OUT,
        {
            "trainer.total_steps": 3,
            "actor.lora": {"rank": 8, "alpha": 16},
            "resources": {"pools": {"train": {}, "gen": {}}},
            "reward.custom_score.path": "score.py",
        },
    )
    assert built["trainer"]["total_steps"] == 3 and built["trainer"]["experiment_name"] == "tiny"
    assert built["actor"]["lora"] == {"rank": 8, "alpha": 16} and built["actor"]["optim"] == {"lr": 1.0e-3}
    assert built["resources"] == {"pools": {"train": {}, "gen": {}}}  # object_store_memory_mb dropped
    assert built["reward"] == {"custom_score": {"path": "score.py"}}  # sections made where missing
    assert tiny_recipe(MODEL, DATA, OUT)["trainer"]["total_steps"] == 1  # the base is a fresh copy each time


def test_the_reliability_recipe_as_yaml_validates_with_its_trackers():
    text = recipe_text(MODEL, DATA, OUT, reliability_overrides(steps=2, keep=2, backends="jsonl, mlflow"))
    raw = yaml.safe_load(text)
    assert raw["trainer"]["max_ckpt_to_keep"] == 2 and raw["tracking"]["backends"] == ["jsonl", "mlflow"]
    assert validate_recipe(raw, check_files=False).trainer.total_steps == 2
