"""The benchmark harness behind ``lightning-perf bench``: configurations side by side, measured, not guessed.

Every (repeat, configuration) pair runs in a fresh worker process. Repeats are interleaved and the order rotates from
one repeat to the next, so drift of the machine (thermal state, a neighbour's load) falls on every configuration alike.
Ratios against ``baseline`` are paired within a repeat and then summarized, so they carry the spread of the machine.
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
from lightning_perf.benchmark.worker import RunResult, RunSpec
from lightning_perf.profiling import (
    environment_info,
    format_bytes,
    markdown_table,
    plot_bars,
    write_json,
)
from lightning_perf.profiling.stats import percentile

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

    def __post_init__(self) -> None:
        from lightning_perf.demos import PRESETS, workload_names

        if self.workload not in workload_names():
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
    """One configuration's figures, aggregated over repeats."""

    config: str
    runs: int = 0
    skipped: str | None = None
    error: str | None = None
    step_median_s: float | None = None
    step_min_s: float | None = None  # smallest and largest per-repeat median
    step_max_s: float | None = None
    step_p10_s: float | None = None  # over all steady-state steps of all repeats
    step_p90_s: float | None = None
    speedup: float | None = None  # baseline step time / this step time, paired per repeat, median
    speedup_min: float | None = None
    speedup_max: float | None = None
    throughput: float | None = None
    warmup_s: float | None = None
    model_init_s: float | None = None
    first_batch_s: float | None = None
    first_forward_s: float | None = None
    peak_memory_bytes: float | None = None
    step_memory_bytes: float | None = None
    memory_ratio: float | None = None  # steady-state step memory / baseline's
    predict_throughput: float | None = None
    predict_speedup: float | None = None
    final_train_loss: float | None = None


@dataclass
class BenchReport:
    options: dict[str, Any]
    command: str
    summaries: list[ConfigSummary] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def failed(self) -> list[ConfigSummary]:
        return [s for s in self.summaries if s.error is not None]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "lightning-perf-bench",
            "command": self.command,
            "options": self.options,
            "wall_s": self.wall_s,
            "summary": [asdict(s) for s in self.summaries],
            "runs": self.runs,
        }


ProgressFn = Callable[[int, int, str], None]


def run_benchmark(options: BenchOptions, progress: ProgressFn | None = None, command: str | None = None) -> BenchReport:
    """Run every configuration ``options.repeats`` times, interleaved, each in a fresh process, and summarize."""
    order = list(options.configs)
    plan = [(r, order[r % len(order) :] + order[: r % len(order)]) for r in range(options.repeats)]
    total = options.repeats * len(order)
    results: dict[str, list[RunResult]] = {name: [] for name in order}
    start = time.perf_counter()
    done = 0
    with tempfile.TemporaryDirectory(prefix="lightning-perf-bench-") as tmp:
        for repeat, names in plan:
            for name in names:
                if progress is not None:
                    progress(done, total, f"repeat {repeat + 1}/{options.repeats}: {name}")
                spec = _spec(options, name, repeat)
                results[name].append(_run_in_subprocess(spec, Path(tmp), options.timeout_s))
                done += 1
    if progress is not None:
        progress(done, total, "done")
    report = BenchReport(
        options=asdict(options) | {"configs": list(order)},
        command=command or _command_for(options),
        summaries=summarize_runs(results),
        runs=[asdict(r) for name in order for r in results[name]],
        wall_s=time.perf_counter() - start,
    )
    return report


def _spec(options: BenchOptions, config: str, repeat: int) -> RunSpec:
    return RunSpec(
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
    )


def _run_in_subprocess(spec: RunSpec, tmp: Path, timeout_s: float) -> RunResult:
    result = run_isolated(spec, tmp, timeout_s, name="lightning-perf-bench")
    if result is None:
        return RunResult(spec=asdict(spec), ok=False, error=f"timed out after {timeout_s:.0f} s")
    return result


def _median(values: Sequence[float | int | None]) -> float | None:
    """The median of the values present (``None`` and NaN dropped), or ``None`` when there are none."""
    present = sorted(float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v)))
    return percentile(present, 50.0) if present else None


def summarize_runs(results: dict[str, list[RunResult]]) -> list[ConfigSummary]:
    """Aggregate per-repeat results into one summary per configuration, with ratios paired against baseline."""
    baseline_by_repeat = {r.spec["repeat"]: r for r in results.get(BASELINE, []) if r.ok}
    summaries = []
    for name, runs in results.items():
        summary = ConfigSummary(config=name)
        ok = [r for r in runs if r.ok]
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
        medians = [r.step_s["median"] for r in ok]
        summary.step_median_s = _median(medians)
        summary.step_min_s, summary.step_max_s = min(medians), max(medians)
        pooled = [t for r in ok for t in r.step_times_s]
        if pooled:
            ordered = sorted(pooled)
            summary.step_p10_s, summary.step_p90_s = percentile(ordered, 10.0), percentile(ordered, 90.0)
        summary.throughput = _median([r.throughput for r in ok])
        summary.warmup_s = _median([r.warmup_s for r in ok])
        summary.model_init_s = _median([r.model_init_s for r in ok])
        summary.first_batch_s = _median([r.first_batch_s for r in ok])
        summary.first_forward_s = _median([r.first_forward_s for r in ok])
        summary.peak_memory_bytes = _median([r.peak_memory_bytes for r in ok])
        summary.step_memory_bytes = _median([r.step_memory_bytes for r in ok])
        summary.predict_throughput = _median([r.predict_throughput for r in ok])
        summary.final_train_loss = _median([r.final_train_loss for r in ok])
        paired = [(baseline_by_repeat[r.spec["repeat"]], r) for r in ok if r.spec["repeat"] in baseline_by_repeat]
        if paired:
            ratios = [b.step_s["median"] / r.step_s["median"] for b, r in paired]
            summary.speedup, summary.speedup_min, summary.speedup_max = _median(ratios), min(ratios), max(ratios)
            mem = [
                r.step_memory_bytes / b.step_memory_bytes
                for b, r in paired
                if b.step_memory_bytes and r.step_memory_bytes
            ]
            summary.memory_ratio = _median(mem)
            pred = [
                r.predict_throughput / b.predict_throughput
                for b, r in paired
                if b.predict_throughput and r.predict_throughput
            ]
            summary.predict_speedup = _median(pred)
        summaries.append(summary)
    return summaries


TABLE_COLUMNS = (
    "config",
    "step ms",
    "speed-up",
    "samples/s",
    "warm-up s",
    "step memory",
    "memory",
    "predict/s",
    "predict speed-up",
    "final loss",
)
TABLE_LEGEND = (
    "step ms: steady-state median (min-max of the per-repeat medians); speed-up: baseline step time / step time, "
    "paired within a repeat (median, min-max); warm-up s: first warm-up steps, compilation included; step memory: "
    "steady-state peak above the memory in use after warm-up, and its ratio to baseline's; predict: inference "
    "throughput and its ratio to baseline's."
)


def table_rows(report: BenchReport) -> list[list[str]]:
    """The summary as text cells, one row per configuration, shared by the console, Markdown and tests."""
    rows = []
    for s in report.summaries:
        if s.step_median_s is None:
            rows.append([s.config, f"skipped: {s.skipped}" if s.skipped else f"failed: {s.error}"] + [""] * 8)
            continue
        rows.append(
            [
                s.config + (" (some runs failed)" if s.error else ""),
                f"{s.step_median_s * 1e3:.1f} ({s.step_min_s * 1e3:.1f}-{s.step_max_s * 1e3:.1f})",  # type: ignore[operator]
                _ratio(s.speedup, s.speedup_min, s.speedup_max),
                _num(s.throughput, ".1f"),
                _num(s.warmup_s, ".2f"),
                format_bytes(s.step_memory_bytes) if s.step_memory_bytes is not None else "n/a",
                _ratio(s.memory_ratio),
                _num(s.predict_throughput, ".1f"),
                _ratio(s.predict_speedup),
                _num(s.final_train_loss, ".4f"),
            ]
        )
    return rows


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _ratio(value: float | None, lo: float | None = None, hi: float | None = None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}x" + (f" ({lo:.2f}-{hi:.2f})" if lo is not None and hi is not None else "")


def _command_for(options: BenchOptions) -> str:
    args = ["lightning-perf", "bench", "--workload", options.workload, "--configs", ",".join(options.configs)]
    args += ["--preset", options.preset, "--steps", str(options.steps), "--warmup-steps", str(options.warmup_steps)]
    args += ["--repeats", str(options.repeats), "--device", options.device, "--precision", options.precision]
    if options.batch_size is not None:
        args += ["--batch-size", str(options.batch_size)]
    return shlex.join(args)


def markdown_report(report: BenchReport) -> str:
    """The report as Markdown: the command, the machine, the table and how to read it."""
    env = environment_info()
    opts = report.options
    lines = [
        f"## `{opts['workload']}` ({opts['preset']} preset) on {opts['device']}",
        "",
        f"Command: `{report.command}`",
        "",
        f"Machine: {env.get('cpu', 'unknown CPU')} ({env.get('cpu_count', '?')} CPUs), "
        f"{env.get('cuda_device') or 'no GPU'}; torch {env.get('torch')}, lightning {env.get('lightning')}.",
        "",
        markdown_table(TABLE_COLUMNS, table_rows(report)),
        "",
        f"{opts['repeats']} repeats x {opts['steps']} steady-state steps after {opts['warmup_steps']} warm-up steps; "
        f"each run in a fresh process, configurations interleaved. {TABLE_LEGEND} Memory on CPU is peak RSS with "
        "MALLOC_MMAP_THRESHOLD_=65536 (freed tensors go back to the OS, so the peak is truthful); on CUDA "
        "max_memory_allocated.",
        "",
    ]
    return "\n".join(lines)


def write_outputs(report: BenchReport, output: Path) -> list[Path]:
    """Write the JSON report at ``output`` and the Markdown and PNG next to it (same stem). Returns the paths."""
    output = Path(output)
    written = [write_json(report.to_dict(), output)]
    md = output.with_suffix(".md")
    from lightning_perf._io import atomic_write_text

    atomic_write_text(md, markdown_report(report))
    written.append(md)
    measured = [s for s in report.summaries if s.speedup is not None]
    from lightning_perf._imports import is_matplotlib_available

    if measured and is_matplotlib_available():
        png = output.with_suffix(".png")
        plot_bars(
            [s.config for s in measured],
            [s.speedup for s in measured],  # type: ignore[misc]
            errors=[(s.speedup - s.speedup_min, s.speedup_max - s.speedup) for s in measured],  # type: ignore[operator]
            title=f"{report.options['workload']}: training speed-up vs baseline ({report.options['device']})",
            ylabel="baseline step time / step time",
            path=png,
        )
        written.append(png)
    return written
