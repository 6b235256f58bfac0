"""``rlkit serve MODEL``: a CPU HTTP server that speaks the subset of SGLang's native API rlkit uses.

Backed by the HF rollout backend (``rlkit.rollout.hf.HFRollout``), so the ``sglang`` rollout backend
(``plugins/rlkit-sglang``) can be tested and debugged on a laptop. Endpoints (fields as SGLang 0.5;
``rlkit_sglang.client`` documents them):

=================================  =========================================================
``POST /generate``                 ``input_ids`` (one list or a list of lists) or ``text``;
                                   ``sampling_params`` (dict or one per input): temperature,
                                   top_p, top_k (-1 off), max_new_tokens, stop, stop_token_ids,
                                   n; ``return_logprob``
``POST /update_weights_from_disk`` ``model_path``: load that HF folder's weights in place
``POST /release_memory_occupation`` accepted; marks the server released (nothing is freed on
``POST /resume_memory_occupation``  CPU); ``/generate`` is refused until resumed
``GET|POST /flush_cache``          accepted (no prefix cache here)
``GET /health``, ``/get_model_info``
``POST /inference/v1/generate``    vLLM's token-in API (verifiers' ``renderers`` client):
                                   ``token_ids`` in; completion ``token_ids``, finish_reason
                                   and one log-prob per token out (``rlkit.rollout.token_in``)
``GET /v1/models``                 the served model's id (the MODEL argument) and max_model_len
=================================  =========================================================

Requests are served one at a time (a lock around the model); inputs of one request that share sampling
parameters are generated as one batch. Not a production server, and bounded as one would not be: ``n`` and
``max_new_tokens`` (token-in: ``max_tokens``) over the server's limits (``--max-n``, ``--max-new-tokens``) get
HTTP 400 naming the limit; weights load only from local folders holding ``*.safetensors`` (no pickle files, no
hub ids), at start and in ``/update_weights_from_disk``; ``rlkit serve`` binds a non-loopback address only
with ``--allow-remote`` (the API has no authentication: anyone who reaches the port can load weights).
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from rlkit.errors import RlkitError
from rlkit.rollout.token_in import ConcurrentHTTPServer

__all__ = [
    "MAX_N",
    "MAX_NEW_TOKENS",
    "ProtocolModel",
    "ServeError",
    "check_host",
    "make_server",
    "serve",
    "weights_folder",
]

MAX_N = 64  # default bound of sampling_params.n
MAX_NEW_TOKENS = 4096  # default bound of sampling_params.max_new_tokens


class RequestError(ValueError):
    """A request the server refuses (HTTP 400)."""


class ServeError(RlkitError):
    """The server cannot start as asked (a remote bind without --allow-remote, weights not in a folder)."""


def weights_folder(path: str, error: type[Exception] = ServeError) -> str:
    """``path`` (or the bundled model it names) as a local folder holding ``*.safetensors``; else raises
    ``error``."""
    from rlkit.model.load import resolve_model_path

    try:
        folder = Path(resolve_model_path(path))
    except RlkitError as exc:
        raise error(str(exc)) from exc
    if not folder.is_dir():
        raise error(
            f"model {path!r}: not a local folder. rlkit serve loads weights only from a model folder "
            "holding *.safetensors (download it first, e.g. `huggingface-cli download NAME "
            "--local-dir DIR`)."
        )
    if not any(folder.glob("*.safetensors")):
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
        found = (
            f" (it holds {', '.join(pickles)}: pickle files, which can run code when loaded)"
            if pickles
            else ""
        )
        raise error(
            f"model folder {folder} has no *.safetensors weights{found}. Save the model with "
            "save_pretrained(..., safe_serialization=True)."
        )
    return str(folder)


def check_host(host: str, allow_remote: bool) -> None:
    """Refuse a non-loopback bind address unless ``allow_remote``: the server has no authentication."""
    if allow_remote:
        return
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError as exc:
        raise ServeError(f"--host {host}: cannot resolve it ({exc.strerror}).") from exc
    if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        shown = ", ".join(sorted(addresses))
        raise ServeError(
            f"--host {host} is not a loopback address ({shown}): the server has no "
            "authentication, and anyone who reaches it can generate and load weights. Bind "
            "127.0.0.1 (the default), or add --allow-remote to serve other hosts on purpose."
        )


class ProtocolModel:
    """The model behind the server: an HF causal LM, its tokenizer and an ``HFRollout``."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        eos_token: str | None = None,
        max_n: int = MAX_N,
        max_new_tokens: int = MAX_NEW_TOKENS,
    ):
        import torch

        from rlkit.model.load import load_model, load_tokenizer
        from rlkit.recipe.schema import ModelConfig, RolloutConfig
        from rlkit.rollout.hf import HFRollout

        if max_n < 1 or max_new_tokens < 1:
            raise ServeError(f"--max-n ({max_n}) and --max-new-tokens ({max_new_tokens}) must be >= 1.")
        self.max_n, self.max_new_tokens = max_n, max_new_tokens
        self.served_model_name = model_path  # as given, like vLLM's default --served-model-name
        model_path = weights_folder(model_path)
        self.model_config = ModelConfig(path=model_path, dtype=dtype, eos_token=eos_token)
        self.model_path = model_path
        self.tokenizer = load_tokenizer(self.model_config)
        module = load_model(self.model_config, tokenizer=self.tokenizer)
        self.rollout = HFRollout(
            module=module,
            tokenizer=self.tokenizer,
            rollout_config=RolloutConfig(),
            max_response_length=16,
            device="cpu",
            seed=seed,
        )
        self._base_eos = self.rollout.eos_token_ids
        self.max_model_len = int(
            getattr(module.config, "max_position_embeddings", None) or self.tokenizer.model_max_length
        )
        self._torch = torch
        self.lock = threading.Lock()
        self.released = False
        self.weight_version = 0

    # ----- /generate --------------------------------------------------------------------------
    def generate(self, body: dict) -> Any:
        inputs, single = self._inputs(body)
        params = body.get("sampling_params") or {}
        per_input = params if isinstance(params, list) else [params] * len(inputs)
        if len(per_input) != len(inputs):
            raise RequestError(f"sampling_params has {len(per_input)} entries for {len(inputs)} inputs")
        return_logprob = body.get("return_logprob") or False
        if isinstance(return_logprob, list):
            return_logprob = any(return_logprob)
        outputs: list[list[dict]] = [[] for _ in inputs]
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(per_input):
            groups.setdefault(json.dumps(p, sort_keys=True), []).append(i)
        with self.lock:
            self._refuse_if_released()
            for rows in groups.values():
                for i, out in zip(
                    rows,
                    self._generate_group([inputs[i] for i in rows], per_input[rows[0]], bool(return_logprob)),
                ):
                    outputs[i] = out
        flat = [o for per in outputs for o in per]
        return flat[0] if single and len(flat) == 1 else flat

    # ----- /inference/v1/generate, /v1/models (vLLM's token-in API) ---------------------------
    def generate_token_in(self, body: dict) -> dict:
        from rlkit.rollout.token_in import generate_response, parse_generate_request

        request = parse_generate_request(
            body,
            served_model=self.served_model_name,
            vocab_size=self.rollout.module.config.vocab_size,
            max_model_len=self.max_model_len,
            max_n=self.max_n,
            max_new_tokens=self.max_new_tokens,
        )
        with self.lock:
            self._refuse_if_released()
            (outputs,) = self._generate_group([request.prompt_ids], request.sglang_sampling(), True)
        completions = [
            (
                out["output_ids"],
                [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
                out["meta_info"]["finish_reason"]["type"],
            )
            for out in outputs
        ]
        return generate_response(request, completions)

    def models(self) -> dict:
        from rlkit.rollout.token_in import models_response

        return models_response(self.served_model_name, self.max_model_len)

    def _refuse_if_released(self) -> None:
        if self.released:
            raise RequestError(
                "memory is released (POST /release_memory_occupation); "
                "POST /resume_memory_occupation before generating"
            )

    def _inputs(self, body: dict) -> tuple[list[list[int]], bool]:
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
        elif body.get("text") is not None:
            text = body["text"]
            ids = [self.tokenizer(t)["input_ids"] for t in ([text] if isinstance(text, str) else text)]
        else:
            raise RequestError("give input_ids or text")
        single = bool(ids) and all(isinstance(t, int) for t in ids)
        ids = [ids] if single else ids
        if not ids or not all(
            isinstance(seq, list) and seq and all(isinstance(t, int) for t in seq) for seq in ids
        ):
            raise RequestError("input_ids must be a non-empty list of token ids, or a list of such lists")
        vocab = self.rollout.module.config.vocab_size
        if any(t < 0 or t >= vocab for seq in ids for t in seq):
            raise RequestError(f"input_ids has a token id outside [0, {vocab})")
        return ids, single

    def _generate_group(self, inputs: list[list[int]], p: dict, return_logprob: bool) -> list[list[dict]]:
        torch = self._torch
        from rlkit.batch import Batch

        n, max_new, temperature, top_k, stop = self._sampling_params(p)
        width = max(len(s) for s in inputs)
        pad = self.rollout.pad_token_id
        ids = torch.tensor([[pad] * (width - len(s)) + s for s in inputs])  # [B, P] left-padded
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in inputs])
        extra = [int(t) for t in p.get("stop_token_ids") or []]
        base = self._base_eos[:0] if p.get("ignore_eos") else self._base_eos
        self.rollout.eos_token_ids = torch.unique(torch.cat([base, torch.tensor(extra, dtype=torch.long)]))
        try:
            out = self.rollout.generate(
                Batch({"input_ids": ids, "attention_mask": mask}),
                n=n,
                temperature=temperature,
                top_p=float(p.get("top_p", 1.0)),
                top_k=max(top_k, 0),
                max_new_tokens=max_new,
                do_sample=temperature > 0,
                stop=stop,
            )
        finally:
            self.rollout.eos_token_ids = self._base_eos
        eos = set(extra) if p.get("ignore_eos") else set(self._base_eos.tolist()) | set(extra)
        results: list[list[dict]] = [[] for _ in inputs]
        for r in range(len(out)):
            length = int(out["response_mask"][r].sum())
            tokens = out["responses"][r, :length].tolist()
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            meta = {
                "id": uuid.uuid4().hex,
                "finish_reason": _finish_reason(tokens, text, eos, stop, max_new),
                "prompt_tokens": len(inputs[r // n]),
                "completion_tokens": length,
                "cached_tokens": 0,
                "weight_version": str(self.weight_version),
            }
            if return_logprob:
                logps = out["rollout_log_probs"][r, :length].tolist()
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logps, tokens)]
            results[r // n].append({"text": text, "output_ids": tokens, "meta_info": meta})
        return results

    def _sampling_params(self, p: dict) -> tuple[int, int, float, int, list[str]]:
        """``(n, max_new_tokens, temperature, top_k, stop strings)`` of a request's ``sampling_params``,
        within this server's limits (a RequestError names the limit and the ``rlkit serve`` flag)."""
        n = int(p.get("n", 1))
        max_new = int(p.get("max_new_tokens", 128))
        stop = p.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        if n < 1 or max_new < 1:
            raise RequestError("n and max_new_tokens must be >= 1")
        if n > self.max_n:
            raise RequestError(f"n={n} is over this server's limit of {self.max_n} (rlkit serve --max-n)")
        if max_new > self.max_new_tokens:
            raise RequestError(
                f"max_new_tokens={max_new} is over this server's limit of "
                f"{self.max_new_tokens} (rlkit serve --max-new-tokens)"
            )
        return n, max_new, float(p.get("temperature", 1.0)), int(p.get("top_k", -1)), stop

    # ----- weights and memory -----------------------------------------------------------------
    def update_weights_from_disk(self, body: dict) -> dict:
        from rlkit.model.load import load_model

        path = body.get("model_path")
        if not path:
            raise RequestError("model_path is required")
        path = weights_folder(str(path), RequestError)
        cfg = self.model_config.model_copy(update={"path": path, "tokenizer_path": None})
        new = load_model(cfg, tokenizer=self.tokenizer)
        with self.lock:
            self.rollout.module.load_state_dict(new.state_dict(), strict=True)
            self.weight_version += 1
            self.model_path = path
        return {
            "success": True,
            "message": f"Succeeded to update model weights from {path}.",
            "num_paused_requests": 0,
        }

    def set_released(self, released: bool) -> dict:
        with self.lock:
            self.released = released
        return {"success": True, "message": "released" if released else "resumed"}

    def model_info(self) -> dict:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "weight_version": str(self.weight_version),
        }


def _finish_reason(tokens: list[int], text: str, eos: set[int], stop: list[str], max_new: int) -> dict:
    """SGLang's ``finish_reason`` of one completion: ``stop`` (an eos token, with it as ``matched``; a stop
    string, or none where the completion ended early otherwise) or ``length`` (it used ``max_new`` tokens)."""
    if tokens and tokens[-1] in eos:
        return {"type": "stop", "matched": tokens[-1]}
    if len(tokens) < max_new or any(s in text for s in stop):
        return {"type": "stop", "matched": next((s for s in stop if s in text), None)}
    return {"type": "length", "length": len(tokens)}


def _handler(model: ProtocolModel, verbose: bool) -> type[BaseHTTPRequestHandler]:
    routes_post = {
        "/generate": model.generate,
        "/update_weights_from_disk": model.update_weights_from_disk,
        "/release_memory_occupation": lambda body: model.set_released(True),
        "/resume_memory_occupation": lambda body: model.set_released(False),
        "/flush_cache": lambda body: "Cache flushed.",
        "/health": lambda body: "",
        "/get_model_info": lambda body: model.model_info(),
        "/inference/v1/generate": model.generate_token_in,
        "/v1/models": lambda body: model.models(),
    }
    routes_get = {"/health", "/flush_cache", "/get_model_info", "/health_generate", "/v1/models"}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            if verbose:
                super().log_message(fmt, *args)

        def _send(self, code: int, payload: Any) -> None:
            body = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _dispatch(self, path: str, body: dict) -> None:
            try:
                if path == "/health_generate":
                    path, body = "/generate", {"input_ids": [0], "sampling_params": {"max_new_tokens": 1}}
                self._send(200, routes_post[path](body))
            except KeyError:
                self._send(404, {"error": {"message": f"no route {path}"}})
            except (RequestError, ValueError, TypeError) as exc:
                self._send(400, {"error": {"message": str(exc)}})
            except Exception as exc:  # the server keeps serving; the client sees why
                self._send(500, {"error": {"message": f"{type(exc).__name__}: {exc}"}})

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?")[0]
            if path not in routes_get:
                self._send(404, {"error": {"message": f"no GET route {path}"}})
                return
            self._dispatch(path, {})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
            except json.JSONDecodeError as exc:
                self._send(400, {"error": {"message": f"body is not JSON: {exc}"}})
                return
            self._dispatch(self.path.split("?")[0], body if isinstance(body, dict) else {})

    return Handler


def make_server(
    model: ProtocolModel, host: str = "127.0.0.1", port: int = 30000, *, verbose: bool = False
) -> ConcurrentHTTPServer:
    """A ready server (not yet serving); ``port=0`` picks a free port (``server.server_address``)."""
    return ConcurrentHTTPServer((host, port), _handler(model, verbose))


def serve(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    dtype: str = "float32",
    seed: int = 0,
    eos_token: str | None = None,
    verbose: bool = False,
    max_n: int = MAX_N,
    max_new_tokens: int = MAX_NEW_TOKENS,
    allow_remote: bool = False,
) -> None:
    """Load the model and serve until interrupted; prints the URL once it accepts requests."""
    check_host(host, allow_remote)
    start = time.perf_counter()
    model = ProtocolModel(
        model_path, dtype=dtype, seed=seed, eos_token=eos_token, max_n=max_n, max_new_tokens=max_new_tokens
    )
    server = make_server(model, host, port, verbose=verbose)
    bound_host, bound_port = server.server_address[:2]
    print(
        f"rlkit serve: {model_path} loaded in {time.perf_counter() - start:.1f} s; "
        f"listening on http://{bound_host}:{bound_port}",
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()
