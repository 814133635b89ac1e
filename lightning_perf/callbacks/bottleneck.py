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

from lightning_perf._validation import check_bool, check_file_stem, check_int
from lightning_perf.callbacks import _observer as obs
from lightning_perf.callbacks._model_hooks import add_batch_transform, remove_batch_transform
from lightning_perf.callbacks._undo import UndoOnExit
from lightning_perf.profiling import LoaderSettings
from lightning_perf.profiling import step_phases as sp
from lightning_perf.profiling.timer import HookCost

__all__ = ["BottleneckCallback"]

_now = time.perf_counter_ns

# Lightning's per-step hooks, silenced on the instance between timed steps (sampling): Lightning skips them then.
_STEP_HOOKS: tuple[str, ...] = ("on_train_batch_start", "on_before_zero_grad", "on_before_backward",
                                "on_after_backward", "on_before_optimizer_step", "on_train_batch_end")  # fmt: skip


class BottleneckCallback(UndoOnExit):
    """Time every phase of (sampled) training steps, show the split while training runs, and advise at fit end.

    Phases (:data:`~lightning_perf.profiling.advice.PHASES`, kept by :class:`~lightning_perf.profiling.step_phases.
    StepPhases`, the logic this file wires to Lightning's hooks): ``data`` (from a step's end until Lightning moves the
    next batch: the DataLoader, the user's ``on_before_batch_transfer``, Lightning's bookkeeping), ``transfer`` (through
    ``on_after_batch_transfer``), ``forward`` (``training_step``), ``backward``, ``optimizer`` (``zero_grad`` and
    ``step()``, without the forward and backward of a closure) and ``other``. Validation is timed apart; a step whose
    wait spans validation or an epoch boundary is ``interrupted``, kept out of the shares. On CPU a phase boundary is
    one clock read into preallocated storage; on CUDA, events read back late (never a sync). After warm-up every step is
    timed until ``min_timed_steps`` are, then one in ``sample_every``; in between the Lightning hooks are silenced and
    an optimizer step post-hook counts steps (``on_train_batch_end`` with manual optimization, gradient accumulation or
    several optimizers). Every ``log_every_n_steps`` steps (at the next timed step) the last timed steps' shares and
    throughput go to the loggers (``bottleneck/<phase>``, ``bottleneck/step_s``, ``bottleneck/samples_per_s``) and, with
    ``progress_bar=True``, the progress bar. The last warm-up steps are checked for host-device synchronizations. At the
    end of fit, on rank zero: the phase table, throughput, the callback's own cost and :func:`~lightning_perf.
    profiling.recommend`'s advice, in the log; ``<filename>.json`` (also :attr:`report`) and, with ``plot=True``,
    ``<filename>.png`` in ``dirpath``, each announced; an earlier run's files are kept (``<filename>-2.*``) unless
    ``overwrite=True``. Under DDP the figures are summarized across ranks. A pickled copy keeps the settings and
    :attr:`report`. Own cost (``overhead``, :class:`~lightning_perf.profiling.timer.HookCost`): every call counted, some
    timed; averaged over all steps run, timed or not.

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
        sample_every: after the first ``min_timed_steps`` steady steps, time one step in this many (1: every step, for
            per-step detail). The default, 100, spreads a timed step's cost over 100 steps (measured from outside on
            1.4 ms steps: a timed step with its neighbours costs about 0.35 ms, so one in 32 cost 1.05%, one in 64
            0.64%); on the others the hooks only count themselves.
        min_timed_steps: after warm-up, time every step until this many steady ones are (default 50, or all of a
            shorter fit), so that a short fit's shares rest on enough steps; a report from fewer than
            :data:`~lightning_perf.profiling.step_phases.ENOUGH_TIMED_STEPS` (30) says so in its table and advice
            ("from 3 timed steps: indicative only"). Each share carries its 95% interval.

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
        sample_every: int = 100,
        min_timed_steps: int = sp.DENSE_TIMED_STEPS,
    ) -> None:
        name = type(self).__name__
        self.warmup_steps: int = check_int(name, "warmup_steps", warmup_steps, 0)
        self.log_every_n_steps: int | None = check_int(name, "log_every_n_steps", log_every_n_steps, 1, True)
        self.sync_check_steps: int = check_int(name, "sync_check_steps", sync_check_steps, 0)
        self.sample_every: int = check_int(name, "sample_every", sample_every, 1)
        self.min_timed_steps: int = check_int(name, "min_timed_steps", min_timed_steps, 0)
        self.thresholds = sp.check_settings(name, warmup_steps, sync_check_steps, thresholds)
        self.dirpath = obs.check_dirpath(name, dirpath)
        self.filename = check_file_stem(name, "filename", filename)
        self.progress_bar = check_bool(name, "progress_bar", progress_bar)
        self.plot = check_bool(name, "plot", plot)
        self.verbose = check_bool(name, "verbose", verbose)
        self.overwrite = check_bool(name, "overwrite", overwrite)
        self.report: dict[str, Any] | None = None
        self._handles: list[RemovableHandle] = []
        self._module: pl.LightningModule | None = None  # whose batch-transfer hooks carry ours (`setup` to `_undo`)
        self._reset()

    def _reset(self) -> None:
        self._phases: sp.StepPhases | None = None
        self._loader: LoaderSettings | None = None
        self._manual, self._fit_start_ns, self._live = False, 0, sp.LiveSchedule()
        self._done: Any = None  # Lightning's count of finished optimizer steps (what `trainer.global_step` reads)
        self._cost, self._sampler = HookCost(), sp.StepSampler()  # the run's, from `_phases` (the quiet paths' reads)
        self._quiet, self._counts, self._hooks_live, self._counted = _STEP_HOOKS, True, True, -2  # hooks silenced

    def __getstate__(self) -> dict[str, Any]:
        # A copy (spawn, deepcopy) holds settings and report, not the run: CUDA events, optimizers' and silenced hooks.
        state = {k: v for k, v in self.__dict__.items() if k not in _STEP_HOOKS}
        return {**state, "_phases": None, "_loader": None, "_handles": [], "_done": None, "_hooks_live": True,
                "_module": None, "_cost": HookCost(), "_sampler": sp.StepSampler()}  # fmt: skip

    def _enter(self, phase: str | None, only_from: str | None = None) -> None:  # a hook inside the step
        if self._phases is not None:
            self._phases.enter(phase, only_from)

    def _hooks_on(self, live: bool) -> None:
        if live != self._hooks_live:
            self._hooks_live = live
            obs.silence_hooks(self, self._quiet, not live)
            if (module := self._module) is not None:  # skipped steps: our batch-transfer links are not even chained
                for hook, transform in (("on_before_batch_transfer", self._before_transfer),
                                        ("on_after_batch_transfer", self._after_transfer)):  # fmt: skip
                    (add_batch_transform if live else remove_batch_transform)(module, transform, hook=hook)

    # Chained onto the module's batch-transfer hooks (`setup`), which run in every stage: they act on training only.
    # Unchained on skipped steps (`_hooks_on`: re-chained last, after any other transform); the post-hook counts.
    def _before_transfer(self, batch: Any) -> Any:
        self._enter("transfer", only_from="data")  # the wait for the batch ends
        return batch

    def _after_transfer(self, batch: Any) -> Any:
        self._enter(None, only_from="transfer")
        return batch

    def _after_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        entry = _now()  # the cost of a skipped step's count is sampled: one clock read a step, a second in 16 steps
        if (step := self._done.completed) == self._counted:  # a subclass's step() calling super().step() runs
            self._enter(None, only_from="")  # torch's post-hooks at both levels: counted as a call, nothing else
        elif self._hooks_live or not self._counts:
            self._counted = step
            self._enter("forward" if self._manual else None, only_from="optimizer")
        else:  # a skipped step ends: counted; if the next is timed, its wait for data starts at this one's end
            self._counted = step
            if self._sampler.count():
                self._hooks_on(True)
            self._cost.quiet_step(entry)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._module = pl_module
            add_batch_transform(pl_module, self._before_transfer, hook="on_before_batch_transfer")
            add_batch_transform(pl_module, self._after_transfer, hook="on_after_batch_transfer")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self.report = None
        dispatch_ns, device = obs.hook_dispatch_ns(trainer), pl_module.device
        self._phases = sp.StepPhases.for_device(
            device,
            self.warmup_steps,
            self.sync_check_steps,
            self.sample_every,
            self._clock,
            dispatch_ns,
            self.min_timed_steps,
        )
        self._cost, self._sampler = self._phases.cost, self._phases.sampler
        every = obs.live_interval(trainer, self.log_every_n_steps, self.progress_bar)
        self._live, self._manual = sp.LiveSchedule(every, self.sample_every), not pl_module.automatic_optimization
        loop = trainer.fit_loop.epoch_loop  # what `trainer.global_step` reads, in either kind of optimization:
        self._done = loop.manual_optimization.optim_step_progress.total if self._manual else (
            loop.automatic_optimization.optim_progress.optimizer.step.total)  # fmt: skip
        # The post-hook counts steps only where the optimizer steps once per batch; else batch end stays live.
        self._counts = obs.steps_once_per_batch(trainer, pl_module)
        self._quiet = _STEP_HOOKS if self._counts else _STEP_HOOKS[:-1]
        self._handles.extend(opt.register_step_post_hook(self._after_optimizer_step) for opt in trainer.optimizers)
        self._fit_start_ns = time.perf_counter_ns()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loader = LoaderSettings.from_dataloader(sp.first_dataloader(trainer.train_dataloader))

    def _undo(self, pl_module: pl.LightningModule) -> None:
        if self._phases is not None:
            self._phases.syncs.stop()
        obs.silence_hooks(self, _STEP_HOOKS, False)
        self._hooks_live, self._module = True, None
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
        if (phases := self._phases) is not None:
            entry = phases.cost.begin()  # a step that shows live figures at its end has its calls timed whole
            phases.begin_step("forward", pl_module, heavy=self._live.due(self._done.completed + 1))
            phases.cost.end(entry)

    @override
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        self._enter("optimizer")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._enter("backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("forward" if self._manual else None)  # manual: back in training_step; automatic: in the optimizer

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._enter("optimizer")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (phases := self._phases) is None:
            return
        entry = phases.cost.begin()
        if phases.end_batch(batch) and self._live.due(step := self._done.completed):  # a timed step closed
            self._live.last = step
            metrics, bar = sp.live_figures(phases, self._live.window, "bottleneck/", bar=self.progress_bar)
            obs.log_metrics(trainer, metrics)
            for key, value in bar.items():
                pl_module.log(key, value, prog_bar=True, logger=False)
        self._hooks_on(phases.sampler.live)  # back on at a skipped step's end before a timed step, else off
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
        if (phases := self._phases) is None:
            return
        phases.interrupt()
        fit_s, device = (time.perf_counter_ns() - self._fit_start_ns) / 1e9, phases.timer.device
        owner = type(self).__name__
        report = {
            **obs.fit_header(owner, trainer, pl_module, device),
            **sp.step_report(phases, fit_s, self._loader, self.thresholds, **obs.run_facts(trainer, pl_module, device)),
        }
        sp.merge_ranks(report, obs.across_ranks(trainer, pl_module, sp.rank_values(report)), trainer.world_size)
        directory = obs.report_dir(trainer, self.dirpath)  # on every rank: log_dir broadcasts
        self.report = report
        if trainer.is_global_zero:
            stem = obs.report_stem(directory, self.filename, (".json", ".png"), self.overwrite)
            steady = report["per_step"]["records"]
            draw = partial(sp.plot_phases, steady) if self.plot and steady else None
            show = (lambda r: rank_zero_info(sp.report_text(r, owner))) if self.verbose else None
            obs.write_reports(owner, report, directory, stem, draw, show, plot=self.plot)
