"""The text of a comparison of two result files (:mod:`lightning_perf.benchmark.compare`): the 80-column table and
the Markdown report."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable

from lightning_perf.benchmark.compare import METHOD, FileComparison, MetricRow

__all__ = ["format_table", "format_value", "markdown_report"]


def format_value(value: float | None, unit: str) -> str:
    """A figure in a readable unit: ``412 ms``, ``71.6/s``, ``99.8 MiB``."""
    if value is None:
        return "-"
    if unit == "s":
        for scale, suffix in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
            if value >= scale:
                return f"{value / scale:.3g} {suffix}"
        return f"{value * 1e9:.3g} ns"
    if unit == "bytes":
        for scale, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if value >= scale:
                return f"{value / scale:.3g} {suffix}"
        return f"{value:.0f} B"
    return f"{value:.3g}/s"


def _percent(ratio: float) -> str:
    change = (ratio - 1.0) * 100.0
    return f"{change:+.0f}%" if abs(change) >= 10 else f"{change:+.1f}%"


def _interval(row: MetricRow) -> str:
    """The interval between processes as ``-2.1..+3.0%``; one within a process in brackets (indicative); or ``-``."""
    interval = row.ratio_ci95 or row.within_process_ci95
    if interval is None:
        return "-"
    low, high = ((r - 1.0) * 100.0 for r in interval)
    text = f"{_signed(low)}..{_signed(high)}%"
    return text if row.ratio_ci95 else f"({text})"


def _signed(percent: float) -> str:
    return f"{percent:+.0f}" if abs(percent) >= 10 else f"{percent:+.1f}"


TABLE_HEADER = ("", "old", "new", "change", "95% interval", "verdict")
_WIDTHS = (14, 9, 9, 7, 14)


def _line(cells: Iterable[str]) -> str:
    cells = list(cells)
    first = cells[0].ljust(_WIDTHS[0])
    middle = [cell.rjust(width) for cell, width in zip(cells[1:5], _WIDTHS[1:])]
    return " ".join([first, *middle, cells[5]]).rstrip()


def format_table(comparison: FileComparison, width: int = 80) -> str:
    """The comparison as plain text within ``width`` columns (80 by default): one block per configuration, one row
    per figure, then what is missing, the notes and the regressions."""
    pct = f"{comparison.threshold * 100:g}%"
    lines = [
        f"old: {comparison.old.path} ({comparison.old.description})",
        f"new: {comparison.new.path} ({comparison.new.description})",
        *(f"warning: {w}" for w in (*comparison.old.warnings, *comparison.new.warnings)),
        "",
        _line(("configuration", *TABLE_HEADER[1:])),
    ]
    current = None
    for row in comparison.rows:
        if row.config != current:
            current = row.config
            lines.append(row.config)
        marker = "*" if row.note else ""
        lines.append(
            _line(
                (
                    f"  {row.metric}{marker}",
                    format_value(row.old_median, row.unit),
                    format_value(row.new_median, row.unit),
                    _percent(row.ratio) if row.ratio is not None else "-",
                    _interval(row),
                    row.verdict,
                )
            )
        )
    if not comparison.rows:
        lines.append("(no configuration measured in both files)")
    lines.append("")
    notes = sorted({row.note for row in comparison.rows if row.note})
    lines += [f"* {note}" for note in notes] + _unmatched(comparison)
    lines.append(
        f"change: new/old over the repeats, 95% interval between processes (Welch t); a verdict needs the interval "
        f"excluding 0% and a change beyond {pct}."
    )
    regressions = comparison.regressions
    if regressions:
        named = ", ".join(f"{row.config} ({row.metric} {_percent(row.ratio or 1.0)})" for row in regressions)
        lines.append(f"REGRESSION beyond {pct} and the noise: {named}")
    else:
        lines.append(f"no regression beyond {pct} and the noise")
    return "\n".join(_wrap(line, width) for line in lines)


def _unmatched(comparison: FileComparison) -> list[str]:
    """What was not compared: the configurations of one file only, and the comparison's notes."""
    sides = (("old", comparison.only_in_old), ("new", comparison.only_in_new))
    return [f"only in {side}: {', '.join(names)}" for side, names in sides if names] + comparison.notes


def _wrap(line: str, width: int) -> str:
    if len(line) <= width:
        return line
    return "\n".join(textwrap.wrap(line, width, subsequent_indent="  ", break_on_hyphens=False))


def markdown_report(comparison: FileComparison) -> str:
    """The comparison as Markdown: a table with every figure, its interval and verdict."""
    pct = f"{comparison.threshold * 100:g}%"
    out = [
        "# lightning-perf compare",
        "",
        f"- old: `{comparison.old.path}` ({comparison.old.description})",
        f"- new: `{comparison.new.path}` ({comparison.new.description})",
        f"- threshold: {pct}",
        f"- method: {METHOD}",
        "",
        "| configuration | figure | old | new | change | 95% interval | repeats old / new | verdict |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in comparison.rows:
        verdict_text = f"**{row.verdict}**" if row.regression else row.verdict
        out.append(
            f"| {row.config} | {row.metric} | {format_value(row.old_median, row.unit)} | "
            f"{format_value(row.new_median, row.unit)} | {_percent(row.ratio) if row.ratio else '-'} | "
            f"{_interval(row)} | {row.n_old} / {row.n_new} | {verdict_text} |"
        )
    out.append("")
    extra = [*comparison.old.warnings, *comparison.new.warnings, *sorted({r.note for r in comparison.rows if r.note})]
    extra += _unmatched(comparison)
    out += [f"- {line}" for line in extra]
    regressions = comparison.regressions
    out += [
        "",
        f"**Regression** beyond {pct} and the noise: " + ", ".join(f"{r.config} ({r.metric})" for r in regressions)
        if regressions
        else f"No regression beyond {pct} and the noise.",
        "",
    ]
    return "\n".join(out)
