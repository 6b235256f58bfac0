"""The rlkit command as a user runs it (in a subprocess)."""

from __future__ import annotations

import subprocess
import sys

import yaml


def rlkit(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlkit", *args], capture_output=True, text=True, cwd=cwd)


def write_recipe(tmp_path, extra: str = "") -> str:
    train = tmp_path / "train.parquet"
    train.write_bytes(b"")
    path = tmp_path / "r.yaml"
    path.write_text(
        f"model: {{path: m}}\ndata: {{train_files: [{train}], train_batch_size: 4}}\nrollout: {{n: "
        f"2}}\n{extra}"
    )
    return str(path)


def test_validate_ok(tmp_path):
    out = rlkit("validate", write_recipe(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "valid" in out.stdout and "estimator=grpo" in out.stdout


def test_validate_unknown_key_exits_nonzero_naming_it(tmp_path):
    out = rlkit("validate", write_recipe(tmp_path, "actor: {clip_ratio_hihg: 0.3}\n"), "trainer.seed=x")
    assert out.returncode == 1
    assert "actor.clip_ratio_hihg" in out.stderr and "trainer.seed" in out.stderr
    assert "Traceback" not in out.stderr


def test_recipe_show_prints_the_effective_recipe(tmp_path):
    out = rlkit("recipe", "show", write_recipe(tmp_path), "algorithm.estimator=dapo")
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown["actor"]["policy_loss"]["clip_ratio_high"] == 0.28 and shown["rollout"]["n"] == 2
    assert shown["algorithm"]["estimator"] == {"name": "dapo", "norm_adv_by_std": True, "epsilon": 1e-6}


def test_no_command_prints_help():
    out = rlkit()
    assert out.returncode == 2 and "validate" in out.stdout
