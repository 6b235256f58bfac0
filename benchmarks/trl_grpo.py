"""TRL side of the GRPO benchmark: ``trl.GRPOTrainer`` on the same work, timed per step and per phase.

    benchmarks/.venv-trl/bin/python benchmarks/trl_grpo.py --model DIR --model-name tiny --dtype fp32 \
        --data X.parquet --out t.json

Runs in its own virtual environment (``benchmarks/.venv-trl``, made by ``benchmarks/run.py``). Same
work as ``rlkit_grpo.py``: the first ``prompts`` rows of the parquet file in order (no shuffling), each
``group`` times; ``min_new_tokens = max_new_tokens`` so eos never ends a completion; loss ``dapo``
(TRL's token-mean over the whole generation batch), ``beta = 0`` (no reference model), one iteration,
one generation per optimizer step and one micro-batch (``per_device_train_batch_size`` = all
completions, no gradient accumulation). ``bf16`` is accelerate's bf16 autocast over fp32 weights.

Phases: ``gen`` = ``model.generate`` (``_generate_single_turn``); ``gen_score`` = TRL's whole
``_generate_and_score_completions`` (tokenise, generate, reward, advantages); ``update`` = the rest of
the optimizer step (forward, backward, optimizer, logging).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    arithmetic_reward,
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


def main() -> None:
    launched = time.perf_counter()  # start-up counts imports, as a user waits for them
    one_thread()
    w, out = workload_args(__doc__)
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import pandas as pd
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    peak = matmul_peak_flops(training_probe_dtype(w.dtype), device=w.device)
    rows = pd.read_parquet(w.data).head(w.prompts)
    dataset = Dataset.from_list(
        [
            {"prompt": [dict(m) for m in r.prompt], "ground_truth": str(r.reward_model["ground_truth"])}
            for r in rows.itertuples()
        ]
    )

    def reward(completions, ground_truth, **_):
        return [
            arithmetic_reward(c[0]["content"] if isinstance(c, list) else c, gt)
            for c, gt in zip(completions, ground_truth, strict=True)
        ]

    times: dict[str, float] = {}
    steps: list[dict[str, float]] = []
    tokens_seen: list[int] = []
    prompt_width: list[int] = []

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                times["gen"] = times.get("gen", 0.0) + time.perf_counter() - start

        def _generate_and_score_completions(self, *args, **kwargs):
            start = time.perf_counter()
            result = super()._generate_and_score_completions(*args, **kwargs)
            times["gen_score"] = times.get("gen_score", 0.0) + time.perf_counter() - start
            mask = result["completion_mask"]
            assert int(mask.sum(-1).min()) == w.tokens, "every completion must have the full length"
            tokens_seen.append(int(result["prompt_mask"].sum() + mask.sum()))
            # left-padded prompts: every row runs this many
            prompt_width.append(int(result["prompt_mask"].shape[1]))
            return result

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            times.clear()
            times["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            wall = time.perf_counter() - times["t0"]
            if state.global_step > w.warmup:
                steps.append(
                    {
                        "step": wall,
                        "gen": times["gen"],
                        "gen_score": times["gen_score"],
                        "update": wall - times["gen_score"],
                        "tokens": float(tokens_seen[-1]),
                        "prompt_max": float(prompt_width[-1]),
                    }
                )

    with tempfile.TemporaryDirectory(prefix="trl-bench-") as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            use_cpu=w.device == "cpu",
            seed=w.seed,
            data_seed=w.seed,
            max_steps=w.warmup + w.steps,
            learning_rate=w.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            per_device_train_batch_size=w.completions,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_generations=w.group,
            num_iterations=1,
            beta=0.0,
            loss_type="dapo",
            scale_rewards="group",
            max_completion_length=w.tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            shuffle_dataset=False,
            generation_kwargs={"min_new_tokens": w.tokens},
            bf16=trains_in_bf16(w.dtype),
            model_init_kwargs={"dtype": "float32"},
            dataloader_num_workers=0,
        )
        # the fast tokenizer as saved (rlkit loads it the same way): AutoTokenizer may swap in the model
        # type's own class, which tokenizes the tiny model's prompts 2 tokens longer
        tokenizer = (
            PreTrainedTokenizerFast.from_pretrained(w.model)
            if w.model_name == "tiny"
            else AutoTokenizer.from_pretrained(w.model)
        )
        tokenizer.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(w.model, dtype="float32")
        trainer = Timed(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[StepTimer()],
        )
        startup_s = time.perf_counter() - launched
        trainer.train()
    n_params = sum(p.numel() for p in model.parameters())
    peak = max(peak, matmul_peak_flops(training_probe_dtype(w.dtype), device=w.device))
    write_result(
        out,
        w,
        "trl",
        steps,
        {
            "startup_s": startup_s,
            "peak_flops": peak,
            "n_params": n_params,
            "bandwidth": memory_bandwidth(device=w.device),
            **gpu_record(w.device),
            "update_flops": update_flops(n_params, tokens_seen[-1]),
        },
    )


if __name__ == "__main__":
    main()
