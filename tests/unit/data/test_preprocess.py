"""Preprocessors write veRL's schema from the real data; bad input names file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlkit.data import generate_arithmetic, preprocess_gsm8k, preprocess_math500
from rlkit.errors import DataError

# rows cut from the real files (README there)
DATA = Path(__file__).resolve().parents[2] / "fixtures" / "datasets"


def _check_schema(row: dict, data_source: str) -> None:
    assert row["data_source"] == data_source
    assert row["ability"] == "math"
    assert [m["role"] for m in row["prompt"]] == ["user"]
    assert isinstance(row["prompt"][0]["content"], str)
    assert row["reward_model"]["style"] == "rule"
    assert isinstance(row["reward_model"]["ground_truth"], str)
    assert {"split", "index"} <= set(row["extra_info"])


def test_gsm8k_real_data(tmp_path):
    out = preprocess_gsm8k(DATA / "gsm8k", tmp_path, instruction="Put the answer after ####.")
    train, test = pq.read_table(out["train"]).to_pylist(), pq.read_table(out["test"]).to_pylist()
    assert (len(train), len(test)) == (11, 8)
    for rows, split in ((train, "train"), (test, "test")):
        _check_schema(rows[0], "openai/gsm8k")
        assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
        assert {r["extra_info"]["split"] for r in rows} == {split}
        assert all(r["prompt"][0]["content"].endswith(" Put the answer after ####.") for r in rows)
        assert all("," not in r["reward_model"]["ground_truth"] for r in rows)
    # The first training problem: Natalia sold 48 clips in April and half as many in May -> 72.
    assert train[0]["reward_model"]["ground_truth"] == "72"
    # all three of the real file
    assert sum(r["reward_model"]["ground_truth"].startswith("-") for r in train) == 3
    assert sum(r["reward_model"]["ground_truth"].startswith("-") for r in test) == 2  # both of the real file


def test_math500_real_data(tmp_path):
    out = preprocess_math500(DATA / "math500", tmp_path)
    assert set(out) == {"test"} and not (tmp_path / "train.parquet").exists()
    rows = pq.read_table(out["test"]).to_pylist()
    assert len(rows) == 8
    _check_schema(rows[0], "HuggingFaceH4/MATH-500")
    assert rows[0]["prompt"][0]["content"].endswith("within \\boxed{}.")
    assert rows[0]["extra_info"]["unique_id"].startswith("test/")
    assert len({r["extra_info"]["unique_id"] for r in rows}) == 8


def _write(path: Path, lines: list[bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


GOOD = json.dumps({"question": "1+1?", "answer": "2\n#### 2"}).encode()


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        (b"\xff\xfe not utf-8", "line 2: not valid UTF-8"),
        (b"{not json", "line 2: not valid JSON"),
        (b"[1, 2]", "line 2: expected a JSON object"),
        (json.dumps({"question": "q"}).encode(), "line 2: missing or empty string field(s) ['answer']"),
        (
            json.dumps({"question": 3, "answer": "#### 1"}).encode(),
            "line 2: missing or empty string field(s) ['question']",
        ),
        (
            json.dumps({"question": "q", "answer": "no final line"}).encode(),
            "line 2: the answer has no '#### <number>'",
        ),
    ],
)
def test_gsm8k_bad_input_names_file_and_line(tmp_path, bad_line, message):
    _write(tmp_path / "in" / "train.jsonl", [GOOD, bad_line])
    _write(tmp_path / "in" / "test.jsonl", [GOOD])
    with pytest.raises(DataError) as info:
        preprocess_gsm8k(tmp_path / "in", tmp_path / "out")
    assert str(tmp_path / "in" / "train.jsonl") in str(info.value)
    assert message in str(info.value)


def test_gsm8k_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="train.jsonl: input file not found"):
        preprocess_gsm8k(tmp_path, tmp_path / "out")
    (tmp_path / "train.jsonl").write_text("\n")
    with pytest.raises(DataError, match="train.jsonl: the file has no rows"):
        preprocess_gsm8k(tmp_path, tmp_path / "out")


def test_arithmetic_is_seeded_and_holds_out_test(tmp_path):
    a = generate_arithmetic(tmp_path / "a", train_size=300, test_size=20, seed=3)
    b = generate_arithmetic(tmp_path / "b", train_size=300, test_size=20, seed=3)
    c = generate_arithmetic(tmp_path / "c", train_size=300, test_size=20, seed=4)
    rows = {k: pq.read_table(v).to_pylist() for k, v in a.items()}
    assert rows == {k: pq.read_table(v).to_pylist() for k, v in b.items()}
    assert rows["train"] != pq.read_table(c["train"]).to_pylist()
    assert (len(rows["train"]), len(rows["test"])) == (300, 20)
    _check_schema(rows["train"][0], "rlkit/arithmetic")
    test_questions = {r["extra_info"]["question"] for r in rows["test"]}
    assert len(test_questions) == 20
    assert not test_questions & {r["extra_info"]["question"] for r in rows["train"]}
    for r in rows["train"] + rows["test"]:
        x, y = (int(t) for t in r["extra_info"]["question"][len("What is ") : -1].split(" + "))
        assert 0 <= x <= 9 and 0 <= y <= 9 and r["reward_model"]["ground_truth"] == str(x + y)


def test_arithmetic_difficulty_knobs(tmp_path):
    out = generate_arithmetic(
        tmp_path, 200, 10, seed=0, max_operand=99, num_terms=3, ops="+-", min_operand=10
    )
    rows = pq.read_table(out["train"]).to_pylist()
    assert len(rows) == 200
    for r in rows:
        question = r["extra_info"]["question"][len("What is ") : -1]
        tokens = question.split(" ")
        assert len(tokens) == 5 and all(10 <= int(t) <= 99 for t in tokens[::2])
        assert eval(question) == int(r["reward_model"]["ground_truth"]) >= 0  # noqa: S307 - our own digits
    with pytest.raises(DataError, match="ops"):
        generate_arithmetic(tmp_path, 1, 1, ops="*")
    with pytest.raises(DataError, match="distinct problems"):
        generate_arithmetic(tmp_path, 10, 200, max_operand=3)
