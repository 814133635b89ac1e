"""One benchmark run: train (or run inference on) a model under one configuration and measure it, in its own process.

Entry point: :func:`run`, called by :func:`lightning_perf.benchmark.isolation.run_isolated`. Design notes (the model's
source, memory measurement, FLOP counting): docs/architecture.md, Module notes.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_perf._device import as_device, synchronize
from lightning_perf._warnings import NoEffectWarning
from lightning_perf.benchmark.spec import MEMORY_STEPS, SETTLE_STEPS, RunSpec
from lightning_perf.benchmark.structure import training_step_flops
from lightning_perf.profiling import MemoryProbe, MemorySample, PhaseTimer, truthful_cpu_peak


@dataclass
class RunResult:
    """What one worker measured. Times in seconds under keys ending ``_s`` (step times ``step_..._s``), memory in
    bytes."""

    spec: dict[str, Any]
    ok: bool = True
    skipped: str | None = None
    error: str | None = None
    traceback: str | None = None  # the failing code's own traceback, for errors raised by the user's model
    batch_size: int | None = None
    model_init_s: float | None = None
    first_batch_s: float | None = None
    first_forward_s: float | None = None
    first_step_s: float | None = None  # the first training step, cold: compile with an empty inductor cache included
    warmup_s: float | None = None
    step_median_s: float | None = None  # median of the steady-state step times
    step_times_s: list[float] = field(default_factory=list)  # every steady-state step, in order
    throughput: float | None = None  # training samples per second at the median step
    peak_memory_bytes: int | None = None
    step_memory_bytes: int | None = None  # steady-state peak minus memory in use before the steps
    memory_source: str | None = None
    predict_step_median_s: float | None = None
    predict_step_times_s: list[float] = field(default_factory=list)  # every steady-state predict batch
    predict_throughput: float | None = None
    final_train_loss: float | None = None
    losses: list[float] = field(default_factory=list)  # every training step's loss, warm-up included
    data_wait_s: list[float] = field(default_factory=list)  # steady-state time between a step's end and the next start
    wall_s: float | None = None  # the run itself; counting FLOPs afterwards is not included
    flops_per_step: int | None = None  # one training step (forward + backward) of the untransformed model
    flops_by_operator: dict[str, int] = field(default_factory=dict)  # "aten.mm" -> FLOPs, for that step
    flops_error: str | None = None  # why the FLOPs are unknown when counting was asked for and failed
    latency_p50_s: float | None = None  # inference stages: percentiles of the steady per-batch latency
    latency_p95_s: float | None = None
    latency_p99_s: float | None = None
    precision: str | None = None  # the precision the run used
    trainer_settings: list[str] = field(default_factory=list)  # the --config file's trainer keys applied
    predict_skipped: str | None = None  # why a fit run timed no inference (a user's data without a predict split)
    no_effect: list[str] = field(default_factory=list)  # a callback's own "did not apply" (NoEffectWarning) texts
    threads: int | None = None  # the intra-op threads the run used (RunSpec.threads, else torch's default)
    wait_policy: str | None = None  # OMP_WAIT_POLICY when the run's process started (what OpenMP read; None: unset)
    decided: dict[str, Any] = field(default_factory=dict)  # callback class -> state_dict of what it decided by timing


class _StepClock(Callback):
    """Times training steps end to end (data fetch included) and the first batch's fetch and forward.

    A steady-state step is the interval between two consecutive ``on_train_batch_end`` calls, so data loading,
    the transfer to the device, forward, backward and the optimizer step all count, as a user would experience.
    On a CPU, memory is measured over :data:`MEMORY_STEPS` steps after the warm-up and the timed steps come after
    :data:`SETTLE_STEPS` more (:attr:`untimed_steps` in all); on CUDA both come from the steps after the warm-up.
    """

    def __init__(self, device: torch.device, warmup_steps: int) -> None:
        self.device = device
        cpu = device.type == "cpu"
        self.memory_end = warmup_steps + MEMORY_STEPS if cpu else None
        self.untimed_steps = warmup_steps + (MEMORY_STEPS + SETTLE_STEPS if cpu else 0)
        self.timer = PhaseTimer(device=device, warmup_steps=self.untimed_steps)
        self.probe = MemoryProbe(device)
        self.warmup_steps = warmup_steps
        self.memory_after: MemorySample | None = None
        self.first_batch_s: float | None = None
        self.first_forward_s: float | None = None
        self.first_step_s: float | None = None
        self.warmup_s: float | None = None
        self.memory_before_steps: int | None = None
        self.last_loss: float | None = None
        self._epoch_start_ns: int | None = None
        self._batch_start_ns: int | None = None
        self._train_start_ns: int | None = None
        self._batches_done = 0
        self._loss: torch.Tensor | None = None
        self._losses: list[torch.Tensor] = []
        self._batch_end_ns: int | None = None
        self.data_wait_s: list[float] = []
        self.losses: list[float] = []

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.memory_end is None:  # on CUDA nothing measures host memory: host allocations at full speed
            truthful_cpu_peak(False)
        self._train_start_ns = time.perf_counter_ns()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._epoch_start_ns is None:
            self._epoch_start_ns = time.perf_counter_ns()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._batch_end_ns is not None and self._batches_done >= self.untimed_steps:
            # Lightning fetches the next batch between one step's end and the next one's start.
            self.data_wait_s.append((time.perf_counter_ns() - self._batch_end_ns) / 1e9)
        if self._batches_done == 0:
            assert self._epoch_start_ns is not None
            self._batch_start_ns = time.perf_counter_ns()
            self.first_batch_s = (self._batch_start_ns - self._epoch_start_ns) / 1e9
            self.timer.start("step")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._batches_done == 0 and self.first_forward_s is None:
            synchronize(self.device)  # once, on the first step only
            assert self._batch_start_ns is not None
            self.first_forward_s = (time.perf_counter_ns() - self._batch_start_ns) / 1e9

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.timer.stop("step")
        self.timer.end_step()
        self._batches_done += 1
        if self._batches_done == 1:  # the cold first step: compilation (a fresh inductor cache), autotuning, allocation
            synchronize(self.device)
            assert self._batch_start_ns is not None
            self.first_step_s = (time.perf_counter_ns() - self._batch_start_ns) / 1e9
        if self._batches_done == self.warmup_steps:
            synchronize(self.device)  # once, at the warm-up boundary, so warm-up time is complete
            assert self._train_start_ns is not None
            self.warmup_s = (time.perf_counter_ns() - self._train_start_ns) / 1e9
            self.memory_before_steps = _comparable_to_peak(self.probe.sample())
            self.probe.reset_peak()
        if self._batches_done == self.memory_end:
            self._end_memory()
        if trainer.global_step < trainer.max_steps:
            self.timer.start("step")
        if isinstance(outputs, dict) and "loss" in outputs:
            self._loss = outputs["loss"]
        elif isinstance(outputs, torch.Tensor):
            self._loss = outputs
        if self._loss is not None:
            self._losses.append(self._loss.detach())  # read after training: no device sync per step
        self._batch_end_ns = time.perf_counter_ns()

    def _end_memory(self) -> None:
        if self.memory_end is not None and self.memory_after is None:
            self.memory_after = self.probe.sample()
            truthful_cpu_peak(False)  # the steps timed next (and predict after the fit) allocate at full speed

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._end_memory()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_memory()
        if self._loss is not None:
            self.last_loss = float(self._loss.detach().float().cpu())
        self.losses = [float(loss.float().cpu()) for loss in self._losses]


class _PredictClock(Callback):
    def __init__(self, device: torch.device, warmup_batches: int) -> None:
        self.timer = PhaseTimer(device=device, warmup_steps=warmup_batches)

    @override
    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int, dl_idx: int = 0
    ) -> None:
        self.timer.start("predict")

    @override
    def on_predict_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int, dl_idx: int = 0
    ) -> None:
        self.timer.stop("predict")
        self.timer.end_step()


def _batch_size_of(model: pl.LightningModule, datamodule: pl.LightningDataModule, spec: RunSpec) -> int | None:
    """The batch size the run trains with: the spec's, else a ``batch_size`` where Lightning's tuner looks for it."""
    from lightning_perf.benchmark.sources import batch_size_holder

    if spec.batch_size is not None:
        return spec.batch_size
    holder = batch_size_holder(model, datamodule)
    return holder[1] if holder is not None else None


def _has_predict_data(model: pl.LightningModule, datamodule: pl.LightningDataModule | None) -> bool:
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return is_overridden("predict_dataloader", datamodule) or is_overridden("predict_dataloader", model)


def _comparable_to_peak(sample: MemorySample) -> int:
    """The in-use figure measured on the same scale as ``sample.peak``: allocator bytes on CUDA, RSS on CPU."""
    return sample.allocated if sample.source == "cuda" else sample.reserved


Builder = Callable[[RunSpec], "tuple[pl.LightningModule, pl.LightningDataModule]"]


def build_reference_workload(spec: RunSpec) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    """The default builder: the reference workload ``spec.workload`` with the spec's data settings."""
    from lightning_perf.benchmark.sources import LOADER_SETTINGS
    from lightning_perf.demos import make_workload

    loader = {name: getattr(spec, name) for name in LOADER_SETTINGS} | spec.loader_overrides
    return make_workload(spec.workload, spec.preset, batch_size=spec.batch_size, seed=spec.seed, **loader)


def _count_flops(spec: RunSpec, build: Builder, device: torch.device, result: RunResult) -> None:
    """Fill ``result.flops_*`` from a fresh build of the workload; a failure is recorded, never raised."""
    try:
        pl.seed_everything(spec.seed, workers=True, verbose=False)
        model, datamodule = build(spec)
        count = training_step_flops(model, datamodule, device)
    except Exception as exc:  # the user's model may not run outside a Trainer: utilization stays unknown
        result.flops_error = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return
    if count.total <= 0:
        result.flops_error = "the training step counted 0 FLOPs (no matmul or convolution torch can count)"
        return
    result.flops_per_step = count.total
    result.flops_by_operator = dict(count.by_operator)


@contextlib.contextmanager
def recording_no_effect(into: list[str]) -> Iterator[None]:
    """Keep the text of each :class:`~lightning_perf.NoEffectWarning` raised inside, still shown as usual.

    A configuration whose callback did not apply (float8 that kept every layer in bf16, channels-last on a model with
    no convolution) measures the model without it: the report must say so beside its row, not leave it to a warning
    lost in a worker's stderr.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("always", NoEffectWarning)
        shown = warnings.showwarning

        def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            text = " ".join(str(message).split())
            if issubclass(category, NoEffectWarning) and text not in into:
                into.append(text)
            shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        yield


def run(spec: RunSpec, build: Builder | None = None) -> RunResult:
    """Train and measure one configuration in this process.

    ``build`` makes the model and data module (default: :func:`build_reference_workload`); the auto-tuner passes one
    that loads the user's own and applies the spec's batch size and loader settings to them. A callback's
    :class:`~lightning_perf.NoEffectWarning` is kept in ``no_effect``. ``spec.threads`` sets torch's intra-op threads
    for the run (put back afterwards, for a run in the caller's process); the count used is kept in ``threads``.
    """
    no_effect: list[str] = []
    before = torch.get_num_threads()
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    try:
        with recording_no_effect(no_effect):
            result = _run(spec, build)
        result.threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    result.no_effect = no_effect
    return result


def _run(spec: RunSpec, build: Builder | None) -> RunResult:
    from lightning_perf.benchmark.configs import get_config

    wall_start = time.perf_counter()
    result = RunResult(spec=asdict(spec))
    device = as_device(spec.device)
    config = get_config(spec.config)
    reason = config.why_not(device) or config.why_not_stage(spec.stage)
    if reason is not None:
        result.ok, result.skipped = False, reason
        return result
    build, source = _builder(spec, build)
    pl.seed_everything(spec.seed, workers=True, verbose=False)
    t0 = time.perf_counter()
    model, datamodule = build(spec)
    result.model_init_s = time.perf_counter() - t0
    result.batch_size = _batch_size_of(model, datamodule, spec)
    settings = dict(source.trainer_settings()) if hasattr(source, "trainer_settings") else {}
    file_callbacks = list(settings.pop("callbacks", []) or [])
    settings.pop("precision", None)  # the runner resolved it into spec.precision (a file's precision included)
    result.trainer_settings = sorted(settings) + (["callbacks"] if file_callbacks else [])
    # The bench's own settings, then the file's, then the configuration's own (its precision over the file's).
    trainer_kwargs = {"accelerator": device.type, "devices": 1, "precision": spec.precision, **QUIET_FIT_KWARGS}
    clock = _StepClock(device, spec.warmup_steps)  # its untimed steps: warm-up, and on a CPU memory and settling
    trainer_kwargs |= {"max_steps": clock.untimed_steps + spec.steps, **settings, **config.trainer_kwargs}
    result.precision = str(trainer_kwargs["precision"])
    if config.strategy is not None:
        trainer_kwargs["strategy"] = config.strategy()
    callbacks = [*file_callbacks, *config.callbacks()]
    for callback in callbacks:  # what the configuration's first run decided by timing: every repeat runs that code
        if state := spec.decided.get(type(callback).__name__):
            callback.load_state_dict(state)
    if spec.stage != "fit":
        _time_inference_stage(spec, model, datamodule, trainer_kwargs, callbacks, result)
        result.wall_s = time.perf_counter() - wall_start
        return result
    pl.Trainer(callbacks=[clock, *callbacks], **trainer_kwargs).fit(model, datamodule=datamodule)
    _record_steps(clock, spec.steps, result)
    result.decided = {type(c).__name__: c.state_dict() for c in callbacks if getattr(c, "first_batch", None)}
    if spec.predict_batches > 0 and not _has_predict_data(model, datamodule):
        result.predict_skipped = "neither the data module nor the model defines predict_dataloader"
    elif spec.predict_batches > 0:
        _time_predict(spec, model, datamodule, trainer_kwargs, callbacks, result)
    result.wall_s = time.perf_counter() - wall_start
    if spec.count_flops:  # after every timed and memory-measured part, on a fresh copy of the untransformed workload
        _count_flops(spec, build, device, result)
    return result


def _builder(spec: RunSpec, build: Builder | None) -> tuple[Builder, Any]:
    """What builds the model and data (the given ``build``, the spec's source, or a reference workload) and the source
    whose ``trainer_settings`` apply (``None`` for a reference workload)."""
    if build is None and spec.source is not None:
        from lightning_perf.benchmark.sources import source_from_dict

        source: Any = source_from_dict(spec.source)
        return source.build, source
    if build is not None:  # a ModelSource's bound build: its trainer settings apply too
        return build, getattr(build, "__self__", None)
    return build_reference_workload, None


QUIET_FIT_KWARGS: dict[str, Any] = {
    "max_epochs": -1,
    "limit_val_batches": 0,
    "num_sanity_val_steps": 0,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
"""Trainer arguments of a timed fit: steps bounded by ``max_steps`` alone, and nothing that costs time beside them."""


def _time_inference_stage(spec: RunSpec, model: Any, datamodule: Any, trainer_kwargs: dict[str, Any],
                          callbacks: list[Callback], result: RunResult) -> None:  # fmt: skip
    from lightning_perf.benchmark.inference import measure_inference

    figures = measure_inference(spec.stage, model, datamodule, trainer_kwargs, callbacks, as_device(spec.device),
                                spec.warmup_steps, spec.steps, result.batch_size)  # fmt: skip
    for key, value in figures.items():
        setattr(result, key, value)
    # The per-batch latency is this run's "step": the summary, the reliability checks and compare read it there.
    result.step_times_s, result.step_median_s = list(result.predict_step_times_s), result.predict_step_median_s


def _record_steps(clock: _StepClock, steps: int, result: RunResult) -> None:
    """The fit's figures: steady step times, the cold first batch, forward and step, memory, losses."""
    steady = clock.timer.summary()
    if "step" not in steady or steady["step"].count == 0:
        raise RuntimeError(f"No steady-state step was measured: raise --steps (got {steps}).")
    step_stats = steady["step"]
    for figure in ("first_batch_s", "first_forward_s", "first_step_s", "warmup_s", "losses", "data_wait_s"):
        setattr(result, figure, getattr(clock, figure))
    result.step_median_s = step_stats.median
    result.step_times_s = [record["step"] for record in clock.timer.steps]
    result.throughput = result.batch_size / step_stats.median if result.batch_size else None
    sample = clock.memory_after or clock.probe.sample()
    result.peak_memory_bytes = int(sample.peak)
    if clock.memory_before_steps is not None:
        result.step_memory_bytes = max(0, int(sample.peak) - int(clock.memory_before_steps))
    result.memory_source = sample.source
    result.final_train_loss = clock.last_loss


def _time_predict(spec: RunSpec, model: Any, datamodule: Any, trainer_kwargs: dict[str, Any],
                  callbacks: list[Callback], result: RunResult) -> None:  # fmt: skip
    """Time ``spec.predict_batches`` predict batches after the fit (two of them warm-up), under the same callbacks."""
    from lightning_perf.benchmark.inference import predict_as_trained

    datamodule.setup("predict")
    available = len(datamodule.predict_dataloader())
    if available < 2:
        raise RuntimeError(f"The predict split has {available} batch(es); inference timing needs at least 2.")
    predict_batches = min(spec.predict_batches, available)
    warmup_batches = min(2, predict_batches - 1)  # at least one steady batch remains
    predict_clock = _PredictClock(as_device(spec.device), warmup_batches)
    kwargs = {k: v for k, v in trainer_kwargs.items() if k not in ("max_steps", "max_epochs", "strategy")}
    kwargs["limit_predict_batches"] = predict_batches
    predictor = pl.Trainer(callbacks=[predict_clock, *callbacks], **kwargs)
    predict_as_trained(predictor, model, datamodule)
    predict_stats = predict_clock.timer.summary().get("predict")
    if predict_stats is not None and predict_stats.count:
        result.predict_step_median_s = predict_stats.median
        result.predict_step_times_s = [record["predict"] for record in predict_clock.timer.steps]
        result.predict_throughput = result.batch_size / predict_stats.median if result.batch_size else None
