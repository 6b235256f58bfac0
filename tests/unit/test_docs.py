"""Every hook and registry is documented (docs/plugins.md)."""

import re
from pathlib import Path

from rlkit.plugin.hookspecs import REGISTRY_KINDS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_hook_is_documented():
    text = (DOCS / "plugins.md").read_text()
    for kind, (hook_name, spec_type) in REGISTRY_KINDS.items():
        assert f"### `{hook_name}`" in text, f"docs/plugins.md lacks a section for {hook_name}"
        assert f"`{kind}`" in text and spec_type.__name__ in text


# ----- every table of measured numbers names where its numbers come from ------------------------------------
# Convention (docs/benchmarks.md, "Where each number comes from"): a Markdown table whose cells hold a
# measured quantity (a number with a unit of time, rate, size or a percentage) has, on one of the 3 lines
# above its header, an HTML comment naming its source: <!-- results: benchmarks/results/X.json[, ...];
# command: python benchmarks/... -->   (each file must exist) <!-- not reproducible: no results file (measured
# <date>[, superseded]) --> <!-- not measured: <why the units are not measurements (settings, limits)> -->
ROOT = DOCS.parent
_MEASURED = re.compile(r"\d(?:[\d.,]*\d)?\s?(?:ms|s|tok/s|[GT]FLOP/s|GB/s|MiB|GiB|MB|%)(?![A-Za-z])")
_SOURCE = re.compile(r"<!--\s*(results|not reproducible|not measured):(.*?)-->")


def measured_tables(text: str) -> list[tuple[int, list[str]]]:
    """(header line index, lines) of each table with a measured quantity in its body."""
    lines, tables, i = text.splitlines(), [], 0
    while i < len(lines):
        if (
            lines[i].startswith("|")
            and i + 1 < len(lines)
            and re.match(r"^\|[\s:|-]+\|$", lines[i + 1].strip())
        ):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            if any(_MEASURED.search(row) for row in lines[i + 2 : j]):
                tables.append((i, lines[i:j]))
            i = j
        else:
            i += 1
    return tables


def table_problems(path: Path) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    problems = []
    for start, table in measured_tables(text):
        where = f"{path.relative_to(ROOT)}:{start + 1} ({table[0][:60]}...)"
        above = [m for line in lines[max(0, start - 3) : start] for m in _SOURCE.finditer(line)]
        if not above:
            problems.append(
                f"{where}: no <!-- results: ...; command: ... --> or <!-- not reproducible: ... --> line"
            )
            continue
        for kind, body in ((m.group(1), m.group(2)) for m in above):
            if kind != "results":
                continue
            files, _, command = body.partition("; command:")
            if not command.strip():
                problems.append(f"{where}: the results line names no command")
            for name in (f.strip() for f in files.split(",")):
                if not (ROOT / name).is_file():
                    problems.append(f"{where}: results file {name} does not exist")
    return problems


def test_every_measured_table_names_its_results_file_and_command():
    problems = [p for path in sorted([*DOCS.glob("*.md"), ROOT / "README.md"]) for p in table_problems(path)]
    assert not problems, "\n".join(problems)


def test_the_table_check_can_fail(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    table = "| a | b |\n|---|---|\n| x | 1.5 s |\n"
    (docs / "bare.md").write_text("text\n\n" + table)
    (docs / "missing.md").write_text(
        "<!-- results: benchmarks/results/nope.json; command: python x -->\n" + table
    )
    (docs / "ok.md").write_text(
        "<!-- not reproducible: no results file (measured 2026-11-22, superseded) -->\n"
        + table
        + "\n| config | value |\n|---|---|\n| layers | 2 |\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert "no <!-- results" in table_problems(docs / "bare.md")[0]
        assert "does not exist" in table_problems(docs / "missing.md")[0]
        assert table_problems(docs / "ok.md") == []
    finally:
        ROOT = saved
