"""Time N training steps of *your* LightningModule inside a pytest-benchmark test, with and without callbacks.

Example::

    from lightning_perf.benchmark import benchmark_training_steps
    from lightning_perf.callbacks import ChannelsLastCallback

    @pytest.mark.parametrize("callbacks", [[], [ChannelsLastCallback()]], ids=["baseline", "channels_last"])
    def test_my_model_steps(benchmark, callbacks):
        benchmark.group = "my-model"
        benchmark_training_steps(benchmark, MyModule(), MyDataModule(), callbacks=callbacks, steps=10)

``pytest --benchmark-only --benchmark-group-by=group`` then shows both side by side.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_perf.profiling import PhaseTimer


class _StepTimes(Callback):
    """Step time from one batch end to the next within a fit, so the Trainer's set-up never counts."""

    def __init__(self) -> None:
        self.timer: PhaseTimer | None = None
        self._open = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timer is None:  # on the device the model trains on, not whatever device happens to exist
            self.timer = PhaseTimer(device=pl_module.device)
        self._open = False

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        assert self.timer is not None
        if self._open:
            self.timer.stop("step")
            self.timer.end_step()
        self._open = trainer.global_step < trainer.max_steps
        if self._open:
            self.timer.start("step")


def benchmark_training_steps(
    benchmark: Any,
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule | None = None,
    *,
    train_dataloaders: Any = None,
    callbacks: Sequence[Callback] = (),
    steps: int = 10,
    warmup_steps: int = 3,
    rounds: int = 5,
    trainer_kwargs: dict[str, Any] | None = None,
) -> Any:
    """Time ``steps`` training steps of a copy of ``model`` per round with pytest-benchmark's ``benchmark`` fixture.

    A warm-up fit of ``warmup_steps`` runs first, outside the timing, so compilation, autotuning and allocator growth
    do not count. Each round is a fresh ``Trainer.fit`` of ``steps`` steps with the same callback instances, so the
    round time includes the Trainer's fixed set-up cost (identical with and without callbacks); the median steady step
    time without that cost is stored in ``benchmark.extra_info["step_median_s"]``.

    Args:
        benchmark: the pytest-benchmark fixture.
        model: the module to train; a deep copy is trained, the object passed in is left untouched.
        datamodule: its data, or pass ``train_dataloaders``.
        callbacks: the callbacks under test (empty for the baseline).
        steps: training steps per timed round.
        warmup_steps: untimed steps before the first round.
        rounds: timed rounds.
        trainer_kwargs: extra Trainer arguments (accelerator, precision, ...).

    Raises:
        ValueError: for non-positive ``steps``/``rounds`` or negative ``warmup_steps``.
    """
    for name, value, minimum in (("steps", steps, 1), ("rounds", rounds, 1), ("warmup_steps", warmup_steps, 0)):
        if not isinstance(value, int) or value < minimum:
            raise ValueError(f"benchmark_training_steps({name}={value!r}) is not valid: expected an int >= {minimum}.")
    if (datamodule is None) == (train_dataloaders is None):
        raise ValueError("benchmark_training_steps needs exactly one of `datamodule` or `train_dataloaders`.")
    model = copy.deepcopy(model)
    clock = _StepTimes()
    kwargs: dict[str, Any] = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "max_epochs": -1,
        **(trainer_kwargs or {}),
    }

    def fit(n: int, timed: bool) -> None:
        extra = [clock] if timed else []
        trainer = pl.Trainer(max_steps=n, callbacks=[*callbacks, *extra], **kwargs)
        trainer.fit(model, datamodule=datamodule, train_dataloaders=train_dataloaders)

    if warmup_steps:
        fit(warmup_steps, timed=False)
    result = benchmark.pedantic(fit, args=(steps, True), rounds=rounds, iterations=1)
    stats = clock.timer.summary().get("step") if clock.timer is not None else None
    benchmark.extra_info.update(
        steps=steps,
        warmup_steps=warmup_steps,
        callbacks=[type(cb).__name__ for cb in callbacks],
        step_median_s=stats.median if stats is not None else None,
        step_p90_s=stats.p90 if stats is not None else None,
    )
    return result
