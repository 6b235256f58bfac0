"""In-process fakes of what ``Trainer.step`` drives (the slot Protocols of a run): worker groups, the reward
step, the rollout pool, so the trainer's data flow runs in a unit test in a second, without Ray or a model.

    rt = FakeRuntime(recipe, tmp_path)              # recipe: a validated Recipe
    (rlkit.recipe.validate_recipe) trainer = Trainer(recipe, rt) metrics = trainer.step(rt.prompts(),
    rt.prompt_stream()) rt.actor.calls["update_actor"][-1]              # the batch the actor update received

The fake actor generates deterministic responses of varying length (``seed``), log-probs that depend on the
tokens, and records every call with the batch it got; the fake reward scores a response by its first token's
parity (so groups hold both outcomes) and its greedy responses differently from sampled ones. Real algorithms
run on top: the recipe's estimator, rollout correction and KL controller come from the registries.

Shapes: ``B`` samples (prompts × n), ``P`` prompt width, ``T`` response width.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from rlkit.batch import Batch
from rlkit.plugin.registry import build_registries
from rlkit.recipe.compose import compose
from rlkit.rewards.managers import RewardResult
from rlkit.runtime.build import _kl_controller

__all__ = ["FakeGroup", "FakeRuntime"]

P, VOCAB = 4, 32


class FakeGroup:
    """A worker group of one rank whose methods compute small deterministic stand-ins, recording each call."""

    world_size = 1

    def __init__(self, role: str, response_width: int, seed: int = 0):
        self.role = role
        self.width = response_width
        self.generator = torch.Generator().manual_seed(seed)
        self.calls: dict[str, list[Any]] = defaultdict(list)
        self.last_metrics: dict[str, float] = {}

    def call(
        self,
        method: str,
        batch: Batch | None = None,
        *,
        balance: bool = False,
        dispatch: str = "split",
        **kwargs: Any,
    ) -> Any:
        self.calls[method].append(batch)
        return getattr(self, method)(batch, **kwargs)

    # ----- actor ----------------------------------------------------------------------------------
    def generate_sequences(
        self, prompts: Batch, n: int = 1, do_sample: bool | None = None, **_: Any
    ) -> Batch:
        b, t = len(prompts), self.width
        if do_sample is False:  # greedy: token 2 then 1s, full length
            responses = torch.ones((b, t), dtype=torch.long)
            responses[:, 0] = 2
            lengths = torch.full((b,), t)
        else:
            responses = torch.randint(3, VOCAB, (b, t), generator=self.generator)
            lengths = torch.randint(1, t + 1, (b,), generator=self.generator)
        mask = (torch.arange(t)[None, :] < lengths[:, None]).long()  # [B, T]
        responses = responses * mask
        log_probs = -(responses.float() % 5 + 1) / 10 * mask
        ids = torch.cat([prompts["input_ids"], responses], 1)
        attention = torch.cat([prompts["attention_mask"], mask], 1)
        tensors = {
            "prompts": prompts["input_ids"],
            "responses": responses,
            "response_mask": mask,
            "input_ids": ids,
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "rollout_log_probs": log_probs,
        }
        return Batch(tensors, {}, {"temperature": 1.0})

    def compute_log_prob(self, batch: Batch, with_sum_pi_squared: bool = False) -> Batch:
        old = batch["rollout_log_probs"] - 0.05 * batch["response_mask"]  # a small rollout/trainer mismatch
        out = {"old_log_prob": old}
        if with_sum_pi_squared:
            out["sum_pi_squared"] = 0.5 * batch["response_mask"].float()
        return Batch(out)

    def update_actor(self, batch: Batch) -> list[dict[str, float]]:
        mask = batch["response_mask"].float()
        return [
            {"actor/pg_loss": float(-(batch["advantages"] * mask).sum() / mask.sum()), "actor/grad_norm": 1.0}
        ]

    def sync_weights(self, batch: Any) -> None:
        return None

    # ----- ref / critic ---------------------------------------------------------------------------
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return Batch({"ref_log_prob": batch["rollout_log_probs"] - 0.2 * batch["response_mask"]})

    def compute_values(self, batch: Batch) -> Batch:
        return Batch({"values": 0.1 * batch["response_mask"].float()})

    def update_critic(self, batch: Batch) -> list[dict[str, float]]:
        return [{"critic/vf_loss": float(((batch["returns"] - batch["values"]) ** 2).mean())}]


class FakePool:
    """A rollout pool generating ahead (``rlkit.step.ahead.RolloutPipeline``'s ``take``): each take makes the
    request for the next prompts and generates it now, one version behind the actor."""

    def __init__(self, actor: FakeGroup):
        self.actor = actor
        self.queue: list[Any] = []
        self.serial = 0
        self.pushed: list[int] = []

    def take(self, actor_version: int, make_request: Any, ahead: int | None = None) -> tuple[Any, int]:
        request, inputs = make_request(self.serial)
        self.serial += 1
        result = self.actor.generate_sequences(inputs)
        result["rollout_version"] = torch.full((len(result),), max(actor_version - 1, 0))
        return SimpleNamespace(request=request, result=result), 0

    def push_weights(self, version: int) -> None:
        self.pushed.append(version)


class FakeRuntime:
    """What ``Trainer`` reads of ``rlkit.runtime.build.Runtime``, with fake groups and a fake reward step."""

    def __init__(self, recipe: Any, output_dir: Path, *, prompts: int | None = None, seed: int = 0):
        self.recipe = recipe
        self.pipeline = compose(recipe, build_registries())
        self.estimator = self.pipeline.estimator
        width = recipe.data.max_response_length
        self.actor = FakeGroup("actor_rollout_ref", width, seed)
        self.ref = FakeGroup("ref", width) if _needs_ref(recipe) else None
        self.critic = FakeGroup("critic", width) if self.estimator.spec.needs_critic else None
        self.reward_model = None
        self.rollout = None  # the trainer builds its RolloutPipeline over it; tests set trainer.pipe
        self.kl_ctrl = _kl_controller(recipe)
        self.tokenizer = SimpleNamespace(pad_token_id=0)
        self.tracking = SimpleNamespace(
            log=lambda *a, **k: None, log_text=lambda *a, **k: None, run_ids=lambda: {}
        )
        self.val_loader = None
        self.total_steps = recipe.trainer.total_steps or 1
        self.output_dir = Path(output_dir)
        self.groups = [g for g in (self.actor, self.ref, self.critic) if g is not None]
        self.n_prompts = prompts or recipe.data.train_batch_size
        self.prompt_seed = 100
        self.reward_calls = 0

    def prompts(self) -> Batch:
        """``n_prompts`` distinct left-padded prompts [b, P] with data_source and ground truth."""
        self.prompt_seed += 1
        g = torch.Generator().manual_seed(self.prompt_seed)
        ids = torch.randint(3, VOCAB, (self.n_prompts, P), generator=g)
        mask = torch.ones_like(ids)
        mask[::2, 0] = 0
        return Batch(
            {
                "input_ids": ids * mask,
                "attention_mask": mask,
                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            },
            {"data_source": ["fake"] * self.n_prompts, "reward_model": [{}] * self.n_prompts},
        )

    def prompt_stream(self) -> Iterator[Batch]:
        while True:
            yield self.prompts()

    def reward(self, batch: Batch) -> RewardResult:
        """1 for an odd first response token, else 0 (greedy responses: 0.25), on each response's last
        token."""
        self.reward_calls += 1
        first = batch["responses"][:, 0]
        value = torch.where(first == 2, 0.25, (first % 2).float())  # [B]
        scores = torch.zeros(batch["responses"].shape)
        last = batch["response_mask"].sum(-1).clamp(min=1) - 1
        scores[torch.arange(len(batch)), last] = value
        return RewardResult(scores, {"parity": value.tolist()}, {"reward/score/mean": float(value.mean())})

    def ref_call(self, method: str, batch: Batch) -> Batch:
        return getattr(self.ref, method)(batch)

    def perf_metrics(
        self, batch: Batch, times: dict[str, float], metrics: dict[str, float]
    ) -> dict[str, float]:
        return {}


def _needs_ref(recipe: Any) -> bool:
    from rlkit.recipe.validate import uses_ref

    return uses_ref(recipe)
