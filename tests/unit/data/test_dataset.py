"""RLDataset over real parquet files: rows checked, chat template applied, length policy, left-padded
batches."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from rlkit_data_rows import make_row, write_parquet

from rlkit.data.dataset import RLDataset, collate_prompts
from rlkit.errors import DataError

# rows cut from the real files (README there)
DATA = Path(__file__).resolve().parents[2] / "fixtures" / "datasets"

# "<|im_start|> user {content} <|im_end|> <|im_start|> assistant": 5 tokens + the content's words.
TEMPLATE_TOKENS = 5


def test_reads_many_files_and_collates_left_padded(tmp_path, tokenizer):
    a = write_parquet(
        tmp_path / "a.parquet", [make_row("one + two ?", "3", index=0), make_row("one ?", "1", index=1)]
    )
    b = write_parquet(tmp_path / "b.parquet", [make_row("what is the answer ? one + one", "2", "gsm8k")])
    ds = RLDataset([a, b], tokenizer, max_prompt_length=32)
    assert len(ds) == 3 and ds.stats["rows_kept"] == 3
    batch = ds.collate([ds[0], ds[1], ds[2]])
    lengths = [4 + TEMPLATE_TOKENS, 2 + TEMPLATE_TOKENS, 8 + TEMPLATE_TOKENS]  # 9, 7, 13
    assert batch["input_ids"].shape == (3, 13)
    assert batch["attention_mask"].sum(1).tolist() == lengths
    # Left padding: row 1 (7 tokens) has 6 pads on the left, then its tokens.
    pad = tokenizer.pad_token_id
    assert batch["input_ids"][1, :6].tolist() == [pad] * 6
    assert batch["attention_mask"][1].tolist() == [0] * 6 + [1] * 7
    assert batch["position_ids"][1].tolist() == [0] * 6 + list(range(7))
    text = tokenizer.decode(batch["input_ids"][2][batch["attention_mask"][2].bool()])
    assert text == "<|im_start|> user what is the answer ? one + one <|im_end|> <|im_start|> assistant"
    assert list(batch["data_source"]) == ["rlkit/arithmetic", "rlkit/arithmetic", "gsm8k"]
    assert batch["reward_model"][2] == {"style": "rule", "ground_truth": "2"}
    assert batch["extra_info"][1] == {"split": "train", "index": 1}
    assert batch["raw_prompt"][0] == [{"role": "user", "content": "one + two ?"}]
    assert list(batch["row"]) == ["0:0", "0:1", "1:0"] and "uid" not in batch and "index" not in batch


@pytest.mark.parametrize(
    ("policy", "kept", "expected_lengths"),
    [
        ("filter", 1, [7]),
        ("truncate_left", 2, [7, 10]),
        ("truncate_right", 2, [7, 10]),
    ],
)
def test_prompt_length_policies(tmp_path, tokenizer, policy, kept, expected_lengths):
    path = write_parquet(tmp_path / "d.parquet", [make_row("one ?"), make_row("one two three four five six")])
    ds = RLDataset(path, tokenizer, max_prompt_length=10, prompt_length_policy=policy)
    assert len(ds) == kept
    assert [len(s["input_ids"]) for s in ds.samples] == expected_lengths
    long_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "one two three four five six"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    long_ids = tokenizer(long_ids, add_special_tokens=False)["input_ids"]  # 11 tokens
    if policy == "filter":
        assert ds.stats["filtered_too_long"] == 1
    elif policy == "truncate_left":
        assert ds.samples[1]["input_ids"] == long_ids[-10:]  # keeps the generation prompt
    else:
        assert ds.samples[1]["input_ids"] == long_ids[:10]


def test_too_long_prompt_errors_by_default(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "d.parquet", [make_row("one ?"), make_row("one two three four five six")])
    with pytest.raises(
        DataError, match=r"d\.parquet, row 1: the prompt is 11 tokens, longer than data\.max_prompt_length=10"
    ):
        RLDataset(path, tokenizer, max_prompt_length=10)


def _malformed_rows():
    good = make_row("one ?")
    no_prompt = {**good, "prompt": []}
    no_truth = {**good, "reward_model": {"style": "rule", "ground_truth": None}}
    return {
        "missing prompt": (no_prompt, "row 1: 'prompt' is missing or empty"),
        "missing ground truth": (no_truth, "row 1: 'reward_model.ground_truth' is missing"),
        "missing data_source": ({**good, "data_source": None}, "row 1: 'data_source' is missing"),
    }


@pytest.mark.parametrize("case", list(_malformed_rows()))
def test_malformed_rows_error_or_filter(tmp_path, tokenizer, case, caplog):
    bad, message = _malformed_rows()[case]
    path = write_parquet(tmp_path / "m.parquet", [make_row("one ?"), bad, make_row("two ?")])
    with pytest.raises(DataError) as info:
        RLDataset(path, tokenizer)
    assert str(path) in str(info.value) and message in str(info.value)
    with caplog.at_level(logging.WARNING):
        ds = RLDataset(path, tokenizer, prompt_length_policy="filter")
    assert len(ds) == 2 and ds.stats["filtered_malformed"] == 1 and ds.stats["rows_read"] == 3
    assert "m.parquet, row 1" in caplog.text
    assert [s["row"] for s in ds.samples] == ["0:0", "0:2"]


def test_non_string_content(tmp_path, tokenizer):
    messages = pa.array(
        [[{"role": "user", "content": b"one ?"}], [{"role": "user", "content": b"\xff two"}]],
        pa.list_(pa.struct([("role", pa.string()), ("content", pa.binary())])),
    )
    table = pa.table(
        {
            "data_source": ["a", "a"],
            "prompt": messages,
            "reward_model": [{"ground_truth": "1"}, {"ground_truth": "2"}],
        }
    )
    path = write_parquet(tmp_path / "bytes.parquet", table=table)
    with pytest.raises(
        DataError, match=r"bytes\.parquet, row 0: 'prompt'\[0\]\.content is bytes, not a string"
    ):
        RLDataset(path, tokenizer)


def test_non_utf8_text(tmp_path, tokenizer):
    content = pa.array([b"one ?", b"\xff\xfe two"], pa.binary()).view(pa.string())  # unvalidated
    prompt = pa.ListArray.from_arrays(
        pa.array([0, 1, 2], pa.int32()),
        pa.StructArray.from_arrays([pa.array(["user", "user"]), content], names=["role", "content"]),
    )
    table = pa.table(
        {"data_source": ["a", "a"], "prompt": prompt, "reward_model": [{"ground_truth": "1"}] * 2}
    )
    path = write_parquet(tmp_path / "latin.parquet", table=table)
    with pytest.raises(DataError, match=r"latin\.parquet, row 1: a text field is not valid UTF-8"):
        RLDataset(path, tokenizer)


def test_file_level_errors(tmp_path, tokenizer):
    with pytest.raises(DataError, match="nope.parquet: data file not found"):
        RLDataset(tmp_path / "nope.parquet", tokenizer)
    empty_bytes = tmp_path / "zero.parquet"
    empty_bytes.write_bytes(b"")
    with pytest.raises(DataError, match="zero.parquet: cannot be read as parquet"):
        RLDataset(empty_bytes, tokenizer)
    not_parquet = tmp_path / "text.parquet"
    not_parquet.write_text("data_source,prompt\n")
    with pytest.raises(DataError, match="text.parquet: cannot be read as parquet"):
        RLDataset(not_parquet, tokenizer)
    empty = write_parquet(
        tmp_path / "empty.parquet", table=pa.Table.from_pylist([make_row("one")]).slice(0, 0)
    )
    with pytest.raises(DataError, match="empty.parquet: the file has no rows"):
        RLDataset(empty, tokenizer)
    wrong = write_parquet(tmp_path / "wrong.parquet", [{"question": "q", "answer": "a"}])
    with pytest.raises(
        DataError, match=r"wrong.parquet: missing column\(s\) \['prompt', 'data_source', 'reward_model'\]"
    ):
        RLDataset(wrong, tokenizer)
    string_prompt = write_parquet(tmp_path / "sp.parquet", [{**make_row("x"), "prompt": "one ?"}])
    with pytest.raises(
        DataError, match="sp.parquet: column 'prompt' has type string; expected a list of chat messages"
    ):
        RLDataset(string_prompt, tokenizer)
    with pytest.raises(DataError, match="prompt_length_policy: 'truncate' is not valid"):
        RLDataset(string_prompt, tokenizer, prompt_length_policy="truncate")
    only_bad = write_parquet(tmp_path / "bad.parquet", [{**make_row("x"), "prompt": []}])
    with pytest.raises(DataError, match="no rows left"):
        RLDataset(only_bad, tokenizer, prompt_length_policy="filter")


def test_custom_prompt_key(tmp_path, tokenizer):
    row = make_row("one ?")
    row["messages"] = row.pop("prompt")
    path = write_parquet(tmp_path / "k.parquet", [row])
    assert len(RLDataset(path, tokenizer, prompt_key="messages")) == 1


def test_collate_prompts_position_ids():
    batch = collate_prompts([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert batch["attention_mask"].dtype == torch.long


def test_real_gsm8k_parquet_tokenizes(tmp_path, tokenizer):
    from rlkit.data import preprocess_gsm8k

    out = preprocess_gsm8k(DATA / "gsm8k", tmp_path)
    ds = RLDataset(out["test"], tokenizer, max_prompt_length=512)
    assert len(ds) == 8
    assert ds.collate([ds[i] for i in range(4)])["input_ids"].shape[0] == 4
