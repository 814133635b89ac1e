"""The auto-tuner's statistics: per-sample step times, paired ratios with 95% intervals, loss agreement."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_perf.profiling.intervals import RatioEstimate, paired_ratio
from lightning_perf.profiling.stats import median, percentile

__all__ = ["compare", "loss_deviation", "per_sample_times", "quartiles", "speedup_estimate"]


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The 25th and 75th percentiles of ``values``."""
    ordered = sorted(values)
    return percentile(ordered, 25.0), percentile(ordered, 75.0)


def per_sample_times(result: Any) -> list[float]:
    """Steady-state step times divided by the batch size (comparable across batch sizes)."""
    batch = result.batch_size or 1
    return [t / batch for t in result.step_times_s]


def compare(candidate: Sequence[float], incumbent: Sequence[float]) -> tuple[float, float]:
    """``(gain, p_faster)`` of the candidate's per-sample step times against the incumbent's.

    ``gain`` is the ratio of medians (above 1: the candidate is faster); ``p_faster`` the share of all (candidate,
    incumbent) pairs in which the candidate step was the faster one, ties counting half (the Mann-Whitney
    probability of superiority). Noise alone keeps ``p_faster`` near 0.5 whatever the medians say.
    """
    if not candidate or not incumbent:
        raise ValueError("compare() needs at least one step time on each side.")
    gain = median(incumbent) / median(candidate)
    wins = sum((c < i) + 0.5 * (c == i) for c in candidate for i in incumbent)
    return gain, wins / (len(candidate) * len(incumbent))


def loss_deviation(candidate: Sequence[float], reference: Sequence[float]) -> float:
    """Median relative difference of per-step losses on the same batches; ``inf`` if the candidate's are not finite."""
    if not candidate or any(not math.isfinite(v) for v in candidate):
        return math.inf
    pairs = list(zip(candidate, reference, strict=False))
    if not pairs:
        return math.inf
    return median([abs(c - r) / max(abs(r), 1e-8) for c, r in pairs])


def speedup_estimate(
    reference: Sequence[Sequence[float]], candidate: Sequence[Sequence[float]], *, paired: bool = True
) -> RatioEstimate:
    """How much faster per sample ``candidate`` ran than ``reference``, with a 95% interval and a verdict.

    Each side is a list of runs (per-sample step times of one process each). With the same number of runs on both
    sides and ``paired``, run ``i`` is paired with run ``i`` (a candidate measured again is paired with its incumbent
    measured again); otherwise each side's steps are pooled into one run. The ratio is reference time / candidate
    time, so above 1 means faster; the interval comes from :func:`lightning_perf.profiling.intervals.paired_ratio`.
    """
    ref = [list(r) for r in reference if len(r)]
    cand = [list(c) for c in candidate if len(c)]
    if not ref or not cand:
        raise ValueError("speedup_estimate() needs at least one step time on each side.")
    if len(ref) != len(cand) or not paired:
        ref, cand = [[t for r in ref for t in r]], [[t for c in cand for t in c]]
    return paired_ratio(ref, cand)
