"""Memory at fixed points of the training step, every few steps, with leak detection and CUDA OOM snapshots."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_perf._validation import check_bool, check_int
from lightning_perf._warnings import MeasurementWarning, NoEffectWarning, warn_once
from lightning_perf.callbacks._observer import (
    across_ranks,
    announce_files,
    check_dirpath,
    check_filename,
    draw_chart,
    log_metrics,
    report_dir,
    report_stem,
)
from lightning_perf.profiling import (
    LeakTrend,
    MemoryProbe,
    MemorySample,
    cuda_history,
    detect_leaks,
    format_bytes,
    format_seconds,
    plot_lines,
    print_table,
    summarize,
    write_json,
)
from lightning_perf.profiling.leaks import MIN_LEAK_SAMPLES, NOISE_FLOOR_STEPS, SEGMENTS, LeakSeries

__all__ = ["POINTS", "MemoryProfilerCallback"]

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
_REPORT_PATTERNS = (".json", ".png", "_history_rank*.pickle", "_oom_rank*.pickle")

_MIB = 1024.0 * 1024.0
_MAX_REPORTED_SAMPLES = 20_000


class MemoryProfilerCallback(Callback):
    """Sample memory at named points of the training step every ``every_n_steps`` steps, and catch leaks.

    Points (``points``, default all, see :data:`POINTS`):

    - ``after_data``: the batch is on the device (``on_train_batch_start``). The peak is reset right after it, so
      each step's ``peak`` covers its forward, backward and optimizer step;
    - ``after_forward``: the loss is computed (the first ``on_before_zero_grad`` or ``on_before_backward``);
    - ``after_backward``: gradients are computed (the last ``on_after_backward`` of the step);
    - ``after_optimizer``: the end of the step (``on_train_batch_end``), after the optimizer step in steps where the
      optimizer steps.

    Each sample is a :class:`~lightning_perf.profiling.MemorySample`: on CUDA the caching allocator's allocated,
    reserved and peak allocated bytes; on CPU the C allocator's bytes in use (glibc ``mallinfo2``), the resident set
    and its peak (see :mod:`lightning_perf.profiling.memory` for what each means and its limits).

    Leak detection, by significance and with no absolute bound in bytes: memory in use (``allocated``) is read at
    each point of *every* training step (one cheap reading: a ``mallinfo2`` call on CPU, the caching allocator's
    counter on CUDA; into storage allocated once, so the series does not measure itself), whatever ``every_n_steps``.
    Warm-up is left out: the first epoch when it is shorter than ``warmup_steps`` steps, else the first
    ``warmup_steps`` steps (lazily built optimizer state, allocator arenas, the first validation run's caches). On
    the rest, for each point, :func:`~lightning_perf.profiling.detect_leaks` fits a Theil-Sen slope and Sen's
    distribution-free 95% interval, and flags the point when, over at least ``leak_min_samples`` steps, the interval
    lies above zero (growth noise would rarely produce), it does so in each third of the steps as well (steady: a
    cache that fills up and stops, or a one-time jump, leaves a third flat), and the growth over two steps reaches the
    noise floor of the readings (their robust scatter around the trend, measured over short blocks). That last rule
    is relative to the readings, not a number of bytes: the allocator's own churn drifts up in occasional jumps that
    can be significant over a few hundred steps, yet is small per step next to that scatter, while a leak adds its
    bytes at every step; the same rule holds on a calm GPU allocator and a busy CPU heap, for any model size.
    While training, the verdict is renewed on the last sampled point of the step every :data:`LEAK_CHECK_EVERY_N_STEPS`
    steps (then every quarter of the steps so far), on every point when that one grows, and on every point at the
    end of fit; a
    :class:`~lightning_perf.MeasurementWarning` containing "leak" names the phase that grows and its rate in KiB/step
    with its 95% interval, once per fit; the every-step readings stop there (the snapshots go on). ``leak_threshold``
    (bytes per step) is an optional extra bound, off by default. Cost: four ``mallinfo2`` calls per step, a few
    microseconds each on a healthy heap (glibc walks its free chunks, so more on a fragmented one), and a verdict
    every 50 or more steps; the callback measures its own time and reports it (``overhead``, and the printed
    "observer cost").

    On CUDA, with ``record_history=True``, every allocation is recorded with its stack from the start of fit, and the
    history is written at the end of fit as ``<filename>_history_rank<R>.pickle``; with ``oom_snapshot=True`` a
    snapshot ``<filename>_oom_rank<R>.pickle`` is written when the allocator runs out of memory, and the
    ``OutOfMemoryError`` still propagates. Both load in PyTorch's memory visualizer (https://pytorch.org/memory_viz).
    Recording stops at teardown.

    At the end of fit, on rank zero: a table ``snapshot | time | allocated | reserved | peak | trend``, a JSON report
    ``<filename>.json`` and, with matplotlib, ``<filename>.png``: memory per point across the sampled steps, in
    ``dirpath`` (default: the Trainer's ``log_dir``). Every file written is announced with its path, one line each
    (``rank_zero_info``). An earlier run's reports are never overwritten silently: when files of ``<filename>``
    already exist there, this run writes ``<filename>-2.*`` (then ``-3``, ...), unless ``overwrite=True``. The step's
    peak memory is sent to the Trainer's loggers (``memory/peak``, ``memory/allocated``, ``memory/reserved``) every
    ``log_every_n_steps``; under DDP the peak and the growth rates are summarized across ranks (min/mean/max, one
    ``all_gather`` at fit end). The JSON report is also kept in :attr:`report`.

    Args:
        every_n_steps: take a full snapshot (allocated, reserved, peak and time at each point) of one training step in
            this many (1: every step). The leak series reads ``allocated`` at every step regardless.
        points: which points to sample (names from :data:`POINTS`); ``None`` for all.
        warmup_steps: leading steps left out of the leak trend, at most (a shorter first epoch is left out instead).
        leak_threshold: optional extra bound: a point is reported as leaking only if it also grows by more than this
            many bytes per step. ``None`` (default): the verdict rests on significance and the noise floor alone.
        leak_min_samples: steps after warm-up needed before a point can be reported as leaking (at least 18: three
            thirds of six, the fewest with which Sen's interval can exclude zero).
        log_every_n_steps: how often to send memory figures to the loggers; ``None`` takes the Trainer's.
        record_history: on CUDA, record allocation history and write it at the end of fit.
        history_max_entries: how many allocation events the history keeps (the latest).
        oom_snapshot: on CUDA, write an allocator snapshot when memory runs out.
        dirpath: directory of the reports; ``None`` uses the Trainer's ``log_dir`` (``default_root_dir`` without a
            logger).
        filename: file name (without extension) of the reports.
        plot: draw the PNG chart (needs matplotlib; without it a note says so and the run goes on).
        verbose: print the table at the end of fit.
        overwrite: write over an earlier run's reports of the same ``filename`` instead of numbering this run's.

    Raises:
        ValueError: for an interval below 1, a negative ``warmup_steps``, an unknown point name, a ``leak_threshold``
            that is not a positive finite number, ``leak_min_samples`` below 18, or a file name with a directory in
            it.
        TypeError: if ``points`` is not a sequence of names, ``dirpath`` not a path, or a flag (``record_history``,
            ``oom_snapshot``, ``plot``, ``verbose``, ``overwrite``) not a bool.

    Example::

        trainer = Trainer(callbacks=[MemoryProfilerCallback(every_n_steps=5)])
        trainer.fit(model, datamodule=data)  # warns "... leak ..." if memory grows steadily from step to step
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        points: Sequence[str] | None = None,
        warmup_steps: int = 50,
        leak_threshold: float | None = None,
        leak_min_samples: int = 30,
        log_every_n_steps: int | None = None,
        record_history: bool = False,
        history_max_entries: int = 100_000,
        oom_snapshot: bool = True,
        dirpath: str | None = None,
        filename: str = "memory_profile",
        plot: bool = True,
        verbose: bool = True,
        overwrite: bool = False,
    ) -> None:
        name = type(self).__name__
        self.every_n_steps: int = check_int(name, "every_n_steps", every_n_steps, 1)
        self.warmup_steps: int = check_int(name, "warmup_steps", warmup_steps, 0)
        self.leak_min_samples: int = check_int(name, "leak_min_samples", leak_min_samples, MIN_LEAK_SAMPLES)
        self.log_every_n_steps: int | None = check_int(name, "log_every_n_steps", log_every_n_steps, 1, True)
        self.history_max_entries: int = check_int(name, "history_max_entries", history_max_entries, 1)
        if leak_threshold is not None and (
            isinstance(leak_threshold, bool)
            or not isinstance(leak_threshold, (int, float))
            or not 0 < leak_threshold < math.inf
        ):
            raise ValueError(
                f"`{name}(leak_threshold={leak_threshold!r})` is not valid. Expected None (no absolute bound) or a "
                "growth in bytes per step > 0, e.g. 16384."
            )
        self.leak_threshold: float | None = None if leak_threshold is None else float(leak_threshold)
        if points is None:
            self.points: tuple[str, ...] = POINTS
        else:
            if isinstance(points, str) or not isinstance(points, Sequence):
                raise TypeError(f"`{name}(points={points!r})` is not valid. Expected a list of names from {POINTS}.")
            unknown = [p for p in points if p not in POINTS]
            if unknown or not points:
                raise ValueError(
                    f"`{name}(points={list(points)!r})` is not valid: "
                    + (f"unknown point(s) {unknown}. " if unknown else "no point given. ")
                    + f"Expected names from: {', '.join(POINTS)}."
                )
            self.points = tuple(p for p in POINTS if p in points)  # step order, no duplicates
        self.record_history = check_bool(name, "record_history", record_history)
        self.oom_snapshot = check_bool(name, "oom_snapshot", oom_snapshot)
        self.dirpath = check_dirpath(name, dirpath)
        self.filename = check_filename(name, filename)
        self.plot = check_bool(name, "plot", plot)
        self.verbose = check_bool(name, "verbose", verbose)
        self.overwrite = check_bool(name, "overwrite", overwrite)
        self.report: dict[str, Any] | None = None
        self._probe: MemoryProbe | None = None
        self._oom_handle: Any = None
        self._recording = False
        self._reset()

    def _reset(self) -> None:
        self._step_index = 0
        self._sampling = False  # whether the running step is sampled
        self._current: dict[str, MemorySample] = {}
        self._steps: list[int] = []  # per sampled step: its index,
        self._epochs: list[int] = []  # its epoch,
        self._samples: list[dict[str, MemorySample]] = []  # and its samples by point
        self._hook_ns = 0
        self._first_end_ns: int | None = None
        self._last_end_ns = 0
        self._ends = 0
        self._last_logged = 0
        self._warned = False
        self._next_check = LEAK_CHECK_EVERY_N_STEPS
        self._trends: dict[str, LeakTrend] = {}
        self._oom_files: list[str] = []
        self._directory: Path | None = None
        self._stem = self.filename
        self._rank = 0
        self._series: LeakSeries | None = None
        self._leak_start: int | None = None

    # ------------------------------------------------------------------------------------------------ set-up

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self.report = None
        self._probe = None
        if pl_module.device.type not in ("cpu", "cuda"):
            warn_once(
                f"`{type(self).__name__}` measures CPU and CUDA memory; the run is on {pl_module.device.type}, so "
                "nothing is sampled.",
                NoEffectWarning,
            )
            return
        self._probe = MemoryProbe(pl_module.device)
        self._series = LeakSeries(self.points)
        self._rank = trainer.global_rank
        self._directory = report_dir(trainer, self.dirpath)  # on every rank: log_dir broadcasts
        self._stem = report_stem(self._directory, self.filename, _REPORT_PATTERNS, self.overwrite)
        if pl_module.device.type != "cuda":
            if self.record_history:
                warn_once(
                    f"`{type(self).__name__}(record_history=True)` records CUDA allocations only; the run is on "
                    f"{pl_module.device.type}, so no history is written.",
                    NoEffectWarning,
                )
            return
        if self.record_history:  # before the OOM observer: it initializes the allocator too
            cuda_history.start_history(self.history_max_entries)
            self._recording = True
        if self.oom_snapshot:
            self._oom_handle = cuda_history.on_out_of_memory(partial(_write_oom_snapshot, self))

    def _stop_recording(self) -> None:
        if self._oom_handle is not None:
            self._oom_handle.remove()
            self._oom_handle = None
        if self._recording:
            cuda_history.stop_history()
            self._recording = False

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_recording()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._oom_files and isinstance(exception, torch.OutOfMemoryError):
            rank_zero_info(
                f"{type(self).__name__}: out of memory; allocator snapshot written to {self._oom_files[-1]} "
                "(open it in https://pytorch.org/memory_viz)."
            )
        self._stop_recording()

    def __getstate__(self) -> dict[str, Any]:
        # The out-of-memory listener and the history recording belong to this process's allocator.
        state = self.__dict__.copy()
        state.update(_oom_handle=None, _recording=False)
        return state

    # ------------------------------------------------------------------------------------------------ sampling

    def _sample(self, point: str, overwrite: bool = False) -> None:
        """Read ``point``: the full sample on sampled steps, the cheap ``allocated`` for the leak series always."""
        if point not in self.points:
            return
        probe, series = self._probe, self._series
        assert probe is not None and series is not None
        if self._sampling and (overwrite or point not in self._current):
            sample = probe.sample()
            self._current[point] = sample
            series.record(point, sample.allocated, overwrite)
        elif series.recording:
            series.record(point, probe.allocated(), overwrite)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        entry = time.perf_counter_ns()
        probe, series = self._probe, self._series
        if probe is None or series is None:
            return
        series.start_step(self._step_index, trainer.current_epoch)
        self._sampling = self._step_index % self.every_n_steps == 0
        if self._sampling:
            self._current = {"start": probe.sample()} if "after_data" not in self.points else {}
        self._sample("after_data")
        if self._sampling:
            probe.reset_peak()
        self._hook_ns += time.perf_counter_ns() - entry

    def _sample_in_step(self, point: str, overwrite: bool = False) -> None:
        if self._probe is not None and (self._sampling or (self._series is not None and self._series.recording)):
            entry = time.perf_counter_ns()
            self._sample(point, overwrite)
            self._hook_ns += time.perf_counter_ns() - entry

    @override
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        self._sample_in_step("after_forward")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._sample_in_step("after_forward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sample_in_step("after_backward", overwrite=True)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        entry = time.perf_counter_ns()
        if self._probe is None:
            return
        if self._first_end_ns is None:
            self._first_end_ns = entry
        self._last_end_ns = entry
        self._ends += 1
        self._sample("after_optimizer", overwrite=True)
        if self._sampling:
            self._sampling = False
            # The peak of the step: read at its end whatever points are sampled.
            end = self._probe.sample() if "after_optimizer" not in self.points else self._current["after_optimizer"]
            self._current["end"] = end
            self._steps.append(self._step_index)
            self._epochs.append(trainer.current_epoch)
            self._samples.append(self._current)
            every = self.log_every_n_steps or trainer.log_every_n_steps  # type: ignore[attr-defined]
            if trainer.loggers and trainer.global_step - self._last_logged >= every:
                self._last_logged = trainer.global_step
                last = self._current[self.points[-1]]
                log_metrics(
                    trainer,
                    {"memory/peak": end.peak, "memory/allocated": last.allocated, "memory/reserved": last.reserved},
                )
            self._current = {}
        self._step_index += 1
        if self._step_index >= self._next_check and not self._warned:
            self._next_check = self._step_index + max(LEAK_CHECK_EVERY_N_STEPS, self._step_index // 4)
            self._check_leaks(every_point=False)
        self._hook_ns += time.perf_counter_ns() - entry

    # -------------------------------------------------------------------------------------------------- leaks

    def _first_leak_step(self) -> int:
        """The first step of the leak window: after the first epoch when it is shorter than ``warmup_steps``."""
        assert self._series is not None
        second_epoch = self._series.first_step_of_epoch_after(0)
        return self.warmup_steps if second_epoch is None else min(self.warmup_steps, second_epoch)

    def _leak_trends(self, points: Sequence[str]) -> dict[str, LeakTrend]:
        assert self._series is not None
        self._leak_start = self._first_leak_step()
        series = self._series.series(self._leak_start)
        return detect_leaks({p: series[p] for p in points}, self.leak_threshold, self.leak_min_samples)

    def _check_leaks(self, every_point: bool = True) -> None:
        """Renew the verdict; while training only the step's last point first (a leak shows at every point)."""
        if not every_point and not any(t.leaking for t in self._leak_trends(self.points[-1:]).values()):
            return
        self._trends = self._leak_trends(self.points)
        leaking = sorted((t for t in self._trends.values() if t.leaking), key=lambda t: t.slope_low, reverse=True)
        if not leaking or self._warned:
            return
        self._warned = True
        # Reported: the every-step readings stop here (on a heap that keeps growing, glibc's mallinfo2 walks more and
        # more free chunks, so they get dearer); the snapshots every `every_n_steps` go on.
        assert self._series is not None
        self._series.stop(self._step_index)
        worst = leaking[0]
        others = ", ".join(f"{t.point} {_kib(t.slope)} KiB/step" for t in leaking[1:])
        warn_once(
            f"{type(self).__name__}: memory leak: memory in use {PHASES[worst.point]} ({worst.point}) grows by "
            f"{_kib(worst.slope)} KiB/step (95% interval {_kib(worst.slope_low)} to {_kib(worst.slope_high)} KiB/step; "
            f"Theil-Sen over {worst.samples} steps, {worst.first_step}-{worst.last_step}: "
            f"{format_bytes(worst.first_bytes)} -> {format_bytes(worst.last_bytes)}; growing in each third, above the "
            f"readings' noise floor of {format_bytes(worst.noise_floor)})"
            + (f"; also {others}" if others else "")
            + ". Something keeps tensors alive from one step to the next, e.g. a list of losses or outputs that "
            "still hold their autograd graph: keep `loss.detach()` or `loss.item()` instead.",
            MeasurementWarning,
        )

    # ------------------------------------------------------------------------------------------------ results

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._probe is None or self._directory is None:
            return
        self._check_leaks()
        directory = self._directory
        history = None
        if self._recording:
            history = str(cuda_history.dump_snapshot(directory / f"{self._stem}_history_rank{self._rank}.pickle"))
        report = self._analyze(trainer)
        report["files"] = {"history": history, "oom_snapshots": list(self._oom_files)}
        peaks = report["peak"]
        ranks = across_ranks(
            trainer,
            pl_module,
            {
                "peak_max": peaks["max"],
                "peak_above_start_median": report["peak_above_start"]["median"],
                **{f"slope_{p}": self._trends[p].slope for p in self.points},
            },
        )
        if ranks is not None:
            report["ranks"] = ranks
        self.report = report
        if not trainer.is_global_zero:
            return
        report["plot"], report["plot_note"] = None, None
        if self.plot and self._samples:
            series = {
                f"{p} allocated": [s[p].allocated / _MIB if p in s else None for s in self._samples]
                for p in self.points
            }
            series["step peak"] = [s["end"].peak / _MIB for s in self._samples]
            report["plot"], report["plot_note"] = draw_chart(
                lambda path: plot_lines(
                    series,
                    path,
                    title=f"Memory per sampled step ({report['source']})",
                    xlabel=f"sampled step (one in {self.every_n_steps})",
                    ylabel="MiB",
                ),
                directory / f"{self._stem}.png",
                type(self).__name__,
            )
        report["json"] = str(directory / f"{self._stem}.json")
        write_json(report, directory / f"{self._stem}.json")
        if self.verbose:
            self._print(report)
        announce_files(type(self).__name__, [report["json"], report["plot"], history, *self._oom_files])

    def _analyze(self, trainer: pl.Trainer) -> dict[str, Any]:
        assert self._probe is not None
        probe = self._probe
        table: dict[str, dict[str, Any]] = {}
        for point in self.points:
            rows = [s for step, s in zip(self._steps, self._samples) if point in s and step >= self.warmup_steps]
            if not rows:  # a short run: fall back to every sample rather than report nothing
                rows = [s for s in self._samples if point in s]
            start = "after_data" if "after_data" in self.points else "start"
            table[point] = {
                "time_s": summarize([(s[point].timestamp_ns - s[start].timestamp_ns) / 1e9 for s in rows]).to_dict(),
                "allocated": summarize([s[point].allocated for s in rows]).to_dict(),
                "reserved": summarize([s[point].reserved for s in rows]).to_dict(),
                "peak_max": max((s[point].peak for s in rows), default=None),
                "trend_bytes_per_step": self._trends[point].slope if point in self._trends else math.nan,
            }
        starts = [s.get("after_data", s.get("start")) for s in self._samples]
        above = [s["end"].peak_above(start) for s, start in zip(self._samples, starts) if start is not None]
        wall_s = (self._last_end_ns - (self._first_end_ns or self._last_end_ns)) / 1e9
        per_step_s = wall_s / (self._ends - 1) if self._ends > 1 else math.nan
        samples = [
            {"step": step, "epoch": epoch, "point": point, **sample.to_dict()}
            for step, epoch, by_point in zip(self._steps, self._epochs, self._samples)
            for point, sample in by_point.items()
            if point in self.points
        ]
        return {
            "callback": type(self).__name__,
            "device": str(probe.device),
            "source": probe.source,
            "notes": self._samples[0]["end"].notes if self._samples else {},
            "every_n_steps": self.every_n_steps,
            "points": list(self.points),
            "warmup_steps": self.warmup_steps,
            "steps_seen": self._step_index,
            "steps_sampled": len(self._samples),
            "snapshots": table,
            "peak": summarize([s["end"].peak for s in self._samples]).to_dict(),
            "peak_above_start": summarize(above).to_dict(),
            "peak_since_reset": all(s["end"].peak_since_reset for s in self._samples),
            "leaks": {
                "method": "Theil-Sen slope with Sen's distribution-free 95% interval, per point, every step",
                "rule": f"interval above zero overall and in each of {SEGMENTS} consecutive parts, and the growth over "
                f"{NOISE_FLOOR_STEPS} steps at least the noise floor of the readings",
                "first_step": self._leak_start,
                "sampled_every_n_steps": self._series.stride if self._series is not None else None,
                "stopped_at_step": self._series.stopped_at if self._series is not None else None,
                "threshold_bytes_per_step": self.leak_threshold,
                "min_samples": self.leak_min_samples,
                "trends": self._trends,
                "leaking": [t.point for t in self._trends.values() if t.leaking],
            },
            "overhead": {
                "hooks_ns_total": self._hook_ns,
                "hooks_ns_per_step": self._hook_ns / self._ends if self._ends else math.nan,
                "step_s_mean": per_step_s,
                "share_of_step": (self._hook_ns / self._ends / 1e9) / per_step_s if per_step_s > 0 else math.nan,
            },
            "samples": samples[-_MAX_REPORTED_SAMPLES:],
            "samples_truncated": len(samples) > _MAX_REPORTED_SAMPLES,
        }

    def _print(self, report: dict[str, Any]) -> None:
        rows = []
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
        print_table(
            ["snapshot", "time", "allocated", "reserved", "peak", "trend"],
            rows,
            title=f"MemoryProfilerCallback: {report['steps_sampled']} sampled steps of {report['steps_seen']} on "
            f"{report['device']} ({report['source']})",
        )
        overhead = report["overhead"]["share_of_step"]
        lines = [
            f"step peak above its start: median {format_bytes(report['peak_above_start']['median'])}; "
            f"observer cost {100 * overhead:.2g}% of step time"
            if math.isfinite(overhead)
            else f"step peak above its start: median {format_bytes(report['peak_above_start']['median'])}"
        ]
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
        if report.get("plot_note"):
            lines.append(report["plot_note"])
        rank_zero_info("\n".join(lines))


def _write_oom_snapshot(callback: MemoryProfilerCallback, device: int, alloc: int, *_: int) -> None:
    """Out-of-memory listener: write the allocator's state where the callback writes its reports."""
    if callback._directory is None:
        return
    path = callback._directory / f"{callback._stem}_oom_rank{callback._rank}.pickle"
    cuda_history.dump_snapshot(path)
    if str(path) not in callback._oom_files:
        callback._oom_files.append(str(path))


def _kib(n: float) -> str:
    """Bytes as KiB (the unit of the leak warning, whatever the size): three significant digits, whole above 100."""
    if not math.isfinite(n):
        return str(n)
    kib = n / 1024
    return f"{kib:,.0f}" if abs(kib) >= 100 else f"{kib:.3g}"
