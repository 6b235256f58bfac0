"""The example third-party plugin, installed into the test environment, shows up in rlkit."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import rlkit
from rlkit.algos.estimators import EstimatorInputs
from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries


def test_rlkit_plugins_lists_the_example_entries():
    out = subprocess.run(
        [sys.executable, "-m", "rlkit", "plugins", "--json"], capture_output=True, text=True, check=True
    )
    data = json.loads(out.stdout)
    estimators = {e["name"]: e for e in data["registries"]["estimators"]}
    scores = {e["name"]: e for e in data["registries"]["compute_scores"]}
    assert estimators["group_median"]["package"] == "rlkit-example"
    assert scores["example/keyword"]["package"] == "rlkit-example"
    assert estimators["grpo"]["package"] == "rlkit"  # built-ins are listed beside it
    assert data["broken"] == []


def test_example_estimator_has_the_uniform_signature():
    spec = build_registries(make_plugin_manager()).estimators.get("group_median")
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 5.0, 2.0])  # scores; groups {0,1} and {2,3}
    mask = torch.ones(4, 3)
    adv, ret = spec.fn(EstimatorInputs(rewards, mask, torch.tensor([0, 0, 1, 1])))
    # torch.median of an even group is its lower middle: group 0 → 0.0, group 1 → 2.0
    assert torch.equal(adv[:, 0], torch.tensor([1.0, 0.0, 3.0, 0.0])) and torch.equal(adv, ret)


def test_example_score_through_the_public_dispatcher():
    result = rlkit.compute_score("example/keyword", "The answer is Paris.", "paris")
    assert result["score"] == 1.0
    assert rlkit.compute_score("example/keyword", "London", "paris")["score"] == 0.0


def test_example_estimators_pass_the_conformance_kit():
    """What the plugin's own tests run (plugins/rlkit-example/tests): rlkit.testing on its entries."""
    from rlkit.testing import check_estimator

    registries = build_registries(make_plugin_manager())
    check_estimator("group_median", registries=registries)
    for quantile in (0.0, 0.9):
        check_estimator("group_quantile", registries=registries, quantile=quantile)


def test_the_example_plugins_own_test_suite_passes():
    """A third party's workflow: the plugin's tests import rlkit's fixtures and kit and pass on their own."""
    from pathlib import Path

    tests = Path(__file__).resolve().parents[2] / "plugins" / "rlkit-example" / "tests"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
