"""rollout.backend: {name: hf, dtype: float16} on the CPU (rlkit.rollout.fp16_weights): fbgemm's fp16-weight
linears compute what fp32 linears compute on fp16-rounded weights; the decode copy follows the actor's
updates, repacking only what changed (a LoRA run's frozen base never)."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import chat_prompts
from torch import nn

from rlkit.errors import RlkitError
from rlkit.hardware import fp16_weights_unavailable
from rlkit.model.load import load_model, load_tokenizer
from rlkit.recipe.schema import LoraConfig, ModelConfig, RolloutConfig
from rlkit.rollout.fp16_weights import Fp16DecodeCopy, Fp16Linear
from rlkit.rollout.hf import HFRollout

pytestmark = pytest.mark.skipif(
    fp16_weights_unavailable() is not None, reason="no fbgemm in this torch build"
)


def _rounded(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose linear weights (PEFT adapters' aside) are rounded to fp16 and kept fp32: the
    model the fp16 decode copy computes."""
    twin = copy.deepcopy(module)
    with torch.no_grad():
        for name, m in twin.named_modules():
            if type(m) is nn.Linear and "lora_" not in name:
                m.weight.copy_(m.weight.half().float())
    return twin


def _linears(module: nn.Module) -> int:
    return sum(type(m) is nn.Linear and "lora_" not in name for name, m in module.named_modules())


def test_fp16_linear_is_the_plain_sum_over_fp16_rounded_weights():
    torch.manual_seed(0)
    linear = nn.Linear(40, 24)
    x = torch.randn(2, 3, 40)
    got = Fp16Linear(linear)(x)  # [2, 3, 24]
    w16, b = linear.weight.detach().half().double(), linear.bias.detach().double()
    want = torch.empty(2, 3, 24, dtype=torch.float64)
    for i in range(2):  # the plain loop
        for t in range(3):
            for o in range(24):
                want[i, t, o] = (x[i, t].double() * w16[o]).sum() + b[o]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 24)
    # the fp32 linear differs: the weights really were rounded (by up to 2^-11 relative)
    assert not torch.allclose(got, linear(x), atol=1e-7, rtol=0)


@pytest.mark.parametrize("rows", [1, 8, 16])
def test_a_fused_group_gives_each_member_what_its_own_linear_gives(rows):
    """q/k/v as one fbgemm matrix (``Fp16FusedLinear``; k without a bias, so its share is zero): each
    member's slice of the one GEMM equals its own ``Fp16Linear`` bit for bit."""
    from rlkit.rollout.fp16_weights import Fp16FusedLinear

    torch.manual_seed(1)
    linears = [nn.Linear(64, 64), nn.Linear(64, 16, bias=False), nn.Linear(64, 16)]
    group = Fp16FusedLinear(linears, ("q_proj", "k_proj", "v_proj"))
    x = torch.randn(rows, 64)
    for linear, got in zip(linears, group.run(x).split(group.splits, dim=-1), strict=True):
        assert torch.equal(got, Fp16Linear(linear)(x))


def test_fp16_decode_copy_matches_rounded_weights_and_repacks_only_after_an_update(tiny_model_dir):
    """Through the registered backend, as the worker builds it: the same tokens as the plain fp32 loop over
    the fp16-rounded model and log-probs within float rounding, before and after a fused AdamW step on the
    actor's weights (which writes them without bumping their version counter) handed over by update_weights;
    a generate with no hand-over since the last one repacks nothing; the actor's fp32 weights stay
    untouched."""
    from rlkit.plugin.manager import make_plugin_manager
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve

    tok = load_tokenizer(ModelConfig(path=str(tiny_model_dir)))
    model = load_model(ModelConfig(path=str(tiny_model_dir)), tokenizer=tok).eval()
    backend = {"name": "hf", "dtype": "float16"}
    spec, problems = resolve(
        "rollout.backend",
        "rollout_backends",
        backend,
        build_registries(make_plugin_manager(entry_points=False)),
    )  # as the driver resolves it
    assert not problems, problems
    fast = spec.build(
        module=model,
        tokenizer=tok,
        max_response_length=12,
        seed=3,
        rollout_config=RolloutConfig(n=3, temperature=1.0, backend=backend),
    )
    assert isinstance(fast, HFRollout) and fast.decode_dtype == torch.float16
    p, n = chat_prompts(tok), _linears(model)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    for _ in range(2):
        plain = HFRollout(
            module=_rounded(model),
            tokenizer=tok,
            max_response_length=12,
            seed=3,
            rollout_config=RolloutConfig(n=3, temperature=1.0),
        )
        fast.generator.manual_seed(3)
        got, want = fast.generate(p), plain.generate(p)
        assert torch.equal(got["responses"], want["responses"])
        torch.testing.assert_close(got["rollout_log_probs"], want["rollout_log_probs"], atol=1e-4, rtol=1e-4)
        # trainable weights are repacked once per hand-over (the fused AdamW step does not bump their version)
        assert got.meta["metrics"]["rollout/fp16_repacked_linears"] == float(n)
        fast.generator.manual_seed(3)  # a second generate before the next hand-over (a multi-turn step's)
        again = fast.generate(p)
        assert again.meta["metrics"]["rollout/fp16_repacked_linears"] == 0.0
        assert torch.equal(again["responses"], got["responses"])
        # fp32 actor untouched
        assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
        # the actor's optimizer (fsdp.py)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
        model(**tok(["What is 2 + 3?"], return_tensors="pt")).logits.square().mean().backward()
        optimizer.step()  # the next generate must see it
        assert not all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
        before = {name: t.clone() for name, t in model.state_dict().items()}
        fast.update_weights(model)  # the hybrid engine hands the same module back


def test_lora_frozen_base_is_packed_once_and_the_adapter_follows(tiny_model_dir):
    """With a PEFT adapter the base linears are packed when the copy is made and never again; the adapter's
    own layers stay fp32 and are copied at every refresh; the output is the rounded base plus the current
    adapter."""
    from rlkit.model.lora import apply_lora

    tok = load_tokenizer(ModelConfig(path=str(tiny_model_dir)))
    torch.manual_seed(0)
    model, _ = apply_lora(
        load_model(ModelConfig(path=str(tiny_model_dir)), tokenizer=tok).eval(),
        LoraConfig(rank=4, target_modules="all-linear"),
    )
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    fp16 = Fp16DecodeCopy(model)
    fp16.refresh(model)  # the first generate's refresh reports the construction's packing
    assert fp16.repacked == _linears(model) > 0
    ids = tok(["What is 2 + 3?"], return_tensors="pt")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: give the adapter an effect
                p.add_(0.1 * torch.randn_like(p))
        out = fp16.refresh(model)(**ids).logits
        want = _rounded(model)(**ids).logits
    assert fp16.repacked == 0  # only adapter tensors changed
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    base = [m for name, m in model.named_modules() if type(m) is nn.Linear and "lora_" not in name]
    with torch.no_grad():  # a frozen weight written in place (load_state_dict does this): repacked, alone
        base[0].weight.copy_(base[0].weight * 1.5)
        torch.testing.assert_close(
            fp16.refresh(model)(**ids).logits, _rounded(model)(**ids).logits, atol=1e-4, rtol=1e-4
        )
    assert fp16.repacked == 1
    assert not torch.allclose(
        out, load_model(ModelConfig(path=str(tiny_model_dir)), tokenizer=tok).eval()(**ids).logits, atol=1e-3
    )  # the adapter's change reached the copy
    # the actor's flags untouched
    assert {name: p.requires_grad for name, p in model.named_parameters()} == grads


def test_float16_without_fbgemm_is_refused_at_validation_naming_the_fix(monkeypatch):
    """Where torch has no fbgemm (not x86 / no AVX2), rollout.backend.dtype=float16 is an error when the run
    is planned, naming the key and the fix, never a crash inside the worker."""
    import rlkit.hardware as hardware
    import rlkit.hardware.precision

    # where concrete_decode_dtype looks it up
    monkeypatch.setattr(
        rlkit.hardware.precision, "fp16_weights_unavailable", lambda: "this torch build has no fbgemm"
    )
    with pytest.raises(
        RlkitError, match=r"rollout.backend.dtype=float16: this torch build has no fbgemm.*float32"
    ):
        hardware.resolve_precision("auto", "float16", "cpu")
    assert hardware.resolve_precision("auto", "float32", "cpu").decode_dtype == "float32"
    # CUDA: a plain fp16 copy, no fbgemm
    assert hardware.concrete_decode_dtype("float16", "cuda") == "float16"


def test_a_weight_beyond_fp16_range_is_an_error_naming_the_layer():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = 1e6
    with pytest.raises(RlkitError, match=r"float16: 1's weight holds 1e\+06, beyond fp16's range.*float32"):
        Fp16DecodeCopy(model)


def test_a_two_thread_worker_repacks_on_two_threads_to_the_same_weights(tiny_model_dir, monkeypatch):
    """With 2 torch threads the repack after an update runs on a pool of 2 packing threads (fbgemm's
    packing is single-threaded); the copy computes exactly what a 1-thread repack gives, and what the rounded
    model does."""
    import threading

    tok = load_tokenizer(ModelConfig(path=str(tiny_model_dir)))
    model = load_model(ModelConfig(path=str(tiny_model_dir)), tokenizer=tok).eval()
    ids = tok(["What is 2 + 3?"], return_tensors="pt")
    packers: set[str] = set()
    pack = Fp16Linear.pack

    def recorded(self, linear, name=""):
        packers.add(threading.current_thread().name)
        return pack(self, linear, name)

    monkeypatch.setattr(Fp16Linear, "pack", recorded)
    threads = torch.get_num_threads()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copies = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            fp16 = Fp16DecodeCopy(model)
            fp16.refresh(model)  # the construction's packing
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.01)  # an update: every trainable linear is repacked
                packers.clear()
                copies[n] = fp16.refresh(model, trainable_moved=True)(**ids).logits
            model.load_state_dict(before)
            assert fp16.repacked == _linears(model)
            if n == 1:  # packed in place, on the caller's thread
                assert packers == {threading.current_thread().name}
            else:  # by the packing pool (how many of its 2 threads took jobs is up to the scheduler)
                assert packers and all(t.startswith("rlkit-pack") for t in packers)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(copies[1], copies[2])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
        want = _rounded(model)(**ids).logits
    torch.testing.assert_close(copies[2], want, atol=5e-4, rtol=1e-3)  # fbgemm sums in another order
