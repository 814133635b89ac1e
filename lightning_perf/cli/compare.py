"""``lightning-perf compare OLD.json NEW.json``: did anything get slower, beyond the threshold and the noise?

Reads two bench results files (or two pytest-benchmark ``--benchmark-json`` files), matches configurations by name,
and prints per configuration and figure the old and new medians, the change with its 95% interval and a verdict.
Exit status: 1 when a configuration is slower beyond the threshold and the noise, 0 otherwise, 2 for bad arguments or
files that cannot be read or compared (one line on stderr). The parser imports nothing heavy; the comparison (NumPy)
loads in :func:`run`.

``--threshold`` is a percentage and must carry its ``%`` sign (``5%``, ``2.5%``, ``0%``): a bare ``5`` or ``0.05``
is refused rather than guessed, since either reading (five percent, or a fraction) would surprise someone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_perf.cli._common import UsageError, at_least, existing_file, fail, invalid

DEFAULT_THRESHOLD = "5%"
OUTPUT_SUFFIXES = (".json", ".md")


def percentage(text: str) -> float:
    """``--threshold``: a percentage with its sign, ``0%`` or more (``5%`` gives 0.05)."""
    expected = "a percentage with its % sign, >= 0%, e.g. 5% or 2.5%"
    stripped = text.strip()
    try:
        if stripped.endswith("%"):
            return at_least(0, float)(stripped[:-1]) / 100.0
    except argparse.ArgumentTypeError:
        pass
    raise invalid(text, expected)


def output_path(text: str) -> Path:
    """``--output``: a path ending in ``.json`` or ``.md`` (not an existing directory)."""
    path = Path(text)
    if not text.strip() or path.suffix.lower() not in OUTPUT_SUFFIXES or path.is_dir():
        raise invalid(text, "a file path ending in .json or .md")
    return path


HELP = "compare two results files and fail on a regression"
DESCRIPTION = (
    "Compare two results files of `lightning-perf bench --output` (or of pytest --benchmark-json) configuration by "
    "configuration: old and new medians of step time, throughput, step memory and predict time, the change with its "
    "95% interval between processes (Welch t over the repeats) and a verdict (faster, slower, no clear difference). "
    "A change is called only when it is beyond the threshold and its interval excludes no change; one repeat on a "
    "side gives no verdict. Exit status: 1 when something is slower, 0 otherwise, 2 for bad arguments or files that "
    "cannot be read or compared."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``compare``."""
    parser.add_argument("old", type=existing_file, metavar="OLD.json", help="the reference results file")
    parser.add_argument("new", type=existing_file, metavar="NEW.json", help="the results file to check")
    parser.add_argument(
        "--threshold",
        type=percentage,
        default=percentage(DEFAULT_THRESHOLD),
        help="smallest change worth a verdict, a percentage with its %% sign (default: 5%%)",
    )
    parser.add_argument(
        "--output",
        type=output_path,
        help="also write the comparison to this file: .json (every figure and interval) or .md",
    )
    parser.add_argument("--force", action="store_true", help="overwrite --output when it exists")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Compare ``args.old`` with ``args.new``; returns 1 on a regression, 0 otherwise (2 via ``parser.error``)."""
    if args.output is not None and args.output.exists() and not args.force:
        fail(parser, "--output", str(args.output), "a file that does not exist yet, or --force to overwrite it")
    if args.output is not None and not args.output.parent.is_dir():
        fail(parser, "--output", str(args.output), "a path in an existing directory")
    from lightning_perf.benchmark.compare import IncompatibleResultsError, ResultsFileError, compare_files
    from lightning_perf.benchmark.compare_text import format_table, markdown_report

    try:
        comparison = compare_files(args.old, args.new, args.threshold)
    except (ResultsFileError, IncompatibleResultsError) as exc:
        parser.error(str(exc))
    print(format_table(comparison))
    if args.output is not None:
        import json

        from lightning_perf._io import atomic_write_text

        if args.output.suffix.lower() == ".json":
            text = json.dumps(comparison.to_dict(), indent=2, allow_nan=False) + "\n"
        else:
            text = markdown_report(comparison)
        try:
            atomic_write_text(args.output, text)
        except OSError as exc:
            message = f"argument --output: {str(args.output)!r} cannot be written ({exc.strerror or exc})"
            raise UsageError(message) from None
        print(f"wrote {args.output}")
    return 1 if comparison.regressions else 0
