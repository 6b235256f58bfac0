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
where the CPU has it. On the CPU the copy's linears hold bf16 weights packed for oneDNN and everything else
stays fp32 (``rlkit.rollout.bf16_weights``: autocast's numerics, 2x the plain bf16 copy's decode at 8 rows
× 256 tokens on Zen 4); its trainable weights are repacked once per ``update_weights``; on CUDA a plain bf16
copy. Only for a plain (unsharded) module; an FSDP-sharded one decodes in its own dtype
(validation refuses an explicit bfloat16/float16 for a hybrid actor on more than one rank).
``auto`` (what a run uses unless the recipe says otherwise; the driver resolves it, ``rlkit.hardware``)
is bfloat16 where this device's bf16 is fast; elsewhere float16 where fp16 weights pay for their packing
within the run's ``max_response_length`` (``rlkit.hardware.fp16``), else float32: on a CPU without native
bf16 a bf16 copy decodes much slower (docs/concepts.md). ``float16`` on the CPU decodes with fp16 weights
packed for fbgemm and fp32 activations (``rlkit.rollout.fp16_weights``: faster linears where bf16 is slow,
measured in docs/benchmarks.md, "fp16 decode weights"; on CUDA a plain fp16 copy); its trainable weights are
repacked once per ``update_weights``. Not given at all (a backend built directly): the weights' own dtype.
``rollout.backend.linears: onnxruntime`` decodes in fp32 on ONNX Runtime's MLAS GEMM over weights it prepacks
once per ``update_weights`` (MKL's sgemm is slow at a decode step's few rows on AMD CPUs): on a model the lean
step accepts, every token after the prefill is one ONNX Runtime graph (``rlkit.rollout.ort_step``) and the
prefill runs the module itself; on any other, a copy's linears run one session each
(``rlkit.rollout.mlas_weights``).

Layout of the returned Batch: ``rlkit.rollout.base``. Shapes: ``B`` prompts × n, ``P`` prompt width,
``T`` response width, ``V`` vocabulary.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlkit.batch import Batch
from rlkit.errors import RlkitError
from rlkit.hardware import concrete_decode_dtype, layer_shapes
from rlkit.model.attention import eager_kind
from rlkit.recipe.schema import RolloutConfig
from rlkit.rollout.base import assemble_rollout
from rlkit.rollout.bf16_weights import Bf16DecodeCopy, bf16_weights_unavailable
from rlkit.rollout.decode import Decoded, DecodePlan, Decoding, decode
from rlkit.rollout.fp16_weights import Fp16DecodeCopy
from rlkit.rollout.mlas_weights import MlasDecodeCopy
from rlkit.rollout.ort_step import OrtDecodeStep, ort_step_for
from rlkit.rollout.packed_copy import PackedDecodeCopy

__all__ = ["HFRollout"]


class HFRollout:
    """Sampling from a transformers causal LM (plain or FSDP2-sharded) with a KV cache."""

    def __init__(
        self,
        *,
        module: nn.Module,
        tokenizer,
        rollout_config: RolloutConfig,
        max_response_length: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
        eos_token_ids: list[int] | None = None,
        params: Any = None,
        decode_plan: DecodePlan = DecodePlan(),
    ):
        """``params``: ``HFRolloutParams`` (``rollout.backend: {name: hf, dtype: ...}``); None = defaults.
        ``decode_plan``: the decode path (``rlkit.rollout.decode.DecodePlan``; the default is the fast
        one)."""
        self.decode_plan = decode_plan
        self.module = module
        self.tokenizer = tokenizer
        self.config = rollout_config
        self.max_response_length = max_response_length
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        ids = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
        self.eos_token_ids = torch.tensor(sorted({i for i in ids if i is not None}), device=self.device)
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(self.eos_token_ids[0])
        )
        # "auto" → this device's choice for decodes of this length (a run's driver resolves it before)
        dtype = concrete_decode_dtype(
            getattr(params, "dtype", None),
            self.device,
            max_response_length,
            lambda: layer_shapes(module.config.to_dict()) if hasattr(module, "config") else None,
        )
        self.decode_dtype = getattr(torch, dtype) if dtype else None
        # onnxruntime: rlkit.rollout.mlas_weights; auto is the driver's to resolve (a backend built directly
        # without a run: torch)
        self.linears = getattr(params, "linears", "torch")
        self.linears = "torch" if self.linears == "auto" else self.linears
        if self.linears == "onnxruntime" and (self.device.type != "cpu" or dtype not in (None, "float32")):
            raise RlkitError(
                f"rollout.backend.linears=onnxruntime decodes on the CPU in float32, not on {self.device} in "
                f"{dtype}; set rollout.backend.linears=torch there."
            )
        self._decode_copy: nn.Module | None = None
        # packed linears: fbgemm fp16 (float16 on the CPU) or MLAS fp32 (linears=onnxruntime)
        self._packed_copy: PackedDecodeCopy | None = None
        # linears=onnxruntime on a model the lean step accepts: the whole step in one ONNX Runtime graph
        # (rlkit.rollout.ort_step); False: the model has none (per-linear sessions instead)
        self._graph_step: OrtDecodeStep | bool | None = None
        self._weights_handed = True  # update_weights since the packed copy's last refresh: repack its weights

    def _decoder(self) -> nn.Module:
        """The module to decode with: the actor's own, or (``rollout.backend.dtype``) a copy in that dtype
        holding the actor's current weights."""
        from torch.distributed.fsdp import FSDPModule

        params = list(self.module.parameters())
        mlas = self.linears == "onnxruntime" and not isinstance(self.module, FSDPModule)
        if mlas and self._graph() is not None:
            # the prefill runs the module itself (fp32, torch); every later token the graph, repacked once per
            # weight hand-over as the per-linear sessions are
            moved, self._weights_handed = self._weights_handed, False
            self._graph_step.refresh(self.module, trainable_moved=moved)
            return self.module
        if not mlas and (
            self.decode_dtype is None
            or isinstance(self.module, FSDPModule)
            or params[0].dtype == self.decode_dtype
        ):
            return self.module
        cpu = self.device.type == "cpu"
        fp16 = self.decode_dtype == torch.float16 and cpu  # fbgemm's fp16-weight GEMM
        bf16 = self.decode_dtype == torch.bfloat16 and cpu and bf16_weights_unavailable() is None  # oneDNN's
        if mlas or fp16 or bf16:
            if self._packed_copy is None:
                kind = MlasDecodeCopy if mlas else Fp16DecodeCopy if fp16 else Bf16DecodeCopy
                self._packed_copy = kind(self.module)
            # trainable weights are repacked once per weight hand-over (the hybrid engine's sync_weights after
            # each update), not at every generate: a multi-turn step generates once per turn
            moved, self._weights_handed = self._weights_handed, False
            return self._packed_copy.refresh(self.module, trainable_moved=moved)
        if self._decode_copy is None:
            self._decode_copy = copy.deepcopy(self.module).requires_grad_(False)
            for p in self._decode_copy.parameters():  # parameters only: buffers (rotary inv_freq) stay fp32
                p.data = p.data.to(self.decode_dtype)
            config = getattr(self._decode_copy, "config", None)
            if eager_kind(getattr(config, "_attn_implementation", None)) and hasattr(
                self._decode_copy, "set_attn_implementation"
            ):
                # the actor's CPU choice (its backward), not the decode's: transformers' eager copies
                # each layer's KV cache per step (repeat_kv), 1.4x the generate time at 638 prompt tokens;
                # the grouped eager (rlkit.model.attention) was measured for training only: SDPA here too
                self._decode_copy.set_attn_implementation("sdpa")
        with torch.no_grad():
            for mine, source in zip(self._decode_copy.parameters(), params, strict=True):
                mine.copy_(source)
            for mine, source in zip(self._decode_copy.buffers(), self.module.buffers(), strict=True):
                mine.copy_(source)
        return self._decode_copy

    def _graph(self) -> OrtDecodeStep | None:
        """The module's one-graph ONNX Runtime step, built on first use; None where it has none."""
        if self._graph_step is None:
            self._graph_step = ort_step_for(self.module) or False
        return self._graph_step or None

    # ----- weights ------------------------------------------------------------------------------
    def update_weights(self, weights: nn.Module | dict[str, torch.Tensor]) -> None:
        """Hybrid engine: the actor's module itself (shared, nothing copied), a full state dict, or (LoRA:
        ``FSDPActor.rollout_state_dict``) the adapter's tensors alone into a module that has the adapter."""
        self._weights_handed = True
        if isinstance(weights, nn.Module):
            if weights is not self.module:
                self._decode_copy = self._packed_copy = self._graph_step = None
            self.module = weights
            return
        from torch.distributed.fsdp import FSDPModule

        from rlkit.model.lora import is_adapter_key

        # A module with a LoRA adapter takes adapter tensors alone (its frozen base never changes).
        adapter_only = any(is_adapter_key(name) for name, _ in self.module.named_parameters())
        if isinstance(self.module, FSDPModule):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not adapter_only)
            set_model_state_dict(self.module, weights, options=opts)
        else:
            result = self.module.load_state_dict(weights, strict=False)
            tied = getattr(getattr(self.module, "config", None), "tie_word_embeddings", False)
            missing = [
                k
                for k in result.missing_keys
                if not (tied and k.endswith("lm_head.weight"))
                and not (adapter_only and not is_adapter_key(k))
            ]
            if missing or result.unexpected_keys:
                raise RlkitError(
                    f"rollout.update_weights: the state dict does not fit the rollout's model "
                    f"(missing {missing[:5]}, unexpected {result.unexpected_keys[:5]})."
                )

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

    def _decoding(self, stop: list[str], sampling: dict) -> Decoding:
        """What this ``generate`` call decodes with (``rlkit.rollout.decode``)."""
        return Decoding(
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            generator=self.generator,
            sampling=sampling,
            stop=stop,
            ignore_eos=self.config.ignore_eos,
            collective=self._collective(),
            plan=self.decode_plan,
        )

    @torch.no_grad()
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
        cfg = self.config
        n = cfg.n if n is None else n
        temperature = cfg.temperature if temperature is None else temperature
        top_p = cfg.top_p if top_p is None else top_p
        top_k = cfg.top_k if top_k is None else top_k
        max_new = self.max_response_length if max_new_tokens is None else max_new_tokens
        do_sample = (temperature > 0) if do_sample is None else do_sample
        stop = list(cfg.stop if stop is None else stop)
        if "input_ids" not in prompts or "attention_mask" not in prompts:
            raise RlkitError(
                f"rollout.generate needs prompt fields input_ids and attention_mask; got {prompts.keys()}."
            )

        prompt_ids = prompts["input_ids"].to(self.device).repeat_interleave(n, dim=0)  # [B, P]
        prompt_mask = prompts["attention_mask"].to(self.device).long().repeat_interleave(n, dim=0)  # [B, P]
        b = prompt_ids.shape[0]
        # [B, T]
        responses = torch.full((b, max_new), self.pad_token_id, dtype=torch.long, device=self.device)
        response_mask = torch.zeros((b, max_new), dtype=torch.long, device=self.device)
        log_probs = torch.zeros((b, max_new), dtype=torch.float32, device=self.device)

        sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "do_sample": do_sample}
        decoded, module, graph, weights_s = self._decode(
            stop, sampling, prompt_ids, prompt_mask, responses, log_probs, response_mask
        )
        meta = {
            "temperature": float(temperature) if do_sample and temperature > 0 else 1.0,
            "do_sample": bool(do_sample),
            "metrics": self._decode_metrics(decoded, module, graph) | {"perf/decode_weights_s": weights_s},
        }
        return assemble_rollout(prompt_ids, prompt_mask, responses, response_mask, log_probs, meta)

    def _decode(
        self,
        stop: list[str],
        sampling: dict[str, Any],
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        responses: torch.Tensor,
        log_probs: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> tuple[Decoded, nn.Module, OrtDecodeStep | None, float]:
        """Fill ``responses`` / ``log_probs`` / ``response_mask`` [B, T] for ``prompt_ids`` [B, P], the
        module in eval mode and unsharded meanwhile (restored after, also where readying the weights fails):
        ``(what decode ran, the module it decoded with, the graph step it was offered, seconds readying the
        weights)``."""
        was_training = self.module.training
        self.module.eval()  # also turns HF gradient checkpointing off, which would disable the cache
        sharded = self._keep_unsharded(True)
        try:
            # readying the decode weights: a session rebuilt or a copy repacked after a weight sync
            begin = time.perf_counter()
            module = self._decoder()
            weights_s = time.perf_counter() - begin
            module.eval()
            graph = self._graph_step if module is self.module and self._graph_step else None
            run = self._decoding(stop, sampling)
            decoded = decode(
                run,
                module,
                prompt_ids,
                prompt_mask,
                responses=responses,
                log_probs=log_probs,
                response_mask=response_mask,
                graph_step=graph,
            )
        finally:
            self.module.train(was_training)
            self._keep_unsharded(False, sharded)
        return decoded, module, graph, weights_s

    def _decode_metrics(
        self, decoded: Decoded, module: nn.Module, graph: OrtDecodeStep | None
    ) -> dict[str, float]:
        """What one ``decode`` ran (``decoded``: its loop and cache; ``module``: the model it decoded with;
        ``graph``: the one-graph step it was offered) and what it repacked, as rollout metrics."""
        path = decoded.path
        metrics = {
            "rollout/lean_step": float(path in ("lean", "scripted", "graph")),
            "rollout/scripted_layers": float(path == "scripted"),  # the lean step's layers under TorchScript
            "rollout/bf16_kv_cache": float(decoded.bf16_kv),  # the slab cache held bf16 K/V (rollout.bf16_kv)
            # the lean step attended with the compiled kernel (rollout.attention_kernel)
            "rollout/attention_kernel": float(decoded.attention_kernel),
            # its scripted layers ran the compiled glue operators (rollout.scripted_step.fused_layer_loop)
            "rollout/fused_glue": float(decoded.fused_glue),
            # the tokens were drawn by the compiled rlkit::sample_rows (rollout.sampling.sample_next)
            "rollout/fused_sampling": float(decoded.fused_sampling),
        }
        if graph is not None:
            metrics["rollout/onnxruntime_graph_step"] = float(path == "graph")
            metrics["rollout/mlas_repacked_linears"] = float(graph.repacked)
        if self._packed_copy is not None and module is self._packed_copy.module:
            kind = {MlasDecodeCopy: "mlas", Bf16DecodeCopy: "bf16"}.get(type(self._packed_copy), "fp16")
            metrics[f"rollout/{kind}_repacked_linears"] = float(self._packed_copy.repacked)
        return metrics
