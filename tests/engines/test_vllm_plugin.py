"""The rlkit-vllm package without the engine (default suite, fast): registration, parameters checked at
validation, and the errors a user without vLLM or with an unsupported setting gets. The engine itself:
tests/engines/test_vllm_real.py (marker ``engines``)."""

from __future__ import annotations

from importlib import metadata

import pytest

try:  # the entry point, not just the module: the registry finds plugins through it
    metadata.distribution("rlkit-vllm")
except metadata.PackageNotFoundError:
    pytest.skip("rlkit-vllm is not installed (pip install -e plugins/rlkit-vllm)", allow_module_level=True)


@pytest.fixture(scope="module")
def registries():
    from rlkit.plugin.manager import make_plugin_manager
    from rlkit.plugin.registry import build_registries

    return build_registries(make_plugin_manager())


def test_vllm_is_registered_with_its_params_and_no_undeclared_capabilities(registries):
    from rlkit_vllm import VllmParams

    spec = registries.rollout_backends.get("vllm")
    assert spec.params in (VllmParams, "rlkit_vllm.params:VllmParams")
    assert spec.generate_ids is False and spec.memory_release is False  # sleep/wake free nothing on CPU
    # limits refused at validation (tests/reliability/test_bad_input.py), LoRA taken through vLLM's own
    # loading
    assert spec.truncated_sampling is False and spec.max_ranks == 1 and spec.lora is True


def test_a_lora_actor_with_vllm_or_sglang_validates(tmp_path):
    from rlkit.recipe.validate import load_recipe

    for backend in ("vllm", "sglang"):
        recipe = load_recipe(_recipe(tmp_path, backend), ["actor.lora={rank: 8}"], check_files=False)
        assert recipe.actor.lora.rank == 8 and recipe.rollout.backend.name == backend


def _recipe(tmp_path, backend: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"""\
model: {{path: some/model}}
data: {{train_files: [train.parquet], max_prompt_length: 8, max_response_length: 8, train_batch_size: 2}}
algorithm: {{estimator: grpo}}
rollout: {{n: 2, backend: {backend}}}
""")
    return str(path)


def test_a_bad_vllm_parameter_is_a_validation_error_naming_the_key(tmp_path):
    from rlkit.errors import RlkitError
    from rlkit.recipe.validate import load_recipe

    with pytest.raises(RlkitError) as exc:
        load_recipe(_recipe(tmp_path, "{name: vllm, kv_cache_gib: -1, weight_sync: nccl}"), check_files=False)
    text = str(exc.value)
    assert "rollout.backend.kv_cache_gib" in text and "rollout.backend.weight_sync" in text


def test_the_vllm_parameters_reach_the_params_model(tmp_path):
    from rlkit.recipe.validate import load_recipe

    recipe = load_recipe(
        _recipe(tmp_path, "{name: vllm, weight_sync: folder, max_model_len: 128}"), check_files=False
    )
    assert recipe.rollout.backend.name == "vllm"
    assert recipe.rollout.backend.params["weight_sync"] == "folder"


def test_without_a_module_the_backend_says_what_it_needs():
    from rlkit_vllm import VllmError
    from rlkit_vllm.backend import VllmRollout

    from rlkit.recipe.schema import RolloutConfig

    with pytest.raises(VllmError, match="actor's Hugging Face module"):
        VllmRollout(module=None, tokenizer=None, rollout_config=RolloutConfig(), max_response_length=4)
