"""vLLM's token-in generate API, the part verifiers' ``renderers`` client speaks, as plain functions.

``POST /inference/v1/generate`` (mounted at the server root, not under ``/v1``) takes prompt token ids and
answers the completion's token ids, its finish reason and one finite log-prob per token; ``GET /v1/models``
names the served model and its ``max_model_len``. A client that tokenizes on its own side (verifiers v1's
``TrainClient``: ``renderers.client.generate``) then trains on exactly the ids it was given.

This module parses and checks a request body (``parse_generate_request``) and shapes the answer
(``generate_response``, ``models_response``); the server that owns a model (``rlkit serve``,
``rlkit.cli.server``) runs the generation in between. Fields (as vLLM 0.11+ and renderers 0.1.12 use them):

request   ``{"model", "token_ids": [ids], "sampling_params": {temperature, top_p, top_k (-1 off),
          max_tokens, n, stop, stop_token_ids, ignore_eos, logprobs (0 or 1), skip_special_tokens},
          "cache_salt"?, "priority"?, "request_id"?}``
answer    ``{"request_id", "prompt_token_ids", "choices": [{"index", "token_ids", "finish_reason":
          "stop" | "length", "logprobs": {"content": [{"token": "token_id:<id>", "logprob"}]}}],
          "usage": {prompt_tokens, completion_tokens, total_tokens}}``

The log-prob of a token is the one rlkit's rollout reports: ``log_softmax(logits / temperature)`` of the
sampled token before top-k / top-p (temperature 1 when greedy), the actor's recompute of the same ids.
Multimodal inputs (``features``, ``content_parts``) and sampling knobs rlkit's sampler does not apply
(penalties, ``min_p``, ``logit_bias``, a per-request ``seed``, ...) are refused, not ignored.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any

from rlkit.errors import RlkitError

__all__ = [
    "ConcurrentHTTPServer",
    "GENERATE_PATH",
    "MODELS_PATH",
    "TokenInError",
    "TokenInRequest",
    "generate_response",
    "models_response",
    "parse_generate_request",
]

GENERATE_PATH = "/inference/v1/generate"
MODELS_PATH = "/v1/models"

LISTEN_BACKLOG = 1024  # connections the kernel queues before the server thread accepts them


class ConcurrentHTTPServer(ThreadingHTTPServer):
    """``http.server``'s threading server with a listen backlog for many clients connecting at once, a
    thread per request (daemon: the process may exit with requests in flight). The standard backlog is 5:
    verifiers opens a connection per episode (16–32 at once in a batch), and while generation keeps the
    accepting thread from running, the kernel dropped the connections past the fifth; the clients saw
    "Connection error." after about a second and the episodes failed (``env/errors``)."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True


_SAMPLING_USED = {"temperature", "top_p", "top_k", "max_tokens", "n", "stop", "stop_token_ids", "ignore_eos"}
# Accepted and without effect here: output formatting (no text is returned), engine hints.
_SAMPLING_NO_EFFECT = {
    "logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "detokenize",
    "routed_experts_prompt_start",
}
# Knobs rlkit's sampler does not apply: accepted only at their no-op value.
_SAMPLING_NEUTRAL: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "seed": None,
    "logit_bias": None,
    "prompt_logprobs": None,
    "include_stop_str_in_output": False,
}
_BODY_KEYS = {"model", "token_ids", "sampling_params", "cache_salt", "priority", "request_id", "stream"}


class TokenInError(RlkitError, ValueError):
    """A token-in request the server refuses (HTTP 400): the message names the field and what is valid."""


@dataclass(frozen=True)
class TokenInRequest:
    """One checked ``/inference/v1/generate`` request."""

    request_id: str
    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # -1: off
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def sglang_sampling(self) -> dict[str, Any]:
        """The same request in ``rlkit serve``'s ``/generate`` (SGLang) sampling fields."""
        return {
            "n": self.n,
            "max_new_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
        }


def parse_generate_request(
    body: dict, *, served_model: str, vocab_size: int, max_model_len: int, max_n: int, max_new_tokens: int
) -> TokenInRequest:
    """Check a ``/inference/v1/generate`` body against the served model and the server's limits
    (``--max-n``, ``--max-new-tokens``); raise ``TokenInError`` naming the field otherwise."""
    unknown = sorted(set(body) - _BODY_KEYS)
    if unknown:
        raise TokenInError(
            f"{GENERATE_PATH}: unsupported field(s) {unknown} (multimodal features are not served here); "
            f"valid: {sorted(_BODY_KEYS)}"
        )
    if body.get("stream"):
        raise TokenInError(f"{GENERATE_PATH}: stream=true is not supported; send stream=false or omit it")
    model = body.get("model")
    if model is not None and model != served_model:
        raise TokenInError(
            f"{GENERATE_PATH}: model {model!r} is not served here; this server serves {served_model!r} "
            f"(GET {MODELS_PATH})"
        )
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise TokenInError(f"{GENERATE_PATH}: token_ids must be a non-empty list of token ids")
    if any(t < 0 or t >= vocab_size for t in ids):
        raise TokenInError(f"{GENERATE_PATH}: token_ids has a token id outside [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise TokenInError(
            f"{GENERATE_PATH}: the prompt has {len(ids)} tokens; this model's max_model_len is "
            f"{max_model_len}, which leaves no room to generate"
        )
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise TokenInError(f"{GENERATE_PATH}: sampling_params must be an object")
    _check_sampling_keys(sampling)
    return TokenInRequest(
        request_id=str(body.get("request_id") or uuid.uuid4().hex),
        prompt_ids=list(ids),
        n=_bounded_int(sampling, "n", 1, max_n, "--max-n"),
        max_tokens=_max_tokens(sampling, len(ids), max_model_len, max_new_tokens),
        temperature=_number(sampling, "temperature", 1.0),
        top_p=_number(sampling, "top_p", 1.0),
        top_k=int(_number(sampling, "top_k", -1)),
        stop=_stop_strings(sampling.get("stop")),
        stop_token_ids=_token_list(sampling.get("stop_token_ids"), "stop_token_ids", vocab_size),
        ignore_eos=bool(sampling.get("ignore_eos", False)),
    )


def _check_sampling_keys(sampling: dict) -> None:
    unknown = sorted(set(sampling) - _SAMPLING_USED - _SAMPLING_NO_EFFECT - set(_SAMPLING_NEUTRAL))
    if unknown:
        valid = sorted(_SAMPLING_USED | _SAMPLING_NO_EFFECT | set(_SAMPLING_NEUTRAL))
        raise TokenInError(f"{GENERATE_PATH}: unsupported sampling_params {unknown}; valid: {valid}")
    for key, neutral in _SAMPLING_NEUTRAL.items():
        if key in sampling and sampling[key] is not None and sampling[key] != neutral:
            raise TokenInError(
                f"{GENERATE_PATH}: sampling_params.{key}={sampling[key]!r} is not applied by rlkit's "
                f"sampler; drop it or send {neutral!r}"
            )
    if sampling.get("logprobs") not in (None, 0, 1):
        raise TokenInError(
            f"{GENERATE_PATH}: sampling_params.logprobs={sampling['logprobs']!r}: only the sampled token's "
            "log-prob is returned; send 0 or 1"
        )


def _number(sampling: dict, key: str, default: float) -> float:
    value = sampling.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TokenInError(f"{GENERATE_PATH}: sampling_params.{key} must be a number, got {value!r}")
    return float(value)


def _bounded_int(sampling: dict, key: str, default: int, limit: int, flag: str) -> int:
    value = sampling.get(key)
    value = default if value is None else value
    if type(value) is not int or value < 1:
        raise TokenInError(f"{GENERATE_PATH}: sampling_params.{key} must be an integer >= 1, got {value!r}")
    if value > limit:
        raise TokenInError(f"{key}={value} is over this server's limit of {limit} (rlkit serve {flag})")
    return value


def _max_tokens(sampling: dict, prompt_len: int, max_model_len: int, max_new_tokens: int) -> int:
    room = max_model_len - prompt_len
    if sampling.get("max_tokens") is None:  # vLLM: up to the context window; here also the server's limit
        return min(room, max_new_tokens)
    value = _bounded_int(sampling, "max_tokens", 1, max_new_tokens, "--max-new-tokens")
    if value > room:
        raise TokenInError(
            f"{GENERATE_PATH}: max_tokens={value} with a {prompt_len}-token prompt exceeds this model's "
            f"max_model_len of {max_model_len}; ask for at most {room}"
        )
    return value


def _stop_strings(stop: Any) -> list[str]:
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise TokenInError(
            f"{GENERATE_PATH}: sampling_params.stop must be a string or a list of non-empty strings"
        )
    return list(stop)


def _token_list(ids: Any, key: str, vocab_size: int) -> list[int]:
    ids = [] if ids is None else ids
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise TokenInError(
            f"{GENERATE_PATH}: sampling_params.{key} must be a list of ids in [0, {vocab_size})"
        )
    return list(ids)


def generate_response(request: TokenInRequest, completions: list[tuple[list[int], list[float], str]]) -> dict:
    """The answer to ``request``: one choice per ``(token_ids, logprobs, finish_reason)`` completion.

    Raises ``RlkitError`` when a completion carries other than one finite log-prob per token (a backend
    bug: the client would refuse the answer)."""
    choices = []
    for index, (ids, logprobs, finish_reason) in enumerate(completions):
        if len(logprobs) != len(ids) or not all(math.isfinite(lp) for lp in logprobs):
            raise RlkitError(
                f"{GENERATE_PATH}: the rollout backend returned {len(logprobs)} log-probs for {len(ids)} "
                "tokens, or a non-finite one; each generated token needs one finite log-prob"
            )
        if finish_reason not in ("stop", "length"):
            raise RlkitError(f"{GENERATE_PATH}: finish_reason {finish_reason!r} is not 'stop' or 'length'")
        content = [{"token": f"token_id:{t}", "logprob": float(lp)} for t, lp in zip(ids, logprobs)]
        choices.append(
            {
                "index": index,
                "token_ids": list(ids),
                "finish_reason": finish_reason,
                "logprobs": {"content": content},
            }
        )
    completion_tokens = sum(len(c["token_ids"]) for c in choices)
    return {
        "request_id": request.request_id,
        "prompt_token_ids": list(request.prompt_ids),
        "choices": choices,
        "usage": {
            "prompt_tokens": len(request.prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(request.prompt_ids) + completion_tokens,
        },
    }


def models_response(served_model: str, max_model_len: int) -> dict:
    """``GET /v1/models``: the served model card with vLLM's ``max_model_len`` extension."""
    card = {
        "id": served_model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "rlkit",
        "root": served_model,
        "max_model_len": int(max_model_len),
    }
    return {"object": "list", "data": [card]}
