"""Memory at fixed points of the training step, every few steps, with leak detection and CUDA OOM snapshots."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_perf._validation import check_bool, check_file_stem, check_int
from lightning_perf._warnings import MeasurementWarning, NoEffectWarning, warn_once
from lightning_perf.callbacks import _observer as obs
from lightning_perf.callbacks._undo import UndoOnExit
from lightning_perf.profiling import MemoryProbe, cuda_history
from lightning_perf.profiling import memory_steps as ms
from lightning_perf.profiling.leaks import MIN_LEAK_SAMPLES
from lightning_perf.profiling.memory_steps import POINTS, MemorySteps

__all__ = ["POINTS", "MemoryProfilerCallback"]

_REPORT_PATTERNS = (".json", ".png", "_history_rank*.pickle", "_oom_rank*.pickle")
_INSIDE_HOOKS = ("on_before_zero_grad", "on_before_backward", "on_after_backward")  # the points inside the step
_QUIET_HOOKS = (*_INSIDE_HOOKS, "on_train_batch_end", "on_before_optimizer_step", "on_train_batch_start")


class MemoryProfilerCallback(UndoOnExit):
    """Sample memory at named points of the training step every ``every_n_steps`` steps, and catch leaks.

    Points (``points``, default all, see :data:`POINTS`):

    - ``after_data``: the batch is on the device (``on_train_batch_start``); the peak restarts from there;
    - ``after_forward``: the loss is computed (the first ``on_before_zero_grad`` or ``on_before_backward``);
    - ``after_backward``: gradients are computed (the last ``on_after_backward`` of the step);
    - ``after_optimizer``: the end of the step (``on_train_batch_end``).

    Each sample is a :class:`~lightning_perf.profiling.MemorySample` (CUDA: the caching allocator's allocated, reserved
    and peak bytes; CPU: glibc ``mallinfo2``'s bytes in use, the resident set and its peak).

    Leak detection, by significance and with no absolute bound in bytes, on any epoch's steps
    (:class:`~lightning_perf.profiling.memory_steps.MemorySteps` says what is read how often): on CUDA the allocator's
    counter at every point of every step; on CPU the resident set (``/proc/self/statm``) at one step in 4 (sparser on
    long runs), screened, and a screen that suggests growth confirmed by reading memory in use (``mallinfo2``) at every
    point of the next ``leak_min_samples`` steps. A leak present from the start is reported near step
    ``warmup_steps + 74 + leak_min_samples + 1`` (155 by default) on CPU, step 100 on CUDA. A
    :class:`~lightning_perf.MeasurementWarning` containing "leak" names the phase that grows and its rate in KiB/step
    with its 95% interval, once per fit. ``leak_threshold`` (bytes per step) is an optional extra bound, off by default.

    Its own cost, on CPU: a step that reads nothing runs no hook of it, only an optimizer post-hook that counts down
    (a compare and a decrement: no clock read, no call) and, one step in 4 (sparser on long runs), reads the resident
    set, or, at the logging interval, the figures for the loggers (the batch's start hook instead, where the optimizer
    does not step once a batch). Self-report (``overhead``, :class:`~lightning_perf.profiling.timer.HookCost`) from step
    50: reading steps timed whole, quiet steps that read timed whole, the others billed as counters or flag checks,
    Lightning's dispatch timed.

    On CUDA, with ``record_history=True``, every allocation is recorded with its stack from the start of fit, and the
    history is written at the end of fit as ``<filename>_history_rank<R>.pickle``; with ``oom_snapshot=True`` a
    snapshot ``<filename>_oom_rank<R>.pickle`` is written when the allocator runs out of memory, and the
    ``OutOfMemoryError`` still propagates. Both open in https://pytorch.org/memory_viz. Recording stops at teardown.

    At the end of fit, on rank zero: a table ``snapshot | time | allocated | reserved | peak | trend`` in the log, a
    JSON report ``<filename>.json`` (also :attr:`report`) and, with ``plot=True`` and matplotlib, ``<filename>.png``
    in ``dirpath``, each announced; an earlier run's files are kept (``<filename>-2.*``...) unless ``overwrite=True``.
    The memory figures go to the loggers every ``log_every_n_steps`` (``memory/peak``, the highest since the last
    snapshot, and ``memory/reserved``; ``memory/allocated`` on CUDA and on snapshot steps); under DDP the peaks and
    growth rates are summarized across ranks at fit end.

    Args:
        every_n_steps: take a full snapshot (allocated, reserved, peak and time at each point) of one step in this many
            (default 500: on CPU a snapshot, a heap walk and a /proc read per point, costs 1-1.5 ms in a training run).
            The leak watch reads on its own schedule regardless.
        points: which points to sample (names from :data:`POINTS`); ``None`` for all.
        warmup_steps: leading steps left out of the leak trend, at most (a shorter first epoch is left out instead).
        leak_threshold: optional extra bound: a point is reported as leaking only if it also grows by more than this
            many bytes per step. ``None`` (default): the verdict rests on significance and the noise floor alone.
        leak_min_samples: readings after warm-up needed before a point can be reported as leaking (at least 18); on
            CPU also the length of a confirmation.
        log_every_n_steps: how often to send memory figures to the loggers; ``None`` takes the Trainer's.
        record_history: on CUDA, record allocation history and write it at the end of fit.
        history_max_entries: how many allocation events the history keeps (the latest).
        oom_snapshot: on CUDA, write an allocator snapshot when memory runs out.
        dirpath: directory of the reports; ``None``: the Trainer's ``log_dir`` (else its ``default_root_dir``).
        filename: file name (without extension) of the reports.
        plot: draw the PNG chart (opt-in: it costs more than the rest of the report; needs matplotlib, else a note).
        verbose: print the table at the end of fit.
        overwrite: write over an earlier run's reports of the same ``filename`` instead of numbering this run's.

    Raises:
        ValueError: for an interval below 1, a negative ``warmup_steps``, an unknown point name, a ``leak_threshold``
            that is not a positive finite number, ``leak_min_samples`` below 18, or a file name with a directory.
        TypeError: if ``points`` is not a sequence of names, ``dirpath`` not a path, or a flag (``record_history``,
            ``oom_snapshot``, ``plot``, ``verbose``, ``overwrite``) not a bool.

    Example::

        trainer = Trainer(callbacks=[MemoryProfilerCallback(every_n_steps=5)])
        trainer.fit(model, datamodule=data)  # warns "... leak ..." if memory grows steadily from step to step
    """

    def __init__(
        self,
        every_n_steps: int = 500,
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
        plot: bool = False,
        verbose: bool = True,
        overwrite: bool = False,
    ) -> None:
        name = type(self).__name__
        self.every_n_steps: int = check_int(name, "every_n_steps", every_n_steps, 1)
        self.warmup_steps: int = check_int(name, "warmup_steps", warmup_steps, 0)
        self.leak_min_samples: int = check_int(name, "leak_min_samples", leak_min_samples, MIN_LEAK_SAMPLES)
        self.log_every_n_steps: int | None = check_int(name, "log_every_n_steps", log_every_n_steps, 1, True)
        self.history_max_entries: int = check_int(name, "history_max_entries", history_max_entries, 1)
        self.leak_threshold = ms.check_leak_threshold(name, leak_threshold)
        self.points = ms.check_points(name, points)
        self.record_history = check_bool(name, "record_history", record_history)
        self.oom_snapshot = check_bool(name, "oom_snapshot", oom_snapshot)
        self.dirpath = obs.check_dirpath(name, dirpath)
        self.filename = check_file_stem(name, "filename", filename)
        self.plot = check_bool(name, "plot", plot)
        self.verbose = check_bool(name, "verbose", verbose)
        self.overwrite = check_bool(name, "overwrite", overwrite)
        self.report: dict[str, Any] | None = None
        self._memory: MemorySteps | None = None
        self._cuda: cuda_history.CudaRecording | None = None  # (CUDA) history and OOM snapshots
        self._silenced: int | None = None  # 0 no hook silenced, 1 those inside the step, 2 and the end (None: CUDA)
        self._epoch, self._every = 0, 0
        self._trainer: pl.Trainer | None = None  # (CPU) for the quiet steps' logging, from fit start to the undo
        # (CPU) steps left to count down, and the countdown's length; Lightning's dispatch, timed in the loop
        self._quiet, self._skipped, self._dispatch = 0, 0, obs.DispatchSamples()
        # (CPU, one optimizer stepping once a batch) the countdown runs in its post-hook; Lightning's step counter
        self._done: Any = None
        self._counted, self._handles = -1, list[RemovableHandle]()  # the step count last counted down
        self._stride = 1 << 62  # (CPU) the leak screen reads one step in this many
        # (CPU) the countdown's value down to which a quiet step only counts; the last quiet step with more to do
        self._calm, self._slow_at = 1, -1

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.report = self._memory = self._cuda = self._done = None
        self._epoch = trainer.current_epoch
        self._quiet, self._skipped, self._dispatch = 0, 0, obs.DispatchSamples()
        self._every = obs.live_interval(trainer, self.log_every_n_steps)  # 0: no logger to send figures to
        self._trainer = trainer  # (CPU) the quiet steps' counter logs the cheap figures: no hook is woken for them
        device, name = pl_module.device, type(self).__name__
        if device.type not in ("cpu", "cuda"):
            msg = f"`{name}` measures CPU and CUDA memory; the run is on {device.type}, so nothing is sampled."
            return warn_once(msg, NoEffectWarning)
        steps = (self.points, self.every_n_steps, self.warmup_steps, self.leak_threshold, self.leak_min_samples)
        self._memory = MemorySteps(MemoryProbe(device), *steps, log_every_n_steps=self._every)
        self._memory.cost.dispatch_ns = obs.hook_dispatch_ns(trainer)
        # Nothing is read before the optimizer step: that hook stays silent all fit; on CPU the others between readings.
        self._silenced = 0 if device.type == "cpu" else None
        obs.silence_hooks(self, ("on_before_optimizer_step",), True)
        if device.type == "cpu" and obs.steps_once_per_batch(trainer, pl_module):  # countdown in the post-hook
            self._done = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
            self._handles = [trainer.optimizers[0].register_step_post_hook(self._after_optimizer_step)]
        self._memory.cheap_at_start = self._done is None  # else the post-hook reads the step's end
        self._stride = self._memory.cheap.stride if self._memory.cheap is not None else 1 << 62
        directory = obs.report_dir(trainer, self.dirpath)  # on every rank: log_dir broadcasts
        stem = obs.report_stem(directory, self.filename, _REPORT_PATTERNS, self.overwrite)
        self._cuda = cuda_history.CudaRecording(directory, stem, trainer.global_rank)
        if device.type == "cuda":
            self._cuda.start(self.history_max_entries if self.record_history else None, self.oom_snapshot)
        elif self.record_history:
            msg = f"`{name}(record_history=True)` records CUDA allocations only; the run is on {device.type}."
            warn_once(msg + " No history is written.", NoEffectWarning)

    def _after_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        # A quiet step, counted once (a step() calling super().step() runs post-hooks twice). Most only count down
        # (billed in bulk, as flag checks): no clock, no call; from `_calm` on, one logs, reads or ends the countdown.
        if (quiet := self._quiet) and (done := self._done.completed) != self._counted:
            self._counted = done
            if quiet > self._calm:
                self._quiet = quiet - 1
            elif (memory := self._memory) is not None:
                entry = time.perf_counter_ns()
                steady, reads = self._count_down(memory)
                if not self._quiet:  # the last step of the countdown: wake the next one's start
                    obs.silence_hooks(self, ("on_train_batch_start",), False)
                memory.cost.quiet_step(entry, steady, reads)

    def _count_down(self, memory: MemorySteps) -> tuple[bool, bool]:
        """A quiet step with something to do: counted down, the loggers' figures or the resident set read where due
        (when that opens a confirmation, the countdown ends). Returns whether the step is past the observer's warm-up,
        and whether it read."""
        quiet, reads = self._quiet, False
        index = memory.step_index + self._skipped - quiet
        self._bill(memory, index)
        if self._every and not (index + 1) % self._every and self._trainer is not None:  # the loggers' figures
            obs.log_metrics(self._trainer, memory.log_figures(None), index + 1)  # the step count once it ends
            reads = True
        if not index % self._stride:
            reads, opened = True, memory.read_cheap(index, self._epoch)
            self._stride = memory.cheap.stride if memory.cheap is not None else 1 << 62  # doubles on long runs
            if opened:  # the steps run quietly, this one included
                self._skipped, self._quiet = self._skipped - quiet + 1, 0
                return index >= memory.cost.first, True
        self._quiet = quiet - 1
        self._plan(memory)
        return index >= memory.cost.first, reads

    def _plan(self, memory: MemorySteps) -> None:
        """Set ``_calm``: the countdown's value down to which the quiet steps have nothing to do but count (the next
        log or read, else the countdown's last step, takes the slow path)."""
        end = memory.step_index + self._skipped  # the countdown's end; the next quiet step is end - _quiet
        index = end - self._quiet
        due = min(index + (-index) % self._stride, index + (-index - 1) % self._every if self._every else end)
        self._calm = max(1, end - due)

    def _bill(self, memory: MemorySteps, index: int) -> None:
        """Bill the steady quiet steps counted on the fast path since the last slow one, up to step ``index``."""
        memory.cost.quiet_calls += max(0, index - max(self._slow_at + 1, memory.cost.first))
        self._slow_at = index

    def _undo(self, pl_module: pl.LightningModule) -> None:
        """Stop the OOM listener and the history recording, give the hooks back (teardown, and on an exception)."""
        obs.silence_hooks(self, _QUIET_HOOKS, False)
        self._silenced, self._trainer = None, None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._cuda is not None:
            self._cuda.stop()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._cuda is not None and self._cuda.oom_files and isinstance(exception, torch.OutOfMemoryError):
            where = f"snapshot written to {self._cuda.oom_files[-1]} (open it in https://pytorch.org/memory_viz)."
            rank_zero_info(f"{type(self).__name__}: out of memory; allocator {where}")
        super().on_exception(trainer, pl_module, exception)

    def __getstate__(self) -> dict[str, Any]:
        # The OOM listener and the history recording belong to this process's allocator, silenced hooks to the run.
        state = {k: v for k, v in self.__dict__.items() if k not in _QUIET_HOOKS}
        return {**state, "_cuda": None, "_silenced": None, "_quiet": 0, "_skipped": 0, "_done": None, "_handles": [],
                "_trainer": None}  # fmt: skip

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch = trainer.current_epoch

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if (memory := self._memory) is None:
            return
        if self._quiet:  # (CPU) a step that reads only its start: a countdown, the step's other hooks silenced
            entry = time.perf_counter_ns()
            return memory.cost.quiet_step(entry, *self._count_down(memory))
        memory.skip(self._skipped, counted=True)  # the steps the countdown let run, in bulk (each billed its read)
        self._skipped = 0
        memory.plan_step()  # whether the step reads anything, and how its hooks are timed
        entry = memory.cost.begin()
        memory.begin_step(self._epoch)
        if self._silenced is not None:  # (CPU) silence the hooks of the points the step does not read
            if memory.reading and memory.cost.steady:  # and time a hook's dispatch where the hooks run (billed)
                self._dispatch.take(trainer)
            self._silence(memory, 0 if memory.inside else 1 if memory.reading else 2, running=True)
        memory.cost.end(entry)

    def _silence(self, memory: MemorySteps, mode: int, running: bool = False) -> None:
        """Silence none of the step's hooks (``mode`` 0), those inside it (1), and its end (2: then count down; its
        start too where the post-hook counts, ``running`` when the step has not stepped its optimizer yet)."""
        if mode != self._silenced:
            obs.silence_hooks(self, _INSIDE_HOOKS, mode > 0)
            obs.silence_hooks(self, ("on_train_batch_end",), mode > 1)
            self._silenced = mode
        if mode > 1:
            self._quiet = self._skipped = memory.quiet_ahead()
            if self._done is not None:  # the post-hook counts down (the running step's too)
                self._quiet, self._counted = self._quiet + running, -1
                obs.silence_hooks(self, ("on_train_batch_start",), True)
            self._slow_at = memory.step_index + self._skipped - self._quiet - 1
            self._plan(memory)

    def _sample(self, point: str, overwrite: bool = False) -> None:
        """Every hook inside the step: read ``point`` if the step reads memory; counted and timed."""
        if (memory := self._memory) is not None:
            entry = memory.cost.begin()
            if memory.active:
                memory.sample(point, overwrite)
            memory.cost.end(entry)

    @override
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        self._sample("after_forward")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._sample("after_forward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sample("after_backward", overwrite=True)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (memory := self._memory) is None:
            return
        entry = memory.cost.begin()
        step = memory.end_step(self._epoch, time.perf_counter_ns())
        if memory.logging:
            obs.log_metrics(trainer, memory.log_figures(step))
        if memory.leak_check_due() and (leaking := memory.check_leaks(every_point=False)):
            warn_once(ms.leak_message(type(self).__name__, leaking), MeasurementWarning)
        if self._silenced is not None and memory.quiet_ahead():  # (CPU) the next step reads nothing
            self._silence(memory, 2)
        memory.cost.end(entry)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        memory, cuda = self._memory, self._cuda
        if memory is None or cuda is None:
            return
        if self._quiet:  # a countdown under way: its fast steps since the last slow one
            self._bill(memory, memory.step_index + self._skipped - self._quiet)
        memory.skip(self._skipped - self._quiet, counted=True)  # since the last reading step
        self._skipped = self._quiet
        memory.cost.dispatch_ns = self._dispatch.median(memory.cost.dispatch_ns)  # timed in the loop (CPU)
        if leaking := memory.check_leaks():
            warn_once(ms.leak_message(type(self).__name__, leaking), MeasurementWarning)
        history = cuda.dump_history()
        files = {"history": history, "oom_snapshots": list(cuda.oom_files)}
        report = {"callback": type(self).__name__, **memory.summary(), "files": files}
        if (ranks := obs.across_ranks(trainer, pl_module, ms.rank_values(report))) is not None:
            report["ranks"] = ranks
        self.report = report
        if trainer.is_global_zero:
            draw = memory.plot if self.plot and memory.samples else None
            show = (lambda r: rank_zero_info(ms.report_text(r, type(self).__name__))) if self.verbose else None
            more = [history, *cuda.oom_files]
            obs.write_reports(type(self).__name__, report, cuda.directory, cuda.stem, draw, show, more, plot=self.plot)
