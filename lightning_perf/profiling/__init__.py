"""The measurement core shared by every observer callback, the benchmark tool and the auto-tuner.

Plain PyTorch, psutil and rich, no Lightning: a device-aware :class:`PhaseTimer` that never synchronizes on the hot
path, a :class:`MemoryProbe` cheap enough to sample every step, :func:`summarize` for medians and spread, and report
writers (JSON, Markdown, rich tables, PNG charts). matplotlib is imported only when a chart is drawn. The observers'
analyses live here too: :func:`recommend` (advice from a step-time breakdown), :func:`detect_leaks` (robust memory
growth per step) and :class:`HostSyncRecorder` (host-device synchronizations and their source lines).
"""

# ruff: noqa: F401
from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_perf._lazy import lazy_exports

# Names load on first use, so that a light user of one module (`lightning-perf compare` reads JSON only) does not
# pay for torch, psutil or Lightning through this package's __init__.
_MODULES = {
    "advice": ("LoaderSettings", "Recommendation", "StepBreakdown", "recommend"),
    "flops": ("FlopCount", "PeakFlops", "count_flops", "peak_flops", "utilization"),
    "leaks": ("LeakSeries", "LeakTrend", "SlopeInterval", "detect_leaks", "noise_floor", "rises_steadily",
              "sen_slope_interval", "theil_sen_slope"),
    "memory": ("TRUTHFUL_CPU_MEMORY_ENV", "MemoryProbe", "MemorySample", "peak_rss_bytes", "truthful_cpu_peak"),
    "report": ("SCHEMA_VERSION", "environment_info", "format_bytes", "format_number", "format_seconds",
               "markdown_table", "plot_bars", "plot_lines", "plot_stacked_steps", "print_table", "write_json"),
    "stats": ("Stats", "median", "percentile", "summarize"),
    "syncs": ("HostSyncRecorder", "SyncSite"),
    "timer": ("PhaseTimer",),
}  # fmt: skip
_EXPORTS = {name: f"{__name__}.{module}" for module, names in _MODULES.items() for name in names}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # the same names for type checkers (exported through `__all__`, hence no F401)
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
