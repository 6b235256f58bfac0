"""`rlkit run` as a user runs it: a tiny recipe end to end in a subprocess, kill + resume, merge."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rlkit_harness import (
    differing_tensors,
    last_record_per_step,
    moment_norms,
    optimizer_state,
    records,
    rlkit_env,
)
from rlkit_harness import run as run_rlkit

SYNC_REFERENCE = Path(__file__).parent / "sync_reference.json"  # (not under data/: .gitignore)


def _fingerprint() -> dict:
    """What the exact metrics of a run depend on besides the code: CPU, torch, transformers."""
    import transformers

    from rlkit.hardware import cpu_info

    cpu = cpu_info()
    return {
        "cpu_model": cpu.model,
        "cpu_flags": sorted(cpu.flags),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _weights_digest(checkpoint: Path) -> str:
    """sha256 over the actor's full state dict (sorted names, fp32 bytes)."""
    import hashlib

    from rlkit.runtime.merge import load_actor_state_dict

    state, digest = load_actor_state_dict(checkpoint), hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


# The tolerance comparison with the recording, on any machine: float results of another CPU or library version
# differ in the last bits, and sampling can turn them into a different token; rtol 1e-3 (atol 1e-6 for values
# near 0, e.g. a GRPO pg_loss) passes for such noise and fails for a changed update, loss or reward.
RTOL, ATOL = 1e-3, 1e-6


def _weights_norm(checkpoint: Path) -> float:
    """L2 norm over the actor's full state dict: the tolerance stand-in for the exact digest."""
    from rlkit.runtime.merge import load_actor_state_dict

    state = load_actor_state_dict(checkpoint)
    return float(sum(state[name].detach().double().pow(2).sum() for name in sorted(state)) ** 0.5)


def _resolved_precision(out: Path) -> dict:
    """What ``auto`` precision became in this run (params.json ``resolved``): float results under another
    precision are not comparable, and ``auto`` can choose differently between runs on one machine (issue
    26.6)."""
    resolved = json.loads((out / "params.json").read_text())["resolved"]
    return {k: resolved[k] for k in ("mixed_precision", "decode_dtype")}


def record_sync_reference(rows: list[dict], checkpoint: Path) -> None:
    """RLKIT_RECORD_SYNC_REFERENCE=<commit> pytest tests/e2e/test_run.py -k sync_reference: re-record after a
    deliberate change of a sync run's numbers (the recording names its machine and library versions)."""
    SYNC_REFERENCE.write_text(
        json.dumps(
            {
                "recorded_from": os.environ["RLKIT_RECORD_SYNC_REFERENCE"],
                "fingerprint": _fingerprint(),
                "records": rows,
                "weights_sha256": _weights_digest(checkpoint),
                "weights_norm": _weights_norm(checkpoint),
                "precision": _resolved_precision(checkpoint.parents[1]),
            },
            indent=1,
        )
        + "\n"
    )


def check_sync_reference_within_tolerance(rows: list[dict], checkpoint: Path, reference: dict) -> None:
    """Every metric of the recording (metrics added since may appear beside them) and the final weights' norm,
    within RTOL/ATOL: runs on every machine."""
    where = (
        f"differs from {SYNC_REFERENCE.name} (recorded from {reference['recorded_from']}) beyond rtol {RTOL}"
    )
    assert [r["step"] for r in rows] == [r["step"] for r in reference["records"]], where
    for row, ref in zip(rows, reference["records"], strict=True):
        for key, want in ref.items():
            assert key in row, f"step {ref['step']}: {key} missing; {where}"
            assert row[key] == pytest.approx(want, rel=RTOL, abs=ATOL), f"step {ref['step']}: {key}: {where}"
    assert _weights_norm(checkpoint) == pytest.approx(reference["weights_norm"], rel=RTOL), (
        f"final weights: {where}"
    )


def check_sync_reference_exactly(rows: list[dict], checkpoint: Path, reference: dict) -> None:
    """Bit for bit, on the recording's CPU and library versions only; elsewhere a visible skip naming both
    fingerprints (float results differ there; the tolerance comparison still ran)."""
    here, there = _fingerprint(), reference["fingerprint"]
    if here != there:
        differ = {
            k: (there.get(k), here.get(k))
            for k in sorted(set(here) | set(there))
            if k != "cpu_flags" and here.get(k) != there.get(k)
        }
        flags = sorted(set(here.get("cpu_flags", ())) ^ set(there.get("cpu_flags", ())))
        pytest.skip(
            f"exact sync reference: this machine's fingerprint differs from the recording's "
            f"(recorded vs here: {differ}; cpu flags on one side only: {flags}); recorded {there}; here "
            f"{here}. The tolerance comparison (rtol {RTOL}) ran."
        )
    where = f"differs from {SYNC_REFERENCE.name} (recorded from {reference['recorded_from']})"
    for row, ref in zip(rows, reference["records"], strict=True):
        assert {k: row.get(k) for k in ref} == ref, f"step {ref['step']}: {where}"
    assert _weights_digest(checkpoint) == reference["weights_sha256"], f"final weights: {where}"


def test_sync_run_matches_the_sync_reference(fp32_run):
    """The e2e recipe's metrics and final weights, in fp32 (``fp32_run``: ``auto`` would pick another
    precision on some machines), against those recorded in sync_reference.json (the file says from which
    commit): within tolerance everywhere, then exactly where the fingerprint is the recording's."""
    result, out = fp32_run
    assert result.returncode == 0, result.stderr[-3000:]
    rows, checkpoint = records(out), out / "checkpoints" / "global_step_4"
    if os.environ.get("RLKIT_RECORD_SYNC_REFERENCE"):
        record_sync_reference(rows, checkpoint)
    reference = json.loads(SYNC_REFERENCE.read_text())
    assert _resolved_precision(out) == reference["precision"], (
        "the sync reference was recorded in another precision: re-record it from fp32_run"
    )
    check_sync_reference_within_tolerance(rows, checkpoint, reference)
    check_sync_reference_exactly(rows, checkpoint, reference)
    # the fp32 decode ran the lean step's layers under TorchScript (rlkit.rollout.scripted_step), which
    # decodes the recording's tokens bit for bit
    assert all(r["rollout/scripted_layers"] == 1.0 for r in rows if "rollout/lean_step" in r)


def test_sync_reference_checks_can_fail_and_skip_visibly(monkeypatch, tmp_path):
    """No run: the recording's own rows pass the tolerance check with float noise (rtol 1e-5) and fail it with
    a 1% change of one metric or of the weights' norm; off the fingerprint the exact check skips naming
    both."""
    import copy

    reference = json.loads(SYNC_REFERENCE.read_text())
    monkeypatch.setattr(sys.modules[__name__], "_weights_norm", lambda checkpoint: reference["weights_norm"])
    noisy = [
        {k: v * (1 + 1e-5) if isinstance(v, float) else v for k, v in r.items()} for r in reference["records"]
    ]
    check_sync_reference_within_tolerance(noisy, tmp_path, reference)
    changed = copy.deepcopy(reference["records"])
    changed[2]["actor/grad_norm"] *= 1.01
    with pytest.raises(AssertionError, match="actor/grad_norm"):
        check_sync_reference_within_tolerance(changed, tmp_path, reference)
    monkeypatch.setattr(
        sys.modules[__name__], "_weights_norm", lambda checkpoint: reference["weights_norm"] * 1.01
    )
    with pytest.raises(AssertionError, match="final weights"):
        check_sync_reference_within_tolerance(reference["records"], tmp_path, reference)
    elsewhere = reference | {
        "fingerprint": reference["fingerprint"] | {"torch": "0.0.0", "cpu_model": "other"}
    }
    with pytest.raises(pytest.skip.Exception) as skipped:
        check_sync_reference_exactly(reference["records"], tmp_path, elsewhere)
    assert "'torch': ('0.0.0', " in str(skipped.value) and "other" in str(skipped.value)


def test_run_end_to_end_then_merge(straight_run, tmp_path):
    result, out = straight_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done:" in result.stdout

    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for key in (
        "actor/pg_loss",
        "actor/grad_norm",
        "critic/score/mean",
        "response_length/mean",
        "global_seqlen/mean",
    ):
        assert key in steps[-1], key
    raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    for step in (r for r in raw if "training/global_step" in r):  # records() drops perf/*: read the file
        # executed FLOPs over the stated peak (rlkit.model.flops): a utilisation, never above 1
        assert step["perf/flops/actor"] > 0 and 0 < step["perf/mfu/actor"] <= 1, step
    assert "val-core/rlkit/arithmetic/score/mean@1" in records(out)[0]  # validation before training

    # the MLflow store holds the run, its metrics and its generations table
    info = json.loads((out / "run_info.json").read_text())
    from mlflow.tracking import MlflowClient

    client = MlflowClient(info["mlflow_uri"])
    run = client.get_run(info["run_ids"]["mlflow"])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "critic/score/mean")] == [1, 2, 3, 4]
    assert run.data.params["rollout.n"] == "4"
    # the recipe leaves precision and threads at auto: what they became on this machine is printed and logged
    from rlkit.hardware import auto_decode_dtype, precision_decision

    decision = precision_decision("cpu")
    decode_dtype = auto_decode_dtype(decision, 8)[0]  # 8: the recipe's max_response_length
    params = run.data.params
    assert params["actor.mixed_precision"] == "auto" and params["resources.threads_per_worker"] == "auto"
    assert (params["resolved.mixed_precision"], params["resolved.decode_dtype"]) == (
        decision.mixed_precision,
        decode_dtype,
    )
    assert params["resolved.precision_reason"] == decision.reason
    assert params["resolved.precision_rule"] == decision.rule and params["resolved.peak_source"]
    resolved = json.loads((out / "run_info.json").read_text())["resolved"]
    assert (
        resolved["precision_rule"] == decision.rule
        and resolved["peak_source"] == params["resolved.peak_source"]
    )
    assert params["resolved.threads_per_worker.actor_rollout_ref"] == "1"  # cpus_per_bundle defaults to 1
    # resources.allocator auto, CPU workers of a local cluster on glibc: every worker started with the
    # tunables (its /proc/self/environ, what glibc read), as the driver asked them
    assert params["resolved.allocator"] == "keep_freed", params["resolved.allocator_reason"]
    assert params["resolved.allocator_in_workers"] == "yes"
    assert resolved["allocator"] == "keep_freed" and "workers' allocator keep_freed" in result.stdout
    assert f"rlkit: precision {decision.mixed_precision}, rollout decode {decode_dtype}" in result.stdout
    assert decision.reason in result.stdout
    assert {a.path for a in client.list_artifacts(run.info.run_id, "generations")} >= {
        "generations/step_0.md"
    }
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"recipe.yaml", "merged_model_path.txt"} <= artifacts
    assert (out / "hf_model" / "config.json").is_file()  # trainer.merge_at_end

    # keep-last-2 checkpoints, each complete; merge the newest and generate with transformers
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["global_step_3", "global_step_4"]
    merged = tmp_path / "merged"
    result = run_rlkit("merge", str(out / "checkpoints" / "global_step_4"), "--out", str(merged))
    assert result.returncode == 0, result.stderr[-3000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkit.runtime.merge import load_actor_state_dict

    model = AutoModelForCausalLM.from_pretrained(merged)
    trained = load_actor_state_dict(out / "checkpoints" / "global_step_4")
    assert all(torch.equal(trained[k], v) for k, v in model.state_dict().items() if k in trained)
    tokenizer = AutoTokenizer.from_pretrained(merged)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 2?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    generated = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == ids["input_ids"].shape[1] + 4


def test_sigkill_then_resume_matches_uninterrupted_run(straight_run, write_recipe, tmp_path):
    result, straight = straight_run  # the same recipe, run once for this file
    assert result.returncode == 0, result.stderr[-3000:]

    killed = tmp_path / "killed"
    recipe = write_recipe(killed, "b.yaml")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlkit", "run", str(recipe)],
        env=rlkit_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while time.time() < deadline:  # kill once step 2 is logged: mid-run, after a checkpoint
        metrics = killed / "metrics.jsonl"
        if metrics.exists() and any('"step": 2' in line for line in metrics.read_text().splitlines()):
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    run_id_before = json.loads((killed / "run_info.json").read_text())["run_ids"]["mlflow"]
    # before the kill the update did something: graded rewards, a gradient at every step, Adam's moments
    # non-zero in the newest checkpoint (so the resume has non-trivial optimizer state to restore)
    before = [r for r in records(killed) if "training/global_step" in r]
    assert before and all(r["critic/score/max"] > r["critic/score/min"] for r in before), before
    assert all(r["actor/grad_norm"] > 0 for r in before), [r["actor/grad_norm"] for r in before]
    newest = max(
        (p for p in (killed / "checkpoints").glob("global_step_*") if (p / "COMPLETE").exists()),
        key=lambda p: int(p.name.rsplit("_", 1)[1]),
    )
    norms = moment_norms(optimizer_state(newest))
    assert norms["exp_avg"] > 0 and norms["exp_avg_sq"] > 0, (newest.name, norms)

    result = run_rlkit("run", str(recipe))  # trainer.resume defaults to auto
    assert result.returncode == 0, result.stderr[-3000:]
    # same seed, same metrics, exactly, at every step: validation at 0 and steps 1-2 come from two independent
    # sync runs from scratch (sync is deterministic), steps 3-4 from the resumed one (resume is exact)
    assert last_record_per_step(killed) == last_record_per_step(straight)
    assert sorted(last_record_per_step(straight)) == [0, 1, 2, 3, 4]
    assert not any(k.startswith("async/") for r in records(straight) for k in r)  # sync: no rollout pool
    assert json.loads((killed / "run_info.json").read_text())["run_ids"]["mlflow"] == run_id_before

    from rlkit.runtime.merge import load_actor_state_dict

    a = load_actor_state_dict(straight / "checkpoints" / "global_step_4")
    b = load_actor_state_dict(killed / "checkpoints" / "global_step_4")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and Adam's state (exp_avg, exp_avg_sq, step of every parameter) after the resumed steps, bit for bit
    want, got = (
        optimizer_state(straight / "checkpoints" / "global_step_4"),
        optimizer_state(killed / "checkpoints" / "global_step_4"),
    )
    assert not differing_tensors(want, got), differing_tensors(want, got)[:10]
    assert moment_norms(want)["exp_avg"] > 0


@pytest.mark.e2e
def test_tool_agent_recipe_runs_on_cpu(write_recipe, tmp_path):
    """rollout.agent=tool with the HF backend: the multi-turn loop runs inside the training step."""
    out = tmp_path / "agent"
    recipe = write_recipe(out)
    result = run_rlkit(
        "run",
        str(recipe),
        "rollout.agent=tool",
        "rollout.agent.max_turns=2",
        "rollout.tools=[calculator]",
        "trainer.total_steps=2",
        "trainer.merge_at_end=false",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    last = records(out)[-1]
    assert last["num_turns/min"] >= 1 and last["num_turns/max"] <= 2
    assert "tool_call_counts/mean" in last


@pytest.mark.e2e
def test_lora_sigkill_then_resume_matches_uninterrupted_run(write_recipe, tmp_path):
    """actor.lora + KL loss: a run killed after step 2 and resumed from its adapter-only checkpoint ends with
    the same metrics and the same adapter as an uninterrupted run."""
    lora = ["actor.lora={rank: 4, alpha: 8, dropout: 0.1}", "actor.use_kl_loss=true", "actor.optim.lr=1.0e-2"]
    straight = tmp_path / "straight"
    result = run_rlkit("run", str(write_recipe(straight, "a.yaml")), *lora)
    assert result.returncode == 0, result.stderr[-3000:]

    killed = tmp_path / "killed"
    recipe = write_recipe(killed, "b.yaml")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlkit", "run", str(recipe), *lora],
        env=rlkit_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while time.time() < deadline:
        metrics = killed / "metrics.jsonl"
        if metrics.exists() and any('"step": 2' in line for line in metrics.read_text().splitlines()):
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    result = run_rlkit("run", str(recipe), *lora)
    assert result.returncode == 0, result.stderr[-3000:]
    assert records(killed)[-1] == records(straight)[-1]
    assert records(straight)[-1]["actor/lora_trainable_params"] > 0

    from rlkit.runtime.merge import load_actor_state_dict

    a = load_actor_state_dict(straight / "checkpoints" / "global_step_4")
    b = load_actor_state_dict(killed / "checkpoints" / "global_step_4")
    assert a and all(".lora_" in k for k in a)  # adapter-only checkpoints
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
