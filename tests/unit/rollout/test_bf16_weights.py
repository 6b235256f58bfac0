"""rollout.backend: {name: hf, dtype: bfloat16} on the CPU (rlkit.rollout.bf16_weights): oneDNN's packed bf16
linears compute what a linear computes on bf16-rounded activations and weights (autocast's numerics), the
rest of the decode stays fp32, and the decode copy follows the actor's updates, repacking only after a
hand-over."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _models import chat_prompts
from torch import nn

from rlkit.model.load import load_model, load_tokenizer
from rlkit.recipe.schema import ModelConfig, RolloutConfig
from rlkit.rollout.bf16_weights import Bf16DecodeCopy, Bf16Linear, bf16_weights_unavailable
from rlkit.rollout.hf import HFRollout
from rlkit.rollout.packed_copy import FusedMember

pytestmark = pytest.mark.skipif(bf16_weights_unavailable() is not None, reason="no oneDNN in this torch")


class _AutocastLinear(nn.Module):
    """The model the bf16 decode copy computes, by hand: bf16-rounded input and weight, the product rounded to
    bf16, handed back fp32."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.linear.weight
        y = F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16)).float()
        return y if self.linear.bias is None else y + self.linear.bias


def _autocast_twin(module: nn.Module) -> nn.Module:
    twin = copy.deepcopy(module)
    for name, m in list(twin.named_modules()):
        if type(m) is nn.Linear:
            parent, _, child = name.rpartition(".")
            setattr(twin.get_submodule(parent) if parent else twin, child, _AutocastLinear(m))
    return twin


@pytest.mark.parametrize("rows", [1, 8, 37])  # a decode step's few rows and a prefill's many
def test_bf16_linear_is_the_plain_sum_over_bf16_rounded_inputs_and_weights(rows):
    torch.manual_seed(0)
    linear = nn.Linear(40, 24)
    x = torch.randn(2, rows, 40)
    got = Bf16Linear(linear)(x)  # [2, rows, 24]
    xb, wb, b = x.bfloat16().double(), linear.weight.detach().bfloat16().double(), linear.bias.detach()
    want = torch.empty(2, rows, 24, dtype=torch.float64)
    for i in range(2):  # the plain loop
        for t in range(rows):
            for o in range(24):
                want[i, t, o] = (xb[i, t] * wb[o]).sum()
    want = want.to(torch.bfloat16).float() + b  # the product rounded to bf16 (fp32 accumulation inside)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=2**-8)  # one bf16 rounding step apart at most
    assert got.dtype == torch.float32 and got.shape == (2, rows, 24)
    # the fp32 linear differs: the inputs and weights really were rounded
    assert not torch.allclose(got, linear(x), atol=1e-5, rtol=0)
    torch.testing.assert_close(got, _AutocastLinear(linear)(x), atol=0, rtol=0)  # what autocast computes


def test_bf16_decode_copy_matches_the_autocast_model_and_repacks_only_after_an_update(tiny_model_dir):
    """Through the registered backend, as the worker builds it: the same tokens as the plain fp32 loop over
    the model whose linears compute in bf16 as autocast's do, log-probs within float rounding, before and
    after a fused AdamW step handed over by update_weights; no repack without a hand-over; the copy's norms,
    embedding and KV cache stay fp32; the actor's weights untouched."""
    from rlkit.plugin.manager import make_plugin_manager
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve

    tok = load_tokenizer(ModelConfig(path=str(tiny_model_dir)))
    model = load_model(ModelConfig(path=str(tiny_model_dir)), tokenizer=tok).eval()
    backend = {"name": "hf", "dtype": "bfloat16"}
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
    assert isinstance(fast, HFRollout) and fast.decode_dtype == torch.bfloat16
    p = chat_prompts(tok)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    before = {name: t.clone() for name, t in model.state_dict().items()}
    for _ in range(2):
        plain = HFRollout(
            module=_autocast_twin(model),
            tokenizer=tok,
            max_response_length=12,
            seed=3,
            rollout_config=RolloutConfig(n=3, temperature=1.0),
        )
        fast.generator.manual_seed(3)
        got, want = fast.generate(p), plain.generate(p)
        assert torch.equal(got["responses"], want["responses"])
        torch.testing.assert_close(got["rollout_log_probs"], want["rollout_log_probs"], atol=1e-5, rtol=1e-5)
        assert isinstance(fast._packed_copy, Bf16DecodeCopy)
        copy_module = fast._packed_copy.module
        assert sum(isinstance(m, Bf16Linear | FusedMember) for m in copy_module.modules()) == linears
        layers = len(model.model.layers)  # q/k/v and gate/up fused in every layer: 2 GEMMs where 5 were
        assert sum(isinstance(m, FusedMember) for m in copy_module.modules()) == 5 * layers
        assert len({id(m.group) for m in copy_module.modules() if isinstance(m, FusedMember)}) == 2 * layers
        assert all(p.dtype == torch.float32 for p in copy_module.parameters())  # norms, embedding: fp32
        assert got.meta["metrics"]["rollout/bf16_repacked_linears"] == float(linears)
        assert got.meta["metrics"]["rollout/lean_step"] == 1.0
        fast.generator.manual_seed(3)  # a second generate before the next hand-over (a multi-turn step's)
        again = fast.generate(p)
        assert again.meta["metrics"]["rollout/bf16_repacked_linears"] == 0.0
        assert torch.equal(again["responses"], got["responses"])
        assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)  # the actor's (fsdp.py)
        model(**tok(["What is 2 + 3?"], return_tensors="pt")).logits.square().mean().backward()
        optimizer.step()  # writes the weights without bumping their version: the hand-over says so
        assert not all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
        before = {name: t.clone() for name, t in model.state_dict().items()}
        fast.update_weights(model)


def test_lora_base_is_packed_in_bf16_and_the_adapter_runs_in_fp32(tiny_model_dir):
    """With a PEFT adapter the base linears are packed once (the adapter's own layers stay fp32 and are copied
    at every refresh): the copy computes the autocast-like base plus the current fp32 adapter."""
    from rlkit.model.lora import apply_lora
    from rlkit.recipe.schema import LoraConfig

    tok = load_tokenizer(ModelConfig(path=str(tiny_model_dir)))
    torch.manual_seed(0)
    model, _ = apply_lora(
        load_model(ModelConfig(path=str(tiny_model_dir)), tokenizer=tok).eval(),
        LoraConfig(rank=4, target_modules="all-linear"),
    )
    bases = [m for name, m in model.named_modules() if type(m) is nn.Linear and "lora_" not in name]
    packed = Bf16DecodeCopy(model)
    packed.refresh(model)  # the first generate's refresh reports the construction's packing
    assert packed.repacked == len(bases) > 0
    ids = tok(["What is 2 + 3?"], return_tensors="pt")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: give the adapter an effect
                p.add_(0.1 * torch.randn_like(p))
        out = packed.refresh(model)(**ids).logits
        twin = copy.deepcopy(model)
        for name, m in list(twin.named_modules()):  # the base linears only: the adapter stays fp32
            if type(m) is nn.Linear and "lora_" not in name:
                parent, _, child = name.rpartition(".")
                setattr(twin.get_submodule(parent) if parent else twin, child, _AutocastLinear(m))
        want = twin(**ids).logits
    assert packed.repacked == 0  # only adapter tensors changed
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    adapters = [m for name, m in packed.module.named_modules() if "lora_" in name and type(m) is nn.Linear]
    assert adapters and all(m.weight.dtype == torch.float32 for m in adapters)
