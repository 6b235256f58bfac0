"""Hub ids: resolved from a real HF cache layout when offline, one clear error when they cannot be had,
truncated weights named with the way to fetch them again. No network: the cache is built here and the
"online" case points HF_ENDPOINT at a closed port."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit.errors import RlkitError
from rlkit.recipe.hub import is_hub_id

REPO = "rlkit-test/tiny-qwen2"
REVISION = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
from rlkit_harness import recipe_text, reliability_overrides  # noqa: E402


def build_hf_cache(cache: Path, model_dir: Path, repo: str = REPO) -> Path:
    """``model_dir``'s files as huggingface_hub stores a download: blobs by hash, a snapshot of links,
    refs/main."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / REVISION
    (storage / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(REVISION)
    for file in sorted(model_dir.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, storage / "blobs" / digest)
        (snapshot / file.name).symlink_to(Path("../../blobs") / digest)
    return snapshot


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hub_env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "RLKIT_FAULT"))}
    return {
        **env,
        "HF_HOME": str(cache.parent / "hf_home"),
        "HF_HUB_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        **extra,
    }


def resolve_in_subprocess(path: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    code = (
        "from rlkit.model.load import load_tokenizer, load_model\n"
        "from rlkit.recipe.schema import ModelConfig\n"
        f"cfg = ModelConfig(path={path!r})\n"
        "tok = load_tokenizer(cfg)\n"
        "print('MODEL', type(load_model(cfg, tokenizer=tok)).__name__, cfg.path)\n"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_hub_ids_and_paths_are_told_apart(tmp_path, monkeypatch):
    assert is_hub_id("Qwen/Qwen2.5-3B-Instruct") and is_hub_id("gpt2")
    assert not is_hub_id("./model") and not is_hub_id("/no/such/folder") and not is_hub_id("a/b/c")
    (tmp_path / "org").mkdir()
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org")  # an existing local folder wins


def test_the_built_cache_is_a_real_hf_cache(tmp_path, tiny_model_dir, monkeypatch):
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    snapshot = build_hf_cache(tmp_path / "hub", tiny_model_dir)
    info = scan_cache_dir(tmp_path / "hub")
    assert [r.repo_id for r in info.repos] == [REPO]
    assert [rev.commit_hash for rev in next(iter(info.repos)).revisions] == [REVISION]
    found = try_to_load_from_cache(REPO, "config.json", cache_dir=tmp_path / "hub")
    assert found == str(snapshot / "config.json")


def test_offline_a_cached_hub_id_trains_through_rlkit_run(tmp_path, tiny_model_dir):
    """`rlkit run` with model.path a hub id, HF_HUB_OFFLINE=1: the model comes from the HF cache."""
    from rlkit.data import generate_arithmetic

    cache = tmp_path / "hub"
    snapshot = build_hf_cache(cache, tiny_model_dir)
    generate_arithmetic(tmp_path / "data", train_size=8, test_size=2, seed=0)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        recipe_text(REPO, tmp_path / "data", tmp_path / "out", reliability_overrides(steps=1, keep=1))
    )
    result = subprocess.run(
        [sys.executable, "-m", "rlkit", "run", str(recipe)],
        env=hub_env(cache, HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    saved = (tmp_path / "out" / "checkpoints" / "global_step_1" / "recipe.yaml").read_text()
    assert str(snapshot) in saved  # the workers were given the snapshot folder, not the id


def test_offline_and_not_cached_is_one_clear_error(tmp_path):
    result = resolve_in_subprocess(REPO, hub_env(tmp_path / "empty-hub", HF_HUB_OFFLINE="1"))
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "HubModelError" in last and REPO in last and "offline mode is on (HF_HUB_OFFLINE=1)" in last
    assert f"hf download {REPO}" in last and "local model folder" in last


def test_an_unreachable_hub_is_one_clear_error(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    result = resolve_in_subprocess(
        REPO, hub_env(tmp_path / "empty-hub", HF_HUB_OFFLINE="0", HF_ENDPOINT=endpoint)
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "HubModelError" in last and REPO in last and f"the Hub ({endpoint}) could not be reached" in last
    assert f"hf download {REPO}" in last and "couldn't connect" not in result.stderr.lower()


def test_an_unreachable_hub_still_serves_the_cache(tmp_path, tiny_model_dir):
    cache = tmp_path / "hub"
    build_hf_cache(cache, tiny_model_dir)
    env = hub_env(cache, HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    result = resolve_in_subprocess(REPO, env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MODEL Qwen2ForCausalLM" in result.stdout


def test_a_truncated_safetensors_file_is_named_with_the_refetch_command(
    tmp_path, tiny_model_dir, monkeypatch
):
    from huggingface_hub import constants

    from rlkit.model.load import load_model
    from rlkit.recipe.schema import ModelConfig

    snapshot = build_hf_cache(tmp_path / "hub", tiny_model_dir)
    blob = (snapshot / "model.safetensors").resolve()
    blob.write_bytes(blob.read_bytes()[:100])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RlkitError) as err:
        load_model(ModelConfig(path=REPO))
    message = str(err.value)
    assert str(snapshot / "model.safetensors") in message and "truncated" in message
    assert f"hf download {REPO} --force-download" in message


def test_a_truncated_local_folder_points_at_rlkit_merge(tmp_path, tiny_model_dir):
    from rlkit.model.load import load_model
    from rlkit.recipe.schema import ModelConfig

    folder = tmp_path / "merged"
    shutil.copytree(tiny_model_dir, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(RlkitError) as err:
        load_model(ModelConfig(path=str(folder)))
    assert str(weights) in str(err.value) and "rlkit merge" in str(err.value)


def lora_checkpoint(tmp_path: Path, model_dir: Path, base: str) -> Path:
    """A LoRA checkpoint as the actor writes it: hf_config/, actor/adapter_config.json naming ``base``, DCP
    shards."""
    import peft
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "global_step_1"
    shutil.copytree(model_dir, ckpt / "hf_config", ignore=shutil.ignore_patterns("*.safetensors"))
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
    inner = model.base_model.model
    adapter = {k: p.detach().clone() for k, p in inner.named_parameters() if p.requires_grad}
    dcp.save({"model": adapter}, checkpoint_id=str(ckpt / "actor" / "dcp"), no_dist=True)
    config.base_model_name_or_path = base
    config.save_pretrained(str(ckpt / "actor"))
    return ckpt


def test_merge_finds_a_hub_base_model_in_the_cache(tmp_path, tiny_model_dir, monkeypatch):
    from huggingface_hub import constants

    from rlkit.recipe.hub import HubModelError
    from rlkit.runtime.merge import merge_checkpoint

    ckpt = lora_checkpoint(tmp_path, tiny_model_dir, REPO)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(
        HubModelError, match=rf"adapter_config.json base_model_name_or_path.*{REPO}.*hf download"
    ):
        merge_checkpoint(ckpt, tmp_path / "merged", merge_lora=True)
    build_hf_cache(tmp_path / "hub", tiny_model_dir)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    out = merge_checkpoint(ckpt, tmp_path / "merged", merge_lora=True)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_validate_checks_a_cached_hub_reward_model_and_leaves_an_uncached_one_to_the_run(
    tmp_path, tiny_model_dir, monkeypatch
):
    from huggingface_hub import constants

    from rlkit.errors import RecipeError
    from rlkit.recipe import validate_recipe

    (tmp_path / "t.parquet").write_bytes(b"")
    raw = {
        "model": {"path": "m"},
        "data": {"train_files": [str(tmp_path / "t.parquet")]},
        "rollout": {"n": 2},
        "resources": {"device": "cpu"},
        "reward": {"reward_model": {"enable": True, "path": REPO}},
    }
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    validate_recipe(raw)  # not cached: downloaded (or refused with HubModelError) at `rlkit run`
    build_hf_cache(tmp_path / "hub", tiny_model_dir)  # cached: a causal LM, not a reward model
    with pytest.raises(RecipeError) as err:
        validate_recipe(raw)
    assert "ForSequenceClassification" in dict(err.value.problems)["reward.reward_model.path"]


def test_every_model_key_of_a_recipe_is_resolved_on_the_driver(tmp_path, tiny_model_dir, monkeypatch):
    from huggingface_hub import constants

    from rlkit.recipe import validate_recipe
    from rlkit.recipe.hub import resolve_recipe_models

    snapshot = build_hf_cache(tmp_path / "hub", tiny_model_dir)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    raw = {
        "model": {"path": REPO, "tokenizer_path": REPO},
        "data": {"train_files": ["t.parquet"]},
        "rollout": {"n": 2},
        "algorithm": {"estimator": "gae"},
        "critic": {"model_path": REPO},
        "reward": {"reward_model": {"enable": True, "path": REPO}},
    }
    recipe = resolve_recipe_models(validate_recipe(raw, check_files=False))
    assert {
        recipe.model.path,
        recipe.model.tokenizer_path,
        recipe.critic.model_path,
        recipe.reward.reward_model.path,
    } == {str(snapshot)}
    local = validate_recipe(
        raw | {"model": {"path": str(tiny_model_dir)}, "critic": {}, "reward": {}}, check_files=False
    )
    assert resolve_recipe_models(local) is local  # nothing to resolve: the same recipe
