"""A LoRA actor (``actor.lora``) with the ``sglang`` rollout backend, against a REAL SGLang server (marker
``engines``).

On CPU SGLang 0.5.15 cannot serve adapters (its LoRA layers pin memory, which needs a CUDA driver: a server
started with ``--enable-lora`` dies at start, docs/sglang.md), so the backend runs in ``lora_mode``
``merged``:
the actor's ``W + scale · B A`` is pushed in full (``/update_weights_from_tensor``) at start and after each
update, and said in the log. Checked: greedy generation equals rlkit's HF backend sampling from the same LoRA
module, before and after a sync; then `rlkit run` with ``actor.lora`` and ``rollout.backend=sglang``. The
adapter mode (``/load_lora_adapter``) is for CUDA servers and is not run here. Run with `nox -s
engines_sglang`. Model:
SmolLM2-135M-Instruct in fp32 (the quickstart's). One server at a time (3.8 GB and a core each).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rlkit_harness import recipe_text, rlkit_env

from rlkit.testing.rollout import assert_same_greedy, hf_greedy

pytestmark = pytest.mark.engines

DEFAULT_PYTHON = "/work/engines/sglang/bin/python"


@pytest.fixture(scope="module")
def sglang_python() -> str:
    python = os.environ.get("RLKIT_SGLANG_PYTHON", DEFAULT_PYTHON)
    if not Path(python).exists():
        pytest.fail(
            f"no SGLang Python at {python} (RLKIT_SGLANG_PYTHON): build it with "
            "plugins/rlkit-sglang/scripts/sglang-cpu.sh (docs/sglang.md)"
        )
    return python


@pytest.fixture(scope="module")
def model_dir() -> str:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rlkit.model.smollm2 import smollm2_dir

    return str(smollm2_dir())


def set_adapter(module, seed: int, scale: float = 0.05) -> None:
    """Random ``lora_B`` (seeded): an adapter that changes the outputs (a fresh one is the identity)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def test_cpu_server_gets_merged_weights_and_generation_follows_each_sync(
    sglang_python, model_dir, tmp_path, caplog
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkit.model.lora import adapter_state_dict, apply_lora, base_state_dict, state_bytes
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve
    from rlkit.recipe.schema import LoraConfig, RolloutConfig
    from rlkit.testing.rollout import chat_prompts

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    module, _ = apply_lora(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), LoraConfig(rank=8, alpha=16)
    )
    module.eval()
    set_adapter(module, seed=1)
    logs = tmp_path / "logs"
    component = {
        "name": "sglang",
        "model_path": model_dir,
        "weights_dir": str(tmp_path / "weights"),
        "launch": {"python": sglang_python, "log_dir": str(logs), "startup_timeout_s": 900},
    }
    built, problems = resolve("rollout.backend", "rollout_backends", component, build_registries())
    assert not problems, problems
    backend = built.build(
        module=module,
        tokenizer=tok,
        rollout_config=RolloutConfig(n=1, backend=component),
        max_response_length=12,
        device=torch.device("cpu"),
    )
    try:
        assert backend.lora_mode == "merged" and "LoRA rank 8 with merged weights" in caplog.text
        full_bytes = state_bytes(base_state_dict(module.state_dict()))  # tied head counted under both names
        assert backend.sync_bytes == full_bytes > 20 * state_bytes(adapter_state_dict(module))
        assert backend.clients[0].request("GET", "/server_info")["enable_lora"] in (None, False)
        prompts = chat_prompts(
            tok, ("What is 2 + 3?", "Name a colour.", "What is 7 + 1? Answer with a number.")
        )
        first = backend.generate(prompts, n=1, do_sample=False)  # the adapter pushed at start is in effect
        assert first.meta["metrics"]["rollout/weight_sync_bytes"] == full_bytes
        assert_same_greedy(first, hf_greedy(module, tok, prompts, 12), atol=1e-3)

        set_adapter(module, seed=2)  # "an update"
        backend.update_weights(module)
        second = backend.generate(prompts, n=1, do_sample=False)
        assert not torch.equal(second["responses"], first["responses"])
        assert_same_greedy(second, hf_greedy(module, tok, prompts, 12), atol=1e-3)
    finally:
        backend.shutdown()
    (log,) = logs.glob("sglang-*.log")
    text = log.read_text(errors="replace")
    synced = r"POST /update_weights_from_tensor HTTP/1.1\" 200"
    assert len(re.findall(synced, text)) == 2  # at start, after the update


def run_overrides(python: str, logs: Path, out: Path) -> dict:
    """On top of the tiny base (``rlkit_harness.tiny_recipe``): the ``sglang`` backend launched by the run,
    at most 8 tokens, 2 steps without checkpoints."""
    return {
        "data.max_response_length": 8,
        "actor": {
            "optim": {"lr": 2.0e-4},
            "ppo_micro_batch_size_per_rank": 4,
            "lora": {"rank": 8, "alpha": 16},
        },
        "rollout.backend": {
            "name": "sglang",
            "launch": {"python": str(python), "log_dir": str(logs), "startup_timeout_s": 900},
        },
        "resources": {"pools": {"global": {"nodes": 1, "bundles_per_node": 1}}},
        "trainer.total_steps": 2,
        "trainer.save_freq": 0,
        "trainer.experiment_name": "sglang_lora",
    }


def test_rlkit_run_lora_through_a_real_sglang_server(sglang_python, model_dir, tmp_path):
    from rlkit.data import generate_arithmetic

    generate_arithmetic(tmp_path / "data", train_size=16, test_size=4, seed=0)
    out, logs = tmp_path / "out", tmp_path / "sglang-logs"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text(model_dir, tmp_path / "data", out, run_overrides(sglang_python, logs, out)))
    proc = subprocess.run(
        [sys.executable, "-m", "rlkit", "run", str(recipe)],
        env=rlkit_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "training/global_step" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2]
    assert "LoRA rank 8 with merged weights" in proc.stdout + proc.stderr  # the fallback, said in the log
    for r in steps:  # on CPU: merged full weights (SmolLM2: 538 MB with the tied head under both names)
        assert r["rollout/weight_sync_bytes"] > 100 * r["actor/lora_trainable_params"]
        assert r["response_length/mean"] > 0 and "actor/pg_loss" in r
    (log,) = logs.glob("sglang-*.log")
    text = log.read_text(errors="replace")
    synced = r"POST /update_weights_from_tensor HTTP/1.1\" 200"
    assert len(re.findall(synced, text)) >= 2  # at start, after step 1
    assert "load_lora_adapter" not in text
    assert len(re.findall(r"POST /generate HTTP/1.1\" 200", text)) >= 2
