"""YAML loading and command-line overrides (``a.b=c``, ``~a.b``).

Override values are parsed as YAML scalars/flow collections, so ``n=8`` is an int,
``stop=[a,b]`` a list and ``kl_ctrl={type: fixed}`` a mapping; the schema then types them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from rlkit.errors import RecipeError

__all__ = ["load_yaml", "parse_override", "apply_overrides", "get_path", "has_path", "set_path"]

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z_][A-Za-z0-9_\-]*)*$")
_DELETE = object()


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a recipe file into a mapping; a missing, empty or malformed file is a ``RecipeError``."""
    path = Path(path)
    if not path.is_file():
        hint = " (it is a folder)" if path.is_dir() else ""
        raise RecipeError([("", f"recipe file not found{hint}; give the path to a .yaml file")], str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(
            [(f"byte {exc.start}", f"the file is not valid UTF-8 text ({exc.reason}); save it as UTF-8")],
            str(path),
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError([(where, f"YAML syntax error: {problem}")], str(path)) from None
    if data is None:
        raise RecipeError(
            [("", "the recipe file is empty; it needs at least `model.path` and `data.train_files`")],
            str(path),
        )
    if not isinstance(data, dict):
        raise RecipeError(
            [("", f"the recipe must be a mapping of sections, got a {type(data).__name__}")], str(path)
        )
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=1"`` → ``(["a", "b"], 1)``; ``"~a.b"`` → ``(["a", "b"], DELETE)``. Raises ValueError."""
    if text.startswith("~"):
        key = text[1:]
        if not _KEY.match(key):
            raise ValueError(f"'{text}': after '~' comes a dotted key such as ~trainer.total_steps")
        return key.split("."), _DELETE
    key, sep, raw = text.partition("=")
    if not sep:
        raise ValueError(f"'{text}' is not an override; write key.sub=value (or ~key.sub to remove a key)")
    key = key.strip()
    if not _KEY.match(key):
        raise ValueError(f"'{text}': '{key}' is not a dotted key such as actor.optim.lr")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ValueError(f"'{text}': the value is not valid YAML ({exc.__class__.__name__})") from None
    return key.split("."), value


def get_path(data: dict, keys: list[str] | str, default: Any = None) -> Any:
    keys = keys.split(".") if isinstance(keys, str) else keys
    node: Any = data
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def has_path(data: dict, keys: list[str] | str) -> bool:
    sentinel = object()
    return get_path(data, keys, sentinel) is not sentinel


def set_path(data: dict, keys: list[str] | str, value: Any) -> None:
    keys = keys.split(".") if isinstance(keys, str) else keys
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ValueError(f"'{'.'.join(keys[: i + 1])}' is a {type(child).__name__}, not a section")
        node = child
    node[keys[-1]] = value


def apply_overrides(data: dict, overrides: list[str]) -> list[tuple[str, str]]:
    """Apply overrides in place; return every problem as ``(override, message)``."""
    problems = []
    for text in overrides:
        try:
            keys, value = parse_override(text)
            if value is _DELETE:
                parent = get_path(data, keys[:-1]) if len(keys) > 1 else data
                if not isinstance(parent, dict) or keys[-1] not in parent:
                    raise ValueError(f"'{text}': there is no key '{'.'.join(keys)}' to remove")
                del parent[keys[-1]]
            else:
                set_path(data, keys, value)
        except ValueError as exc:
            problems.append((f"override {text!r}", str(exc)))
    return problems
