"""Where the time of each training step goes, live and at the end of fit, with advice on what to change."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
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
from lightning_perf.profiling import (
    HostSyncRecorder,
    LoaderSettings,
    PhaseTimer,
    StepBreakdown,
    format_seconds,
    plot_stacked_steps,
    print_table,
    recommend,
    summarize,
    write_json,
)
from lightning_perf.profiling.advice import DEFAULT_THRESHOLDS, PHASES, validate_thresholds

__all__ = ["BottleneckCallback"]

_MEASURED = PHASES[:-1]  # timed directly; "other" is the step minus these
_PROGRESS_BAR_KEYS = {"data": "data%", "forward": "fwd%", "backward": "bwd%", "optimizer": "opt%"}
_MAX_PLOTTED_BARS = 500
_MAX_REPORTED_STEPS = 20_000


def _batch_size(batch: Any) -> int | None:
    """Length of the first tensor found in ``batch`` (depth first), the way Lightning infers a batch size."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        size = _batch_size(item)
        if size is not None:
            return size
    return None


def _first_dataloader(loaders: Any) -> Any:
    if loaders is None or hasattr(loaders, "num_workers"):
        return loaders
    items = loaders.values() if isinstance(loaders, Mapping) else loaders if isinstance(loaders, (list, tuple)) else ()
    for item in items:
        found = _first_dataloader(item)
        if found is not None:
            return found
    return None


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _is_compiled(module: nn.Module) -> bool:
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


def _with_other(record: Mapping[str, float]) -> dict[str, float]:
    """A step record with ``other``: the step's time not covered by any measured phase."""
    out = {name: record.get(name, 0.0) for name in _MEASURED}
    step = record.get("step", 0.0)
    out["other"] = max(0.0, step - sum(out.values()))
    out["step"] = step
    return out


def _shares(records: list[dict[str, float]]) -> dict[str, float]:
    total = math.fsum(r["step"] for r in records)
    if not total > 0:
        return {name: math.nan for name in PHASES}
    return {name: math.fsum(r[name] for r in records) / total for name in PHASES}


class BottleneckCallback(Callback):
    """Time every phase of each training step, show the split while training runs, and advise at the end of fit.

    Each training step is split into (see :data:`~lightning_perf.profiling.advice.PHASES`):

    - ``data``: waiting for the next batch, from the end of one step to the moment Lightning starts moving the next
      batch to the device (the DataLoader's ``next()``, the user's ``on_before_batch_transfer``, and Lightning's
      bookkeeping after the previous step: loggers, progress bar, callbacks that run after this one);
    - ``transfer``: moving the batch to the device, through the user's ``on_after_batch_transfer``;
    - ``forward``: ``training_step`` (forward and loss), from ``on_train_batch_start``;
    - ``backward``: ``on_before_backward`` to ``on_after_backward``, summed over every backward of the step
      (``manual_backward`` calls, accumulation);
    - ``optimizer``: ``zero_grad`` and the optimizer step (from ``on_before_optimizer_step`` until the optimizer's
      ``step()`` returns), only in steps where the optimizer steps under gradient accumulation; in manual
      optimization every ``opt.step()`` counts;
    - ``other``: the rest of the step (Lightning between the phases, user code after backward in automatic
      optimization).

    Under automatic optimization Lightning runs ``training_step`` and backward *inside* ``optimizer.step(closure)``;
    the phases follow the hooks, so forward and backward are not billed to the optimizer. Validation during fit is
    timed apart and its time (and a checkpoint saved right after it) never reaches the training phases: a step whose
    wait for data spans a validation run or an epoch boundary is marked ``interrupted`` and kept out of the shares.

    On CUDA the phases are measured with CUDA events on the device timeline (:class:`~lightning_perf.profiling.
    PhaseTimer`), read back lazily: the callback never synchronizes the device during training. ``data`` then means
    "the GPU idles waiting for the next batch": zero when the GPU is the bottleneck, even if loading is slow.

    While training, every ``log_every_n_steps`` steps the phase shares and the throughput of the recent steps are sent
    to the Trainer's loggers (``bottleneck/<phase>``, ``bottleneck/step_s``, ``bottleneck/samples_per_s``) and, with
    ``progress_bar=True``, shown in the progress bar. A few warm-up steps are checked for host-device
    synchronizations (:class:`~lightning_perf.profiling.HostSyncRecorder`: CUDA's sync debug mode on GPU; on CPU the
    tensor calls that would synchronize on a GPU, with their source lines).

    At the end of fit, on rank zero: a table of the phases (median, p90, share of step time), the throughput, and
    :func:`~lightning_perf.profiling.recommend`'s recommendations with the evidence behind each (the DataLoader's
    settings are read from ``trainer.train_dataloader``); a JSON report ``<filename>.json`` and, with matplotlib, a
    chart of phase time per step ``<filename>.png`` in ``dirpath`` (default: the Trainer's ``log_dir``). Under DDP the
    step time, shares and throughput are also summarized across ranks (min/mean/max, one ``all_gather`` at fit end).
    Every file written is announced with its path, one line each (``rank_zero_info``). An earlier run's reports are
    never overwritten silently: when ``<filename>.json`` or ``.png`` already exists there, this run writes
    ``<filename>-2.*`` (then ``-3``, ...), unless ``overwrite=True``.
    The callback's own cost (its hooks, the timer included) is measured and reported. The JSON report is also kept in
    :attr:`report`. A pickled copy keeps the settings and :attr:`report`, not the timers of a run in progress (CUDA
    events cannot be pickled): they are built again when the copy's fit starts.

    Args:
        warmup_steps: leading training steps reported apart as warm-up (compilation, autotuning, allocator growth).
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
        self._timer: PhaseTimer | None = None
        self._val_timer: PhaseTimer | None = None
        self._recorder: HostSyncRecorder | None = None
        self._sync_note: str | None = None
        self._sync_steps = 0
        self._current: str | None = None  # the sub-phase running now
        self._step_open = False  # whether the "step" phase runs (False while paused for validation)
        self._waiting = False  # in the gap before the next batch, "data" running
        self._paused = False
        self._manual = False
        self._interrupted = False  # the current step's gap spans validation or an epoch boundary
        self._epoch_first = False
        self._batch_sizes: list[int | None] = []
        self._step_interrupted: list[bool] = []
        self._step_epoch_first: list[bool] = []
        self._hook_ns: list[int] = []
        self._hook_ns_open = 0
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

    # --------------------------------------------------------------------------------------------- phase machinery

    def _switch(self, phase: str | None) -> None:
        timer = self._timer
        assert timer is not None
        if self._current is not None:
            timer.stop(self._current)
        self._current = phase
        if phase is not None:
            timer.start(phase)

    def _open_gap(self) -> None:
        """Start the wait for the next batch (and the next step)."""
        if self._timer is None:
            return
        if not self._step_open:
            self._timer.start("step")
            self._step_open = True
        self._switch("data")
        self._waiting = True

    def _close_gap(self) -> None:
        """Stop the clock of the open step without ending it (validation, epoch end, fit end)."""
        if self._timer is None or not self._step_open:
            return
        self._switch(None)
        self._timer.stop("step")
        self._step_open = False
        self._waiting = False
        self._interrupted = True

    def _charge(self, entry_ns: int) -> None:
        self._hook_ns_open += time.perf_counter_ns() - entry_ns

    # Chained onto the module's batch-transfer hooks (see `setup`): they run for every stage, so they only act while
    # a training step is waiting for its batch.
    def _before_transfer(self, batch: Any) -> Any:
        entry = time.perf_counter_ns()
        if self._waiting:
            self._waiting = False
            self._switch("transfer")
        self._charge(entry)
        return batch

    def _after_transfer(self, batch: Any) -> Any:
        entry = time.perf_counter_ns()
        if self._current == "transfer":
            self._switch(None)
        self._charge(entry)
        return batch

    def _after_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        entry = time.perf_counter_ns()
        if self._step_open and self._current == "optimizer":
            self._switch("forward" if self._manual else None)
        self._charge(entry)

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
        self._timer = PhaseTimer(device, warmup_steps=self.warmup_steps, clock=self._clock)
        self._val_timer = PhaseTimer(device, clock=self._clock)
        self._manual = not pl_module.automatic_optimization
        if self.sync_check_steps:
            self._recorder = HostSyncRecorder(device)
        for optimizer in trainer.optimizers:
            self._handles.append(optimizer.register_step_post_hook(self._after_optimizer_step))
        self._fit_start_ns = time.perf_counter_ns()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loader = LoaderSettings.from_dataloader(_first_dataloader(trainer.train_dataloader))

    def _cleanup(self, pl_module: pl.LightningModule) -> None:
        if self._recorder is not None:
            self._recorder.stop()
        remove_batch_transform(pl_module, self._before_transfer, hook="on_before_batch_transfer")
        remove_batch_transform(pl_module, self._after_transfer, hook="on_after_batch_transfer")
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._cleanup(pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._cleanup(pl_module)

    # ------------------------------------------------------------------------------------------------ the step

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        entry = time.perf_counter_ns()
        self._epochs_started += 1
        if self._epochs_started > 1:
            self._epoch_first = True
        self._open_gap()
        self._charge(entry)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        entry = time.perf_counter_ns()
        if self._timer is None:
            return
        if not self._step_open:
            self._timer.start("step")
            self._step_open = True
        self._waiting = False
        self._switch("forward")
        index = self._timer.num_steps
        recorder = self._recorder
        if recorder is not None and self.warmup_steps - self.sync_check_steps <= index < self.warmup_steps:
            if recorder.device.type != "cuda" and _is_compiled(pl_module):
                # A Python-level mode around compiled code would change what the compiler traces: skip the check.
                self._sync_note = "not checked: the model is compiled and the CPU check would interfere with it"
                self._recorder = None
            else:
                recorder.start()
        self._charge(entry)

    @override
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        entry = time.perf_counter_ns()
        if self._step_open:
            self._switch("optimizer")
        self._charge(entry)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        entry = time.perf_counter_ns()
        if self._step_open:
            self._switch("backward")
        self._charge(entry)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        entry = time.perf_counter_ns()
        if self._step_open:
            # Manual optimization: back in the user's training_step. Automatic: Lightning returns to the optimizer.
            self._switch("forward" if self._manual else None)
        self._charge(entry)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        entry = time.perf_counter_ns()
        if self._step_open:
            self._switch("optimizer")
        self._charge(entry)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        entry = time.perf_counter_ns()
        timer = self._timer
        if timer is None or not self._step_open:
            return
        self._switch(None)
        timer.stop("step")
        self._step_open = False
        if self._recorder is not None and self._recorder.active:
            self._recorder.stop()
            self._sync_steps += 1
        self._batch_sizes.append(_batch_size(batch))
        self._step_interrupted.append(self._interrupted)
        self._step_epoch_first.append(self._epoch_first)
        self._interrupted = self._epoch_first = False
        self._hook_ns.append(self._hook_ns_open + time.perf_counter_ns() - entry)
        self._hook_ns_open = 0
        entry = time.perf_counter_ns()  # what follows is billed to the next step
        timer.end_step()
        every = self.log_every_n_steps or trainer.log_every_n_steps  # type: ignore[attr-defined]
        if (trainer.loggers or self.progress_bar) and trainer.global_step - self._last_logged >= every:
            self._last_logged = trainer.global_step
            self._log_live(trainer, pl_module, every)
        self._open_gap()
        self._charge(entry)

    def _log_live(self, trainer: pl.Trainer, pl_module: pl.LightningModule, window: int) -> None:
        assert self._timer is not None
        records = [_with_other(r) for r in self._timer.recent_steps(window)]  # never waits for the device
        if not records:
            return
        shares = _shares(records)
        step_s = math.fsum(r["step"] for r in records) / len(records)
        sizes = [s for s in self._batch_sizes[-window:] if s is not None]
        samples_per_s = (sum(sizes) / len(sizes)) / step_s if sizes and step_s > 0 else math.nan
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
        if self._val_timer is None or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self._close_gap()
        self._paused = True
        self._val_timer.start("validation")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_timer is None or not self._paused:
            return
        self._paused = False
        self._val_timer.stop("validation")
        self._val_timer.end_step()
        self._open_gap()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_gap()

    # ------------------------------------------------------------------------------------------------- results

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timer is None:
            return
        self._close_gap()
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
        steady = [_with_other(r) for r in self._timer.steps]
        report["plot"], report["plot_note"] = None, None
        if self.plot and steady:
            report["plot"], report["plot_note"] = draw_chart(
                lambda path: plot_stacked_steps(
                    _binned(steady), path, title="Phase time per training step", phases=PHASES
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
        assert self._timer is not None and self._val_timer is not None
        timer = self._timer
        raw = timer.steps
        steady = [_with_other(r) for r in raw]
        first = len(timer.warmup_steps_records)
        flags = self._step_interrupted[first : first + len(steady)]
        clean = [r for r, interrupted in zip(steady, flags) if not interrupted]
        clean_raw = [r for r, interrupted in zip(raw, flags) if not interrupted]
        sizes = [s for s, f in zip(self._batch_sizes[first:], flags) if not f and s is not None]
        # Each phase over the steps in which it ran (the optimizer steps once per accumulation window).
        phases = {name: summarize([r[name] for r in clean_raw if name in r]).to_dict() for name in _MEASURED}
        phases["other"] = summarize([r["other"] for r in clean]).to_dict()
        step = summarize([r["step"] for r in clean])
        shares = _shares(clean)
        clean_time = math.fsum(r["step"] for r in clean)
        samples_per_s = sum(sizes) / clean_time if sizes and clean_time > 0 else math.nan
        data_median = phases["data"]["median"]
        restarts = [
            r["data"] - data_median
            for r, epoch_first in zip(steady, self._step_epoch_first[first:])
            if epoch_first and math.isfinite(data_median)
        ]
        val = self._val_timer.summary().get("validation")
        hook = summarize(self._hook_ns[first:])
        recorder = self._recorder
        sites = recorder.sites() if recorder is not None else []
        device = timer.device
        breakdown = StepBreakdown(
            shares=shares,
            medians={name: phases[name]["median"] for name in PHASES},
            step_median_s=step.median,
            steps=len(clean),
            device_type=device.type,
            loader=self._loader,
            cpu_count=_usable_cpus(),
            processes_per_node=max(1, int(trainer.num_devices)),
            steps_per_epoch=float(trainer.num_training_batches)
            if math.isfinite(trainer.num_training_batches)
            else None,
            epoch_restart_s=summarize(restarts).median if restarts else None,
            precision=str(trainer.precision),
            has_convolutions=any(isinstance(m, (nn.Conv2d, nn.Conv3d)) for m in pl_module.modules()),
            optimizers_fused=bool(trainer.optimizers)
            and all(group.get("fused") is True for opt in trainer.optimizers for group in opt.param_groups),
            fast_bf16=is_sm_at_least(8, 0, device) if device.type == "cuda" else has_fast_cpu_bf16(),
            tf32_capable=supports_tf32(device),
            tf32_enabled=torch.get_float32_matmul_precision() != "highest",
            active_callbacks=class_names(trainer),
            host_syncs=sites,
            sync_steps_checked=self._sync_steps,
            sync_method=recorder.method if recorder is not None else "",
            thresholds=self.thresholds,
        )
        recommendations = recommend(breakdown)
        timer_dict = timer.to_dict()
        reported = steady[-_MAX_REPORTED_STEPS:]
        return {
            "callback": type(self).__name__,
            "device": str(device),
            "world_size": trainer.world_size,
            "precision": str(trainer.precision),
            "automatic_optimization": not self._manual,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "steps": {
                "total": timer.num_steps,
                "warmup": first,
                "steady": len(steady),
                "interrupted": len(steady) - len(clean),
            },
            "steady_state": {"step": step.to_dict(), "phases": phases, "shares": shares},
            "warmup": timer_dict["warmup_summary"],
            "throughput": {
                "samples_per_s": samples_per_s,
                "steps_per_s": 1.0 / step.median if step.median > 0 else math.nan,
                "batch_size_median": summarize(sizes).median if sizes else math.nan,
            },
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
                "sites": sites,
            },
            "recommendations": recommendations,
            "overhead": {
                "hooks_ns_total": sum(self._hook_ns) + self._hook_ns_open,
                "hooks_ns_per_step": hook.to_dict(),
                "timer_ns_total": timer.overhead_ns,
                "share_of_step": (hook.median / 1e9) / step.median if step.median > 0 else math.nan,
            },
            "per_step": {
                "phases": list(PHASES),
                "truncated": len(steady) > len(reported),
                "records": reported,
                "interrupted": flags[-_MAX_REPORTED_STEPS:],
            },
        }

    def _print(self, report: dict[str, Any]) -> None:
        summary = report["steady_state"]
        rows: list[list[object]] = []
        for name in PHASES:
            stats = summary["phases"][name]
            share = summary["shares"][name]
            rows.append(
                [
                    name,
                    format_seconds(stats["median"]),
                    format_seconds(stats["p90"]),
                    f"{100 * share:.1f}%" if math.isfinite(share) else "n/a",
                    stats["count"],
                ]
            )
        step = summary["step"]
        rows.append(["step", format_seconds(step["median"]), format_seconds(step["p90"]), "100%", step["count"]])
        steps = report["steps"]
        print_table(
            ["phase", "median", "p90", "share", "steps"],
            rows,
            title=f"BottleneckCallback: {steps['steady']} steady steps ({steps['warmup']} warm-up, "
            f"{steps['interrupted']} interrupted left out) on {report['device']}",
        )
        throughput = report["throughput"]
        overhead = report["overhead"]
        lines = [
            f"throughput: {throughput['samples_per_s']:.1f} samples/s per process, {throughput['steps_per_s']:.2f} "
            f"steps/s; observer cost {100 * overhead['share_of_step']:.2g}% of the median step",
        ]
        if report["validation"]["runs"]:
            lines.append(
                f"validation: {report['validation']['runs']} runs, {format_seconds(report['validation']['total_s'])} "
                f"({100 * report['validation']['share_of_fit']:.1f}% of fit)"
            )
        recs = report["recommendations"]
        lines.append("recommendations:" if recs else "recommendations: none, nothing stands out.")
        lines += [rec.format() for rec in recs]
        if report.get("plot_note"):
            lines.append(report["plot_note"])
        rank_zero_info("\n".join(lines))


def _binned(records: list[dict[str, float]]) -> list[dict[str, float]]:
    """At most ``_MAX_PLOTTED_BARS`` bars: means of consecutive steps, so long runs still draw quickly."""
    n = len(records)
    if n <= _MAX_PLOTTED_BARS:
        return records
    out = []
    for b in range(_MAX_PLOTTED_BARS):
        group = records[b * n // _MAX_PLOTTED_BARS : (b + 1) * n // _MAX_PLOTTED_BARS]
        out.append({name: math.fsum(r[name] for r in group) / len(group) for name in PHASES})
    return out
