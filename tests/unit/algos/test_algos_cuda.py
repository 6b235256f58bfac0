"""Every registered estimator and policy loss on a CUDA device equals the same call on the CPU (values,
gradients, metrics). Marked ``cuda``: skipped, with the reason, where torch sees no GPU (tests/conftest.py);
run on a GPU with ``python -m pytest -m cuda tests/unit`` (benchmarks/gpu_check.sh does)."""

from __future__ import annotations

import pytest
import torch
from test_algos_registry_purity import (
    ACTOR_KEYS,
    ALGORITHM_KEYS,
    ESTIMATORS,
    LOSSES,
    estimator_inputs,
    fields,
    resolved,
    small_batch,
)

from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def registries():
    return build_registries(make_plugin_manager(entry_points=False))


def _to(tensors, device):
    return [t.to(device) for t in tensors]


def _estimate(spec, est, device):
    rewards, mask, index, values, baselines = small_batch()
    # graded, mixed rewards in both groups: every estimator's advantages are non-zero somewhere
    rewards[torch.arange(6), mask.sum(-1).long() - 1] = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.25])
    batch = _to((rewards, mask, index, values, baselines), device)
    return est.fn(estimator_inputs(spec, *batch), **est.kwargs)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_every_estimator_on_cuda_equals_the_cpu(registries, name):
    spec = registries.estimators.get(name)
    est = resolved(registries, "algorithm.estimator", "estimators", name, ALGORITHM_KEYS)
    adv_cpu, ret_cpu = _estimate(spec, est, torch.device("cpu"))
    adv, ret = _estimate(spec, est, CUDA)
    assert adv.device.type == "cuda" and ret.device.type == "cuda"
    torch.testing.assert_close(adv.cpu(), adv_cpu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu(), ret_cpu, atol=1e-5, rtol=1e-5)
    assert adv_cpu.abs().sum() > 0  # the comparison is on non-trivial values


def _loss_and_grad(loss, device):
    import rlkit.algos

    rewards, mask, _, noise, _ = _to(small_batch(), device)
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(rewards.shape, generator=g).to(device)
    log_prob = (old + 0.1 * noise).detach().requires_grad_(True)
    per_token, metrics = loss.fn(log_prob, old, noise, mask, **loss.kwargs)
    total = rlkit.algos.agg_loss(per_token, mask, "token-mean")
    total.backward()
    return total.detach().cpu(), log_prob.grad.cpu(), metrics


@pytest.mark.parametrize("name", LOSSES)
def test_every_policy_loss_and_its_gradient_on_cuda_equal_the_cpu(registries, name):
    assert fields(registries.policy_losses.get(name)) <= set(ACTOR_KEYS)
    loss = resolved(registries, "actor.policy_loss", "policy_losses", name, ACTOR_KEYS)
    value_cpu, grad_cpu, metrics_cpu = _loss_and_grad(loss, torch.device("cpu"))
    value, grad, metrics = _loss_and_grad(loss, CUDA)
    torch.testing.assert_close(value, value_cpu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, grad_cpu, atol=1e-5, rtol=1e-5)
    assert grad_cpu.abs().sum() > 0
    assert metrics.keys() == metrics_cpu.keys()
    for key in metrics:
        assert metrics[key] == pytest.approx(metrics_cpu[key], abs=1e-5), key
