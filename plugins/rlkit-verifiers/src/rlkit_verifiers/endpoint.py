"""The token-in endpoint in-process, over the rollout's own generator: what verifiers' ``TrainClient`` calls.

``rlkit serve`` answers ``POST /inference/v1/generate`` from its own model; during a run the policy is the
rollout backend's, so this module serves the same API (``rlkit.rollout.token_in``: the same request checks
and answer shape) from a loopback HTTP thread whose generation is the rollout's ``GeneratesIds``
generator (``rlkit.rollout.agent``), run on the rollout's event loop. One endpoint per process, bound to
the loop and generator of the batch being generated (``bind``). The completion is cut after its first
``stop_token_ids`` token (the renderer's turn close), log-probs alongside.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any

from rlkit.errors import RlkitError
from rlkit.rollout.token_in import (
    GENERATE_PATH,
    MODELS_PATH,
    ConcurrentHTTPServer,
    TokenInError,
    TokenInRequest,
    generate_response,
    models_response,
    parse_generate_request,
)

__all__ = ["GeneratorEndpoint", "SERVED_MODEL", "shared_endpoint"]

SERVED_MODEL = "rlkit-policy"  # the model name verifiers' client sends
MAX_BODY_BYTES = 64 << 20
GENERATE_TIMEOUT_S = 3600.0


class GeneratorEndpoint:
    """``POST /inference/v1/generate`` and ``GET /v1/models`` on 127.0.0.1 (a free port), in a thread."""

    def __init__(self, vocab_size: int, max_model_len: int):
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self._target: tuple[asyncio.AbstractEventLoop, Any, int] | None = None
        self._server = ConcurrentHTTPServer(("127.0.0.1", 0), _handler(self))
        threading.Thread(target=self._server.serve_forever, daemon=True, name="rlkit-token-in").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def bind(self, loop: asyncio.AbstractEventLoop, generator: Any, max_new_tokens: int) -> None:
        """Serve from ``generator`` (a ``GeneratesIds``) on ``loop``, at most ``max_new_tokens`` per call."""
        self._target = (loop, generator, max_new_tokens)

    def generate(self, body: dict) -> dict:
        if self._target is None:
            raise RlkitError("the token-in endpoint has no generator bound (bind it before a rollout)")
        loop, generator, max_new_tokens = self._target
        request = parse_generate_request(
            body,
            served_model=SERVED_MODEL,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            max_n=1,
            max_new_tokens=max_new_tokens,
        )
        future = asyncio.run_coroutine_threadsafe(
            generator.generate_ids(request.prompt_ids, _sampling(request)), loop
        )
        ids, logprobs, finish = future.result(GENERATE_TIMEOUT_S)
        return generate_response(request, [_cut_at_stop(ids, logprobs, finish, request.stop_token_ids)])

    def models(self) -> dict:
        return models_response(SERVED_MODEL, self.max_model_len)


def _sampling(request: TokenInRequest) -> dict:
    return {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": max(request.top_k, 0),
        "do_sample": request.temperature > 0,
        "stop": request.stop,
        "max_new_tokens": request.max_tokens,
    }


def _cut_at_stop(ids: list[int], logprobs: list[float], finish: str, stop_ids: list[int]):
    for i, token in enumerate(ids):
        if token in stop_ids:
            return ids[: i + 1], logprobs[: i + 1], "stop"
    return list(ids), list(logprobs), finish


def _handler(endpoint: GeneratorEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet
            pass

        def _send(self, code: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?")[0] == MODELS_PATH:
                self._send(200, endpoint.models())
            else:
                self._send(404, {"error": {"message": f"no GET route {self.path}"}})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            if self.path.split("?")[0] != GENERATE_PATH or length > MAX_BODY_BYTES:
                self._send(404 if length <= MAX_BODY_BYTES else 413, {"error": {"message": "refused"}})
                return
            try:
                self._send(200, endpoint.generate(json.loads(self.rfile.read(length) or b"{}")))
            except (TokenInError, json.JSONDecodeError) as exc:
                self._send(400, {"error": {"message": str(exc)}})
            except Exception as exc:  # the endpoint keeps serving; the client sees why
                self._send(500, {"error": {"message": f"{type(exc).__name__}: {exc}"}})

    return Handler


_SHARED: dict[tuple[int, int], GeneratorEndpoint] = {}
_SHARED_LOCK = threading.Lock()


def shared_endpoint(vocab_size: int, max_model_len: int) -> GeneratorEndpoint:
    """This process's endpoint for a vocabulary and context size (started on first use)."""
    with _SHARED_LOCK:
        key = (vocab_size, max_model_len)
        if key not in _SHARED:
            _SHARED[key] = GeneratorEndpoint(vocab_size, max_model_len)
        return _SHARED[key]
