"""Recipes: loading, overrides, estimator defaults, and a corpus of broken recipes."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlkit.errors import RecipeError
from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries
from rlkit.recipe import load_recipe, recipe_to_dict, validate_recipe
from rlkit.recipe.load import parse_override

GOOD = """\
model: {path: some/model}
data:
  train_files: [{train}]
  train_batch_size: 4
actor: {ppo_mini_batch_size: 2}
rollout: {n: 4}
algorithm: {estimator: grpo}
"""


@pytest.fixture(scope="module")
def registries():
    return build_registries(make_plugin_manager(entry_points=False))


@pytest.fixture
def recipe_file(tmp_path: Path):
    train = tmp_path / "train.parquet"
    train.write_bytes(b"")  # existence is what validation checks

    def write(text: str = GOOD) -> Path:
        path = tmp_path / "recipe.yaml"
        path.write_text(text.replace("{train}", str(train)))
        return path

    return write


def problems_of(path, overrides=(), registries=None, **kw) -> list[tuple[str, str]]:
    with pytest.raises(RecipeError) as err:
        load_recipe(path, list(overrides), registries=registries, **kw)
    assert str(path) in str(err.value)  # every error names the file
    return err.value.problems


def test_good_recipe_loads_with_defaults(recipe_file, registries):
    recipe = load_recipe(recipe_file(), registries=registries)
    assert recipe.rollout.n == 4 and recipe.actor.policy_loss.name == "ppo_clip"
    # a component's parameters get its params model's defaults written in
    assert recipe.actor.policy_loss.params == {
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
        "clip_ratio_c": 3.0,
    }
    assert recipe.algorithm.estimator.params == {"norm_adv_by_std": True, "epsilon": 1e-6}
    assert [b.name for b in recipe.tracking.backends] == ["console", "mlflow"]


def test_overrides_are_typed_by_the_schema(recipe_file, registries):
    recipe = load_recipe(
        recipe_file(),
        [
            "actor.optim.lr=3e-6",
            "rollout.stop=[a, b]",
            "trainer.total_steps=7",
            "rollout.backend={name: hf, dtype: bfloat16}",
            "algorithm.estimator.epsilon=1e-4",
        ],
        registries=registries,
    )
    assert recipe.actor.optim.lr == 3e-6 and recipe.rollout.stop == ["a", "b"]
    assert recipe.trainer.total_steps == 7
    assert recipe.rollout.backend.name == "hf" and recipe.rollout.backend.params == {
        "dtype": "bfloat16",
        "linears": "auto",
    }
    assert recipe.algorithm.estimator.name == "grpo" and recipe.algorithm.estimator.params["epsilon"] == 1e-4


def test_precision_and_threads_default_to_auto_and_take_explicit_values(recipe_file, registries):
    recipe = load_recipe(recipe_file(), registries=registries)
    assert recipe.actor.mixed_precision == "auto" and recipe.resources.threads_per_worker == "auto"
    recipe = load_recipe(
        recipe_file(),
        ["actor.mixed_precision=bf16", "resources.threads_per_worker=3", "rollout.backend.dtype=bfloat16"],
        registries=registries,
    )
    assert recipe.actor.mixed_precision == "bf16" and recipe.resources.threads_per_worker == 3
    assert recipe.rollout.backend.params["dtype"] == "bfloat16"
    assert load_recipe(recipe_file(), registries=registries).rollout.backend.params["dtype"] == "auto"
    assert (
        load_recipe(
            recipe_file(), ["actor.mixed_precision=auto"], registries=registries
        ).actor.mixed_precision
        == "auto"
    )


def test_tilde_removes_a_key(recipe_file, registries):
    recipe = load_recipe(
        recipe_file(), ["~actor.ppo_mini_batch_size", "actor.ppo_mini_batch_size=4"], registries=registries
    )
    assert recipe.actor.ppo_mini_batch_size == 4
    problems = problems_of(recipe_file(), ["~model.path"], registries)
    assert ("model.path", "required key is missing") in problems


def test_dapo_sets_its_defaults_and_the_user_wins(recipe_file, registries):
    dapo = load_recipe(recipe_file(), ["algorithm.estimator=dapo"], registries=registries)
    loss = dapo.actor.policy_loss.params
    assert loss["clip_ratio_high"] == 0.28 and loss["clip_ratio_low"] == 0.2
    assert dapo.algorithm.filter_groups.enable and dapo.reward.overlong_buffer.enable
    # overlong shaping is a reward step after any manager, so DAPO keeps the default manager
    assert dapo.actor.loss_agg_mode == "token-mean" and dapo.reward.manager.name == "naive"
    mine = load_recipe(
        recipe_file(),
        ["algorithm.estimator=dapo", "actor.policy_loss.clip_ratio_high=0.3"],
        registries=registries,
    )
    assert mine.actor.policy_loss.params["clip_ratio_high"] == 0.3
    # the estimator's other default still applies
    assert mine.actor.policy_loss.params["clip_ratio_low"] == 0.2
    plain = load_recipe(recipe_file(), registries=registries)
    assert (
        plain.actor.policy_loss.params["clip_ratio_high"] == 0.2 and not plain.algorithm.filter_groups.enable
    )
    # a default for a parameter the chosen loss does not have is not applied (gpg takes none)
    gpg = load_recipe(
        recipe_file(), ["algorithm.estimator=dapo", "actor.policy_loss=gpg"], registries=registries
    )
    assert gpg.actor.policy_loss.name == "gpg" and gpg.actor.policy_loss.params == {}


def test_effective_recipe_round_trips(recipe_file, registries):
    recipe = load_recipe(recipe_file(), registries=registries)
    again = validate_recipe(recipe_to_dict(recipe), registries=registries)
    assert again == recipe


@pytest.mark.parametrize("text", ["a.b", "=3", "a..b=1", "~", "a.b=[1, 2", "1a=2"])
def test_bad_override_syntax(text):
    with pytest.raises(ValueError):
        parse_override(text)


# (overrides, expected key path, fragment of the message)
BROKEN = [
    (["actor.loss_agg_mod=token-mean"], "actor.loss_agg_mod", "Did you mean 'loss_agg_mode'"),
    (["actor.policy_loss.clip_ratio_hgh=0.3"], "actor.policy_loss.clip_ratio_hgh", "clip_ratio_high"),
    (["actor.policy_loss.clip_ratio_c=0.5"], "actor.policy_loss.clip_ratio_c", "greater than 1"),
    (["algorithm.estimator={name: ppo, lam: 2}"], "algorithm.estimator.lam", "less than or equal to 1"),
    (
        ["actor.policy_loss={name: gpg, clip_ratio_high: 0.3}"],
        "actor.policy_loss.clip_ratio_high",
        "takes no parameters",
    ),
    (["nonsense.key=1"], "nonsense", "unknown key"),
    (["rollout.n=many"], "rollout.n", "valid integer"),
    (["rollout.n=0"], "rollout.n", "greater than 0"),
    (["actor.loss_agg_mode=mean"], "actor.loss_agg_mode", "token-mean"),
    (["algorithm.estimator=grpoo"], "algorithm.estimator", "Did you mean 'grpo'"),
    (["actor.policy_loss=ppo_clp"], "actor.policy_loss", "ppo_clip"),
    (["reward.manager=navie"], "reward.manager", "naive"),
    (["tracking.backends=[console, mlflw]"], "tracking.backends.1", "mlflow"),
    (["actor.ppo_mini_batch_size=3"], "actor.ppo_mini_batch_size", "does not divide"),
    (["rollout.n=1"], "rollout.n", "2 or more"),
    (["critic.enable=true"], "critic.enable", "uses no critic"),
    (["critic.cliprange_value=0.3"], "critic.cliprange_value", "uses no critic"),
    (["ref.enable=false", "actor.use_kl_loss=true"], "ref.enable", "needs the reference model"),
    (["resources.roles={actor_rollout_ref: gpu_pool}"], "resources.roles.actor_rollout_ref", "unknown pool"),
    (["data.train_files=[/no/such/file.parquet]"], "data.train_files.0", "file not found"),
    (["reward.custom_score={path: /no/such.py}"], "reward.custom_score.path", "file not found"),
    (["badoverride"], "override 'badoverride'", "not an override"),
    (["~nothing.here"], "override '~nothing.here'", "no key"),
    (["model=3"], "model", "valid dictionary"),
    (["actor.mixed_precision=fp16"], "actor.mixed_precision", "'auto', 'fp32' or 'bf16'"),
    (["resources.threads_per_worker=some"], "resources.threads_per_worker", "positive integer or 'auto'"),
    (
        ["resources.threads_per_worker=0"],
        "resources.threads_per_worker",
        "positive integer or 'auto' (got 0)",
    ),
]


@pytest.mark.parametrize("overrides,loc,fragment", BROKEN, ids=[" ".join(o[0]) for o in BROKEN])
def test_broken_recipe_corpus(recipe_file, registries, overrides, loc, fragment):
    problems = problems_of(recipe_file(), overrides, registries)
    matching = [msg for where, msg in problems if where == loc]
    assert matching, f"no problem at {loc}: {problems}"
    assert any(fragment in msg for msg in matching), problems


def test_every_problem_is_reported_at_once(recipe_file, registries):
    problems = problems_of(
        recipe_file(),
        [
            "actor.clip_ratio_hgh=1",
            "actor.policy_loss.clip_ratio_hgh=1",
            "algorithm.estimator=nope",
            "actor.ppo_mini_batch_size=3",
            "data.train_files=[/missing]",
        ],
        registries,
    )
    assert {
        "actor.clip_ratio_hgh",
        "actor.policy_loss.clip_ratio_hgh",
        "algorithm.estimator",
        "data.train_files.0",
    } <= {loc for loc, _ in problems}


@pytest.mark.parametrize(
    "content,fragment",
    [
        ("", "empty"),
        ("model: [unclosed\n", "YAML syntax error"),
        ("- a\n- b\n", "mapping"),
        (None, "not found"),
    ],
    ids=["empty", "syntax", "list", "missing"],
)
def test_unreadable_files(tmp_path, registries, content, fragment):
    path = tmp_path / "r.yaml"
    if content is not None:
        path.write_text(content)
    problems = problems_of(path, registries=registries)
    assert fragment in problems[0][1]


def test_yaml_error_names_the_line(tmp_path, registries):
    path = tmp_path / "r.yaml"
    path.write_text("model:\n  path: a\ndata: {train_files: [x\n")
    ((loc, _),) = problems_of(path, registries=registries)
    assert loc.startswith("line ")


def test_lora_section_and_its_errors(recipe_file, registries):
    import rlkit
    from rlkit.plugin.specs import RolloutBackendSpec

    recipe = load_recipe(
        recipe_file(), ["actor.lora={rank: 4, target_modules: [q_proj, v_proj]}"], registries=registries
    )
    assert (
        recipe.actor.lora.rank == 4
        and recipe.actor.lora.alpha == 16.0
        and recipe.actor.lora.target_modules == ["q_proj", "v_proj"]
    )
    assert load_recipe(recipe_file(), registries=registries).actor.lora is None  # off by default
    [(key, msg)] = problems_of(recipe_file(), ["actor.lora.rank=0"], registries=registries)
    assert key == "actor.lora.rank"
    assert (
        problems_of(recipe_file(), ["critic.lora={rank: 4}"], registries=registries)[0][0] == "critic.lora"
    )  # grpo: no critic
    ppo = load_recipe(
        recipe_file(), ["algorithm.estimator=ppo", "critic.lora={rank: 4}"], registries=registries
    )
    # the critic's own adapter, through the same LoraConfig
    assert ppo.critic.lora.rank == 4 and ppo.actor.lora is None

    class Engine:
        @rlkit.hookimpl
        def rlkit_register_rollout_backends(self):
            return [
                RolloutBackendSpec(name="engine_x", description="an engine with its own weights", cls="x:Y")
            ]

    with_engine = build_registries(
        make_plugin_manager(entry_points=False, extra_plugins=(("engine", Engine()),))
    )
    [(key, msg)] = problems_of(
        recipe_file(), ["actor.lora={rank: 4}", "rollout.backend=engine_x"], registries=with_engine
    )
    assert key == "actor.lora" and "lora=False" in msg and "rollout.backend=hf" in msg
