"""The ``sglang`` rollout backend: rlkit's rollout contract over SGLang servers' HTTP API.

Constructed like every backend (``rlkit.rollout.base``); its parameters (``SglangParams``) sit
beside its name, ``rollout.backend: {name: sglang, ...}``:

- ``urls: [http://host:port, ...]`` — attach to running servers (one per replica); or
- ``launch: {num_replicas, tp_size, mem_fraction_static, dtype, extra_args}`` with ``model_path``
  (default: the module's ``name_or_path``) — start them (``rlkit_sglang.launch``, unverified on
  real SGLang);
- ``timeout_s`` (600), ``retries`` (3): per request; ``weights_dir``: where ``update_weights``
  writes the weights servers reload (default: a temporary folder).

``generate`` returns the same Batch layout as the HF backend; ``generate_ids`` is the one-turn
call the multi-turn agent loop drives (``rlkit.rollout.agent``). Prompts are spread over the
servers; each server gets one batched ``/generate``.

Shapes: ``B`` prompts, ``n`` samples per prompt, ``P`` prompt width, ``T`` response width.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from rlkit.batch import Batch
from rlkit.errors import RlkitError
from rlkit.recipe.schema import RolloutConfig
from rlkit.rollout.base import assemble_rollout
from rlkit_sglang.client import GenerateOutput, SglangClient
from rlkit_sglang.params import SglangParams

__all__ = ["SglangRollout"]


class SglangRollout:
    def __init__(self, *, module: nn.Module | None = None, tokenizer, rollout_config: RolloutConfig,
                 max_response_length: int, device: torch.device | str = "cpu", seed: int = 0,
                 eos_token_ids: list[int] | None = None, clients: list[SglangClient] | None = None,
                 params: SglangParams | None = None):
        self.module = module
        self.tokenizer = tokenizer
        self.config = rollout_config
        self.max_response_length = max_response_length
        self.seed = seed
        params = params if params is not None else SglangParams()
        self._handles: list[Any] = []
        if clients is None:
            urls = list(params.urls) or self._launch(params)
            clients = [SglangClient(u, timeout_s=params.timeout_s, retries=params.retries) for u in urls]
        self.clients = clients
        self._next = itertools.cycle(range(len(clients)))
        self.weights_dir = params.weights_dir
        ids = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
        self.stop_token_ids = sorted({i for i in ids if i is not None})
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_token_ids[0]

    def _launch(self, params: SglangParams) -> list[str]:
        from rlkit_sglang.launch import LaunchConfig, launch_servers

        model_path = params.model_path or getattr(getattr(self.module, "config", None), "name_or_path", None)
        if not model_path:
            raise RlkitError("rollout.backend=sglang needs rollout.backend.urls (running servers) or "
                             "rollout.backend.model_path (servers to launch, with rollout.backend.launch).")
        urls, self._handles = launch_servers(LaunchConfig(model_path=model_path, **params.launch.model_dump()))
        return urls

    # ----- sampling parameters ------------------------------------------------------------------
    def sampling_params(self, *, n: int = 1, temperature: float | None = None, top_p: float | None = None,
                        top_k: int | None = None, max_new_tokens: int | None = None, do_sample: bool | None = None,
                        stop: list[str] | None = None) -> dict:
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
    def generate(self, prompts: Batch, *, n: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, max_new_tokens: int | None = None,
                 do_sample: bool | None = None, stop: list[str] | None = None) -> Batch:
        n = self.config.n if n is None else n
        params = self.sampling_params(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                      max_new_tokens=max_new_tokens, do_sample=do_sample, stop=stop)
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
        meta = {"temperature": params["temperature"] if sampled else 1.0, "do_sample": sampled}
        return assemble_rollout(ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0), responses,
                                response_mask, log_probs, meta)

    def _generate_rows(self, rows: list[list[int]], params: dict) -> list[GenerateOutput]:
        """Spread rows over the servers (contiguous chunks), one batched request each, in order."""
        k = len(self.clients)
        chunks = [rows[i * len(rows) // k:(i + 1) * len(rows) // k] for i in range(k)]
        with ThreadPoolExecutor(max_workers=k) as pool:
            parts = list(pool.map(lambda ci: self.clients[ci[0]].generate(ci[1], params) if ci[1] else [],
                                  enumerate(chunks)))
        return [o for part in parts for o in part]

    # ----- one turn, for the agent loop -----------------------------------------------------------
    async def generate_ids(self, prompt_ids: list[int], sampling: dict) -> tuple[list[int], list[float], str]:
        """Continue one token sequence: ``(token_ids, logprobs, finish_reason)``; ``sampling`` holds
        rlkit's keywords (temperature, top_p, top_k, max_new_tokens, do_sample, stop)."""
        params = self.sampling_params(n=1, **sampling)
        client = self.clients[next(self._next)]
        out = (await asyncio.to_thread(client.generate, [prompt_ids], params))[0]
        return out.token_ids, out.logprobs or [0.0] * len(out.token_ids), out.finish_reason

    # ----- weights and memory --------------------------------------------------------------------
    def update_weights(self, weights: nn.Module | dict[str, torch.Tensor]) -> None:
        """Write the weights as an HF folder and have every server reload it (/update_weights_from_disk)."""
        module = weights if isinstance(weights, nn.Module) else self.module
        if module is None or not hasattr(module, "save_pretrained"):
            raise RlkitError("sglang backend: update_weights needs the actor's HF module (to write its config "
                             "beside the weights); construct the backend with module=...")
        state = weights if isinstance(weights, dict) else _full_state_dict(module)
        folder = self.weights_dir or tempfile.mkdtemp(prefix="rlkit-sglang-weights-")
        os.makedirs(folder, exist_ok=True)
        module.save_pretrained(folder, state_dict={k: v.detach().cpu() for k, v in state.items()})
        for client in self.clients:
            client.update_weights_from_disk(folder)

    def release_memory(self) -> None:
        """Before training (colocated hybrid engine): free the servers' GPU memory."""
        for client in self.clients:
            client.release_memory_occupation()

    def resume_memory(self) -> None:
        """After training: take the memory back (then update_weights)."""
        for client in self.clients:
            client.resume_memory_occupation()

    def flush_cache(self) -> None:
        for client in self.clients:
            client.flush_cache()

    def shutdown(self) -> None:
        """Stop the servers this backend launched (attached servers are left running)."""
        for handle in self._handles:
            if hasattr(handle.stop, "remote"):  # a Ray actor
                import ray

                ray.get(handle.stop.remote())
            else:
                handle.stop()
        self._handles = []


def _full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return module.state_dict()
