"""The sglang backend's weight sync without SGLang (rlkit_sglang.sync): the in-memory payload read by another
process and its shared memory freed, buckets, the run's one weights folder and who removes it (close, exit,
the guard, the next run). The same paths against a real server: tests/engines/test_sglang_real.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("rlkit_sglang", reason="pip install -e plugins/rlkit-sglang")

from rlkit_sglang.launch import GUARD  # noqa: E402
from rlkit_sglang.sync import RunFolder, buckets, flattened_bucket_payload, sweep_stale  # noqa: E402

# What SGLang's scheduler does with the payload (model_runner._update_weights_from_flattened_bucket), in a
# process that inherits nothing from this one: unpickle, rebuild each tensor from its byte range, let go.
READER = """
import base64, json, pickle, sys, torch, torch.multiprocessing
bucket = pickle.loads(base64.b64decode(sys.stdin.read()))
flat = bucket["flattened_tensor"]
for m in bucket["metadata"]:
    t = flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)
    print(json.dumps([m.name, str(m.dtype), list(t.shape), t.double().sum().item()]))
del bucket, flat, t
"""


def _segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}


def test_flattened_bucket_is_read_by_another_process_and_its_shared_memory_freed():
    named = [
        ("a.weight", torch.randn(3, 4)),
        ("b.bias", torch.arange(5, dtype=torch.int64)),
        ("c.half", torch.randn(2, 3).to(torch.bfloat16)),
    ]
    before = _segments()
    payload, buffer = flattened_bucket_payload(named)
    assert len(_segments() - before) == 1  # one buffer for the bucket
    assert len(payload) < 2000  # the handle and metadata travel, not the tensors
    out = subprocess.run(
        [sys.executable, "-c", READER], input=payload, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r[:3] for r in rows] == [[name, str(t.dtype), list(t.shape)] for name, t in named]
    assert [r[3] for r in rows] == [t.double().sum().item() for _, t in named]
    del buffer
    deadline = time.monotonic() + 10
    while _segments() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _segments() - before, "the shared-memory segment outlived the sync"
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"  # the process default is back


def test_buckets_keep_order_and_size():
    t = torch.zeros(10)  # 40 bytes
    named = [(f"t{i}", t) for i in range(5)] + [("big", torch.zeros(100)), ("last", t)]
    groups = buckets(named, limit=100)
    assert [[n for n, _ in g] for g in groups] == [["t0", "t1"], ["t2", "t3"], ["t4"], ["big"], ["last"]]


def test_run_folder_is_one_folder_removed_by_remove(tmp_path):
    folder = RunFolder(str(tmp_path / "root"))
    path = folder.create()
    assert folder.create() == path and Path(path).parent == tmp_path / "root"
    assert Path(path).name.startswith(f"rlkit-sglang-{os.getpid()}-")
    (Path(path) / "model.safetensors").write_bytes(b"x" * 10)
    folder.remove()
    assert not Path(path).exists() and list((tmp_path / "root").iterdir()) == []


def test_run_folder_is_removed_at_interpreter_exit(tmp_path):
    code = (
        f"from rlkit_sglang.sync import RunFolder\nf = RunFolder({str(tmp_path)!r})\n"
        "open(f.create() + '/w', 'w').write('x')\nprint(f.path)\nraise SystemExit(3)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3 and out.stdout.strip().startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_a_killed_runs_folder_is_swept_by_the_next(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f"rlkit-sglang-{int(dead.stdout)}-abc"
    stale.mkdir()
    live = tmp_path / f"rlkit-sglang-{os.getppid()}-def"  # a live process's folder stays
    live.mkdir()
    other = tmp_path / "unrelated"
    other.mkdir()
    assert sweep_stale(str(tmp_path)) == [str(stale)]
    RunFolder(str(tmp_path)).create()  # what a new run does first
    assert not stale.exists() and live.exists() and other.exists()


def test_guard_removes_the_folder_when_its_launcher_is_killed(tmp_path):
    folder = tmp_path / "rlkit-sglang-run"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    launcher = (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, {GUARD!r}, str(os.getpid()), '--remove', {str(folder)!r}, "
        "sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
        "print(p.pid, flush=True)\ntime.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    guard = int(proc.stdout.readline())
    time.sleep(1.0)
    assert folder.exists()  # the launcher lives: the folder is its own
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not folder.exists()
    while os.path.exists(f"/proc/{guard}") and time.monotonic() < deadline:
        time.sleep(0.2)


def test_weight_sync_setting_decides_the_path():
    """``weight_sync``: auto = tensor for launched servers (same host), disk for attached ones; an explicit
    value wins; anything else is refused at validation."""
    from types import SimpleNamespace

    from pydantic import ValidationError
    from rlkit_sglang.backend import SglangRollout
    from rlkit_sglang.client import SglangClient
    from rlkit_sglang.params import SglangParams

    from rlkit.recipe.schema import RolloutConfig

    tok = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    clients = [SglangClient("http://127.0.0.1:9")]

    def built(**params) -> SglangRollout:
        return SglangRollout(
            tokenizer=tok,
            rollout_config=RolloutConfig(),
            max_response_length=4,
            clients=clients,
            params=SglangParams(**params),
        )

    assert built().weight_sync == "disk"  # given clients: servers it did not launch
    assert built(urls=["http://127.0.0.1:9"]).weight_sync == "disk"
    assert built(weight_sync="tensor").weight_sync == "tensor"
    with pytest.raises(ValidationError, match="weight_sync"):
        SglangParams(weight_sync="nfs")
