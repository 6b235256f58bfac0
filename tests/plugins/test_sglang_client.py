"""The sglang client and backend against `rlkit serve` (SGLang's native API subset on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("rlkit_sglang", reason="pip install -e plugins/rlkit-sglang")

from rlkit_sglang import SglangClient, SglangServerError  # noqa: E402
from rlkit_sglang.backend import SglangRollout  # noqa: E402


def resolved(key: str, kind: str, component):
    """A recipe component as the driver resolves it, from the installed plugins (rlkit-sglang included)."""
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve

    out, problems = resolve(key, kind, component, build_registries())
    assert not problems, problems
    return out


def _prompt(tokenizer, text="What is 2 + 3?") -> list[int]:
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def test_generate_returns_ids_logprobs_and_finish_reason(serve_thread):
    url, model = serve_thread
    client = SglangClient(url)
    assert client.health()
    prompt = _prompt(model.tokenizer)
    outs = client.generate([prompt, prompt[:4]], {"temperature": 0, "max_new_tokens": 6})
    assert len(outs) == 2
    for out in outs:
        assert 1 <= len(out.token_ids) <= 6 and len(out.logprobs) == len(out.token_ids)
        assert all(lp <= 0 for lp in out.logprobs)
        assert out.finish_reason in ("stop", "length")
    # The raw answer carries SGLang 0.5's field names.
    raw = client.request(
        "POST",
        "/generate",
        {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 3},
        },
    )
    assert raw["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    lp, tok, text = raw["meta_info"]["output_token_logprobs"][0]
    assert tok == raw["output_ids"][0] and text is None and lp < 0
    # Greedy log-probs equal a forward pass of the same model on prompt ‖ response.
    ids = torch.tensor([prompt + outs[0].token_ids])
    with torch.no_grad():
        logits = model.rollout.module(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    expected = (
        torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(outs[0].token_ids)[:, None]).squeeze(-1)
    )
    torch.testing.assert_close(torch.tensor(outs[0].logprobs), expected, atol=1e-4, rtol=0)


def test_n_samples_and_stop_token_ids(serve_thread):
    url, model = serve_thread
    client = SglangClient(url)
    prompt = _prompt(model.tokenizer)
    outs = client.generate([prompt], {"temperature": 1.0, "max_new_tokens": 5, "n": 3})
    assert len(outs) == 3
    greedy = client.generate([prompt], {"temperature": 0, "max_new_tokens": 5})[0]
    first = greedy.token_ids[0]
    stopped = client.generate([prompt], {"temperature": 0, "max_new_tokens": 5, "stop_token_ids": [first]})[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.matched == first


def test_bad_request_is_a_clear_error_without_retries(serve_thread):
    url, _ = serve_thread
    with pytest.raises(SglangServerError, match=r"HTTP 400.*input_ids"):
        SglangClient(url).generate([[]], {"max_new_tokens": 2})


def test_weight_update_from_disk_changes_the_next_generation(serve_thread, tmp_path):
    url, model = serve_thread
    from transformers import AutoModelForCausalLM

    client = SglangClient(url)
    prompt = _prompt(model.tokenizer)
    params = {"temperature": 0, "max_new_tokens": 8}
    original_path = model.model_path
    before = client.generate([prompt], params)[0]
    other = tmp_path / "edited"
    edited = AutoModelForCausalLM.from_pretrained(original_path, dtype=torch.float32)
    with torch.no_grad():  # point token 7's (tied) output embedding along the prompt's last hidden state
        h = edited(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
        edited.get_output_embeddings().weight[7] = 100.0 * h / h.norm() ** 2  # logit of token 7 = 100
    edited.save_pretrained(other)
    try:
        answer = client.update_weights_from_disk(str(other))
        assert answer["success"] is True
        after = client.generate([prompt], params)[0]
        assert after.token_ids[0] == 7 != before.token_ids[0]
        assert client.get_model_info()["weight_version"] == "1"
    finally:
        client.update_weights_from_disk(original_path)
    assert client.generate([prompt], params)[0].token_ids == before.token_ids  # back to the original weights
    with pytest.raises(SglangServerError, match="update_weights_from_disk"):
        client.update_weights_from_disk(str(tmp_path / "missing"))


def test_release_resume_and_flush_are_accepted(serve_thread):
    url, model = serve_thread
    client = SglangClient(url)
    assert client.release_memory_occupation()["success"] is True
    with pytest.raises(SglangServerError, match="resume_memory_occupation"):
        client.generate([_prompt(model.tokenizer)], {"max_new_tokens": 2})
    assert client.resume_memory_occupation()["success"] is True
    assert client.flush_cache() == "Cache flushed."
    assert len(client.generate([_prompt(model.tokenizer)], {"max_new_tokens": 2})) == 1


def test_backend_returns_the_rollout_batch_layout(serve_thread):
    url, model = serve_thread
    from rlkit.batch import Batch
    from rlkit.recipe.schema import RolloutConfig

    tok = model.tokenizer
    component = {"name": "sglang", "urls": [url, url]}
    spec = resolved("rollout.backend", "rollout_backends", component)  # built as the worker builds it
    assert spec.spec.generate_ids and spec.spec.memory_release and spec.params.urls == [url, url]
    backend = spec.build(
        module=None, tokenizer=tok, rollout_config=RolloutConfig(backend=component), max_response_length=6
    )
    assert isinstance(backend, SglangRollout) and [c.url for c in backend.clients] == [url, url]
    a, b = _prompt(tok), _prompt(tok, "What is 7 + 1? Think step")
    width = max(len(a), len(b))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(a)) + a, [tok.pad_token_id] * (width - len(b)) + b])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(a), width - len(b)])[:, None]).long()
    out = backend.generate(Batch({"input_ids": ids, "attention_mask": mask}), n=2, temperature=0.0)
    assert out["responses"].shape == (4, 6) and out["input_ids"].shape == (4, width + 6)
    assert torch.equal(out["prompts"][0], out["prompts"][1]) and torch.equal(out["prompts"][2], ids[1])
    assert out["response_mask"].sum() > 0 and out.meta["temperature"] == 1.0
    assert (out["rollout_log_probs"][out["response_mask"] == 0] == 0).all()
    # The same greedy continuation as the HF backend in the server.
    single = SglangClient(url).generate([a], {"temperature": 0, "max_new_tokens": 6})[0]
    assert out["responses"][0, : len(single.token_ids)].tolist() == single.token_ids


def test_server_killed_mid_request_is_a_clear_error_naming_the_url(tiny_model_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlkit", "serve", str(tiny_model_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        line = ""
        deadline = time.monotonic() + 60
        while "listening on" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "rlkit serve exited before listening"
        url = line.strip().rsplit(" ", 1)[-1]
        client = SglangClient(url, retries=2, backoff_s=0.2)
        assert client.health()
        killer = threading.Timer(0.5, proc.kill)
        killer.start()
        start = time.monotonic()
        with pytest.raises(SglangServerError) as err:  # ~1900 tokens: seconds of work, killed after 0.5 s
            client.generate([[1, 2, 3]], {"temperature": 1.0, "max_new_tokens": 1900, "ignore_eos": True})
        message = str(err.value)
        assert url in message and "/generate" in message and "still alive" in message
        assert time.monotonic() - start < 10
    finally:
        proc.kill()
        proc.wait()


def test_agent_loop_drives_the_sglang_backend_turn_by_turn(serve_thread):
    url, model = serve_thread
    from rlkit.batch import Batch
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.rollout.agent import AgentLoopRollout

    tok = model.tokenizer
    cfg = RolloutConfig(
        temperature=0.0,
        agent={"name": "tool", "max_turns": 2},
        tools=["calculator"],
        backend={"name": "sglang", "urls": [url]},
    )
    backend_c = resolved("rollout.backend", "rollout_backends", cfg.backend)
    backend = backend_c.build(tokenizer=tok, rollout_config=cfg, max_response_length=10)
    prompt = _prompt(tok)
    batch = Batch(
        {"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, len(prompt), dtype=torch.long)}
    )
    loops = {"tool": resolved("rollout.agent", "agent_loops", cfg.agent)}
    agent = AgentLoopRollout(
        backend,
        tok,
        rollout_config=cfg,
        max_response_length=10,
        loops=loops,
        default_agent="tool",
        tools=(resolved("rollout.tools.0", "tools", "calculator"),),
        generate_ids=backend_c.spec.generate_ids,
    )
    assert agent.generator is backend  # the sglang backend is its own TurnGenerator
    out = agent.generate(batch)
    direct = backend.generate(batch)  # greedy: the loop's single turn equals the batch call
    assert torch.equal(out["responses"], direct["responses"]) and out.meta["metrics"]["num_turns/max"] == 1.0
