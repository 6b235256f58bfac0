"""``rlkit eval`` as a user runs it (a subprocess, the suite's tiny model, arithmetic sums): an HF folder and
a PEFT adapter, what it writes, ``--compare``, resume after SIGKILL, and the clear errors before any
generation. (An rlkit checkpoint, and agreement with the run's own validation: tests/e2e/test_eval.py.)"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rlkit_harness import rlkit_env, start
from rlkit_harness import run as run_rlkit


@pytest.fixture(scope="module")
def sums(tmp_path_factory) -> Path:
    from rlkit.data import generate_arithmetic

    root = tmp_path_factory.mktemp("eval-data")
    generate_arithmetic(root, train_size=4, test_size=6, seed=0)
    return root / "test.parquet"


def env(tmp: Path) -> dict[str, str]:
    return rlkit_env(RLKIT_CACHE=str(Path.home() / ".cache" / "rlkit"))


def test_eval_of_an_hf_folder_writes_results_parquet_mlflow_and_compares(tiny_model_dir, sums, tmp_path):
    out = tmp_path / "base"
    args = [
        "eval",
        str(tiny_model_dir),
        "--data",
        str(sums),
        "--out",
        str(out),
        "--n",
        "2",
        "--temperature",
        "1.0",
        "--top-p",
        "0.9",
        "--max-new-tokens",
        "5",
        "--seed",
        "3",
        "--batch-size",
        "4",
        "--bootstrap",
        "50",
        "--no-progress",
        "data.max_prompt_length=256",
    ]
    result = run_rlkit(*args, env=env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "val-core/rlkit/arithmetic/pass@2" in result.stdout  # the terminal table
    assert "eval: 100%" not in result.stderr  # --no-progress

    results = json.loads((out / "results.json").read_text())
    assert results["model_kind"] == "hf" and results["prompts"] == 6 and results["samples"] == 12
    assert results["sampling"] == {
        "n": 2,
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 0.9,
        "max_new_tokens": 5,
        "seed": 3,
        "backend": "hf",
    }
    metrics = results["metrics"]
    for key in ("score/mean@2", "score/best@2", "pass@1", "pass@2", "maj@2"):
        m = metrics[f"val-core/rlkit/arithmetic/{key}"]
        assert m["ci_low"] <= m["value"] <= m["ci_high"], key
    assert metrics["val-aux/rlkit/arithmetic/response_length/max"]["value"] <= 5
    assert "| val-core/rlkit/arithmetic/pass@1 |" in (out / "results.md").read_text()

    table = pq.read_table(out / "generations.parquet").to_pydict()
    assert len(table["response"]) == 12 and set(table["data_source"]) == {"rlkit/arithmetic"}
    assert {"prompt", "response", "score", "data_source"} <= set(table)
    assert len(set(zip(table["prompt_id"], table["sample"]))) == 12
    assert [c.name for c in sorted((out / "parts").iterdir())] == [
        "chunk-000000.parquet",
        "chunk-000001.parquet",
    ]

    from mlflow.tracking import MlflowClient

    info = json.loads((out / "run_info.json").read_text())
    run = MlflowClient(tracking_uri=info["mlflow_uri"]).get_run(info["mlflow"])
    assert run.data.params["model"] == str(tiny_model_dir) and run.data.params["sampling.n"] == "2"
    assert (
        run.data.metrics["val-core/rlkit/arithmetic/score/mean_2"]
        == metrics["val-core/rlkit/arithmetic/score/mean@2"]["value"]
    )
    assert info["mlflow_uri"].endswith(f"{tmp_path}/mlflow.db")

    again = run_rlkit(*args, env=env(tmp_path))  # everything done: nothing generated, same numbers
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "results.json").read_text())["metrics"] == metrics

    other = dict(results, metrics={k: dict(m, value=m["value"] + 0.25) for k, m in metrics.items()})
    (tmp_path / "b.json").write_text(json.dumps(other))
    shown = run_rlkit(
        "eval", "--compare", str(out / "results.json"), str(tmp_path / "b.json"), env=env(tmp_path)
    )
    assert shown.returncode == 0, shown.stderr
    line = next(x for x in shown.stdout.splitlines() if "arithmetic/pass@1:" in x)
    assert "diff +0.2500 [" in line


def test_eval_of_a_peft_adapter_merges_it_over_its_base(tiny_model_dir, sums, tmp_path):
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapter = tmp_path / "adapter"
    peft.get_peft_model(base, config).save_pretrained(adapter)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        tiny_model_dir
    )

    out = tmp_path / "adapter-eval"
    result = run_rlkit(
        "eval",
        str(adapter),
        "--data",
        str(sums),
        "--out",
        str(out),
        "--max-new-tokens",
        "4",
        env=env(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval: 100%" in result.stderr and "6/6" in result.stderr  # the progress bar (prompts)
    assert json.loads((out / "results.json").read_text())["model_kind"] == "adapter"
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    lora = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, lora(ids).logits, atol=1e-5)
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(ids).logits
        assert not torch.allclose(merged(ids).logits, plain, atol=1e-3)  # the adapter changes the model


def test_a_killed_eval_resumes_where_it_stopped(tiny_model_dir, tmp_path):
    from rlkit.data import generate_arithmetic

    generate_arithmetic(tmp_path / "data", train_size=4, test_size=40, seed=1)
    out = tmp_path / "killed"
    args = [
        "eval",
        str(tiny_model_dir),
        "--data",
        str(tmp_path / "data" / "test.parquet"),
        "--out",
        str(out),
        "--n",
        "2",
        "--max-new-tokens",
        "24",
        "--batch-size",
        "1",
        "--no-progress",
        "--bootstrap",
        "20",
    ]
    proc = start(*args, env=env(tmp_path))
    parts = out / "parts"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and len(list(parts.glob("chunk-*.parquet"))) < 2:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {
        p.name: (p.read_bytes(), p.stat().st_ino, p.stat().st_mtime_ns) for p in parts.glob("chunk-*.parquet")
    }
    assert 2 <= len(before) < 40, f"the kill should land mid-eval: {len(before)} chunks"
    assert not (out / "results.json").exists()

    result = run_rlkit(*args, env=env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming, {len(before)} of 40 prompts already done" in result.stderr
    after = {
        p.name: (p.read_bytes(), p.stat().st_ino, p.stat().st_mtime_ns) for p in parts.glob("chunk-*.parquet")
    }
    assert len(after) == 40 and all(
        after[name] == kept for name, kept in before.items()
    )  # not generated again
    table = pq.read_table(out / "generations.parquet").to_pydict()
    assert len(table["prompt_id"]) == 80 and len(set(zip(table["prompt_id"], table["sample"]))) == 80


def test_bad_input_is_a_clear_error_before_any_generation(tiny_model_dir, sums, tmp_path, capsys):
    from rlkit.cli import main
    from rlkit.data import generate_arithmetic

    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    generate_arithmetic(tmp_path / "odd", train_size=2, test_size=2, seed=0, data_source="nobody/knows")
    cases = [
        ([str(tiny_model_dir), "--data", str(tmp_path / "missing.parquet")], "no such file"),
        ([str(not_a_model), "--data", str(sums)], "is not a model"),
        ([str(tmp_path / "nowhere"), "--data", str(sums)], "does not exist"),
        ([str(tiny_model_dir), "--data", str(tmp_path / "odd" / "test.parquet")], "'nobody/knows'"),
        (["--compare", str(sums)], "two or more"),
    ]
    for argv, message in cases:
        out = tmp_path / f"out-{len(message)}"
        code = main(["eval", *argv, "--out", str(out)])
        assert code == 1, argv
        assert message in capsys.readouterr().err, argv
        assert not (out / "parts").exists(), argv  # nothing generated
    import subprocess
    import sys

    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlkit",
            "eval",
            str(not_a_model),
            "--data",
            str(sums),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env=env(tmp_path),
    )
    assert shown.returncode == 1 and "error:" in shown.stderr and "is not a model" in shown.stderr
    assert "Traceback" not in shown.stderr
