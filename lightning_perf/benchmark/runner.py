"""The benchmark harness behind ``lightning-perf bench``: configurations side by side, measured, not guessed.

Every (repeat, configuration) pair runs in a fresh worker process. Repeats are interleaved and the order rotates from
one repeat to the next, so drift of the machine (thermal state, a neighbour's load) falls on every configuration alike.
Ratios against ``baseline`` are paired within a repeat and carry a 95% interval and a verdict
(:mod:`lightning_perf.profiling.intervals`); the machine's conditions are watched around every run
(:mod:`lightning_perf.profiling.reliability`) and a disturbed run says so.

Results file (JSON, ``kind: "lightning-perf-bench"``). Every time is in seconds under a key ending ``_s``, every step
time under ``step_..._s``; memory in bytes under ``_bytes``; ratios are plain numbers::

    schema_version, kind, command, wall_s
    options      the BenchOptions (workload, configs, preset, steps, warmup_steps, repeats, batch_size, precision,
                 device, seed, predict_batches, num_workers, timeout_s, stage ("fit" | "predict" | "validate" |
                 "test"), source (the user's model, null for a workload: {kind: "import", model, datamodule,
                 model_args, datamodule_args} or {kind: "config", configs: [paths], model, datamodule, ...}; workload
                 is then the model's class name), precision_from ("--config" when the file's precision is the run's),
                 ignored_trainer_settings (the file's trainer keys the bench decides itself))
    notes        [str]: a configuration's own precision over the run's, a fit run that timed no inference
    machine      profiling.machine.describe_machine(): cpu, cpu_count, torch_threads, cpu_flags {avx2, avx512f,
                 avx512_vnni, avx512_bf16, amx_tile, amx_bf16, amx_int8}, cpu_bf16_instructions, gpu, gpu_driver,
                 versions (lightning_perf, torch, lightning)
    run          profiling.machine.run_metadata(): command, argv, cwd, git_commit, git_dirty, start_time, end_time
    environment  profiling.environment_info() (added by write_json)
    reliability  {reliable: bool, causes: [str], disturbed_runs: ["<config>, repeat <n>"], disturbed_configs: [...],
                  cores_used, cpu_count, runs_watched, other_cores_mean, other_cores_max, steal_share_max,
                  load_average_max, frequency_share_min, dispersion: {config: {repeat_spread, outlier_step_share}}}
    left_out     [{config, reason}]: configurations the no-argument bench did not run on this device, and why
    summary      one row per configuration (ConfigSummary below):
        config, runs, skipped, error, disturbed (bool), likely_cause (str | null, for a slower configuration)
        step_median_s, step_min_s, step_max_s (smallest and largest per-repeat median), step_p10_s, step_p90_s
        step_times_s: [[...] per repeat, in repeat order]   raw steady-state step times, to rebuild any interval
        speedup: baseline step time / step time (> 1: faster), geometric mean of the paired per-repeat ratios;
            speedup_ci95: [low, high] (low <= speedup <= high), speedup_verdict: "faster" | "slower" |
            "no clear difference", speedup_method: "t interval over paired repeats" | "bootstrap over paired steps"
            | "one paired repeat: no interval", speedup_n (paired repeats), speedup_min / speedup_max (per-repeat)
            (baseline's own row: speedup 1.0, the rest null)
        throughput (samples/s at the median step), warmup_s, model_init_s, first_batch_s, first_forward_s
        peak_memory_bytes, step_memory_bytes; memory_ratio: step memory / baseline's, with memory_ratio_ci95,
            memory_ratio_verdict ("less memory" | "more memory" | "no clear difference"), _method, _n
        predict_step_median_s, predict_step_times_s (per repeat), predict_throughput; predict_speedup: baseline
            predict time / predict time, with predict_speedup_ci95, _verdict ("faster" | "slower" | ...), _method, _n
        final_train_loss
        flops_per_step (one training step of the untransformed workload, counted on repeat 0; null when unknown,
            flops_error says why), step_median_ci95_s (bootstrap over repeats and steps),
            achieved_flops_per_second and _ci95, peak_flops_per_second, peak_source ("table: H100 SXM bf16 dense",
            "given: Lightning get_available_flops", "measured matmul 2048^3 fp32, 2 threads (cached)",
            "unknown: ..."), peak_causes (what disturbed a measured peak), mfu (achieved / peak, a fraction) and
            mfu_ci95 (see benchmark.utilization)
        inference stages (--stage predict|validate|test; a "step" is then one batch's latency, and step_times_s,
            speedup... describe it): latency_p50_s, latency_p95_s, latency_p99_s (median over repeats of each
            repeat's percentile), and against baseline, each with _ci95, _verdict, _method, _n:
            latency_p50_speedup, latency_p95_speedup, latency_p99_speedup, predict_throughput_ratio,
            first_batch_speedup, warmup_speedup (baseline / configuration: > 1 is faster), peak_memory_ratio
    runs         every worker's RunResult (also latency_p50_s/_p95_s/_p99_s, precision, trainer_settings):
                 spec {config, repeat, ...}, ok, skipped, error, batch_size,
                 step_median_s, step_times_s, predict_step_median_s, predict_step_times_s, throughput, warmup_s,
                 model_init_s, first_batch_s, first_forward_s, peak_memory_bytes, step_memory_bytes, losses,
                 data_wait_s, wall_s, flops_per_step, flops_by_operator, flops_error (repeat 0)
"""

from __future__ import annotations

import math
import shlex
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_perf.benchmark.configs import resolve_configs
from lightning_perf.benchmark.isolation import run_isolated

# The report's tables and files (formerly here) live in benchmark/report.py; these names stay importable from here.
from lightning_perf.benchmark.report import (  # noqa: F401
    CONSOLE_COLUMNS,
    CONSOLE_LEGEND,
    DISTURBED,
    TABLE_COLUMNS,
    TABLE_LEGEND,
    console_rows,
    markdown_report,
    output_paths,
    reliability_lines,
    table_rows,
    unused_output,
    write_outputs,
)
from lightning_perf.benchmark.utilization import (
    PeakFn,
    add_utilization,
    machine_peak,
    matmul_setting,
)
from lightning_perf.benchmark.worker import RunResult, RunSpec
from lightning_perf.profiling.intervals import RatioEstimate, paired_ratio
from lightning_perf.profiling.reliability import ConditionMonitor, Reliability, assess
from lightning_perf.profiling.stats import median, percentile

BASELINE = "baseline"


@dataclass
class BenchOptions:
    """Options of one ``lightning-perf bench`` invocation (the CLI flags, validated)."""

    workload: str = "convnet"
    configs: Sequence[str] = ()
    preset: str = "default"
    steps: int = 20
    warmup_steps: int = 5
    repeats: int = 3
    batch_size: int | None = None
    precision: str = "32-true"
    device: str = "cpu"
    seed: int = 0
    predict_batches: int = 10
    num_workers: int = 0
    timeout_s: float = 900.0
    source: dict[str, Any] | None = None  # the user's model (ModelSource.to_dict()); workload is then its label
    stage: str = "fit"
    precision_from: str | None = None  # where options.precision came from when not the default ("--config")
    ignored_trainer_settings: dict[str, Any] = field(default_factory=dict)  # the --config keys the bench owns

    def __post_init__(self) -> None:
        from lightning_perf.demos import PRESETS, workload_names
        from lightning_perf.optimizations import STAGES

        if self.stage not in STAGES:
            raise ValueError(f"stage={self.stage!r} is unknown. Expected one of: {', '.join(STAGES)}.")
        if self.source is None and self.workload not in workload_names():
            raise ValueError(f"workload={self.workload!r} is unknown. Expected one of: {', '.join(workload_names())}.")
        if self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r} is unknown. Expected one of: {', '.join(PRESETS)}.")
        for name, minimum in (("steps", 1), ("warmup_steps", 1), ("repeats", 1), ("predict_batches", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name}={value!r} is not valid. Expected an integer >= {minimum}.")
        if self.batch_size is not None and (not isinstance(self.batch_size, int) or self.batch_size < 1):
            raise ValueError(f"batch_size={self.batch_size!r} is not valid. Expected a positive integer.")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r} is not valid. Expected 'cpu', 'cuda' or 'cuda:N'.")
        names = [c.name for c in resolve_configs(self.configs or [BASELINE])]
        if BASELINE not in names:  # every ratio is taken against a baseline measured in the same session
            names.insert(0, BASELINE)
        self.configs = names


@dataclass
class ConfigSummary:
    """One configuration's figures, aggregated over repeats (the keys are described in the module docstring)."""

    config: str
    runs: int = 0
    skipped: str | None = None
    error: str | None = None
    disturbed: bool = False
    likely_cause: str | None = None
    step_median_s: float | None = None
    step_min_s: float | None = None  # smallest and largest per-repeat median
    step_max_s: float | None = None
    step_p10_s: float | None = None  # over all steady-state steps of all repeats
    step_p90_s: float | None = None
    speedup: float | None = None  # baseline step time / this step time, paired per repeat
    speedup_ci95: list[float] | None = None
    speedup_verdict: str | None = None
    speedup_method: str | None = None
    speedup_n: int | None = None
    speedup_min: float | None = None  # smallest and largest per-repeat ratio
    speedup_max: float | None = None
    throughput: float | None = None
    warmup_s: float | None = None
    model_init_s: float | None = None
    first_batch_s: float | None = None
    first_forward_s: float | None = None
    peak_memory_bytes: float | None = None
    step_memory_bytes: float | None = None
    memory_ratio: float | None = None  # steady-state step memory / baseline's
    memory_ratio_ci95: list[float] | None = None
    memory_ratio_verdict: str | None = None
    memory_ratio_method: str | None = None
    memory_ratio_n: int | None = None
    predict_step_median_s: float | None = None
    predict_throughput: float | None = None
    predict_speedup: float | None = None  # baseline predict time / this predict time, paired per repeat
    predict_speedup_ci95: list[float] | None = None
    predict_speedup_verdict: str | None = None
    predict_speedup_method: str | None = None
    predict_speedup_n: int | None = None
    final_train_loss: float | None = None
    flops_per_step: int | None = None  # utilization: see lightning_perf.benchmark.utilization
    flops_error: str | None = None
    step_median_ci95_s: list[float] | None = None
    achieved_flops_per_second: float | None = None
    achieved_flops_per_second_ci95: list[float] | None = None
    peak_flops_per_second: float | None = None
    peak_source: str | None = None
    peak_causes: list[str] = field(default_factory=list)
    mfu: float | None = None  # achieved FLOP/s / peak FLOP/s, a fraction
    mfu_ci95: list[float] | None = None
    step_times_s: list[list[float]] = field(default_factory=list)
    predict_step_times_s: list[list[float]] = field(default_factory=list)
    # Inference stages: latency_p50_s/_p95_s/_p99_s and the ratios of INFERENCE_RATIOS, each with _ci95, _verdict,
    # _method, _n; written flat into the JSON summary row.
    inference: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str) -> Any:
        """A field, or an inference figure (``None`` when absent)."""
        return getattr(self, key) if key in self.__dataclass_fields__ else self.inference.get(key)

    def estimate(self, name: str) -> RatioEstimate | None:
        """The ratio ``name`` (``speedup``, ``memory_ratio``, ``predict_speedup``, or one of
        :data:`INFERENCE_RATIOS`) as a :class:`RatioEstimate`."""
        ratio, ci = self.get(name), self.get(f"{name}_ci95")
        if ratio is None or self.get(f"{name}_verdict") is None:
            return None
        low, high = ci if ci is not None else (ratio, ratio)
        method, n = self.get(f"{name}_method"), self.get(f"{name}_n")
        return RatioEstimate(ratio, low, high, method, self.get(f"{name}_verdict"), n)

    def set_estimate(self, name: str, estimate: RatioEstimate) -> None:
        for key, value in estimate.to_dict(name).items():
            if key in self.__dataclass_fields__:
                setattr(self, key, value)
            else:
                self.inference[key] = value

    def to_dict(self) -> dict[str, Any]:
        """The JSON summary row: every field, the inference figures flat among them."""
        row = asdict(self)
        return {**{k: v for k, v in row.items() if k != "inference"}, **row["inference"]}


@dataclass
class BenchReport:
    options: dict[str, Any]
    command: str
    summaries: list[ConfigSummary] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    machine: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    reliability: dict[str, Any] = field(default_factory=lambda: {"reliable": True, "causes": []})
    left_out: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. a configuration's precision over the --config file's

    @property
    def stage(self) -> str:
        return str(self.options.get("stage", "fit"))

    @property
    def failed(self) -> list[ConfigSummary]:
        return [s for s in self.summaries if s.error is not None]

    @property
    def reliable(self) -> bool:
        return bool(self.reliability.get("reliable", True))

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "lightning-perf-bench",
            "command": self.command,
            "options": self.options,
            "wall_s": self.wall_s,
            "machine": self.machine,
            "run": self.run,
            "reliability": self.reliability,
            "left_out": self.left_out,
            "notes": self.notes,
            "summary": [s.to_dict() for s in self.summaries],
            "runs": self.runs,
        }


ProgressFn = Callable[[int, int, str], None]


@dataclass(frozen=True)
class RunEvent:
    """One finished run, for a progress line: which, what it measured, and how far the bench is."""

    config: str
    repeat: int
    repeats: int
    done: int
    total: int
    step_median_s: float | None
    elapsed_s: float
    remaining_s: float
    status: str  # "ok", "skipped: ...", "failed: ..."
    unit: str = "step"  # "batch" for an inference stage (the median is then a batch's latency)

    def line(self) -> str:
        """``"[3/9] channels_last repeat 1/3: step 41.2 ms, elapsed 0:32, about 1:05 left"``."""
        what = f"{self.unit} {self.step_median_s * 1e3:.1f} ms" if self.step_median_s is not None else self.status
        return (
            f"[{self.done}/{self.total}] {self.config} repeat {self.repeat + 1}/{self.repeats}: {what}, "
            f"elapsed {_clock(self.elapsed_s)}, about {_clock(self.remaining_s)} left"
        )


def _clock(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def run_benchmark(
    options: BenchOptions,
    progress: ProgressFn | None = None,
    command: str | None = None,
    *,
    on_run: Callable[[RunEvent], None] | None = None,
    monitor: ConditionMonitor | None = None,
    argv: Sequence[str] | None = None,
    left_out: Sequence[tuple[str, str]] = (),
    peak: PeakFn | None = None,
) -> BenchReport:
    """Run every configuration ``options.repeats`` times, interleaved, each in a fresh process, and summarize.

    Args:
        options: what to run.
        progress: called before each run with ``(done, total, what)`` (a progress bar).
        command: the command line to record (default: one rebuilt from ``options``).
        on_run: called after each run with a :class:`RunEvent` (a progress line).
        monitor: watches the machine around each run (default: a :class:`ConditionMonitor` on the real counters).
        argv: the command line for the ``run`` metadata (default: ``command`` split).
        left_out: ``(config, why)`` for configurations the caller chose not to run, recorded in the report.
        peak: ``(device, precision, fast_fp32_matmul) -> PeakFlops`` for the MFU (default:
            :func:`~lightning_perf.benchmark.utilization.machine_peak`; a CPU peak is measured after every run, once
            per machine and dtype, and cached). Asked once per precision, only where FLOPs were counted.
    """
    import torch

    from lightning_perf.profiling.machine import describe_machine, finish_run, run_metadata

    command = command or _command_for(options)
    run_info = run_metadata(list(argv) if argv is not None else shlex.split(command))
    machine = describe_machine()
    monitor = monitor if monitor is not None else ConditionMonitor()
    order = list(options.configs)
    plan = [(r, order[r % len(order) :] + order[: r % len(order)]) for r in range(options.repeats)]
    total = options.repeats * len(order)
    results: dict[str, list[RunResult]] = {name: [] for name in order}
    start = time.perf_counter()
    done = 0
    watched = []
    with tempfile.TemporaryDirectory(prefix="lightning-perf-bench-") as tmp:
        for repeat, names in plan:
            for name in names:
                if progress is not None:
                    progress(done, total, f"repeat {repeat + 1}/{options.repeats}: {name}")
                token = monitor.start()
                result = _run_in_subprocess(_spec(options, name, repeat), Path(tmp), options.timeout_s)
                conditions = monitor.stop(token, f"{name}, repeat {repeat + 1}", config=name, repeat=repeat)
                if result.ok:  # a skipped or failed run measured nothing the conditions could have disturbed
                    watched.append(conditions)
                results[name].append(result)
                done += 1
                if on_run is not None:
                    elapsed = time.perf_counter() - start
                    status = "ok" if result.ok else f"skipped: {result.skipped}" if result.skipped else "failed"
                    if result.error and not result.ok:
                        status = f"failed: {' '.join(result.error.split())[:160]}"
                    on_run(
                        RunEvent(
                            name, repeat, options.repeats, done, total, result.step_median_s if result.ok else None,
                            elapsed, elapsed / done * (total - done), status,
                            "step" if options.stage == "fit" else "batch",
                        )
                    )  # fmt: skip
    if progress is not None:
        progress(done, total, "done")
    summaries = summarize_runs(results)
    cores = 1 if options.device.startswith("cuda") else torch.get_num_threads()
    reliability = assess(
        watched,
        {s.config: s.step_times_s for s in summaries if s.step_times_s},
        cores_used=cores,
        cpu_count=int(machine.get("cpu_count_usable") or machine.get("cpu_count") or 1),
    )
    mark_disturbed(summaries, reliability, watched)
    add_likely_causes(summaries, machine, options)
    if progress is not None and any(s.flops_per_step for s in summaries):
        progress(done, total, "peak FLOP/s")
    add_utilization(summaries, _peak_lookup(options, machine, peak))
    return BenchReport(
        options=asdict(options) | {"configs": list(order)},
        command=command,
        summaries=summaries,
        runs=[asdict(r) for name in order for r in results[name]],
        wall_s=time.perf_counter() - start,
        machine=machine,
        run=finish_run(run_info),
        reliability=reliability.to_dict(),
        left_out=[{"config": name, "reason": why} for name, why in left_out],
        notes=precision_notes(options) + _predict_skipped_notes(results),
    )


def _predict_skipped_notes(results: dict[str, list[RunResult]]) -> list[str]:
    reasons = sorted({r.predict_skipped for runs in results.values() for r in runs if r.predict_skipped})
    return [f"no inference timing: {reason}" for reason in reasons]


def precision_notes(options: BenchOptions) -> list[str]:
    """One line per configuration whose own precision replaces the run's (``--precision`` or the --config file's)."""
    from lightning_perf.benchmark.configs import get_config

    notes = []
    origin = f" (from {options.precision_from})" if options.precision_from else ""
    for name in options.configs:
        own = get_config(name).trainer_kwargs.get("precision")
        if own is not None and str(own) != options.precision:
            notes.append(f"{name}: precision {own} overrides {options.precision}{origin}")
    return notes


def _peak_lookup(options: BenchOptions, machine: dict[str, Any], peak: PeakFn | None) -> Callable[[str], Any]:
    """config -> its peak, asked once per (precision, fast float32 matmuls) setting."""
    bf16 = machine.get("cpu_bf16_instructions")
    ask = peak or (lambda d, p, f: machine_peak(d, p, f, cpu_bf16_instructions=bool(bf16)))
    known: dict[tuple[str, bool], Any] = {}

    def lookup(config: str) -> Any:
        setting = matmul_setting(config, options.precision)
        if setting not in known:
            known[setting] = ask(options.device, *setting)
        return known[setting]

    return lookup


def _spec(options: BenchOptions, config: str, repeat: int) -> RunSpec:
    return RunSpec(
        source=options.source,
        stage=options.stage,
        workload=options.workload,
        config=config,
        preset=options.preset,
        steps=options.steps,
        warmup_steps=options.warmup_steps,
        batch_size=options.batch_size,
        precision=options.precision,
        device=options.device,
        seed=options.seed,
        predict_batches=options.predict_batches,
        num_workers=options.num_workers,
        repeat=repeat,
        count_flops=repeat == 0 and options.stage == "fit",
    )


def _run_in_subprocess(spec: RunSpec, tmp: Path, timeout_s: float) -> RunResult:
    result = run_isolated(spec, tmp, timeout_s, name="lightning-perf-bench")
    if result is None:
        return RunResult(spec=asdict(spec), ok=False, error=f"timed out after {timeout_s:.0f} s")
    return result


def _median(values: Sequence[float | int | None]) -> float | None:
    """The median of the values present (``None`` and NaN dropped), or ``None`` when there are none."""
    present = sorted(float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v)))
    return median(present) if present else None


def _step_samples(result: RunResult) -> list[float]:
    return list(result.step_times_s) or ([result.step_median_s] if result.step_median_s else [])


def summarize_runs(results: dict[str, list[RunResult]]) -> list[ConfigSummary]:
    """Aggregate per-repeat results into one summary per configuration, with ratios paired against baseline."""
    baseline_by_repeat = {r.spec["repeat"]: r for r in results.get(BASELINE, []) if r.ok}
    summaries = []
    for name, runs in results.items():
        summary = ConfigSummary(config=name)
        ok = sorted((r for r in runs if r.ok), key=lambda r: r.spec.get("repeat", 0))
        summary.runs = len(ok)
        if not ok:
            skipped = next((r.skipped for r in runs if r.skipped), None)
            summary.skipped = skipped
            if skipped is None:
                summary.error = next((r.error for r in runs if r.error), "no result")
            summaries.append(summary)
            continue
        failures = [r.error for r in runs if r.error]
        if failures:
            summary.error = f"{len(failures)} of {len(runs)} runs failed: {failures[0]}"
        medians = [r.step_median_s for r in ok if r.step_median_s is not None]
        summary.step_median_s = _median(medians)
        summary.step_min_s, summary.step_max_s = min(medians), max(medians)
        summary.step_times_s = [list(r.step_times_s) for r in ok]
        summary.predict_step_times_s = [list(r.predict_step_times_s) for r in ok if r.predict_step_times_s]
        pooled = [t for r in ok for t in r.step_times_s]
        if pooled:
            summary.step_p10_s, summary.step_p90_s = percentile(pooled, 10.0), percentile(pooled, 90.0)
        summary.throughput = _median([r.throughput for r in ok])
        summary.warmup_s = _median([r.warmup_s for r in ok])
        summary.model_init_s = _median([r.model_init_s for r in ok])
        summary.first_batch_s = _median([r.first_batch_s for r in ok])
        summary.first_forward_s = _median([r.first_forward_s for r in ok])
        summary.peak_memory_bytes = _median([r.peak_memory_bytes for r in ok])
        summary.step_memory_bytes = _median([r.step_memory_bytes for r in ok])
        summary.predict_step_median_s = _median([r.predict_step_median_s for r in ok])
        summary.predict_throughput = _median([r.predict_throughput for r in ok])
        summary.final_train_loss = _median([r.final_train_loss for r in ok])
        summary.flops_per_step = next((r.flops_per_step for r in ok if r.flops_per_step), None)
        if summary.flops_per_step is None:
            summary.flops_error = next((r.flops_error for r in ok if r.flops_error), None)
        inference = ok[0].spec.get("stage", "fit") != "fit"
        if inference:
            for q in ("50", "95", "99"):
                summary.inference[f"latency_p{q}_s"] = _median([getattr(r, f"latency_p{q}_s") for r in ok])
        if name == BASELINE:
            summary.speedup = 1.0
        elif paired := [
            (baseline_by_repeat[r.spec["repeat"]], r) for r in ok if r.spec["repeat"] in baseline_by_repeat
        ]:
            _paired_ratios(summary, paired)
            if inference:
                _inference_ratios(summary, paired)
        summaries.append(summary)
    return summaries


INFERENCE_RATIOS: dict[str, tuple[str, bool, tuple[str, str]]] = {
    # name: (RunResult figure, larger is better, (verdict above 1, verdict below 1)). Time ratios are speed-ups,
    # baseline / configuration, so > 1 is faster throughout.
    "latency_p50_speedup": ("latency_p50_s", False, ("faster", "slower")),
    "latency_p95_speedup": ("latency_p95_s", False, ("faster", "slower")),
    "latency_p99_speedup": ("latency_p99_s", False, ("faster", "slower")),
    "predict_throughput_ratio": ("predict_throughput", True, ("faster", "slower")),
    "first_batch_speedup": ("first_batch_s", False, ("faster", "slower")),
    "warmup_speedup": ("warmup_s", False, ("faster", "slower")),
    "peak_memory_ratio": ("peak_memory_bytes", True, ("more memory", "less memory")),
}
"""The ratios an inference stage reports against baseline, each with its interval and verdict."""


def _inference_ratios(summary: ConfigSummary, paired: list[tuple[RunResult, RunResult]]) -> None:
    """The inference figures against baseline: the median latency from the per-batch samples (bootstrap or t), the
    tail percentiles and the one-per-run figures paired per repeat (an interval from two repeats on)."""
    for name, (figure, larger_better, (above, below)) in INFERENCE_RATIOS.items():
        if figure == "latency_p50_s":
            pairs = [(b.predict_step_times_s, r.predict_step_times_s) for b, r in paired]
        else:
            pairs = [([getattr(b, figure)], [getattr(r, figure)]) for b, r in paired]
        pairs = [(b, r) for b, r in pairs if b and r and all(v is not None and v > 0 for v in (*b, *r))]
        if not pairs:
            continue
        if larger_better:  # configuration / baseline
            summary.set_estimate(name, paired_ratio([r for _, r in pairs], [b for b, _ in pairs], above_one=above,
                                                    below_one=below))  # fmt: skip
        else:  # baseline / configuration
            summary.set_estimate(name, paired_ratio([b for b, _ in pairs], [r for _, r in pairs]))


def _paired_ratios(summary: ConfigSummary, paired: list[tuple[RunResult, RunResult]]) -> None:
    steps = [(_step_samples(b), _step_samples(r)) for b, r in paired]
    steps = [(b, r) for b, r in steps if b and r]
    if steps:
        summary.set_estimate("speedup", paired_ratio([b for b, _ in steps], [r for _, r in steps]))
        ratios = [_median(b) / _median(r) for b, r in steps]  # type: ignore[operator]
        summary.speedup_min, summary.speedup_max = min(ratios), max(ratios)
    memory = [
        (r.step_memory_bytes, b.step_memory_bytes) for b, r in paired if b.step_memory_bytes and r.step_memory_bytes
    ]
    if memory:
        estimate = paired_ratio(
            [float(m) for m, _ in memory],
            [float(m) for _, m in memory],
            above_one="more memory",
            below_one="less memory",
        )
        summary.set_estimate("memory_ratio", estimate)
    predict = [
        (b.predict_step_times_s or [b.predict_step_median_s], r.predict_step_times_s or [r.predict_step_median_s])
        for b, r in paired
        if b.predict_step_median_s and r.predict_step_median_s
    ]
    if predict:
        summary.set_estimate("predict_speedup", paired_ratio([b for b, _ in predict], [r for _, r in predict]))


def mark_disturbed(summaries: Sequence[ConfigSummary], reliability: Reliability, watched: Sequence[Any]) -> None:
    """Flag the rows whose figures a disturbance touched: their own runs, or baseline's (every ratio pairs with it)."""
    hit = {(r.config, r.repeat) for r in watched if r.label in reliability.disturbed_runs}
    by_config = {config for config, _ in hit}
    for s in summaries:
        own = s.config in by_config or s.config in reliability.disturbed_configs
        via_baseline = (
            s.config != BASELINE
            and s.speedup is not None
            and (BASELINE in by_config or BASELINE in reliability.disturbed_configs)
        )
        s.disturbed = own or via_baseline


def add_likely_causes(summaries: Sequence[ConfigSummary], machine: dict[str, Any], options: BenchOptions) -> None:
    """Name a likely cause for each configuration slower than baseline, from the optimizations' slowdown causes."""
    import lightning_perf.optimizations as optimizations

    known = {o.name: o for o in optimizations.optimizations()}
    base = next((s for s in summaries if s.config == BASELINE), None)
    for s in summaries:
        if s.speedup_verdict != "slower":
            continue
        causes = [cause.text for part in s.config.split("+") if part in known for cause in known[part].slowdown_causes
                  if _slowdown_condition(cause.when, s, base, machine, options)]  # fmt: skip
        s.likely_cause = "; ".join(causes[:2]) or None


def _slowdown_condition(
    when: str, s: ConfigSummary, base: ConfigSummary | None, machine: dict[str, Any], options: BenchOptions
) -> bool:
    if when == "always":
        return True
    if when == "cpu_without_bf16":
        return not options.device.startswith("cuda") and machine.get("cpu_bf16_instructions") is False
    if when == "warmup_longer":
        if base is None or s.warmup_s is None or base.warmup_s is None:
            return False
        saved = ((base.step_median_s or 0.0) - (s.step_median_s or 0.0)) * options.steps
        return s.warmup_s - base.warmup_s > max(saved, 0.5 * base.warmup_s)
    return False


def _command_for(options: BenchOptions) -> str:
    args = ["lightning-perf", "bench", "--workload", options.workload, "--configs", ",".join(options.configs)]
    args += ["--preset", options.preset, "--steps", str(options.steps), "--warmup-steps", str(options.warmup_steps)]
    args += ["--repeats", str(options.repeats), "--device", options.device, "--precision", options.precision]
    if options.batch_size is not None:
        args += ["--batch-size", str(options.batch_size)]
    return shlex.join(args)
