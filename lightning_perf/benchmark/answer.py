"""The bench's answer as data: how the repeats settled, and the recommended stack, for the report and its readers.

The runner measures (:mod:`lightning_perf.benchmark.rounds`, :mod:`lightning_perf.benchmark.settle`); these functions
turn what it measured into the report's ``settling`` and ``recommendation`` entries and mark each summary row
settled or not, so the console, the Markdown and the PNG say the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_perf.benchmark.settle import (
    DEFAULT_TARGET,
    Decision,
    Settling,
    Unsettled,
    is_settled,
    unsettled_item,
    unsettled_text,
)
from lightning_perf.benchmark.stack import Stack, is_winner, recommendation_lines, recommended_names
from lightning_perf.optimizations import BASELINE
from lightning_perf.profiling.intervals import RatioEstimate

if TYPE_CHECKING:
    from lightning_perf.benchmark.results import ConfigSummary

__all__ = ["estimates_from", "mark_settled", "prefer_measured_stack", "recommendation_record", "settling_record"]

RATIO = "speedup"
"""The ratio that must settle and that picks the winners (for an inference stage, the per-batch latency speed-up)."""


def estimates_from(summaries: Sequence[ConfigSummary]) -> dict[str, RatioEstimate | None]:
    """Each measured configuration's speed-up against baseline (None where it measured nothing)."""
    return {s.config: s.estimate(RATIO) for s in summaries if s.config != BASELINE}


def mark_settled(
    summaries: Sequence[ConfigSummary], target: float = DEFAULT_TARGET, settling: Settling | None = None
) -> list[Unsettled]:
    """Set each row's ``settled`` and, where it did not, ``unsettled`` (what would settle it); returns those rows."""
    out = []
    for s in summaries:
        estimate = s.estimate(RATIO) if s.config != BASELINE else None
        if estimate is None:
            continue
        s.settled = is_settled(estimate, target)
        if s.settled:
            s.unsettled = None
            continue
        item = unsettled_item(s.config, estimate, target, settling)
        s.unsettled = unsettled_text(item, target)
        out.append(item)
    return out


def settling_record(
    settling: Settling | None, decisions: Sequence[Decision | None], rounds: int, summaries: Sequence[ConfigSummary]
) -> dict[str, Any]:
    """The report's ``settling``: the mode, target, budget, rounds, why it stopped, and every unsettled ratio."""
    if settling is None:
        mark_settled(summaries)
        return {"mode": "fixed", "rounds": rounds}
    unsettled = mark_settled(summaries, settling.target, settling)
    # The first decision ended the single configurations' rounds, any later one the winners' stack's: say which.
    first, *later = [d.reason if d is not None else "" for d in decisions] or [""]
    stopped = "; ".join(
        filter(None, [first, *(f"the winners' stack: {r}" for r in dict.fromkeys(later) if r and r != first)])
    )
    return {
        "mode": "auto",
        "target": settling.target,
        "time_budget_s": settling.time_budget_s,
        "elapsed_s": settling.elapsed_s,
        "rounds": rounds,
        "stopped": stopped,
        "unsettled": [{**item.__dict__, "text": unsettled_text(item, settling.target)} for item in unsettled],
    }


def prefer_measured_stack(stack: Stack, summaries: Sequence[ConfigSummary], notes: list[str] | None = None) -> Stack:
    """What the recommendation names: ``stack`` (the winners stacked), or a stack measured in the same run
    (``--configs a+b+c``) that won itself (its whole interval above 1 over enough repeats, undisturbed) and whose
    interval lies wholly above that of what ``stack`` would put in the Trainer; the best such stack. A measured stack
    faster by its point estimate only (the intervals overlap) is not preferred, and ``notes`` gets a line saying so."""
    by_name = {s.config: s for s in summaries}
    singles = estimates_from(summaries)
    row = by_name.get(stack.name)
    current = "+".join(recommended_names(stack, row.estimate(RATIO) if row is not None else None, singles))
    best = by_name.get(current)
    floor = best.estimate(RATIO) if best is not None else None
    chosen = None
    for candidate in summaries:
        estimate = candidate.estimate(RATIO)
        if "+" not in candidate.config or candidate.config == current or candidate.disturbed or not is_winner(estimate):
            continue
        assert estimate is not None  # a winner has an interval
        if floor is None or estimate.low > floor.high:
            chosen, floor = candidate, estimate
        elif estimate.ratio > floor.ratio and notes is not None:
            notes.append(f"{candidate.config} {estimate.format()} is not clearly faster than {current or 'baseline'} "
                         f"{floor.format()} (the intervals overlap): the recommendation keeps the latter")  # fmt: skip
    return stack if chosen is None else Stack(tuple(chosen.config.split("+")))


def recommendation_record(
    stack: Stack, summaries: Sequence[ConfigSummary], *, config_file: bool = False
) -> dict[str, Any]:
    """The report's ``recommendation``: the stack, what was dropped from it, its speed-up and the lines to add."""
    by_name = {s.config: s for s in summaries}
    singles = estimates_from(summaries)
    row = by_name.get(stack.name)
    estimate = row.estimate(RATIO) if row is not None else None
    notes = [] if row is None else [row.unsettled, "measured while the machine was disturbed" if row.disturbed else ""]
    note = "; ".join(filter(None, notes))
    lines = recommendation_lines(
        stack, estimate if len(stack.names) > 1 else None, singles, settled_note=note, config_file=config_file
    )
    measured = [e for e in singles.values() if e is not None]
    if not stack.names and measured and not any(e.has_interval for e in measured):
        lines = [
            "Recommendation: none yet: with one repeat no speed-up has an interval, so none can be called faster; "
            "run with --repeats auto (the default) or --repeats 2 or more."
        ]
    return {
        "stack": stack.name,
        "configs": list(stack.names),
        "dropped": [list(item) for item in stack.dropped],
        "speedup": None if estimate is None else estimate.to_dict(RATIO),
        "lines": lines,
    }
