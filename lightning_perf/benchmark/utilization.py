"""Utilization in the bench's summary: FLOPs per step, achieved FLOP/s and model-FLOPs utilization (MFU).

Entry points: :func:`add_utilization`, :func:`machine_peak`, :func:`step_median_ci95`. The keys a summary row gains and
where the peak comes from: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lightning_perf.profiling.flops import PeakFlops, format_flops, utilization

__all__ = [
    "MFU_LEGEND",
    "PeakFn",
    "add_utilization",
    "machine_peak",
    "matmul_setting",
    "mfu_cell",
    "step_median_ci95",
    "unknown_mfu_lines",
    "utilization_lines",
    "utilization_markdown",
]

PeakFn = Callable[[str, str, bool], PeakFlops]
"""``(device, precision, fast_fp32_matmul) -> PeakFlops``: the peak a configuration's matmuls can reach."""

MFU_LEGEND = "MFU: achieved FLOP/s / the machine's peak in the run's dtype (?: run or peak disturbed; -: unknown)."

_RESAMPLES = 2000


def matmul_setting(config: str, options_precision: str) -> tuple[str, bool]:
    """``(precision, fast_fp32_matmul)`` of a configuration: its own ``Trainer(precision=...)`` or the bench's, and
    whether a part lets float32 matmuls run in the device's faster mode (its entry's ``fast_fp32_matmul``: TF32 on
    CUDA, bf16 on a bf16 CPU), the peak its MFU is then taken against."""
    from lightning_perf.benchmark.configs import get_config

    precision = str(get_config(config).trainer_kwargs.get("precision", options_precision))
    return precision, any(part.fast_fp32_matmul for part in _parts(config))


def mfu_note(config: str) -> str:
    """What a configuration's MFU is taken against when that is not its own dtype (its entries' ``mfu_note``: an fp8
    run's MFU is against the bf16 peak), or ``""``."""
    return "; ".join(part.mfu_note for part in _parts(config) if part.mfu_note)


def _parts(config: str) -> list[Any]:
    """The optimization-list entries of a configuration's parts (``baseline`` and bench-only ones have none)."""
    from lightning_perf.benchmark.configs import get_config
    from lightning_perf.optimizations import find

    return [o for part in get_config(config).parts if (o := find(part)) is not None]


def machine_peak(
    device: str, precision: str, fast_fp32_matmul: bool = False, *, cpu_bf16_instructions: bool | None = None
) -> PeakFlops:
    """The peak FLOP/s of ``device`` for matmuls under ``precision``, and how it was obtained.

    CUDA: the datasheet table (``fast_fp32_matmul``: TF32 for fp32), else Lightning's ``get_available_flops``. CPU:
    the cached or freshly measured matmul rate in the dtype of the run's matmuls: fp32 for a float32 run, also with a
    backend flag (measured: such a run's matmuls stay float32, at baseline's speed), bf16 only for a bf16 precision
    (``cpu_bf16_instructions`` is kept for callers and no longer changes the dtype). Never raises for an unknown
    precision: the peak is then unknown.
    """
    import torch

    from lightning_perf.profiling.flops import dtype_of_precision, gpu_peak_flops, peak_flops

    try:
        dtype = dtype_of_precision(precision)
    except ValueError:
        return PeakFlops(None, f"unknown: no matmul dtype for precision {precision!r}")
    target = torch.device(device)
    if target.type == "cuda":
        name = torch.cuda.get_device_name(target)
        peak = gpu_peak_flops(name, dtype, "high" if fast_fp32_matmul else torch.get_float32_matmul_precision())
        if peak.flops_per_second is not None:
            return peak
        from lightning.fabric.utilities.throughput import get_available_flops

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning warns about devices it does not know
            given = get_available_flops(target, dtype)
        if not given:
            return PeakFlops(None, f"{peak.source}; Lightning's get_available_flops has none either")
        return peak_flops(target, dtype, given=float(given), given_source="given: Lightning get_available_flops")
    return peak_flops(target, dtype)


def step_median_ci95(step_times_s: Sequence[Sequence[float]], point: float, seed: int = 0) -> list[float] | None:
    """A 95% interval of the median of per-repeat median step times (the summary's ``step_median_s``).

    Two-stage percentile bootstrap with a seeded NumPy generator: repeats drawn with replacement, steps within each
    drawn repeat with replacement, so the spread between processes counts as well as the spread between steps. With
    one repeat only the steps are resampled. The interval is widened, if need be, to contain ``point``. None when
    there are fewer than two step times.
    """
    groups = [np.asarray(g, dtype=np.float64) for g in step_times_s if len(g)]
    if sum(g.size for g in groups) < 2:
        return None
    rng = np.random.default_rng(seed)
    # Bootstrap medians of each repeat on its own, then draw repeats: row b of `medians` is resample b of every repeat.
    medians = np.stack([np.median(g[rng.integers(0, g.size, size=(_RESAMPLES, g.size))], axis=1) for g in groups])
    k = len(groups)
    drawn = rng.integers(0, k, size=(_RESAMPLES, k)) if k > 1 else np.zeros((_RESAMPLES, 1), dtype=np.int64)
    statistic = np.median(medians[drawn, np.arange(_RESAMPLES)[:, None]], axis=1)
    low, high = (float(v) for v in np.percentile(statistic, [2.5, 97.5]))
    return [min(low, point), max(high, point)]


def add_utilization(rows: Sequence[Any], peak_of: Callable[[str], PeakFlops | None]) -> None:
    """Fill each row's utilization fields from its ``flops_per_step``, ``step_median_s`` and ``peak_of(config)``.

    A row without FLOPs or step time keeps them None (``flops_error`` says why where the count failed); the peak is
    asked for only where FLOPs are known, so nothing is measured for nothing.
    """
    for row in rows:
        if row.step_median_s is None or not row.flops_per_step:
            continue
        row.step_median_ci95_s = step_median_ci95(row.step_times_s, row.step_median_s)
        peak = peak_of(row.config)
        figures = utilization(row.flops_per_step, row.step_median_s, peak, step_time_ci95_s=row.step_median_ci95_s)
        for key, value in figures.items():
            setattr(row, key, value)
        note = mfu_note(row.config)
        if note and row.peak_source:
            row.peak_source = f"{row.peak_source} ({note})"
        if row.mfu is not None and row.mfu > 1.0:
            # Achieved above the peak: the peak's kernel (a matmul in the run's dtype) is not what this configuration
            # runs (e.g. emulated bf16 matmuls on a CPU without bf16 instructions, while its convolutions take a
            # faster path). A utilization above 100% means nothing: report it as unknown, and why.
            row.peak_source = (
                f"unknown: the achieved rate is {row.mfu:.1f}x the peak ({row.peak_source}), which therefore does "
                "not represent this configuration's kernels"
            )
            row.mfu = None
            row.mfu_ci95 = None


def mfu_cell(row: Any) -> str:
    """``"12%"``; ``"?12%"`` when the row's runs or the peak's measurement were disturbed (the console has no room
    for two marks: the warnings and the Markdown say which); ``"-"`` when the MFU is unknown."""
    if row.mfu is None:
        return "-"
    percent = row.mfu * 100.0
    text = f"{percent:.0f}%" if percent >= 10 else f"{percent:.2g}%"
    return ("?" if row.disturbed or row.peak_causes else "") + text


def utilization_lines(rows: Sequence[Any]) -> list[str]:
    """A warning line per cause that disturbed a peak measurement (an MFU against it is too high)."""
    causes = dict.fromkeys(cause for row in rows for cause in (row.peak_causes or []))
    text = "warning: peak FLOP/s measured while disturbed by {}: the MFU against it is too high (marked ?)"
    return [text.format(cause) for cause in causes]


def unknown_mfu_lines(rows: Sequence[Any]) -> list[str]:
    """Why a measured row has no MFU, once per reason: its FLOPs could not be counted, or no peak is known."""
    reasons: dict[str, None] = {}
    for row in rows:
        if row.step_median_s is None or row.mfu is not None:
            continue
        if row.flops_error:
            reasons[f"MFU unknown: FLOPs per step not counted ({row.flops_error})"] = None
        elif row.peak_source and row.peak_source.startswith("unknown"):
            reasons[f"MFU unknown: peak FLOP/s {row.peak_source}"] = None
    return list(reasons)


def _rate_with_interval(value: float | None, interval: Sequence[float] | None, unit: str) -> str:
    if value is None:
        return "-"
    text = format_flops(value, unit)
    if interval is not None:
        text += f" [{format_flops(interval[0], unit)} - {format_flops(interval[1], unit)}]"
    return text


def utilization_markdown(rows: Sequence[Any]) -> list[str]:
    """The Markdown section on utilization: one table row per configuration, and how to read it."""
    from lightning_perf.profiling import markdown_table

    table = []
    for row in rows:
        if row.step_median_s is None:
            continue
        if not row.flops_per_step:
            why = row.flops_error or "not counted"
            table.append([row.config, f"unknown: {why}", "-", "-", "-", "-"])
            continue
        mfu = "-"
        if row.mfu is not None:
            mfu = f"{row.mfu * 100:.3g}%"
            if row.mfu_ci95 is not None:
                mfu += f" [{row.mfu_ci95[0] * 100:.3g}-{row.mfu_ci95[1] * 100:.3g}%]"
            mfu = ("? " if row.disturbed else "") + mfu + (" *" if row.peak_causes else "")
        peak_source = row.peak_source or "-"
        if row.peak_causes:
            peak_source += f" (disturbed by {'; '.join(row.peak_causes)})"
        table.append(
            [
                row.config,
                format_flops(row.flops_per_step),
                _rate_with_interval(row.achieved_flops_per_second, row.achieved_flops_per_second_ci95, "FLOP/s"),
                format_flops(row.peak_flops_per_second, "FLOP/s"),
                peak_source,
                mfu,
            ]
        )
    if not table:
        return []
    columns = ("config", "FLOPs/step", "achieved FLOP/s [95% CI]", "peak FLOP/s", "peak from", "MFU [95% CI]")
    return [
        "### Utilization",
        "",
        markdown_table(columns, table),
        "",
        "FLOPs/step: one training step (forward and backward, the optimizer's update not counted) of the untransformed "
        "workload, counted once with torch's FlopCounterMode (a multiply-add is 2 FLOPs); every configuration computes "
        "the same model, so the same count serves all. Achieved FLOP/s: FLOPs/step / median step time, with the "
        "interval of the median (bootstrap over repeats and steps). " + MFU_LEGEND,
        "",
    ]
