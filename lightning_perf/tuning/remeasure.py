"""Measuring again what was disturbed, for the auto-tuner: the bench's rule (:mod:`lightning_perf.benchmark.rounds`)
applied to one trial at a time.

A trial the watcher finds disturbed is set aside and measured again while the budget lasts, at most
:data:`MAX_MEASUREMENTS` runs; the budget stretches by the time the set-aside runs took, up to twice it
(:class:`~lightning_perf.benchmark.settle.Settling`'s ``lose``/``can_stretch``). Two baseline runs further apart than
:data:`~lightning_perf.tuning.conditions.BASELINE_SPREAD_MAX` get a third, and the two that agree are the reference.
:class:`Remeasuring` is the part of :class:`~lightning_perf.tuning.tuner.AutoTuner` that does it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from lightning_perf.benchmark.settle import Settling
from lightning_perf.profiling.stats import median
from lightning_perf.tuning.conditions import TrialWatch, baseline_spread_cause
from lightning_perf.tuning.results import Trial
from lightning_perf.tuning.verdicts import per_sample_times

__all__ = ["MAX_MEASUREMENTS", "Remeasuring"]

MAX_MEASUREMENTS = 3
"""Runs of one trial at most: a trial still disturbed on its third run is under a steady load, not a passing one."""


class Remeasuring:
    """The tuner's trials, measured again when disturbed (a mixin of :class:`~lightning_perf.tuning.tuner.AutoTuner`,
    which provides ``_measure``, ``_usable``, ``_record`` and ``_say``)."""

    _deadline: float
    _stretch: Settling | None
    _tries: int
    _watch: TrialWatch
    # AutoTuner's methods, named here for the type checker.
    _measure: Callable[[Any, float], Any]
    _usable: Callable[[Any], Any]
    _record: Callable[..., Trial]
    _say: Callable[[str], None]

    def _trial(self, candidate: Any, timeout: float) -> tuple[Any, list[str], list[str]]:
        """Measure ``candidate`` with the machine watched: ``(result, set-aside causes, causes)``.

        A run that the watcher finds disturbed (other processes' load, steal, load average, a throttled CPU, its own
        interrupted steps) is set aside and measured again, up to :data:`MAX_MEASUREMENTS` runs, while the budget
        lasts; the budget stretches by the time the set-aside runs took, up to twice it (the bench's rule,
        :class:`~lightning_perf.benchmark.settle.Settling`). ``causes`` are those of the result returned (empty:
        clean), ``set-aside causes`` those of the runs measured again (empty: none was)."""
        result, causes = self._watched(candidate, timeout)
        aside: list[str] = []
        self._tries = 1
        while result is not None and result.ok and causes:
            if self._tries >= MAX_MEASUREMENTS:
                self._say(f" disturbed ({'; '.join(causes)}); measured {self._tries} times, disturbed every time")
                break
            self._set_aside(result.wall_s or 0.0)
            remaining = self._deadline - time.monotonic()
            if (result.wall_s or 0.0) > remaining:
                self._say(f" disturbed ({'; '.join(causes)}); no budget to measure it again")
                break
            self._say(f" disturbed ({'; '.join(causes)}); measuring it again")
            again, again_causes = self._watched(candidate, remaining)
            if again is None or not again.ok:
                break
            self._tries += 1
            aside += [c for c in causes if c not in aside]
            result, causes = again, again_causes
        return result, aside, causes

    def _watched(self, candidate: Any, timeout: float) -> tuple[Any, list[str]]:
        """One run of ``candidate`` and what disturbed it (empty for a clean, failed or timed-out run)."""
        token = self._watch.start()
        try:
            result = self._usable(self._measure(candidate, timeout))
            if result is None or not result.ok:
                return result, []
            return result, self._watch.causes(token, candidate.label, result.step_times_s)
        finally:
            self._watch.close()  # the monitor's sampler thread ends with the trial, whatever became of it

    def _set_aside(self, seconds: float) -> None:
        """A disturbed run measured nothing usable: the deadline moves by its time, up to the budget's cap."""
        if self._stretch is not None and self._stretch.can_stretch:
            before = self._stretch.budget_s
            self._stretch.lose(seconds)
            self._deadline += self._stretch.budget_s - before

    def _every_time(self) -> str:
        """``"measured 3 times, disturbed every time"`` for the last trial."""
        return f"measured {self._tries} times, disturbed every time" if self._tries > 1 else "no budget to re-measure"

    def _agreeing_baselines(self, candidate: Any, first: Any, second: Any) -> tuple[Any, Any] | str:
        """Two baseline runs that agree (within :data:`~lightning_perf.tuning.conditions.BASELINE_SPREAD_MAX`), or why
        there are none. When the first two differ more, a third run is measured while the budget lasts (a passing load
        may have slowed one of them, unseen by the watcher); the two closest of the three then serve, the odd one is
        set aside."""
        spread = baseline_spread_cause(median(per_sample_times(first)), median(per_sample_times(second)))
        if spread is None:
            return first, second
        if (second.wall_s or 0.0) > self._deadline - time.monotonic():
            return f"{spread}; no budget to measure it a third time"
        self._say("the two baseline runs differ: measuring it a third time")
        third_candidate = candidate.with_("baseline (again)", "baseline")
        third, aside, causes = self._trial(third_candidate, timeout=self._deadline - time.monotonic())
        row = self._record(third_candidate, third, causes, aside)
        if third is None or not third.ok or causes:
            row.reason = "the third run failed, ran out of time or was disturbed"
            return f"{spread}; {row.reason}"
        row.verdict = "baseline"
        runs = [(first, "baseline"), (second, "baseline (repeat)"), (third, "baseline (again)")]
        s_per = {label: median(per_sample_times(run)) for run, label in runs}
        a, b = min(((x, y) for i, x in enumerate(runs) for y in runs[i + 1 :]),
                   key=lambda p: max(s_per[p[0][1]], s_per[p[1][1]]) / min(s_per[p[0][1]], s_per[p[1][1]]))  # fmt: skip
        if baseline_spread_cause(s_per[a[1]], s_per[b[1]]) is not None:
            return f"{spread}; a third run ({s_per['baseline (again)'] * 1e3:.1f} ms per sample) agreed with neither"
        odd = next(label for _, label in runs if label not in (a[1], b[1]))
        row.reason = (
            f"measured a third time: {a[1]} and {b[1]} agree; {odd} ({s_per[odd] * 1e3:.1f} ms per sample) set aside"
        )
        return a[0], b[0]
