"""The ``lightning-perf`` command (also ``python -m lightning_perf``).

``lightning-perf bench`` trains a reference workload under named configurations, each in a fresh process, and shows
their effect side by side against ``baseline``; ``lightning-perf autotune`` measures a model (a reference workload or
the user's own classes) and recommends its fastest safe configuration; ``lightning-perf export`` exports a checkpoint
for deployment; ``lightning-perf compare`` compares two results files and exits 1 on a regression. Bad arguments exit
with status 2 and one line on stderr that says what is valid.

One module per command (``lightning_perf.cli.<command>``), each with ``HELP``, ``DESCRIPTION``,
``add_arguments(parser)`` and ``run(args, parser)``; building the parsers imports neither torch nor Lightning, so
``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from lightning_perf.cli._common import CliParser, UsageError, one_line

__all__ = ["COMMANDS", "build_parser", "main"]

COMMANDS: tuple[str, ...] = ("bench", "autotune", "export", "compare")
"""The sub-commands, each a module ``lightning_perf.cli.<name>``."""


def build_parser() -> argparse.ArgumentParser:
    """The ``lightning-perf`` parser with every sub-command (imports neither torch nor Lightning)."""
    parser = CliParser(prog="lightning-perf", description=__doc__.splitlines()[0], allow_abbrev=False)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        command = importlib.import_module(f"lightning_perf.cli.{name}")
        sub = subparsers.add_parser(name, help=command.HELP, description=command.DESCRIPTION, allow_abbrev=False)
        sub.set_defaults(run=command.run, subparser=sub)
        command.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lightning-perf`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    A bad invocation exits 2 (``SystemExit``) with one line on stderr; no traceback reaches the user.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    subparser: argparse.ArgumentParser = args.subparser
    try:
        return int(args.run(args, subparser))
    except UsageError as exc:
        subparser.error(str(exc))  # exits 2
    except KeyboardInterrupt:
        sys.stderr.write(f"{subparser.prog}: interrupted\n")
        return 130
    except Exception as exc:  # a failure of the work itself: one line, not a traceback
        sys.stderr.write(f"{subparser.prog}: failed: {type(exc).__name__}: {one_line(exc)}\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
