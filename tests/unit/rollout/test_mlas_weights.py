"""rollout.backend: {name: hf, linears: onnxruntime} (rlkit.rollout.mlas_weights): ONNX Runtime's fp32 GEMM
on prepacked weights computes what ``F.linear`` computes; the decode copy gives the fp32 loop's tokens and
log-probs and follows the actor's updates, repacking once per hand-over."""

from __future__ import annotations

import pytest
import torch
from _models import chat_prompts
from torch import nn

from rlkit.errors import RlkitError
from rlkit.hardware import onnxruntime_unavailable
from rlkit.model.load import load_model, load_tokenizer
from rlkit.recipe.schema import ModelConfig, RolloutConfig
from rlkit.rollout.hf import HFRollout

pytestmark = pytest.mark.skipif(onnxruntime_unavailable() is not None, reason="onnxruntime not installed")


@pytest.mark.parametrize("bias", [True, False])
def test_mlas_linear_is_the_plain_sum(bias):
    from rlkit.rollout.mlas_weights import MlasLinear

    torch.manual_seed(0)
    linear = nn.Linear(40, 24, bias=bias)
    x = torch.randn(2, 3, 40)
    got = MlasLinear(linear)(x)  # [2, 3, 24]
    w = linear.weight.detach().double()
    b = linear.bias.detach().double() if bias else torch.zeros(24, dtype=torch.float64)
    want = torch.empty(2, 3, 24, dtype=torch.float64)
    for i in range(2):  # the plain loop
        for t in range(3):
            for o in range(24):
                want[i, t, o] = (x[i, t].double() * w[o]).sum() + b[o]
    assert got.dtype == torch.float32 and got.shape == (2, 3, 24)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)
    # packed at build time: a later write to the weight is not seen until the next pack
    with torch.no_grad():
        linear.weight.mul_(2)
    torch.testing.assert_close(MlasLinear(linear)(x), linear(x), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(got, linear(x), atol=1e-3)


@pytest.mark.parametrize("graph", [True, False], ids=["one-graph-step", "per-linear-sessions"])
def test_onnxruntime_linears_match_fp32_and_repack_once_per_hand_over(tiny_model_dir, graph):
    """Through the registered backend, as the worker builds it: the same tokens as the plain fp32 loop and
    log-probs within float rounding, before and after a fused AdamW step handed over by update_weights; a
    second generate before the next hand-over repacks nothing. The tiny Qwen2 decodes on one ONNX Runtime
    graph per step (rlkit.rollout.ort_step); told its MLP is not SiLU, on the copy's per-linear sessions
    (MlasDecodeCopy)."""
    from rlkit.plugin.manager import make_plugin_manager
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve

    tok = load_tokenizer(ModelConfig(path=str(tiny_model_dir)))
    model = load_model(ModelConfig(path=str(tiny_model_dir)), tokenizer=tok).eval()
    if not graph:
        model.config.hidden_act = "gelu"  # the graph declines it; the module itself still runs SiLU
    backend = {"name": "hf", "dtype": "float32", "linears": "onnxruntime"}
    spec, problems = resolve(
        "rollout.backend",
        "rollout_backends",
        backend,
        build_registries(make_plugin_manager(entry_points=False)),
    )
    assert not problems, problems
    fast = spec.build(
        module=model,
        tokenizer=tok,
        max_response_length=12,
        seed=3,
        rollout_config=RolloutConfig(n=3, temperature=1.0, backend=backend),
    )
    plain = HFRollout(
        module=model, tokenizer=tok, max_response_length=12, seed=3, rollout_config=RolloutConfig(n=3)
    )
    assert isinstance(fast, HFRollout) and fast.linears == "onnxruntime"
    p = chat_prompts(tok)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    for _ in range(2):
        fast.generator.manual_seed(3)
        plain.generator.manual_seed(3)
        got, want = fast.generate(p), plain.generate(p)
        assert torch.equal(got["responses"], want["responses"])
        torch.testing.assert_close(got["rollout_log_probs"], want["rollout_log_probs"], atol=1e-5, rtol=1e-5)
        assert got.meta["metrics"]["rollout/mlas_repacked_linears"] == float(linears)
        assert got.meta["metrics"]["rollout/lean_step"] == 1.0
        assert got.meta["metrics"].get("rollout/onnxruntime_graph_step") == (1.0 if graph else None)
        fast.generator.manual_seed(3)
        again = fast.generate(p)
        assert again.meta["metrics"]["rollout/mlas_repacked_linears"] == 0.0
        assert torch.equal(again["responses"], got["responses"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
        model(**tok(["What is 2 + 3?"], return_tensors="pt")).logits.square().mean().backward()
        optimizer.step()  # the next generate must see it
        fast.update_weights(model)


def test_onnxruntime_linears_refuse_what_they_cannot_run(tiny_model_dir):
    tok = load_tokenizer(ModelConfig(path=str(tiny_model_dir)))
    model = load_model(ModelConfig(path=str(tiny_model_dir)), tokenizer=tok)
    from rlkit.builtin.params import HFRolloutParams

    with pytest.raises(RlkitError, match="linears=onnxruntime decodes on the CPU in float32"):
        HFRollout(
            module=model,
            tokenizer=tok,
            max_response_length=4,
            rollout_config=RolloutConfig(n=1),
            params=HFRolloutParams(dtype="float16", linears="onnxruntime"),
        )
