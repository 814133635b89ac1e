"""The auto-tuner: try the optimizations on the user's own model, one measured trial at a time, keep what helps.

Entry point: :class:`AutoTuner` (:class:`TuningError`, :class:`ModelError`). Every trial runs in a fresh process through
the bench's worker, and every ratio carries a 95% interval and a verdict. The keep rule, disturbed trials and the
search's order: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lightning_perf._validation import check_bool, check_choice, check_instance, check_int, check_number
from lightning_perf.benchmark.settle import Settling
from lightning_perf.benchmark.sources import (
    LOADER_SETTINGS,
    ModelSource,
    ObjectSource,
    WorkloadSource,
    batch_size_holder,
    init_parameters,
)
from lightning_perf.benchmark.spec import RunSpec, check_preset, check_workload, resolve_device
from lightning_perf.benchmark.structure import ModelStructure, structure_of
from lightning_perf.benchmark.threads import ThreadChoice, choose_threads, start_load_note
from lightning_perf.optimizations import STAGES, tuner_alternatives
from lightning_perf.profiling.machine import describe_machine
from lightning_perf.profiling.stats import median
from lightning_perf.tuning.conditions import TrialWatch
from lightning_perf.tuning.inference import NO_DATA_STAGE, search_plan, too_few_batches, trial_skip_reason
from lightning_perf.tuning.recommend import bench_command, long_warmup, recommend
from lightning_perf.tuning.remeasure import Remeasuring
from lightning_perf.tuning.results import Trial, TuningResult
from lightning_perf.tuning.trials import check_search_lists, memory_problem, resolve_isolation, run_in_process
from lightning_perf.tuning.verdicts import compare, loss_deviation, per_sample_times, speedup_estimate

ISOLATION = ("auto", "process", "in-process")
# Data wait below this share of the step leaves nothing for more loader workers to win.
DATA_WAIT_THRESHOLD = 0.05
# A gain must exceed this many times the difference between two baseline runs (process-to-process noise).
NOISE_FACTOR = 1.5
# Rough cost of a trial relative to the last one: compiling adds a cold compilation to the warm-up.
_COMPILE_COST_FACTOR = 4.0


class TuningError(RuntimeError):
    """The tuner cannot go on (a budget too small for one trial, no usable baseline)."""


class ModelError(TuningError):
    """The user's model failed under its own settings; the message carries the model's traceback."""


@dataclass(frozen=True)
class Candidate:
    """One configuration to measure: bench configuration names stacked, plus batch size and loader settings."""

    label: str
    stage: str
    configs: tuple[str, ...] = ()
    batch_size: int | None = None  # None: the model's own
    loader: tuple[tuple[str, Any], ...] = ()

    @property
    def config_name(self) -> str:
        return "+".join(self.configs) or "baseline"

    def with_(self, label: str, stage: str, **changes: Any) -> Candidate:
        return replace(self, label=label, stage=stage, **changes)


def _model_source(
    model: Any, datamodule: Any, workload: str | None, source: Any, preset: str | None, device: str, seed: int
) -> tuple[ModelSource, str | None]:
    """What the tuner measures, from exactly one of: ``model`` and ``datamodule``, a workload, a source; and the
    workload's preset (``preset`` for the others)."""
    import lightning.pytorch as pl

    given = [model is not None or datamodule is not None, workload is not None, source is not None]
    if sum(given) != 1:
        raise ValueError(
            "AutoTuner needs exactly one of: `model` and `datamodule`, `workload=`, or `source=` "
            f"(got model={type(model).__name__ if model is not None else None}, workload={workload!r}, "
            f"source={source!r})."
        )
    if given[0]:
        check_instance("AutoTuner", "model", model, pl.LightningModule, "a LightningModule")
        expected = "a LightningDataModule (wrap plain DataLoaders with `LightningDataModule.from_datasets`)"
        check_instance("AutoTuner", "datamodule", datamodule, pl.LightningDataModule, expected)
        return ObjectSource.from_objects(model, datamodule), preset
    if workload is not None:
        size = check_preset(preset, device.split(":")[0], "AutoTuner")
        return WorkloadSource(check_workload(workload, "AutoTuner"), size, seed), size
    check_instance("AutoTuner", "source", source, ModelSource, "a lightning_perf.benchmark.sources.ModelSource")
    return source, preset


def _check_settings(settings: dict[str, Any]) -> None:
    """Refuse a bad search setting of :class:`AutoTuner` (``settings``: its arguments by name) before anything runs."""
    check_number("AutoTuner", "time_budget_s", settings["time_budget_s"], 0.0, exclusive=True)
    check_int("AutoTuner", "steps", settings["steps"], 3)
    check_int("AutoTuner", "warmup_steps", settings["warmup_steps"], 1)
    check_number("AutoTuner", "min_gain", settings["min_gain"], 0.0)
    check_number("AutoTuner", "confidence", settings["confidence"], 0.5, 1.0)
    check_number("AutoTuner", "loss_rtol", settings["loss_rtol"], 0.0, exclusive=True)
    check_number("AutoTuner", "confirm_below", settings["confirm_below"], 1.0)
    for name, minimum in (("max_batch_size", 1), ("max_num_workers", 0), ("threads", 1)):
        check_int("AutoTuner", name, settings[name], minimum, allow_none=True)
    check_choice("AutoTuner", "isolation", settings["isolation"], ISOLATION)
    for flag in ("tune_batch_size", "tune_data_loading", "noise_check", "progress"):
        check_bool("AutoTuner", flag, settings[flag])
    if isinstance(settings["seed"], bool) or not isinstance(settings["seed"], int):
        raise TypeError(f"`AutoTuner(seed={settings['seed']!r})` is not valid. Expected an integer.")


class AutoTuner(Remeasuring):
    """Measure the user's own model and recommend the fastest configuration that keeps its losses.

    Example::

        tuner = AutoTuner(MyModel(), MyDataModule(), time_budget_s=300)
        result = tuner.run()  # prints progress and the table
        trainer = Trainer(callbacks=result.recommendation.callbacks(), **result.recommendation.trainer_kwargs)
        result.write("tuned.yaml", "tuned.json")  # `python train.py fit --config tuned.yaml` with LightningCLI

    Args:
        model: the user's ``LightningModule`` (copied for every trial, never modified).
        datamodule: its ``LightningDataModule`` (copied likewise).
        workload: a reference workload name instead of ``model``/``datamodule`` (``preset`` picks its size; ``None``:
            ``gpu`` on a CUDA device where the workload has it, else ``default``).
        source: a :class:`~lightning_perf.benchmark.sources.ModelSource` instead of the above (the CLI's import paths).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"`` (CUDA when one is visible; ``device_reason`` says
            why).
        stage: the Trainer stage to tune: ``"fit"`` (training steps), or ``"predict"``, ``"validate"``, ``"test"``
            (per-batch inference latency; :mod:`lightning_perf.tuning.inference`).
        time_budget_s: wall-clock budget for the whole search; trials that would not fit are skipped.
        steps: measured steps per trial (after ``warmup_steps`` excluded ones).
        warmup_steps: excluded steps at the start of each trial (compilation, allocator growth).
        precisions: mixed precisions to try (default: those the device supports).
        optimizations: bench configuration names to try stacking, in order (default: the optimization stage's
            search list of :mod:`lightning_perf.optimizations`).
        tune_batch_size: try larger batch sizes (changes the optimization: scale the learning rate to match).
        max_batch_size: largest batch size to try (default: 4x the model's own).
        tune_data_loading: try DataLoader workers when the data wait is a noticeable share of the step.
        max_num_workers: most DataLoader workers to try (default: the CPU count).
        min_gain: smallest per-sample speed-up worth keeping (0.03: 3%).
        confidence: required share of step pairs in which the candidate is faster (0.5-1).
        loss_rtol: largest median relative difference of per-step losses from the baseline's.
        noise_check: measure the baseline twice, in two processes, and require every gain to exceed
            ``NOISE_FACTOR`` times their difference as well as ``min_gain`` (a noisy machine keeps only large wins).
        confirm_below: a win smaller than this (per sample) is kept only if a second pair of processes (candidate and
            incumbent measured again) confirms it; 1.0 keeps single-pair wins above the noise bar unconfirmed.
        isolation: ``"process"`` (a fresh spawned process per trial), ``"in-process"`` (copies of the objects,
            global torch state restored after each trial), or ``"auto"`` (process unless the objects cannot travel).
        progress: print a line per trial as it runs.
        threads: every trial's intra-op threads; ``None``: decided at the start from the usable cores and the load
            (:func:`~lightning_perf.benchmark.threads.decide_threads`), the same for every trial; a load present at
            the start is watched for up to a minute first, as by the bench (not taken from ``time_budget_s``).
    """

    def __init__(
        self,
        model: Any = None,
        datamodule: Any = None,
        *,
        workload: str | None = None,
        preset: str | None = None,
        source: ModelSource | None = None,
        device: str = "cpu",
        stage: str = "fit",
        time_budget_s: float = 300.0,
        steps: int = 10,
        warmup_steps: int = 3,
        precisions: Sequence[str] | None = None,
        optimizations: Sequence[str] | None = None,
        tune_batch_size: bool = True,
        max_batch_size: int | None = None,
        tune_data_loading: bool = True,
        max_num_workers: int | None = None,
        min_gain: float = 0.03,
        confidence: float = 0.75,
        loss_rtol: float = 0.05,
        noise_check: bool = True,
        confirm_below: float = 1.5,
        isolation: str = "auto",
        seed: int = 0,
        progress: bool = True,
        threads: int | None = None,
    ) -> None:
        device, self.device_reason = resolve_device(device, "AutoTuner", "the tuner")
        self.source, self.preset = _model_source(model, datamodule, workload, source, preset, device, seed)
        _check_settings(locals())
        self.stage = check_choice("AutoTuner", "stage", stage, STAGES)
        optimizations = check_search_lists(precisions, optimizations, self.stage)
        self.device = str(device)
        self.time_budget_s = float(time_budget_s)
        self.steps, self.warmup_steps = steps, warmup_steps
        self.precisions = tuple(precisions) if precisions is not None else None
        self.optimizations = tuple(optimizations)
        self.tune_batch_size, self.max_batch_size = tune_batch_size, max_batch_size
        self.tune_data_loading, self.max_num_workers = tune_data_loading, max_num_workers
        self.min_gain, self.confidence, self.loss_rtol = float(min_gain), float(confidence), float(loss_rtol)
        self.noise_check, self.confirm_below = noise_check, float(confirm_below)
        self.isolation, self.seed, self.progress, self.threads = isolation, seed, progress, threads
        # Filled by run()
        self._trials: list[Trial] = []
        self._deadline = 0.0
        self._stretch: Settling | None = None  # the budget's stretch for disturbed runs measured again
        self._tries = 0  # runs of the last trial (more than one: disturbed ones were set aside)
        self._threads = ThreadChoice(1, 1, None, None, "not decided yet")
        self._tmp: Path | None = None
        self._count = 0
        self._required_gain = 1 + self.min_gain
        self._base_runs: list[list[float]] = []
        self._base_label = "baseline"
        self._unreliable: list[str] = []  # why the reference measurement cannot be trusted (then: no recommendation)
        self._structure = ModelStructure()
        self._probes: Any = None  # the condition watcher's counters (None: the real ones)
        self._watch = TrialWatch(self.device)

    # ------------------------------------------------------------------ the search

    def run(self) -> TuningResult:
        """Run the search and return every trial with the recommendation. Raises :class:`ModelError` at once when
        the model fails under its own settings, and :class:`TuningError` when the budget cannot fit two trials."""
        start = time.monotonic()
        self._deadline = start + self.time_budget_s
        self._stretch = Settling(time_budget_s=self.time_budget_s, clock=time.monotonic)
        self._trials, self._count = [], 0
        self._required_gain, self._base_runs, self._unreliable = 1 + self.min_gain, [], []
        model, datamodule = self.source.load()  # a private copy, for introspection only
        holder = batch_size_holder(model, datamodule)
        dm_params, model_params = sorted(init_parameters(datamodule)), sorted(init_parameters(model))
        own_loader = {k: getattr(datamodule, k) for k in LOADER_SETTINGS if hasattr(datamodule, k)}
        # Probed once, here (no trial needed to know); the same facts decide the bench's default set.
        self._structure = structure_of(model, datamodule)
        self._plan = search_plan(
            self.stage, self.precisions, self.optimizations, device=self.device, structure=self._structure
        )
        del model, datamodule
        isolation = resolve_isolation(self.isolation, self.source)
        self._watch = TrialWatch(self.device, self._probes)  # samples the starting load the threads are chosen from
        # As the bench: a load present at the start is watched for up to a minute, so a burst that ends does not
        # decide the whole search; the watching is not taken from the search's budget. Unlike the bench, the search
        # keeps that count: every stage compares against a baseline measured at it.
        self._threads = choose_threads(self._watch, self.threads, describe_machine(), self._say)
        self._deadline += self._threads.watched_s
        start_load = self._watch.judge_from(self._threads)
        self._say(
            f"autotune ({self.stage}): {self.source.describe()} on {self.device}, budget {self.time_budget_s:.0f} s, "
            f"{self.warmup_steps}+{self.steps} steps per trial, {isolation}; {self._threads.line}"
            + (f"; {start_load}" if start_load else "")
        )

        with tempfile.TemporaryDirectory(prefix="lightning-perf-autotune-") as tmp:
            self._tmp = Path(tmp)
            self._isolation = isolation
            baseline_candidate = Candidate("baseline", "baseline")
            baseline, base_result = self._baseline(baseline_candidate)
            incumbent = (baseline_candidate, baseline, base_result)
            if not self._unreliable:
                incumbent = self._precision_stage(incumbent, base_result)
                incumbent = self._optimization_stage(incumbent, base_result)
                if self.tune_data_loading:
                    incumbent = self._data_stage(incumbent, base_result, own_loader)
                if self.tune_batch_size:
                    incumbent = self._batch_size_stage(incumbent, holder)

        for trial in self._trials:  # every reason quotes the row's own "vs baseline" figure, never another one
            if trial.speedup is not None and trial.verdict != "baseline" and trial.speedup_text not in trial.reason:
                trial.reason = "; ".join(x for x in (trial.reason, f"{trial.speedup_text} vs baseline") if x)
        candidate, best, _ = incumbent
        recommendation = recommend(candidate, best, holder, dm_params, self._unreliable, self.stage)
        recommendation.notes += filter(None, [start_load_note(self._threads, self._watch)])
        disturbed = [f"{t.label}: {'; '.join(t.disturbed)}" for t in self._trials if t.disturbed]
        result = TuningResult(
            source=self.source.describe(),
            device=self.device,
            stage=self.stage,
            time_budget_s=self.time_budget_s,
            elapsed_s=time.monotonic() - start,
            trials=self._trials,
            recommendation=recommendation,
            datamodule_init_args=dm_params,
            model_init_args=model_params,
            batch_size_holder=holder[0] if holder else None,
            bench_command=None if self._unreliable else bench_command(self.source, self.device, candidate, self.stage),
            reliability={
                "reliable": not self._unreliable,
                "causes": list(self._unreliable) or disturbed,
                "disturbed_trials": [t.label for t in self._trials if t.disturbed],
                "remeasured_trials": [t.label for t in self._trials if t.remeasured_because],
            },
            threads=self._threads.to_dict(),
        )
        if self.progress:
            result.print()
        return result

    def _baseline(self, candidate: Candidate) -> tuple[Trial, Any]:
        result, first, causes = self._trial(candidate, timeout=self.time_budget_s)
        trial = self._record(candidate, result, causes, first)
        if result is None:
            raise TuningError(
                f"time_budget_s={self.time_budget_s:g} is too small: the baseline trial ({self.warmup_steps}+"
                f"{self.steps} steps) did not finish within it. A run needs at least twice one trial's time; "
                f"raise time_budget_s or lower steps."
            )
        if not result.ok and result.skipped:
            raise TuningError(f"The baseline trial cannot be measured: {result.skipped}.")
        if not result.ok:
            raise ModelError(
                f"The model failed its baseline trial, its {self.stage} run as given (fp32, its own batch size and "
                "loaders), so there is nothing to tune. This is the model's own error:\n\n"
                + (result.traceback or result.error or "no traceback")
            )
        trial.verdict = "baseline"
        self._base_runs = [per_sample_times(result)]
        self._base_label = candidate.label
        if causes:
            self._unreliable = [f"baseline: {c}" for c in causes]
            trial.reason = f"unreliable: {'; '.join(causes)} ({self._every_time()})"
            return trial, result
        elapsed = result.wall_s or 0.0  # one trial, process start included
        if elapsed * 2 > self.time_budget_s:
            needed = math.ceil(elapsed * 2)
            raise TuningError(
                f"time_budget_s={self.time_budget_s:g} is too small: one trial of this model takes {elapsed:.0f} s, "
                f"and tuning needs at least the baseline plus one trial: time_budget_s >= {needed} "
                f"(about {math.ceil(elapsed * 8)} s tries every stage)."
            )
        if self.noise_check and elapsed * 3 <= self.time_budget_s:
            result = self._repeat_baseline(candidate, trial, result)
        return trial, result

    def _repeat_baseline(self, candidate: Candidate, trial: Trial, first: Any) -> Any:
        """Measure the baseline in a second process: the gap between the two runs is the machine's process-to-process
        noise, which step-to-step spread within one run does not show. A gain must exceed it to count; both runs'
        steps are pooled into the reference the first candidates are compared with."""
        repeat = candidate.with_("baseline (repeat)", "baseline")
        second, first_causes, causes = self._trial(repeat, timeout=self._deadline - time.monotonic())
        again = self._record(repeat, second, causes, first_causes)
        if second is None or not second.ok:
            again.verdict = "failed"
            again.reason = "the repeat failed: the noise floor stays at min_gain"
            return first
        again.verdict = "baseline"
        pair = self._agreeing_baselines(candidate, first, second) if not causes else None
        if not isinstance(pair, tuple):
            self._unreliable = [f"baseline (repeat): {c}" for c in causes] + ([pair] if pair else [])
            again.reason = f"unreliable: {'; '.join(causes + ([pair] if pair else []))}"
            return first
        first, second = pair
        noise = abs(math.log(median(per_sample_times(second)) / median(per_sample_times(first))))
        self._required_gain = max(1 + self.min_gain, math.exp(NOISE_FACTOR * noise))
        pooled = replace(first, step_times_s=[*first.step_times_s, *second.step_times_s])
        pooled.throughput = (pooled.batch_size or 1) / median(pooled.step_times_s)
        self._base_runs = [per_sample_times(first), per_sample_times(second)]
        again.reason = (
            f"the two baseline runs differ by {100 * (math.exp(noise) - 1):.1f}%: a gain must reach "
            f"{self._required_gain:.2f}x to count (the noise bar: min_gain={self.min_gain:g}, or {NOISE_FACTOR:g}x "
            "that difference)"
        )
        return pooled

    def _precision_stage(self, incumbent: tuple[Candidate, Trial, Any], base: Any) -> tuple[Candidate, Trial, Any]:
        plan, start, best = self._plan, incumbent, incumbent
        for precision in plan.precisions:
            candidate = start[0].with_(f"+{precision}", "precision", configs=(*start[0].configs, precision))
            best = self._unless_skipped(precision, candidate, start, best, base, explicit=self.precisions is not None)
        return best

    def _optimization_stage(self, incumbent: tuple[Candidate, Trial, Any], base: Any) -> tuple[Candidate, Trial, Any]:
        alternatives = tuner_alternatives()
        for name in self._plan.optimizations:
            configs = incumbent[0].configs
            label = f"+{name}"
            replaced = alternatives.get(name)
            if replaced in configs:
                configs = tuple(c for c in configs if c != replaced)
                label = f"{name} instead of {replaced}"
            candidate = incumbent[0].with_(label, "optimization", configs=(*configs, name))
            incumbent = self._unless_skipped(name, candidate, incumbent, incumbent, base)
        return incumbent

    def _unless_skipped(
        self, name: str, candidate: Candidate, start: Any, best: Any, base: Any, explicit: bool = False
    ) -> Any:
        """``best`` after ``candidate`` (the trial of ``name``) challenged ``start``, or as it was when the trial
        cannot apply (then listed as skipped, with the reason)."""
        why = self._plan.left_out.get(name) or trial_skip_reason(name, self._structure, self.device, explicit=explicit)
        if why is not None:
            self._skip(candidate, why)
            return best
        return self._challenge(candidate, start, best, base)

    def _data_stage(
        self, incumbent: tuple[Candidate, Trial, Any], base: Any, own: dict[str, Any]
    ) -> tuple[Candidate, Trial, Any]:
        if self.stage != "fit":
            self._skip(incumbent[0].with_("num_workers", "data"), NO_DATA_STAGE)
            return incumbent
        share = incumbent[1].data_wait_share
        limit = self.max_num_workers if self.max_num_workers is not None else (os.cpu_count() or 1)
        if share is None or share < DATA_WAIT_THRESHOLD:
            self._skip(
                incumbent[0].with_("num_workers", "data"),
                f"data wait is {100 * (share or 0):.1f}% of the step (< {100 * DATA_WAIT_THRESHOLD:.0f}%): "
                "more loader workers have nothing to win",
            )
            return incumbent
        current = int(own.get("num_workers", 0) or 0)
        counts = [n for n in (1, 2, 4, 8, 16, 32) if current < n <= limit]
        if not counts:
            self._skip(incumbent[0].with_("num_workers", "data"), f"already {current} workers (limit {limit})")
            return incumbent
        start = best = incumbent
        cuda = self.device.startswith("cuda")
        for n in counts:
            loader = dict(start[0].loader) | {"num_workers": n, "persistent_workers": True}
            if cuda:
                loader["pin_memory"] = True
            label = f"num_workers={n}" + (" +pin_memory" if cuda else "")
            candidate = start[0].with_(label, "data", loader=tuple(sorted(loader.items())))
            previous = best
            best = self._challenge(candidate, start, best, base)
            if best is previous and self._trials[-1].verdict != "skipped":
                break  # more workers than this did not help; more still will not either on the same cores
        return best

    def _batch_size_stage(
        self, incumbent: tuple[Candidate, Trial, Any], holder: tuple[str, int] | None
    ) -> tuple[Candidate, Trial, Any]:
        if holder is None:
            self._skip(
                incumbent[0].with_("batch_size", "batch_size"),
                "neither the model, its hparams nor the data module has an integer `batch_size` attribute",
            )
            return incumbent
        own = holder[1]
        cap = self.max_batch_size if self.max_batch_size is not None else own * 4
        sizes = [own * 2**k for k in range(1, cap.bit_length() + 1) if own * 2**k <= cap]  # 2x, 4x... up to cap
        if not sizes:
            self._skip(incumbent[0].with_("batch_size", "batch_size"), f"max_batch_size={cap} leaves no larger size")
            return incumbent
        start = best = incumbent
        for size in sizes:
            candidate = start[0].with_(f"batch_size={size}", "batch_size", batch_size=size)
            fits = memory_problem(self.device, start[2], own, size)
            if fits is not None:
                self._skip(candidate, fits)
                break
            best = self._challenge(candidate, start, best, None)
            last = self._trials[-1]
            if last.verdict == "failed" and "out of memory" in (last.error or "").lower():
                last.reason = f"does not fit: {last.error}"
                break
        return best

    def _challenge(
        self,
        candidate: Candidate,
        against: tuple[Candidate, Trial, Any],
        best: tuple[Candidate, Trial, Any],
        base: Any,
    ) -> tuple[Candidate, Trial, Any]:
        """Measure ``candidate``; it replaces ``best`` if it beats ``against`` (and ``best``) and keeps the losses.

        Kept only when its gain over ``against`` reaches the noise bar (``min_gain``, or 1.5x the baseline runs'
        difference) *and* its 95% interval lies above 1; a gain inside the bar is measured again in a second pair of
        processes and kept only if both pairs together reach it. A disturbed trial decides nothing.
        """
        estimate = self._estimate(candidate, against)
        remaining = self._deadline - time.monotonic()
        if estimate > remaining:
            self._skip(candidate, f"out of budget: needs about {estimate:.0f} s, {max(0.0, remaining):.0f} s left")
            return best
        result, first, causes = self._trial(candidate, timeout=remaining)
        trial = self._record(candidate, result, causes, first)
        if result is None:
            trial.verdict, trial.reason = "skipped", "out of budget: stopped at the end of the time budget"
            return best
        if not result.ok:
            trial.verdict, trial.reason = "failed", result.error or "failed"
            return best
        if causes:
            trial.verdict = "unreliable"
            trial.reason = f"unreliable: {'; '.join(causes)} ({self._every_time()}): not compared"
            return best
        if base is not None and self.stage == "fit" and candidate.batch_size == against[0].batch_size:
            trial.loss_deviation = loss_deviation(result.losses, base.losses)
            if trial.loss_deviation > self.loss_rtol:
                trial.verdict = "rejected"
                trial.reason = (
                    f"losses differ from the baseline's by {trial.loss_deviation:.3g} (median relative, "
                    f"limit loss_rtol={self.loss_rtol:g})"
                )
                return best
        elif any(not math.isfinite(v) for v in result.losses):
            trial.verdict, trial.reason = "rejected", "non-finite loss"
            return best
        inc_runs, cand_runs = [per_sample_times(against[2])], [per_sample_times(result)]
        gain, p_faster = self._compare(trial, against, inc_runs, cand_runs)
        confirmed = ""
        if not self._plausible(gain, p_faster):
            trial.verdict = "rejected"
            trial.reason = f"not measurably faster: {self._explain(trial, against, p_faster)}"
            return best
        if not self._wins(trial, p_faster) or gain < self.confirm_below:
            # Faster in this pair of processes, but by less than one process can be luckier than another
            # (the noise bar, or confirm_below): measure both once more; both pairs together must clear the bar.
            again = self._confirm(candidate, against, trial, inc_runs, cand_runs)
            if isinstance(again, str):
                trial.verdict, trial.reason = "rejected", again
                return best
            result = replace(result, step_times_s=[*result.step_times_s, *again.step_times_s])
            confirmed = ", confirmed by a second pair of runs"
        if best is not against:  # an alternative to one kept earlier in this stage: it must beat that one too
            rival = speedup_estimate([per_sample_times(best[2])], [per_sample_times(result)])
            rival_p = compare(per_sample_times(result), per_sample_times(best[2]))[1]
            if rival.ratio < 1 + self.min_gain or rival.verdict != "faster" or rival_p < self.confidence:
                trial.verdict = "rejected"
                trial.reason = (
                    f"not measurably faster than {best[0].label}: {rival.format()} {rival.verdict} per sample, "
                    f"faster in {100 * rival_p:.0f}% of step pairs"
                )
                return best
            best[1].verdict = "rejected"
            best[1].reason = f"beaten by {candidate.label}"
        trial.verdict = "kept"
        trial.reason = (
            f"{trial.gain_text} per sample vs {against[0].label}, faster in {100 * p_faster:.0f}% of step pairs"
            f"{confirmed}; noise bar {self._required_gain:.2f}x"
        )
        return candidate, trial, result

    def _compare(
        self,
        trial: Trial,
        against: tuple[Candidate, Trial, Any],
        inc_runs: list[list[float]],
        cand_runs: list[list[float]],
    ) -> tuple[float, float]:
        """Set the trial's gain over ``against`` (pairs of runs) and, when that is the baseline, its speed-up to the
        very same estimate; ``(gain, p_faster)`` of the last pair."""
        estimate = speedup_estimate(inc_runs, cand_runs)
        trial.set_ratio("gain", estimate)
        trial.compared_with = against[0].label
        trial.p_faster = compare(cand_runs[-1], inc_runs[-1])[1]
        if against[1].verdict == "baseline":  # "vs baseline" and the reason's figure are one number
            trial.set_ratio("speedup", estimate)
        else:
            trial.set_ratio("speedup", speedup_estimate(self._base_runs, cand_runs, paired=False))
        return estimate.ratio, trial.p_faster

    def _confirm(
        self,
        candidate: Candidate,
        against: tuple[Candidate, Trial, Any],
        trial: Trial,
        inc_runs: list[list[float]],
        cand_runs: list[list[float]],
    ) -> Any:
        """Re-run ``against`` and ``candidate`` in fresh processes; the candidate's second result if both pairs
        together clear the noise bar, else why it is rejected."""
        first = f"{trial.gain:.2f}x per sample, faster in {100 * (trial.p_faster or 0):.0f}% of step pairs"
        needed = (against[1].wall_s or 0.0) + self._estimate(candidate, against) / _COMPILE_COST_FACTOR
        remaining = self._deadline - time.monotonic()
        if needed > remaining:
            return (
                f"not confirmed: {first}, below the noise bar {self._required_gain:.2f}x, and no budget left to "
                f"measure it again (about {needed:.0f} s needed, {max(0.0, remaining):.0f} s left)"
            )
        runs = []
        for who in (against[0], candidate):
            repeat = who.with_(f"{who.label} (again)", "confirm")
            result, first_causes, causes = self._trial(repeat, timeout=self._deadline - time.monotonic())
            rerun = self._record(repeat, result, causes, first_causes)
            rerun.verdict = "confirm"
            if result is None or not result.ok:
                rerun.reason = "the re-run did not finish" if result is None else (result.error or "failed")
                return f"not confirmed: {first}, and its re-run failed or ran out of time"
            if causes:
                rerun.reason = f"unreliable: {'; '.join(causes)}"
                return f"not confirmed: {first}, and its re-run was disturbed ({'; '.join(causes)})"
            runs.append(per_sample_times(result))
            last = result
        second = speedup_estimate([runs[0]], [runs[1]])
        self._trials[-1].set_ratio("gain", second)
        self._trials[-1].compared_with = f"{against[0].label} (again)"
        self._trials[-1].p_faster = p2 = compare(runs[1], runs[0])[1]
        self._compare(trial, against, [*inc_runs, runs[0]], [*cand_runs, runs[1]])
        if not self._plausible(second.ratio, p2) or not self._wins(trial, p2):
            return (
                f"not confirmed: {first} at first, then {second.ratio:.2f}x and {100 * p2:.0f}% when measured again; "
                f"both pairs together {trial.gain_text} vs {against[0].label} (needs >= {self._required_gain:.2f}x, "
                "the noise bar, with an interval above 1)"
            )
        return last

    def _wins(self, trial: Trial, p_faster: float) -> bool:
        """Clear of the noise bar: the gain reaches it, its interval lies above 1, and most step pairs agree."""
        gain = trial.gain or 0.0
        return gain >= self._required_gain and trial.gain_verdict == "faster" and p_faster >= self.confidence

    def _plausible(self, gain: float, p_faster: float) -> bool:
        """A win within one pair of processes (min_gain and step-pair share), whatever the process-to-process noise."""
        return gain >= 1 + self.min_gain and p_faster >= self.confidence

    def _explain(self, trial: Trial, against: tuple[Candidate, Trial, Any], p_faster: float) -> str:
        return (
            f"{trial.gain_text} per sample vs {against[0].label}, faster in {100 * p_faster:.0f}% of step pairs "
            f"(needs >= {self._required_gain:.2f}x, the noise bar, and {100 * self.confidence:.0f}%)"
        )

    def _estimate(self, candidate: Candidate, against: tuple[Candidate, Trial, Any]) -> float:
        wall = against[1].wall_s or 0.0
        factor = 1.2
        if any(c not in against[0].configs for c in long_warmup(candidate.configs)):
            factor = _COMPILE_COST_FACTOR
        if candidate.batch_size is not None:
            own = against[2].batch_size or candidate.batch_size
            factor *= max(1.0, candidate.batch_size / own)
        return wall * factor

    # ------------------------------------------------------------------ running and recording trials

    def _spec(self, candidate: Candidate) -> RunSpec:
        self._count += 1
        return RunSpec(
            workload=self.source.describe(),
            threads=self._threads.threads,
            wait_policy=self._threads.wait_policy,
            config=candidate.config_name,
            steps=self.steps,
            warmup_steps=self.warmup_steps,
            batch_size=candidate.batch_size,
            device=self.device,
            seed=self.seed,
            predict_batches=0,
            repeat=self._count,
            loader_overrides=dict(candidate.loader),
            stage=self.stage,
        )

    def _usable(self, result: Any) -> Any:
        """``result``, marked failed (and skipped: not the model's error) when it timed too few batches to compare."""
        if result is not None and (short := too_few_batches(self.stage, result)):
            result.ok, result.error, result.skipped = False, short, short
        return result

    def _measure(self, candidate: Candidate, timeout: float) -> Any:
        """Run one trial; ``None`` when it ran out of time."""
        spec = self._spec(candidate)
        self._say(f"[{self._count}] {candidate.label} ({candidate.stage}) ...", end="")
        started = time.monotonic()
        if self._isolation == "in-process":
            result = run_in_process(spec, self.source.build)
        else:
            result = self._measure_in_subprocess(spec, timeout)
        if result is not None:
            result.wall_s = time.monotonic() - started  # the whole trial, process start included
        return result

    def _measure_in_subprocess(self, spec: Any, timeout: float) -> Any:
        from lightning_perf.benchmark.isolation import run_isolated

        assert self._tmp is not None
        return run_isolated(spec, self._tmp, timeout, source=self.source, name=f"lightning-perf-autotune-{self._count}")

    def _record(
        self, candidate: Candidate, result: Any, disturbed: Sequence[str] = (), remeasured: Sequence[str] = ()
    ) -> Trial:
        batch_size = candidate.batch_size if result is None else result.batch_size
        trial = self._row(candidate, "failed", batch_size, disturbed=[*disturbed], remeasured_because=[*remeasured])
        if result is not None:
            trial.wall_s = result.wall_s
            trial.error = result.error
            if result.ok and result.step_times_s:
                trial.fill(result)
                if self._base_runs and candidate.stage != "baseline":
                    estimate = speedup_estimate(self._base_runs, [per_sample_times(result)], paired=False)
                    trial.set_ratio("speedup", estimate)
        if result is None:
            self._say(" out of time")
        elif not result.ok:
            self._say(f" failed ({trial.wall_s:.1f} s): {result.error}")
        else:
            vs = "" if trial.speedup is None else f", {trial.speedup_text} vs baseline"
            unit = "step" if self.stage == "fit" else "batch"
            self._say(f" {trial.step_median_s * 1e3:.1f} ms/{unit}{vs} ({trial.wall_s:.1f} s)")  # type: ignore[operator]
        return trial

    def _row(self, candidate: Candidate, verdict: str, batch_size: int | None, **fields: Any) -> Trial:
        """A new row of the trial list, for ``candidate``."""
        trial = Trial(
            label=candidate.label,
            stage=candidate.stage,
            config=candidate.config_name,
            batch_size=batch_size,
            loader=dict(candidate.loader),
            verdict=verdict,
            **fields,
        )
        self._trials.append(trial)
        return trial

    def _skip(self, candidate: Candidate, reason: str) -> None:
        self._row(candidate, "skipped", candidate.batch_size, reason=reason)
        self._say(f"[-] {candidate.label} ({candidate.stage}): skipped, {reason}")

    def _say(self, text: str, end: str = "\n") -> None:
        if self.progress:
            print(text, end=end, flush=True)
