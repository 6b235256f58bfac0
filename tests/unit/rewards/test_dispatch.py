"""The compute_score dispatcher and custom score files."""

from __future__ import annotations

import pytest

import rlkit
from rlkit.errors import RlkitError
from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries
from rlkit.plugin.specs import ComputeScoreSpec
from rlkit.rewards.dispatch import (
    ScoreDispatcher,
    ScoreLoadError,
    UnknownDataSourceError,
    batched,
    compute_score,
    get_score_fn,
    load_custom_score,
)


@pytest.fixture
def registries():
    return build_registries(make_plugin_manager(entry_points=False))


@pytest.mark.parametrize(
    ("source", "solution", "truth"),
    [
        ("openai/gsm8k", "#### 72", "72"),
        ("gsm8k", "#### 72", "72"),
        ("HuggingFaceH4/MATH-500", "\\boxed{\\frac{1}{2}}", "\\frac12"),
        ("math500", "\\boxed{3}", "3"),
        ("lighteval/MATH", "\\boxed{3}", "3"),
        ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{3}", "3"),
        ("math", "\\boxed{3}", "3"),
        ("rlkit/arithmetic", "8", "8"),
        ("arithmetic", "8", "8"),
    ],
)
def test_builtin_sources(registries, source, solution, truth):
    assert compute_score(source, solution, truth, registries=registries) == 1.0


def test_public_entry_point():
    assert rlkit.compute_score("openai/gsm8k", "#### 1,000", "1000") == 1.0


def test_unknown_source_lists_known_and_suggests(registries):
    with pytest.raises(UnknownDataSourceError) as info:
        compute_score("openai/gsm8", "#### 1", "1", registries=registries)
    message = str(info.value)
    assert isinstance(info.value, RlkitError)
    assert "openai/gsm8" in message and "HuggingFaceH4/MATH-500" in message and "rlkit/arithmetic" in message
    assert "Did you mean 'openai/gsm8k'?" in message


def test_plugin_score_is_found_without_global_state():
    class Plugin:
        @rlkit.hookimpl
        def rlkit_register_compute_scores(self):
            return [
                ComputeScoreSpec(
                    name="my/source", fn=lambda ds, s, gt, extra=None: {"score": 0.5, "len": len(s)}
                )
            ]

    mine = build_registries(make_plugin_manager(entry_points=False, extra_plugins=(("mine", Plugin()),)))
    assert compute_score("my/source", "abc", "x", registries=mine) == {"score": 0.5, "len": 3}
    with pytest.raises(UnknownDataSourceError):  # a fresh set of registries does not see it
        get_score_fn("my/source", build_registries(make_plugin_manager(entry_points=False)))


def test_load_custom_score(tmp_path, registries):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.25\n"
    )
    fn = load_custom_score(path, "compute_score")
    assert fn("anything", "x", "y") == 0.25
    dispatcher = ScoreDispatcher(registries, custom=fn)
    assert dispatcher("unregistered/source", "x", "y") == 0.25
    assert ScoreDispatcher(registries)("gsm8k", "#### 2", "2") == 1.0
    assert batched(ScoreDispatcher(registries))(
        ["gsm8k", "arithmetic"], ["#### 2", "3"], ["2", "4"], [None, None]
    ) == [1.0, 0.0]


def test_load_custom_score_errors(tmp_path):
    with pytest.raises(ScoreLoadError, match="does not exist"):
        load_custom_score(tmp_path / "missing.py", "compute_score")
    path = tmp_path / "r.py"
    path.write_text("def compute_scor(a, b, c, d=None):\n    return 1.0\nTHRESHOLD = 3\n")
    with pytest.raises(ScoreLoadError, match=r"defines no 'compute_score'.*compute_scor.*Did you mean"):
        load_custom_score(path, "compute_score")
    with pytest.raises(ScoreLoadError, match="is a int, not a function"):
        load_custom_score(path, "THRESHOLD")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ScoreLoadError, match="RuntimeError: boom"):
        load_custom_score(broken, "compute_score")


def test_make_score_fn(tmp_path, registries):
    from rlkit.rewards.dispatch import make_score_fn

    assert make_score_fn(registries)("gsm8k", "#### 3", "3") == 1.0
    assert make_score_fn(registries, batch_call=True)(["gsm8k"], ["#### 3"], ["4"], [None]) == [0.0]
    path = tmp_path / "s.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n"
    )
    assert (
        make_score_fn(registries, {"path": str(path), "name": "compute_score"})("any/source", "x", "y") == 0.5
    )
