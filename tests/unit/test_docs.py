"""Every hook and registry is documented (docs/plugins.md)."""

from pathlib import Path

from rlkit.plugin.hookspecs import REGISTRY_KINDS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_hook_is_documented():
    text = (DOCS / "plugins.md").read_text()
    for kind, (hook_name, spec_type) in REGISTRY_KINDS.items():
        assert f"### `{hook_name}`" in text, f"docs/plugins.md lacks a section for {hook_name}"
        assert f"`{kind}`" in text and spec_type.__name__ in text
