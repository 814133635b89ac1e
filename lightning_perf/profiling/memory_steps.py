"""Memory at named points of training steps, the leak verdict and the report: no Lightning needed.

A loop (Lightning's hooks in :class:`~lightning_perf.callbacks.MemoryProfilerCallback`, or a hand-written one) tells
:class:`MemorySteps` where each step is; it takes a full :class:`~lightning_perf.profiling.MemorySample` at each point
of one step in ``every_n_steps``, reads the cheap ``allocated`` at each point of every step until the first verdict,
then (on CPU) at the last point of one step in 64, into a :class:`~lightning_perf.profiling.LeakSeries`, and renews
the leak verdict (:func:`~lightning_perf.profiling.detect_leaks`) on a schedule whose cost is a bounded share of the
run. A step that reads nothing says so beforehand (:meth:`MemorySteps.plan_step`, :attr:`MemorySteps.reading`), so a
loop can skip its other calls; :meth:`MemorySteps.quiet_ahead` says how many steps to come read nothing, so a loop can
run them with no call at all and count them afterwards (:meth:`MemorySteps.skip`)::

    steps = MemorySteps(MemoryProbe("cpu"), every_n_steps=5, warmup_steps=10)
    for epoch in range(epochs):
        for batch in loader:
            steps.plan_step()                      # steps.reading: whether this step reads anything
            steps.begin_step(epoch)                # "after_data"; the peak is reset on a sampled step
            loss = model(batch).sum()
            steps.sample("after_forward")
            loss.backward()
            steps.sample("after_backward", overwrite=True)
            optimizer.step(); optimizer.zero_grad()
            steps.end_step(epoch, time.perf_counter_ns())  # "after_optimizer"; steps.cost counts the loop's calls
            if steps.leak_check_due() and (leaking := steps.check_leaks(every_point=False)):
                print(leak_message("my loop", leaking))
    steps.check_leaks()
    print(summary_lines(steps.summary()))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_perf.profiling.leaks import (
    NOISE_FLOOR_STEPS,
    SEGMENTS,
    LeakSeries,
    LeakTrend,
    could_leak,
    detect_leaks,
)
from lightning_perf.profiling.memory import MemoryProbe, MemorySample
from lightning_perf.profiling.report import format_bytes, format_seconds, plot_lines, text_table
from lightning_perf.profiling.stats import summarize
from lightning_perf.profiling.timer import HookCost

__all__ = [
    "LEAK_CHECK_EVERY_N_STEPS",
    "LEAK_READ_EVERY_N_STEPS_CPU",
    "PHASES",
    "POINTS",
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
"""While training, the leak verdict is renewed after this many steps, then every quarter of the steps seen so far (at
least this many), so that the checks cost a bounded share of the run; and at the end of fit."""

LEAK_READ_EVERY_N_STEPS_CPU = 128
"""After the first verdict, on CPU, the leak series reads the last sampled point of one step in this many (and the
verdict is renewed on such steps only): one glibc ``mallinfo2`` heap walk per 128 steps. A walk visits every free
chunk of every arena: 100-150 us in a training process (the step has evicted the heap's free lists from the caches;
8 us in a warm loop); seen from outside, a reading step costs about 0.25 ms more than a quiet one (2-core AMD EPYC,
1.2 ms steps, `examples/observer_overhead.py`), about 0.4% of such steps at one in 64, hence one in 128. A slow leak
(1 KiB/step) is reported within about 4,000 steps; a large one at the first verdict (step 50)."""

_MIB = 1024.0 * 1024.0
_INSIDE = frozenset(("after_forward", "after_backward"))  # the points read by hooks inside the step
_MAX_REPORTED_SAMPLES = 20_000


def check_points(owner: str, points: Sequence[str] | None) -> tuple[str, ...]:
    """``points`` in step order without duplicates (``None``: all of :data:`POINTS`), else raise."""
    if points is None:
        return POINTS
    if isinstance(points, str) or not isinstance(points, Sequence):
        raise TypeError(f"`{owner}(points={points!r})` is not valid. Expected a list of names from {POINTS}.")
    unknown = [p for p in points if p not in POINTS]
    if unknown or not points:
        raise ValueError(
            f"`{owner}(points={list(points)!r})` is not valid: "
            + (f"unknown point(s) {unknown}. " if unknown else "no point given. ")
            + f"Expected names from: {', '.join(POINTS)}."
        )
    return tuple(p for p in POINTS if p in points)


def check_leak_threshold(owner: str, leak_threshold: Any) -> float | None:
    """``leak_threshold`` as a float (None stays None) if it is a positive finite number, else raise ``ValueError``."""
    if leak_threshold is None:
        return None
    if (
        isinstance(leak_threshold, bool)
        or not isinstance(leak_threshold, (int, float))
        or not 0 < leak_threshold < math.inf
    ):
        raise ValueError(
            f"`{owner}(leak_threshold={leak_threshold!r})` is not valid. Expected None (no absolute bound) or a "
            "growth in bytes per step > 0, e.g. 16384."
        )
    return float(leak_threshold)


class MemorySteps:
    """Memory at the points of each step: full samples every ``every_n_steps`` steps, ``allocated`` more often.

    Leak detection, by significance and with no absolute bound in bytes: memory in use (``allocated``) is read at
    each point of every step until the first verdict (:data:`LEAK_CHECK_EVERY_N_STEPS`), so that a large leak shows
    at once; from then on, on CPU, at the last point of one step in :data:`LEAK_READ_EVERY_N_STEPS_CPU` (a glibc
    ``mallinfo2`` heap walk each; the earlier readings are thinned to the same spacing, and a snapshot that falls on
    the series' steps adds its points), on CUDA (the caching allocator's counter) at every point of every step;
    whatever ``every_n_steps``; into storage allocated once, so the series does not measure itself.
    ``leak_min_samples`` counts these readings: on CPU a verdict after warm-up needs about 30 x 128 steps. Warm-up
    is left out: the first epoch when it is shorter than ``warmup_steps`` steps, else the first ``warmup_steps`` steps
    (lazily built optimizer state, allocator arenas, the first validation run's caches). On the rest, for each point,
    :func:`~lightning_perf.profiling.detect_leaks` fits a Theil-Sen slope and Sen's distribution-free 95% interval,
    and flags the point when, over at least ``leak_min_samples`` steps, the interval lies above zero (growth noise
    would rarely produce), it does so in each third of the steps as well (steady: a cache that fills up and stops, or
    a one-time jump, leaves a third flat), and the growth over two steps reaches the noise floor of the readings
    (their robust scatter around the trend, measured over short blocks). That last rule is relative to the readings,
    not a number of bytes: the allocator's own churn drifts up in occasional jumps that can be significant over a few
    hundred steps, yet is small per step next to that scatter, while a leak adds its bytes at every step; the same
    rule holds on a calm GPU allocator and a busy CPU heap, for any model size. While training, the verdict is renewed
    on the last sampled point of the step every :data:`LEAK_CHECK_EVERY_N_STEPS` steps (then every quarter of the
    steps so far, :meth:`leak_check_due`; on CPU at the next step the series reads anyway), on every point when that
    one grows, and on every point at the end (:meth:`check_leaks`; a renewal stops at
    :func:`~lightning_perf.profiling.leaks.could_leak`'s cheap screen unless the readings rise steadily); once a leak
    is found these readings stop (the full samples go on). Cost on
    CPU: ``mallinfo2`` walks every free chunk of every arena, microseconds on a fresh heap, a few percent of a 2 ms
    step in a training process: the reason the points are not all read at every step. The loop's own calls are counted
    and timed on :attr:`cost` (:class:`~lightning_perf.profiling.timer.HookCost`; steady state from the first verdict
    on, the steps that read timed whole), and reported as ``overhead``; what timing its calls cannot see is left out
    (a heap walk evicts the CPU's caches, so the training work right after it may run slower).

    Args:
        probe: what reads the memory (CPU or CUDA).
        points: which points of :data:`POINTS` are sampled, in step order (see :func:`check_points`).
        every_n_steps: one fully sampled step in this many.
        warmup_steps: leading steps left out of the leak trend and the snapshot table, at most (a shorter first epoch
            is left out of the trend instead).
        leak_threshold: optional extra bound in bytes per step (see :func:`~lightning_perf.profiling.detect_leaks`).
        leak_min_samples: steps after warm-up needed before a point can be reported as leaking.
    """

    def __init__(
        self,
        probe: MemoryProbe,
        points: Sequence[str] = POINTS,
        every_n_steps: int = 10,
        warmup_steps: int = 50,
        leak_threshold: float | None = None,
        leak_min_samples: int = 30,
    ) -> None:
        self.probe = probe
        self.points = check_points(type(self).__name__, points)
        self.every_n_steps = every_n_steps
        self.warmup_steps = warmup_steps
        self.leak_threshold = leak_threshold
        self.leak_min_samples = leak_min_samples
        self.series = LeakSeries(self.points)
        cuda = probe.device.type == "cuda"
        # After the first verdict, on CPU: the last point of one step in LEAK_READ_EVERY_N_STEPS_CPU (a heap walk each).
        self._steady_stride = 1 if cuda else LEAK_READ_EVERY_N_STEPS_CPU
        self._read_points = self.points  # the points the leak series reads (the last one only in CPU steady state)
        self.step_index = 0  # steps begun (the running step's index is one less)
        self._index = -1
        self._planned = -1
        self.reading = False  # whether the running step reads or checks anything (else its hooks can stay silent)
        self.sampling = False  # whether the running step is sampled
        self._current: dict[str, MemorySample] = {}
        self.steps: list[int] = []  # per sampled step: its index,
        self.epochs: list[int] = []  # its epoch,
        self.samples: list[dict[str, MemorySample]] = []  # and its samples by point ("end": the step's peak)
        self.trends: dict[str, LeakTrend] = {}
        self.leak_start: int | None = None
        self.leak_found = False
        self._next_check = LEAK_CHECK_EVERY_N_STEPS
        # Where the loop counts and times its own calls; the dense readings before the first verdict are warm-up.
        self.cost = HookCost(first=LEAK_CHECK_EVERY_N_STEPS)
        self._first_end: tuple[int, int] | None = None  # (step, ns) of the first steady step ended
        self._last_end = (0, 0)
        self.inside = False  # whether the running step reads a point inside it (after_forward, after_backward)

    @property
    def active(self) -> bool:
        """Whether the running step reads anything (a sampled step, or one in the leak series)."""
        return self.sampling or self.series.recording

    def plan_step(self) -> None:
        """Decide, before the next step's first hook, whether it reads or checks anything (:attr:`reading`) and how
        its calls are timed (whole when it does); :meth:`begin_step` does it if the loop did not."""
        index = self._planned = self.step_index
        self.reading = (
            index % self.every_n_steps == 0
            or self.series.will_record(index)
            or (not self.leak_found and index + 1 >= self._next_check)
        )
        self.cost.step(index, heavy=self.reading)

    def quiet_ahead(self) -> int:
        """How many steps from the next one on read and check nothing (0: the next one does): a loop may run them
        without any call, then say so with :meth:`skip` before the next step that reads (:meth:`plan_step`)."""
        index = self.step_index
        ahead = [index + (-index) % self.every_n_steps]  # the next full snapshot
        if self.series.stopped_at is None:  # the leak series' next reading (at its stride now)
            ahead.append(index + (-index) % self.series.stride)
        if not self.leak_found:  # the step after which the verdict is renewed
            ahead.append(max(index, self._next_check - 1))
        return min(ahead) - index

    def skip(self, steps: int, counted: bool = False) -> None:
        """``steps`` steps ran that read nothing (as :meth:`quiet_ahead` allowed), with no call: counted in bulk, each
        billed one quiet call (:class:`~lightning_perf.profiling.timer.HookCost`: the framework's dispatch of the
        loop's one hook plus a counter), unless ``counted``: the loop billed its counter itself
        (:meth:`~lightning_perf.profiling.timer.HookCost.quiet_step`, e.g. in an optimizer's post-hook)."""
        start, end = self.step_index, self.step_index + steps
        if not counted:
            steady = max(0, end - max(start, self.cost.first))
            self.cost.calls += steady
            self.cost.quiet_calls += steady
            self.cost.warmup_calls += steps - steady
        self.step_index = end

    def begin_step(self, epoch: int) -> None:
        """A step begins with its batch on the device: ``after_data``; a sampled step's peak is reset after it."""
        if self._planned != self.step_index:
            self.plan_step()
        index = self._index = self.step_index
        self.step_index += 1
        if not self.reading:  # the common step: nothing to read
            self.sampling = self.inside = False
            self.series.skip_step()
            return
        if index == LEAK_CHECK_EVERY_N_STEPS and self._steady_stride > 1 and not self.leak_found:
            self.series.coarsen(self._steady_stride)
            self._read_points = self.points[-1:]
        recording = self.series.start_step(index, epoch)
        self.sampling = index % self.every_n_steps == 0
        self.inside = self.sampling or (recording and not _INSIDE.isdisjoint(self._read_points))
        if self.sampling:
            self._current = {"start": self.probe.sample()} if "after_data" not in self.points else {}
        self.sample("after_data")
        if self.sampling:
            start = self._current.get("after_data") or self._current["start"]
            self.probe.reset_peak(start)  # nothing to reset where the peak is the level already

    def sample(self, point: str, overwrite: bool = False) -> None:
        """Read ``point``: the full sample on sampled steps, the cheap ``allocated`` for the leak series always.

        Without ``overwrite`` only the point's first reading in the step is kept.
        """
        if point not in self.points:
            return
        series = self.series
        if self.sampling and (overwrite or point not in self._current):
            sample = self.probe.sample()
            self._current[point] = sample
            series.record(point, sample.allocated, overwrite)
        elif series.recording and point in self._read_points and series.wants(point, overwrite):
            series.record(point, self.probe.allocated(), overwrite)

    def end_step(self, epoch: int, end_ns: int) -> dict[str, MemorySample] | None:
        """The step ends at ``end_ns`` (after its optimizer step): ``after_optimizer``, and the peak of a sampled step.

        Returns:
            The sampled step's samples by point (``"end"``: the sample holding its peak), None for a step not sampled.
        """
        index = self._index
        if self._first_end is None and index >= self.cost.first:
            self._first_end = (index, end_ns)
        self._last_end = (index, end_ns)
        self.sample("after_optimizer", overwrite=True)
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

    # -------------------------------------------------------------------------------------------------- leaks

    def leak_check_due(self) -> bool:
        """Whether the verdict is due after this step (then not again for a quarter of the steps so far, at least
        :data:`LEAK_CHECK_EVERY_N_STEPS`); never once a leak is found."""
        if self.leak_found or self.step_index < self._next_check:
            return False
        due = self.step_index + max(LEAK_CHECK_EVERY_N_STEPS, self.step_index // 4)
        # Checked at the end of step `_next_check - 1`: on a CPU, moved to the next step the series reads anyway, so
        # that a renewal never wakes a step of its own (a heap walk and the hooks: about 0.3 ms on a 1 ms step).
        self._next_check = due + (1 - due) % self._steady_stride
        return True

    def _leak_trends(self, points: Sequence[str], screen: bool = False) -> dict[str, LeakTrend]:
        """The trends of ``points`` over the leak window; with ``screen``, none (an empty dict) unless each point
        passes :func:`~lightning_perf.profiling.leaks.could_leak`, the cheap necessary conditions of a leak."""
        # The first step of the leak window: after the first epoch when it is shorter than `warmup_steps`.
        second_epoch = self.series.first_step_of_epoch_after(0)
        self.leak_start = self.warmup_steps if second_epoch is None else min(self.warmup_steps, second_epoch)
        series = self.series.series(self.leak_start)
        if screen and not all(could_leak(series[p][1], self.leak_min_samples) for p in points):
            return {}
        return detect_leaks({p: series[p] for p in points}, self.leak_threshold, self.leak_min_samples)

    def check_leaks(self, every_point: bool = True) -> list[LeakTrend]:
        """Renew the verdict (``every_point=False``: the step's last point first, a leak shows at every point).

        Returns:
            The leaking points' trends, fastest first, the first time a leak is found (else an empty list). The
            every-step readings stop then (on a heap that keeps growing, glibc's ``mallinfo2`` walks more and more free
            chunks, so they get dearer); the full samples every ``every_n_steps`` go on.
        """
        if not every_point and not any(t.leaking for t in self._leak_trends(self.points[-1:], screen=True).values()):
            return []
        self.trends = self._leak_trends(self.points)
        leaking = sorted((t for t in self.trends.values() if t.leaking), key=lambda t: t.slope_low, reverse=True)
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
                "sampled_every_n_steps": self.series.stride,
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
