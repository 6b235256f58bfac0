"""The update's shared-prompt layout as one pass: prompt and response tokens in one hidden-state tensor.

    M=~/.cache/rlkit/models/SmolLM2-135M-Instruct
    OMP_NUM_THREADS=1 python benchmarks/fused_prefix_spike.py --model $M

rlkit's update runs a group's prompt once (``rlkit.model.forward._shared_prefix_logits``): a prompt pass with
a KV cache, the cache indexed out to the group's rows, then the responses' pass. Every linear therefore runs
two GEMMs forward (M = the prompts' tokens, then the responses'), two weight-gradient GEMMs backward (K = each
pass's tokens) and an ``add`` of the two gradients; the prompt's, with M or K of a few dozen tokens, run well
below the matmul peak (``profile_step.py --shapes``). This spike runs a Llama-family body (SmolLM2) with the
prompt tokens and the response tokens as one ``[N, hidden]`` tensor: one GEMM per linear each way, and an
attention in two parts per layer, as the decode's shared prompt does (``rlkit.rollout.shared_prompt``): each
group's queries against its prompt's keys in one product per prompt, each row's queries against its own
positions, one softmax over both.

Measured: the body's forward and backward (the final hidden states of the response tokens, a stand-in loss:
their mean square), the two-pass layout through the model's own forward (rlkit's grouped eager attention, as
the actor trains) against the one-pass spike, interleaved, best of ``--reps``; and the largest difference of
the response hidden states and of the weight gradients between the two. Prompts here are of equal length (no
left padding). Not wired into rlkit: a measurement before building it. Writes
``benchmarks/results/<stamp>-fused-prefix-spike.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

SHAPES = [  # (dtype, prompts u, rows per prompt n, prompt tokens P, response tokens T): the harness's
    ("fp32", 2, 4, 44, 64),  # smollm2-64, issue 30's "ours"
    ("bf16", 4, 4, 44, 32),  # smollm2
    ("bf16", 2, 4, 44, 64),  # smollm2-64 in bf16
    ("bf16", 2, 4, 526, 64),  # smollm2-long
]


def two_pass(model, prompt_ids, response_ids):
    """rlkit's shared layout through the model's forward: response hidden states [u·n, T, h]."""
    from rlkit.model.kv_cache import cache_argument, output_cache

    u, p = prompt_ids.shape
    rows, t = response_ids.shape
    n = rows // u
    body = model.model
    pos = torch.arange(p)[None].expand(u, p)
    head = body(
        input_ids=prompt_ids,
        attention_mask=torch.ones(u, p, dtype=torch.long),
        position_ids=pos,
        use_cache=True,
    )
    cache = output_cache(head)
    cache.batch_select_indices(torch.arange(u).repeat_interleave(n))
    tail = body(
        input_ids=response_ids,
        attention_mask=torch.ones(rows, p + t, dtype=torch.long),
        position_ids=(p + torch.arange(t))[None].expand(rows, t),
        use_cache=True,
        **cache_argument(body, cache),
    )
    return tail.last_hidden_state


def one_pass(model, prompt_ids, response_ids):
    """The same response hidden states with prompt and response tokens in one [N, h] tensor."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    body, cfg = model.model, model.config
    u, p = prompt_ids.shape
    rows, t = response_ids.shape
    n = rows // u
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    g = heads // kv_heads
    np_, nr = u * p, rows * t
    ids = torch.cat([prompt_ids.reshape(-1), response_ids.reshape(-1)])  # [N]
    positions = torch.cat([torch.arange(p).repeat(u), (p + torch.arange(t)).repeat(rows)])  # [N]
    x = body.embed_tokens(ids)[None]  # [1, N, h]
    cos, sin = body.rotary_emb(x, positions[None])  # [1, N, D]
    causal_p = torch.full((p, p), float("-inf")).triu(1)
    causal_t = torch.full((t, t), float("-inf")).triu(1)
    for layer in body.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(1, -1, heads, d).transpose(1, 2)  # [1, H, N, D]
        k = attn.k_proj(h).view(1, -1, kv_heads, d).transpose(1, 2)
        v = attn.v_proj(h).view(1, -1, kv_heads, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        q, k, v = q[0], k[0], v[0]  # [H, N, D], [Hkv, N, D]
        # prompts: [u, Hkv, G·P, D] against [u, Hkv, P, D], causal
        qp = q[:, :np_].reshape(kv_heads, g, u, p, d).permute(2, 0, 1, 3, 4).reshape(u, kv_heads, g * p, d)
        kp = k[:, :np_].reshape(kv_heads, u, p, d).transpose(0, 1)  # [u, Hkv, P, D]
        vp = v[:, :np_].reshape(kv_heads, u, p, d).transpose(0, 1)
        sp = torch.matmul(qp, kp.transpose(-1, -2)) * attn.scaling  # [u, Hkv, G·P, P]
        sp = (sp.view(u, kv_heads, g, p, p) + causal_p).view(u, kv_heads, g * p, p)
        op = torch.matmul(torch.softmax(sp, -1, dtype=torch.float32).to(qp.dtype), vp)  # [u, Hkv, G·P, D]
        op = op.view(u, kv_heads, g, p, d).permute(1, 2, 0, 3, 4).reshape(heads, np_, d)
        # responses: each group's queries [u, Hkv, n·G·T, D] against its prompt, each row against its own
        qr = q[:, np_:].reshape(kv_heads, g, u, n, t, d).permute(2, 0, 3, 1, 4, 5)  # [u, Hkv, n, G, T, D]
        kr = k[:, np_:].reshape(kv_heads, u, n, t, d).permute(1, 0, 2, 3, 4)  # [u, Hkv, n, T, D]
        vr = v[:, np_:].reshape(kv_heads, u, n, t, d).permute(1, 0, 2, 3, 4)
        s_prompt = torch.matmul(
            qr.reshape(u, kv_heads, n * g * t, d), kp.transpose(-1, -2)
        )  # [u, Hkv, nGT, P]
        s_own = torch.matmul(qr.reshape(u, kv_heads, n, g * t, d), kr.transpose(-1, -2))  # [u, Hkv, n, GT, T]
        s_own = (s_own.view(u, kv_heads, n, g, t, t) + causal_t).view(u, kv_heads, n, g * t, t)
        scores = torch.cat([s_prompt.view(u, kv_heads, n, g * t, p), s_own], dim=-1) * attn.scaling
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(qr.dtype)  # [u, Hkv, n, GT, P + T]
        o_r = torch.matmul(probs[..., :p].reshape(u, kv_heads, n * g * t, p), vp).view(
            u, kv_heads, n, g * t, d
        )
        o_r = o_r + torch.matmul(probs[..., p:], vr)  # [u, Hkv, n, G·T, D]
        o_r = o_r.view(u, kv_heads, n, g, t, d).permute(1, 3, 0, 2, 4, 5).reshape(heads, nr, d)
        o = torch.cat([op, o_r], dim=1).transpose(0, 1).reshape(1, -1, heads * d)  # [1, N, H·D]
        x = x + attn.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = body.norm(x)
    return x[0, np_:].view(rows, t, -1)


def measure(model, dtype: str, u: int, n: int, p: int, t: int, reps: int) -> dict:
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(0, vocab, (u, p))
    response_ids = torch.randint(0, vocab, (u * n, t))
    bf16 = dtype == "bf16"

    def run(fn):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            hidden = fn(model, prompt_ids, response_ids)
            loss = hidden.float().pow(2).mean()
        loss.backward()
        seconds = time.perf_counter() - start
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
        return seconds, hidden.detach().float(), grads

    _, h_two, g_two = run(two_pass)
    _, h_one, g_one = run(one_pass)
    hidden_diff = float((h_two - h_one).abs().max())
    grad_diff = max(
        float((g_two[k] - g_one[k]).abs().max() / g_two[k].abs().max().clamp_min(1e-30)) for k in g_two
    )
    times = {"two_pass": [], "one_pass": []}
    for rep in range(reps):
        for name in ("two_pass", "one_pass") if rep % 2 == 0 else ("one_pass", "two_pass"):
            times[name].append(run(two_pass if name == "two_pass" else one_pass)[0])
    return {
        "dtype": dtype,
        "u": u,
        "n": n,
        "P": p,
        "T": t,
        "two_pass_s": min(times["two_pass"]),
        "one_pass_s": min(times["one_pass"]),
        "times": times,
        "hidden_max_abs_diff": hidden_diff,
        "grad_max_rel_diff": grad_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import Report, hardware_line, keep_freed_memory, one_thread
    from transformers import AutoModelForCausalLM

    from rlkit.model.attention import grouped_eager_name

    one_thread()
    keep_freed_memory()
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.set_attn_implementation(grouped_eager_name())
    model.train()
    report = Report("fused-prefix-spike")
    report(hardware_line())
    report(
        "| dtype | prompts × rows × (P + T) | two passes s (best) | one pass s (best) | one / two "
        "| hidden max abs diff | grad max rel diff |"
    )
    report("|---|---|---:|---:|---:|---:|---:|")
    rows = []
    for shape in SHAPES:
        r = measure(model, *shape, args.reps)
        rows.append(r)
        report(
            f"| {r['dtype']} | {r['u']} × {r['n']} × ({r['P']} + {r['T']}) | {r['two_pass_s']:.3f} | "
            f"{r['one_pass_s']:.3f} | {r['one_pass_s'] / r['two_pass_s']:.3f} | "
            f"{r['hidden_max_abs_diff']:.1e} | {r['grad_max_rel_diff']:.1e} |"
        )
    report.save({"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
