"""`rlkit data ...` through its own argparse parser (the CLI package wires the same add_parser)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow.parquet as pq

from rlkit.cli.data import add_parser

# rows cut from the real files (README there)
DATA = Path(__file__).resolve().parents[2] / "fixtures" / "datasets"


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlkit")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_gsm8k_and_math500(tmp_path, capsys):
    assert (
        run(
            [
                "data",
                "gsm8k",
                "--input",
                str(DATA / "gsm8k"),
                "--output",
                str(tmp_path / "g"),
                "--instruction",
                "",
            ]
        )
        == 0
    )
    assert "train: 11 rows" in capsys.readouterr().out
    first = pq.read_table(tmp_path / "g" / "train.parquet").to_pylist()[0]
    assert first["prompt"][0]["content"] == first["extra_info"]["question"].strip()
    assert run(["data", "math500", "--input", str(DATA / "math500"), "--output", str(tmp_path / "m")]) == 0
    assert "test: 8 rows" in capsys.readouterr().out


def test_arithmetic(tmp_path, capsys):
    argv = [
        "data",
        "arithmetic",
        "--output",
        str(tmp_path),
        "--train-size",
        "30",
        "--test-size",
        "5",
        "--seed",
        "2",
    ]
    assert run(argv + ["--ops", "+-", "--max-operand", "20"]) == 0
    out = capsys.readouterr().out
    assert "train: 30 rows" in out and "test: 5 rows" in out
