"""The conformance kit fails, with a message that says why, on components that break their contract.

Each broken component here is a real one with one realistic bug (the kind a plugin author makes),
registered as a spec the way a plugin would; the kit must name the component and the problem.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from rlkit.algos import masked_mean
from rlkit.algos.estimators import grpo
from rlkit.algos.policy_losses import ppo_clip
from rlkit.errors import RlkitError
from rlkit.plugin.specs import (
    AgentLoopSpec,
    ComputeScoreSpec,
    EstimatorSpec,
    PolicyLossSpec,
    RewardManagerSpec,
    RoleSpec,
    RolloutBackendSpec,
    ToolSpec,
    TrackerSpec,
)
from rlkit.rewards.managers import NaiveRewardManager, RewardManager
from rlkit.rollout.hf import HFRollout
from rlkit.testing import (
    ContractError,
    check_agent_loop,
    check_compute_score,
    check_estimator,
    check_policy_loss,
    check_reward_manager,
    check_role,
    check_rollout_backend,
    check_tool,
    check_tracker,
)


def est(fn, **kw) -> EstimatorSpec:
    return EstimatorSpec(name=fn.__name__, fn=fn, needs_groups=True, **kw)


def scores_of(rewards, mask):
    return (rewards * mask).sum(-1)  # [B]


# ----- estimators -----------------------------------------------------------------------------------
def leaky(x):
    token_level_rewards, response_mask = x.token_level_rewards, x.response_mask
    # forgot the mask
    adv = scores_of(token_level_rewards, response_mask)[:, None].expand_as(response_mask).clone()
    return adv, adv


def no_epsilon(x):
    token_level_rewards, response_mask, index = x.token_level_rewards, x.response_mask, x.group_id
    s = scores_of(token_level_rewards, response_mask)
    mean = torch.stack([s[index == g].mean() for g in index])
    std = torch.stack([s[index == g].std() for g in index])
    adv = ((s - mean) / std)[:, None] * response_mask  # a group with equal scores: 0 / 0
    return adv, adv


def first_row_baseline(x):
    token_level_rewards, response_mask = x.token_level_rewards, x.response_mask
    s = scores_of(token_level_rewards, response_mask)
    adv = (s - s[0])[:, None] * response_mask  # "the group" is wherever row 0 happens to be
    return adv, adv


def noisy(x):
    response_mask = x.response_mask
    adv = torch.randn(response_mask.shape) * response_mask
    return adv, adv


def in_place(x):
    token_level_rewards = x.token_level_rewards
    token_level_rewards.mul_(2.0)
    return grpo(x)


def per_sequence(x):
    token_level_rewards, response_mask = x.token_level_rewards, x.response_mask
    s = scores_of(token_level_rewards, response_mask)
    return s, s  # [B], not [B, T]


class ShiftParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    shift: float = Field(0.0, ge=0, description="added to every advantage")


def shifted(x, *, shift=0.0):
    adv, ret = grpo(x)
    return adv + shift, ret  # the shift lands on masked tokens too


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (est(leaky), "advantages is not 0 where response_mask is 0"),
        (
            est(no_epsilon),
            "NaN/inf in rows [0, 1, 2, 3]. Rows 0..G-1 form a group whose scores are all equal",
        ),
        (est(first_row_baseline), "permuting whole groups"),
        (est(noisy), "two calls on the same inputs gave different results"),
        (est(in_place), "modified its input `rewards` in place"),
        (est(per_sequence), "advantages has shape (16,); expected [B, T] = (16, 6)"),
    ],
)
def test_estimator_bugs_are_caught(spec, message):
    with pytest.raises(ContractError, match="estimators entry '" + spec.name) as err:
        check_estimator(spec)
    assert message in str(err.value) and "Contract: fn(inputs: EstimatorInputs" in str(err.value)


def test_estimator_parameters_are_validated_and_passed():
    spec = est(shifted, params=ShiftParams)
    check_estimator(spec)  # shift 0: conforms
    with pytest.raises(ContractError, match="advantages is not 0 where response_mask is 0"):
        check_estimator(spec, shift=0.5)  # the parameter arrives, and its bug shows
    with pytest.raises(
        ContractError, match=r"<estimators>.shfit: unknown parameter of estimators entry 'shifted'"
    ):
        check_estimator(spec, shfit=0.5)
    with pytest.raises(ContractError, match="greater than or equal to 0"):
        check_estimator(spec, shift=-1.0)


def test_contract_error_is_an_assertion_and_an_rlkit_error():
    assert issubclass(ContractError, AssertionError) and issubclass(ContractError, RlkitError)
    with pytest.raises(ContractError, match="unknown estimators entry 'no_such'"):
        check_estimator("no_such")


# ----- policy losses --------------------------------------------------------------------------------
def batch_normalised(log_prob, old_log_prob, advantages, response_mask):
    ratio = torch.exp(log_prob - old_log_prob)
    scale = masked_mean(advantages.abs(), response_mask)  # a micro-batch statistic inside the loss
    return -advantages * ratio / scale, {}


def unmasked_sequence_ratio(log_prob, old_log_prob, advantages, response_mask):
    seq = (log_prob - old_log_prob).mean(-1, keepdim=True)  # mean over padding too
    return -advantages * torch.exp(seq), {}


def tensor_metric(log_prob, old_log_prob, advantages, response_mask):
    loss, metrics = ppo_clip(log_prob, old_log_prob, advantages, response_mask)
    return loss, {"ppo_kl": torch.tensor(metrics["ppo_kl"])}


def detached(log_prob, old_log_prob, advantages, response_mask):
    return (-advantages * torch.exp(log_prob - old_log_prob)).detach(), {}


def prefixed(log_prob, old_log_prob, advantages, response_mask):
    loss, metrics = ppo_clip(log_prob, old_log_prob, advantages, response_mask)
    return loss, {f"actor/{k}": v for k, v in metrics.items()}


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (batch_normalised, "a row's loss must not depend on the other rows of its micro-batch"),
        (unmasked_sequence_ratio, "masked tokens get a gradient"),
        (tensor_metric, "metric 'ppo_kl' = tensor("),
        (detached, "no gradient with respect to log_prob"),
        (prefixed, "metric 'actor/pg_clipfrac' is prefixed"),
    ],
)
def test_policy_loss_bugs_are_caught(fn, message):
    with pytest.raises(ContractError, match=f"policy_losses entry '{fn.__name__}'") as err:
        check_policy_loss(PolicyLossSpec(name=fn.__name__, fn=fn))
    assert message in str(err.value)


# ----- reward managers, compute_score ----------------------------------------------------------------
class LastColumnManager(NaiveRewardManager):
    """Puts each score on the last column instead of the last valid token."""

    def __call__(self, batch):
        result = super().__call__(batch)
        scores = result.token_level_scores.sum(-1)
        result.token_level_scores = torch.zeros_like(result.token_level_scores)
        result.token_level_scores[:, -1] = scores
        return result


class SilentManager(RewardManager):
    """Scores a sample that failed as 0 and does not count it."""

    def score_all(self, items):
        from rlkit.rewards.managers import ScoreOutcome, normalize_score

        out = []
        for item in items:
            try:
                out.append(normalize_score(self.score_fn(*item), 0.0))
            except Exception:  # noqa: BLE001
                out.append(ScoreOutcome(0.0))
        return [o if o.error is None else ScoreOutcome(0.0) for o in out]


class NoTimeoutManager(NaiveRewardManager):
    def __init__(self, tokenizer, score_fn, *, num_examine=0, default_score=0.0):
        super().__init__(tokenizer, score_fn, num_examine=num_examine, default_score=default_score)


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (LastColumnManager, "have scores away from their last valid token"),
        (SilentManager, "differ from the expected"),
        (NoTimeoutManager, "the constructor refused rlkit's arguments"),
    ],
)
def test_reward_manager_bugs_are_caught(cls, message):
    from rlkit.model.tiny import build_tiny_tokenizer

    with pytest.raises(ContractError, match=f"reward_managers entry '{cls.__name__}'") as err:
        check_reward_manager(RewardManagerSpec(name=cls.__name__, cls=cls), build_tiny_tokenizer())
    assert message in str(err.value)


def test_compute_score_bugs_are_caught():
    def text_score(data_source, solution_str, ground_truth, extra_info=None):
        return "1.0" if ground_truth in solution_str else "0.0"

    def needs_extra_info(data_source, solution_str, ground_truth, extra_info=None):
        return float(extra_info["weight"])

    with pytest.raises(ContractError, match="returned str '1.0', not a number"):
        check_compute_score(ComputeScoreSpec(name="my/text", fn=text_score), [("a 3", "3", 1.0)])
    with pytest.raises(ContractError, match="raised TypeError"):
        check_compute_score(
            ComputeScoreSpec(name="my/extra", fn=needs_extra_info),
            [("x", "y", 1.0)],
            extra_info={"weight": 1.0},
        )


# ----- rollout backends, agent loops -----------------------------------------------------------------
class SampleMajorRollout(HFRollout):
    """Returns the n samples sample-major (j * B + i) instead of prompt-major."""

    def generate(self, prompts, **kw):
        out = super().generate(prompts, **kw)
        n = len(out) // len(prompts)
        order = torch.arange(len(out)).view(len(prompts), n).t().reshape(-1)
        return out[order]


class TruncatedLogProbRollout(HFRollout):
    """Reports the log-prob under the top-k-truncated distribution (renormalised): not what the actor
    computes."""

    def generate(self, prompts, **kw):
        out = super().generate(prompts, **kw)
        out.tensors["rollout_log_probs"] = out["rollout_log_probs"] * 0.9
        return out


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (RolloutBackendSpec(name="sample_major", cls=SampleMajorRollout), "row 1 does not hold prompt 0"),
        (
            RolloutBackendSpec(name="truncated", cls=TruncatedLogProbRollout),
            "rollout_log_probs differ from the model's",
        ),
        (
            RolloutBackendSpec(name="claims_ids", cls=HFRollout, generate_ids=True),
            "the spec declares generate_ids=True but HFRollout lacks ['generate_ids']",
        ),
        (
            RolloutBackendSpec(name="claims_memory", cls=HFRollout, memory_release=True),
            "declares memory_release=True",
        ),
    ],
)
def test_rollout_backend_bugs_are_caught(spec, message, tiny):
    model, tokenizer = tiny
    with pytest.raises(ContractError, match=f"rollout_backends entry '{spec.name}'") as err:
        check_rollout_backend(spec, model, tokenizer)
    assert message in str(err.value)


class HidesFirstTokenLoop:
    """Marks the policy's first token as a tool token (mask 0) but keeps its log-prob."""

    def __init__(self, generator, tokenizer, tools, *, max_response_length, sampling=None):
        from rlkit.rollout.agent import SingleTurnAgentLoop

        self.inner = SingleTurnAgentLoop(
            generator, tokenizer, max_response_length=max_response_length, sampling=sampling
        )
        self.schemas = None

    def prompt_ids(self, messages):
        return self.inner.prompt_ids(messages)

    async def run(self, messages, tools_kwargs=None, prompt_ids=None):
        traj = await self.inner.run(messages, tools_kwargs, prompt_ids=prompt_ids)
        traj.response_mask[0] = 0
        return traj


def test_agent_loop_bug_is_caught(tiny):
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.rollout.agent import HFTurnGenerator

    model, tokenizer = tiny
    generator = HFTurnGenerator(
        HFRollout(module=model, tokenizer=tokenizer, rollout_config=RolloutConfig(), max_response_length=12)
    )
    with pytest.raises(ContractError, match="agent_loops entry 'hides'.*start with the policy's own tokens"):
        check_agent_loop(AgentLoopSpec(name="hides", cls=HidesFirstTokenLoop), generator, tokenizer)


# ----- trackers, roles, tools ------------------------------------------------------------------------
class ForgetfulTracker:
    """A new run id every time it is built: a resumed run would start a second run."""

    name = "forgetful"

    def __init__(self, config):
        import uuid

        self.run_id = uuid.uuid4().hex

    def log_params(self, params): ...

    def log(self, metrics, step): ...

    def log_artifact(self, path): ...

    def log_text(self, text, name): ...

    def finish(self, status="FINISHED"): ...


class NanRefusingTracker(ForgetfulTracker):
    def log(self, metrics, step):
        if any(v != v for v in metrics.values()):
            raise ValueError("NaN metric")


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (ForgetfulTracker, "it must continue the same run"),
        (NanRefusingTracker, "raised ValueError: NaN metric"),
    ],
)
def test_tracker_bugs_are_caught(cls, message, tmp_path):
    with pytest.raises(ContractError, match=message):
        check_tracker(TrackerSpec(name=cls.name, cls=cls), tmp_path)


class ValueOnlyCritic:
    def __init__(
        self,
        rank,
        world_size,
        master_addr,
        master_port,
        device,
        threads=1,
        *,
        model_config,
        critic_config,
        rollout_n,
        ppo_mini_batch_size,
        total_steps=1,
        mixed_precision="fp32",
        seed=1,
    ): ...

    def ping(self): ...

    def destroy(self): ...

    def compute_values(self, batch): ...


class FixedKwargsRef:
    def __init__(
        self, rank, world_size, master_addr, master_port, device, threads=1, *, model_config, ref_config
    ): ...


def test_role_bugs_are_caught():
    with pytest.raises(ContractError, match=r"slot 'critic' needs method update_critic\(\)"):
        check_role(RoleSpec(name="my_critic", cls=ValueOnlyCritic, slot="critic"))
    with pytest.raises(ContractError, match="does not bind: got an unexpected keyword argument"):
        check_role(RoleSpec(name="my_ref", cls=FixedKwargsRef, slot="ref"))
    with pytest.raises(ContractError, match="fills slot 'judge', which the step does not have"):
        check_role(RoleSpec(name="judge", cls=FixedKwargsRef))


def test_tool_bug_is_caught():
    from rlkit.rollout.tools.calculator import CalculatorTool

    class Renamed(CalculatorTool):
        def schema(self):
            return {**super().schema(), "function": {**super().schema()["function"], "name": "calc"}}

    with pytest.raises(ContractError, match="schema\\(\\) must be"):
        check_tool(ToolSpec(name="calculator2", cls=Renamed), {"expression": "1 + 1"})
    with pytest.raises(ContractError, match="expected ok=True and text containing '3'"):
        check_tool("calculator", {"expression": "1 + 1"}, contains="3")
