"""The sglang backend against a REAL SGLang server (0.5.15.post1, CPU), started once for this module.

Marker ``engines`` (not in the default run): ``nox -s engines_sglang``, or
``RLKIT_SGLANG_PYTHON=/path/to/venv/bin/python pytest -m engines tests/engines/test_sglang_real.py``.
SGLang lives in its own venv (``plugins/rlkit-sglang/scripts/sglang-cpu.sh VENV``); the server is
launched by the backend itself (``launch.python``), as a training run does. Model: SmolLM2-135M-Instruct
in fp32 (the quickstart's, from the rlkit cache). The next-to-last test kills the server; the last one is an
`rlkit run` whose worker launches its own server (one server at a time: 3.8 GB and a core each).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from rlkit_harness import recipe_text, rlkit_env

from rlkit.testing.rollout import hf_greedy

pytestmark = pytest.mark.engines

DEFAULT_PYTHON = "/work/engines/sglang/bin/python"
BUILD = (
    "build it: bash plugins/rlkit-sglang/scripts/sglang-cpu.sh /work/engines/sglang (about 3 min, 6.6 GB, "
    "registry packages only), or point RLKIT_SGLANG_PYTHON at a Python that has sglang==0.5.15.post1"
)


@pytest.fixture(scope="module")
def sglang_python() -> str:
    python = os.environ.get("RLKIT_SGLANG_PYTHON", DEFAULT_PYTHON)
    if not Path(python).exists():
        pytest.fail(f"no SGLang Python at {python} (RLKIT_SGLANG_PYTHON): {BUILD}")
    check = subprocess.run(
        [python, "-c", "import sglang, sys; print(sglang.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check.returncode != 0:
        pytest.fail(f"{python} cannot import sglang ({check.stderr.strip()[-300:]}): {BUILD}")
    return python


@pytest.fixture(scope="module")
def model_dir() -> str:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rlkit.model.smollm2 import smollm2_dir

    return str(smollm2_dir())


@pytest.fixture(scope="module")
def hf(model_dir):
    """SmolLM2 in fp32 and its tokenizer in this process (the HF backend's model; the log-prob reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return module, AutoTokenizer.from_pretrained(model_dir)


def _resolve(component):
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve

    built, problems = resolve("rollout.backend", "rollout_backends", component, build_registries())
    assert not problems, problems
    return built


@pytest.fixture(scope="module")
def backend(sglang_python, model_dir, hf, tmp_path_factory):
    """The sglang backend as a worker builds it, launching its server on CPU (device auto = the worker's)."""
    from rlkit.recipe.schema import RolloutConfig

    module, tok = hf
    logs = tmp_path_factory.mktemp("sglang-logs")
    component = {
        "name": "sglang",
        "model_path": model_dir,
        "weights_dir": str(logs / "weights"),
        "launch": {"python": sglang_python, "log_dir": str(logs), "startup_timeout_s": 900},
    }
    built = _resolve(component)
    backend = built.build(
        module=module,
        tokenizer=tok,
        rollout_config=RolloutConfig(n=2, backend=component),
        max_response_length=12,
        device=torch.device("cpu"),
    )
    try:
        yield backend
    finally:
        backend.shutdown()


def _prompts(tok, questions=("What is 2 + 3?", "Name a colour.", "What is 7 + 1? Answer with a number.")):
    from rlkit.testing.rollout import chat_prompts

    return chat_prompts(tok, questions)


def test_server_runs_on_cpu_with_the_cpu_flags_and_no_memory_release(backend, sglang_python):
    from rlkit.errors import RlkitError
    from rlkit.recipe.schema import RolloutConfig

    server = backend._servers[0]
    info = backend.clients[0].request("GET", "/server_info")
    assert info["device"] == "cpu" and info["enable_memory_saver"] is False and info["dtype"] == "float32"
    assert info["attention_backend"] == "torch_native" and info["sleep_on_idle"] is True
    assert backend.memory_release is False  # decided at start: never on CPU
    backend.release_memory()  # a no-op here (on CPU /release_memory_occupation kills the server)
    assert backend.clients[0].health() and server.problem() is None
    with pytest.raises(RlkitError, match="memory_release=true, but a server cannot release.*CUDA-only"):
        asked = _resolve({"name": "sglang", "urls": [server.url], "memory_release": True})
        asked.build(tokenizer=backend.tokenizer, rollout_config=RolloutConfig(), max_response_length=4)


def test_generate_contract_with_the_rollout_kit(backend, hf):
    """Layout, n ordering, log-probs = the model's log_softmax(logits / T) of the sampled tokens (T = 0.8,
    top-k 20: untruncated) and at T = 1 when greedy, generate_ids, update_weights(module) — through the
    attach path (urls) on the same server."""
    from rlkit.testing import check_rollout_backend

    module, tok = hf
    url = backend.clients[0].url
    checked = check_rollout_backend(
        "sglang",
        module,
        tok,
        n=2,
        max_response_length=10,
        temperature=0.8,
        top_k=20,
        atol=1e-4,
        urls=[url],
        weights_dir=backend.weights_dir,
    )
    assert checked.memory_release is False


def test_finish_reasons_stop_ids_and_one_log_prob_per_token(backend, hf):
    _, tok = hf
    client = backend.clients[0]
    row = _prompts(tok)["input_ids"][0].tolist()
    base = {"temperature": 0.0, "no_stop_trim": True, "skip_special_tokens": False}
    long = client.generate([row], {**base, "max_new_tokens": 40, "stop_token_ids": [tok.eos_token_id]})[0]
    assert (
        long.finish_reason == "stop"
        and long.matched == tok.eos_token_id
        and long.token_ids[-1] == tok.eos_token_id
    )
    assert len(long.logprobs) == len(long.token_ids) and all(lp <= 0 for lp in long.logprobs)
    cut = client.generate([row], {**base, "max_new_tokens": 3})[0]
    assert cut.finish_reason == "length" and cut.token_ids == long.token_ids[:3] and len(cut.logprobs) == 3
    third = long.token_ids[2]
    stopped = client.generate([row], {**base, "max_new_tokens": 40, "stop_token_ids": [third]})[0]
    assert (
        stopped.finish_reason == "stop"
        and stopped.matched == third
        and stopped.token_ids == long.token_ids[:3]
    )
    # n samples per input come input-major: [a0, a1, b0, b1]; greedy makes each pair equal to that input's
    # answer.
    short = row[:6]
    pairs = client.generate([row, short], {**base, "max_new_tokens": 5, "n": 2})
    alone = client.generate([short], {**base, "max_new_tokens": 5})[0]
    assert [o.token_ids for o in pairs] == [long.token_ids[:5]] * 2 + [alone.token_ids] * 2


def test_greedy_parity_with_the_hf_backend(backend, hf):
    module, tok = hf
    prompts = _prompts(tok)
    ours = backend.generate(prompts, n=1, do_sample=False)
    ref = hf_greedy(module, tok, prompts, backend.max_response_length)
    assert torch.equal(ours["responses"], ref["responses"]) and torch.equal(
        ours["response_mask"], ref["response_mask"]
    )
    gap = (ours["rollout_log_probs"] - ref["rollout_log_probs"]).abs().max().item()
    assert gap < 1e-4, f"greedy log-probs differ from the HF backend's by {gap:.2e}"


def _footprint(backend) -> dict:
    """What a sync could leave behind: rlkit-sglang entries in the temp dir, the bytes under the run's weights
    root, this process's shared-memory segments."""
    import tempfile

    root = Path(backend.weights_dir)
    files = [f for f in root.rglob("*") if f.is_file()] if root.exists() else []
    mine = f"rlkit-sglang-{os.getpid()}-"  # other processes on the machine may make their own
    return {
        "tmp": sorted(e for e in os.listdir(tempfile.gettempdir()) if e.startswith(mine)),
        "weights_files": sorted(str(f.relative_to(root)) for f in files),
        "weights_bytes": sum(f.stat().st_size for f in files),
        "shm": sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")),
    }


@pytest.mark.parametrize("path", ["tensor", "disk"])
def test_weight_sync_changes_outputs_restores_them_and_leaves_nothing(backend, hf, path, monkeypatch):
    """Six syncs (perturbed, original, ...): perturbed weights give the HF backend's outputs for the perturbed
    model, the originals the first outputs again; nothing grows on disk or in shared memory from one sync to
    the next. ``tensor``: /update_weights_from_tensor (what a launched server gets); ``disk``: the run's one
    folder, rewritten in place (/update_weights_from_disk)."""
    import copy

    module, tok = hf
    monkeypatch.setattr(backend, "weight_sync", path)
    prompts = _prompts(tok)
    before = backend.generate(prompts, n=1, do_sample=False)
    perturbed = copy.deepcopy(module)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    ref = hf_greedy(perturbed, tok, prompts, backend.max_response_length)
    footprints = []
    try:
        for i in range(6):
            backend.update_weights(perturbed if i % 2 == 0 else module)
            footprints.append(_footprint(backend))
            if i == 4:
                after = backend.generate(prompts, n=1, do_sample=False)
                assert not torch.equal(after["responses"], before["responses"])
                assert torch.equal(after["responses"], ref["responses"])
                assert (after["rollout_log_probs"] - ref["rollout_log_probs"]).abs().max().item() < 1e-4
    finally:
        backend.update_weights(module)
    restored = backend.generate(prompts, n=1, do_sample=False)
    assert torch.equal(restored["responses"], before["responses"])
    assert (restored["rollout_log_probs"] - before["rollout_log_probs"]).abs().max().item() < 1e-5
    assert all(f == footprints[0] for f in footprints), footprints  # nothing grows from sync to sync
    assert footprints[0]["shm"] == []  # every buffer was let go by the server and by us
    assert backend.sync_bytes > 500e6  # SmolLM2-135M in fp32 went through each time
    if path == "tensor":
        assert backend.folder.path is None  # nothing written at all
    else:  # one folder, the model's size, rewritten in place
        own = Path(backend.folder.path)
        assert 500e6 < sum(f.stat().st_size for f in own.rglob("*") if f.is_file()) < 700e6


def test_flush_cache_keeps_the_outputs(backend, hf):
    _, tok = hf
    prompts = _prompts(tok)
    before = backend.generate(prompts, n=1, do_sample=False)
    assert "Cache flushed" in backend.clients[0].flush_cache()
    backend.flush_cache()
    after = backend.generate(prompts, n=1, do_sample=False)
    assert torch.equal(after["responses"], before["responses"])


def test_dead_server_is_an_error_within_seconds(backend, hf):
    """Runs last: kills the server's main process in the middle of a long generation."""
    from rlkit_sglang import SglangClient, SglangServerError

    _, tok = hf
    server = backend._servers[0]
    main = int(Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()[0])
    killer = threading.Timer(1.0, os.kill, (main, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    row = _prompts(tok)["input_ids"][0].tolist()
    # the launched server is watched: ~900 tokens
    with pytest.raises(SglangServerError, match="exited") as err:
        backend.clients[0].generate([row], {"max_new_tokens": 900, "ignore_eos": True})  # take 20 s or more
    assert server.url in str(err.value) and time.monotonic() - start < 30
    start = time.monotonic()
    with pytest.raises(SglangServerError, match="did not answer") as err:  # an attached one: refused, retried
        SglangClient(server.url, retries=2, backoff_s=0.2).generate([[1, 2, 3]], {"max_new_tokens": 2})
    assert server.url in str(err.value) and time.monotonic() - start < 10


# ----- a training run ------------------------------------------------------------------------------
def run_overrides(python: str, logs: Path, out: Path) -> dict:
    """On top of the tiny base (``rlkit_harness.tiny_recipe``): the ``sglang`` backend launched by the run,
    at most 8 tokens, 2 steps without checkpoints."""
    return {
        "data.max_response_length": 8,
        "actor": {"optim": {"lr": 1.0e-5}, "ppo_micro_batch_size_per_rank": 4},
        "rollout.backend": {
            "name": "sglang",
            "launch": {"python": str(python), "log_dir": str(logs), "startup_timeout_s": 900},
        },
        "resources": {"pools": {"global": {"nodes": 1, "bundles_per_node": 1}}},
        "trainer.total_steps": 2,
        "trainer.save_freq": 0,
        "trainer.experiment_name": "sglang",
    }


def _server_pids(port: str) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-f", f"sglang.launch_server.*--port {port}"], capture_output=True, text=True
    )
    return [int(p) for p in out.stdout.split()]


def test_rlkit_run_trains_through_a_real_sglang_server(sglang_python, model_dir, tmp_path):
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
    assert "sglang: memory release off" in proc.stdout + proc.stderr  # decided at start, said in the log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "training/global_step" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2]
    for r in steps:  # generation came from the server; the update ran on its samples
        assert r["response_length/mean"] > 0 and "actor/pg_loss" in r and "critic/score/mean" in r
    (log,) = logs.glob("sglang-*.log")
    text = log.read_text(errors="replace")
    assert len(re.findall(r"POST /update_weights_from_tensor HTTP/1.1\" 200", text)) >= 2  # a sync per step
    assert len(re.findall(r"POST /generate HTTP/1.1\" 200", text)) >= 2
    port = log.stem.split("-")[1]
    deadline = time.monotonic() + 30  # stopped with the run (shutdown, or the guard when the worker exits)
    while _server_pids(port) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _server_pids(port)
    assert not list(tmp_path.glob("**/rlkit-sglang-*")), "the run left a weights folder behind"
