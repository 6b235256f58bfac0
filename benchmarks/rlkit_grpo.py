"""rlkit side of the GRPO benchmark: the real Runtime + Trainer.step, timed per step and per phase.

    python benchmarks/rlkit_grpo.py --model DIR --model-name tiny --dtype fp32 --data X.parquet --out r.json

Start-up (recipe validation, Ray, worker construction, model load) is timed separately and not part
of any step. Each step is ``Trainer.step`` followed by the trackers' ``log`` (console + jsonl), as in
``Trainer.fit``; validation and checkpoints are off.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Workload,
    gpu_record,
    matmul_peak_flops,
    memory_bandwidth,
    one_thread,
    training_probe_dtype,
    trains_in_bf16,
    update_flops,
    workload_args,
    write_result,
)

# rollout.backend.dtype per harness dtype (common.HARNESS_DTYPES)
DECODE_DTYPE = {
    "fp32": "float32",
    "fp32mlas": "float32",
    "bf16": "bfloat16",
    "fp16w": "float16",
    "fp32auto": "auto",
    "bf16auto": "auto",
}


def recipe_dict(w: Workload, out_dir: str) -> dict:
    """The recipe: GRPO, token-mean, no KL, one epoch over one mini-batch, one micro-batch, fixed length."""
    samples = w.completions
    return {
        "model": {"path": w.model},
        "data": {
            "train_files": [w.data],
            "max_prompt_length": w.max_prompt_length,
            "max_response_length": w.tokens,
            "train_batch_size": w.prompts,
            "seed": w.seed,
            "shuffle": False,
        },
        "algorithm": {"estimator": "grpo", "use_kl_in_reward": False},
        "actor": {
            "optim": {"lr": w.lr, "warmup_steps": 0, "weight_decay": 0.0},
            "loss_agg_mode": "token-mean",
            "ppo_epochs": 1,
            "ppo_mini_batch_size": w.prompts,
            "ppo_micro_batch_size_per_rank": samples,
            "use_kl_loss": False,
            "entropy_coeff": 0.0,
            "mixed_precision": "bf16" if trains_in_bf16(w.dtype) else "fp32",
        },
        "rollout": {
            "n": w.group,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "ignore_eos": True,
            "log_prob_micro_batch_size_per_rank": samples,
            # TRL: bf16 autocast; fp32 is set, not left to auto (an AMX machine would decode in bf16)
            "backend": {
                "name": "hf",
                # fp32auto / bf16auto: the decode as auto chooses it on this machine (what a recipe that
                # says nothing gets); the run's choice is recorded as decode
                "dtype": DECODE_DTYPE[w.dtype],
                # fp32mlas: fp32 decode on ONNX Runtime's prepacked GEMM (rlkit.rollout.mlas_weights);
                # set, not left to auto, as the dtype is
                "linears": {"fp32mlas": "onnxruntime", "fp32auto": "auto", "bf16auto": "auto"}.get(
                    w.dtype, "torch"
                ),
            },
        },
        "resources": {
            "device": w.device,
            "threads_per_worker": 1,
            "allocator": w.allocator,
            "pools": {
                "global": {"nodes": 1, "bundles_per_node": 1, "cpus_per_bundle": 1, "gpus_per_bundle": 1}
            },
        },
        "trainer": {
            "total_steps": w.warmup + w.steps,
            "val_before_train": False,
            "seed": w.seed,
            "output_dir": out_dir,
            "resume": "never",
        },
        "tracking": {"backends": ["console", "jsonl"]},
    }


def main() -> None:
    launched = time.perf_counter()  # start-up counts imports, as a user waits for them
    one_thread()
    w, out = workload_args(__doc__)
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }.items():
        os.environ.setdefault(key, value)
    import yaml

    from rlkit.plugin.registry import build_registries
    from rlkit.recipe import load_recipe
    from rlkit.runtime.build import Runtime
    from rlkit.step.trainer import Trainer

    peak = matmul_peak_flops(training_probe_dtype(w.dtype), device=w.device)
    with tempfile.TemporaryDirectory(prefix="rlkit-bench-") as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe_dict(w, str(Path(tmp) / "out"))))
        registries = build_registries()
        recipe = load_recipe(str(path), [], registries=registries)
        runtime = Runtime.start(recipe, registries)
        startup_s = time.perf_counter() - launched
        try:
            trainer = Trainer(recipe, runtime)
            batches = runtime.train_batches()
            steps = []
            pids = [pid for group in runtime.groups for pid in group.pids()]
            for i in range(w.warmup + w.steps):
                prompts = next(batches)
                trainer.global_step += 1
                faults = minor_faults(pids)
                start = time.perf_counter()
                metrics = trainer.step(prompts, batches)
                runtime.tracking.log(metrics, trainer.global_step)
                wall = time.perf_counter() - start
                faults = minor_faults(pids) - faults
                assert metrics["response_length/min"] == w.tokens, (
                    "every completion must have the full length"
                )
                if i >= w.warmup:
                    counted = {"worker_minor_faults": faults} if faults >= 0 else {}
                    steps.append(phases(metrics, wall) | counted)
        finally:
            runtime.close()
    peak = max(peak, matmul_peak_flops(training_probe_dtype(w.dtype), device=w.device))
    decoded = runtime.hardware.precision  # the run's resolved decode dtype and linears
    write_result(
        out,
        w,
        "rlkit",
        steps,
        {
            "startup_s": startup_s,
            "peak_flops": peak,
            "n_params": runtime.n_params,
            "bandwidth": memory_bandwidth(device=w.device),
            # the worker's peak on the GPU (perf/max_memory_allocated_gb of the last step), not the driver's
            **gpu_record(w.device),
            **(
                {"max_memory_allocated_gb": metrics["perf/max_memory_allocated_gb"]}
                if w.device != "cpu"
                else {}
            ),
            "update_flops": update_flops(runtime.n_params, int(metrics["perf/total_num_tokens"])),
            # what the rollout decoded in and with (rollout.backend.dtype / linears as resolved)
            "decode": f"{decoded.decode_dtype} {decoded.decode_linears}",
            # the peak of the decode's arithmetic: bf16 weights multiply in bf16
            "decode_peak_flops": matmul_peak_flops(
                "bf16" if decoded.decode_dtype == "bfloat16" else "fp32", device=w.device
            ),
        },
    )


def minor_faults(pids: list[int]) -> int:
    """The worker processes' minor page faults so far (``/proc/<pid>/stat``, field 10); -1 if unreadable."""
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return -1
        total += int(stat.rsplit(")", 1)[1].split()[7])  # minflt: 8th after "pid (comm)"
    return total


def phases(metrics: dict[str, float], wall: float) -> dict[str, float]:
    """Per-step seconds: ``step`` (Trainer.step + logging), each phase, and what ran inside the worker."""
    out = {
        "step": wall,
        "tokens": metrics["perf/total_num_tokens"],
        "prompt_max": metrics["prompt_length/max"],
    }
    for key, value in metrics.items():
        if key.startswith("timing_s/") and key != "timing_s/step":
            out[key.split("/", 1)[1]] = value
        elif key.startswith("perf/worker_s/"):
            out["worker_" + key.rsplit("/", 1)[1]] = value
        elif key == "perf/decode_weights_s":  # inside gen: the decode weights readied after the weight sync
            out["decode_weights"] = value
        elif key == "training/rollout_probs_diff_max":  # the rollout's policy against the actor's
            out["rollout_probs_diff_max"] = value
    return out


if __name__ == "__main__":
    main()
