"""Every shipped recipe runs end to end with `rlkit run RECIPE --smoke` (default test run, not behind a
marker).

Each recipe in recipes/ runs in its own subprocess and working folder, sharing one tiny smoke model built once
per session (``RLKIT_CACHE``). ``EXPECTED`` names, per recipe, the metrics that prove its parts ran; a recipe
without an entry fails ``test_every_recipe_has_an_entry`` (add one when you add a recipe). On top of the
table, what a recipe declares is checked generically: a KL loss must log ``actor/kl_loss``, a critic
``critic/vf_loss``; and ``_values`` checks what every run's metrics say (finite, shares in [0, 1], scores in
the scorer's range, a gradient where advantages are non-zero, KL > 0 once the actor moved), with the graded
reward in the runs of ``GRADED`` so those checks have something to see. One recipe (quickstart, which merges
at the end) is also resumed from its checkpoint. ``EXTRA_RUNS`` run a recipe with overrides: DAPO's refill
budget error, and the off-policy doors (a rollout correction, Clip-Cov, the optimal token baseline) in one
quickstart run.
"""

from __future__ import annotations

import json
import math
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from rlkit_harness import GRADED_SCORE, ray_session, records, rlkit_env
from rlkit_harness import run as run_rlkit

REPO = Path(__file__).resolve().parents[2]
RECIPES = {p.stem: p for p in sorted((REPO / "recipes").glob("*.yaml"))}

# recipe -> metrics its smoke run must log (in its last training step unless noted in CHECKS)
EXPECTED: dict[str, tuple[str, ...]] = {
    "quickstart": ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "critic/advantages/mean"),
    "grpo": ("actor/pg_loss", "actor/kl_loss", "critic/advantages/mean"),
    "ppo": (
        "critic/vf_loss",
        "critic/values/mean",
        "critic/vf_clipfrac",
        "actor/pg_loss",
        "critic/returns/mean",
    ),
    "dapo": (
        "train/num_gen_batches",
        "train/filter_groups_kept",
        "train/filter_groups_dropped",
        "reward/overlong_penalty/mean",
        "reward/overlong_ratio",
        "actor/pg_clipfrac",
    ),
    "grpo_tool_agent": (
        "num_turns/mean",
        "num_turns/min",
        "num_turns/max",
        "tool_call_counts/mean",
        "actor/kl_loss",
    ),
    "grpo_reward_model": ("reward/rm_scores/mean", "reward/rm_scores/used_fraction", "actor/kl_loss"),
    "grpo_separate_ref": ("actor/kl_loss", "actor/pg_loss"),
    "grpo_async": (
        "async/staleness_mean",
        "async/staleness_max",
        "async/dropped_stale",
        "async/weights_version",
        "actor/pg_loss",
        "rollout_corr/bypass",
        "training/rollout_probs_diff_max",
    ),
    "quickstart_lora": ("actor/lora_trainable_params", "actor/kl_loss", "actor/pg_loss"),
    "textarena": (
        "num_turns/mean",
        "env/errors",
        "env/truncated",
        "reward_extra/finished/mean",
        "training/rollout_probs_diff_max",
    ),
    "reasoning_gym": (
        "reward_extra/correct/mean",
        "reward_extra/format/mean",
        "actor/grad_norm",
        "critic/score/max",
    ),
    "verifiers": (
        "num_turns/mean",
        "env/errors",
        "reward_extra/solved/mean",
        "reward_extra/format/mean",
        "actor/grad_norm",
        "training/rollout_probs_diff_max",
    ),
}


def _dapo_refilled(steps: list[dict], out: Path) -> None:
    """Dynamic sampling dropped uniform groups and generated again in at least one step."""
    assert max(s["train/num_gen_batches"] for s in steps) >= 2, [s["train/num_gen_batches"] for s in steps]
    assert sum(s["train/filter_groups_dropped"] for s in steps) >= 1
    assert all(s["train/filter_groups_kept"] >= 4 for s in steps)  # the batch was filled every step


def _tool_turns(steps: list[dict], out: Path) -> None:
    assert all(s["num_turns/min"] >= 1 and s["num_turns/max"] <= 5 for s in steps)


def _environment_scored(steps: list[dict], out: Path) -> None:
    """The reasoning-gym environment gave the rows and scored them: its task's score_answer (0..1, partial
    credit for a response containing the answer) spread over the batch, and the update had a gradient."""
    assert (out / "environment" / "train.parquet").is_file()
    for s in steps:
        assert s["reward/errors"] == 0.0 and 0.0 <= s["critic/score/min"] <= s["critic/score/max"] <= 1.0
        assert s["actor/grad_norm"] > 0
    assert any(s["critic/score/max"] > s["critic/score/min"] for s in steps), steps


def _verifiers_scored(steps: list[dict], out: Path) -> None:
    """verifiers played the episodes (vf-guess-number, its rubric: solved 1.0 + format 0.5) against the
    token-in endpoint: no episode failed, the rubric's scores spread over the batch, the update had a
    gradient, and the actor's recomputed log-probs equal the ones the endpoint served."""
    assert (out / "environment" / "train.parquet").is_file()
    for s in steps:
        assert s["env/errors"] == 0.0 and s["env/timeouts"] == 0.0 and s["reward/errors"] == 0.0, s
        assert s["actor/grad_norm"] > 0 and s["critic/score/max"] > s["critic/score/min"], s
        assert s["training/rollout_probs_diff_valid"] == 1.0 and s["training/rollout_probs_diff_max"] < 1e-4


def _own_process(role: str):
    """The role ran in worker processes of its own (ray_session.json lists each role's worker pids)."""

    def check(steps: list[dict], out: Path) -> None:
        pids = ray_session(out)["worker_pids"]
        assert pids.get(role) and not set(pids[role]) & set(pids["actor_rollout_ref"]), pids

    return check


def _reward_model_scored(steps: list[dict], out: Path) -> None:
    _own_process("reward_model")(steps, out)
    # synthetic rows: the model scores them
    assert all(s["reward/rm_scores/used_fraction"] > 0 for s in steps)


def _generated_ahead(steps: list[dict], out: Path) -> None:
    """The rollout pool ran in its own processes and generated step 2's batch before step 1's update."""
    _own_process("rollout")(steps, out)
    assert [s["async/staleness_mean"] for s in steps] == [0.0, 1.0]
    assert all(s["async/dropped_stale"] == 0 for s in steps)
    # the recipe's correction is decoupled in bypass mode: the rollout's log-probs were pi_old, so no
    # old-log-prob pass ran (the correction would force it otherwise) and no weights were made; the mismatch
    # metrics come from the actor's first log-probs. Step 1 sampled from the actor's own weights: equal up to
    # numerics. (The tiny model scores 0, so GRPO's update leaves the weights unchanged and step 2's stale
    # sample cannot show a mismatch here; tests/unit/test_offpolicy.py covers the phase.)
    raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # records() drops timing_s/*: read the file itself
    timed = [r for r in raw if "training/global_step" in r]
    assert all("timing_s/update_actor" in r and "timing_s/old_log_prob" not in r for r in timed), timed
    assert all(s["rollout_corr/bypass"] == 1.0 for s in steps)
    # full weights pushed (the LoRA run: adapter only)
    assert all(s["rollout/weight_sync_bytes"] > 0 for s in steps)
    assert not any(k.startswith("rollout_corr/rollout_is") for k in steps[0]), sorted(steps[0])
    assert steps[0]["training/rollout_probs_diff_max"] < 1e-3
    assert abs(steps[0]["rollout_corr/kl"]) < 1e-3


def _lora_trained_and_merges(steps: list[dict], out: Path) -> None:
    """LoRA ran: the reference (adapter off) equals the actor before the first update (KL exactly 0), not
    after; checkpoints hold the adapter; the final merge is a PEFT adapter folder and --merge-lora a full
    model, and both load and generate, with the same logits."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert steps[0]["actor/kl_loss"] == 0.0 and steps[1]["actor/kl_loss"] > 0, [
        s["actor/kl_loss"] for s in steps
    ]
    assert 0 < steps[-1]["actor/lora_trainable_params"]
    assert (out / "checkpoints" / "global_step_2" / "actor" / "adapter_config.json").is_file()
    adapter = out / "hf_model"  # merge_at_end of a LoRA run: the adapter folder
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "model.safetensors").exists()
    merged = out / "merged"
    result = run_rlkit(
        "merge", str(out / "checkpoints" / "global_step_2"), "--out", str(merged), "--merge-lora"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    base_path = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path)
    q_base = base.model.layers[0].self_attn.q_proj.weight.detach().clone()
    with_adapter = PeftModel.from_pretrained(base, adapter)
    full = AutoModelForCausalLM.from_pretrained(merged)
    # the trained adapter is in it
    assert not torch.equal(full.model.layers[0].self_attn.q_proj.weight, q_base)
    tok = AutoTokenizer.from_pretrained(merged)
    ids = tok("1 + 2 =", return_tensors="pt")
    for model in (with_adapter, full):  # both generate
        assert (
            model.generate(**ids, max_new_tokens=6, do_sample=False).shape[1] == ids["input_ids"].shape[1] + 6
        )
    with torch.no_grad():  # the same function: logits equal up to the rounding of W + BA vs W x + B(A x)
        logits = [model(**ids).logits for model in (with_adapter, full)]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


# Recipes whose smoke run scores with the graded reward (tests/fixtures/graded_score.py) instead of
# arithmetic, which the tiny model never answers (score 0, zero advantages, zero gradient: nothing to check).
# Left out: dapo (its refill check needs uniform groups), grpo_reward_model (the reward model is what it
# checks), grpo_async and quickstart_lora (their checks read a run whose weights do not move).
GRADED = {"quickstart", "grpo", "ppo", "grpo_separate_ref", "grpo_tool_agent"}
# the random tiny model's sentences rarely end in the sum (answer_tags: last_number scores 0); scoring the
# whole response gives partial credit for containing the answer, so its scores spread
SPREAD = {"reasoning_gym": ["data.environment.answer_tags=optional"]}
# else [0, 1] (arithmetic and graded); None: a reward model's scores (any real)
SCORE_RANGE = {"dapo": (-1.0, 1.0)}
# vf-guess-number: solved + 0.5 format
SCORE_RANGE |= {"grpo_reward_model": None, "verifiers": (0.0, 1.5)}


def _values(name: str, steps: list[dict]) -> None:
    """What the metrics say, beyond their presence: the update ran where it had something to learn, KL grew
    once the actor moved away from its reference, shares are shares, scores lie in the scorer's range.

    A non-zero advantage gives a non-zero gradient: grad_norm > 0 where any advantage is non-zero. pg_loss is
    not asserted non-zero: on-policy with group-centred advantages it is ``-sum_i A_i n_i / N``, 0 up to float
    noise whenever the responses have one length (the tiny model fills the length), whatever the update does.
    """
    for s in steps:
        for key, value in s.items():
            if key.startswith(("actor/", "critic/")):
                assert math.isfinite(value), f"{name} step {s['step']}: {key} = {value}"
            if "clipfrac" in key or key.endswith(("_frac", "_fraction", "/overlong_ratio")):
                assert 0.0 <= value <= 1.0, f"{name} step {s['step']}: {key} = {value}"
        assert s["actor/entropy"] > 0, s["actor/entropy"]
        for stat in ("score", "rewards", "advantages", "returns"):
            assert s[f"critic/{stat}/min"] <= s[f"critic/{stat}/mean"] <= s[f"critic/{stat}/max"], (
                name,
                stat,
            )
        low_high = SCORE_RANGE.get(name, (0.0, 1.0))
        if low_high is not None:
            assert low_high[0] <= s["critic/score/min"] and s["critic/score/max"] <= low_high[1], (name, s)
        if s["critic/advantages/max"] != 0 or s["critic/advantages/min"] != 0:
            assert s["actor/grad_norm"] > 0, f"{name} step {s['step']}: advantages non-zero, grad_norm 0"
        if "critic/vf_loss" in s:
            assert s["critic/vf_loss"] >= 0 and s["critic/grad_norm"] > 0, (name, s)
    # the actor moved: KL to the reference
    if "actor/kl_loss" in steps[0] and steps[0]["actor/grad_norm"] > 0:
        assert steps[1]["actor/kl_loss"] > 0, [s["actor/kl_loss"] for s in steps]
    if name in GRADED:  # the checks above were not vacuous: rewards varied and the update ran at every step
        assert all(
            s["critic/score/max"] > s["critic/score/min"] and s["actor/grad_norm"] > 0 for s in steps
        ), steps


CHECKS = {
    "reasoning_gym": _environment_scored,
    "verifiers": _verifiers_scored,
    "quickstart_lora": _lora_trained_and_merges,
    "dapo": _dapo_refilled,
    "grpo_async": _generated_ahead,
    "grpo_tool_agent": _tool_turns,
    "ppo": _own_process("critic"),
    "grpo_separate_ref": _own_process("ref"),
    "grpo_reward_model": _reward_model_scored,
}

# extra smoke runs beyond one per recipe: name -> (recipe, overrides)
EXTRA_RUNS = {
    "dapo_budget": ("dapo", ["algorithm.filter_groups.max_num_gen_batches=1"]),
    # the off-policy doors in one run: a rollout correction, Clip-Cov's mini-batch selection, OTB's
    # sum_pi_squared, sampling from fp16 weights (rlkit.rollout.fp16_weights) the correction has to correct
    # for
    "offpolicy": (
        "quickstart",
        [
            "algorithm.estimator=optimal_token_baseline",
            "rollout.backend={name: hf, dtype: float16}",
            "algorithm.rollout_correction={name: token_tis, threshold: 1.5}",
            "actor.policy_loss={name: clip_cov, clip_cov_ratio: 0.2, clip_cov_lb: -10.0, clip_cov_ub: 10.0}",
            "trainer.merge_at_end=false",
            "trainer.test_freq=0",
        ],
    ),
    # a LoRA actor with a rollout pool of its own: the pushes carry the adapter alone
    "async_lora": ("grpo_async", ["actor.lora={rank: 4, alpha: 8}", "trainer.merge_at_end=false"]),
    # room for whole game turns: the tiny tokenizer spends ~1 token per character of the game's replies
    "textarena_turns": (
        "textarena",
        ["data.max_response_length=384", "rollout.agent.max_reply_chars=60", "rollout.agent.max_turns=3"],
    ),
    # room for whole turns of vf-guess-number: 3 turns of at most 12 tokens and the environment's replies;
    # a number from 1 to 10^6 the tiny model never guesses, so every episode plays its 3 turns
    "verifiers_turns": (
        "verifiers",
        [
            "data.max_response_length=128",
            "data.environment.max_tokens_per_turn=12",
            "data.environment.args={size: 264, high: 1000000, max_turns: 3, seed: 1}",
        ],
    ),
    # the same episodes generated ahead in a rollout pool of its own (trainer.mode async)
    "textarena_async": (
        "textarena",
        [
            "data.max_response_length=384",
            "rollout.agent.max_reply_chars=60",
            "rollout.agent.max_turns=3",
            "trainer.mode=async",
            "resources.pools={train: {nodes: 1, bundles_per_node: 1, cpus_per_bundle: 1}, "
            "generate: {nodes: 1, bundles_per_node: 1, cpus_per_bundle: 1}}",
            "resources.roles={actor_rollout_ref: train, rollout: generate}",
        ],
    ),
}


@pytest.fixture(scope="session")
def smoke_cache(tmp_path_factory) -> Path:
    """One smoke model for the whole session (RLKIT_CACHE of every run)."""
    from rlkit.cli.smoke import TINY_MODEL, _build_tiny

    cache = tmp_path_factory.mktemp("rlkit-cache")
    _build_tiny(cache / "models" / TINY_MODEL)
    return cache


PARALLEL = 2  # smoke runs at once: a run is mostly start-up (Ray, worker imports), ~17 s of CPU in ~60 s


@pytest.fixture(scope="session")
def smoke_runs(smoke_cache, tmp_path_factory, request):
    """`rlkit run recipes/<name>.yaml --smoke` of every recipe the selected tests need, each in its own
    folder, started together (``PARALLEL`` at a time) on first use; name -> future of ``(CompletedProcess,
    output dir)``."""
    needs = {
        "test_resume_and_merge_after_a_smoke_run": "quickstart",
        "test_dapo_budget_error": "dapo_budget",
        "test_offpolicy_smoke_run": "offpolicy",
        "test_async_lora_smoke_run": "async_lora",
        "test_textarena_multi_turn_smoke_run": "textarena_turns",
        "test_verifiers_multi_turn_smoke_run": "verifiers_turns",
    }
    needs_param = {"test_textarena_multi_turn_smoke_run"}  # parametrized by run name
    # in the order the tests ask for them, so no test waits behind runs queued after it
    wanted: list[str] = []
    for item in request.session.items:
        name, spec = getattr(item, "originalname", ""), getattr(item, "callspec", None)
        run = (
            spec.params["name"]
            if name in {"test_recipe_smoke_run", *needs_param} and spec is not None
            else needs.get(name)
        )
        if run is not None and run not in wanted:
            wanted.append(run)
    root = tmp_path_factory.mktemp("smoke-runs")

    def one(name: str) -> tuple[subprocess.CompletedProcess, Path]:
        recipe, overrides = EXTRA_RUNS.get(name, (name, []))
        overrides = [*overrides, *SPREAD.get(recipe, [])]
        overrides = (
            [*overrides, f"reward.custom_score={{path: {GRADED_SCORE}}}"] if name in GRADED else overrides
        )
        cwd = root / name
        cwd.mkdir()
        result = run_rlkit(
            "run",
            str(RECIPES[recipe]),
            "--smoke",
            *overrides,
            env=rlkit_env(RLKIT_CACHE=str(smoke_cache)),
            cwd=cwd,
            timeout=500,
        )
        return result, cwd / "outputs/smoke" / recipe

    pool = ThreadPoolExecutor(max_workers=PARALLEL)
    futures = {name: pool.submit(one, name) for name in wanted}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def test_every_recipe_has_an_entry():
    missing = sorted(set(RECIPES) - set(EXPECTED))
    assert not missing, (
        f"recipes without expected smoke metrics in tests/e2e/test_smoke_matrix.py EXPECTED: {missing}"
    )
    assert {
        "quickstart",
        "ppo",
        "grpo",
        "dapo",
        "grpo_tool_agent",
        "grpo_reward_model",
        "grpo_separate_ref",
        "grpo_async",
    } <= set(RECIPES)


# its own run, plus at most the run queued beside it (a loaded machine: ~5 min each)
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_smoke_run(name, smoke_runs):
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe import load_recipe

    result, out = smoke_runs[name].result()
    assert result.returncode == 0, result.stderr[-4000:]
    assert "--smoke:" in result.stderr and "resources.device" in result.stderr  # the table of swaps
    assert "done:" in result.stdout
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    declared = load_recipe(RECIPES[name], check_files=False)
    registries = build_registries()
    wanted = list(EXPECTED.get(name, ()))
    wanted += ["actor/kl_loss"] if declared.actor.use_kl_loss else []
    wanted += (
        ["critic/vf_loss"]
        if registries.estimators.get(declared.algorithm.estimator.name).needs_critic
        else []
    )
    for key in wanted:
        assert key in steps[-1], f"{name}: metric {key} missing; logged: {sorted(steps[-1])}"
    _values(name, steps)
    if name in CHECKS:
        try:
            CHECKS[name](steps, out)
        except AssertionError as exc:  # the run's warnings say why (e.g. a failed episode's message)
            warned = [
                line for line in result.stderr.splitlines() if "WARNING" in line or "counted in env/" in line
            ]
            raise AssertionError(f"{exc}\nthe run's warnings:\n" + "\n".join(warned[-20:])) from exc
    assert (out / "checkpoints" / "global_step_2").is_dir()  # saved at the end


@pytest.mark.timeout(1200)
def test_dapo_budget_error(smoke_runs):
    """max_num_gen_batches=1 and a step that needs a refill: the run stops with an error that names the
    metric, shows every group's scores and says what to change."""
    result, _ = smoke_runs["dapo_budget"].result()
    assert result.returncode == 1
    err = result.stderr
    assert (
        "algorithm.filter_groups.max_num_gen_batches=1" in err
        and "algorithm.filter_groups.metric='score'" in err
    )
    assert " x" in err.split("what every group scored", 1)[1]  # e.g. "[-1 -1 -1 -1] x2, [-0.5 0 0 0] x2"
    assert "algorithm.filter_groups.enable=false" in err and "Metrics the scores carry: ['score'" in err
    assert "Traceback" not in err


@pytest.mark.timeout(1200)
def test_offpolicy_smoke_run(smoke_runs):
    """Token-TIS correction + Clip-Cov + the optimal token baseline + fp16 decode weights (quickstart's smoke
    profile, 2 steps)."""
    result, out = smoke_runs["offpolicy"].result()
    assert result.returncode == 0, result.stderr[-4000:]
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # the old_log_prob pass ran: forced by the correction and OTB (one epoch over one mini-batch would skip
    # it)
    assert all("timing_s/old_log_prob" in r for r in raw if "training/global_step" in r)
    # the rollout decoded with fbgemm fp16 weights, every linear of the tiny model (2 layers x 7 + the head)
    # repacked at every step (they are trainable)
    assert [s["rollout/fp16_repacked_linears"] for s in steps] == [15.0, 15.0]
    for step in steps:
        # the HF backend samples from the actor's weights rounded to fp16: pi_old / pi_rollout = 1 up to that
        # rounding
        assert 0.99 < step["rollout_corr/rollout_is_mean"] < 1.01
        assert step["training/rollout_probs_diff_max"] > 5e-5  # measured ~3e-4 (fp32 decode: float noise)
        assert (
            step["rollout_corr/rollout_is_min"]
            <= step["rollout_corr/rollout_is_mean"]
            <= step["rollout_corr/rollout_is_max"]
        )
        assert step["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0  # nothing near the cap 1.5
        assert abs(step["rollout_corr/kl"]) < 1e-3 and 0.0 <= step["rollout_corr/k3_kl"] < 1e-3
        assert step["training/rollout_probs_diff_valid"] == 1.0
        assert (
            0.0 <= step["training/rollout_probs_diff_mean"] <= step["training/rollout_probs_diff_max"] < 1e-2
        )
        assert step["training/rollout_actor_probs_pearson_corr"] > 0.99
        # Clip-Cov cut floor(0.2 N) tokens (fewer where the ratio clip binds): the selection reached the loss
        assert 0.0 < step["actor/pg_clipfrac"] <= 0.2 + 1e-6
        assert step["critic/advantages/max"] >= step["critic/advantages/min"]
    # the run's recipe names OTB (its function raises without old_log_prob and sum_pi_squared: they were
    # passed)
    saved = (out / "checkpoints" / "global_step_2" / "recipe.yaml").read_text()
    assert "optimal_token_baseline" in saved and "token_tis" in saved and "clip_cov" in saved


def test_async_lora_smoke_run(smoke_runs):
    """actor.lora with trainer.mode=async (grpo_async's smoke profile): the rollout pool's module carries the
    adapter and every weight push sends the adapter's tensors alone (fp32: 4 bytes per trainable
    parameter)."""
    result, out = smoke_runs["async_lora"].result()
    assert result.returncode == 0, result.stderr[-4000:]
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    _own_process("rollout")(steps, out)
    for step in steps:
        assert step["actor/lora_trainable_params"] > 0
        assert step["rollout/weight_sync_bytes"] == 4 * step["actor/lora_trainable_params"]
    assert [s["async/staleness_mean"] for s in steps] == [0.0, 1.0]


@pytest.mark.timeout(1800)
def test_resume_and_merge_after_a_smoke_run(smoke_cache, smoke_runs, tmp_path):
    """Quickstart's smoke run merged its final actor (merge_at_end); resume it for one more step, merge
    again."""
    result, out = smoke_runs["quickstart"].result()
    assert result.returncode == 0, result.stderr[-4000:]
    assert (out / "hf_model" / "config.json").is_file()
    again = run_rlkit(
        "run",
        str(RECIPES["quickstart"]),
        "--smoke",
        "trainer.resume=auto",
        "trainer.total_steps=3",
        "trainer.merge_at_end=false",
        env=rlkit_env(RLKIT_CACHE=str(smoke_cache)),
        cwd=out.parents[2],
        timeout=500,
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resumed from" in again.stderr
    # step 3 only, appended
    assert [r["step"] for r in records(out) if "training/global_step" in r] == [1, 2, 3]
    merged = tmp_path / "merged"
    result = run_rlkit("merge", str(out / "checkpoints" / "global_step_3"), "--out", str(merged))
    assert result.returncode == 0, result.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(merged).config.model_type == "qwen2"


@pytest.mark.e2e
def test_smoke_with_smollm2(tmp_path):
    """`--smoke-model smollm2`: the same laptop profile on SmolLM2-135M (converted once into the user's
    cache)."""
    result = run_rlkit(
        "run", str(RECIPES["grpo"]), "--smoke", "--smoke-model", "smollm2", cwd=tmp_path, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "model: smollm2" in result.stderr
    steps = [r for r in records(tmp_path / "outputs/smoke/grpo") if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2] and "actor/kl_loss" in steps[-1]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", ["textarena_turns", "textarena_async"])
def test_textarena_multi_turn_smoke_run(name, smoke_runs):
    """A TextArena game (GuessTheNumber-v0) through the environment agent loop: every episode had more than
    one assistant turn (the game's replies in between, as masked user turns:
    tests/unit/rollout/test_environment.py), the game's reward reached the reward manager without errors, and
    the actor's recomputed log-probs on the multi-turn sequences agree with the rollout's (fp32 decode: float
    noise only) — in sync mode and with the episodes generated ahead in a rollout pool (async; the tiny
    model's games score 0, so its weights do not move and a stale sample's log-probs still agree)."""
    result, out = smoke_runs[name].result()
    assert result.returncode == 0, result.stderr[-4000:]
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for s in steps:
        assert s["num_turns/min"] >= 2 and s["num_turns/max"] <= 3, s
        assert s["env/errors"] == 0.0 and s["env/timeouts"] == 0.0 and s["reward/errors"] == 0.0
        assert s["reward_extra/finished/mean"] > 0  # games ended by themselves and gave their reward
        assert s["training/rollout_probs_diff_valid"] == 1.0 and s["training/rollout_probs_diff_max"] < 1e-4


@pytest.mark.timeout(1200)
def test_verifiers_multi_turn_smoke_run(smoke_runs):
    """A verifiers v1 environment (vf-guess-number) through `rlkit run`: verifiers played every episode for
    its 3 assistant turns against the token-in endpoint, the environment's replies masked in between
    (tests/plugins/test_verifiers_plugin.py), the rubric's reward reached the reward manager, and the actor's
    recomputed log-probs on the multi-turn sequences agree with the ones the endpoint served."""
    result, out = smoke_runs["verifiers_turns"].result()
    assert result.returncode == 0, result.stderr[-4000:]
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for s in steps:
        assert s["num_turns/min"] == 3 and s["num_turns/max"] == 3, s
        assert s["env/errors"] == 0.0 and s["reward/errors"] == 0.0 and s["reward_extra/format/mean"] > 0
        assert s["training/rollout_probs_diff_valid"] == 1.0 and s["training/rollout_probs_diff_max"] < 1e-4
