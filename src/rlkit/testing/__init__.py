"""A conformance kit: run your plugin against the contract rlkit calls it with.

Plain functions that raise ``ContractError`` (an ``AssertionError``) with a message naming the
component, the problem and the contract; usable from pytest, unittest or a script::

    from rlkit.testing import check_estimator, check_policy_loss

    def test_my_estimator():
        check_estimator("my_adv", my_param=2)          # a registered name (installed plugin) ...
        check_estimator(MY_SPEC, my_param=2)           # ... or the spec itself, nothing installed

============================  ===================================================================
``check_estimator``           shapes ``[B, T]``, finite (also for a zero-spread group), 0 outside the
                              mask, pure, identical members alike, whole-group permutation equivariance
``check_policy_loss``         ``(per_token_loss [B, T], metrics of floats)``, finite, no gradient
                              through masked tokens, exact micro-batch/rank split with global counts
``check_rollout_correction``  ``(weights or 0/1 mask [B, T], metrics)``, finite, 0 on padding, 1 when
                              on-policy, row-local
``check_reward_manager``      score on the last valid token, ``[B, T]``, bad scores → ``default_score``
                              counted in ``reward/errors``, ``extra`` lists of length B
``check_compute_score``       your examples score as expected (float or dict with ``score``), for the
                              data_source and every alias, also for an empty response
``check_rollout_backend``     the generate layout (shapes, masks, ``n`` ordering, positions, one
                              log-prob per response token, the actor's log-probs), ``max_new_tokens``,
                              ``update_weights`` and every capability the spec declares
``check_agent_loop``          constructor, ``prompt_ids``, ``run`` → a consistent ``Trajectory``
``check_tracker``             every ``Tracker`` method, and resuming its run id
``check_role``                the methods and constructor keywords of the slot a role fills
``check_tool``                ``schema()``, a call through ``call_tool``, bad arguments as failed results
``check_environment``         rows (veRL schema, data_source = its name), finite scores, the ground truth
                              above a wrong answer; multi-turn: ``(reply, done)`` steps and a reward
============================  ===================================================================

The protocols the checks enforce are in ``rlkit.plugin.protocols``. With pytest, add
``pytest_plugins = ["rlkit.testing.pytest_plugin"]`` to your ``conftest.py`` for the fixtures
``rlkit_registries``, ``rlkit_tiny_model_dir``, ``rlkit_tokenizer`` and ``rlkit_tiny_model``.
docs/writing-plugins.md shows each check beside the kind of plugin it tests.
"""

from __future__ import annotations

from rlkit.testing._common import ContractError
from rlkit.testing.algos import check_estimator, check_policy_loss
from rlkit.testing.components import check_role, check_tool, check_tracker
from rlkit.testing.corrections import check_rollout_correction
from rlkit.testing.environments import check_environment
from rlkit.testing.rewards import (
    check_compute_score,
    check_reward_manager,
    conformance_score,
    conformance_score_batch,
)
from rlkit.testing.rollout import check_agent_loop, check_rollout_backend

__all__ = [
    "ContractError",
    "check_estimator",
    "check_policy_loss",
    "check_rollout_correction",
    "check_reward_manager",
    "check_compute_score",
    "conformance_score",
    "conformance_score_batch",
    "check_rollout_backend",
    "check_agent_loop",
    "check_tracker",
    "check_role",
    "check_tool",
    "check_environment",
]
