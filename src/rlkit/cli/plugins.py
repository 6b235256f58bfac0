"""``rlkit plugins [--json]``: every registry, its entries, and where each came from."""

from __future__ import annotations

import argparse
import json

from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plugins", help="list every registry and entry, with its package and version"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)


def collect() -> dict:
    """Registries and broken plugins as plain data (what ``--json`` prints)."""
    plugins = make_plugin_manager()
    registries = build_registries(plugins, allow_broken=True)
    return {
        "registries": {
            kind: [
                {
                    "name": entry.spec.name,
                    "aliases": list(entry.spec.aliases),
                    "description": entry.spec.description,
                    "plugin": entry.source.plugin,
                    "package": entry.source.package,
                    "version": entry.source.version,
                    "params": _params(entry.spec),
                }
                for entry in registry
            ]
            for kind, registry in registries.items()
        },
        "broken": [
            {
                "entry_point": b.entry_point,
                "group": b.group,
                "package": b.package,
                "version": b.version,
                "error": b.error,
            }
            for b in plugins.broken
        ],
    }


def _params(spec) -> dict[str, dict]:
    """``{field: {default, description}}`` of the entry's params model (what a recipe may set beside its
    name)."""
    from rlkit.recipe.compose import params_model

    try:
        model = params_model(spec)
    except Exception as exc:  # noqa: BLE001 - a broken params reference is shown, not fatal here
        return {"<error>": {"default": None, "description": f"{type(exc).__name__}: {exc}"}}
    if model is None:
        return {}
    return {
        name: {
            "default": None if field.is_required() else repr(field.get_default(call_default_factory=True)),
            "description": field.description or "",
        }
        for name, field in model.model_fields.items()
    }


def run(args: argparse.Namespace) -> int:
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for kind, entries in data["registries"].items():
            print(f"{kind} ({len(entries)})")
            for e in entries:
                aliases = f" [{', '.join(e['aliases'])}]" if e["aliases"] else ""
                print(
                    f"  {e['name']}{aliases}  —  {e['package']} {e['version']}"
                    + (f"  {e['description']}" if e["description"] else "")
                )
                for name, p in e["params"].items():
                    print(f"      {name} = {p['default']}  {p['description']}")
        for b in data["broken"]:
            print(
                f"BROKEN  {b['entry_point']} ({b['group']}) from {b['package']} {b['version']}: {b['error']}"
            )
    return 1 if data["broken"] else 0
