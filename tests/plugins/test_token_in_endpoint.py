"""`rlkit serve`'s token-in endpoint (``POST /inference/v1/generate``, ``GET /v1/models``) against verifiers'
real ``renderers`` client: a real server process on the tiny test model, its answers parsed by
``renderers.client.generate`` (which refuses a malformed one), and the log-probs it returned recomputed by
rlkit's own forward pass over the same token ids."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from rlkit_harness import rlkit_env

pytest.importorskip("renderers", reason="pip install -e plugins/rlkit-verifiers (it installs renderers)")


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """`rlkit serve MODEL --port 0 --max-new-tokens 24` in a subprocess; its URL."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlkit",
            "serve",
            str(tiny_model_dir),
            "--port",
            "0",
            "--max-new-tokens",
            "24",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=rlkit_env(),
    )
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, (line, proc.poll(), proc.stderr.read())
        yield line.strip().rsplit(" ", 1)[-1]
    finally:
        proc.kill()
        proc.wait()


def _renderers_generate(
    url: str, model: str, tokenizer_dir: str, messages: list[dict], sampling: dict
) -> dict:
    from openai import AsyncOpenAI
    from renderers import DefaultRendererConfig, create_renderer
    from renderers.base import load_tokenizer
    from renderers.client import generate

    renderer = create_renderer(load_tokenizer(tokenizer_dir), DefaultRendererConfig())

    async def call() -> dict:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            return await generate(
                client=client, renderer=renderer, messages=messages, model=model, sampling_params=sampling
            )
        finally:
            await client.close()

    return asyncio.run(call())


def _recompute(model_dir: str, prompt_ids: list[int], completion_ids: list[int], temperature: float):
    """rlkit's actor recompute (``rlkit.model.forward.response_outputs``) of the completion's log-probs."""
    import torch

    from rlkit.batch import Batch
    from rlkit.model.forward import response_outputs
    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig

    config = ModelConfig(path=model_dir, dtype="float32")
    module = load_model(config, tokenizer=load_tokenizer(config))
    ids = torch.tensor([prompt_ids + completion_ids])
    batch = Batch(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(ids.shape[1])[None],
            "responses": torch.tensor([completion_ids]),
            "response_mask": torch.ones(1, len(completion_ids), dtype=torch.long),
        }
    )
    out = response_outputs(
        module, batch, temperature=temperature, with_entropy=False, mixed_precision="fp32", device="cpu"
    )
    return out["log_prob"][0].tolist()


def test_models_lists_the_served_model_with_max_model_len(served, tiny_model_dir):
    with urllib.request.urlopen(f"{served}/v1/models", timeout=60) as response:
        body = json.loads(response.read())
    (card,) = body["data"]
    assert card["id"] == str(tiny_model_dir) and card["max_model_len"] == 2048


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_renderers_client_generates_and_rlkit_recomputes_the_same_log_probs(
    served, tiny_model_dir, temperature
):
    messages = [{"role": "user", "content": "Count: one two three"}]
    result = _renderers_generate(
        served,
        str(tiny_model_dir),
        str(tiny_model_dir),
        messages,
        {"temperature": temperature, "max_tokens": 12},
    )
    ids, logprobs = result["completion_ids"], result["completion_logprobs"]
    assert result["finish_reason"] in ("stop", "length") and 1 <= len(ids) <= 12
    assert len(logprobs) == len(ids) and all(lp <= 0.0 for lp in logprobs)
    recomputed = _recompute(str(tiny_model_dir), result["prompt_ids"], ids, temperature)
    assert max(abs(a - b) for a, b in zip(logprobs, recomputed)) < 1e-4, (logprobs, recomputed)


def test_requests_out_of_bounds_get_400_naming_the_field(served, tiny_model_dir):
    url, model = f"{served}/inference/v1/generate", str(tiny_model_dir)
    code, body = _post(url, {"model": model, "token_ids": [1, 2], "sampling_params": {"max_tokens": 25}})
    assert code == 400 and "max_tokens=25 is over this server's limit of 24" in body["error"]["message"]
    code, body = _post(url, {"model": model, "token_ids": [1, 2], "sampling_params": {"n": 65}})
    assert (
        code == 400
        and "n=65 is over this server's limit of 64 (rlkit serve --max-n)" in body["error"]["message"]
    )
    code, body = _post(url, {"model": "other", "token_ids": [1, 2]})
    assert code == 400 and f"this server serves {model!r}" in body["error"]["message"]
    code, body = _post(url, {"token_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.3}})
    assert code == 400 and "repetition_penalty=1.3 is not applied" in body["error"]["message"]
    code, body = _post(url, {"token_ids": [1] * 2048})
    assert code == 400 and "max_model_len is 2048" in body["error"]["message"]
    code, body = _post(url, {"token_ids": [1, 2], "sampling_params": {"max_tokens": 3, "n": 2}})
    assert code == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    assert all(len(c["logprobs"]["content"]) == len(c["token_ids"]) <= 3 for c in body["choices"])
