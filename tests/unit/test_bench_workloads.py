"""benchmarks/run.py's long-prompt workload: the rows it writes (issue 30 item 6)."""

from __future__ import annotations

import pandas as pd
import pytest


@pytest.fixture(scope="module")
def run_py(benchmark_module):
    return benchmark_module("run.py")


def test_long_prompts_reach_the_token_floor_and_keep_the_question_and_answer(
    run_py, tiny_model_dir, tmp_path
):
    from transformers import AutoTokenizer

    from rlkit.data.synthetic import generate_arithmetic

    generate_arithmetic(tmp_path, train_size=6, test_size=1, seed=0)
    short = pd.read_parquet(tmp_path / "train.parquet")
    out = run_py.long_prompt_file(tmp_path / "train.parquet", str(tiny_model_dir))
    long = pd.read_parquet(out)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert list(long["reward_model"]) == list(short["reward_model"])  # the same answers: the same reward
    contexts = set()
    for before, after in zip(short["prompt"], long["prompt"], strict=True):
        question, text = before[-1]["content"], after[-1]["content"]
        assert text.startswith("Worked examples:\n") and text.endswith("\n\n" + question)
        templated = tokenizer.apply_chat_template(
            [dict(m) for m in after], add_generation_prompt=True, tokenize=False
        )
        assert len(tokenizer(templated, add_special_tokens=False)["input_ids"]) >= run_py.LONG_PROMPT_TOKENS
        contexts.add(text)
    assert len(contexts) == len(short)  # each row its own worked sums
    assert {"smollm2-long", "smollm2-256", "smollm2-64"} <= set(run_py.DEFAULT_WORKLOADS.split(","))
