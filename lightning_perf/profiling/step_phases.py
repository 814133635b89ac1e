"""The phases of training steps from the boundaries a loop reports, and their summary: no Lightning needed.

A loop (Lightning's hooks in :class:`~lightning_perf.callbacks.BottleneckCallback`, or a hand-written one) tells
:class:`StepPhases` where each phase begins; it keeps the phases on a :class:`~lightning_perf.profiling.PhaseTimer`,
the wait for data between steps (``data``), which steps an interruption (validation, an epoch boundary) split, and
the loop's own cost of telling it. :func:`summarize_steps` turns that into the report's figures::

    phases = StepPhases(PhaseTimer(torch.device("cpu"), warmup_steps=2))
    phases.open_gap()
    for batch in loader:                 # the wait for `batch` is billed to "data"
        phases.begin_step("forward")
        loss = model(batch).sum()
        phases.switch("backward")
        loss.backward()
        phases.switch("optimizer")
        optimizer.step(); optimizer.zero_grad()
        entry = phases.end_step(len(batch), phases.clock())
        phases.open_gap()                # the wait for the next batch
        phases.charge(entry)             # this loop's own bookkeeping, billed as observer cost
    print(summarize_steps(phases)["steady_state"]["shares"])
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_perf.profiling.advice import PHASES
from lightning_perf.profiling.report import format_seconds
from lightning_perf.profiling.stats import summarize
from lightning_perf.profiling.timer import PhaseTimer

__all__ = [
    "StepPhases",
    "batch_size_of",
    "binned",
    "first_dataloader",
    "phase_rows",
    "recent_figures",
    "report_lines",
    "summarize_steps",
    "usable_cpus",
]

MEASURED = PHASES[:-1]  # timed directly; "other" is the step minus these
MAX_PLOTTED_BARS = 500
MAX_REPORTED_STEPS = 20_000


class StepPhases:
    """Which phase of the step runs now, on a :class:`PhaseTimer`; per step: batch size, interruption, epoch start.

    ``data`` runs from the end of one step (or an epoch's start) until the next begins; ``switch(None)`` leaves the
    step running with no sub-phase (its time becomes ``other``). ``interrupt`` stops the clock of an open step without
    ending it: that step is marked interrupted and kept out of the steady-state shares. ``charge(entry_ns)`` adds
    the caller's own time since ``entry_ns`` to the current step's observer cost.
    """

    def __init__(self, timer: PhaseTimer, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.timer = timer
        self.clock = clock  # the observer's own cost is read from this one (the timer's clock may be a test's)
        self.current: str | None = None
        self.step_open = False
        self.waiting = False  # in the gap before the next batch, "data" running
        self._interrupted = False
        self._epoch_first = False
        self.batch_sizes: list[int | None] = []
        self.interrupted: list[bool] = []
        self.epoch_first: list[bool] = []
        self.hook_ns: list[int] = []
        self.hook_ns_open = 0

    def switch(self, phase: str | None) -> None:
        if self.current is not None:
            self.timer.stop(self.current)
        self.current = phase
        if phase is not None:
            self.timer.start(phase)

    def _open_step(self) -> None:
        if not self.step_open:
            self.timer.start("step")
            self.step_open = True

    def open_gap(self, new_epoch: bool = False) -> None:
        """Start the wait for the next batch (and the next step); ``new_epoch`` marks that step an epoch's first."""
        self._epoch_first = self._epoch_first or new_epoch
        self._open_step()
        self.switch("data")
        self.waiting = True

    def begin_step(self, phase: str = "forward") -> None:
        self._open_step()
        self.waiting = False
        self.switch(phase)

    def interrupt(self) -> None:
        """Stop the clock of the open step without ending it (validation, an epoch's end, the fit's end)."""
        if not self.step_open:
            return
        self.switch(None)
        self.timer.stop("step")
        self.step_open = self.waiting = False
        self._interrupted = True

    def end_step(self, batch_size: int | None, entry_ns: int) -> int:
        """Close the step begun by :meth:`begin_step`; ``entry_ns``: when the caller's own work for it began.

        Returns when the bookkeeping after the step began: charge it (after :meth:`open_gap`) to the next step.
        """
        self.switch(None)
        self.timer.stop("step")
        self.step_open = False
        self.batch_sizes.append(batch_size)
        self.interrupted.append(self._interrupted)
        self.epoch_first.append(self._epoch_first)
        self._interrupted = self._epoch_first = False
        now = self.clock()
        self.hook_ns.append(self.hook_ns_open + now - entry_ns)
        self.hook_ns_open = 0
        self.timer.end_step()
        return now

    def charge(self, entry_ns: int) -> None:
        self.hook_ns_open += self.clock() - entry_ns


def with_other(record: Mapping[str, float]) -> dict[str, float]:
    """A step record with ``other``: the step's time not covered by any measured phase."""
    out = {name: record.get(name, 0.0) for name in MEASURED}
    step = record.get("step", 0.0)
    out["other"] = max(0.0, step - sum(out.values()))
    out["step"] = step
    return out


def phase_shares(records: list[dict[str, float]]) -> dict[str, float]:
    total = math.fsum(r["step"] for r in records)
    if not total > 0:
        return {name: math.nan for name in PHASES}
    return {name: math.fsum(r[name] for r in records) / total for name in PHASES}


def recent_figures(phases: StepPhases, window: int) -> tuple[dict[str, float], float, float] | None:
    """Shares, mean step seconds and samples per second of the last ``window`` steps, never waiting for a device."""
    records = [with_other(r) for r in phases.timer.recent_steps(window)]
    if not records:
        return None
    step_s = math.fsum(r["step"] for r in records) / len(records)
    sizes = [s for s in phases.batch_sizes[-window:] if s is not None]
    samples_per_s = (sum(sizes) / len(sizes)) / step_s if sizes and step_s > 0 else math.nan
    return phase_shares(records), step_s, samples_per_s


def summarize_steps(phases: StepPhases) -> dict[str, Any]:
    """The steady steps' figures: step and phase statistics, shares, throughput, the observer's own cost, per step.

    Interrupted steps are counted but kept out of the statistics; each phase is summarized over the steps in which it
    ran (the optimizer steps once per accumulation window). ``epoch_restart_s``: how much longer an epoch's first
    wait for data is than the median one (DataLoader workers starting again), ``None`` without a second epoch.
    """
    timer = phases.timer
    raw = timer.steps
    steady = [with_other(r) for r in raw]
    first = len(timer.warmup_steps_records)
    flags = phases.interrupted[first : first + len(steady)]
    clean = [r for r, interrupted in zip(steady, flags) if not interrupted]
    clean_raw = [r for r, interrupted in zip(raw, flags) if not interrupted]
    sizes = [s for s, f in zip(phases.batch_sizes[first:], flags) if not f and s is not None]
    stats = {name: summarize([r[name] for r in clean_raw if name in r]).to_dict() for name in MEASURED}
    stats["other"] = summarize([r["other"] for r in clean]).to_dict()
    step = summarize([r["step"] for r in clean])
    clean_time = math.fsum(r["step"] for r in clean)
    data_median = stats["data"]["median"]
    restarts = [r["data"] - data_median for r, e in zip(steady, phases.epoch_first[first:]) if e]
    hook = summarize(phases.hook_ns[first:])
    reported = steady[-MAX_REPORTED_STEPS:]
    return {
        "steps": {
            "total": timer.num_steps,
            "warmup": first,
            "steady": len(steady),
            "interrupted": len(steady) - len(clean),
        },
        "steady_state": {"step": step.to_dict(), "phases": stats, "shares": phase_shares(clean)},
        "warmup": timer.to_dict()["warmup_summary"],
        "throughput": {
            "samples_per_s": sum(sizes) / clean_time if sizes and clean_time > 0 else math.nan,
            "steps_per_s": 1.0 / step.median if step.median > 0 else math.nan,
            "batch_size_median": summarize(sizes).median if sizes else math.nan,
        },
        "epoch_restart_s": summarize(restarts).median if restarts and math.isfinite(data_median) else None,
        "overhead": {
            "hooks_ns_total": sum(phases.hook_ns) + phases.hook_ns_open,
            "hooks_ns_per_step": hook.to_dict(),
            "timer_ns_total": timer.overhead_ns,
            "share_of_step": (hook.median / 1e9) / step.median if step.median > 0 else math.nan,
        },
        "per_step": {
            "phases": list(PHASES),
            "truncated": len(steady) > len(reported),
            "records": reported,
            "interrupted": flags[-MAX_REPORTED_STEPS:],
        },
    }


def phase_rows(report: Mapping[str, Any]) -> list[list[object]]:
    """The report's table: a row per phase and one for the whole step (median, p90, share, steps)."""
    summary = report["steady_state"]
    rows: list[list[object]] = []
    for name in [*PHASES, "step"]:
        stats = summary["step"] if name == "step" else summary["phases"][name]
        share = 1.0 if name == "step" else summary["shares"][name]
        share_text = f"{100 * share:.1f}%" if math.isfinite(share) else "n/a"
        rows.append([name, format_seconds(stats["median"]), format_seconds(stats["p90"]), share_text, stats["count"]])
    return rows


def report_lines(report: Mapping[str, Any]) -> list[str]:
    """Throughput and the observer's cost, validation, the recommendations and the plot's note, a line each."""
    throughput, overhead, validation = report["throughput"], report["overhead"], report["validation"]
    lines = [
        f"throughput: {throughput['samples_per_s']:.1f} samples/s per process, {throughput['steps_per_s']:.2f} "
        f"steps/s; observer cost {100 * overhead['share_of_step']:.2g}% of the median step",
    ]
    if validation["runs"]:
        lines.append(
            f"validation: {validation['runs']} runs, {format_seconds(validation['total_s'])} "
            f"({100 * validation['share_of_fit']:.1f}% of fit)"
        )
    recs = report["recommendations"]
    lines.append("recommendations:" if recs else "recommendations: none, nothing stands out.")
    lines += [rec.format() for rec in recs]
    return lines + ([report["plot_note"]] if report.get("plot_note") else [])


def binned(records: list[dict[str, float]], bars: int = MAX_PLOTTED_BARS) -> list[dict[str, float]]:
    """At most ``bars`` records: means of consecutive steps, so long runs still draw quickly."""
    n = len(records)
    if n <= bars:
        return records
    groups = (records[b * n // bars : (b + 1) * n // bars] for b in range(bars))
    return [{name: math.fsum(r[name] for r in group) / len(group) for name in PHASES} for group in groups]


def batch_size_of(batch: Any) -> int | None:
    """Length of the first tensor found in ``batch`` (depth first), the way Lightning infers a batch size."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        size = batch_size_of(item)
        if size is not None:
            return size
    return None


def first_dataloader(loaders: Any) -> Any:
    """The first object with ``num_workers`` in a loader or a nest of mappings and sequences of them."""
    if loaders is None or hasattr(loaders, "num_workers"):
        return loaders
    items = loaders.values() if isinstance(loaders, Mapping) else loaders if isinstance(loaders, (list, tuple)) else ()
    for item in items:
        found = first_dataloader(item)
        if found is not None:
            return found
    return None


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1
