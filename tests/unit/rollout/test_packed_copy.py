"""Which linears a packed decode copy fuses (rlkit.rollout.packed_copy.sibling_groups) and how a fused
group serves its members (FusedOutputs): one GEMM per input, a fresh one for any other call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlkit.rollout.packed_copy import FusedOutputs, sibling_groups


class _Attention(nn.Module):
    def __init__(self, kv_in: int = 8):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(kv_in, 4), nn.Linear(8, 4)
        self.o_proj = nn.Linear(8, 8)


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)


def _names(module: nn.Module) -> list[str]:
    return [name for name, m in module.named_modules() if type(m) is nn.Linear]


def test_q_k_v_and_gate_up_of_each_layer_are_grouped_in_order_the_rest_alone():
    model = nn.ModuleDict({"attn": _Attention(), "mlp": _Mlp(), "head": nn.Linear(8, 3)})
    units = sibling_groups(model, _names(model))
    assert units == [
        ("attn.q_proj", "attn.k_proj", "attn.v_proj"),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("attn.o_proj",),
        ("mlp.down_proj",),
        ("head",),
    ]


def test_an_incomplete_or_mismatched_set_stays_unfused():
    odd = nn.ModuleDict({"attn": _Attention(kv_in=6)})  # k_proj reads another width
    assert sibling_groups(odd, _names(odd)) == [(n,) for n in _names(odd)]
    partial = nn.ModuleDict({"attn": _Attention()})
    names = [n for n in _names(partial) if n != "attn.v_proj"]  # v_proj not packable (a LoRA-wrapped one)
    assert sibling_groups(partial, names) == [(n,) for n in names]


def test_lora_wrapped_projections_are_not_grouped():
    from peft import LoraConfig, get_peft_model

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = _Attention()

        def forward(self, x):
            return self.attn.q_proj(x)

    model = get_peft_model(Wrapper(), LoraConfig(r=2, target_modules=["q_proj"]))
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and "lora_" not in n]
    assert any(n.endswith("q_proj.base_layer") for n in names)
    assert all(len(unit) == 1 for unit in sibling_groups(model, names))


def test_a_group_runs_its_gemm_once_per_input_and_afresh_for_any_other_call():
    calls: list[torch.Tensor] = []

    class Tripled(FusedOutputs):  # members 0, 1, 2: x, 2x, 3x
        in_features, splits = 2, [2, 2, 2]

        def run(self, x):
            calls.append(x)
            return torch.cat([x, 2 * x, 3 * x], dim=-1)

    group = Tripled()
    x = torch.ones(1, 2)
    assert [group.output(x, i)[0, 0].item() for i in range(3)] == [1.0, 2.0, 3.0]
    assert len(calls) == 1 and group.input is None and group.outputs == ()  # nothing held after the last
    y = torch.ones(1, 2)  # equal values, another tensor: another GEMM
    group.output(x, 0)
    assert group.output(y, 1)[0, 0].item() == 2.0 and len(calls) == 3
    group.output(y, 1)  # the same member twice (a model calling it again): run afresh
    assert len(calls) == 4


@pytest.mark.parametrize("rows", [1, 8, 37])
def test_a_fused_bf16_group_computes_what_its_linears_compute_one_by_one(rows):
    from rlkit.rollout.bf16_weights import Bf16FusedLinear, Bf16Linear, bf16_weights_unavailable

    if bf16_weights_unavailable():
        pytest.skip(bf16_weights_unavailable())
    torch.manual_seed(0)
    attention = _Attention()
    attention.k_proj.bias = None  # a member without bias among members with one
    linears = [attention.q_proj, attention.k_proj, attention.v_proj]
    fused = Bf16FusedLinear(linears, ("q_proj", "k_proj", "v_proj"))
    x = torch.randn(2, rows, 8)
    for i, linear in enumerate(linears):
        torch.testing.assert_close(fused.output(x, i), Bf16Linear(linear)(x), atol=1e-6, rtol=2**-8)
    with torch.no_grad():
        attention.v_proj.weight.mul_(2)
    fused.pack(linears, ("q_proj", "k_proj", "v_proj"))  # a repack follows the weights
    torch.testing.assert_close(fused.output(x, 2), Bf16Linear(attention.v_proj)(x), atol=1e-6, rtol=2**-8)
