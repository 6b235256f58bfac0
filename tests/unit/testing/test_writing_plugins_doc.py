"""docs/writing-plugins.md: every Python block of the worked examples runs as written, its conformance
check included (a section's blocks share one namespace with `tokenizer`, `model` and `tmp_path`), on the
model of rlkit.testing's own fixtures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlkit.testing.pytest_plugin import rlkit_tiny_model, rlkit_tiny_model_dir, rlkit_tokenizer  # noqa: F401

DOC = Path(__file__).resolve().parents[3] / "docs" / "writing-plugins.md"


def worked_sections() -> dict[str, list[str]]:
    text = DOC.read_text()
    worked = text.split("## Worked examples", 1)[1].split("\n## ", 1)[0]
    sections = {}
    for chunk in worked.split("\n### ")[1:]:
        title, body = chunk.split("\n", 1)
        sections[title.strip()] = re.findall(r"```python\n(.*?)```", body, flags=re.DOTALL)
    return sections


SECTIONS = worked_sections()


def test_every_kind_has_a_worked_section_with_its_check():
    checks = {
        "check_estimator",
        "check_policy_loss",
        "check_reward_manager",
        "check_compute_score",
        "check_rollout_backend",
        "check_role",
        "check_tracker",
        "check_tool",
        "check_agent_loop",
        "check_rollout_correction",
    }
    code = "\n".join(block for blocks in SECTIONS.values() for block in blocks)
    assert {c for c in checks if f"{c}(SPEC" in code} == checks
    assert all(blocks for blocks in SECTIONS.values()), "a worked section without code"


@pytest.mark.parametrize("title", list(SECTIONS))
def test_worked_example_runs(title, rlkit_tiny_model, tmp_path):  # noqa: F811 - the imported fixture
    model, tokenizer = rlkit_tiny_model  # the kit's own fixture, as the doc says
    namespace = {
        "model": model,
        "tokenizer": tokenizer,
        "tmp_path": tmp_path,
        "__name__": "writing_plugins_doc",
    }
    for block in SECTIONS[title]:
        # as a user runs it
        code = compile(block, f"docs/writing-plugins.md ({title})", "exec", dont_inherit=True)
        exec(code, namespace)  # noqa: S102 - our own docs
    assert "SPEC" in namespace
