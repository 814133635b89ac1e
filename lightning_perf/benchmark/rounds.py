"""The bench's schedule: interleaved rounds of runs, a fixed number (``--repeats N``) or until settled (``auto``).

A round runs each configuration once, in an order that rotates from round to round (so a drift of the machine falls
on every configuration alike); repeat ``i`` of a configuration pairs with baseline's repeat ``i``. With a
:class:`~lightning_perf.benchmark.settle.Settling`, after each round the ratios measured so far decide whether another
round runs and which configurations it holds (baseline and the ones not yet settled). The runs themselves and the
ratios are the caller's (``run_one`` and ``estimates_of``), so this schedule is tested without processes. Where the
caller's ``rethink`` says after a round that the runs so far no longer count (the threads were chosen again), they
are set aside and the rounds start again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_perf.benchmark.settle import Decision, Settling
from lightning_perf.optimizations import BASELINE
from lightning_perf.profiling.intervals import RatioEstimate

__all__ = ["Rounds", "rotated", "run_rounds"]

RunOne = Callable[[str, int], Any]
"""``(configuration, repeat) -> result`` (a :class:`~lightning_perf.benchmark.worker.RunResult`)."""
EstimatesOf = Callable[[Mapping[str, Sequence[Any]]], Mapping[str, "RatioEstimate | None"]]
"""results so far -> each configuration's ratio against baseline (None where it measured nothing)."""


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """``names`` rotated by ``round_index`` places (round 0 keeps the given order)."""
    if not names:
        return []
    shift = round_index % len(names)
    return list(names[shift:]) + list(names[:shift])


@dataclass
class Rounds:
    """What a schedule ran.

    Attributes:
        results: configuration -> its results, in the order they ran.
        rounds: the rounds run.
        decision: the settling rule's last decision (None for a fixed number of repeats).
        set_aside: ``(configuration, repeat, why)`` of each run measured again and kept out of the results.
    """

    results: dict[str, list[Any]] = field(default_factory=dict)
    rounds: int = 0
    decision: Decision | None = None
    set_aside: list[tuple[str, int, str]] = field(default_factory=list)


def _start_again(
    out: Rounds, kept: list[tuple[str, int, float]], settling: Settling | None, before: Mapping[str, int], why: str
) -> None:
    """Set aside the runs kept so far (``rethink`` said why they no longer count), their time counted lost."""
    out.set_aside += [(name, repeat, why) for name, repeat, _ in kept]
    if settling is not None:
        settling.lose(sum(seconds for *_, seconds in kept), pace=True)
    for name, count in before.items():
        del out.results[name][count:]
    kept.clear()


def run_rounds(
    names: Sequence[str],
    run_one: RunOne,
    *,
    repeats: int | None = None,
    settling: Settling | None = None,
    estimates_of: EstimatesOf | None = None,
    first_repeat: int = 0,
    reserve_s: Callable[[], float] | None = None,
    results: dict[str, list[Any]] | None = None,
    disturbed: Callable[[Any], str | None] | None = None,
    rethink: Callable[[int], str | None] | None = None,
) -> Rounds:
    """Run ``names`` in interleaved rounds: ``repeats`` rounds, or until ``settling`` stops.

    Args:
        names: the configurations, baseline among them.
        run_one: runs one configuration's repeat and returns its result.
        repeats: a fixed number of rounds (``--repeats N``); give this or ``settling``.
        settling: the rule that decides after each round (``--repeats auto``), with ``estimates_of``.
        estimates_of: the ratios against baseline from the results so far.
        first_repeat: the first round's repeat number (a later phase continues it: its runs pair with its own).
        reserve_s: seconds the rule keeps for later phases (asked after each round).
        results: results to add to (a later phase's configurations join the earlier ones').
        disturbed: result -> why its run was disturbed (None: it was not); such a run is measured again at the round's
            end, the budget stretching by the time lost, and the second run kept: every repeat keeps its pair.
        rethink: round (from 1) -> why the runs so far no longer count (None: they do), asked after each run while the
            budget may stretch: they are set aside, their time counted lost, and the rounds start again.
    """
    if (repeats is None) == (settling is None):
        raise ValueError("`run_rounds` needs either `repeats` or `settling`, not both.")
    if settling is not None and estimates_of is None:
        raise ValueError("`run_rounds(settling=...)` needs `estimates_of`.")
    out = Rounds(results=results if results is not None else {})
    for name in names:
        out.results.setdefault(name, [])
    active, before = list(names), {name: len(out.results[name]) for name in names}
    kept: list[tuple[str, int, float]] = []  # the runs in the results, for a restart

    def measure(name: str, repeat: int, again: bool) -> str | None:
        start = settling.clock() if settling is not None else 0.0
        result = run_one(name, repeat)
        seconds = settling.clock() - start if settling is not None else 0.0
        if settling is not None:
            settling.record_run(name, seconds)
        why = disturbed(result) if disturbed is not None else None
        if why is not None and not again and (settling is None or settling.can_stretch):
            out.set_aside.append((name, repeat, why))  # type: ignore[arg-type]
            if settling is not None:
                settling.lose(seconds)
            return why
        out.results[name].append(result)
        kept.append((name, repeat, seconds))
        return None

    while True:
        repeat, again, why = first_repeat + out.rounds, [], None
        for name in rotated(active, out.rounds):
            if measure(name, repeat, False) is not None:
                again.append(name)
            can = settling is None or settling.can_stretch  # asked after each run: a load that ends mid-round
            if rethink is not None and can and (why := rethink(out.rounds + 1)) is not None:  # costs no more runs
                break
        if why is not None:
            _start_again(out, kept, settling, before, why)
            out.rounds, active = 0, list(names)
            continue
        for name in again:  # at the round's end: a transient load may have passed
            measure(name, repeat, True)
        out.rounds += 1
        if settling is None:
            if out.rounds >= repeats:  # type: ignore[operator]
                return out
            continue
        estimates = estimates_of(out.results)  # type: ignore[misc]
        estimates = {n: e for n, e in estimates.items() if n in names and n != BASELINE}
        out.decision = settling.decide(estimates, out.rounds, reserve_s=reserve_s() if reserve_s else 0.0)
        if out.decision.stop:
            return out
        active = [n for n in names if n in out.decision.active]
