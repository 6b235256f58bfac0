"""The ``sglang`` rollout backend: rlkit's rollout contract over SGLang servers' HTTP API.

Constructed like every backend (``rlkit.rollout.base``); its parameters (``SglangParams``) sit
beside its name, ``rollout.backend: {name: sglang, ...}``:

- ``urls: [http://host:port, ...]`` — attach to running servers (one per replica); or
- ``launch: {python, device, num_replicas, threads, ...}`` with ``model_path`` (default: the module's
  ``name_or_path``) — start them on this node (``rlkit_sglang.launch``; ``python`` is the SGLang
  venv's interpreter, ``device: auto`` the worker's device, CPU flags on CPU);
- ``memory_release`` (None = decided at start): ``release_memory``/``resume_memory`` reach the servers
  only when every server runs on CUDA with the memory saver (what launched servers were given, what
  attached ones report in ``/server_info``); otherwise they are no-ops, said once in the log. Asking
  for it where a server cannot (CPU) is an error at validation (``launch.device: cpu``) or at start;
- ``timeout_s`` (600), ``retries`` (3): per request;
- ``weight_sync`` (``auto``: ``tensor`` for launched servers, ``disk`` for attached ones): how
  ``update_weights`` reaches the servers, with no files left behind (``rlkit_sglang.sync``): in memory
  through ``/update_weights_from_tensor`` (a shared-memory buffer per GiB, same host), or through one
  folder per run under ``weights_dir`` (default: the temp dir), rewritten in place, removed at exit.

Launched servers are watched: a request in flight to a server whose process died raises
``SglangServerError`` at once. ``shutdown()`` (also at garbage collection or exit) ends their process
groups.

LoRA (``actor.lora``; the module carries a PEFT adapter), ``lora_mode``:

- ``adapter`` (servers on CUDA, or attached servers that report ``enable_lora``): the servers serve the
  base model with ``--enable-lora`` (launched ones get it, with the adapter's rank and target modules); at
  start and after each update the adapter alone is written as a PEFT folder (``weights_dir/adapter-v<k>``)
  and loaded under a new name (``/load_lora_adapter``, the previous one unloaded), which every
  ``/generate`` names (``lora_path``). Only the adapter's tensors travel. Not verified here (no GPU).
- ``merged`` (servers on CPU, or attached ones without LoRA): SGLang 0.5.15's LoRA layers allocate
  pinned memory, which needs a CUDA driver (the server dies at start: docs/sglang.md), so the actor
  merges (``W + scale · B A``, ``rlkit.model.lora.merged_state_dict``) and pushes full weights through
  the weight sync (``weight_sync``), at start and after each update; said once in the log.

``rollout/weight_sync_bytes``: the tensor bytes the last sync moved (either mode, and without LoRA).

``generate`` returns the same Batch layout as the HF backend; ``generate_ids`` is the one-turn
call the multi-turn agent loop drives (``rlkit.rollout.agent``). Prompts are spread over the
servers; each server gets one batched ``/generate``.

Shapes: ``B`` prompts, ``n`` samples per prompt, ``P`` prompt width, ``T`` response width.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from rlkit.batch import Batch
from rlkit.errors import RlkitError
from rlkit.model.lora import (
    adapter_state_dict,
    lora_config_of,
    merged_state_dict,
    state_bytes,
    write_adapter_folder,
)
from rlkit.recipe.schema import RolloutConfig
from rlkit.rollout.base import assemble_rollout
from rlkit_sglang.client import GenerateOutput, SglangClient, SglangServerError
from rlkit_sglang.params import CPU_MEMORY_RELEASE, MEMORY_RELEASE_FIX, SglangParams, memory_release_problem
from rlkit_sglang.sync import RunFolder, buckets, flattened_bucket_payload

__all__ = ["SglangRollout"]

log = logging.getLogger("rlkit.sglang")

# Why a CPU server gets merged weights instead of adapters (log line, docs/sglang.md).
CPU_LORA = (
    "SGLang 0.5.15's LoRA layers pin host memory (torch.tensor(..., pin_memory=True) in sglang/srt/lora/"
    "layers.py), which needs a CUDA driver: a CPU server started with --enable-lora dies at start"
)


class SglangRollout:
    def __init__(
        self,
        *,
        module: nn.Module | None = None,
        tokenizer,
        rollout_config: RolloutConfig,
        max_response_length: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
        eos_token_ids: list[int] | None = None,
        clients: list[SglangClient] | None = None,
        params: SglangParams | None = None,
    ):
        self.module = module
        self.lora = lora_config_of(module) if module is not None else None  # the actor's peft.LoraConfig
        # adapter | merged (decided at start)
        self.lora_mode: str | None = "merged" if self.lora is not None else None
        self.lora_name: str | None = None  # the servers' current adapter (lora_mode adapter)
        self._no_lora_why = "the backend was given clients, not servers it could ask"
        self.lora_version = 0
        self.sync_bytes = 0  # tensor bytes the last sync moved (metric rollout/weight_sync_bytes)
        self.tokenizer = tokenizer
        self.config = rollout_config
        self.max_response_length = max_response_length
        self.seed = seed
        params = params if params is not None else SglangParams()
        self._servers: list[Any] = []
        self._finalizer = None
        self.weights_dir = params.weights_dir
        self.folder = RunFolder(params.weights_dir)  # the run's one weights folder (disk sync, adapters)
        self.weight_sync = (
            params.weight_sync
            if params.weight_sync != "auto"
            else ("disk" if params.urls or clients is not None else "tensor")
        )
        self.tp_size = 1 if params.urls or clients is not None else params.launch.tp_size
        if clients is None:
            clients = self._attach(params) if params.urls else self._launch(params, torch.device(device).type)
        else:
            self.memory_release = bool(params.memory_release)
        self.clients = clients
        self._next = itertools.cycle(range(len(clients)))
        if self.lora_mode == "adapter":
            self._load_adapter(adapter_state_dict(module))
            log.info(
                "sglang: LoRA rank %d through SGLang's own LoRA loading (/load_lora_adapter): each sync "
                "moves the adapter alone (%d bytes)",
                self.lora.r,
                self.sync_bytes,
            )
        elif self.lora_mode == "merged":
            # the servers loaded the base; the adapter may not be the identity (resume)
            self.update_weights(module)
            log.warning(
                "sglang: LoRA rank %d with merged weights: these servers cannot load adapters (%s); each "
                "sync pushes W + scale * B A in full (%d bytes)",
                self.lora.r,
                self._no_lora_why,
                self.sync_bytes,
            )
        ids = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
        self.stop_token_ids = sorted({i for i in ids if i is not None})
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_token_ids[0]
        )

    def _launch(self, params: SglangParams, worker_device: str) -> list[SglangClient]:
        """Start the servers on ``launch.device`` (auto: the worker's); decide memory release."""
        from rlkit_sglang.launch import launch_servers

        model_path = params.model_path or getattr(getattr(self.module, "config", None), "name_or_path", None)
        if not model_path:
            raise RlkitError(
                "rollout.backend=sglang needs rollout.backend.urls (running servers) or "
                "rollout.backend.model_path (servers to launch, with rollout.backend.launch)."
            )
        launch = params.launch
        device = launch.device if launch.device != "auto" else ("cuda" if worker_device == "cuda" else "cpu")
        saver = launch.enable_memory_saver if device == "cuda" else False
        if device == "cpu" and launch.enable_memory_saver:
            raise RlkitError(
                f"rollout.backend.launch.enable_memory_saver=true, but the servers run on cpu (the "
                f"worker's device): {CPU_MEMORY_RELEASE}. Remove enable_memory_saver."
            )
        self._decide_memory_release(
            params.memory_release, [(device, saver if saver is not None else True)], "rollout.backend.launch"
        )
        lora = None
        if self.lora is not None and device == "cpu":
            self._no_lora_why = CPU_LORA
        elif self.lora is not None:
            self.lora_mode, lora = "adapter", (self.lora.r, sorted(self.lora.target_modules))
        folders = (self.folder.create(),) if self.weight_sync == "disk" or lora is not None else ()
        self._servers = launch_servers(launch, model_path, device, lora, remove=folders)
        self._finalizer = weakref.finalize(self, _stop_all, list(self._servers))  # at GC or exit
        log.info(
            "sglang: %d server(s) of %s on %s: %s (logs: %s)",
            len(self._servers),
            model_path,
            device,
            [s.url for s in self._servers],
            [s.log_path for s in self._servers],
        )
        return [
            SglangClient(s.url, timeout_s=params.timeout_s, retries=params.retries, watch=s.problem)
            for s in self._servers
        ]

    def _attach(self, params: SglangParams) -> list[SglangClient]:
        """Clients of running servers; what they report (``/get_server_info``) decides memory release."""
        clients = [SglangClient(u, timeout_s=params.timeout_s, retries=params.retries) for u in params.urls]
        reports = [_server_memory_report(c) for c in clients]
        self._decide_memory_release(params.memory_release, reports, "rollout.backend.urls")
        if self.lora is not None:
            if all(report[2] for report in reports):
                self.lora_mode = "adapter"
            else:
                self._no_lora_why = (
                    "a server at rollout.backend.urls does not report enable_lora (start it with "
                    "--enable-lora)"
                )
        return clients

    def _decide_memory_release(
        self, asked: bool | None, reports: list[tuple[str | None, bool | None]], where: str
    ) -> None:
        """``reports``: ``(device, memory saver on)`` per server, None where unknown. Sets
        ``memory_release``."""
        problems = [p for device, saver, *_ in reports if (p := memory_release_problem(device or "", saver))]
        if asked and problems:
            raise RlkitError(
                f"rollout.backend.memory_release=true, but a server cannot release its memory "
                f"({where}): {problems[0]}. {MEMORY_RELEASE_FIX}"
            )
        known = all(device == "cuda" and saver for device, saver, *_ in reports)
        self.memory_release = bool(asked) or (asked is None and known)
        if self.memory_release:
            log.info(
                "sglang: memory release on (/release_memory_occupation after generation, "
                "/resume_memory_occupation before the weight sync)"
            )
        else:
            why = (
                problems[0]
                if problems
                else (
                    "turned off (rollout.backend.memory_release=false)"
                    if asked is False
                    else "the servers do not report a CUDA device with the memory saver on"
                )
            )
            log.warning("sglang: memory release off, the servers keep their memory during training: %s", why)

    # ----- sampling parameters ------------------------------------------------------------------
    def sampling_params(
        self,
        *,
        n: int = 1,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        stop: list[str] | None = None,
    ) -> dict:
        """SGLang ``sampling_params`` from rlkit's arguments (None → the rollout config)."""
        cfg = self.config
        temperature = cfg.temperature if temperature is None else temperature
        do_sample = (temperature > 0) if do_sample is None else do_sample
        top_k = cfg.top_k if top_k is None else top_k
        return {
            "n": int(n),
            "temperature": float(temperature) if do_sample else 0.0,
            "top_p": float(cfg.top_p if top_p is None else top_p),
            "top_k": int(top_k) if top_k and top_k > 0 else -1,
            "max_new_tokens": int(self.max_response_length if max_new_tokens is None else max_new_tokens),
            "stop": list(cfg.stop if stop is None else stop),
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }

    # ----- batch generation ---------------------------------------------------------------------
    def generate(
        self,
        prompts: Batch,
        *,
        n: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        stop: list[str] | None = None,
    ) -> Batch:
        n = self.config.n if n is None else n
        params = self.sampling_params(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            stop=stop,
        )
        ids, mask = prompts["input_ids"], prompts["attention_mask"].long()  # [B, P]
        rows = [ids[i][mask[i].bool()].tolist() for i in range(ids.shape[0])]
        outputs = self._generate_rows(rows, params)  # B * n, input-major
        width = params["max_new_tokens"]
        total = len(outputs)
        responses = torch.full((total, width), self.pad_token_id, dtype=torch.long)  # [B*n, T]
        response_mask = torch.zeros((total, width), dtype=torch.long)
        log_probs = torch.zeros((total, width), dtype=torch.float32)
        for r, out in enumerate(outputs):
            length = min(len(out.token_ids), width)
            responses[r, :length] = torch.tensor(out.token_ids[:length], dtype=torch.long)
            response_mask[r, :length] = 1
            if out.logprobs:
                log_probs[r, :length] = torch.tensor(out.logprobs[:length], dtype=torch.float32)
        sampled = params["temperature"] > 0
        meta = {
            "temperature": params["temperature"] if sampled else 1.0,
            "do_sample": sampled,
            "metrics": {"rollout/weight_sync_bytes": float(self.sync_bytes)},
        }
        return assemble_rollout(
            ids.repeat_interleave(n, dim=0),
            mask.repeat_interleave(n, dim=0),
            responses,
            response_mask,
            log_probs,
            meta,
        )

    def _generate_rows(self, rows: list[list[int]], params: dict) -> list[GenerateOutput]:
        """Spread rows over the servers (contiguous chunks), one batched request each, in order."""
        k = len(self.clients)
        chunks = [rows[i * len(rows) // k : (i + 1) * len(rows) // k] for i in range(k)]
        with ThreadPoolExecutor(max_workers=k) as pool:
            parts = list(
                pool.map(
                    lambda ci: (
                        self.clients[ci[0]].generate(ci[1], params, lora_name=self.lora_name) if ci[1] else []
                    ),
                    enumerate(chunks),
                )
            )
        return [o for part in parts for o in part]

    # ----- one turn, for the agent loop -----------------------------------------------------------
    async def generate_ids(self, prompt_ids: list[int], sampling: dict) -> tuple[list[int], list[float], str]:
        """Continue one token sequence: ``(token_ids, logprobs, finish_reason)``; ``sampling`` holds
        rlkit's keywords (temperature, top_p, top_k, max_new_tokens, do_sample, stop)."""
        params = self.sampling_params(n=1, **sampling)
        client = self.clients[next(self._next)]
        out = (await asyncio.to_thread(client.generate, [prompt_ids], params, lora_name=self.lora_name))[0]
        return out.token_ids, out.logprobs or [0.0] * len(out.token_ids), out.finish_reason

    # ----- weights and memory --------------------------------------------------------------------
    def update_weights(self, weights: nn.Module | dict[str, torch.Tensor]) -> None:
        """Push the weights into every server: in memory (``weight_sync: tensor``) or through the run's folder
        (``disk``); with LoRA, the module's adapter (or an adapter-only state dict) becomes the servers' new
        adapter."""
        module = weights if isinstance(weights, nn.Module) else self.module
        if self.lora_mode == "adapter":
            self._load_adapter(weights if isinstance(weights, dict) else adapter_state_dict(module))
            return
        if module is None or not hasattr(module, "save_pretrained"):
            raise RlkitError(
                "sglang backend: update_weights needs the actor's HF module (to write its config "
                "beside the weights); construct the backend with module=..."
            )
        state = weights if isinstance(weights, dict) else _full_state_dict(module)
        if self.lora_mode == "merged":  # an adapter-only dict lands on the module's own base
            state = merged_state_dict(
                {**(_full_state_dict(module) if isinstance(weights, dict) else {}), **state}, self.lora
            )
        self.sync_bytes = state_bytes(state)
        if self.weight_sync == "tensor":
            self._push_tensors(_tied_dropped(module, state))
            return
        folder = self.folder.create()  # the same folder every sync: save_pretrained rewrites it in place
        module.save_pretrained(folder, state_dict={k: v.detach().cpu() for k, v in state.items()})
        for client in self.clients:
            client.update_weights_from_disk(folder)

    def _push_tensors(self, state: dict[str, torch.Tensor]) -> None:
        """``/update_weights_from_tensor`` per bucket of ``state``, the cache flushed after the last one;
        each bucket's shared-memory buffer is dropped (the segment unlinked) once every server answered."""
        groups = buckets(list(state.items()))
        for i, group in enumerate(groups):
            payload, buffer = flattened_bucket_payload(group)
            try:
                for client in self.clients:
                    client.update_weights_from_tensor(
                        [payload] * self.tp_size, flush_cache=i == len(groups) - 1
                    )
            finally:
                del buffer

    def _load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        """Write the adapter tensors of ``state`` as a PEFT folder; every server loads it under a new name,
        then drops the previous adapter."""
        from pathlib import Path

        self.lora_version += 1
        root = Path(self.folder.create())
        folder = root / f"adapter-v{self.lora_version}"
        self.sync_bytes = write_adapter_folder(folder, state, self.lora)
        name, previous = f"rlkit-actor-v{self.lora_version}", self.lora_name
        for client in self.clients:
            client.load_lora_adapter(name, str(folder))
        self.lora_name = name
        if previous is not None:
            for client in self.clients:
                client.unload_lora_adapter(previous)
            shutil.rmtree(root / f"adapter-v{self.lora_version - 1}", ignore_errors=True)

    def release_memory(self) -> None:
        """Before training (colocated hybrid engine): free the servers' GPU memory. A no-op when memory
        release is off (``memory_release``, decided at start: never on CPU, where the call kills the
        server)."""
        if self.memory_release:
            for client in self.clients:
                client.release_memory_occupation()

    def resume_memory(self) -> None:
        """After training: take the memory back (then update_weights). A no-op when memory release is off."""
        if self.memory_release:
            for client in self.clients:
                client.resume_memory_occupation()

    def flush_cache(self) -> None:
        for client in self.clients:
            client.flush_cache()

    def shutdown(self) -> None:
        """Stop the servers this backend launched, by process group (attached servers are left running), and
        remove the run's weights folder."""
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_all once
        self._servers = []
        self.folder.remove()


def _stop_all(servers: list) -> None:
    for server in servers:
        server.stop()


def _server_memory_report(client: SglangClient) -> tuple[str | None, bool | None, bool]:
    """``(device, enable_memory_saver, enable_lora)`` from SGLang's ``GET /server_info`` (its server args;
    before 0.5.x ``/get_server_info``); None for what the server does not report (``rlkit serve``)."""
    info = None
    for path in ("/server_info", "/get_server_info"):
        try:
            info = client.request("GET", path, timeout_s=30)
            break
        except SglangServerError as exc:
            if "HTTP 404" not in str(exc):
                raise
    if not isinstance(info, dict):
        return None, None, False
    saver = info.get("enable_memory_saver")
    return info.get("device"), (bool(saver) if saver is not None else None), bool(info.get("enable_lora"))


def _tied_dropped(module: nn.Module | None, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the output embedding when the model ties it to the input one (what save_pretrained
    leaves out too: the server's model has one tensor for both)."""
    config = getattr(module, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        return {k: v for k, v in state.items() if k != "lm_head.weight"}
    return state


def _full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return module.state_dict()
