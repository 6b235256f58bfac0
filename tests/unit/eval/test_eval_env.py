"""``rlkit eval MODEL --env NAME env.KEY=VALUE`` as a user runs it (a subprocess, the suite's tiny model):
reasoning-gym scored by the environment's own rubric, TextArena's multi-turn games through the
``environment`` agent loop, and the errors before any generation (bad parameters, a missing plugin)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rlkit_harness import rlkit_env
from rlkit_harness import run as run_rlkit

ROOT = Path(__file__).resolve().parents[3]


def env() -> dict[str, str]:
    return rlkit_env(RLKIT_CACHE=str(Path.home() / ".cache" / "rlkit"))


def test_eval_on_reasoning_gym_scores_with_the_environments_rubric(tiny_model_dir, tmp_path):
    pytest.importorskip("rlkit_reasoning_gym")
    out = tmp_path / "rg"
    args = ["eval", str(tiny_model_dir), "--env", "reasoning_gym", "env.task=basic_arithmetic"]
    args += ["env.size=1", "env.val_size=5", "env.seed=7", "env.format_weight=0.5"]
    args += ["--out", str(out), "--max-new-tokens", "12", "--batch-size", "2", "--bootstrap", "20"]
    result = run_rlkit(*args, "--no-progress", env=env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "generating in-process, 1 rank" in result.stderr

    results = json.loads((out / "results.json").read_text())
    assert results["environment"]["name"] == "reasoning_gym" and results["environment"]["split"] == "val"
    assert results["environment"]["seed"] == 7 and results["prompts"] == 5
    metrics = results["metrics"]
    for part in ("score/mean@1", "correct/mean@1", "format/mean@1"):  # the rubric's parts are metrics
        m = metrics[f"val-core/reasoning_gym/{part}"]
        assert 0.0 <= m["ci_low"] <= m["value"] <= m["ci_high"] <= 1.5, part
    assert "| val-core/reasoning_gym/correct/mean@1 |" in (out / "results.md").read_text()
    assert "val-core/reasoning_gym/score/mean@1" in result.stdout  # the per-data_source terminal table

    # the scores are the environment's own: score each response again with a freshly built environment
    from rlkit.data.environment import build_environment
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve

    params = {k: v for k, v in results["environment"].items() if k != "split"}
    resolved, problems = resolve("test", "environments", params, build_registries())
    assert not problems
    game = build_environment(resolved)
    rows = pq.read_table(out / "environment" / "val.parquet").to_pylist()
    table = pq.read_table(out / "generations.parquet").to_pylist()
    assert [r["data_source"] for r in table] == ["reasoning_gym"] * 5
    for row, sample in zip(rows, table):
        again = game.score(sample["response"], row["reward_model"]["ground_truth"], row["extra_info"])
        assert sample["score"] == pytest.approx(again["score"])
        assert json.loads(sample["extra"])["correct"] == pytest.approx(again["correct"])


def test_eval_on_textarena_plays_multi_turn_games_in_the_agent_loop(tiny_model_dir, tmp_path):
    pytest.importorskip("rlkit_textarena")
    out = tmp_path / "ta"
    args = ["eval", str(tiny_model_dir), "--recipe", str(ROOT / "recipes" / "textarena.yaml")]
    args += ["--env", "textarena", "env.size=1", "env.val_size=3", "--max-new-tokens", "96"]
    args += ["rollout.agent.max_turns=3", "rollout.agent.max_reply_chars=60", "--out", str(out)]
    result = run_rlkit(*args, "--bootstrap", "20", "--no-progress", env=env())
    assert result.returncode == 0, result.stderr[-3000:]

    results = json.loads((out / "results.json").read_text())
    assert results["environment"]["env_id"] == "GuessTheNumber-v0" and results["prompts"] == 3
    metrics = results["metrics"]
    for part in ("score/mean@1", "won/mean@1", "finished/mean@1"):  # the episode reward's rubric parts
        assert 0.0 <= metrics[f"val-core/textarena/{part}"]["value"] <= 1.0, part
    table = pq.read_table(out / "generations.parquet").to_pylist()
    assert {r["data_source"] for r in table} == {"textarena"}
    turns = [r["turns"] for r in table]
    assert all(1 <= t <= 3 for t in turns) and max(turns) >= 2, turns  # the game replied between turns
    assert all({"won", "finished"} <= set(json.loads(r["extra"])) for r in table)  # episode.reward()


def test_bad_environment_parameters_fail_before_any_generation(tiny_model_dir, tmp_path, capsys):
    pytest.importorskip("rlkit_reasoning_gym")
    from rlkit.cli import main

    cases = [
        (["--env", "reasoning_gym", "env.size=-3"], "data.environment"),
        (["--env", "reasoning_gym", "env.no_such_key=1"], "no_such_key"),
        (["--env", "reasoning_gym", "--data", str(tmp_path / "x.parquet")], "drop one of them"),
        (["--env", "reasoning_gym", "env.task=no_such_task"], "no_such_task"),
        (["--env", "nobody_knows"], "nobody_knows"),
    ]
    for i, (argv, message) in enumerate(cases):
        out = tmp_path / f"out-{i}"
        code = main(["eval", str(tiny_model_dir), *argv, "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 1, (argv, err)
        assert message in err and "error:" in err, (argv, err)
        assert not (out / "parts").exists(), argv  # nothing generated


def test_an_environment_whose_plugin_is_missing_names_the_package(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    import rlkit.plugin.registry as registry
    from rlkit.cli import main
    from rlkit.plugin.manager import make_plugin_manager

    built_ins = registry.build_registries(make_plugin_manager(entry_points=False))
    assert "textarena" not in built_ins.environments  # as where rlkit-textarena is not installed
    monkeypatch.setattr(registry, "build_registries", lambda *a, **k: built_ins)
    code = main(["eval", str(tiny_model_dir), "--env", "textarena", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 1 and "pip install -e plugins/rlkit-textarena" in err, err
    assert not (tmp_path / "o" / "parts").exists()
