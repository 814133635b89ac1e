"""The phases of training steps from the boundaries a loop reports, and their summary: no Lightning needed.

Entry points: :class:`StepPhases` (driven by :class:`~lightning_perf.callbacks.BottleneckCallback` or a hand-written
loop), :func:`summarize_steps` and the report writers (:func:`report_text`, :func:`plot_phases`). How phases are kept
and a hand-written loop's example: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_perf.profiling.advice import PHASES, LoaderSettings, StepBreakdown, recommend, validate_thresholds
from lightning_perf.profiling.intervals import t_critical_95
from lightning_perf.profiling.report import format_seconds, plot_stacked_steps, text_table
from lightning_perf.profiling.stats import Stats, summarize
from lightning_perf.profiling.syncs import HostSyncRecorder
from lightning_perf.profiling.timer import Clock, HookCost, PhaseLedger, PhaseTimer

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "DENSE_TIMED_STEPS",
    "ENOUGH_TIMED_STEPS",
    "MEASURED",
    "LiveSchedule",
    "StepPhases",
    "StepSampler",
    "SyncCheck",
    "batch_size_of",
    "binned",
    "check_settings",
    "first_dataloader",
    "live_figures",
    "merge_ranks",
    "phase_table",
    "plot_phases",
    "rank_values",
    "recent_figures",
    "report_lines",
    "report_text",
    "share_intervals",
    "step_report",
    "summarize_steps",
]

MEASURED = PHASES[:-1]  # timed directly; "other" is the step minus these
DENSE_TIMED_STEPS = 50
"""After warm-up every step is timed until this many steady ones are (or the fit ends), then one in ``sample_every``."""
ENOUGH_TIMED_STEPS = 30
"""A report from fewer steady timed steps says so ("from 3 timed steps: indicative only") in its table and advice."""
MAX_PLOTTED_BARS = 500
MAX_REPORTED_STEPS = 20_000
_BAR_KEYS = {"data": "data%", "forward": "fwd%", "backward": "bwd%", "optimizer": "opt%"}


_INTERRUPTED, _EPOCH_FIRST = 1, 2  # bits of StepPhases.flags


class _EventLedger:
    """A :class:`PhaseTimer` (CUDA events) behind :class:`PhaseLedger`'s calls: the step is a phase of its own."""

    def __init__(self, timer: PhaseTimer) -> None:
        self.timer = timer
        self._current: str | None = None

    def switch(self, phase: str | None) -> None:
        if self._current is not None:
            self.timer.stop(self._current)
        self._current = phase
        if phase is not None:
            self.timer.start(phase)

    def open(self, phase: str | None) -> None:
        self.timer.start("step")
        self._current = None
        self.switch(phase)

    def close(self) -> None:
        self.switch(None)
        self.timer.stop("step")

    def end_step(self, then: str | None = None) -> None:
        self.close()
        self.timer.end_step()
        if then is not None:
            self.open(then)


class StepSampler:
    """Which steps are timed: every one of the first ``first`` (warm-up), then one in ``every``. :attr:`live` says
    whether the observer's per-step hooks run now: through a timed step and from the end of the step before it (a
    timed step's ``data`` phase starts when the step before it ends); :attr:`step` is the index of the running step
    (between steps, of the next).

    Example (``counts`` from something the loop runs every step anyway, e.g. an optimizer's step post-hook)::

        sampler = StepSampler(every=16, first=5)
        sampler.sampled(5), sampler.sampled(6), sampler.sampled(21)  # True, False, True
    """

    __slots__ = ("every", "first", "live", "pre", "step")

    def __init__(self, every: int = 1, first: int = 0) -> None:
        self.every, self.first = every, first
        self.step = 0
        self.live = True  # step 0 is always timed
        self.pre = False  # the running step is the one before a timed step (its end opens that step's wait)

    def sampled(self, step: int) -> bool:
        return step < self.first or (step - self.first) % self.every == 0

    def count(self) -> bool:
        """A skipped step ends (counted outside the observer's hooks): True if the next is timed, so the hooks must
        run again from now on (the end of this step)."""
        step = self.step = self.step + 1
        if step >= self.first and (step - self.first) % self.every:  # sampled(), inlined: this runs on every step
            return False
        self.live = self.pre = True
        return True

    def steps_run(self, measured: int) -> int:
        return max(self.step, measured)


class StepPhases:
    """Which phase of the step runs now, on a :class:`PhaseLedger` (CPU: one clock read per boundary) or a
    :class:`PhaseTimer` (CUDA events); per step: batch size, interruption, epoch start, in typed arrays.

    ``data`` runs from the end of one step (or an epoch's start) until the next begins; ``switch(None)`` leaves the
    step running with no sub-phase (its time becomes ``other``). ``interrupt`` stops the clock of an open step without
    ending it: that step is marked interrupted and kept out of the steady-state shares. ``cost`` (a
    :class:`HookCost`) is where the caller counts and times its own calls; :meth:`begin_step` tells it which steps
    are timed.
    """

    def __init__(
        self,
        timer: PhaseLedger | PhaseTimer,
        validation: PhaseTimer | None = None,
        syncs: SyncCheck | None = None,
        cost: HookCost | None = None,
        sampler: StepSampler | None = None,
    ) -> None:
        self.timer = timer
        self.sampler = sampler if sampler is not None else StepSampler()
        self._ledger = timer if isinstance(timer, PhaseLedger) else _EventLedger(timer)
        self.validation = validation if validation is not None else PhaseTimer(timer.device)
        self.syncs = syncs if syncs is not None else SyncCheck(None, 0, 0)
        self.cost = cost if cost is not None else HookCost()
        self.paused = False  # in validation
        self.epochs = 0
        self.current: str | None = None
        self.step_open = False
        self._syncing = False  # a step the host-sync check records
        self._flags = 0
        self.batch_sizes = array("q")  # per step; -1: unknown
        self.flags = array("B")  # per step: interrupted (1), an epoch's first (2)

    @classmethod
    def for_device(
        cls,
        device: torch.device,
        warmup_steps: int = 0,
        sync_check_steps: int = 0,
        sample_every: int = 1,
        clock: Clock = time.perf_counter_ns,
        dispatch_ns: float = 0.0,
        dense_steps: int = DENSE_TIMED_STEPS,
    ) -> StepPhases:
        """An observer's phases on ``device``: a :class:`PhaseLedger` on CPU, else a :class:`PhaseTimer`; validation
        timed apart; the last ``sync_check_steps`` warm-up steps checked for host-device synchronizations; one step in
        ``sample_every`` timed after warm-up and ``dense_steps`` steady ones timed each; its own cost with
        ``dispatch_ns`` (its framework's) per call."""
        cpu, recorder = device.type == "cpu", HostSyncRecorder(device) if sync_check_steps else None
        return cls(
            PhaseLedger(MEASURED, warmup_steps, clock) if cpu else PhaseTimer(device, warmup_steps, clock),
            validation=PhaseTimer(device, clock=clock),
            syncs=SyncCheck(recorder, warmup_steps - sync_check_steps, warmup_steps),
            cost=HookCost(first=warmup_steps, dispatch_ns=dispatch_ns),
            sampler=StepSampler(sample_every, warmup_steps + dense_steps),
        )

    def switch(self, phase: str | None) -> None:
        self._ledger.switch(phase)
        self.current = phase

    def _enter_step(self, phase: str) -> None:
        if self.step_open:
            self._ledger.switch(phase)
        else:
            self._ledger.open(phase)
            self.step_open = True
        self.current = phase

    def open_gap(self, new_epoch: bool = False) -> None:
        """Start the wait for the next batch (and the next step); ``new_epoch`` marks that step an epoch's first."""
        if new_epoch:
            self._flags |= _EPOCH_FIRST
        self._enter_step("data")

    def begin_epoch(self) -> None:
        """A training epoch begins: the wait for its first batch (marked an epoch's first from the second epoch on)."""
        self.epochs += 1
        if self.sampler.live:  # else its first step is not timed
            self.open_gap(new_epoch=self.epochs > 1)

    def pause(self) -> None:
        """Validation begins: the open step is interrupted, and the time until :meth:`resume` is timed apart."""
        self.interrupt()
        self.paused = True
        self.validation.start("validation")

    def resume(self) -> None:
        """Validation ends (nothing if not paused): the wait for the next batch begins."""
        if not self.paused:
            return
        self.paused = False
        self.validation.stop("validation")
        self.validation.end_step()
        if self.sampler.live:  # else the next step is not timed
            self.open_gap()

    def begin_step(self, phase: str = "forward", module: nn.Module | None = None, heavy: bool = False) -> None:
        """The step's work begins (its wait for data ends) in ``phase``; the cost's timing is decided for it (whole if
        ``heavy``: the caller expects dear work in it, e.g. live figures), and ``module``'s host-device
        synchronizations recorded if the step is one :attr:`syncs` checks."""
        step = self.timer.num_steps
        self.cost.step(step, heavy)
        self._enter_step(phase)
        if module is not None and step < self.syncs.last:
            self.syncs.begin(step, module)
            self._syncing = True

    def interrupt(self) -> None:
        """Stop the clock of the open step without ending it (validation, an epoch's end, the fit's end)."""
        if not self.step_open:
            return
        self._ledger.close()
        self.step_open = False
        self.current = None
        self._flags |= _INTERRUPTED

    def end_step(self, batch_size: int | None, gap: bool = True) -> None:
        """Close the step begun by :meth:`begin_step`; with ``gap`` the wait for the next batch starts at once (on the
        same clock read)."""
        if self._syncing:
            self._syncing = False
            self.syncs.end()
        self._ledger.end_step("data" if gap else None)
        self.step_open, self.current = gap, "data" if gap else None
        self.batch_sizes.append(-1 if batch_size is None else batch_size)
        self.flags.append(self._flags)
        self._flags = 0

    # The loop's calls, each counted on `cost` (timed on its timed steps), or as a quiet call on a step not timed.

    def enter(self, phase: str | None, only_from: str | None = None) -> None:
        """A call inside the step: switch to ``phase`` (one clock read) if a step is open and, with ``only_from``, only
        while that phase runs."""
        cost = self.cost
        if not self.sampler.live:
            cost.quiet_calls += 1
            return
        entry = cost.begin()
        if self.step_open and (only_from is None or self.current == only_from):
            self._ledger.switch(phase)
            self.current = phase
        cost.end(entry)

    def end_batch(self, batch: Any) -> bool:
        """The loop's end of a batch while its calls run: on a step not timed the step is counted here (no other
        counter); then :meth:`finish_batch` with ``batch``'s size. True if a timed step closed."""
        sampler = self.sampler
        if not sampler.live and not sampler.count():
            return False
        return self.finish_batch(batch_size_of(batch))

    def finish_batch(self, batch_size: int | None) -> bool:
        """The loop's end of a batch while the observer's hooks run: the end of the step before a timed one opens its
        wait for data; a timed step is closed (True), its wait for the next batch opened only if that one is timed,
        else :attr:`sampler` goes quiet (``live`` False: the caller silences its hooks)."""
        sampler = self.sampler
        if sampler.pre:
            sampler.pre = False
            self.open_gap()
            return False
        sampler.step += 1
        sampler.live = sampler.sampled(sampler.step)
        if not sampler.live:
            self.cost.pause()
        if not self.step_open:
            return False
        self.end_step(batch_size, gap=sampler.live)
        return True


class LiveSchedule:
    """When a loop shows live figures: at the end of the first timed step once ``every`` steps have run since the
    last time (``every`` 0: never). :attr:`window` is how many timed steps such an interval holds, one in
    ``sample_every``.

    Example::

        live = LiveSchedule(every=50, sample_every=32)
        if live.due(steps_done):
            live.last = steps_done
            metrics, bar = live_figures(phases, live.window)
    """

    __slots__ = ("every", "last", "window")

    def __init__(self, every: int = 0, sample_every: int = 1) -> None:
        self.every, self.last = every, 0
        self.window = -(-every // sample_every) if every else 0

    def due(self, steps_done: int) -> bool:
        return bool(self.every) and steps_done - self.last >= self.every


def with_other(record: Mapping[str, float]) -> dict[str, float]:
    """A step record with ``other``: the step's time not covered by any measured phase."""
    out = {name: record.get(name, 0.0) for name in MEASURED}
    step = record.get("step", 0.0)
    out["other"] = max(0.0, step - sum(out.values()))
    out["step"] = step
    return out


def share_intervals(records: list[dict[str, float]]) -> dict[str, list[float]]:
    """Each phase's share of the step time over ``records`` (:func:`with_other`'s) with its 95% interval: the share is
    a ratio of sums, its standard error from the linearized residuals ``phase - share * step`` (the delta method) and
    a t quantile; NaN bounds below two steps. Steps that drift together widen it, as they should."""
    n = len(records)
    steps = [r["step"] for r in records]
    total = math.fsum(steps)
    if n < 2 or not total > 0:
        return {name: [math.nan, math.nan] for name in PHASES}
    out = {}
    for name in PHASES:
        values = [r[name] for r in records]
        share = math.fsum(values) / total
        residuals = [v - share * step for v, step in zip(values, steps)]
        mean = math.fsum(residuals) / n
        spread = math.sqrt(n * math.fsum((z - mean) ** 2 for z in residuals) / (n - 1))
        half = t_critical_95(n - 1) * spread / total
        out[name] = [max(0.0, share - half), min(1.0, share + half)]
    return out


def indicative_note(timed: int) -> str | None:
    """What a report from ``timed`` steady timed steps says of itself: None from :data:`ENOUGH_TIMED_STEPS` on."""
    return f"from {timed} timed steps: indicative only" if timed < ENOUGH_TIMED_STEPS else None


def phase_shares(records: list[dict[str, float]]) -> dict[str, float]:
    total = math.fsum(r["step"] for r in records)
    if not total > 0:
        return {name: math.nan for name in PHASES}
    return {name: math.fsum(r[name] for r in records) / total for name in PHASES}


def live_figures(
    phases: StepPhases, window: int, prefix: str = "", bar: bool = True
) -> tuple[dict[str, float], dict[str, float]]:
    """The last ``window`` steps' shares, step seconds and samples/s under names starting with ``prefix`` (empty
    before any step is read back), and, with ``bar``, what a progress bar shows of them: the finite ones, as rounded
    percentages and samples/s."""
    figures = recent_figures(phases, window)
    if figures is None:
        return {}, {}
    shares, step_s, samples_per_s = figures
    shown: dict[str, float] = {}
    if bar:
        shown = {key: round(100.0 * shares[name], 1) for name, key in _BAR_KEYS.items() if math.isfinite(shares[name])}
        if math.isfinite(samples_per_s):
            shown["samples/s"] = round(samples_per_s, 1)
    metrics = {prefix + name: share for name, share in shares.items()} if prefix else shares
    metrics[prefix + "step_s"], metrics[prefix + "samples_per_s"] = step_s, samples_per_s
    return metrics, shown


def recent_figures(phases: StepPhases, window: int) -> tuple[dict[str, float], float, float] | None:
    """Shares, mean step seconds and samples per second of the last ``window`` steps, never waiting for a device (on
    a :class:`PhaseLedger`, straight from its per-step totals: this runs while training)."""
    timer = phases.timer
    if isinstance(timer, PhaseLedger):
        totals, steps = timer.recent_totals(window)
        if not steps:
            return None
        step_ns = sum(totals.values())
        shares = {name: totals.get(name, 0) / step_ns if step_ns > 0 else math.nan for name in PHASES}
        step_s = step_ns / 1e9 / steps
    else:
        records = [with_other(r) for r in timer.recent_steps(window)]
        if not records:
            return None
        shares, step_s = phase_shares(records), math.fsum(r["step"] for r in records) / len(records)
    sizes = [s for s in phases.batch_sizes[-window:] if s >= 0]
    samples_per_s = (sum(sizes) / len(sizes)) / step_s if sizes and step_s > 0 else math.nan
    return shares, step_s, samples_per_s


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
    flags = [bool(f & _INTERRUPTED) for f in phases.flags[first : first + len(steady)]]
    clean = [r for r, interrupted in zip(steady, flags) if not interrupted]
    clean_raw = [r for r, interrupted in zip(raw, flags) if not interrupted]
    sizes = [s for s, f in zip(phases.batch_sizes[first:], flags) if not f and s >= 0]
    stats = {name: summarize([r[name] for r in clean_raw if name in r]).to_dict() for name in MEASURED}
    stats["other"] = summarize([r["other"] for r in clean]).to_dict()
    step = summarize([r["step"] for r in clean])
    clean_time = math.fsum(r["step"] for r in clean)
    data_median = stats["data"]["median"]
    restarts = [r["data"] - data_median for r, f in zip(steady, phases.flags[first:]) if f & _EPOCH_FIRST]
    reported = steady[-MAX_REPORTED_STEPS:]
    every, run = phases.sampler.every, phases.sampler.steps_run(timer.num_steps)
    return {
        "steps": {
            "total": timer.num_steps,
            "warmup": first,
            "steady": len(steady),
            "interrupted": len(steady) - len(clean),
        },
        "steps_run": run,
        "sampling": {
            "sample_every": every,
            "steps_run": run,
            "steps_measured": timer.num_steps,
            "dense_steps": (dense := phases.sampler.first - first),
            "note": f"after warm-up every step timed until {dense} are, then one in {every}; phases, "
            "shares and throughput from the timed steps, the observer's cost averaged over every step run"
            if every > 1
            else "every step timed",
            "indicative": indicative_note(len(clean)),
        },
        "steady_state": {
            "step": step.to_dict(),
            "phases": stats,
            "shares": phase_shares(clean),
            "shares_ci95": share_intervals(clean),
        },
        "warmup": {name: stats.to_dict() for name, stats in timer.summary(warmup=True).items()},
        "throughput": {
            "samples_per_s": sum(sizes) / clean_time if sizes and clean_time > 0 else math.nan,
            "steps_per_s": 1.0 / step.median if step.median > 0 else math.nan,
            "batch_size_median": summarize(sizes).median if sizes else math.nan,
            "from_sampled_steps": every > 1,
        },
        "epoch_restart_s": summarize(restarts).median if restarts and math.isfinite(data_median) else None,
        # Every steady step run (sampled or not), the mean step (the cost is a mean too: rare dear calls count in full).
        "overhead": phases.cost.figures(max(0, run - first), clean_time / len(clean) if clean else math.nan),
        "per_step": {
            "phases": list(PHASES),
            "sampled": every > 1,
            "truncated": len(steady) > len(reported),
            "records": reported,
            "interrupted": flags[-MAX_REPORTED_STEPS:],
        },
    }


class SyncCheck:
    """The host-device synchronizations made in the steps ``first <= step < last``, found by ``recorder`` (None: none
    checked); :meth:`figures` for the report."""

    def __init__(self, recorder: HostSyncRecorder | None, first: int, last: int) -> None:
        self.recorder, self.first, self.last = recorder, first, last
        self.steps = 0
        self.note: str | None = None

    def begin(self, step: int, module: nn.Module) -> None:
        """Start recording if ``step`` is checked; on CPU not around a compiled ``module``."""
        recorder = self.recorder
        if recorder is not None and self.first <= step < self.last:
            if recorder.device.type != "cuda" and is_compiled(module):
                # A Python-level mode around compiled code would change what the compiler traces: skip the check.
                self.note = "not checked: the model is compiled and the CPU check would interfere with it"
                self.recorder = None
            else:
                recorder.start()

    def end(self) -> None:
        if self.recorder is not None and self.recorder.active:
            self.recorder.stop()
            self.steps += 1

    def stop(self) -> None:
        if self.recorder is not None:
            self.recorder.stop()

    def figures(self) -> dict[str, Any]:
        recorder, steps = self.recorder, self.steps
        return {
            "method": recorder.method if recorder is not None else "",
            "steps_checked": steps,
            "note": self.note,
            "per_step": (recorder.total / steps) if recorder is not None and steps else None,
            "sites": recorder.sites() if recorder is not None else [],
        }


def step_report(
    phases: StepPhases,
    fit_s: float,
    loader: LoaderSettings | None,
    thresholds: Mapping[str, float],
    **facts: Any,
) -> dict[str, Any]:
    """:func:`summarize_steps`'s figures, the validation runs' against the fit's ``fit_s`` seconds, the loader, the
    host syncs and :func:`~lightning_perf.profiling.recommend`'s advice; ``facts``: the rest of
    :class:`~lightning_perf.profiling.StepBreakdown`."""
    figures, host_syncs = summarize_steps(phases), phases.syncs.figures()
    validation: Stats | None = phases.validation.summary().get("validation")
    steady = figures["steady_state"]
    breakdown = StepBreakdown(
        shares=steady["shares"],
        medians={name: steady["phases"][name]["median"] for name in PHASES},
        step_median_s=steady["step"]["median"],
        steps=steady["step"]["count"],
        loader=loader,
        epoch_restart_s=figures.pop("epoch_restart_s"),
        host_syncs=host_syncs["sites"],
        sync_steps_checked=host_syncs["steps_checked"],
        sync_method=host_syncs["method"],
        thresholds=thresholds,
        **facts,
    )
    return {
        **figures,
        "validation": {
            "runs": validation.count if validation else 0,
            "total_s": validation.total if validation else 0.0,
            "median_s": validation.median if validation else math.nan,
            "share_of_fit": (validation.total / fit_s) if validation and fit_s > 0 else 0.0,
        },
        "fit_seconds": fit_s,
        "dataloader": loader,
        "host_syncs": host_syncs,
        "recommendations": [
            replace(rec, evidence=f"{note}; {rec.evidence}") if (note := figures["sampling"]["indicative"]) else rec
            for rec in recommend(breakdown)
        ],
    }


def rank_values(report: Mapping[str, Any]) -> dict[str, float]:
    """The figures of :func:`step_report` compared across processes: step time, throughput, shares, own cost."""
    summary = report["steady_state"]
    return {
        "step_median_s": summary["step"]["median"],
        "samples_per_s": report["throughput"]["samples_per_s"],
        **{f"share_{name}": summary["shares"][name] for name in PHASES},
        "overhead_share": report["overhead"]["share_of_step"],
    }


def merge_ranks(report: dict[str, Any], ranks: Mapping[str, Mapping[str, float]] | None, world_size: int) -> None:
    """Add the figures of every process (:func:`rank_values`' min, mean and max across ranks) to ``report``, with the
    throughput of the whole world; nothing with a single process (``ranks`` None)."""
    if ranks is not None:
        report["ranks"] = ranks
        report["throughput"]["world_samples_per_s"] = ranks["samples_per_s"]["mean"] * world_size


def phase_table(report: Mapping[str, Any], owner: str) -> tuple[list[str], list[list[object]], str]:
    """The report's table: headers, a row per phase and one for the whole step (median, p90, share, steps), title."""
    summary, steps = report["steady_state"], report["steps"]
    note = (report.get("sampling") or {}).get("indicative")
    title = (
        f"{owner}: {steps['steady']} steady steps ({steps['warmup']} warm-up, {steps['interrupted']} interrupted left "
        f"out) on {report['device']}" + (f" ({note})" if note else "")
    )
    rows: list[list[object]] = []
    intervals = summary.get("shares_ci95", {})
    for name in [*PHASES, "step"]:
        stats = summary["step"] if name == "step" else summary["phases"][name]
        share = 1.0 if name == "step" else summary["shares"][name]
        low, high = intervals.get(name, (math.nan, math.nan))
        share_text = f"{100 * share:.1f}%" if math.isfinite(share) else "n/a"
        if math.isfinite(low) and name != "step":
            share_text += f" [{100 * low:.1f}-{100 * high:.1f}]"
        rows.append([name, format_seconds(stats["median"]), format_seconds(stats["p90"]), share_text, stats["count"]])
    return ["phase", "median", "p90", "share [95%]", "steps"], rows, title


def report_lines(report: Mapping[str, Any]) -> list[str]:
    """Throughput and the observer's cost, validation, the recommendations and the plot's note, a line each."""
    throughput, overhead, validation = report["throughput"], report["overhead"], report["validation"]
    sampling = report.get("sampling") or {}
    every = sampling.get("sample_every", 1)
    sampled = ""
    if every > 1:
        dense = f" after the first {n} steady" if (n := sampling.get("dense_steps")) else ""
        sampled = f" ({sampling['steps_measured']} timed steps of {sampling['steps_run']}, one in {every}{dense})"
    lines = [
        f"throughput{sampled}: {throughput['samples_per_s']:.1f} samples/s per process, {throughput['steps_per_s']:.2f}"
        f" steps/s; observer cost {100 * overhead['share_of_step']:.2g}% of the mean step",
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


def report_text(report: Mapping[str, Any], owner: str) -> str:
    """The report as plain text for a log: :func:`phase_table` and :func:`report_lines` (a plain table: rendering a
    rich one costs tens of milliseconds)."""
    return "\n".join([text_table(*phase_table(report, owner)), *report_lines(report)])


def binned(records: list[dict[str, float]], bars: int = MAX_PLOTTED_BARS) -> list[dict[str, float]]:
    """At most ``bars`` records: means of consecutive steps, so long runs still draw quickly."""
    n = len(records)
    if n <= bars:
        return records
    groups = (records[b * n // bars : (b + 1) * n // bars] for b in range(bars))
    return [{name: math.fsum(r[name] for r in group) / len(group) for name in PHASES} for group in groups]


def plot_phases(records: list[dict[str, float]], path: Path) -> Path:
    """The phases' time per step, stacked (binned, see :func:`binned`), as a PNG (needs matplotlib)."""
    return plot_stacked_steps(binned(records), path, title="Phase time per training step", phases=PHASES)


def check_settings(
    owner: str, warmup_steps: int, sync_check_steps: int, thresholds: Mapping[str, float] | None
) -> dict[str, float]:
    """The thresholds by phase (see :func:`~lightning_perf.profiling.advice.validate_thresholds`), once the settings
    are checked: the host-sync check runs on the last warm-up steps, thresholds name phases that have one."""
    if sync_check_steps > warmup_steps:
        raise ValueError(
            f"`{owner}(sync_check_steps={sync_check_steps!r}, warmup_steps={warmup_steps!r})`: the checked steps "
            "are the last warm-up steps, so sync_check_steps must be at most warmup_steps."
        )
    return validate_thresholds(thresholds, owner)


def is_compiled(module: nn.Module) -> bool:
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


def batch_size_of(batch: Any) -> int | None:
    """Length of the first tensor found in ``batch`` (depth first), the way Lightning infers a batch size."""
    kind = type(batch)
    if (kind is list or kind is tuple) and batch and type(batch[0]) is torch.Tensor and batch[0].dim() > 0:
        return int(batch[0].shape[0])  # the common batch, (inputs, targets), without the ABC checks below
    return _first_in(batch, lambda b: int(b.shape[0]) if isinstance(b, torch.Tensor) and b.dim() > 0 else None)


def first_dataloader(loaders: Any) -> Any:
    """The first object with ``num_workers`` in a loader or a nest of mappings and sequences of them."""
    return _first_in(loaders, lambda loader: loader if hasattr(loader, "num_workers") else None)


def _first_in(nest: Any, pick: Callable[[Any], Any]) -> Any:
    """The first ``pick(item)`` that is not None, depth first through ``nest``'s mappings, lists and tuples."""
    found = pick(nest)
    if found is not None:
        return found
    items = nest.values() if isinstance(nest, Mapping) else nest if isinstance(nest, (list, tuple)) else ()
    return next((f for f in (_first_in(item, pick) for item in items) if f is not None), None)
