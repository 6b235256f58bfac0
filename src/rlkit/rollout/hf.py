"""The Hugging Face rollout backend: batched sampling with a KV cache, in the actor's process.

Its own decode loop (rather than ``model.generate``) for three reasons: the sampled token's log-prob
under the untruncated temperature-scaled distribution comes for free; stop strings end a row at the
exact token that completes them; and when the module is FSDP-sharded every forward is a collective, so
all ranks must run the same number of decode steps — the loop stops only when every rank is done —
and the parameters are gathered once for the whole loop (``set_reshard_after_forward(False)``), not
once per token, then resharded (the full weights are held on every rank while generating, as veRL's
hybrid engine does).

``rollout.backend: {name: hf, dtype: bfloat16}`` decodes with a bf16 copy of the weights (refreshed from the
actor's fp32 weights at the start of every ``generate``; the optimizer keeps its fp32 master): decoding
reads every weight once per token, so half the bytes is about half the time, and bf16 matmuls use AMX
where the CPU has it. Only for a plain (unsharded) module; an FSDP-sharded one decodes in its own dtype
(validation refuses an explicit bfloat16/float16 for a hybrid actor on more than one rank).
``auto`` (what a run uses unless the recipe says otherwise; the driver resolves it, ``rlkit.hardware``)
is bfloat16 where this device's bf16 is fast and float32 elsewhere: on a CPU without native bf16 a bf16
copy decodes tens of times slower. ``float16`` on the CPU decodes with fp16 weights packed for fbgemm and
fp32 activations (``rlkit.rollout.fp16_weights``: 1.5–1.9× faster linears where bf16 is slow; on CUDA a
plain fp16 copy). Not given at all (a backend built directly): the weights' own dtype.

Layout of the returned Batch: ``rlkit.rollout.base``. Shapes: ``B`` prompts × n, ``P`` prompt width,
``T`` response width, ``V`` vocabulary.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlkit.batch import Batch
from rlkit.errors import RlkitError
from rlkit.hardware import concrete_decode_dtype
from rlkit.recipe.schema import RolloutConfig
from rlkit.rollout.base import assemble_rollout
from rlkit.rollout.decode import decode, slab_layers
from rlkit.rollout.fp16_weights import Fp16DecodeCopy

__all__ = ["HFRollout", "sample_next"]

_fast_decode = True  # rlkit.rollout.decode's loop (tests turn it off to compare with the plain loop)


def sample_next(logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int, do_sample: bool,
                generator: torch.Generator | None, uniform: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from ``logits [B, V]``; returns ``(tokens [B], log_prob [B])``.

    The log-prob is that of ``log_softmax(logits / temperature)`` (greedy: temperature 1), before
    top-k / top-p truncation (``rlkit.rollout.base``). ``uniform [B, 1]`` (float64): the rows' random draws
    when the caller made them (``rlkit.rollout.decode`` draws for the full batch); else drawn here.
    Nothing of size ``[B, V]`` is copied unless truncation needs it; top-k works on its ``k`` candidates.
    """
    logits = logits.float()
    greedy = not do_sample or temperature == 0
    scaled = logits if greedy or temperature == 1 else logits / temperature  # [B, V]
    logp = torch.log_softmax(scaled, dim=-1)
    if greedy:
        tokens = logp.argmax(dim=-1)
    else:
        tokens = _sample_top_k(scaled, top_k, top_p, generator, uniform) if 0 < top_k < scaled.shape[-1] else None
        if tokens is None:
            tokens = _inverse_cdf_sample(_truncated_probs(scaled, top_k, top_p), generator, uniform)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _truncated_probs(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``softmax`` of ``scaled [B, V]`` after top-k (ties with the k-th kept) and top-p, over the whole
    vocabulary: the reference form (a sort of ``[B, V]`` for top-p)."""
    filtered = scaled
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # [B, 1]
        filtered = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # mass before this token already >= p
        sorted_logits[drop] = float("-inf")
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)


def _sample_top_k(scaled: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator | None,
                  uniform: torch.Tensor | None) -> torch.Tensor | None:
    """Top-k (then top-p) sampling on the ``k`` candidates ``[B, k]`` in vocabulary order, the order the
    full-vocabulary inverse CDF walks: the same draw picks the same token. None where a row has ties with
    its k-th logit (the reference keeps them all): the caller takes the full path."""
    values, index = torch.topk(scaled, top_k, dim=-1)  # [B, k], descending
    if bool(((scaled >= values[:, -1:]).sum(-1) > top_k).any()):
        return None
    if top_p < 1.0:
        probs = torch.softmax(values, dim=-1)
        values = values.masked_fill(probs.cumsum(-1) - probs >= top_p, float("-inf"))
    index, order = index.sort(dim=-1)  # vocabulary order
    pick = _inverse_cdf_sample(torch.softmax(values.gather(-1, order), dim=-1), generator, uniform)  # [B]
    return index.gather(-1, pick[:, None]).squeeze(-1)


def _inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None,
                        uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row of ``probs [B, V]`` → ``[B]``: the first token whose cumulative probability exceeds
    a uniform draw (``uniform [B, 1]`` float64, or drawn here). One random number per row, where
    ``torch.multinomial`` draws one per vocabulary entry (measured 16 ms vs 1 ms for 16 × 49k on one
    thread); float64 keeps the tail's mass exact enough."""
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)  # [B, V]
    u = uniform if uniform is not None else torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64,
                                                       device=probs.device)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)


class HFRollout:
    """Sampling from a transformers causal LM (plain or FSDP2-sharded) with a KV cache."""

    _share_prefill = True  # one prefill per distinct prompt (tests turn it off to compare with the plain path)

    def __init__(self, *, module: nn.Module, tokenizer, rollout_config: RolloutConfig, max_response_length: int,
                 device: torch.device | str = "cpu", seed: int = 0, eos_token_ids: list[int] | None = None,
                 params: Any = None):
        """``params``: ``HFRolloutParams`` (``rollout.backend: {name: hf, dtype: ...}``); None = defaults."""
        self.module = module
        self.tokenizer = tokenizer
        self.config = rollout_config
        self.max_response_length = max_response_length
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        ids = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
        self.eos_token_ids = torch.tensor(sorted({i for i in ids if i is not None}), device=self.device)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(self.eos_token_ids[0])
        dtype = concrete_decode_dtype(getattr(params, "dtype", None), self.device)  # "auto" → this device's choice
        self.decode_dtype = getattr(torch, dtype) if dtype else None
        self._decode_copy: nn.Module | None = None
        self._fp16_copy: Fp16DecodeCopy | None = None  # float16 on the CPU (rlkit.rollout.fp16_weights)

    def _decoder(self) -> nn.Module:
        """The module to decode with: the actor's own, or (``rollout.backend.dtype``) a copy in that dtype
        holding the actor's current weights."""
        from torch.distributed.fsdp import FSDPModule

        params = list(self.module.parameters())
        if self.decode_dtype is None or isinstance(self.module, FSDPModule) or params[0].dtype == self.decode_dtype:
            return self.module
        if self.decode_dtype == torch.float16 and self.device.type == "cpu":  # fbgemm's fp16-weight GEMM
            if self._fp16_copy is None:
                self._fp16_copy = Fp16DecodeCopy(self.module)
            return self._fp16_copy.refresh(self.module)
        if self._decode_copy is None:
            self._decode_copy = copy.deepcopy(self.module).requires_grad_(False)
            for p in self._decode_copy.parameters():  # parameters only: buffers (rotary inv_freq) stay fp32
                p.data = p.data.to(self.decode_dtype)
        with torch.no_grad():
            for mine, source in zip(self._decode_copy.parameters(), params, strict=True):
                mine.copy_(source)
            for mine, source in zip(self._decode_copy.buffers(), self.module.buffers(), strict=True):
                mine.copy_(source)
        return self._decode_copy

    # ----- weights ------------------------------------------------------------------------------
    def update_weights(self, weights: nn.Module | dict[str, torch.Tensor]) -> None:
        """Hybrid engine: the actor's module itself (shared, nothing copied), a full state dict, or (LoRA:
        ``FSDPActor.rollout_state_dict``) the adapter's tensors alone into a module that has the adapter."""
        if isinstance(weights, nn.Module):
            if weights is not self.module:
                self._decode_copy = self._fp16_copy = None
            self.module = weights
            return
        from torch.distributed.fsdp import FSDPModule

        from rlkit.workers.lora import is_adapter_key

        # A module with a LoRA adapter takes adapter tensors alone (its frozen base never changes).
        adapter_only = any(is_adapter_key(name) for name, _ in self.module.named_parameters())
        if isinstance(self.module, FSDPModule):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not adapter_only)
            set_model_state_dict(self.module, weights, options=opts)
        else:
            result = self.module.load_state_dict(weights, strict=False)
            tied = getattr(getattr(self.module, "config", None), "tie_word_embeddings", False)
            missing = [k for k in result.missing_keys if not (tied and k.endswith("lm_head.weight"))
                       and not (adapter_only and not is_adapter_key(k))]
            if missing or result.unexpected_keys:
                raise RlkitError(f"rollout.update_weights: the state dict does not fit the rollout's model "
                                 f"(missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}).")

    # ----- generation ---------------------------------------------------------------------------
    def _collective(self) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(self.module, FSDPModule) and dist.is_initialized() and dist.get_world_size() > 1

    def _keep_unsharded(self, keep: bool, modules: list | None = None) -> list:
        """FSDP2: gather the full parameters once for the whole decode loop instead of once per token
        (``keep=True``); afterwards (``keep=False``) free them again and restore resharding."""
        from torch.distributed.fsdp import FSDPModule

        if keep:
            modules = [m for m in self.module.modules() if isinstance(m, FSDPModule)]
        for m in modules or []:
            m.set_reshard_after_forward(not keep)
            if not keep:
                m.reshard()
        return modules or []

    def _all_done(self, finished: torch.Tensor) -> bool:
        done = torch.tensor([int(bool(finished.all()))], device=self.device)
        if self._collective():
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())

    def _hits_stop(self, responses: torch.Tensor, step: int, rows: torch.Tensor, stop: list[str]) -> torch.Tensor:
        """Rows (among ``rows``) whose response text now contains a stop string."""
        hit = torch.zeros(responses.shape[0], dtype=torch.bool, device=responses.device)
        window = 4 * max(len(s) for s in stop) + 4  # tokens enough to hold any stop string
        lo = max(0, step + 1 - window)
        for r in rows.nonzero().flatten().tolist():
            text = self.tokenizer.decode(responses[r, lo:step + 1].tolist(), skip_special_tokens=False)
            hit[r] = any(s in text for s in stop)
        return hit

    def _prefill(self, module: nn.Module, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache=None):
        """Forward the prompts once each: a group's n identical rows share one prefill whose KV cache is then
        copied to every row (HF's ``batch_select_indices``); the head runs on the last position only.
        ``cache``: the ``transformers`` Cache to fill (None: the model's own ``DynamicCache``).
        Returns the model output (its cache covers all B rows) and the next-token logits [B, V]."""
        rows = torch.cat([ids, mask], dim=1)  # identical prompt = identical ids and mask
        unique, inverse = torch.unique(rows, dim=0, return_inverse=True)
        share = self._share_prefill and len(unique) < len(rows)
        if share:
            first = torch.full((len(unique),), len(rows), dtype=torch.long).scatter_reduce_(
                0, inverse, torch.arange(len(rows)), reduce="amin")  # one representative row per prompt
            ids, mask, pos = ids[first], mask[first], pos[first]
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(type(module).forward).parameters else {}
        out = module(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, past_key_values=cache,
                     **keep)
        logits = out.logits[:, -1]
        if share:
            out.past_key_values.batch_select_indices(inverse)
            logits = logits[inverse]
        return out, logits

    @torch.no_grad()
    def generate(self, prompts: Batch, *, n: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, max_new_tokens: int | None = None,
                 do_sample: bool | None = None, stop: list[str] | None = None) -> Batch:
        cfg = self.config
        n = cfg.n if n is None else n
        temperature = cfg.temperature if temperature is None else temperature
        top_p = cfg.top_p if top_p is None else top_p
        top_k = cfg.top_k if top_k is None else top_k
        max_new = self.max_response_length if max_new_tokens is None else max_new_tokens
        do_sample = (temperature > 0) if do_sample is None else do_sample
        stop = list(cfg.stop if stop is None else stop)
        if "input_ids" not in prompts or "attention_mask" not in prompts:
            raise RlkitError(f"rollout.generate needs prompt fields input_ids and attention_mask; got {prompts.keys()}.")

        prompt_ids = prompts["input_ids"].to(self.device).repeat_interleave(n, dim=0)  # [B, P]
        prompt_mask = prompts["attention_mask"].to(self.device).long().repeat_interleave(n, dim=0)  # [B, P]
        b = prompt_ids.shape[0]
        responses = torch.full((b, max_new), self.pad_token_id, dtype=torch.long, device=self.device)  # [B, T]
        response_mask = torch.zeros((b, max_new), dtype=torch.long, device=self.device)
        log_probs = torch.zeros((b, max_new), dtype=torch.float32, device=self.device)

        was_training = self.module.training
        self.module.eval()  # also turns HF gradient checkpointing off, which would disable the cache
        sharded = self._keep_unsharded(True)
        module = self._decoder()
        module.eval()
        sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "do_sample": do_sample}
        try:
            layers = slab_layers(module) if _fast_decode else None
            if layers is not None:
                decode(self, module, prompt_ids, prompt_mask, responses=responses, log_probs=log_probs,
                       response_mask=response_mask, num_layers=layers, sampling=sampling, stop=stop,
                       ignore_eos=cfg.ignore_eos)
            else:
                self._decode_plain(module, prompt_ids, prompt_mask, responses, log_probs, response_mask, sampling, stop)
        finally:
            self.module.train(was_training)
            self._keep_unsharded(False, sharded)
        meta = {"temperature": float(temperature) if do_sample and temperature > 0 else 1.0, "do_sample": bool(do_sample)}
        if self._fp16_copy is not None and module is self._fp16_copy.module:
            meta["metrics"] = {"rollout/fp16_repacked_linears": float(self._fp16_copy.repacked)}
        return assemble_rollout(prompt_ids, prompt_mask, responses, response_mask, log_probs, meta)

    def _decode_plain(self, module: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      responses: torch.Tensor, log_probs: torch.Tensor, response_mask: torch.Tensor, sampling: dict,
                      stop: list[str]) -> None:
        """The reference loop (``_fast_decode`` off, or a model whose cache the slab does not fit): the model's
        ``DynamicCache``, every row forwarded until all are done. Fills ``responses``, ``log_probs`` and
        ``response_mask [B, T]`` in place."""
        b, max_new = responses.shape
        finished = torch.zeros(b, dtype=torch.bool, device=self.device)
        mask = prompt_mask
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out, logits = self._prefill(module, prompt_ids, mask, pos)  # logits [B, V]
        last_pos = pos[:, -1]
        for step in range(max_new):
            tokens, lp = sample_next(logits, generator=self.generator, **sampling)
            live = ~finished
            responses[:, step] = torch.where(live, tokens, self.pad_token_id)
            log_probs[:, step] = torch.where(live, lp, 0.0)
            response_mask[:, step] = live.long()
            ended = live & torch.isin(tokens, self.eos_token_ids) if not self.config.ignore_eos else torch.zeros_like(live)
            if stop:
                ended |= self._hits_stop(responses, step, live & ~ended, stop)
            finished |= ended
            if step + 1 == max_new or self._all_done(finished):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            last_pos = last_pos + 1
            out = module(input_ids=responses[:, step:step + 1], attention_mask=mask,
                         position_ids=last_pos[:, None], past_key_values=out.past_key_values, use_cache=True)
            logits = out.logits[:, -1]
