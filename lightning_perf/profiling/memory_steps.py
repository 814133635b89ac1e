"""Memory at named points of training steps, the leak verdict and the report: no Lightning needed.

Entry points: :class:`MemorySteps` (driven by :class:`~lightning_perf.callbacks.MemoryProfilerCallback` or a
hand-written loop), :func:`leak_message`, :func:`summary_lines`, :func:`report_text`. A hand-written loop's example:
docs/architecture.md, Module notes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_perf._validation import check_number, check_str_sequence
from lightning_perf.profiling.leaks import (
    MIN_LEAK_SAMPLES,
    NOISE_FLOOR_STEPS,
    SEGMENTS,
    LeakSeries,
    LeakTrend,
    ResidentSeries,
    could_leak,
    detect_leaks,
    noise_floor,
    sen_slope_interval,
    trend_of,
)
from lightning_perf.profiling.memory import MemoryProbe, MemorySample
from lightning_perf.profiling.report import format_bytes, format_seconds, plot_lines, text_table
from lightning_perf.profiling.stats import summarize
from lightning_perf.profiling.timer import HookCost

__all__ = [
    "LEAK_CHECK_EVERY_N_STEPS",
    "PHASES",
    "POINTS",
    "SCREEN_GAP",
    "SCREEN_READINGS",
    "SCREEN_READ_EVERY_N_STEPS_CPU",
    "MemorySteps",
    "check_leak_threshold",
    "check_points",
    "leak_message",
    "rank_values",
    "report_text",
    "snapshot_table",
    "summary_lines",
]

POINTS: tuple[str, ...] = ("after_data", "after_forward", "after_backward", "after_optimizer")
"""Where in a training step memory can be sampled, in the order they happen."""

PHASES: dict[str, str] = {
    "after_data": "at the start of the step, once the batch is on the device",
    "after_forward": "after the forward pass (the loss is computed)",
    "after_backward": "after the backward pass",
    "after_optimizer": "after the optimizer step (the end of the step)",
}
"""What each point of :data:`POINTS` means, as the leak warning says it."""

LEAK_CHECK_EVERY_N_STEPS = 50
"""The observer's warm-up (its own cost is counted from this step on); on CUDA the leak verdict is renewed after this
many steps, then every quarter of the steps seen so far (at least this many), and at the end of fit."""

SCREEN_READ_EVERY_N_STEPS_CPU = 4
"""On CPU the leak screen reads the resident set (``/proc/self/statm``) at the end of one step in this many at first;
the series keeps at most :data:`SCREEN_READINGS` readings, evenly spread, so the stride doubles as the run grows (one
in 8 from step 256, 16 from 512...). A procfs ``pread`` costs 1.5 us in a warm loop but about 20 us right after a
training step (2-core AMD EPYC VM: cold caches; an empty Python call costs 2 us there, ``getpid`` 5 us): read at every
step it would be 1% of a 2 ms step."""

SCREEN_READINGS = 64
"""Readings of the resident set kept at most (see :data:`SCREEN_READ_EVERY_N_STEPS_CPU`)."""

SCREEN_GAP = 64
"""On CPU leak screens run at least this many steps apart (then every quarter of the steps so far), the first when the
resident set holds :data:`~lightning_perf.profiling.leaks.MIN_LEAK_SAMPLES` readings past warm-up (0.1-1 ms each)."""

_MIB = 1024.0 * 1024.0
_INSIDE = frozenset(("after_forward", "after_backward"))  # the points read by hooks inside the step
_MAX_REPORTED_SAMPLES = 20_000


def check_points(owner: str, points: Sequence[str] | None) -> tuple[str, ...]:
    """``points`` in step order without duplicates (``None``: all of :data:`POINTS`), else raise."""
    if points is None:
        return POINTS
    chosen = check_str_sequence(owner, "points", points, POINTS, single=False)
    return tuple(p for p in POINTS if p in chosen)


def check_leak_threshold(owner: str, leak_threshold: Any) -> float | None:
    """``leak_threshold`` as a float (None stays None) if it is a positive finite number, else raise ``ValueError``."""
    return (
        None if leak_threshold is None else check_number(owner, "leak_threshold", leak_threshold, 0.0, exclusive=True)
    )


class MemorySteps:
    """Memory at the points of each step: full samples every ``every_n_steps`` steps, a leak watch on every step.

    Leak detection, by significance and with no absolute bound in bytes, on every step of any epoch:

    - **CUDA**: the caching allocator's ``allocated`` counter (exact, no synchronization) is read at each point of
      every step into a :class:`~lightning_perf.profiling.LeakSeries`; the verdict
      (:func:`~lightning_perf.profiling.detect_leaks`) is renewed after :data:`LEAK_CHECK_EVERY_N_STEPS` steps, then
      every quarter of the steps so far (:meth:`leak_check_due`), and at the end of fit.
    - **CPU**: a cheap signal, the expensive look only to confirm. The resident set (one ``pread`` of
      ``/proc/self/statm``, :meth:`MemoryProbe.resident`) is read at the end of one step in
      :data:`SCREEN_READ_EVERY_N_STEPS_CPU` (sparser on long runs; :meth:`read_cheap`; where the optimizer does not
      step once a batch, at its start) into a series of its own. A **screen** of that series (once it holds 18
      readings past warm-up, then every quarter of the steps so far, at least :data:`SCREEN_GAP` apart) judges the
      later half of the run with the full rule (:func:`~lightning_perf.profiling.leaks.trend_of`: a steady rise in
      each third, Sen's interval above zero, four steps of growth above the readings' noise floor, which keeps out a
      clean process's creep of a page every few dozen steps) and asks for a rise faster than any that memory in use
      refused before (the same creep is not confirmed twice). The resident set is too coarse to judge a leak by
      itself (glibc trims and grows the heap by megabytes, and a leak pins pages around it), so a screen that passes
      opens a **confirmation**: the next ``leak_min_samples`` steps read memory in use (glibc ``mallinfo2``, a heap
      walk) at every point (~8 ms over 30 steps of 2 ms), and :func:`~lightning_perf.profiling.detect_leaks` judges
      those readings with the full rule. A confirmed leak is reported once; a refused one (memory in use is flat: the
      resident set grew for another reason) pushes the next screen back (50, 100, 200... steps). Delay, by default: a
      leak present from the start is screened at the first reading from step ``warmup_steps + 18 x 4`` (124) and
      reported ``leak_min_samples + 1`` steps later (155) when the resident set shows it by then
      (`benchmarks/leak_detection.py`); one that starts late, once it fills most of the screened window (the later
      half of the run, at least 36 readings).

    On both, warm-up is left out of the verdict: the first epoch when it is shorter than ``warmup_steps`` steps, else
    the first ``warmup_steps`` steps (lazily built optimizer state, allocator arenas, the first validation run's
    caches). The rule (:mod:`~lightning_perf.profiling.leaks`): over at least ``leak_min_samples`` readings, a
    Theil-Sen slope whose 95% interval lies above zero, a steady rise in each third, and growth over
    :data:`~lightning_perf.profiling.leaks.NOISE_FLOOR_STEPS` steps that reaches the readings' noise floor.

    The loop's own calls are counted and timed on :attr:`cost` (:class:`~lightning_perf.profiling.timer.HookCost`;
    steady state from step :data:`LEAK_CHECK_EVERY_N_STEPS` on, the steps that read timed whole, the cheap reads of
    the other steps as quiet calls) and reported as ``overhead``. A step that reads only the cheap signal says so
    beforehand (:attr:`reading` False), so a loop can leave its other calls out; :meth:`quiet_ahead` says how many
    steps to come are such steps.

    Args:
        probe: what reads the memory (CPU or CUDA).
        points: which points of :data:`POINTS` are sampled, in step order (see :func:`check_points`).
        every_n_steps: one fully sampled step in this many.
        warmup_steps: leading steps left out of the leak trend and the snapshot table, at most (a shorter first epoch
            is left out of the trend instead).
        leak_threshold: optional extra bound in bytes per step (see :func:`~lightning_perf.profiling.detect_leaks`).
        leak_min_samples: readings after warm-up needed before a point can be reported as leaking (and the length of
            a CPU confirmation).
        log_every_n_steps: the loggers get the cheap figures (:meth:`log_figures`) at the end of one step in this many
            (0: never): :attr:`logging` on such a step (on CPU the loop reads them where it counts quiet steps, so a
            step is not woken for them: waking one costs about 0.3 ms on a 2 ms step).
    """

    def __init__(
        self,
        probe: MemoryProbe,
        points: Sequence[str] = POINTS,
        every_n_steps: int = 10,
        warmup_steps: int = 50,
        leak_threshold: float | None = None,
        leak_min_samples: int = 30,
        log_every_n_steps: int = 0,
    ) -> None:
        self.probe = probe
        self.points = check_points(type(self).__name__, points)
        self.every_n_steps = every_n_steps
        self.warmup_steps = warmup_steps
        self.leak_threshold = leak_threshold
        self.leak_min_samples = leak_min_samples
        self.log_every_n_steps = log_every_n_steps
        self.series = LeakSeries(self.points)  # CUDA: every step; CPU: the last confirmation's steps
        cpu = probe.device.type != "cuda"
        # (CPU) the resident set at one point of every step, and the screen's schedule
        self.cheap = ResidentSeries(SCREEN_READINGS, SCREEN_READ_EVERY_N_STEPS_CPU) if cpu else None
        self.cheap_at_start = False  # the loop reads the cheap signal at the step's start (not its end)
        self._screen_at = MIN_LEAK_SAMPLES * SCREEN_READ_EVERY_N_STEPS_CPU  # the next screen, at the earliest
        self._backoff = LEAK_CHECK_EVERY_N_STEPS
        self._refused = 0.0  # (CPU) the fastest rise of the resident set that memory in use did not confirm, bytes/step
        self._confirm: tuple[int, int] | None = None  # (CPU) the confirmation's steps [first, end)
        self.screens: list[dict[str, Any]] = []  # (CPU) each screen that opened a confirmation, and its outcome
        self.step_index = 0  # steps begun (the running step's index is one less)
        self._index = -1
        self._planned = -1
        self.reading = False  # whether the running step reads or checks anything (else its hooks can stay silent)
        self.sampling = False  # whether the running step is sampled
        self.logging = False  # whether the running step reads the cheap figures for the loggers
        self._current: dict[str, MemorySample] = {}
        self.steps: list[int] = []  # per sampled step: its index,
        self.epochs: list[int] = []  # its epoch,
        self.samples: list[dict[str, MemorySample]] = []  # and its samples by point ("end": the step's peak)
        self.trends: dict[str, LeakTrend] = {}
        self.cheap_trend: LeakTrend | None = None
        self.leak_start: int | None = None
        self.leak_found = False
        self._next_check = LEAK_CHECK_EVERY_N_STEPS
        # Where the loop counts and times its own calls; the first steps are warm-up.
        self.cost = HookCost(first=LEAK_CHECK_EVERY_N_STEPS)
        self._first_end: tuple[int, int] | None = None  # (step, ns) of the first steady step ended
        self._last_end = (0, 0)
        self.inside = False  # whether the running step reads a point inside it (after_forward, after_backward)

    @property
    def active(self) -> bool:
        """Whether the running step reads anything (a sampled step, or one in the leak series)."""
        return self.sampling or self.series.recording

    def _confirming(self, index: int) -> bool:
        return self._confirm is not None and self._confirm[0] <= index < self._confirm[1]

    def plan_step(self) -> None:
        """Decide, before the next step's first hook, whether it reads or checks anything (:attr:`reading`) and how
        its calls are timed (whole when it does); :meth:`begin_step` does it if the loop did not."""
        index = self._planned = self.step_index
        self.logging = bool(self.log_every_n_steps) and (index + 1) % self.log_every_n_steps == 0
        self.reading = index % self.every_n_steps == 0 or (self.logging and self.cheap is None)
        if self.cheap is None:  # CUDA: every step
            self.reading = self.reading or self.series.will_record(index)
        else:
            self.reading = self.reading or self._confirming(index)
        self.cost.step(index, heavy=self.reading)

    def quiet_ahead(self) -> int:
        """How many steps from the next one on read nothing but the cheap signal (0: the next one does): a loop may run
        them with no call but :meth:`read_cheap`, then say so with :meth:`skip` before the next step that reads."""
        index = self.step_index
        if self.cheap is None and self.series.stopped_at is None:  # CUDA: the leak series reads every step
            return 0
        ahead = [index + (-index) % self.every_n_steps]  # the next full snapshot
        if self._confirm is not None:
            ahead.append(max(index, self._confirm[0]))
        if self.cheap is None and not self.leak_found:  # the step after which the verdict is renewed
            ahead.append(max(index, self._next_check - 1))
        return min(ahead) - index

    def skip(self, steps: int, counted: bool = False) -> None:
        """``steps`` steps ran that read nothing (as :meth:`quiet_ahead` allowed), with no call: counted in bulk, each
        billed one quiet call (:class:`~lightning_perf.profiling.timer.HookCost`: the framework's dispatch of the
        loop's one hook plus a counter), unless ``counted``: the loop billed its calls itself
        (:meth:`~lightning_perf.profiling.timer.HookCost.quiet_step`, e.g. in an optimizer's post-hook)."""
        start, end = self.step_index, self.step_index + steps
        if not counted:
            steady = max(0, end - max(start, self.cost.first))
            self.cost.calls += steady
            self.cost.quiet_calls += steady
            self.cost.warmup_calls += steps - steady
        self.step_index = end

    def read_cheap(self, index: int, epoch: int, stamp: bool = True) -> bool:
        """(CPU) Read the cheap signal for step ``index`` (steps in order, each once; the loop calls it on the steps
        it runs quietly, :meth:`begin_step` or :meth:`end_step` on the others, per :attr:`cheap_at_start`) and screen
        it when due; ``stamp``: the clock read now marks the step for the mean step time. Returns True when a
        confirmation opens: the steps from the next one on read (see :meth:`quiet_ahead`)."""
        cheap = self.cheap
        if cheap is None or index % cheap.stride or not cheap.add(index, epoch, self.probe.resident()):
            return False
        if stamp:
            self._stamp(index, time.perf_counter_ns())
        if index < self._screen_at or self.leak_found or self._confirm is not None:
            return False
        first = self._leak_first_step(cheap)
        if index < (earliest := first + MIN_LEAK_SAMPLES * cheap.stride):
            self._screen_at = earliest  # enough readings past warm-up
            return False
        self._screen_at = index + max(SCREEN_GAP, index // 4)
        # The later half of the run, at least 36 readings of it where there are.
        steps, values = cheap.series(max(first, min(index // 2, index - 2 * MIN_LEAK_SAMPLES * cheap.stride)))
        # A trigger, not the verdict: the full rule on the resident set, cheapest test first (its noise floor keeps out
        # a clean process's creep of a page every few dozen steps), and a rise faster than the fastest that memory in
        # use refused (a false trigger costs a confirmation, ~30 woken steps: not paid twice for the same creep).
        if not could_leak(values, MIN_LEAK_SAMPLES):
            return False
        rise = sen_slope_interval(steps, values)
        if rise.low <= self._refused or rise.slope * NOISE_FLOOR_STEPS < noise_floor(steps, values, rise.slope):
            return False
        self._confirm = (index + 1, index + 1 + self.leak_min_samples)
        self.series = LeakSeries(self.points)
        self.screens.append({"step": index, "rate_bytes_per_step": rise.slope})
        return True

    def begin_step(self, epoch: int) -> None:
        """A step begins with its batch on the device: ``after_data``; a sampled step's peak is reset after it."""
        if self._planned != self.step_index:
            self.plan_step()
        index = self._index = self.step_index
        self.step_index += 1
        if self.cheap_at_start:
            self.read_cheap(index, epoch, stamp=False)
        if not self.reading:  # the common step: nothing to read
            self.sampling = self.inside = False
            self.series.skip_step()
            return
        recording = (self.cheap is None or self._confirming(index)) and self.series.start_step(index, epoch)
        if not recording:
            self.series.skip_step()
        self.sampling = index % self.every_n_steps == 0
        self.inside = self.sampling or (recording and not _INSIDE.isdisjoint(self.points))
        if self.sampling:
            self._current = {"start": self.probe.sample()} if "after_data" not in self.points else {}
        self.sample("after_data")
        if self.sampling:
            start = self._current.get("after_data") or self._current["start"]
            self.probe.reset_peak(start)  # nothing to reset where the peak is the level already

    def sample(self, point: str, overwrite: bool = False) -> None:
        """Read ``point``: the full sample on sampled steps, ``allocated`` for the leak series where it reads.

        Without ``overwrite`` only the point's first reading in the step is kept.
        """
        if point not in self.points:
            return
        series = self.series
        if self.sampling and (overwrite or point not in self._current):
            sample = self.probe.sample()
            self._current[point] = sample
            series.record(point, sample.allocated, overwrite)
        elif series.recording and series.wants(point, overwrite):
            series.record(point, self.probe.allocated(), overwrite)

    def end_step(self, epoch: int, end_ns: int) -> dict[str, MemorySample] | None:
        """The step ends at ``end_ns`` (after its optimizer step): ``after_optimizer``, and the peak of a sampled step.

        Returns:
            The sampled step's samples by point (``"end"``: the sample holding its peak), None for a step not sampled.
        """
        index = self._index
        self._stamp(index, end_ns)
        self.sample("after_optimizer", overwrite=True)
        if not self.cheap_at_start:
            self.read_cheap(index, epoch, stamp=False)
        step = None
        if self.sampling:
            self.sampling = False
            step = self._current
            # The peak of the step: read at its end whatever points are sampled.
            step["end"] = self.probe.sample() if "after_optimizer" not in self.points else step["after_optimizer"]
            self.steps.append(index)
            self.epochs.append(epoch)
            self.samples.append(step)
        return step

    def _stamp(self, index: int, ns: int) -> None:
        """Step ``index`` ended (or began, for all steps alike) at ``ns``: the mean step time, for the self-report."""
        if self._first_end is None and index >= self.cost.first:
            self._first_end = (index, ns)
        self._last_end = (index, ns)

    def log_figures(self, step: dict[str, MemorySample] | None) -> dict[str, float]:
        """The figures for the loggers at the end of this step: from its full sample where it has one, else the cheap
        ones (CPU: the resident set and its peak from one ``/proc`` read, no heap walk, so no ``memory/allocated``;
        CUDA: the allocator's three counters). The peak is the highest since the last sampled step's start."""
        last = step[self.points[-1]] if step is not None else self.probe.sample(heap=self.cheap is None)
        figures: dict[str, float] = {
            "memory/peak": step["end"].peak if step is not None else last.peak,
            "memory/reserved": last.reserved,
        }
        return figures if last.allocated < 0 else {**figures, "memory/allocated": last.allocated}

    # -------------------------------------------------------------------------------------------------- leaks

    def leak_check_due(self) -> bool:
        """Whether the verdict is due after this step: CUDA after :data:`LEAK_CHECK_EVERY_N_STEPS` steps, then every
        quarter of the steps so far; CPU at a confirmation's last step. Never once a leak is found."""
        if self.leak_found:
            return False
        if self.cheap is not None:
            return self._confirm is not None and self.step_index >= self._confirm[1]
        if self.step_index < self._next_check:
            return False
        self._next_check = self.step_index + max(LEAK_CHECK_EVERY_N_STEPS, self.step_index // 4)
        return True

    def _leak_first_step(self, series: LeakSeries | ResidentSeries) -> int:
        # The first step of the leak window: after the first epoch when it is shorter than `warmup_steps`.
        second_epoch = (
            series.second_epoch if isinstance(series, ResidentSeries) else series.first_step_of_epoch_after(0)
        )
        return self.warmup_steps if second_epoch is None else min(self.warmup_steps, second_epoch)

    def _leak_trends(self, points: Sequence[str], screen: bool = False) -> dict[str, LeakTrend]:
        """The trends of ``points`` over the leak window; with ``screen``, none (an empty dict) unless each point
        passes :func:`~lightning_perf.profiling.leaks.could_leak`, the cheap necessary conditions of a leak."""
        self.leak_start = self._leak_first_step(self.cheap if self.cheap is not None else self.series)
        series = self.series.series(self.leak_start)
        if screen and not all(could_leak(series[p][1], self.leak_min_samples) for p in points):
            return {}
        return detect_leaks({p: series[p] for p in points}, self.leak_threshold, self.leak_min_samples)

    def check_leaks(self, every_point: bool = True) -> list[LeakTrend]:
        """Renew the verdict (``every_point=False``: the step's last point first, a leak shows at every point); on
        CPU, judge the confirmation that just ended (or, at the end of fit, the one under way: too short to flag).

        Returns:
            The leaking points' trends, fastest first, the first time a leak is found (else an empty list). The leak
            series then stops; the full samples every ``every_n_steps`` go on.
        """
        if self.cheap is not None and self.cheap.rows:
            steps, values = self.cheap.series(self._leak_first_step(self.cheap))
            self.cheap_trend = trend_of("resident", steps, values, self.leak_min_samples, self.leak_threshold)
        if not every_point and not any(t.leaking for t in self._leak_trends(self.points[-1:], screen=True).values()):
            leaking = []
        else:
            self.trends = self._leak_trends(self.points)
            leaking = sorted((t for t in self.trends.values() if t.leaking), key=lambda t: t.slope_low, reverse=True)
        if self._confirm is not None and self.step_index >= self._confirm[1]:  # (CPU) a confirmation ends
            self.screens[-1]["confirmed"] = bool(leaking)
            self._confirm = None
            if not leaking:
                self._screen_at, self._backoff = self.step_index + self._backoff, 2 * self._backoff
                self._refused = max(self._refused, self.screens[-1]["rate_bytes_per_step"])
        if not leaking or self.leak_found:
            return []
        self.leak_found = True
        self.series.stop(self.step_index)
        return leaking

    # ------------------------------------------------------------------------------------------------ results

    def _snapshot(self, point: str) -> dict[str, Any]:
        rows = [s for step, s in zip(self.steps, self.samples) if point in s and step >= self.warmup_steps]
        if not rows:  # a short run: fall back to every sample rather than report nothing
            rows = [s for s in self.samples if point in s]
        start = "after_data" if "after_data" in self.points else "start"
        return {
            "time_s": summarize([(s[point].timestamp_ns - s[start].timestamp_ns) / 1e9 for s in rows]).to_dict(),
            "allocated": summarize([s[point].allocated for s in rows]).to_dict(),
            "reserved": summarize([s[point].reserved for s in rows]).to_dict(),
            "peak_max": max((s[point].peak for s in rows), default=None),
            "trend_bytes_per_step": self.trends[point].slope if point in self.trends else math.nan,
        }

    def summary(self) -> dict[str, Any]:
        """The report: the snapshot table per point, the steps' peaks, the leak verdict, the observer's own cost and
        the samples (the last 20,000)."""
        starts = [s.get("after_data", s.get("start")) for s in self.samples]
        above = [s["end"].peak_above(start) for s, start in zip(self.samples, starts) if start is not None]
        first, last = self._first_end or self._last_end, self._last_end
        per_step_s = (last[1] - first[1]) / 1e9 / (last[0] - first[0]) if last[0] > first[0] else math.nan
        steady = max(0, self.step_index - self.cost.first)
        samples = [
            {"step": step, "epoch": epoch, "point": point, **sample.to_dict()}
            for step, epoch, by_point in zip(self.steps, self.epochs, self.samples)
            for point, sample in by_point.items()
            if point in self.points
        ]
        return {
            "device": str(self.probe.device),
            "source": self.probe.source,
            "notes": self.samples[0]["end"].notes if self.samples else {},
            "every_n_steps": self.every_n_steps,
            "points": list(self.points),
            "warmup_steps": self.warmup_steps,
            "steps_seen": self.step_index,
            "steps_sampled": len(self.samples),
            "snapshots": {point: self._snapshot(point) for point in self.points},
            "peak": summarize([s["end"].peak for s in self.samples]).to_dict(),
            "peak_above_start": summarize(above).to_dict(),
            "peak_since_reset": all(s["end"].peak_since_reset for s in self.samples),
            "leaks": {
                "method": "Theil-Sen slope with Sen's distribution-free 95% interval, per point",
                "rule": f"interval above zero overall and in each of {SEGMENTS} consecutive parts, and the growth over "
                f"{NOISE_FLOOR_STEPS} steps at least the noise floor of the readings",
                "first_step": self.leak_start,
                "sampled_every_n_steps": self.series.stride if self.cheap is None else None,
                "screen": None
                if self.cheap is None
                else {
                    "signal": "resident set (/proc/self/statm), confirmed by memory in use (mallinfo2) at every point",
                    "read_every_n_steps": self.cheap.stride,
                    "trend": self.cheap_trend,
                    "confirmations": self.screens,
                },
                "stopped_at_step": self.series.stopped_at,
                "threshold_bytes_per_step": self.leak_threshold,
                "min_samples": self.leak_min_samples,
                "trends": self.trends,
                "leaking": [t.point for t in self.trends.values() if t.leaking],
            },
            "overhead": {**self.cost.figures(steady, per_step_s), "step_s_mean": per_step_s},
            "samples": samples[-_MAX_REPORTED_SAMPLES:],
            "samples_truncated": len(samples) > _MAX_REPORTED_SAMPLES,
        }

    def plot(self, path: Path) -> Path:
        """Draw memory per point across the sampled steps, and each step's peak, as a PNG (needs matplotlib)."""
        series = {
            f"{p} allocated": [s[p].allocated / _MIB if p in s else None for s in self.samples] for p in self.points
        }
        series["step peak"] = [s["end"].peak / _MIB for s in self.samples]
        return plot_lines(
            series,
            path,
            title=f"Memory per sampled step ({self.probe.source})",
            xlabel=f"sampled step (one in {self.every_n_steps})",
            ylabel="MiB",
        )


def rank_values(report: Mapping[str, Any]) -> dict[str, float]:
    """The figures of :meth:`MemorySteps.summary` compared across processes: the peaks and each point's growth."""
    return {
        "peak_max": report["peak"]["max"],
        "peak_above_start_median": report["peak_above_start"]["median"],
        **{f"slope_{p}": report["leaks"]["trends"][p].slope for p in report["points"]},
    }


def leak_message(owner: str, leaking: Sequence[LeakTrend]) -> str:
    """The leak warning: the point that grows fastest, its rate with its 95% interval and the evidence; the others."""
    worst = leaking[0]
    others = ", ".join(f"{t.point} {_kib(t.slope)} KiB/step" for t in leaking[1:])
    return (
        f"{owner}: memory leak: memory in use {PHASES[worst.point]} ({worst.point}) grows by "
        f"{_kib(worst.slope)} KiB/step (95% interval {_kib(worst.slope_low)} to {_kib(worst.slope_high)} KiB/step; "
        f"Theil-Sen over {worst.samples} steps, {worst.first_step}-{worst.last_step}: "
        f"{format_bytes(worst.first_bytes)} -> {format_bytes(worst.last_bytes)}; growing in each third, above the "
        f"readings' noise floor of {format_bytes(worst.noise_floor)})"
        + (f"; also {others}" if others else "")
        + ". Something keeps tensors alive from one step to the next, e.g. a list of losses or outputs that "
        "still hold their autograd graph: keep `loss.detach()` or `loss.item()` instead."
    )


def snapshot_table(report: Mapping[str, Any], owner: str) -> tuple[list[str], list[list[object]], str]:
    """The report's table: headers ``snapshot | time | allocated | reserved | peak | trend``, a row per point, title."""
    rows: list[list[object]] = []
    for point, row in report["snapshots"].items():
        slope = row["trend_bytes_per_step"]
        rows.append(
            [
                point,
                format_seconds(row["time_s"]["median"]),
                format_bytes(row["allocated"]["median"]),
                format_bytes(row["reserved"]["median"]),
                format_bytes(row["peak_max"]),
                "n/a" if slope is None or math.isnan(slope) else f"{format_bytes(slope)}/step",
            ]
        )
    title = (
        f"{owner}: {report['steps_sampled']} sampled steps of {report['steps_seen']} on {report['device']} "
        f"({report['source']})"
    )
    return ["snapshot", "time", "allocated", "reserved", "peak", "trend"], rows, title


def report_text(report: Mapping[str, Any], owner: str) -> str:
    """The end-of-fit text: the snapshot table, then the summary lines."""
    return "\n".join([text_table(*snapshot_table(report, owner)), *summary_lines(report)])


def summary_lines(report: Mapping[str, Any]) -> list[str]:
    """The step's peak above its start and the observer's cost, the leak verdict and the plot's note, a line each."""
    overhead = report["overhead"]["share_of_step"]
    peak = f"step peak above its start: median {format_bytes(report['peak_above_start']['median'])}"
    lines = [f"{peak}; observer cost {100 * overhead:.2g}% of step time" if math.isfinite(overhead) else peak]
    leaks = report["leaks"]
    trends = [t for t in leaks["trends"].values() if t.samples]
    if leaks["leaking"]:
        lines.append(
            "leak: memory in use grows at "
            + ", ".join(
                f"{t.point} {_kib(t.slope)} KiB/step [{_kib(t.slope_low)}, {_kib(t.slope_high)}]"
                for t in trends
                if t.leaking
            )
        )
    elif (screen := leaks.get("screen")) and screen["trend"] is not None:
        refused = [c for c in screen["confirmations"] if c.get("confirmed") is False]
        lines.append(
            f"no leak found: the resident set read at {screen['trend'].samples} steps from step "
            f"{leaks['first_step']} (one in {screen['read_every_n_steps']} at the end), "
            + (f"{len(refused)} rise(s) not confirmed by memory in use" if refused else "no steady rise")
        )
    elif trends:
        lines.append(
            f"no leak found over {max(t.samples for t in trends)} steps from step {leaks['first_step']} "
            "(no steady, significant growth above the readings' noise floor)"
        )
    return lines + ([report["plot_note"]] if report.get("plot_note") else [])


def _kib(n: float) -> str:
    """Bytes as KiB (the unit of the leak warning, whatever the size): three significant digits, whole above 100."""
    if not math.isfinite(n):
        return str(n)
    kib = n / 1024
    return f"{kib:,.0f}" if abs(kib) >= 100 else f"{kib:.3g}"
