"""``data.environment: {name: verifiers, env_id: ..., args: {...}}``: a verifiers v1 environment's tasks as
rlkit rows, its episodes played by the ``verifiers`` agent loop (``rlkit_verifiers.loop``).

``env_id`` names an installed verifiers v1 environment package (its taskset, and its own ``Env`` when it
has one), as ``vf-eval`` and prime-rl take it; ``args`` are its taskset's config fields. Each row is one
task (``extra_info.vf_index``: its position in the taskset); training rows are tasks ``[0, size)``,
validation rows ``[size, size + val_size)``.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlkit.errors import RlkitError

__all__ = ["VerifiersEnv", "VerifiersParams", "verifiers_environment"]

LOOP = "verifiers"  # the agent loop that plays these rows (registry `agent_loops`)
# The seat every verifiers role plays through: rlkit_verifiers.harness, loaded by verifiers as a harness id.
HARNESS_ID = "rlkit_verifiers"


class VerifiersParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    env_id: str = Field(
        description="an installed verifiers v1 environment package (taskset id), e.g. vf-gsm8k"
    )
    args: dict[str, Any] = Field(default_factory=dict, description="the taskset's config fields")
    size: int = Field(64, ge=1, description="training rows: tasks [0, size)")
    val_size: int = Field(0, ge=0, description="validation rows: tasks [size, size + val_size)")
    max_turns: int | None = Field(None, ge=1, description="model turns per episode (each seat's max_turns)")
    max_tokens_per_turn: int | None = Field(
        None, ge=1, description="tokens one model turn may generate (None: data.max_response_length)"
    )
    episode_timeout_s: float = Field(600.0, gt=0, description="an episode still running is an error")


class EnvironmentNotInstalled(RlkitError):
    """``env_id`` names no installed module."""


def module_name(env_id: str) -> str:
    """The module verifiers imports for ``env_id`` (hub ids ``owner/name@version`` install as ``name``)."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def check_installed(env_id: str) -> None:
    name = module_name(env_id)
    if importlib.util.find_spec(f"verifiers.v1.tasksets.{name}") or importlib.util.find_spec(name):
        return
    package = env_id.rsplit("/", 1)[-1].split("@", 1)[0]
    raise EnvironmentNotInstalled(
        f"data.environment.env_id: verifiers environment {env_id!r} is not installed (no module {name!r}). "
        f"Install its package: pip install {package} (a Prime hub id: prime env install {env_id}; a "
        "local folder: pip install -e PATH)."
    )


class _Loaded:
    """A verifiers ``Env`` for one ``VerifiersParams`` and its tasks, built once per process."""

    def __init__(self, params: VerifiersParams):
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.configs.env import EnvConfig
        from verifiers.v1.utils.generic import concrete_type
        from verifiers.v1.utils.loaders import environment_class

        check_installed(params.env_id)
        env_cls = environment_class(params.env_id)
        config_cls = concrete_type(env_cls, EnvConfig) or EnvConfig
        taskset = {"id": params.env_id, **params.args}
        seats = agent_config_fields(config_cls.model_validate({"taskset": taskset}))
        seat = {
            "harness": {"id": HARNESS_ID},
            "runtime": {"type": "subprocess"},
            **({"max_turns": params.max_turns} if params.max_turns else {}),
        }
        config = config_cls.model_validate(
            {
                "taskset": taskset,
                "timeout": {"episode": params.episode_timeout_s},
                "interception": {"type": "server"},
                **{name: seat for name in seats},
            }
        )
        self.env = env_cls(config)
        self.tasks = list(self.env.taskset.take(params.size + params.val_size))
        if len(self.tasks) < params.size:
            raise RlkitError(
                f"verifiers environment {params.env_id!r} has {len(self.tasks)} tasks; data.environment.size "
                f"asks {params.size}: lower size."
            )


_LOADED: dict[str, _Loaded] = {}
_LOCK = threading.Lock()


def verifiers_environment(params: VerifiersParams) -> _Loaded:
    key = params.model_dump_json()
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = _Loaded(params)
        return _LOADED[key]


def prompt_messages(data: Any) -> list[dict]:
    from verifiers.v1.dialects.chat import message_to_wire

    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += [
            {"role": m["role"], "content": str(m.get("content") or "")}
            for m in (message_to_wire(x) for x in data.prompt)
        ]
    return messages or [{"role": "user", "content": ""}]


class VerifiersEnv:
    """rlkit's ``Environment`` contract over a verifiers v1 environment (``rows``; episodes: the loop)."""

    def __init__(self, params: VerifiersParams):
        check_installed(params.env_id)
        self.params = params

    def rows(self, split: str) -> list[dict]:
        loaded = verifiers_environment(self.params)
        span = range(self.params.size) if split == "train" else range(self.params.size, len(loaded.tasks))
        return [
            {
                "prompt": prompt_messages(loaded.tasks[i].data),
                "reward_model": {"style": "rule", "ground_truth": ""},
                "extra_info": {"vf_index": i, "agent_name": LOOP},
            }
            for i in span
        ]

    def score(self, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
        raise RlkitError(
            f"verifiers environment {self.params.env_id!r}: its rows are episodes the `verifiers` agent loop "
            "plays and scores; set rollout.agent: {name: verifiers} in the recipe."
        )
