"""The ``rlkit`` command: run | validate | recipe show | plugins | data | merge | plot | eval | serve.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``; the parser's
``func(args) -> int`` does the work and returns the exit code. Errors rlkit raises on purpose
(``RlkitError``) print as one clear message, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

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
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def _version() -> str:
    from rlkit import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides after a flag (`rlkit run R --smoke a.b=1`) land here; anything else is an error
        if not isinstance(getattr(args, "overrides", None), list) or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except RlkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
