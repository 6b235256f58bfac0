"""The code style CI enforces, in the default suite: ``ruff check`` (E501 included: every line fits in 110
columns) and ``ruff format --check`` over the code the repository ships. A failure lists the offending lines
and how to fix them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ["src", "tests", "plugins", "benchmarks", "noxfile.py"]


def ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


@pytest.fixture(scope="module", autouse=True)
def _ruff_installed():
    if ruff("--version").returncode != 0:
        pytest.fail("ruff is not installed: pip install -e '.[test]' (the test extra pins it)")


def test_ruff_check_passes():
    result = ruff("check", "--output-format", "concise", *TARGETS)
    assert result.returncode == 0, (
        f"ruff check found problems (fix them, or `ruff check --fix` the safe ones):\n{result.stdout}"
        f"{result.stderr}"
    )


def test_ruff_format_leaves_every_file_unchanged():
    result = ruff("format", "--check", "--diff", *TARGETS)
    assert result.returncode == 0, (
        f"these files are not `ruff format`ted (run `ruff format {' '.join(TARGETS)}`):\n{result.stdout}"
        f"{result.stderr}"
    )
