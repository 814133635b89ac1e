"""What the observer callbacks (``BottleneckCallback``, ``MemoryProfilerCallback``) share: argument checks, where
reports go and under which name (never over an earlier run's files unless asked), the announcement of every file
written, logging to the Trainer's loggers, the cross-rank summary at fit end, and optional charts."""

from __future__ import annotations

import glob
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_perf._device import has_fast_cpu_bf16, is_sm_at_least, supports_tf32
from lightning_perf._imports import install_hint, is_available
from lightning_perf._validation import check_instance
from lightning_perf.profiling.machine import usable_cpu_count
from lightning_perf.profiling.report import write_json


def check_dirpath(owner: str, dirpath: Any) -> str | None:
    """Return ``dirpath`` as a string (None stays None), else raise ``TypeError``."""
    check_instance(owner, "dirpath", dirpath, (type(None), str, os.PathLike), "a path or None")
    return None if dirpath is None else os.fspath(dirpath)


def report_dir(trainer: pl.Trainer, dirpath: str | None) -> Path:
    """Where reports go: ``dirpath``, else the Trainer's ``log_dir`` (its ``default_root_dir`` without a logger).

    Call it on every rank: ``Trainer.log_dir`` broadcasts rank zero's value.
    """
    if dirpath is not None:
        return Path(dirpath)
    return Path(trainer.log_dir or trainer.default_root_dir)


def report_stem(directory: Path, filename: str, patterns: Sequence[str], overwrite: bool) -> str:
    """The stem of this run's report files, so that an earlier run's reports are never overwritten silently.

    ``filename`` itself when no file ``<filename><pattern>`` exists in ``directory`` (``patterns`` are suffixes, glob
    wildcards allowed, e.g. ``".json"``, ``"_oom_rank*.pickle"``) or when ``overwrite`` is True; otherwise the first
    free run number: ``<filename>-2``, ``<filename>-3``, ... Call it once per fit on every rank before writing
    anything, so all files of one run share the stem.
    """
    if overwrite:
        return filename

    def taken(stem: str) -> bool:
        escaped = glob.escape(str(directory / stem))
        return any(glob.glob(escaped + pattern) for pattern in patterns)

    stem, run = filename, 1
    while taken(stem):
        run += 1
        stem = f"{filename}-{run}"
    return stem


def announce_files(owner: str, paths: Iterable[str | os.PathLike | None]) -> list[str]:
    """Say on rank zero, one line each, which report files this run wrote (None entries are skipped).

    Returns:
        The announced paths, as strings.
    """
    written = [os.fspath(p) for p in paths if p is not None]
    for path in written:
        rank_zero_info(f"{owner}: wrote {path}")
    return written


def live_interval(trainer: pl.Trainer, every: int | None, progress_bar: bool = False) -> int:
    """Steps between live figures: ``every``, else the Trainer's ``log_every_n_steps``; 0 with nowhere to show them
    (no logger, no progress bar), so a step spends nothing on them."""
    interval = every or trainer.log_every_n_steps  # type: ignore[attr-defined]
    return interval if trainer.loggers or progress_bar else 0


def log_metrics(trainer: pl.Trainer, metrics: Mapping[str, float], step: int | None = None) -> None:
    """Send ``metrics`` to every logger of the Trainer at ``step`` (its current step), from rank zero only."""
    if not trainer.is_global_zero:
        return
    clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
    if not clean:
        return
    for logger in trainer.loggers:
        logger.log_metrics(clean, step=trainer.global_step if step is None else step)


def across_ranks(
    trainer: pl.Trainer, pl_module: pl.LightningModule, values: Mapping[str, float]
) -> dict[str, dict[str, float]] | None:
    """Min, mean and max of each value over the ranks; None with a single process.

    One ``all_gather`` of a small tensor: call it on every rank, and only at the end of a run, never per step.
    NaN (a rank without the figure) is left out of that figure's summary.
    """
    if trainer.world_size <= 1:
        return None
    keys = list(values)
    local = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=pl_module.device)
    gathered = trainer.strategy.all_gather(local).reshape(-1, len(keys)).cpu()
    summary: dict[str, dict[str, float]] = {}
    for index, key in enumerate(keys):
        column = [float(v) for v in gathered[:, index].tolist() if not math.isnan(float(v))]
        if not column:
            summary[key] = {"min": math.nan, "mean": math.nan, "max": math.nan}
            continue
        summary[key] = {"min": min(column), "mean": sum(column) / len(column), "max": max(column)}
    return summary


def draw_chart(draw: Callable[[Path], Path], path: Path, owner: str) -> tuple[str | None, str | None]:
    """Draw a PNG with ``draw(path)`` if matplotlib is installed; return ``(path, None)`` or ``(None, note)``.

    Without matplotlib the note says how to get charts, and is shown once on rank zero instead of failing the run.
    """
    if not is_available("matplotlib"):
        note = f"{owner}: no chart was drawn. " + install_hint("matplotlib")
        rank_zero_info(note)
        return None, note
    return str(draw(path)), None


def write_reports(
    owner: str,
    report: dict[str, Any],
    directory: Path,
    stem: str,
    draw: Callable[[Path], Path] | None,
    show: Callable[[dict[str, Any]], None] | None,
    more_files: Iterable[str | None] = (),
    plot: bool = True,
) -> None:
    """On rank zero at fit end: the chart ``<stem>.png`` (``draw``; None: none), the JSON report ``<stem>.json`` (both
    paths and the chart's note kept in ``report``; without ``plot`` the note says charts are opt-in),
    ``show(report)`` (None: silent), then every file announced."""
    report["plot"], report["plot_note"] = None, None if plot else chart_opt_in_note(owner, stem)
    if draw is not None:
        report["plot"], report["plot_note"] = draw_chart(draw, directory / f"{stem}.png", owner)
    report["json"] = str(directory / f"{stem}.json")
    write_json(report, directory / f"{stem}.json")
    if show is not None:
        show(report)
    announce_files(owner, [report["json"], report["plot"], *more_files])


def class_names(trainer: pl.Trainer) -> frozenset[str]:
    """Names of the classes of the Trainer's callbacks (to tell which of this library's are already in use)."""
    return frozenset(type(callback).__name__ for callback in trainer.callbacks)  # type: ignore[attr-defined]


def fit_header(owner: str, trainer: pl.Trainer, pl_module: pl.LightningModule, device: torch.device) -> dict[str, Any]:
    """The first keys of an observer's report: who wrote it, the device and the Trainer's settings."""
    return {
        "callback": owner,
        "device": str(device),
        "world_size": trainer.world_size,
        "precision": str(trainer.precision),
        "automatic_optimization": pl_module.automatic_optimization,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
    }


def run_facts(trainer: pl.Trainer, pl_module: pl.LightningModule, device: torch.device) -> dict[str, Any]:
    """What the advice (:class:`~lightning_perf.profiling.StepBreakdown`) knows of a run besides its step times: the
    device, the Trainer's settings, the model, its optimizers and the other callbacks."""
    batches = trainer.num_training_batches
    return {
        "device_type": device.type,
        "cpu_count": usable_cpu_count(),
        "processes_per_node": max(1, int(trainer.num_devices)),
        "steps_per_epoch": float(batches) if math.isfinite(batches) else None,
        "precision": str(trainer.precision),
        "has_convolutions": any(isinstance(m, (nn.Conv2d, nn.Conv3d)) for m in pl_module.modules()),
        "optimizers_fused": bool(trainer.optimizers)
        and all(group.get("fused") is True for opt in trainer.optimizers for group in opt.param_groups),
        "fast_bf16": is_sm_at_least(8, 0, device) if device.type == "cuda" else has_fast_cpu_bf16(),
        "tf32_capable": supports_tf32(device),
        "tf32_enabled": torch.get_float32_matmul_precision() != "highest",
        "active_callbacks": class_names(trainer),
    }


def steps_once_per_batch(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether one optimizer steps once per batch (automatic optimization, no accumulation): then an optimizer
    post-hook can count the steps in place of Lightning's per-batch hooks (which an observer silences meanwhile)."""
    one = len(trainer.optimizers) == 1 and trainer.accumulate_grad_batches == 1  # type: ignore[attr-defined]
    return one and pl_module.automatic_optimization


def hook_dispatch_ns(trainer: pl.Trainer, calls: int = 200, rounds: int = 5) -> float:
    """What Lightning spends to call one hook of one callback, in nanoseconds: the body of its callback loop
    (``lightning.pytorch.trainer.call._call_callback_hooks``: the lookup, the profiler's context and its name, the
    call) timed on an empty hook, the median of ``rounds`` rounds of ``calls`` calls (about a millisecond, once per
    fit). The profiler is a pass-through one: a user's profiler would record these calls, and its own cost per hook
    is its to report."""
    empty, profiler, per_call = Callback(), PassThroughProfiler(), []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn = empty.on_after_backward
            if callable(fn):
                with profiler.profile(f"[Callback]{empty.state_key}.on_after_backward"):
                    fn(trainer, trainer.lightning_module)
        per_call.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(per_call)


def silence_hooks(callback: Callback, names: Iterable[str], silent: bool) -> None:
    """Silence (or give back) hooks of ``callback``: a silenced hook is ``None`` on the instance, and Lightning skips a
    callback's hook that is not callable (``lightning.pytorch.trainer.call._call_callback_hooks``: ``if callable(fn)``),
    so it costs not even Lightning's dispatch (the profiler's context, the call: about a microsecond, per hook and
    step). Giving back removes the instance attribute, so the class's method is found again. A copy must not carry
    the ``None`` entries (leave them out of ``__getstate__``)."""
    for name in names:
        if silent:
            setattr(callback, name, None)
        else:
            callback.__dict__.pop(name, None)


def chart_opt_in_note(owner: str, stem: str) -> str:
    """What the report says when no chart was asked for: charts are opt-in because drawing one costs far more than
    the rest of the report."""
    return (
        f"{owner}: no chart drawn (opt-in: drawing and saving a PNG costs a few hundred milliseconds at the end of "
        f"fit); pass plot=True for {stem}.png."
    )


class DispatchSamples:
    """Lightning's dispatch of one hook (the body of :func:`hook_dispatch_ns`'s loop, once), timed inside the training
    loop where an observer's hooks really run: the step's work has evicted the caches, and a dispatch costs there a
    few times what the same loop costs warm at fit start. The first ``size`` calls of :meth:`take` time one, then one
    call in 8; the last ``size`` readings are kept, and their median bills each call."""

    _EMPTY: list[tuple[Callback, PassThroughProfiler]] = []  # an empty callback and a profiler, made once

    def __init__(self, size: int = 64) -> None:
        self.size, self.count, self.calls, self.ns = size, 0, 0, [0.0] * size

    def take(self, trainer: pl.Trainer) -> None:
        """Time one dispatch now (see above): an empty hook through Lightning's callback loop body."""
        self.calls += 1
        if self.count >= self.size and self.calls % 8:
            return
        if not self._EMPTY:
            self._EMPTY.append((Callback(), PassThroughProfiler()))
        empty, profiler = self._EMPTY[0]
        start = time.perf_counter_ns()
        fn = empty.on_after_backward
        if callable(fn):
            with profiler.profile(f"[Callback]{empty.state_key}.on_after_backward"):
                fn(trainer, trainer.lightning_module)
        self.ns[self.count % self.size] = time.perf_counter_ns() - start
        self.count += 1

    def median(self, default: float) -> float:
        """The median of the readings kept, ``default`` without any."""
        return statistics.median(self.ns[: min(self.count, self.size)]) if self.count else default
