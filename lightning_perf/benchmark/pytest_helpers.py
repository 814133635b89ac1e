"""Time N training steps of *your* LightningModule inside a pytest-benchmark test, with and without callbacks.

Entry point: :func:`benchmark_training_steps`; ``benchmark.extra_info`` holds each speed-up with its 95% interval and
verdict. An example and the measurement notes: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_perf._validation import check_int

__all__ = ["benchmark_training_steps"]

_process_warmed_up = False
"""Whether this process has trained once already: the first ``Trainer.fit`` of a process pays for lazy imports,
thread pools and allocator growth, and without a throwaway fit first, whichever configuration a test session measured
first looked slower than the rest (a no-op once came out 1.6x faster than it)."""


class _StepTimes(Callback):
    """Step times from one batch end to the next within each fit (one list per fit), so set-up never counts."""

    def __init__(self) -> None:
        self.fits: list[list[float]] = []
        self._last: int | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fits.append([])
        self._last = None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if pl_module.device.type == "cuda":
            import torch

            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter_ns()
        if self._last is not None:
            self.fits[-1].append((now - self._last) / 1e9)
        self._last = now


def _check(steps: Any, warmup_steps: Any, rounds: Any, compare_with: Any, name: Any) -> None:
    for arg, value, minimum in (("steps", steps, 2), ("rounds", rounds, 1), ("warmup_steps", warmup_steps, 0)):
        check_int("benchmark_training_steps", arg, value, minimum)
    if compare_with is not None:
        if not isinstance(compare_with, Mapping) or not all(
            isinstance(k, str) and k and not isinstance(v, (str, Callback)) and isinstance(v, Sequence)
            for k, v in compare_with.items()
        ):
            raise ValueError(
                f"`benchmark_training_steps(compare_with={compare_with!r})` is not valid. Expected a dict of "
                "configuration name -> list of callbacks, e.g. {'baseline': []}."
            )
        if name in compare_with:
            raise ValueError(
                f"`benchmark_training_steps(name={name!r})` is also a key of compare_with. Expected distinct names."
            )


def benchmark_training_steps(
    benchmark: Any,
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule | None = None,
    *,
    train_dataloaders: Any = None,
    callbacks: Sequence[Callback] = (),
    compare_with: Mapping[str, Sequence[Callback]] | None = None,
    name: str | None = None,
    steps: int = 10,
    warmup_steps: int = 3,
    rounds: int = 5,
    trainer_kwargs: dict[str, Any] | None = None,
) -> Any:
    """Time ``steps`` training steps of a copy of ``model`` per round with pytest-benchmark's ``benchmark`` fixture.

    Every configuration (``callbacks`` and each of ``compare_with``) trains its own copy of ``model`` and is warmed
    up the same way first: an untimed fit of ``warmup_steps`` steps with its own callbacks. The first call in a
    process also runs one throwaway fit before anything, so the configuration measured first does not pay for the
    process's first Trainer. Each round is a fresh ``Trainer.fit`` of ``steps`` steps; the ``compare_with``
    configurations run their round just before each timed round of ``callbacks`` (pytest-benchmark times only
    ``callbacks``; the others are timed by the same per-step clock).

    ``benchmark.extra_info`` gets ``steps``, ``warmup_steps``, ``rounds``, ``callbacks``, ``step_median_s``,
    ``step_p90_s``, ``step_times_s`` (per round), ``order`` (the configurations in the order they ran) and, with
    ``compare_with``, ``comparisons``: per name, ``speedup`` (its step time / this one's), ``speedup_ci95``,
    ``speedup_verdict``, ``speedup_method`` and its ``step_median_s``. With exactly one comparison these are also at
    the top level (``speedup``, ``speedup_ci95``, ``verdict``, ``speedup_method``, ``compared_with``).

    Args:
        benchmark: the pytest-benchmark fixture.
        model: the module to train; deep copies are trained, the object passed in is left untouched.
        datamodule: its data, or pass ``train_dataloaders``.
        callbacks: the callbacks under test (empty for the baseline).
        compare_with: other configurations to measure interleaved with this one, name -> callbacks.
        name: this configuration's name in ``order`` (default: its callbacks' class names, or ``baseline``).
        steps: training steps per round (the first of each fit is not timed: the clock starts at its end).
        warmup_steps: untimed steps per configuration before its first round.
        rounds: timed rounds per configuration.
        trainer_kwargs: extra Trainer arguments (accelerator, precision, ...).

    Raises:
        ValueError: for ``steps`` below 2, non-positive ``rounds``, negative ``warmup_steps``, a malformed
            ``compare_with``, or not exactly one of ``datamodule`` and ``train_dataloaders``.
    """
    from lightning_perf.benchmark.worker import QUIET_FIT_KWARGS

    name = name or "+".join(type(cb).__name__ for cb in callbacks) or "baseline"
    _check(steps, warmup_steps, rounds, compare_with, name)
    if (datamodule is None) == (train_dataloaders is None):
        raise ValueError("`benchmark_training_steps` needs exactly one of `datamodule` or `train_dataloaders`.")
    configs = {name: list(callbacks), **{k: list(v) for k, v in (compare_with or {}).items()}}
    data = {"datamodule": datamodule, "train_dataloaders": train_dataloaders}
    fits = _Fits(model, configs, data, {**QUIET_FIT_KWARGS, **(trainer_kwargs or {})})
    fits.warm_up(warmup_steps)
    others = [k for k in configs if k != name]

    def other_rounds() -> None:
        for config in others:
            fits.run(config, steps, timed=True)

    result = benchmark.pedantic(lambda: fits.run(name, steps, True), setup=other_rounds, rounds=rounds, iterations=1)
    info: dict[str, Any] = {"steps": steps, "warmup_steps": warmup_steps, "rounds": rounds}
    info["callbacks"] = [type(cb).__name__ for cb in callbacks]
    benchmark.extra_info.update(info | _timings(fits, name, others, compared=compare_with is not None))
    return result


class _Fits:
    """Fresh ``Trainer.fit`` runs of each configuration on its own copy of the model; a timed one is clocked by the
    configuration's :class:`_StepTimes` and appended to :attr:`order`."""

    def __init__(self, model: pl.LightningModule, configs: dict[str, list[Callback]], data: dict[str, Any],
                 trainer_kwargs: dict[str, Any]) -> None:  # fmt: skip
        self.model, self.configs, self.data, self.trainer_kwargs = model, configs, data, trainer_kwargs
        self.models = {k: copy.deepcopy(model) for k in configs}
        self.clocks = {k: _StepTimes() for k in configs}
        self.order: list[str] = []

    def run(self, config: str, n: int, timed: bool, module: pl.LightningModule | None = None) -> None:
        extra = [self.clocks[config]] if timed else []
        trainer = pl.Trainer(max_steps=n, callbacks=[*self.configs.get(config, []), *extra], **self.trainer_kwargs)
        trainer.fit(module or self.models[config], **self.data)
        if timed:
            self.order.append(config)

    def warm_up(self, steps: int) -> None:
        """The process's first fit, thrown away (see :data:`_process_warmed_up`), then ``steps`` untimed steps of
        every configuration, the measured one included."""
        global _process_warmed_up
        if not _process_warmed_up:
            self.run("process warm-up", max(steps, 1), timed=False, module=copy.deepcopy(self.model))
            _process_warmed_up = True
        for config in self.configs if steps else ():
            self.run(config, steps, timed=False)


def _timings(fits: _Fits, name: str, others: list[str], compared: bool) -> dict[str, Any]:
    """The ``extra_info`` of ``name``'s step times and, with ``compared``, of its ratios against the ``others``."""
    from lightning_perf.profiling.intervals import paired_ratio
    from lightning_perf.profiling.stats import summarize

    mine = fits.clocks[name].fits
    stats = summarize(flat) if (flat := [t for f in mine for t in f]) else None
    info: dict[str, Any] = {
        "step_median_s": stats.median if stats is not None else None,
        "step_p90_s": stats.p90 if stats is not None else None,
        "step_times_s": mine,
        "order": fits.order,
    }
    comparisons = {}
    for other in others:
        theirs = fits.clocks[other].fits
        if mine and theirs and all(mine) and all(theirs):
            median = summarize([t for f in theirs for t in f]).median
            comparisons[other] = paired_ratio(theirs, mine).to_dict("speedup") | {"step_median_s": median}
    if compared:
        info["comparisons"] = comparisons
    if len(comparisons) == 1:
        (other, found), *_ = comparisons.items()
        info.update(compared_with=other, speedup=found["speedup"], speedup_ci95=found["speedup_ci95"],
                    verdict=found["speedup_verdict"], speedup_method=found["speedup_method"])  # fmt: skip
    return info
