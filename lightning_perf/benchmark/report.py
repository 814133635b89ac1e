"""The bench's report: tables for the console (80 columns) and the Markdown file, and the output files.

The runner (:mod:`lightning_perf.benchmark.runner`) measures; this module only formats a
:class:`~lightning_perf.benchmark.results.BenchReport` and writes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_perf._io import atomic_write_text, numbered_path
from lightning_perf.benchmark.payback import compile_costs
from lightning_perf.benchmark.results import ONE_REPEAT
from lightning_perf.benchmark.utilization import MFU_LEGEND, mfu_cell, utilization_lines, utilization_markdown
from lightning_perf.optimizations import BASELINE
from lightning_perf.profiling import format_bytes, format_number, markdown_table, plot_bars, write_json
from lightning_perf.profiling.intervals import NO_CLEAR_DIFFERENCE

if TYPE_CHECKING:
    from collections.abc import Callable

    from lightning_perf.benchmark.results import BenchReport, ConfigSummary

DISTURBED = "(disturbed)"


# ------------------------------------------------------------------------------------------------------------ tables

TABLE_COLUMNS = (
    "config",
    "step ms",
    "speed-up [95% CI]",
    "verdict",
    "interval from",
    "samples/s",
    "warm-up s",
    "first step s",
    "step memory",
    "memory [95% CI]",
    "predict/s",
    "predict speed-up [95% CI]",
    "final loss",
    "likely cause",
)
TABLE_LEGEND = (
    "step ms: steady-state median (min-max of the per-repeat medians); speed-up: baseline step time / step time, "
    "paired within a repeat (geometric mean of the paired ratios) with its 95% interval and verdict: faster or "
    "slower when the interval excludes 1, else no clear difference; warm-up s: first warm-up steps, compilation "
    "included; first step s: the first training step of the configuration's first process, cold (compiling with "
    "an empty cache included; its later processes share that cache); step memory: steady-state peak above the "
    "memory in use after warm-up, and its ratio to baseline's; "
    "predict: inference throughput and baseline predict time / predict time. '?' and (disturbed): the machine was "
    "busy with other work or the samples scattered (see the reliability warnings): do not trust that figure."
)
CONSOLE_COLUMNS = ("config", "step ms", "speed-up", "verdict", "memory", "predict", "MFU")
CONSOLE_LEGEND = (
    "speed-up: baseline step time / step time, paired per repeat, [95% interval]; memory, predict: ratios to "
    "baseline (~ : no clear difference, or one repeat). ? and (disturbed): measured while the machine was "
    "disturbed. " + MFU_LEGEND
)


def _mark(s: ConfigSummary) -> str:
    return "?" if s.disturbed else ""


def _estimate_cell(s: ConfigSummary, name: str, multiline: bool = False) -> str:
    estimate = s.estimate(name)
    if estimate is None:
        return "n/a" if s.get(name) is None else f"{s.get(name):.2f}x"
    if not estimate.has_interval:
        return f"{_mark(s)}{estimate.ratio:.2f}x"
    sep = "\n" if multiline else " "
    return f"{_mark(s)}{estimate.ratio:.2f}x{sep}[{estimate.low:.2f}-{estimate.high:.2f}]"


def _verdict_cell(s: ConfigSummary, multiline: bool = False, name: str = "speedup") -> str:
    sep = "\n" if multiline else " "
    if s.config == BASELINE:
        return "reference" + (sep + DISTURBED if s.disturbed else "")
    text = s.get(f"{name}_verdict")
    if text is None:
        return "n/a"
    return f"? {text}{sep}{DISTURBED}" if s.disturbed else text


def _compact_ratio(s: ConfigSummary, name: str) -> str:
    estimate = s.estimate(name)
    if estimate is None:
        return "n/a"
    return f"{_mark(s)}{'~' if estimate.verdict in (NO_CLEAR_DIFFERENCE, ONE_REPEAT) else ''}{estimate.ratio:.2f}x"


def table_rows(report: BenchReport) -> list[list[str]]:
    """The summary as text cells, one row per configuration, with every detail (Markdown and tests)."""

    def cells(s: ConfigSummary) -> list[str]:
        return [
            f"{s.step_median_s * 1e3:.1f} ({s.step_min_s * 1e3:.1f}-{s.step_max_s * 1e3:.1f})",  # type: ignore[operator]
            _estimate_cell(s, "speedup") if s.config != BASELINE else "1.00x",
            _verdict_cell(s),
            s.speedup_method or "",
            format_number(s.throughput, ".1f"),
            format_number(s.warmup_s, ".2f"),
            format_number(s.first_step_s, ".2f"),
            format_bytes(s.step_memory_bytes) if s.step_memory_bytes is not None else "n/a",
            _with_verdict(s, "memory_ratio"),
            format_number(s.predict_throughput, ".1f"),
            _with_verdict(s, "predict_speedup"),
            format_number(s.final_train_loss, ".4f"),
            s.likely_cause or "",
        ]

    return _rows(report, len(TABLE_COLUMNS), cells, " (some runs failed)")


def _rows(report: BenchReport, width: int, cells: Callable[[ConfigSummary], list[str]], failed: str,
          note_at: int = 1) -> list[list[str]]:  # fmt: skip
    """One row per configuration: its name (``failed`` added when some runs failed) and ``cells(s)``; for one that
    measured nothing, why, in column ``note_at`` of an otherwise empty row."""
    rows = []
    for s in report.summaries:
        if s.step_median_s is None:
            rows.append([s.config] + [""] * (width - 1))
            rows[-1][note_at] = f"skipped: {s.skipped}" if s.skipped else f"failed: {s.error}"
        else:
            rows.append([s.config + (failed if s.error else ""), *cells(s)])
    return rows


def console_rows(report: BenchReport) -> list[list[str]]:
    """The summary for an 80-column terminal: ratio, interval and verdict; the rest is in the Markdown file."""

    def cells(s: ConfigSummary) -> list[str]:
        base = s.config == BASELINE
        return [
            f"{s.step_median_s * 1e3:.1f}",  # type: ignore[operator]
            "1.00x" if base else _estimate_cell(s, "speedup", multiline=True),
            _verdict_cell(s, multiline=True) + (f"\n{s.likely_cause}" if s.likely_cause else ""),
            "1.00x" if base else _compact_ratio(s, "memory_ratio"),
            "1.00x" if base else _compact_ratio(s, "predict_speedup"),
            mfu_cell(s),
        ]

    return _rows(report, len(CONSOLE_COLUMNS), cells, "\n(runs failed)", note_at=3)


INFERENCE_TABLE_COLUMNS = (
    "config",
    "p50 ms",
    "p95 ms",
    "p99 ms",
    "p50 speed-up [95% CI]",
    "p95 speed-up [95% CI]",
    "p99 speed-up [95% CI]",
    "samples/s",
    "throughput [95% CI]",
    "first batch s",
    "first batch [95% CI]",
    "warm-up s",
    "warm-up [95% CI]",
    "peak memory",
    "memory [95% CI]",
)
INFERENCE_LEGEND = (
    "p50/p95/p99: percentiles of the steady-state per-batch latency (median over repeats); each speed-up is baseline "
    "/ configuration, paired within a repeat, with its 95% interval and verdict (faster or slower when the interval "
    "excludes 1, else no clear difference); throughput: samples per second at the median batch, configuration / "
    "baseline; first batch: the cold first batch (data, transfer, first forward, compilation); warm-up: the warm-up "
    "batches together; memory: peak memory, configuration / baseline. A percentile or one-per-run figure has an "
    "interval from two repeats on."
)
INFERENCE_CONSOLE_COLUMNS = ("config", "p50 ms", "p50 speed-up", "verdict", "p95 | p99", "memory")
INFERENCE_CONSOLE_LEGEND = (
    "speed-up: baseline latency / latency per batch, paired per repeat, [95% interval]; p95 | p99, memory: ratios to "
    "baseline (~ : no clear difference, or one repeat). ? and (disturbed): measured while the machine was "
    "disturbed. Throughput, "
    "first-batch and warm-up ratios are in the Markdown file."
)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.2f}"


def _with_verdict(s: ConfigSummary, name: str) -> str:
    verdict = s.get(f"{name}_verdict")
    return f"{_estimate_cell(s, name)} {verdict}" if verdict else "n/a"


def inference_table_rows(report: BenchReport) -> list[list[str]]:
    """An inference stage's summary, one row per configuration, every figure (Markdown)."""

    def cells(s: ConfigSummary) -> list[str]:
        base = s.config == BASELINE
        return [
            *(_ms(s.get(f"latency_p{q}_s")) for q in ("50", "95", "99")),
            *("1.00x" if base else _with_verdict(s, f"latency_p{q}_speedup") for q in ("50", "95", "99")),
            format_number(s.predict_throughput, ".1f"),
            "1.00x" if base else _with_verdict(s, "predict_throughput_ratio"),
            format_number(s.first_batch_s, ".3f"),
            "1.00x" if base else _with_verdict(s, "first_batch_speedup"),
            format_number(s.warmup_s, ".3f"),
            "1.00x" if base else _with_verdict(s, "warmup_speedup"),
            format_bytes(s.peak_memory_bytes) if s.peak_memory_bytes is not None else "n/a",
            "1.00x" if base else _with_verdict(s, "peak_memory_ratio"),
        ]

    return _rows(report, len(INFERENCE_TABLE_COLUMNS), cells, " (some runs failed)")


def inference_console_rows(report: BenchReport) -> list[list[str]]:
    """An inference stage's summary for an 80-column terminal."""

    def cells(s: ConfigSummary) -> list[str]:
        base = s.config == BASELINE
        return [
            _ms(s.get("latency_p50_s")),
            "1.00x" if base else _estimate_cell(s, "latency_p50_speedup", multiline=True),
            _verdict_cell(s, multiline=True, name="latency_p50_speedup"),
            "1.00x" if base else "\n".join(_compact_ratio(s, f"latency_p{q}_speedup") for q in ("95", "99")),
            "1.00x" if base else _compact_ratio(s, "peak_memory_ratio"),
        ]

    return _rows(report, len(INFERENCE_CONSOLE_COLUMNS), cells, "\n(runs failed)", note_at=3)


def scaling_markdown(reports: list[tuple[int, BenchReport]]) -> list[str]:
    """The batch-scaling table of a ``--batch-sizes`` sweep: throughput per configuration and batch size."""
    if not reports:
        return []
    inference = reports[0][1].stage != "fit"
    what = "predict samples/s" if inference else "training samples/s"
    configs: list[str] = []
    for _, report in reports:
        configs += [s.config for s in report.summaries if s.config not in configs]
    header = ["config", *(f"batch {size}" for size, _ in reports)]
    rows = []
    for config in configs:
        cells = [config]
        for _, report in reports:
            s = next((x for x in report.summaries if x.config == config), None)
            value = None if s is None else (s.predict_throughput if inference else s.throughput)
            cells.append(("? " if s is not None and s.disturbed else "") + format_number(value, ".1f"))
        rows.append(cells)
    return [f"### Batch scaling ({what}, median over repeats)", "", markdown_table(header, rows), ""]


def reliability_lines(report: BenchReport) -> list[str]:
    """One warning line per cause of an unreliable measurement, then per cause that disturbed a peak FLOP/s
    measurement (empty when nothing was disturbed)."""
    lines = [] if report.reliable else report.reliability.get("causes", [])
    return [f"warning: measurement disturbed by {cause}" for cause in lines] + utilization_lines(report.summaries)


def _repeats_text(report: BenchReport) -> str:
    """``3 repeats``, or for ``--repeats auto`` the rounds run and when they stopped."""
    settling = report.settling or {}
    if report.options.get("repeats"):
        return f"{report.options['repeats']} repeats"
    rounds = settling.get("rounds", "?")
    return f"{rounds} rounds of repeats (auto: until +-{settling.get('target', 0.05):.0%}, {settling.get('stopped')})"


def _worker_threads(machine: dict[str, Any]) -> Any:
    """The workers' intra-op threads (``machine.threads``, decided at the run's start); older reports: the parent's."""
    threads = machine.get("threads")
    return threads.get("threads", "?") if isinstance(threads, dict) else machine.get("torch_threads", "?")


def markdown_report(report: BenchReport) -> str:
    """The report as Markdown: the command, the machine, reliability, the table and how to read it."""
    opts, machine, run = report.options, report.machine, report.run
    flags = machine.get("cpu_flags")
    flag_text = ", ".join(k for k, v in flags.items() if v) or "none of avx2/avx512/amx" if flags else "unknown"
    commit = run.get("git_commit")
    lines = [
        f"## {title(report)}",
        "",
        f"Command: `{report.command}`",
        "",
        *source_lines(report),
        f"Machine: {machine.get('cpu') or 'unknown CPU'} ({machine.get('cpu_count', '?')} CPUs, "
        f"{_worker_threads(machine)} torch threads per run; flags: {flag_text}), {machine.get('gpu') or 'no GPU'}; "
        f"lightning_perf {machine.get('lightning_perf')}, torch {machine.get('torch')}, "
        f"lightning {machine.get('lightning')}.",
        "",
        f"Run: {run.get('start_time')} to {run.get('end_time')}"
        + (f", commit {commit[:10]}{' (dirty)' if run.get('git_dirty') else ''}" if commit else "")
        + ".",
        "",
    ]
    if report.reliable:
        lines += ["Reliability: no disturbance seen (other processes' load, steal, load average, dispersion).", ""]
    else:
        lines += ["**Reliability: disturbed.** Figures marked `?` are not to be trusted:", ""]
        lines += [f"- {cause}" for cause in report.reliability.get("causes", [])] + [""]
    memory = (
        "Memory on CPU is peak RSS over 2 steps after the warm-up with MALLOC_MMAP_THRESHOLD_=65536 (freed tensors go "
        "back to the OS, so the peak is truthful), switched off before the timed steps (it slows allocation); on CUDA "
        "max_memory_allocated."
    )
    if report.stage == "fit":
        lines += [
            markdown_table(TABLE_COLUMNS, table_rows(report)),
            "",
            f"{_repeats_text(report)} x {opts['steps']} steady-state steps after {opts['warmup_steps']} warm-up "
            f"steps; each run in a fresh process, configurations interleaved. {TABLE_LEGEND} {memory}",
            "",
        ]
        lines += utilization_markdown(report.summaries)
    else:
        lines += [
            markdown_table(INFERENCE_TABLE_COLUMNS, inference_table_rows(report)),
            "",
            f"`{report.stage}` of the model as built (no training): {_repeats_text(report)} x {opts['steps']} timed "
            f"batches after {opts['warmup_steps']} warm-up batches; each run in a fresh process, configurations "
            f"interleaved. {INFERENCE_LEGEND} {memory}",
            "",
        ]
    if report.notes:
        lines += ["Notes:", ""] + [f"- {note}" for note in report.notes] + [""]
    costs = compile_costs(report.summaries, report.runs)
    if costs:
        lines += ["Compiled configurations (the first process compiles cold, later ones start from its cache):", ""]
        lines += [f"- `{c.config}`{c.text()[len(c.config) :]}" for c in costs] + [""]
    unsettled = [s for s in report.summaries if s.unsettled]
    if unsettled:
        lines += ["Not settled:", ""] + [f"- `{s.config}`: {s.unsettled}" for s in unsettled] + [""]
    if report.recommendation.get("lines"):
        lines += ["### Recommendation", "", "```text", *report.recommendation["lines"], "```", ""]
    if report.left_out:
        lines += ["Left out:", ""] + [f"- `{x['config']}`: {x['reason']}" for x in report.left_out]
        lines.append("")
    return "\n".join(lines)


def title(report: BenchReport) -> str:
    """``convnet (default preset), fit on cpu`` or ``Classifier, predict on cpu`` (a Markdown heading's text)."""
    opts = report.options
    what = f"`{opts['workload']}`" + ("" if opts.get("source") else f" ({opts['preset']} preset)")
    batch = f", batch size {opts['batch_size']}" if opts.get("batch_size") else ""
    return f"{what}, {report.stage} on {opts['device']}{batch}"


def source_lines(report: BenchReport) -> list[str]:
    """What was measured when it is the user's own model: classes, arguments, configuration files."""
    source = report.options.get("source")
    if not source:
        return []
    parts = []
    if source.get("model"):
        parts.append(f"model `{source['model']}` {json.dumps(source.get('model_args') or {})}")
    if source.get("datamodule"):
        parts.append(f"data `{source['datamodule']}` {json.dumps(source.get('datamodule_args') or {})}")
    if source.get("configs"):
        parts.append("LightningCLI config " + ", ".join(f"`{c}`" for c in source["configs"]))
    ignored = report.options.get("ignored_trainer_settings") or {}
    lines = [f"Model: {'; '.join(parts)}.", ""]
    if ignored:
        lines += [f"Trainer settings of the config decided by the bench instead: {', '.join(sorted(ignored))}.", ""]
    return lines


# ----------------------------------------------------------------------------------------------------------- outputs


def output_paths(output: Path) -> list[Path]:
    """The files one report writes: the JSON at ``output``, and the Markdown and PNG beside it."""
    return [output, output.with_suffix(".md"), output.with_suffix(".png")]


def unused_output(output: Path, force: bool = False) -> Path:
    """``output``, or with a run number (``name-2.json``, ``name-3.json``...) when one of its files exists.

    With ``force`` the existing files are overwritten: ``output`` is returned as is.
    """
    return numbered_path(Path(output), output_paths, force)


def write_outputs(report: BenchReport, output: Path) -> list[Path]:
    """Write the JSON report at ``output`` and the Markdown and PNG next to it (same stem). Returns the paths.

    The caller picks ``output`` (see :func:`unused_output`: files are never overwritten unless asked).
    """
    output = Path(output)
    written = [
        write_json(report.to_dict(), output),
        atomic_write_text(output.with_suffix(".md"), markdown_report(report)),
    ]
    measured = [s for s in report.summaries if s.speedup is not None]
    from lightning_perf._imports import is_available

    if measured and is_available("matplotlib"):
        png = output.with_suffix(".png")
        speedups = [float(s.speedup) for s in measured]  # type: ignore[arg-type]  # measured: not None
        bounds = [s.speedup_ci95 or (ratio, ratio) for s, ratio in zip(measured, speedups)]
        plot_bars(
            [s.config for s in measured],
            speedups,
            errors=[(ratio - low, high - ratio) for ratio, (low, high) in zip(speedups, bounds)],
            marks=["disturbed" if s.disturbed else "unsettled" if s.settled is False else None for s in measured],
            title=f"{report.options['workload']}: "
            f"{'training' if report.stage == 'fit' else report.stage + ' latency'} speed-up vs baseline "
            f"({report.options['device']})",
            ylabel=f"baseline {'step time' if report.stage == 'fit' else 'batch latency'} / configuration's "
            "(95% interval)",
            path=png,
            reference=1.0,
        )
        written.append(png)
    return written


def write_sweep_outputs(reports: list[tuple[int, BenchReport]], output: Path) -> list[Path]:
    """A ``--batch-sizes`` sweep: one JSON at ``output`` (``kind: lightning-perf-bench-sweep``, ``by_batch_size``: one
    bench report per size, each with its ``batch_size``) and one Markdown beside it (a section per size, then the
    batch-scaling table). Returns the paths."""
    output = Path(output)
    data = {
        "kind": "lightning-perf-bench-sweep",
        "batch_sizes": [size for size, _ in reports],
        "by_batch_size": [{"batch_size": size, **report.to_dict()} for size, report in reports],
    }
    written = [write_json(data, output)]
    sections = ["#" + markdown_report(report) for _, report in reports]  # each "## ..." heading one level down
    first = reports[0][1] if reports else None
    heading = f"## Batch sizes {', '.join(str(size) for size, _ in reports)}" + (f": {title(first)}" if first else "")
    text = "\n".join([heading, "", *scaling_markdown(reports), *sections])
    return [*written, atomic_write_text(output.with_suffix(".md"), text)]
