"""What ``lightning-perf bench`` prints when it ends: the table, how to read it, every warning, and the answer.

Every line fits 80 columns and nothing is cut: the table wraps its cells at spaces (a stack's name breaks after its
``+``), columns with nothing measured are left out, and every prose line is wrapped. Every ``?`` in the table has a
line naming its cause (:func:`mark_lines`). A ratio that did not settle says so with what would settle it, and the
output ends with the recommendation: the winners' stack, its speed-up and the lines to add to the Trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_perf.optimizations import BASELINE
from lightning_perf.profiling.report import CONSOLE_WIDTH, text_table, wrap_lines

if TYPE_CHECKING:
    from lightning_perf.benchmark.results import BenchReport

__all__ = ["cold_start_lines", "console_lines", "mark_lines", "settling_lines"]

_EMPTY = ("", "n/a", "-")


def _drop_empty_columns(columns: Sequence[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """Leave out the columns where no row but baseline's reference figure measured anything."""
    keep = [
        j
        for j in range(len(columns))
        if j == 0 or any(str(row[j]).strip() not in _EMPTY and not _reference_only(rows, row, j) for row in rows)
    ]
    return [columns[j] for j in keep], [[row[j] for j in keep] for row in rows]


def _reference_only(rows: list[list[str]], row: list[str], j: int) -> bool:
    return row[0] == BASELINE and str(row[j]).strip() == "1.00x" and len(rows) > 1


def _break_stack(cell: str) -> str:
    """A stack's name on one line per part (``a+\\nb``): its parts stay whole within a narrow column."""
    first, _, rest = cell.partition("\n")
    return first.replace("+", "+\n") + (f"\n{rest}" if rest else "")


def mark_lines(report: BenchReport) -> list[str]:
    """One line per row marked ``?`` or ``(disturbed)``, naming what disturbed it (its own runs, its pairs with
    baseline's, or its dispersion), so that no mark stands without its cause."""
    reliability = report.reliability or {}
    runs = list(reliability.get("disturbed_runs") or [])
    causes = list(reliability.get("causes") or [])
    lines = []
    for s in report.summaries:
        if not s.disturbed:
            continue
        involved = [s.config] if s.config == BASELINE else [s.config, BASELINE]
        parts = []
        own_runs = [r for r in runs if any(r.startswith(f"{c}, ") for c in involved)]
        if own_runs:  # what loaded the machine, in short (its figures are in the warnings above)
            kinds = [c.split(":")[0].split(" during ")[0] for c in causes if not c.startswith("dispersion of ")]
            parts.append(
                f"runs measured while the machine was busy ({'; '.join(own_runs)})"
                + (f": {', '.join(dict.fromkeys(kinds))}" if kinds else "")
            )
        parts += [c for c in causes if any(c.startswith(f"dispersion of {c2}:") for c2 in involved)]
        if not parts:
            parts.append("the machine was disturbed during the bench: " + ("; ".join(causes) or "see the JSON report"))
        via = " (its ratios pair with baseline's runs)" if s.config != BASELINE and not any(
            s.config in p for p in parts
        ) else ""  # fmt: skip
        lines.append(f"warning: {s.config} is marked ?{via}: {'; '.join(parts)}")
    return lines


def settling_lines(report: BenchReport) -> list[str]:
    """How the repeats ended under ``--repeats auto``: settled, or per unsettled ratio what would settle it."""
    settling = getattr(report, "settling", None) or {}
    if not settling or settling.get("mode") != "auto":
        return []
    target = settling.get("target", 0.05)
    head = (
        f"repeats: auto, until every speed-up's 95% interval is within +-{target:.0%} or "
        f"{settling.get('time_budget_s', 0):.0f} s of measuring are spent; {settling.get('rounds', 0)} rounds: "
        f"{settling.get('stopped') or 'stopped'}."
    )
    lines = [head]
    lines += [f"{item['config']}: {item['text']}" for item in settling.get("unsettled") or []]
    return lines


def cold_start_lines(report: BenchReport) -> list[str]:
    """One line per compiled configuration: its cold first step (its first process compiles; the later ones start
    from the configuration's cache) apart from the warm ones, and after how many training steps it pays for itself
    (:func:`~lightning_perf.benchmark.payback.compile_costs`)."""
    from lightning_perf.benchmark.payback import compile_costs

    return [cost.text() for cost in compile_costs(report.summaries, report.runs)]


def console_lines(report: BenchReport, width: int = CONSOLE_WIDTH) -> list[str]:
    """The bench's closing output as lines of at most ``width`` characters (the table, its legend, notes, warnings,
    the settling of the repeats and the recommendation)."""
    from lightning_perf.benchmark import report as tables
    from lightning_perf.benchmark.threads import threads_line
    from lightning_perf.benchmark.utilization import unknown_mfu_lines

    opts = report.options
    repeats = opts.get("repeats") or f"{(report.settling or {}).get('rounds', '?')} rounds (auto)"
    heading = f"{tables.title(report).replace('`', '')}: {repeats} x {opts.get('steps')}"
    if report.stage == "fit":
        columns, rows, legend = list(tables.CONSOLE_COLUMNS), tables.console_rows(report), tables.CONSOLE_LEGEND
        heading += " steps"
    else:
        columns, rows = list(tables.INFERENCE_CONSOLE_COLUMNS), tables.inference_console_rows(report)
        legend = tables.INFERENCE_CONSOLE_LEGEND
        heading += " batches"
    rows = [[_break_stack(str(row[0])), *row[1:]] for row in rows]
    columns, rows = _drop_empty_columns(columns, rows)
    lines = [text for text in (threads_line(report.machine),) if text]  # "threads: 1 (2 cores, load 1.4)"
    lines += text_table(columns, rows, title=heading, width=width).splitlines()
    lines += wrap_lines(legend, width)
    prose: list[str] = [f"note: {note}" for note in report.notes]
    prose += tables.reliability_lines(report) + mark_lines(report)
    prose += unknown_mfu_lines(report.summaries)
    prose += settling_lines(report)
    prose += cold_start_lines(report)
    for text in prose:
        lines += wrap_lines(text, width)
    recommendation: dict[str, Any] = getattr(report, "recommendation", None) or {}
    if recommendation.get("lines"):
        lines.append("")
        lines += [part for line in recommendation["lines"] for part in (wrap_lines(line, width) if not
                  line.startswith("    ") else [line])]  # fmt: skip
    return lines
