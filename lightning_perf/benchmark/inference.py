"""The inference benchmark of one run: ``trainer.predict`` / ``validate`` / ``test`` of the model as built, timed per
batch (``lightning-perf bench --stage predict``).

Design notes (what is timed, warm-up, ``predict`` without ``predict_step``): docs/architecture.md, Module notes.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_perf._device import synchronize
from lightning_perf.benchmark.spec import MEMORY_STEPS, SETTLE_STEPS
from lightning_perf.functional.inputs import call_of
from lightning_perf.profiling import MemoryProbe, MemorySample, PhaseTimer, truthful_cpu_peak
from lightning_perf.profiling.stats import median, percentile
from lightning_perf.profiling.step_phases import batch_size_of

__all__ = ["INFERENCE_STAGES", "LATENCY_PERCENTILES", "measure_inference", "predict_as_trained"]

INFERENCE_STAGES = ("predict", "validate", "test")
LATENCY_PERCENTILES = (50.0, 95.0, 99.0)

# What each stage calls the hooks and the Trainer argument that limits its batches.
_LIMIT = {"predict": "limit_predict_batches", "validate": "limit_val_batches", "test": "limit_test_batches"}
_LOADER = {"predict": "predict_dataloader", "validate": "val_dataloader", "test": "test_dataloader"}


class _InferenceClock(Callback):
    """Times every batch of one inference stage; the memory probe's peak restarts after the warm-up batches. On a CPU
    memory is measured over the next ``memory`` batches, and the timed ones come after
    :data:`~lightning_perf.benchmark.spec.SETTLE_STEPS` more, as in a fit (``memory=0``: no memory figure)."""

    def __init__(self, stage: str, device: torch.device, warmup: int, memory: int = 0) -> None:
        self.stage, self.device, self.warmup = stage, device, warmup
        cpu = device.type == "cpu"
        self.memory_end = warmup + memory if cpu and memory else None
        self.untimed = warmup + (memory + SETTLE_STEPS if self.memory_end else 0)
        self.measures_memory = not cpu or self.memory_end is not None
        self.memory_after: MemorySample | None = None
        self.timer = PhaseTimer(device=device, warmup_steps=self.untimed)
        self.probe = MemoryProbe(device)
        self.samples: list[int] = []
        self.first_batch_s: float | None = None
        self.warmup_s: float | None = None
        self.memory_before: int | None = None
        self._start_ns: int | None = None
        self._done = 0
        hook = "validation" if stage == "validate" else stage
        setattr(self, f"on_{hook}_start", self._stage_start)
        setattr(self, f"on_{hook}_batch_start", self._batch_start)
        setattr(self, f"on_{hook}_batch_end", self._batch_end)

    def _stage_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        synchronize(self.device)
        self._start_ns = time.perf_counter_ns()

    def _batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        size = batch_size_of(batch)
        if size is not None and self._done >= self.untimed:
            self.samples.append(size)
        self.timer.start("batch")

    def _batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.timer.stop("batch")
        self.timer.end_step()
        self._done += 1
        if self._done == 1 or self._done == self.warmup:
            synchronize(self.device)  # twice per run, at the cold batch and at the warm-up boundary
            assert self._start_ns is not None
            elapsed = (time.perf_counter_ns() - self._start_ns) / 1e9
            if self._done == 1:
                self.first_batch_s = elapsed
            if self._done == self.warmup:
                self.warmup_s = elapsed
                sample = self.probe.sample()
                self.memory_before = sample.allocated if sample.source == "cuda" else sample.reserved
                self.probe.reset_peak()
        if self._done == self.memory_end:
            self.memory_after = self.probe.sample()
            truthful_cpu_peak(False)  # the batches timed next allocate at full speed


def _as_trained(model: pl.LightningModule, batch: Any) -> Any:
    """``forward`` on ``batch`` called as ``training_step`` calls it (the step stops there); the whole batch, as
    Lightning's default ``predict_step`` passes it, when the step makes no call or cannot take a predict batch (one
    without the targets it unpacks)."""
    try:
        call = call_of(model, lambda: model.training_step(batch, 0), "a predict batch", cpu=False)
    except Exception:  # the user's step on a batch it was not written for: Lightning's default is the honest call
        call = None
    return model(batch) if call is None else model(*call.args, **call.kwargs)


def predict_as_trained(trainer: pl.Trainer, model: pl.LightningModule, datamodule: Any) -> None:
    """``trainer.predict`` without predictions kept; a module without its own ``predict_step`` is called as its
    ``training_step`` calls ``forward`` (Lightning's default passes the whole batch), for this run only."""
    if is_overridden("predict_step", model):
        trainer.predict(model, datamodule=datamodule, return_predictions=False)
        return
    model.predict_step = lambda batch, *_, **__: _as_trained(model, batch)  # type: ignore[method-assign]
    try:
        trainer.predict(model, datamodule=datamodule, return_predictions=False)
    finally:
        del model.predict_step


def measure_inference(
    stage: str,
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule | None,
    trainer_kwargs: dict[str, Any],
    callbacks: list[Any],
    device: torch.device,
    warmup: int,
    steps: int,
    batch_size: int | None,
) -> dict[str, Any]:
    """Run ``stage`` on the model as built for ``warmup + steps`` batches and return the measured figures.

    The figures are :class:`~lightning_perf.benchmark.worker.RunResult` fields: ``first_batch_s``, ``warmup_s``,
    ``predict_step_times_s`` (every steady batch), ``predict_step_median_s``, ``latency_p50_s``/``p95``/``p99``,
    ``predict_throughput`` (samples per second at the median batch), ``peak_memory_bytes``, ``step_memory_bytes``,
    ``memory_source``.

    Raises:
        ValueError: for a stage that is not an inference stage.
        RuntimeError: when the stage's loader has too few batches for the untimed ones and one timed batch, or no
            batch was timed.
    """
    if stage not in INFERENCE_STAGES:
        raise ValueError(f"stage={stage!r} is not valid. Expected one of {INFERENCE_STAGES}.")
    available = None
    if datamodule is not None:
        datamodule.setup(stage)
        loader = getattr(datamodule, _LOADER[stage])()
        try:
            available = len(loader)
        except TypeError:  # an iterable loader without a length: Lightning's limit decides
            available = None
        if available is not None and available < warmup + 1:
            raise RuntimeError(
                f"The {stage} data has {available} batch(es); {warmup} warm-up batch(es) and at least one timed batch "
                f"are needed (lower --warmup-steps, or give the data module more {stage} samples)."
            )
    # On a CPU: memory over up to MEMORY_STEPS batches the data can spare beside a settling one and three timed ones
    # (or all of `steps`, if fewer); none when it cannot: the timed batches come first.
    spare = MEMORY_STEPS if available is None else available - warmup - SETTLE_STEPS - min(steps, 3)
    memory = max(0, min(MEMORY_STEPS, spare))
    clock = _InferenceClock(stage, device, warmup, memory)
    if clock.memory_end is None:  # nothing measures host memory: host allocations at full speed
        truthful_cpu_peak(False)
    wanted = clock.untimed + steps
    dropped = ("max_steps", "max_epochs", "strategy", *_LIMIT.values())
    kwargs = {k: v for k, v in trainer_kwargs.items() if k not in dropped}
    kwargs[_LIMIT[stage]] = wanted
    trainer = pl.Trainer(callbacks=[clock, *callbacks], **kwargs)
    if stage == "predict":
        predict_as_trained(trainer, model, datamodule)
    else:
        getattr(trainer, stage)(model, datamodule=datamodule, verbose=False)
    times = [record["batch"] for record in clock.timer.steps]
    if not times:
        raise RuntimeError(
            f"No steady {stage} batch was timed: the data ran out after the {clock.untimed} untimed batches."
        )
    latency = median(times)
    samples = median(clock.samples) if clock.samples else batch_size
    sample = clock.memory_after or clock.probe.sample()
    figures: dict[str, Any] = {
        "first_batch_s": clock.first_batch_s,
        "warmup_s": clock.warmup_s,
        "predict_step_times_s": times,
        "predict_step_median_s": latency,
        "predict_throughput": samples / latency if samples else None,
        "peak_memory_bytes": int(sample.peak) if clock.measures_memory else None,
        "step_memory_bytes": None
        if clock.memory_before is None or not clock.measures_memory
        else max(0, int(sample.peak) - clock.memory_before),
        "memory_source": sample.source,
    }
    for q in LATENCY_PERCENTILES:
        figures[f"latency_p{q:.0f}_s"] = percentile(times, q)
    return figures
