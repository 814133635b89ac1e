"""The measurement core shared by every observer callback, the benchmark tool and the auto-tuner.

Plain PyTorch, psutil and rich, no Lightning: a device-aware :class:`PhaseTimer` that never synchronizes on the hot
path, a :class:`MemoryProbe` cheap enough to sample every step, :func:`summarize` for medians and spread, and report
writers (JSON, Markdown, rich tables, PNG charts). matplotlib is imported only when a chart is drawn. The observers'
analyses live here too: :func:`recommend` (advice from a step-time breakdown), :func:`detect_leaks` (robust memory
growth per step) and :class:`HostSyncRecorder` (host-device synchronizations and their source lines).
"""

from __future__ import annotations

from lightning_perf.profiling.advice import LoaderSettings, Recommendation, StepBreakdown, recommend
from lightning_perf.profiling.leaks import LeakTrend, detect_leaks, theil_sen_slope
from lightning_perf.profiling.memory import TRUTHFUL_CPU_MEMORY_ENV, MemoryProbe, MemorySample, peak_rss_bytes
from lightning_perf.profiling.report import (
    SCHEMA_VERSION,
    environment_info,
    format_bytes,
    format_seconds,
    markdown_table,
    plot_bars,
    plot_lines,
    plot_stacked_steps,
    print_table,
    rich_table,
    write_json,
    write_markdown,
)
from lightning_perf.profiling.stats import Stats, median, percentile, summarize
from lightning_perf.profiling.syncs import HostSyncRecorder, SyncSite
from lightning_perf.profiling.timer import PhaseTimer

__all__ = [
    "SCHEMA_VERSION",
    "TRUTHFUL_CPU_MEMORY_ENV",
    "HostSyncRecorder",
    "LeakTrend",
    "LoaderSettings",
    "MemoryProbe",
    "MemorySample",
    "PhaseTimer",
    "Recommendation",
    "Stats",
    "StepBreakdown",
    "SyncSite",
    "detect_leaks",
    "environment_info",
    "format_bytes",
    "format_seconds",
    "markdown_table",
    "median",
    "peak_rss_bytes",
    "percentile",
    "plot_bars",
    "plot_lines",
    "plot_stacked_steps",
    "print_table",
    "recommend",
    "rich_table",
    "summarize",
    "theil_sen_slope",
    "write_json",
    "write_markdown",
]
