"""Plugin manager and registries: built-ins, entry points, duplicates, broken plugins."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import rlkit
from rlkit.errors import PluginError, UnknownNameError
from rlkit.plugin.hookspecs import REGISTRY_KINDS
from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries
from rlkit.plugin.specs import ComputeScoreSpec, EstimatorSpec, PolicyLossSpec


def _fn(*args, **kwargs):
    return None


class _DupEstimator:
    @rlkit.hookimpl
    def rlkit_register_estimators(self):
        return [EstimatorSpec(name="dup_me", fn=_fn)]


def make_dist(tmp_path: Path, name: str, entry_points: str, modules: dict[str, str]) -> Path:
    """Write an installed-looking distribution (dist-info + modules) into ``tmp_path``."""
    dist = tmp_path / f"{name.replace('-', '_')}-1.2.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.2.3\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for mod, code in modules.items():
        (tmp_path / f"{mod}.py").write_text(textwrap.dedent(code))
    return tmp_path


def test_every_registry_kind_has_a_hook():
    pm = make_plugin_manager(entry_points=False).pm
    for hook_name, _ in REGISTRY_KINDS.values():
        assert hasattr(pm.hook, hook_name)


def test_builtins_come_from_the_rlkit_package():
    registries = build_registries(make_plugin_manager(entry_points=False))
    scores = registries.compute_scores
    assert "openai/gsm8k" in scores
    assert scores.entry("openai/gsm8k").source.package == "rlkit"


def test_extra_plugin_is_registered_with_its_source():
    class Plugin:
        @rlkit.hookimpl
        def rlkit_register_policy_losses(self):
            return [PolicyLossSpec(name="my_loss", fn=_fn, aliases=("mine",))]

    registries = build_registries(
        make_plugin_manager(entry_points=False, extra_plugins=(("mine-plugin", Plugin()),))
    )
    assert registries.policy_losses.get("mine").name == "my_loss"
    assert registries.policy_losses.entry("my_loss").source.plugin == "mine-plugin"


def test_duplicate_name_names_both_plugins():
    plugins = make_plugin_manager(
        entry_points=False, extra_plugins=(("first-pkg", _DupEstimator()), ("second-pkg", _DupEstimator()))
    )
    with pytest.raises(PluginError) as err:
        build_registries(plugins)
    assert "dup_me" in str(err.value) and "first-pkg" in str(err.value) and "second-pkg" in str(err.value)


def test_duplicate_against_a_builtin_alias():
    class Plugin:
        @rlkit.hookimpl
        def rlkit_register_compute_scores(self):
            return [ComputeScoreSpec(name="gsm8k", fn=_fn)]  # alias of openai/gsm8k

    with pytest.raises(PluginError, match="rlkit.builtin.rewards"):
        build_registries(make_plugin_manager(entry_points=False, extra_plugins=(("clash", Plugin()),)))


def test_unknown_name_lists_valid_names_and_suggests():
    registries = build_registries(make_plugin_manager(entry_points=False))
    with pytest.raises(UnknownNameError) as err:
        registries.compute_scores.get("openai/gsm8")
    message = str(err.value)
    assert "Did you mean 'openai/gsm8k'?" in message
    assert "HuggingFaceH4/MATH-500" in message  # the valid names are listed


def test_wrong_spec_type_is_refused():
    class Plugin:
        @rlkit.hookimpl
        def rlkit_register_estimators(self):
            return [PolicyLossSpec(name="x", fn=_fn)]

    with pytest.raises(PluginError, match="must return EstimatorSpec"):
        build_registries(make_plugin_manager(entry_points=False, extra_plugins=(("bad", Plugin()),)))


def test_misspelled_hook_fails_check_pending():
    class Plugin:
        @rlkit.hookimpl
        def rlkit_register_estimator(self):  # missing the final "s"
            return []

    with pytest.raises(PluginError, match="rlkit_register_estimator"):
        make_plugin_manager(entry_points=False, extra_plugins=(("typo", Plugin()),))


def test_entry_points_are_loaded_with_their_package(tmp_path, monkeypatch):
    make_dist(
        tmp_path,
        "rlkit-fake",
        """
        [rlkit]
        fake = fake_hooks
        [rlkit.compute_score]
        fake/source = fake_scores:score
        """,
        {
            "fake_hooks": """
                import rlkit
                from rlkit.plugin.specs import EstimatorSpec
                @rlkit.hookimpl
                def rlkit_register_estimators():
                    return [EstimatorSpec(name="fake_est", fn=print)]
            """,
            "fake_scores": (
                "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
            ),
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registries = build_registries(make_plugin_manager())
    assert registries.estimators.entry("fake_est").source.package == "rlkit-fake"
    assert registries.estimators.entry("fake_est").source.version == "1.2.3"
    score = registries.compute_scores.entry("fake/source")
    assert score.source.package == "rlkit-fake"
    assert score.spec.fn("fake/source", "x", "y") == 1.0


def test_broken_entry_point_is_named_and_the_rest_still_load(tmp_path, monkeypatch):
    make_dist(
        tmp_path,
        "rlkit-broken",
        """
        [rlkit]
        broken = broken_hooks
        """,
        {"broken_hooks": "import a_module_that_does_not_exist\n"},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins = make_plugin_manager()
    assert [b.package for b in plugins.broken] == ["rlkit-broken"]
    with pytest.raises(PluginError) as err:
        build_registries(plugins)
    assert "broken = broken_hooks" in str(err.value) and "rlkit-broken" in str(err.value)
    assert "a_module_that_does_not_exist" in str(err.value)
    registries = build_registries(plugins, allow_broken=True)
    assert "openai/gsm8k" in registries.compute_scores


def test_fresh_managers_do_not_share_state():
    class Plugin:
        @rlkit.hookimpl
        def rlkit_register_tools(self):
            from rlkit.plugin.specs import ToolSpec

            return [ToolSpec(name="only_here", cls=object)]

    with_plugin = build_registries(make_plugin_manager(entry_points=False, extra_plugins=(("p", Plugin()),)))
    without = build_registries(make_plugin_manager(entry_points=False))
    assert "only_here" in with_plugin.tools and "only_here" not in without.tools


@pytest.mark.parametrize(("name", "package"), [("sglang", "rlkit-sglang"), ("vllm", "rlkit-vllm")])
def test_missing_engine_plugin_names_its_package(name, package):
    registries = build_registries(make_plugin_manager(entry_points=False))  # no installed plugins
    assert name not in registries.rollout_backends
    with pytest.raises(UnknownNameError) as err:
        registries.rollout_backends.get(name)
    message = str(err.value)
    assert f"'{name}'" in message and f"pip install {package}" in message and "hf" in message


def test_missing_sglang_plugin_is_named_by_validate():
    from rlkit.errors import RecipeError
    from rlkit.recipe import load_recipe

    registries = build_registries(make_plugin_manager(entry_points=False))
    recipe_path = Path(__file__).resolve().parents[2] / "recipes" / "dapo.yaml"
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe_path, registries=registries, check_files=False)
    assert "rollout.backend" in str(err.value) and "pip install rlkit-sglang" in str(err.value)
