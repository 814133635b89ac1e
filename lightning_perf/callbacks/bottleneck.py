"""Where the time of each training step goes, live and at the end of fit, with advice on what to change."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_perf._device import has_fast_cpu_bf16, is_sm_at_least, supports_tf32
from lightning_perf._validation import check_bool, check_int
from lightning_perf.callbacks._model_hooks import add_batch_transform, remove_batch_transform
from lightning_perf.callbacks._observer import (
    across_ranks,
    announce_files,
    check_dirpath,
    check_filename,
    class_names,
    draw_chart,
    log_metrics,
    report_dir,
    report_stem,
)
from lightning_perf.callbacks._undo import UndoOnExit
from lightning_perf.profiling import (
    HostSyncRecorder,
    LoaderSettings,
    PhaseTimer,
    StepBreakdown,
    plot_stacked_steps,
    print_table,
    recommend,
    write_json,
)
from lightning_perf.profiling.advice import DEFAULT_THRESHOLDS, PHASES, validate_thresholds
from lightning_perf.profiling.step_phases import (
    StepPhases,
    batch_size_of,
    binned,
    first_dataloader,
    phase_rows,
    recent_figures,
    report_lines,
    summarize_steps,
    usable_cpus,
)

__all__ = ["BottleneckCallback"]

_PROGRESS_BAR_KEYS = {"data": "data%", "forward": "fwd%", "backward": "bwd%", "optimizer": "opt%"}


def _is_compiled(module: nn.Module) -> bool:
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


class BottleneckCallback(UndoOnExit):
    """Time every phase of each training step, show the split while training runs, and advise at the end of fit.

    Phases (:data:`~lightning_perf.profiling.advice.PHASES`, kept by :class:`~lightning_perf.profiling.step_phases.
    StepPhases`): ``data`` (from the end of a step until Lightning moves the next batch: the DataLoader, the user's
    ``on_before_batch_transfer`` and Lightning's bookkeeping after the last step), ``transfer`` (to the device,
    through ``on_after_batch_transfer``), ``forward`` (``training_step``), ``backward`` (every backward of the step),
    ``optimizer`` (``zero_grad`` and ``step()``, in the steps where the optimizer steps) and ``other`` (the rest).
    The phases follow the hooks, so forward and backward inside ``optimizer.step(closure)`` are not billed to the
    optimizer. Validation is timed apart: a step whose wait spans validation or an epoch boundary is marked
    ``interrupted`` and kept out of the shares. On CUDA the phases are CUDA events read back lazily (the device is
    never synchronized during training), and ``data`` means "the GPU waits for the next batch".

    Every ``log_every_n_steps`` steps the recent shares and throughput go to the loggers (``bottleneck/<phase>``,
    ``bottleneck/step_s``, ``bottleneck/samples_per_s``) and, with ``progress_bar=True``, to the progress bar. A few
    warm-up steps are checked for host-device synchronizations (:class:`~lightning_perf.profiling.HostSyncRecorder`).
    At the end of fit, on rank zero: the phase table (median, p90, share), the throughput, the callback's own cost and
    :func:`~lightning_perf.profiling.recommend`'s advice with its evidence; ``<filename>.json`` (also in
    :attr:`report`) and, with matplotlib, ``<filename>.png`` in ``dirpath``, each announced; an earlier run's files
    are kept (``<filename>-2.*``) unless ``overwrite=True``. Under DDP the figures are also summarized across ranks.
    A pickled copy keeps the settings and :attr:`report`, not a run in progress.

    Args:
        warmup_steps: leading steps reported apart as warm-up (compilation, autotuning, allocator growth).
        log_every_n_steps: how often to log live figures; ``None`` takes the Trainer's ``log_every_n_steps``.
        progress_bar: also show the shares and throughput in the progress bar.
        sync_check_steps: how many of the last warm-up steps are checked for host-device synchronizations (0: none;
            at most ``warmup_steps``, so the check never slows a measured step).
        thresholds: share of the step above which a phase is flagged, by phase (``data``, ``transfer``,
            ``optimizer``, ``other``); defaults in :data:`~lightning_perf.profiling.advice.DEFAULT_THRESHOLDS`.
        dirpath: directory of the reports; ``None`` uses the Trainer's ``log_dir`` (``default_root_dir`` without a
            logger).
        filename: file name (without extension) of the reports.
        plot: draw the PNG chart (needs matplotlib; without it a note says so and the run goes on).
        verbose: print the table and the recommendations at the end of fit.
        overwrite: write over an earlier run's reports of the same ``filename`` instead of numbering this run's.

    Raises:
        ValueError: for a negative step count, ``sync_check_steps > warmup_steps``, a threshold outside (0, 1), an
            unknown phase name, or a file name with a directory in it.
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
        plot: bool = True,
        verbose: bool = True,
        overwrite: bool = False,
    ) -> None:
        name = type(self).__name__
        self.warmup_steps: int = check_int(name, "warmup_steps", warmup_steps, 0)
        self.log_every_n_steps: int | None = check_int(name, "log_every_n_steps", log_every_n_steps, 1, True)
        self.sync_check_steps: int = check_int(name, "sync_check_steps", sync_check_steps, 0)
        if sync_check_steps > warmup_steps:
            raise ValueError(
                f"`{name}(sync_check_steps={sync_check_steps!r}, warmup_steps={warmup_steps!r})`: the checked steps "
                "are the last warm-up steps, so sync_check_steps must be at most warmup_steps."
            )
        unknown = sorted(set(thresholds) - set(DEFAULT_THRESHOLDS)) if isinstance(thresholds, Mapping) else []
        if unknown:
            raise ValueError(
                f"`{name}(thresholds={thresholds!r})` is not valid: {', '.join(map(repr, unknown))} not a phase with "
                f"a threshold. Expected phases from: {', '.join(DEFAULT_THRESHOLDS)}."
            )
        self.thresholds = validate_thresholds(thresholds, name)
        self.dirpath = check_dirpath(name, dirpath)
        self.filename = check_filename(name, filename)
        self.progress_bar = check_bool(name, "progress_bar", progress_bar)
        self.plot = check_bool(name, "plot", plot)
        self.verbose = check_bool(name, "verbose", verbose)
        self.overwrite = check_bool(name, "overwrite", overwrite)
        self.report: dict[str, Any] | None = None
        self._handles: list[RemovableHandle] = []
        self._reset()

    def _reset(self) -> None:
        self._phases: StepPhases | None = None
        self._val_timer: PhaseTimer | None = None
        self._recorder: HostSyncRecorder | None = None
        self._sync_note: str | None = None
        self._sync_steps = 0
        self._paused = False
        self._manual = False
        self._last_logged = 0
        self._loader: LoaderSettings | None = None
        self._fit_start_ns = 0
        self._epochs_started = 0

    def __getstate__(self) -> dict[str, Any]:
        # A copy (a spawn launcher's, a deepcopy of the Trainer's callbacks) holds the settings and the last report,
        # never the run in progress: the timers hold CUDA events (which cannot be pickled) and the hook handles belong
        # to this process's optimizers. `on_fit_start` builds all of it again.
        state = self.__dict__.copy()
        idle = type(self).__new__(type(self))
        idle._reset()
        state.update(vars(idle), _handles=[])
        return state

    # Chained onto the module's batch-transfer hooks (see `setup`): they run for every stage, so they only act while
    # a training step is waiting for its batch.
    def _before_transfer(self, batch: Any) -> Any:
        entry, phases = time.perf_counter_ns(), self._phases
        if phases is not None and phases.waiting:
            phases.waiting = False
            phases.switch("transfer")
            phases.charge(entry)
        return batch

    def _after_transfer(self, batch: Any) -> Any:
        entry, phases = time.perf_counter_ns(), self._phases
        if phases is not None and phases.current == "transfer":
            phases.switch(None)
            phases.charge(entry)
        return batch

    def _after_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        entry, phases = time.perf_counter_ns(), self._phases
        if phases is not None and phases.step_open and phases.current == "optimizer":
            phases.switch("forward" if self._manual else None)
            phases.charge(entry)

    def _enter(self, phase: str | None) -> None:
        """A hook inside the step: switch to ``phase`` and bill the hook's own time."""
        entry, phases = time.perf_counter_ns(), self._phases
        if phases is not None and phases.step_open:
            phases.switch(phase)
            phases.charge(entry)

    # --------------------------------------------------------------------------------------------------- set-up

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            add_batch_transform(pl_module, self._before_transfer, hook="on_before_batch_transfer")
            add_batch_transform(pl_module, self._after_transfer, hook="on_after_batch_transfer")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self.report = None
        device = pl_module.device
        self._phases = StepPhases(PhaseTimer(device, warmup_steps=self.warmup_steps, clock=self._clock))
        self._val_timer = PhaseTimer(device, clock=self._clock)
        self._manual = not pl_module.automatic_optimization
        if self.sync_check_steps:
            self._recorder = HostSyncRecorder(device)
        for optimizer in trainer.optimizers:
            self._handles.append(optimizer.register_step_post_hook(self._after_optimizer_step))
        self._fit_start_ns = time.perf_counter_ns()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loader = LoaderSettings.from_dataloader(first_dataloader(trainer.train_dataloader))

    def _undo(self, pl_module: pl.LightningModule) -> None:
        if self._recorder is not None:
            self._recorder.stop()
        remove_batch_transform(pl_module, self._before_transfer, hook="on_before_batch_transfer")
        remove_batch_transform(pl_module, self._after_transfer, hook="on_after_batch_transfer")
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------------------------------------ the step

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        entry, phases = time.perf_counter_ns(), self._phases
        self._epochs_started += 1
        if phases is not None:
            phases.open_gap(new_epoch=self._epochs_started > 1)
            phases.charge(entry)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        entry, phases = time.perf_counter_ns(), self._phases
        if phases is None:
            return
        phases.begin_step("forward")
        recorder, index = self._recorder, phases.timer.num_steps
        if recorder is not None and self.warmup_steps - self.sync_check_steps <= index < self.warmup_steps:
            if recorder.device.type != "cuda" and _is_compiled(pl_module):
                # A Python-level mode around compiled code would change what the compiler traces: skip the check.
                self._sync_note = "not checked: the model is compiled and the CPU check would interfere with it"
                self._recorder = None
            else:
                recorder.start()
        phases.charge(entry)

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
        entry, phases = time.perf_counter_ns(), self._phases
        if phases is None or not phases.step_open:
            return
        if self._recorder is not None and self._recorder.active:
            self._recorder.stop()
            self._sync_steps += 1
        entry = phases.end_step(batch_size_of(batch), entry)  # what follows is billed to the next step
        every = self.log_every_n_steps or trainer.log_every_n_steps  # type: ignore[attr-defined]
        if (trainer.loggers or self.progress_bar) and trainer.global_step - self._last_logged >= every:
            self._last_logged = trainer.global_step
            self._log_live(trainer, pl_module, every)
        phases.open_gap()
        phases.charge(entry)

    def _log_live(self, trainer: pl.Trainer, pl_module: pl.LightningModule, window: int) -> None:
        assert self._phases is not None
        figures = recent_figures(self._phases, window)
        if figures is None:
            return
        shares, step_s, samples_per_s = figures
        metrics = {f"bottleneck/{name}": shares[name] for name in PHASES}
        metrics.update({"bottleneck/step_s": step_s, "bottleneck/samples_per_s": samples_per_s})
        log_metrics(trainer, metrics)
        if self.progress_bar:
            for name, key in _PROGRESS_BAR_KEYS.items():
                if math.isfinite(shares[name]):
                    pl_module.log(key, round(100.0 * shares[name], 1), prog_bar=True, logger=False)
            if math.isfinite(samples_per_s):
                pl_module.log("samples/s", round(samples_per_s, 1), prog_bar=True, logger=False)

    # ------------------------------------------------------------------------------------ validation, epoch end

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_timer is None or self._phases is None or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self._phases.interrupt()
        self._paused = True
        self._val_timer.start("validation")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_timer is None or not self._paused:
            return
        self._paused = False
        self._val_timer.stop("validation")
        self._val_timer.end_step()
        if self._phases is not None:
            self._phases.open_gap()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._phases is not None:
            self._phases.interrupt()

    # ------------------------------------------------------------------------------------------------- results

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._phases is None:
            return
        self._phases.interrupt()
        fit_s = (time.perf_counter_ns() - self._fit_start_ns) / 1e9
        report = self._analyze(trainer, pl_module, fit_s)
        summary = report["steady_state"]
        ranks = across_ranks(
            trainer,
            pl_module,
            {
                "step_median_s": summary["step"]["median"],
                "samples_per_s": report["throughput"]["samples_per_s"],
                **{f"share_{name}": summary["shares"][name] for name in PHASES},
                "overhead_share": report["overhead"]["share_of_step"],
            },
        )
        if ranks is not None:
            report["ranks"] = ranks
            report["throughput"]["world_samples_per_s"] = ranks["samples_per_s"]["mean"] * trainer.world_size
        directory = report_dir(trainer, self.dirpath)  # on every rank: log_dir broadcasts
        self.report = report
        if not trainer.is_global_zero:
            return
        stem = report_stem(directory, self.filename, (".json", ".png"), self.overwrite)
        steady = report["per_step"]["records"]
        report["plot"], report["plot_note"] = None, None
        if self.plot and steady:
            report["plot"], report["plot_note"] = draw_chart(
                lambda path: plot_stacked_steps(
                    binned(steady), path, title="Phase time per training step", phases=PHASES
                ),
                directory / f"{stem}.png",
                type(self).__name__,
            )
        report["json"] = str(directory / f"{stem}.json")
        write_json(report, directory / f"{stem}.json")
        if self.verbose:
            self._print(report)
        announce_files(type(self).__name__, [report["json"], report["plot"]])

    def _analyze(self, trainer: pl.Trainer, pl_module: pl.LightningModule, fit_s: float) -> dict[str, Any]:
        assert self._phases is not None and self._val_timer is not None
        figures = summarize_steps(self._phases)
        steady, recorder, device = figures["steady_state"], self._recorder, self._phases.timer.device
        val = self._val_timer.summary().get("validation")
        breakdown = StepBreakdown(
            shares=steady["shares"],
            medians={name: steady["phases"][name]["median"] for name in PHASES},
            step_median_s=steady["step"]["median"],
            steps=steady["step"]["count"],
            device_type=device.type,
            loader=self._loader,
            cpu_count=usable_cpus(),
            processes_per_node=max(1, int(trainer.num_devices)),
            steps_per_epoch=float(trainer.num_training_batches)
            if math.isfinite(trainer.num_training_batches)
            else None,
            epoch_restart_s=figures.pop("epoch_restart_s"),
            precision=str(trainer.precision),
            has_convolutions=any(isinstance(m, (nn.Conv2d, nn.Conv3d)) for m in pl_module.modules()),
            optimizers_fused=bool(trainer.optimizers)
            and all(group.get("fused") is True for opt in trainer.optimizers for group in opt.param_groups),
            fast_bf16=is_sm_at_least(8, 0, device) if device.type == "cuda" else has_fast_cpu_bf16(),
            tf32_capable=supports_tf32(device),
            tf32_enabled=torch.get_float32_matmul_precision() != "highest",
            active_callbacks=class_names(trainer),
            host_syncs=recorder.sites() if recorder is not None else [],
            sync_steps_checked=self._sync_steps,
            sync_method=recorder.method if recorder is not None else "",
            thresholds=self.thresholds,
        )
        return {
            "callback": type(self).__name__,
            "device": str(device),
            "world_size": trainer.world_size,
            "precision": str(trainer.precision),
            "automatic_optimization": not self._manual,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            **figures,
            "validation": {
                "runs": val.count if val else 0,
                "total_s": val.total if val else 0.0,
                "median_s": val.median if val else math.nan,
                "share_of_fit": (val.total / fit_s) if val and fit_s > 0 else 0.0,
            },
            "fit_seconds": fit_s,
            "dataloader": self._loader,
            "host_syncs": {
                "method": breakdown.sync_method,
                "steps_checked": self._sync_steps,
                "note": self._sync_note,
                "per_step": (recorder.total / self._sync_steps) if recorder is not None and self._sync_steps else None,
                "sites": breakdown.host_syncs,
            },
            "recommendations": recommend(breakdown),
        }

    def _print(self, report: dict[str, Any]) -> None:
        steps = report["steps"]
        title = (
            f"{type(self).__name__}: {steps['steady']} steady steps ({steps['warmup']} warm-up, "
            f"{steps['interrupted']} interrupted left out) on {report['device']}"
        )
        print_table(["phase", "median", "p90", "share", "steps"], phase_rows(report), title=title)
        rank_zero_info("\n".join(report_lines(report)))
