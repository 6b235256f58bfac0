"""The example plugin's own tests: rlkit's conformance kit run on what this package registers.

Run them with ``pytest plugins/rlkit-example/tests`` (the package and rlkit installed). ``check_*``
raise an AssertionError that names the entry, the broken rule and the contract.
"""

from __future__ import annotations

import pytest
from rlkit_example.hooks import rlkit_register_estimators

from rlkit.testing import check_compute_score, check_estimator


def test_group_median_conforms(rlkit_registries):
    check_estimator("group_median", registries=rlkit_registries)


@pytest.mark.parametrize("quantile", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_group_quantile_conforms_for_each_parameter(rlkit_registries, quantile):
    check_estimator("group_quantile", registries=rlkit_registries, quantile=quantile)


def test_the_specs_conform_before_installation():
    """The spec objects themselves, without the entry point: what to run while writing the plugin."""
    for spec in rlkit_register_estimators():
        check_estimator(spec)


def test_an_out_of_range_parameter_is_refused_by_the_params_model(rlkit_registries):
    with pytest.raises(AssertionError, match=r"quantile: .*less than or equal to 1.*group_quantile"):
        check_estimator("group_quantile", registries=rlkit_registries, quantile=1.5)


def test_keyword_score_conforms(rlkit_registries):
    check_compute_score(
        "example/keyword",
        [("The answer is Paris.", "paris", 1.0), ("London", "paris", 0.0)],
        registries=rlkit_registries,
    )
