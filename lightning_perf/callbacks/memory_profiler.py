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
    check_dirpath,
    check_filename,
    draw_chart,
    log_metrics,
    report_dir,
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

__all__ = ["POINTS", "MemoryProfilerCallback"]

POINTS: tuple[str, ...] = ("after_data", "after_forward", "after_backward", "after_optimizer")
"""Where in a training step memory can be sampled, in the order they happen."""

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

    Leak detection: for each point, the growth of ``allocated`` across the sampled steps after ``warmup_steps`` is
    estimated with a Theil-Sen trend (the median of pairwise slopes, robust to spikes;
    :func:`~lightning_perf.profiling.detect_leaks`). When it exceeds ``leak_threshold`` bytes per step over at least
    ``leak_min_samples`` samples, a :class:`~lightning_perf.MeasurementWarning` names the rate and the point where
    memory grows; it is checked at the end of each training epoch and of fit, and said once per fit. The threshold is
    an absolute rate, not a fraction of memory in use: a leak costs the same bytes per step whatever the model's size,
    and it is what decides how many steps remain before memory runs out.

    On CUDA, with ``record_history=True``, every allocation is recorded with its stack from the start of fit, and the
    history is written at the end of fit as ``<filename>_history.pickle``; with ``oom_snapshot=True`` (default) a
    snapshot ``<filename>_oom_rank<R>.pickle`` is written when the allocator runs out of memory, and the
    ``OutOfMemoryError`` still propagates. Both load in PyTorch's memory visualizer (https://pytorch.org/memory_viz).
    Recording stops at teardown.

    At the end of fit, on rank zero: a table ``snapshot | time | allocated | reserved | peak | trend``, a JSON report
    ``<filename>.json`` and, with matplotlib, ``<filename>.png``: memory per point across the sampled steps, in
    ``dirpath`` (default: the Trainer's ``log_dir``). The step's peak memory is sent to the Trainer's loggers
    (``memory/peak``, ``memory/allocated``, ``memory/reserved``) every ``log_every_n_steps``; under DDP the peak and
    the growth rates are summarized across ranks (min/mean/max, one ``all_gather`` at fit end). The JSON report is
    also kept in :attr:`report`.

    Args:
        every_n_steps: sample one training step in this many (1: every step).
        points: which points to sample (names from :data:`POINTS`); ``None`` for all.
        warmup_steps: leading steps left out of the leak trend (allocator and optimizer state growth).
        leak_threshold: growth of memory in use, in bytes per step, above which a point is reported as leaking.
        leak_min_samples: sampled steps after warm-up needed before a point can be reported as leaking.
        log_every_n_steps: how often to send memory figures to the loggers; ``None`` takes the Trainer's.
        record_history: on CUDA, record allocation history and write it at the end of fit.
        history_max_entries: how many allocation events the history keeps (the latest).
        oom_snapshot: on CUDA, write an allocator snapshot when memory runs out.
        dirpath: directory of the reports; ``None`` uses the Trainer's ``log_dir`` (``default_root_dir`` without a
            logger).
        filename: file name (without extension) of the reports.
        plot: draw the PNG chart (needs matplotlib; without it a note says so and the run goes on).
        verbose: print the table at the end of fit.

    Raises:
        ValueError: for an interval below 1, a negative ``warmup_steps``, an unknown point name, a non-positive
            ``leak_threshold``, or a file name with a directory in it.
        TypeError: if ``points`` is not a sequence of names, ``dirpath`` not a path, or a flag (``record_history``,
            ``oom_snapshot``, ``plot``, ``verbose``) not a bool.

    Example::

        trainer = Trainer(callbacks=[MemoryProfilerCallback(every_n_steps=5)])
        trainer.fit(model, datamodule=data)  # warns if memory grows from step to step
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        points: Sequence[str] | None = None,
        warmup_steps: int = 5,
        leak_threshold: float = 16 * 1024,
        leak_min_samples: int = 10,
        log_every_n_steps: int | None = None,
        record_history: bool = False,
        history_max_entries: int = 100_000,
        oom_snapshot: bool = True,
        dirpath: str | None = None,
        filename: str = "memory_profile",
        plot: bool = True,
        verbose: bool = True,
    ) -> None:
        name = type(self).__name__
        self.every_n_steps: int = check_int(name, "every_n_steps", every_n_steps, 1)
        self.warmup_steps: int = check_int(name, "warmup_steps", warmup_steps, 0)
        self.leak_min_samples: int = check_int(name, "leak_min_samples", leak_min_samples, 2)
        self.log_every_n_steps: int | None = check_int(name, "log_every_n_steps", log_every_n_steps, 1, True)
        self.history_max_entries: int = check_int(name, "history_max_entries", history_max_entries, 1)
        if (
            isinstance(leak_threshold, bool)
            or not isinstance(leak_threshold, (int, float))
            or not 0 < leak_threshold < math.inf
        ):
            raise ValueError(
                f"`{name}(leak_threshold={leak_threshold!r})` is not valid. Expected a growth in bytes per step > 0, "
                "e.g. 16384."
            )
        self.leak_threshold = float(leak_threshold)
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
        self._trends: dict[str, LeakTrend] = {}
        self._oom_files: list[str] = []
        self._directory: Path | None = None
        self._rank = 0

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
        self._rank = trainer.global_rank
        self._directory = report_dir(trainer, self.dirpath)  # on every rank: log_dir broadcasts
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
        if point in self.points and (overwrite or point not in self._current):
            assert self._probe is not None
            self._current[point] = self._probe.sample()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        entry = time.perf_counter_ns()
        probe = self._probe
        if probe is None:
            return
        self._sampling = self._step_index % self.every_n_steps == 0
        if self._sampling:
            self._current = {"start": probe.sample()} if "after_data" not in self.points else {}
            self._sample("after_data")
            probe.reset_peak()
        self._hook_ns += time.perf_counter_ns() - entry

    def _sample_in_step(self, point: str, overwrite: bool = False) -> None:
        if self._sampling:
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
        if self._sampling:
            self._sampling = False
            self._sample("after_optimizer", overwrite=True)
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
        self._hook_ns += time.perf_counter_ns() - entry

    # -------------------------------------------------------------------------------------------------- leaks

    def _leak_trends(self) -> dict[str, LeakTrend]:
        series: dict[str, tuple[list[int], list[int]]] = {}
        for point in self.points:
            steps, values = [], []
            for step, samples in zip(self._steps, self._samples):
                if step >= self.warmup_steps and point in samples:
                    steps.append(step)
                    values.append(samples[point].allocated)
            series[point] = (steps, values)
        return detect_leaks(series, self.leak_threshold, self.leak_min_samples)

    def _check_leaks(self) -> None:
        self._trends = self._leak_trends()
        leaking = sorted((t for t in self._trends.values() if t.leaking), key=lambda t: t.slope, reverse=True)
        if not leaking or self._warned:
            return
        self._warned = True
        worst = leaking[0]
        others = ", ".join(f"{t.point} {format_bytes(t.slope)}/step" for t in leaking[1:])
        warn_once(
            f"{type(self).__name__}: memory in use {worst.point} grows by {format_bytes(worst.slope)} per step "
            f"(robust trend over {worst.samples} sampled steps, steps {worst.first_step}-{worst.last_step}: "
            f"{format_bytes(worst.first_bytes)} -> {format_bytes(worst.last_bytes)}), above "
            f"leak_threshold={format_bytes(self.leak_threshold)}/step"
            + (f"; also {others}" if others else "")
            + ". Something keeps tensors alive from one step to the next, e.g. a list of losses or outputs that "
            "still hold their autograd graph: keep `loss.detach()` or `loss.item()` instead.",
            MeasurementWarning,
        )

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._probe is not None:
            self._check_leaks()

    # ------------------------------------------------------------------------------------------------ results

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._probe is None or self._directory is None:
            return
        self._check_leaks()
        directory = self._directory
        history = None
        if self._recording:
            history = str(cuda_history.dump_snapshot(directory / f"{self.filename}_history_rank{self._rank}.pickle"))
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
                directory / f"{self.filename}.png",
                type(self).__name__,
            )
        report["json"] = str(directory / f"{self.filename}.json")
        write_json(report, directory / f"{self.filename}.json")
        if self.verbose:
            self._print(report)

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
        if report.get("plot_note"):
            lines.append(report["plot_note"])
        rank_zero_info("\n".join(lines))


def _write_oom_snapshot(callback: MemoryProfilerCallback, device: int, alloc: int, *_: int) -> None:
    """Out-of-memory listener: write the allocator's state where the callback writes its reports."""
    if callback._directory is None:
        return
    path = callback._directory / f"{callback.filename}_oom_rank{callback._rank}.pickle"
    cuda_history.dump_snapshot(path)
    if str(path) not in callback._oom_files:
        callback._oom_files.append(str(path))
