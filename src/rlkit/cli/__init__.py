"""The ``rlkit`` command: run | validate | recipe show | plugins | data | merge | plot | eval | serve.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``; the parser's
``func(args) -> int`` does the work and returns the exit code. Errors rlkit raises on purpose
(``RlkitError``) print as one clear message, without a traceback; so does any other exception, named as
unexpected. ``rlkit --debug COMMAND`` (or ``RLKIT_DEBUG=1``) prints the full traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import Any

from rlkit.errors import RlkitError

__all__ = ["main", "build_parser"]

# Order is the order of `rlkit --help`.
COMMAND_MODULES = (
    "rlkit.cli.run",
    "rlkit.cli.recipe",
    "rlkit.cli.plugins",
    "rlkit.cli.data",
    "rlkit.cli.merge",
    "rlkit.cli.eval",
    "rlkit.cli.serve",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlkit", description="RL post-training of language models.")
    parser.add_argument("--version", action="version", version=f"rlkit {_version()}")
    parser.add_argument(
        "--debug", action="store_true", help="print the full traceback of an error (also: RLKIT_DEBUG=1)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def _version() -> str:
    from rlkit import __version__

    return __version__


def main(argv: list[str] | None = None, *, hooks: Any = None) -> int:
    """The ``rlkit`` command. ``hooks``: ``rlkit.step.hooks.RunHooks`` for ``run`` (passed only by
    ``rlkit.testing.faults``)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides after a flag (`rlkit run R --smoke a.b=1`) land here; anything else is an error
        if not isinstance(getattr(args, "overrides", None), list) or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if hooks is not None:
        args.hooks = hooks
    debug = args.debug or os.environ.get("RLKIT_DEBUG", "") not in ("", "0")
    try:
        return int(args.func(args) or 0)
    except RlkitError as exc:
        if debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a user sees one message; --debug shows where
        if debug:
            raise
        print(
            f"error: unexpected {type(exc).__name__} in `rlkit {args.command}`: {exc}\n"
            "This is a case rlkit does not check yet (or a bug in rlkit or a plugin). Run again with "
            "`rlkit --debug ...` or RLKIT_DEBUG=1 for the full traceback, and report it.",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
