"""The text of a comparison of two result files (:mod:`lightning_perf.benchmark.compare`): the 80-column table and
the Markdown report."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_perf.benchmark.compare import METHOD, FileComparison, MetricRow
from lightning_perf.profiling.report import format_bytes, format_seconds, text_table, wrap_lines

__all__ = ["format_table", "format_value", "interval_text", "markdown_report", "percent_change"]


def format_value(value: float | None, unit: str) -> str:
    """A figure in a readable unit: ``412 ms``, ``71.6/s``, ``99.8 MiB``."""
    if value is None:
        return "-"
    return format_seconds(value) if unit == "s" else format_bytes(value) if unit == "bytes" else f"{value:.3g}/s"


def percent_change(ratio: float) -> str:
    """The change a ratio new/old means: ``+48%``, ``-3.2%``."""
    change = (ratio - 1.0) * 100.0
    return f"{change:+.0f}%" if abs(change) >= 10 else f"{change:+.1f}%"


def _row_interval(row: MetricRow) -> str:
    """The interval between processes; one within a process in brackets (indicative: one repeat a side); or ``-``."""
    text = interval_text(row.ratio_ci95 or row.within_process_ci95)
    return text if row.ratio_ci95 or text == "-" else f"({text})"


def interval_text(ci: Sequence[float] | None) -> str:
    """A ratio's 95% interval as changes: ``-3.2..+1.0%``."""
    return "-" if ci is None else f"{percent_change(ci[0])[:-1]}..{percent_change(ci[1])}"


def format_table(comparison: FileComparison, width: int = 80) -> str:
    """The comparison as plain text within ``width`` columns (80 by default): one block per configuration, one row
    per figure, then what is missing, the notes and the regressions."""
    pct = f"{comparison.threshold * 100:g}%"
    lines = [
        f"old: {comparison.old.path} ({comparison.old.description})",
        f"new: {comparison.new.path} ({comparison.new.description})",
        *(f"warning: {w}" for w in (*comparison.old.warnings, *comparison.new.warnings)),
        "",
    ]
    rows: list[list[str] | str] = []
    for i, row in enumerate(comparison.rows):
        if i == 0 or row.config != comparison.rows[i - 1].config:
            rows.append(row.config)  # a heading line across the table
        change = percent_change(row.ratio) if row.ratio is not None else "-"
        old, new = format_value(row.old_median, row.unit), format_value(row.new_median, row.unit)
        rows.append([f"  {row.metric}{'*' if row.note else ''}", old, new, change, _row_interval(row), row.verdict])
    header = ["configuration", "old", "new", "change", "95% interval", "verdict"]
    lines += text_table(header, rows, width=width).splitlines()
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
        named = ", ".join(f"{row.config} ({row.metric} {percent_change(row.ratio or 1.0)})" for row in regressions)
        lines.append(f"REGRESSION beyond {pct} and the noise: {named}")
    else:
        lines.append(f"no regression beyond {pct} and the noise")
    return "\n".join(part for line in lines for part in wrap_lines(line, width))


def _unmatched(comparison: FileComparison) -> list[str]:
    """What was not compared: the configurations of one file only, and the comparison's notes."""
    sides = (("old", comparison.only_in_old), ("new", comparison.only_in_new))
    return [f"only in {side}: {', '.join(names)}" for side, names in sides if names] + comparison.notes


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
            f"{format_value(row.new_median, row.unit)} | {percent_change(row.ratio) if row.ratio else '-'} | "
            f"{_row_interval(row)} | {row.n_old} / {row.n_new} | {verdict_text} |"
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
