"""Where the time of each training step goes, live and at the end of fit, with advice on what to change."""

from __future__ import annotations

import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_perf._validation import check_bool, check_int
from lightning_perf.callbacks import _observer as obs
from lightning_perf.callbacks._model_hooks import add_batch_transform, remove_batch_transform
from lightning_perf.callbacks._undo import UndoOnExit
from lightning_perf.profiling import HostSyncRecorder, LoaderSettings, PhaseTimer
from lightning_perf.profiling import step_phases as sp
from lightning_perf.profiling.report import text_table
from lightning_perf.profiling.timer import HookCost, PhaseLedger

__all__ = ["BottleneckCallback"]

# Lightning's per-step hooks, silenced on the instance between timed steps (sampling): Lightning skips them then.
_STEP_HOOKS: tuple[str, ...] = ("on_train_batch_start", "on_before_zero_grad", "on_before_backward",
                                "on_after_backward", "on_before_optimizer_step", "on_train_batch_end")  # fmt: skip


class BottleneckCallback(UndoOnExit):
    """Time every phase of (sampled) training steps, show the split while training runs, and advise at fit end.

    Phases (:data:`~lightning_perf.profiling.advice.PHASES`, kept by :class:`~lightning_perf.profiling.step_phases.
    StepPhases`): ``data`` (from the end of a step until Lightning moves the next batch: the DataLoader, the user's
    ``on_before_batch_transfer``, Lightning's bookkeeping), ``transfer`` (through ``on_after_batch_transfer``),
    ``forward`` (``training_step``), ``backward``, ``optimizer`` (``zero_grad`` and ``step()``; forward and backward
    inside ``optimizer.step(closure)`` are not the optimizer's) and ``other`` (the rest). Validation is timed apart; a
    step whose wait spans validation or an epoch boundary is ``interrupted``, kept out of the shares. On CPU each phase
    boundary is one clock read into preallocated storage; on CUDA, events read back lazily (never a synchronization).
    After warm-up one step in ``sample_every`` is timed; in between the callback's Lightning hooks are silenced and an
    optimizer step post-hook counts steps (``on_train_batch_end`` with manual optimization, gradient accumulation or
    several optimizers). Every ``log_every_n_steps`` steps (at the next timed step) the last timed steps' shares and
    throughput go to the loggers (``bottleneck/<phase>``, ``bottleneck/step_s``, ``bottleneck/samples_per_s``) and,
    with ``progress_bar=True``, the progress bar. The last warm-up steps are checked for host-device synchronizations
    (:class:`~lightning_perf.profiling.HostSyncRecorder`). At the end of fit, on rank zero: the phase table,
    throughput, the callback's own cost and :func:`~lightning_perf.profiling.recommend`'s advice, in the log;
    ``<filename>.json`` (also :attr:`report`, with ``sampling``: steps timed and run) and, with ``plot=True``,
    ``<filename>.png`` in ``dirpath``, each announced; an earlier run's files are kept (``<filename>-2.*``) unless
    ``overwrite=True``. Under DDP the figures are summarized across ranks. A pickled copy keeps the settings and
    :attr:`report`. Own cost (``overhead``, :class:`~lightning_perf.profiling.timer.HookCost`): every call counted, one
    timed step in 17 timed, Lightning's dispatch timed at fit start; averaged over all steps run, timed or not.

    Args:
        warmup_steps: leading steps reported apart as warm-up (compilation, autotuning, allocator growth); all timed.
        log_every_n_steps: how often to log live figures; ``None`` takes the Trainer's ``log_every_n_steps``.
        progress_bar: also show the shares and throughput in the progress bar.
        sync_check_steps: how many of the last warm-up steps are checked for host-device synchronizations (0: none;
            at most ``warmup_steps``, so the check never slows a measured step).
        thresholds: share of the step above which a phase is flagged, by phase (``data``, ``transfer``,
            ``optimizer``, ``other``); defaults in :data:`~lightning_perf.profiling.advice.DEFAULT_THRESHOLDS`.
        dirpath: directory of the reports; ``None``: the Trainer's ``log_dir`` (else its ``default_root_dir``).
        filename: file name (without extension) of the reports.
        plot: draw the PNG chart (opt-in: it costs more than the rest of the report; needs matplotlib, else a note).
        verbose: print the table and the recommendations at the end of fit.
        overwrite: write over an earlier run's reports of the same ``filename`` instead of numbering this run's.
        sample_every: after warm-up, time one step in this many (1: every step, for per-step detail). The default, 32,
            keeps the mean cost near 0.25% of a 2 ms step (~100 us per timed step, 1-2 us on the others).

    Raises:
        ValueError: for a negative step count or ``sample_every < 1``, ``sync_check_steps > warmup_steps``, a
            threshold outside (0, 1), an unknown phase name, or a file name with a directory in it.
        TypeError: if ``thresholds`` is not a mapping, ``dirpath`` not a path, or ``progress_bar``, ``plot``,
            ``verbose`` or ``overwrite`` not a bool.

    Example::

        trainer = Trainer(callbacks=[BottleneckCallback(progress_bar=True)])
        trainer.fit(model, datamodule=data)
        print(trainer.callbacks[0].report["recommendations"])
    """

    # The phases' clock (CPU), replaceable in tests; the callback's own cost is always read from the real clock.
    _clock = staticmethod(time.perf_counter_ns)

    def __init__(
        self,
        warmup_steps: int = 5,
        log_every_n_steps: int | None = None,
        progress_bar: bool = False,
        sync_check_steps: int = 2,
        thresholds: Mapping[str, float] | None = None,
        dirpath: str | None = None,
        filename: str = "bottleneck",
        plot: bool = False,
        verbose: bool = True,
        overwrite: bool = False,
        sample_every: int = 32,
    ) -> None:
        name = type(self).__name__
        self.warmup_steps: int = check_int(name, "warmup_steps", warmup_steps, 0)
        self.log_every_n_steps: int | None = check_int(name, "log_every_n_steps", log_every_n_steps, 1, True)
        self.sync_check_steps: int = check_int(name, "sync_check_steps", sync_check_steps, 0)
        self.sample_every: int = check_int(name, "sample_every", sample_every, 1)
        self.thresholds = sp.check_settings(name, warmup_steps, sync_check_steps, thresholds)
        self.dirpath = obs.check_dirpath(name, dirpath)
        self.filename = obs.check_filename(name, filename)
        self.progress_bar = check_bool(name, "progress_bar", progress_bar)
        self.plot = check_bool(name, "plot", plot)
        self.verbose = check_bool(name, "verbose", verbose)
        self.overwrite = check_bool(name, "overwrite", overwrite)
        self.report: dict[str, Any] | None = None
        self._handles: list[RemovableHandle] = []
        self._reset()

    def _reset(self) -> None:
        self._phases: sp.StepPhases | None = None
        self._loader: LoaderSettings | None = None
        self._manual, self._last_logged, self._fit_start_ns, self._every = False, 0, 0, 0
        self._trainer: pl.Trainer | None = None
        self._counted = -2
        self._quiet, self._counts = _STEP_HOOKS, True  # hooks silenced between timed steps; the post-hook counts

    def __getstate__(self) -> dict[str, Any]:
        # A copy (spawn, deepcopy) holds settings and report, not the run: CUDA events, optimizers' and silenced hooks.
        state = {k: v for k, v in self.__dict__.items() if k not in _STEP_HOOKS}
        return {**state, "_phases": None, "_loader": None, "_handles": [], "_trainer": None}

    # Chained onto the module's batch-transfer hooks (`setup`), which run in every stage: they act on training only.
    def _before_transfer(self, batch: Any) -> Any:
        self._enter("transfer", only_from="data")  # the wait for the batch ends
        return batch

    def _after_transfer(self, batch: Any) -> Any:
        self._enter(None, only_from="transfer")
        return batch

    def _after_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        phases = self._phases
        step = self._trainer.global_step if self._trainer is not None else -1  # once a step: a subclass's step()
        if step == self._counted:  # calling super().step() runs torch's post-hooks at both levels
            if phases is not None:
                phases.cost.end(phases.cost.begin())  # counted as a call, nothing else
            return
        self._counted = step
        if phases is not None and self._counts and phases.quiet_call():  # a skipped step ends: count it
            if phases.sampler.count():  # the next step is timed: its wait for data starts at this one's end
                obs.silence_hooks(self, self._quiet, False)
            return
        self._enter("forward" if self._manual else None, only_from="optimizer")

    def _enter(self, phase: str | None, only_from: str | None = None) -> None:
        """A hook inside the step (``only_from``: only while that phase runs): switch to ``phase`` (one clock read).
        Every call is counted in ``phases.cost``, and timed end to end on its timed steps."""
        if (phases := self._phases) is None or phases.quiet_call():  # a skipped step: the model's hooks run anyway
            return
        entry = phases.cost.begin()
        if phases.step_open and (only_from is None or phases.current == only_from):
            phases.switch(phase)
        phases.cost.end(entry)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            add_batch_transform(pl_module, self._before_transfer, hook="on_before_batch_transfer")
            add_batch_transform(pl_module, self._after_transfer, hook="on_after_batch_transfer")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self.report = None
        device, clock = pl_module.device, self._clock
        recorder = HostSyncRecorder(device) if self.sync_check_steps else None
        cpu = device.type == "cpu"
        self._phases = sp.StepPhases(
            PhaseLedger(sp.MEASURED, self.warmup_steps, clock) if cpu else PhaseTimer(device, self.warmup_steps, clock),
            validation=PhaseTimer(device, clock=clock),
            syncs=sp.SyncCheck(recorder, self.warmup_steps - self.sync_check_steps, self.warmup_steps),
            cost=HookCost(first=self.warmup_steps, dispatch_ns=obs.hook_dispatch_ns(trainer)),
            sampler=sp.StepSampler(self.sample_every, self.warmup_steps),
        )
        self._every = obs.live_interval(trainer, self.log_every_n_steps, self.progress_bar)
        self._manual = not pl_module.automatic_optimization
        # The post-hook counts steps only where the optimizer steps once per batch; else batch end stays live.
        self._counts = not self._manual and trainer.accumulate_grad_batches == 1 and len(trainer.optimizers) == 1
        self._quiet = _STEP_HOOKS if self._counts else _STEP_HOOKS[:-1]
        self._trainer = trainer
        self._handles.extend(opt.register_step_post_hook(self._after_optimizer_step) for opt in trainer.optimizers)
        self._fit_start_ns = time.perf_counter_ns()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loader = LoaderSettings.from_dataloader(sp.first_dataloader(trainer.train_dataloader))

    def _undo(self, pl_module: pl.LightningModule) -> None:
        if self._phases is not None:
            self._phases.syncs.stop()
        obs.silence_hooks(self, _STEP_HOOKS, False)
        remove_batch_transform(pl_module, self._before_transfer, hook="on_before_batch_transfer")
        remove_batch_transform(pl_module, self._after_transfer, hook="on_after_batch_transfer")
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._phases is not None:
            self._phases.begin_epoch()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        phases = self._phases
        if phases is None:
            return
        entry = phases.cost.begin()
        heavy = bool(self._every) and trainer.global_step + 1 - self._last_logged >= self._every  # logs at its end:
        phases.begin_step("forward", pl_module, heavy=heavy)  # its hooks timed whole
        phases.cost.end(entry)

    @override
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        self._enter("optimizer")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._enter("backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Manual optimization: back in the user's training_step. Automatic: Lightning returns to the optimizer.
        self._enter("forward" if self._manual else None)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._enter("optimizer")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        phases = self._phases
        if phases is None:
            return
        entry, sampler = phases.cost.begin(), phases.sampler
        if not sampler.live:  # a skipped step, counted here (no post-hook counter)
            if not sampler.count():
                phases.cost.end(entry)
                return
            obs.silence_hooks(self, self._quiet, False)
        ended = phases.finish_batch(sp.batch_size_of(batch))  # and the wait for the next batch begins, if timed
        if ended and self._every and trainer.global_step - self._last_logged >= self._every:  # 0: nothing to log to
            self._last_logged = trainer.global_step
            metrics, bar = sp.live_figures(phases, -(-self._every // sampler.every))  # the timed steps of the interval
            obs.log_metrics(trainer, {f"bottleneck/{name}": value for name, value in metrics.items()})
            for key, value in bar.items() if self.progress_bar else ():
                pl_module.log(key, value, prog_bar=True, logger=False)
        if not sampler.live:
            obs.silence_hooks(self, self._quiet, True)
        phases.cost.end(entry)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._phases is not None and not trainer.sanity_checking and trainer.state.fn == "fit":
            self._phases.pause()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._phases is not None:
            self._phases.resume()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._phases is not None:
            self._phases.interrupt()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        phases = self._phases
        if phases is None:
            return
        phases.interrupt()
        fit_s, device = (time.perf_counter_ns() - self._fit_start_ns) / 1e9, phases.timer.device
        report = {
            **obs.fit_header(type(self).__name__, trainer, pl_module, device),
            **sp.step_report(phases, fit_s, self._loader, self.thresholds, **obs.run_facts(trainer, pl_module, device)),
        }
        ranks = obs.across_ranks(trainer, pl_module, sp.rank_values(report))
        if ranks is not None:
            report["ranks"] = ranks
            report["throughput"]["world_samples_per_s"] = ranks["samples_per_s"]["mean"] * trainer.world_size
        directory = obs.report_dir(trainer, self.dirpath)  # on every rank: log_dir broadcasts
        self.report = report
        if trainer.is_global_zero:
            stem = obs.report_stem(directory, self.filename, (".json", ".png"), self.overwrite)
            steady = report["per_step"]["records"]
            draw = partial(sp.plot_phases, steady) if self.plot and steady else None
            show = self._print if self.verbose else None
            obs.write_reports(type(self).__name__, report, directory, stem, draw, show, plot=self.plot)

    def _print(self, report: dict[str, Any]) -> None:
        # A plain-text table in the log (rendering a rich one costs tens of milliseconds).
        rank_zero_info("\n".join([text_table(*sp.phase_table(report, type(self).__name__)), *sp.report_lines(report)]))
