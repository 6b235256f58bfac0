"""A small client of SGLang's native HTTP API (the subset an RL trainer needs), standard library only.

Endpoints and fields follow SGLang 0.5 (``sglang/srt/managers/io_struct.py``,
``sglang/srt/entrypoints/http_server.py``):

- ``POST /generate`` ``{"input_ids": [[int]] | [int], "sampling_params": {...} | [{...}],
  "return_logprob": bool}``; ``sampling_params``: ``temperature, top_p, top_k (-1 = off),
  max_new_tokens, stop, stop_token_ids, ignore_eos, n, skip_special_tokens, no_stop_trim``. The answer is one
  object (or a list, one per input × n) with ``text``, ``output_ids`` and ``meta_info``:
  ``finish_reason`` ``{"type": "stop", "matched": id | str} | {"type": "length", "length": n} |
  {"type": "abort", "message": str}``, ``prompt_tokens``, ``completion_tokens``, and with
  ``return_logprob`` ``output_token_logprobs`` = ``[[logprob, token_id, text | None], ...]``.
- ``POST /update_weights_from_disk`` ``{"model_path", "load_format", "flush_cache"}`` → ``{"success",
  "message"}``;
- ``POST /update_weights_from_tensor`` ``{"serialized_named_tensors": [base64, one per TP rank],
  "load_format": "flattened_bucket", "flush_cache"}`` → ``{"success", "message"}`` (``rlkit_sglang.sync``);
- ``POST /load_lora_adapter`` ``{"lora_name", "lora_path"}`` / ``/unload_lora_adapter`` ``{"lora_name"}``
  → ``{"success", "error_message", ...}``; ``/generate`` then takes ``"lora_path": lora_name``;
- ``POST /release_memory_occupation`` / ``/resume_memory_occupation`` ``{"tags": [...] | None}``;
- ``GET|POST /flush_cache``; ``GET /health``; ``GET /get_model_info``.

Every call retries connection failures (a server restarting, a port not yet open) with backoff and
then raises ``SglangServerError`` naming the URL, the endpoint and what to check. A client of a server
this process launched also has a liveness ``watch``: while a request is in flight the server process is
checked every ``poll_s``, and its death raises at once (a dead server is an error within a second,
never a wait for ``timeout_s``).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlkit.errors import RlkitError

__all__ = ["SglangClient", "SglangServerError", "GenerateOutput", "parse_output"]


class SglangServerError(RlkitError):
    """An SGLang server did not answer, or answered with an error."""


@dataclass
class GenerateOutput:
    """One generated continuation, parsed from a ``/generate`` answer."""

    token_ids: list[int]
    logprobs: list[float]  # one per token (empty when return_logprob was off)
    finish_reason: str  # "stop" | "length" | "abort"
    text: str = ""
    matched: Any = None  # the stop token id or string that ended it, if any
    meta_info: dict = field(default_factory=dict)


def parse_output(item: dict) -> GenerateOutput:
    """A ``GenerateOutput`` from one ``/generate`` answer object (SGLang 0.5 field names)."""
    meta = item.get("meta_info") or {}
    reason = meta.get("finish_reason") or {}
    if isinstance(reason, str):  # older servers send a bare string
        reason = {"type": reason}
    kind = reason.get("type") or "length"
    if kind == "abort":
        raise SglangServerError(f"SGLang aborted the request: {reason.get('message', reason)}")
    triples = meta.get("output_token_logprobs")
    if triples:
        logprobs = [float(t[0]) if t[0] is not None else 0.0 for t in triples]
        ids = [int(t[1]) for t in triples]
    else:
        ids = [int(i) for i in item.get("output_ids", [])]
        logprobs = []
    return GenerateOutput(ids, logprobs, kind, item.get("text", ""), reason.get("matched"), meta)


class SglangClient:
    """One SGLang server at ``url`` (``http://host:port``)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        watch: Callable[[], str | None] | None = None,
        poll_s: float = 0.25,
    ):
        """``watch``: returns None while the server lives, else what happened to it
        (``LocalServer.problem``)."""
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.watch = watch
        self.poll_s = poll_s

    def _dead(self, method: str, path: str) -> SglangServerError | None:
        problem = self.watch() if self.watch is not None else None
        if problem is None:
            return None
        return SglangServerError(
            f"{problem}; {method} {path} cannot be answered. The log shows why it died "
            "(out of memory, a crash while loading weights, an endpoint the device does not support)."
        )

    def _open(self, req: urllib.request.Request, timeout_s: float) -> bytes:
        """The answer's body; with a ``watch``, the request runs in a thread while the server is watched."""
        if self.watch is None:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.read()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                    box["body"] = resp.read()
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=run, daemon=True, name=f"sglang-request {req.full_url}")
        thread.start()
        while thread.is_alive():
            thread.join(self.poll_s)
            if thread.is_alive():
                dead = self._dead(req.get_method(), req.selector)
                if dead is not None:
                    raise dead
        if "error" in box:
            raise box["error"]
        return box["body"]

    # ----- transport --------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        *,
        timeout_s: float | None = None,
        retries: int | None = None,
    ) -> Any:
        """Send one request; the decoded JSON answer (or text when not JSON). Raises ``SglangServerError``."""
        data = None if payload is None else json.dumps(payload).encode()
        attempts = 1 + (self.retries if retries is None else retries)
        last: BaseException | None = None
        for attempt in range(attempts):
            req = urllib.request.Request(
                self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
            )
            try:
                body = self._open(req, timeout_s or self.timeout_s)
            except urllib.error.HTTPError as exc:  # the server answered: do not retry
                detail = exc.read().decode(errors="replace")[:2000]
                raise SglangServerError(
                    f"SGLang server {self.url} answered {path} with HTTP {exc.code}: {detail or exc.reason}"
                ) from None
            except (
                urllib.error.URLError,
                http.client.HTTPException,
                ConnectionError,
                TimeoutError,
                OSError,
            ) as exc:
                last = exc
                dead = self._dead(method, path)
                if dead is not None:
                    raise dead from exc
                if attempt + 1 < attempts:
                    time.sleep(self.backoff_s * (2**attempt))
                continue
            text = body.decode(errors="replace")
            try:
                return json.loads(text) if text else None
            except json.JSONDecodeError:
                return text
        reason = getattr(last, "reason", last)
        raise SglangServerError(
            f"SGLang server {self.url} did not answer {method} {path} after {attempts} attempt(s): "
            f"{type(reason).__name__}: {reason}. Check that the server process is still alive (its log shows "
            f"why it died: CUDA out of memory, a crash while loading weights), that {self.url} is the right "
            "address (rollout.backend.urls), and that nothing between here and it blocks the port."
        ) from last

    # ----- endpoints --------------------------------------------------------------------------
    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            self.request("GET", "/health", timeout_s=timeout_s, retries=0)
            return True
        except SglangServerError:
            return False

    def wait_healthy(self, timeout_s: float = 300.0, poll_s: float = 1.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.health():
                return
            time.sleep(poll_s)
        raise SglangServerError(
            f"SGLang server {self.url} was not healthy (GET /health) within {timeout_s:.0f} s; "
            "check its log for the reason it did not start."
        )

    def get_model_info(self) -> dict:
        return self.request("GET", "/get_model_info")

    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: dict | list[dict],
        *,
        return_logprob: bool = True,
        lora_name: str | None = None,
    ) -> list[GenerateOutput]:
        """Continue each token-id sequence; ``n`` in ``sampling_params`` gives n outputs per input
        (input-major order: input ``i``'s outputs are ``i*n .. i*n+n-1``); ``lora_name``: a loaded adapter."""
        if not input_ids:
            return []
        payload = {
            "input_ids": [list(map(int, ids)) for ids in input_ids],
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
        }
        if lora_name is not None:
            payload["lora_path"] = lora_name  # SGLang's field takes a loaded adapter's name
        answer = self.request("POST", "/generate", payload)
        items = answer if isinstance(answer, list) else [answer]
        n = int((sampling_params[0] if isinstance(sampling_params, list) else sampling_params).get("n", 1))
        if len(items) != len(input_ids) * n:
            raise SglangServerError(
                f"SGLang server {self.url}: /generate returned {len(items)} outputs for "
                f"{len(input_ids)} inputs × n={n}."
            )
        return [parse_output(item) for item in items]

    def update_weights_from_disk(
        self, model_path: str, *, load_format: str | None = None, flush_cache: bool = True
    ) -> dict:
        answer = self.request(
            "POST",
            "/update_weights_from_disk",
            {"model_path": model_path, "load_format": load_format, "flush_cache": flush_cache},
        )
        if not isinstance(answer, dict) or not answer.get("success", False):
            raise SglangServerError(
                f"SGLang server {self.url} refused /update_weights_from_disk ({model_path}): {answer}"
            )
        return answer

    def update_weights_from_tensor(
        self, payloads: list[str], *, load_format: str | None = "flattened_bucket", flush_cache: bool = True
    ) -> dict:
        """Load weights from ``payloads`` (SGLang's serialized tensors, one per TP rank of the server)."""
        answer = self.request(
            "POST",
            "/update_weights_from_tensor",
            {"serialized_named_tensors": payloads, "load_format": load_format, "flush_cache": flush_cache},
        )
        if not isinstance(answer, dict) or not answer.get("success", False):
            raise SglangServerError(f"SGLang server {self.url} refused /update_weights_from_tensor: {answer}")
        return answer

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> Any:
        """Load a PEFT adapter folder under ``lora_name`` (the server runs with ``--enable-lora``)."""
        return self._lora_call("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    def unload_lora_adapter(self, lora_name: str) -> Any:
        return self._lora_call("/unload_lora_adapter", {"lora_name": lora_name})

    def _lora_call(self, path: str, payload: dict) -> Any:
        answer = self.request("POST", path, payload)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise SglangServerError(
                f"SGLang server {self.url} refused {path} {payload}: {answer.get('error_message')}"
                " (the server needs --enable-lora with a --max-lora-rank and "
                "--lora-target-modules that hold the adapter)"
            )
        return answer

    def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self.request("POST", "/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self.request("POST", "/resume_memory_occupation", {"tags": tags})

    def flush_cache(self) -> Any:
        return self.request("POST", "/flush_cache")
