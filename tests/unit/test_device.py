"""One place decides device and process-group backend (rlkit.hardware.device_plan); CUDA asked for where
there is none is a validation error; GPU memory metrics under veRL's names on CUDA only. The ``cuda``
tests are skipped, with the reason, on a machine without a GPU (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from rlkit.hardware import device_plan, dist_backend, gpu_memory_metrics


def test_the_plan_on_a_machine_without_cuda():
    plan = device_plan("auto", cuda_available=False)
    assert (plan.device, plan.backend, plan.torch_device(0)) == ("cpu", "gloo", torch.device("cpu"))
    assert device_plan("cpu", cuda_available=True).backend == "gloo"
    with pytest.raises(ValueError, match=r"resources.device=cpu \(or auto\).*CUDA build of torch"):
        device_plan("cuda", cuda_available=False)
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        device_plan("tpu")


def test_the_plan_where_torch_sees_cuda():
    plan = device_plan("auto", cuda_available=True)
    assert (plan.device, plan.backend, plan.torch_device(1)) == ("cuda", "nccl", torch.device("cuda:1"))
    assert dist_backend(torch.device("cuda:1")) == "nccl" and dist_backend("cpu") == "gloo"


def test_no_gpu_memory_metrics_on_a_cpu():
    assert gpu_memory_metrics(torch.device("cpu")) == {}


def test_validate_refuses_cuda_where_there_is_none(monkeypatch, tmp_path):
    from rlkit.errors import RecipeError
    from rlkit.recipe import validate_recipe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "train.parquet").write_bytes(b"")
    raw = {
        "model": {"path": str(tmp_path)},
        "data": {"train_files": [str(tmp_path / "train.parquet")]},
        "rollout": {"n": 2},
        "resources": {"device": "cuda"},
    }
    with pytest.raises(RecipeError) as err:
        validate_recipe(raw)
    problems = dict(err.value.problems)
    assert (
        "sees no GPU" in problems["resources.device"]
        and "resources.device=cpu" in problems["resources.device"]
    )
    validate_recipe(raw, check_files=False)  # the machine checks are the ones --no-check-files skips
    validate_recipe(raw, ["resources.device=auto"])


@pytest.mark.cuda
def test_on_cuda_the_plan_is_nccl_and_bf16():
    plan = device_plan("auto")
    assert (plan.device, plan.backend) == ("cuda", "nccl")
    assert plan.precision().mixed_precision == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")


@pytest.mark.cuda
def test_on_cuda_gpu_memory_metrics_are_reported():
    x = torch.ones(1024, 1024, 64, device="cuda")  # 256 MiB
    metrics = gpu_memory_metrics(x.device)
    assert metrics["perf/max_memory_allocated_gb"] >= 0.25
    assert metrics["perf/max_memory_reserved_gb"] >= metrics["perf/max_memory_allocated_gb"]


@pytest.mark.cuda
def test_on_cuda_one_fsdp2_step_over_nccl(tiny_model_dir):
    """A world-size-1 NCCL group chosen by device_plan, the tiny model FSDP2-wrapped on cuda:0, one
    forward/backward/optimizer step: finite loss, moved weights, memory metrics present."""
    code = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from rlkit.hardware import device_plan, gpu_memory_metrics
        from rlkit.model.load import load_model
        from rlkit.recipe.schema import ModelConfig
        from rlkit.model import fsdp
        from rlkit.workers.base import find_free_port
        plan = device_plan("auto")
        device = plan.torch_device(0)
        torch.cuda.set_device(device)
        address = f"tcp://127.0.0.1:{{find_free_port()}}"
        dist.init_process_group(plan.backend, init_method=address, rank=0, world_size=1)
        model = load_model(ModelConfig(path={str(tiny_model_dir)!r}))
        module = fsdp.fsdp_wrap(model, device, plain_at_world_size_1=False)  # FSDP2 even at world size 1
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
        before = [p.detach().full_tensor().clone() for p in module.parameters()]
        ids = torch.randint(0, 100, (2, 16), device=device)
        loss = module(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        after = [p.detach().full_tensor() for p in module.parameters()]
        moved = any(not torch.equal(b, a) for b, a in zip(before, after))
        memory = sorted(gpu_memory_metrics(device))
        print("RESULT", dist.get_backend(), bool(torch.isfinite(loss)), moved, memory)
        dist.destroy_process_group()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
    assert line == ("RESULT nccl True True ['perf/max_memory_allocated_gb', 'perf/max_memory_reserved_gb']")
