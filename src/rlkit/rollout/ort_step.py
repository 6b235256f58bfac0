"""A Llama-family decode step as one ONNX Runtime graph: what ``rollout.backend.linears: onnxruntime`` decodes
every token after the prefill with, on a model the lean step accepts (``rlkit.rollout.lean_step``).

One session holds every layer's RMSNorms, q/k/v/o projections (their biases and Qwen3's per-head q/k norms
included), rotary embedding, attention over the slab cache and SiLU MLP, then the final norm and the LM head,
all fp32. Its weights are the model's own tensors, read from memory when the session is built; MLAS prepacks
every GEMM weight then, so each weight hand-over rebuilds the session (:meth:`OrtDecodeStep.refresh`), as
``rlkit.rollout.mlas_weights`` repacks its per-linear sessions. Against those per-linear sessions the graph
saves each call's Python and dispatch and runs the norms, rotary, attention and activation as ONNX Runtime
kernels: on SmolLM2-135M, one AVX2 core, a step took 0.70-0.83x as long at 8-64 rows, and 0.44-0.61x the fp32
lean step's (``benchmarks/ort_step_spike.py``; docs/benchmarks.md, "One ONNX Runtime graph per decode
step").

The step keeps :class:`~rlkit.rollout.lean_step.LeanStep`'s contract, so the decode loop and its cache are
the same: the embedding lookup, rotary cos/sin and sampling stay in torch. Attention is ONNX Runtime's
``GroupQueryAttention`` (com.microsoft) with the cache's K/V buffers ``[A, Hkv, C, D]`` bound as its past and
its present at once: it writes the new token's rotated key and value at position ``L - 1`` and attends
positions ``[0, L)`` only, under an additive bias that is -inf over left padding. So the cache is neither
concatenated nor copied, and a step's attention grows with ``L``, not with the capacity ``C`` (it replaced a
hand-built attention over the full capacity: ``benchmarks/ort_attention_ab.py``, docs/benchmarks.md). The
graph also returns the new key and value, which the loop hands to ``SlabLayer.update`` (its count of filled
positions; the values are already in place). Outputs are the fp32 lean step's to float rounding (logits
within 1e-4 on SmolLM2), so the rollout's log-probs stay the actor's.

Shapes: ``A`` rows, ``C`` cache capacity, ``L`` filled positions after the step, ``H``/``Hkv`` query/KV heads,
``G = H / Hkv``, ``D`` head size, ``V`` vocabulary.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from rlkit.errors import RlkitError
from rlkit.hardware.mlas import memory_initializer, memory_session, onnxruntime_unavailable
from rlkit.rollout.lean_step import lean_step_for

__all__ = ["OrtDecodeStep", "ort_step_for"]

SETTING = "rollout.backend.linears=onnxruntime"


def ort_step_for(module: nn.Module) -> OrtDecodeStep | None:
    """The one-graph step for ``module`` (built, not yet packed: :meth:`OrtDecodeStep.refresh`), or None where
    it decodes with per-linear sessions instead: the lean step does not accept it, its MLP is not SiLU, a
    projection is not a plain ``nn.Linear`` (a LoRA adapter's layer: the graph would leave the adapter out) or
    a weight is not fp32 on the CPU (the prefill runs the module itself and fills the cache the graph reads as
    fp32)."""
    if lean_step_for(module) is None or getattr(module.config, "hidden_act", "silu") != "silu":
        return None
    if any(type(m) is not nn.Linear for m in _projections(module)):
        return None
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in module.parameters()):
        return None
    reason = onnxruntime_unavailable()
    if reason:
        raise RlkitError(f"{SETTING}: {reason}. Or use rollout.backend.linears=torch.")
    return OrtDecodeStep(module)


def _projections(module: nn.Module) -> list[nn.Module]:
    """Every linear the graph computes: each layer's q, k, v, o, gate, up and down, and the LM head."""
    out = [module.lm_head]
    for layer in module.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return out


class _Graph:
    """The step's ONNX graph, built node by node (:meth:`decoder_layer` per layer); ``weights`` maps each
    initializer's name (the parameter's path) to its tensor."""

    def __init__(self, heads: int, kv_heads: int, dim: int, eps: float, scale: float):
        from onnx import helper, numpy_helper  # optional: rlkit[onnxruntime]

        self.helper = helper
        self.nodes: list = []
        self.constants: list = []
        self.initializers: list = []
        self.weights: dict[str, torch.Tensor] = {}
        self.heads, self.kv_heads, self.dim, self.scale = heads, kv_heads, dim, scale
        i64 = functools.partial(np.array, dtype=np.int64)
        for name, value in {
            "two": np.float32(2.0),
            "eps": np.float32(eps),
            "shape_q": i64([0, kv_heads, heads // kv_heads, dim]),
            "shape_kv": i64([0, kv_heads, 1, dim]),
            "shape_q3": i64([0, 1, heads * dim]),
            "shape_kv3": i64([0, 1, kv_heads * dim]),
            "shape_cs": i64([0, 1, 1, dim]),
            "shape_o": i64([0, heads * dim]),
            "halves": i64([dim // 2, dim - dim // 2]),
        }.items():
            self.constants.append(numpy_helper.from_array(np.asarray(value), name))
        self.node("Reshape", ["cos", "shape_cs"], "cos4")  # [A, 1, 1, D]: broadcast over heads
        self.node("Reshape", ["sin", "shape_cs"], "sin4")

    def node(self, op: str, inputs: list[str], output: str, **attrs) -> str:
        self.nodes.append(self.helper.make_node(op, inputs, [output], **attrs))
        return output

    def weight(self, name: str, tensor: torch.Tensor) -> str:
        if name not in self.weights:
            self.weights[name] = tensor
            self.initializers.append(memory_initializer(name, list(tensor.shape)))
        return name

    def rms(self, x: str, name: str, norm: nn.Module, out: str) -> str:
        """transformers' RMSNorm over the last axis: ``x / sqrt(mean(x²) + eps) * w``."""
        square = self.node("Pow", [x, "two"], out + "_sq")
        mean = self.node("ReduceMean", [square], out + "_ms", axes=[-1], keepdims=1)
        root = self.node("Sqrt", [self.node("Add", [mean, "eps"], out + "_mse")], out + "_rms")
        normed = self.node("Div", [x, root], out + "_xn")
        return self.node("Mul", [normed, self.weight(name + ".weight", norm.weight)], out)

    def linear(self, x: str, name: str, linear: nn.Linear, out: str) -> str:
        """``x [A, in] @ W.T + b``: a Gemm on the weight as stored ([out, in]), which MLAS prepacks."""
        inputs = [x, self.weight(name + ".weight", linear.weight)]
        if linear.bias is not None:
            inputs.append(self.weight(name + ".bias", linear.bias))
        return self.node("Gemm", inputs, out, transB=1)

    def rope(self, t: str, out: str) -> str:
        """``t · cos + rotate_half(t) · sin`` over ``t [A, Hkv, G or 1, D]``, as transformers rotates."""
        self.nodes.append(self.helper.make_node("Split", [t, "halves"], [out + "_x1", out + "_x2"], axis=-1))
        negated = self.node("Neg", [out + "_x2"], out + "_nx2")
        rotated = self.node("Concat", [negated, out + "_x1"], out + "_r", axis=-1)
        cos = self.node("Mul", [t, "cos4"], out + "_c")
        return self.node("Add", [cos, self.node("Mul", [rotated, "sin4"], out + "_s")], out)

    def attention(self, i: int, name: str, attn: nn.Module, h: str) -> str:
        """Layer ``i`` 's attention of ``h [A, Hd]`` over its cache ``k{i}``/``v{i} [A, Hkv, C, D]`` under
        ``mask``, plus the new token's own key and value (outputs ``nk{i}``, ``nv{i} [A, Hkv, 1, D]``);
        returns ``[A, H·D]``, heads in transformers' order."""
        p = f"l{i}_"
        q = self.node(
            "Reshape", [self.linear(h, name + ".q_proj", attn.q_proj, p + "q"), "shape_q"], p + "q4"
        )
        k = self.node(
            "Reshape", [self.linear(h, name + ".k_proj", attn.k_proj, p + "k"), "shape_kv"], p + "k4"
        )
        v = self.node(
            "Reshape", [self.linear(h, name + ".v_proj", attn.v_proj, p + "v"), "shape_kv"], f"nv{i}"
        )
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head's D, before the rotation
            q = self.rms(q, name + ".q_norm", attn.q_norm, p + "qn")
            k = self.rms(k, name + ".k_norm", attn.k_norm, p + "kn")
        q = self.node("Reshape", [self.rope(q, p + "qr"), "shape_q3"], p + "q3")  # [A, 1, H·D]
        k = self.rope(k, f"nk{i}")  # [A, Hkv, 1, D]
        k = self.node("Reshape", [k, "shape_kv3"], p + "k3")  # [A, 1, Hkv·D]
        v = self.node("Reshape", [v, "shape_kv3"], p + "v3")
        # ONNX Runtime's GroupQueryAttention over the cache buffers shared as past and present: it writes the
        # new key and value at position seqlens + 1 - 1 = L - 1 and attends positions [0, L) only, under bias
        self.nodes.append(
            self.helper.make_node(
                "GroupQueryAttention",
                [q, k, v, f"k{i}", f"v{i}", "seqlens", "total", "", "", "", "bias"],
                [p + "o", f"pk{i}", f"pv{i}"],
                domain="com.microsoft",
                num_heads=self.heads,
                kv_num_heads=self.kv_heads,
                scale=self.scale,
            )
        )
        o = p + "o"
        o = self.node("Reshape", [o, "shape_o"], p + "o2")
        return self.linear(o, name + ".o_proj", attn.o_proj, p + "oo")

    def decoder_layer(self, i: int, layer: nn.Module, x: str) -> str:
        """Layer ``i`` over the residual stream ``x [A, Hd]``: pre-norm attention and SiLU MLP."""
        name, p, mlp = f"model.layers.{i}", f"l{i}_", layer.mlp
        h = self.rms(x, name + ".input_layernorm", layer.input_layernorm, p + "n1")
        x = self.node("Add", [x, self.attention(i, name + ".self_attn", layer.self_attn, h)], p + "x1")
        h = self.rms(x, name + ".post_attention_layernorm", layer.post_attention_layernorm, p + "n2")
        gate = self.linear(h, name + ".mlp.gate_proj", mlp.gate_proj, p + "g")
        up = self.linear(h, name + ".mlp.up_proj", mlp.up_proj, p + "u")
        silu = self.node("Mul", [gate, self.node("Sigmoid", [gate], p + "sg")], p + "silu")
        act = self.node("Mul", [silu, up], p + "a")
        return self.node(
            "Add", [x, self.linear(act, name + ".mlp.down_proj", mlp.down_proj, p + "d")], p + "x2"
        )


class OrtDecodeStep:
    """``step(cache, ids, positions, mask)``: the next-token logits of one decode step, every layer in one
    ONNX Runtime session (module docstring); :meth:`refresh` packs the module's current weights."""

    def __init__(self, module: nn.Module):
        config = module.config
        self.model = module.model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.vocab, self.hidden = module.lm_head.out_features, config.hidden_size
        self.layers = len(self.model.layers)
        self.linears = len(_projections(module))
        self._graph, self._names = self._build_graph(module)
        self.session = None
        self.packed_at: tuple | None = None
        self.repacked = 0  # linears packed by the last refresh (as PackedDecodeCopy.repacked)
        self._sources: dict[str, torch.Tensor] = {}

    def _build_graph(self, module: nn.Module) -> tuple[bytes, dict[str, str]]:
        """The serialized graph, and each initializer's parameter path in ``module``."""
        from onnx import TensorProto, helper

        kv, dim, scale = self.kv_heads, self.dim, self.model.layers[0].self_attn.scaling
        g = _Graph(self.heads, kv, dim, float(module.config.rms_norm_eps), scale)
        x = "x"
        for i, layer in enumerate(self.model.layers):
            x = g.decoder_layer(i, layer, x)
        g.linear(g.rms(x, "model.norm", self.model.norm, "fn"), "lm_head", module.lm_head, "logits")
        value, f32 = helper.make_tensor_value_info, TensorProto.FLOAT
        cache = [value(f"{kind}{i}", f32, ["A", kv, "C", dim]) for kind in "kv" for i in range(self.layers)]
        new = [value(f"n{kind}{i}", f32, ["A", kv, 1, dim]) for i in range(self.layers) for kind in "kv"]
        present = [
            value(f"p{kind}{i}", f32, ["A", kv, "C", dim]) for i in range(self.layers) for kind in "kv"
        ]
        graph = helper.make_graph(
            g.nodes,
            "decode_step",
            [
                value("x", f32, ["A", self.hidden]),
                value("cos", f32, ["A", dim]),
                value("sin", f32, ["A", dim]),
                value("seqlens", TensorProto.INT32, ["A"]),
                value("total", TensorProto.INT32, []),
                value("bias", f32, ["A", 1, 1, "L"]),
                *cache,
            ],
            [value("logits", f32, ["A", self.vocab]), *new, *present],
            g.initializers + g.constants,
        )
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        model = helper.make_model(graph, opset_imports=opsets, ir_version=9)
        paths = {id(t): name for name, t in module.named_parameters(remove_duplicate=False)}
        names = {name: paths[id(t)] for name, t in g.weights.items()}
        return model.SerializeToString(), names

    def refresh(self, module: nn.Module, *, trainable_moved: bool = True) -> int:
        """Build the session over ``module`` 's current weights where they may have moved since the last build
        (``trainable_moved``, or any weight written since); MLAS prepacks every GEMM weight here. Returns the
        linears packed (0: the session was kept)."""
        params = dict(module.named_parameters(remove_duplicate=False))
        weights = {name: params[path] for name, path in self._names.items()}
        versions = tuple((t.data_ptr(), t._version) for t in weights.values())
        if self.session is not None and not trainable_moved and versions == self.packed_at:
            self.repacked = 0
            return 0
        with torch.no_grad():  # fp32 contiguous: the parameters themselves where they are
            sources = {name: t.detach().float().contiguous() for name, t in weights.items()}
        try:
            self.session = memory_session(self._graph, sources, optimization="all")
        except Exception as exc:  # noqa: BLE001 - onnxruntime's own error types
            raise RlkitError(
                f"{SETTING}: onnxruntime could not build the decode step's graph: {exc}"
            ) from exc
        self._sources, self.packed_at = sources, versions  # the memory the initializers were read from
        self.repacked = self.linears
        return self.linears

    @torch.no_grad()
    def __call__(self, cache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Write token ``ids [A, 1]`` at ``positions [A]`` into ``cache`` (a ``SlabCache`` holding ``L - 1``
        positions) and return its next-token logits ``[A, V]``; ``mask [A, L]``: 1 where a position is
        attended (0: left padding)."""
        if self.session is None:
            raise RlkitError(f"{SETTING}: the decode step's graph was used before refresh(); a bug in rlkit.")
        a, filled = ids.shape[0], mask.shape[1] - 1
        x = self.model.embed_tokens(ids)  # [A, 1, h]
        cos, sin = self.model.rotary_emb(x, positions[:, None])  # [A, 1, D]
        slabs = cache.layers
        if slabs[0].key_slab.dtype != torch.float32:  # ort_step_for takes fp32 modules only
            raise RlkitError(
                f"{SETTING}: the graph step got a {slabs[0].key_slab.dtype} cache; a bug in rlkit."
            )
        bias = torch.zeros(a, 1, 1, filled + 1)  # [A, 1, 1, L]: -inf over left padding; the new key attended
        bias[:, 0, 0, :filled].masked_fill_(~mask[:, :filled].bool(), float("-inf"))
        feeds = {"x": x[:, 0].contiguous(), "cos": cos[:, 0].contiguous(), "sin": sin[:, 0].contiguous()}
        feeds["bias"] = bias
        for i, slab in enumerate(slabs):
            if slab.length != filled:
                raise RlkitError(
                    f"{SETTING}: cache layer {i} holds {slab.length} positions, not {filled}; a bug."
                )
            feeds[f"k{i}"], feeds[f"v{i}"] = slab.key_slab, slab.value_slab
        logits = torch.empty(a, self.vocab)
        new = [
            (torch.empty(a, self.kv_heads, 1, self.dim), torch.empty(a, self.kv_heads, 1, self.dim))
            for _ in slabs
        ]
        outputs = {"logits": logits} | {f"nk{i}": k for i, (k, _) in enumerate(new)}
        outputs |= {f"nv{i}": v for i, (_, v) in enumerate(new)}
        # the cache buffers are GroupQueryAttention's past and present at once (it writes position L - 1)
        outputs |= {f"p{kind}{i}": feeds[f"{kind}{i}"] for i in range(len(slabs)) for kind in "kv"}
        binding = self.session.io_binding()
        for name, t in feeds.items():
            binding.bind_input(name, "cpu", 0, np.float32, list(t.shape), t.data_ptr())
        seqlens = torch.full((a,), filled, dtype=torch.int32)  # per row: positions before the new one
        total = torch.tensor(filled + 1, dtype=torch.int32)
        binding.bind_input("seqlens", "cpu", 0, np.int32, [a], seqlens.data_ptr())
        binding.bind_input("total", "cpu", 0, np.int32, [], total.data_ptr())
        for name, t in outputs.items():
            binding.bind_output(name, "cpu", 0, np.float32, list(t.shape), t.data_ptr())
        self.session.run_with_iobinding(binding)
        for slab, (k, v) in zip(slabs, new, strict=True):
            slab.update(k, v)  # the slab's count of filled positions (the values are already at L - 1)
        return logits
