"""What an agent loop needs from a backend, one turn at a time: ``TurnGenerator`` (``await
generate_ids(prompt_ids, sampling) -> (ids, logprobs, finish_reason)``), and ``HFTurnGenerator``, which gives
it to a backend that only generates whole batches (the HF backend, the vLLM plugin's). ``rlkit.rollout.agent``
runs the loops."""

from __future__ import annotations

import asyncio
import json

import torch

from rlkit.batch import Batch
from rlkit.plugin.protocols import GeneratesIds

__all__ = ["TurnGenerator", "HFTurnGenerator"]


# What the loop needs from a backend: ``rlkit.plugin.protocols.GeneratesIds`` (a backend declaring the
# ``generate_ids`` capability implements it; ``HFTurnGenerator`` adapts one that does not).
TurnGenerator = GeneratesIds


class HFTurnGenerator:
    """``TurnGenerator`` over a backend's batched ``generate`` (``rlkit.rollout.hf.HFRollout``, the vLLM
    plugin's ``VllmRollout``: any backend without the ``generate_ids`` capability): requests that arrive
    together with the same sampling settings run as one left-padded batch (generated up to the largest
    budget, each cut to its own). Reads the backend's ``pad_token_id``, ``eos_token_ids`` (a tensor or a
    list) and ``max_response_length``."""

    def __init__(self, rollout):
        self.rollout = rollout
        self._pending: list[tuple[list[int], dict, asyncio.Future]] = []
        self._flush_scheduled = False
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None  # each generate() call runs its own loop

    async def generate_ids(self, prompt_ids: list[int], sampling: dict) -> tuple[list[int], list[float], str]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._pending.append((list(prompt_ids), dict(sampling), future))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(lambda: asyncio.ensure_future(self._flush()))
        return await future

    async def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        loop = asyncio.get_running_loop()
        if (
            self._lock is None or self._lock_loop is not loop
        ):  # a lock is bound to the loop it first waited in
            self._lock, self._lock_loop = asyncio.Lock(), loop
        groups: dict[str, list[tuple[list[int], dict, asyncio.Future]]] = {}
        for item in pending:
            key = json.dumps({k: v for k, v in item[1].items() if k != "max_new_tokens"}, sort_keys=True)
            groups.setdefault(key, []).append(item)
        async with self._lock:  # one forward at a time: the module is shared
            for items in groups.values():
                try:
                    results = await asyncio.to_thread(self._run, [i[0] for i in items], [i[1] for i in items])
                except Exception as exc:
                    for *_, fut in items:
                        fut.done() or fut.set_exception(exc)
                    continue
                for (*_, fut), res in zip(items, results):
                    fut.done() or fut.set_result(res)

    def _run(
        self, prompts: list[list[int]], samplings: list[dict]
    ) -> list[tuple[list[int], list[float], str]]:
        budgets = [int(s.get("max_new_tokens") or self.rollout.max_response_length) for s in samplings]
        pad = self.rollout.pad_token_id
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [B, P]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, P]
        s = samplings[0]
        out = self.rollout.generate(
            Batch({"input_ids": ids, "attention_mask": mask}),
            n=1,
            temperature=s.get("temperature"),
            top_p=s.get("top_p"),
            top_k=s.get("top_k"),
            max_new_tokens=max(budgets),
            do_sample=s.get("do_sample"),
            stop=s.get("stop"),
        )
        eos = {int(i) for i in self.rollout.eos_token_ids}
        results = []
        for r, budget in enumerate(budgets):
            length = int(out["response_mask"][r].sum())
            tokens = out["responses"][r, :length].tolist()
            logps = out["rollout_log_probs"][r, :length].tolist()
            if length > budget:
                results.append((tokens[:budget], logps[:budget], "length"))
            else:
                ended = length < max(budgets) or (tokens and tokens[-1] in eos)
                results.append((tokens, logps, "stop" if ended else "length"))
        return results
