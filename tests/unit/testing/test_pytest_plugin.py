"""rlkit.testing.pytest_plugin loaded the documented way, `pytest_plugins` in a plugin's top-level conftest,
in a separate pytest run: its fixtures reach the plugin's tests and a failing check fails the run."""

from __future__ import annotations

import subprocess
import sys

CONFTEST = 'pytest_plugins = ["rlkit.testing.pytest_plugin"]\n'
TESTS = """
import pytest
from rlkit.plugin.specs import EstimatorSpec
from rlkit.testing import check_estimator


def unmasked(x):
    token_level_rewards, response_mask, index = x.token_level_rewards, x.response_mask, x.group_id
    adv = token_level_rewards.sum(-1, keepdim=True).expand_as(response_mask).clone()
    return adv, adv


def test_registries_fixture(rlkit_registries):
    assert "grpo" in rlkit_registries.estimators
    check_estimator("grpo", registries=rlkit_registries)


def test_a_broken_plugin_fails():
    check_estimator(EstimatorSpec(name="unmasked", fn=unmasked))
"""


def test_fixtures_through_pytest_plugins(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_my_plugin.py").write_text(TESTS)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "1 failed, 1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
    assert "estimators entry 'unmasked'" in out.stdout and "not 0 where response_mask is 0" in out.stdout
