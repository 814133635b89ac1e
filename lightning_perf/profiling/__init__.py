"""The measurement core shared by every observer callback, the benchmark tool and the auto-tuner.

Plain PyTorch, psutil and rich, no Lightning: a device-aware :class:`PhaseTimer` that never synchronizes on the hot
path, a :class:`MemoryProbe` cheap enough to sample every step, :func:`summarize` for medians and spread, and report
writers (JSON, Markdown, rich tables, PNG charts). matplotlib is imported only when a chart is drawn. The observers'
analyses live here too: :func:`recommend` (advice from a step-time breakdown), :func:`detect_leaks` (robust memory
growth per step) and :class:`HostSyncRecorder` (host-device synchronizations and their source lines).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_perf._lazy import lazy_exports

# Names load on first use, so that a light user of one module (`lightning-perf compare` reads JSON only) does not
# pay for torch, psutil or Lightning through this package's __init__.
_EXPORTS = {
    "count_flops": "lightning_perf.profiling.flops",
    "detect_leaks": "lightning_perf.profiling.leaks",
    "environment_info": "lightning_perf.profiling.report",
    "FlopCount": "lightning_perf.profiling.flops",
    "format_bytes": "lightning_perf.profiling.report",
    "format_number": "lightning_perf.profiling.report",
    "format_seconds": "lightning_perf.profiling.report",
    "HostSyncRecorder": "lightning_perf.profiling.syncs",
    "LeakTrend": "lightning_perf.profiling.leaks",
    "LeakSeries": "lightning_perf.profiling.leaks",
    "SlopeInterval": "lightning_perf.profiling.leaks",
    "sen_slope_interval": "lightning_perf.profiling.leaks",
    "rises_steadily": "lightning_perf.profiling.leaks",
    "noise_floor": "lightning_perf.profiling.leaks",
    "LoaderSettings": "lightning_perf.profiling.advice",
    "markdown_table": "lightning_perf.profiling.report",
    "median": "lightning_perf.profiling.stats",
    "MemoryProbe": "lightning_perf.profiling.memory",
    "MemorySample": "lightning_perf.profiling.memory",
    "peak_flops": "lightning_perf.profiling.flops",
    "peak_rss_bytes": "lightning_perf.profiling.memory",
    "PeakFlops": "lightning_perf.profiling.flops",
    "percentile": "lightning_perf.profiling.stats",
    "PhaseTimer": "lightning_perf.profiling.timer",
    "plot_bars": "lightning_perf.profiling.report",
    "plot_lines": "lightning_perf.profiling.report",
    "plot_stacked_steps": "lightning_perf.profiling.report",
    "print_table": "lightning_perf.profiling.report",
    "recommend": "lightning_perf.profiling.advice",
    "Recommendation": "lightning_perf.profiling.advice",
    "SCHEMA_VERSION": "lightning_perf.profiling.report",
    "Stats": "lightning_perf.profiling.stats",
    "StepBreakdown": "lightning_perf.profiling.advice",
    "summarize": "lightning_perf.profiling.stats",
    "SyncSite": "lightning_perf.profiling.syncs",
    "theil_sen_slope": "lightning_perf.profiling.leaks",
    "TRUTHFUL_CPU_MEMORY_ENV": "lightning_perf.profiling.memory",
    "truthful_cpu_peak": "lightning_perf.profiling.memory",
    "utilization": "lightning_perf.profiling.flops",
    "write_json": "lightning_perf.profiling.report",
}

__all__ = [
    "SCHEMA_VERSION",
    "TRUTHFUL_CPU_MEMORY_ENV",
    "FlopCount",
    "HostSyncRecorder",
    "LeakSeries",
    "LeakTrend",
    "LoaderSettings",
    "MemoryProbe",
    "MemorySample",
    "PeakFlops",
    "PhaseTimer",
    "Recommendation",
    "SlopeInterval",
    "Stats",
    "StepBreakdown",
    "SyncSite",
    "count_flops",
    "detect_leaks",
    "environment_info",
    "format_bytes",
    "format_number",
    "format_seconds",
    "markdown_table",
    "median",
    "noise_floor",
    "peak_flops",
    "peak_rss_bytes",
    "percentile",
    "plot_bars",
    "plot_lines",
    "plot_stacked_steps",
    "print_table",
    "recommend",
    "rises_steadily",
    "sen_slope_interval",
    "summarize",
    "theil_sen_slope",
    "truthful_cpu_peak",
    "utilization",
    "write_json",
]

if TYPE_CHECKING:
    from lightning_perf.profiling.advice import LoaderSettings, Recommendation, StepBreakdown, recommend
    from lightning_perf.profiling.flops import FlopCount, PeakFlops, count_flops, peak_flops, utilization
    from lightning_perf.profiling.leaks import (
        LeakSeries,
        LeakTrend,
        SlopeInterval,
        detect_leaks,
        noise_floor,
        rises_steadily,
        sen_slope_interval,
        theil_sen_slope,
    )
    from lightning_perf.profiling.memory import (
        TRUTHFUL_CPU_MEMORY_ENV,
        MemoryProbe,
        MemorySample,
        peak_rss_bytes,
        truthful_cpu_peak,
    )
    from lightning_perf.profiling.report import (
        SCHEMA_VERSION,
        environment_info,
        format_bytes,
        format_number,
        format_seconds,
        markdown_table,
        plot_bars,
        plot_lines,
        plot_stacked_steps,
        print_table,
        write_json,
    )
    from lightning_perf.profiling.stats import Stats, median, percentile, summarize
    from lightning_perf.profiling.syncs import HostSyncRecorder, SyncSite
    from lightning_perf.profiling.timer import PhaseTimer


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
