"""Is a change real? Tests on two independent samples of one measurement (an old run and a new run).

Entry points (NumPy and the standard library, no SciPy): :func:`mann_whitney_u`, :func:`ratio_of_medians_ci` and
:func:`compare_samples`, the verdict ``lightning-perf compare`` uses. The methods, their limits at small samples and the
verdict's rule: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_perf._validation import check_int, check_number

__all__ = [
    "FASTER",
    "NO_CLEAR_DIFFERENCE",
    "SIGNIFICANCE_LEVEL",
    "SLOWER",
    "MannWhitneyResult",
    "Sample",
    "SampleComparison",
    "compare_samples",
    "mann_whitney_p_value",
    "mann_whitney_u",
    "ratio_of_medians_ci",
    "verdict",
]

FASTER = "faster"
SLOWER = "slower"
NO_CLEAR_DIFFERENCE = "no clear difference"

SIGNIFICANCE_LEVEL = 0.01
"""A change is significant when the Mann-Whitney p-value is below this (or the interval clears the threshold)."""

_BOOTSTRAP_BLOCK = 2_000_000  # resampled values held in memory at once (16 MB of float64)


@dataclass(frozen=True)
class MannWhitneyResult:
    """The outcome of :func:`mann_whitney_u`.

    Attributes:
        u: the U statistic of the first sample (the number of pairs in which its value is the larger, ties counting
            one half); ``n_old * n_new / 2`` when the samples are alike.
        z: the standardized statistic (continuity-corrected); 0.0 when every value is tied.
        p_value: the two-sided p-value from the normal approximation, in [0, 1].
        n_old: size of the first sample.
        n_new: size of the second sample.
    """

    u: float
    z: float
    p_value: float
    n_old: int
    n_new: int


@dataclass(frozen=True)
class SampleComparison:
    """The comparison of two independent samples of one figure (see :func:`compare_samples`).

    Attributes:
        ratio: ``median(new) / median(old)``.
        ratio_ci95: the 95% bootstrap interval of ``ratio`` as ``(low, high)`` with ``low <= ratio <= high``; ``None``
            when a sample has fewer than two values.
        p_value: the Mann-Whitney two-sided p-value; ``None`` when a sample has fewer than two values.
        verdict: ``"faster"``, ``"slower"`` or ``"no clear difference"`` (worded for a time or a speed).
        regression: whether the verdict is ``"slower"``.
        n_old: size of the old sample.
        n_new: size of the new sample.
    """

    ratio: float
    ratio_ci95: tuple[float, float] | None
    p_value: float | None
    verdict: str
    regression: bool
    n_old: int
    n_new: int


Sample = Sequence[float] | Sequence[Sequence[float]]
"""A flat sample, or a sample in groups (e.g. one list of step times per repeat)."""


def _is_grouped(values: Sample) -> bool:
    return len(values) > 0 and all(isinstance(v, (Sequence, np.ndarray)) and not isinstance(v, str) for v in values)


def _groups(values: Sample, name: str) -> list[np.ndarray]:
    """The sample as groups: each non-empty group of a grouped sample, or one group holding a flat sample."""
    if not _is_grouped(values):
        return [_sample(values, name)]  # type: ignore[arg-type]
    groups = [_sample(group, name) for group in values if len(group) > 0]  # type: ignore[arg-type]
    if not groups:
        raise ValueError(f"`{name}` has 0 value(s). Expected at least 1.")
    return groups


def _flat(values: Sample, name: str, minimum: int = 1) -> np.ndarray:
    data = np.concatenate(_groups(values, name)) if len(values) else np.empty(0)
    if data.size < minimum:
        raise ValueError(f"`{name}` has {data.size} value(s). Expected at least {minimum}.")
    return data


def _sample(values: Sequence[float], name: str, minimum: int = 1) -> np.ndarray:
    try:
        data = np.asarray([float(v) for v in values], dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"`{name}` must be a sequence of numbers, got {values!r:.80}.") from None
    if data.size < minimum:
        raise ValueError(f"`{name}` has {data.size} value(s). Expected at least {minimum}.")
    if not np.all(np.isfinite(data)):
        raise ValueError(f"`{name}` holds a NaN or infinite value. Expected finite numbers; drop failed runs first.")
    return data


def _check_positive(data: np.ndarray, name: str) -> None:
    if np.any(data <= 0):
        raise ValueError(f"`{name}` holds a value <= 0. Expected positive numbers (a ratio of medians needs them).")


def mann_whitney_p_value(u: float, n_old: int, n_new: int, tie_term: float = 0.0) -> tuple[float, float]:
    """The two-sided p-value of a Mann-Whitney ``u`` by the normal approximation; returns ``(z, p_value)``.

    Args:
        u: the U statistic of the first sample.
        n_old: size of the first sample (>= 1).
        n_new: size of the second sample (>= 1).
        tie_term: ``sum(t**3 - t)`` over the groups of tied values (``t`` values each) in the pooled sample; 0 without
            ties. It shrinks the variance: ``n1*n2/12 * ((n + 1) - tie_term / (n * (n - 1)))``.

    Usable on its own when only the ordering is known, e.g. two samples whose ranges do not overlap (``u = 0``).
    """
    check_int("mann_whitney_p_value", "n_old", n_old, 1)
    check_int("mann_whitney_p_value", "n_new", n_new, 1)
    n = n_old + n_new
    mean = n_old * n_new / 2.0
    variance = n_old * n_new / 12.0 * ((n + 1) - tie_term / (n * (n - 1)))
    if variance <= 0.0:  # every value tied: no evidence of any difference
        return 0.0, 1.0
    delta = u - mean
    corrected = max(abs(delta) - 0.5, 0.0)  # continuity correction towards the mean
    z = math.copysign(corrected, delta) / math.sqrt(variance)
    return z, min(1.0, math.erfc(abs(z) / math.sqrt(2.0)))


def mann_whitney_u(old: Sequence[float], new: Sequence[float]) -> MannWhitneyResult:
    """The two-sided Mann-Whitney U test of two independent samples (normal approximation, tie-corrected).

    Args:
        old: the first sample (finite numbers, at least one).
        new: the second sample (finite numbers, at least one).

    Returns:
        U of ``old``, z and the p-value. Exact enough for 8 or more values a side (see the module notes).

    Raises:
        ValueError: if a sample is empty or holds NaN or an infinite value.
        TypeError: if a sample holds something that is not a number.

    Example::

        >>> mann_whitney_u([1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18]).p_value < 0.01
        True
    """
    a = _sample(old, "old")
    b = _sample(new, "new")
    pooled = np.concatenate([a, b])
    order = np.argsort(pooled, kind="mergesort")
    ordered = pooled[order]
    ranks = np.empty(pooled.size, dtype=np.float64)
    # average rank (1-based) of each group of tied values
    _, first, counts = np.unique(ordered, return_index=True, return_counts=True)
    average = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(average, counts)
    u = float(ranks[: a.size].sum() - a.size * (a.size + 1) / 2.0)
    tie_term = float(np.sum(counts.astype(np.float64) ** 3 - counts))
    z, p = mann_whitney_p_value(u, int(a.size), int(b.size), tie_term)
    return MannWhitneyResult(u=u, z=z, p_value=p, n_old=int(a.size), n_new=int(b.size))


def _bootstrap_medians(groups: list[np.ndarray], resamples: int, rng: np.random.Generator) -> np.ndarray:
    if len(groups) == 1:
        return _bootstrap_flat(groups[0], resamples, rng)
    # Two stages: draw as many groups as there are, with replacement; then values within each drawn group. Groups of
    # unequal size are padded with NaN (left out of the median), so every resample is one vectorized row.
    k = len(groups)
    sizes = np.array([group.size for group in groups])
    width = int(sizes.max())
    padded = np.full((k, width), np.nan)
    for i, group in enumerate(groups):
        padded[i, : group.size] = group
    equal = bool(np.all(sizes == width))
    out = np.empty(resamples, dtype=np.float64)
    block = max(1, _BOOTSTRAP_BLOCK // (k * width))
    for start in range(0, resamples, block):
        stop = min(resamples, start + block)
        drawn = rng.integers(0, k, size=(stop - start, k))
        drawn_sizes = sizes[drawn][:, :, None]
        within = (rng.random((stop - start, k, width)) * drawn_sizes).astype(np.int64)
        values = padded[drawn[:, :, None], within]
        if equal:
            out[start:stop] = np.median(values.reshape(stop - start, -1), axis=1)
        else:
            values = np.where(np.arange(width)[None, None, :] < drawn_sizes, values, np.nan)
            out[start:stop] = np.nanmedian(values.reshape(stop - start, -1), axis=1)
    return out


def _bootstrap_flat(data: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    out = np.empty(resamples, dtype=np.float64)
    block = max(1, _BOOTSTRAP_BLOCK // data.size)
    for start in range(0, resamples, block):
        stop = min(resamples, start + block)
        picks = rng.integers(0, data.size, size=(stop - start, data.size))
        out[start:stop] = np.median(data[picks], axis=1)
    return out


def ratio_of_medians_ci(
    old: Sample,
    new: Sample,
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """``median(new) / median(old)`` and its percentile-bootstrap interval; returns ``(ratio, low, high)``.

    The two samples are resampled independently (they are not paired); a sample given as groups is resampled in two
    stages (groups, then values within each). The interval is widened, if need be, to contain the point estimate, so
    ``low <= ratio <= high`` always holds.

    Args:
        old: the first sample (positive finite numbers, at least two), flat or as groups (lists of numbers).
        new: the second sample, likewise.
        confidence: the interval's coverage, in (0, 1).
        resamples: bootstrap resamples (>= 100).
        seed: seed of the :class:`numpy.random.Generator`; the same inputs and seed give the same interval.

    Raises:
        ValueError: on fewer than two values a side, a value <= 0, NaN, inf, or an out-of-range setting.
    """
    if check_number("ratio_of_medians_ci", "confidence", confidence, 0.0, 1.0, exclusive=True) == 1.0:
        raise ValueError("`ratio_of_medians_ci(confidence=1.0)` is not valid. Expected a number in (0, 1).")
    check_int("ratio_of_medians_ci", "resamples", resamples, 100)
    check_int("ratio_of_medians_ci", "seed", seed, 0)
    a, b = _flat(old, "old", minimum=2), _flat(new, "new", minimum=2)
    _check_positive(a, "old")
    _check_positive(b, "new")
    ratio = float(np.median(b) / np.median(a))
    rng = np.random.default_rng(seed)
    ratios = _bootstrap_medians(_groups(new, "new"), resamples, rng) / _bootstrap_medians(
        _groups(old, "old"), resamples, rng
    )
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = (float(v) for v in np.percentile(ratios, [tail, 100.0 - tail]))
    return ratio, min(low, ratio), max(high, ratio)


def verdict(
    ratio: float,
    ratio_ci95: tuple[float, float] | None,
    p_value: float | None,
    threshold: float,
    *,
    higher_is_better: bool = False,
) -> str:
    """The verdict on ``ratio = new / old`` under ``threshold`` (a fraction: 0.05 is 5%), as described above.

    Args:
        ratio: ``new / old`` of the medians (> 0).
        ratio_ci95: its interval, or ``None`` when there is none.
        p_value: the test's p-value, or ``None`` when there is none.
        threshold: the smallest change worth a verdict, a fraction >= 0.
        higher_is_better: ``True`` for a speed (samples/s), ``False`` for a time (seconds).

    Returns:
        ``"slower"``, ``"faster"`` or ``"no clear difference"``.
    """
    check_number("verdict", "threshold", threshold, 0.0)
    check_number("verdict", "ratio", ratio, 0.0, exclusive=True)
    # Work on the "time" scale: > 1 is worse. A speed's ratio is inverted (its interval too, ends swapped).
    worse = 1.0 / ratio if higher_is_better else ratio
    interval = None
    if ratio_ci95 is not None:
        low, high = ratio_ci95
        interval = (1.0 / high, 1.0 / low) if higher_is_better else (low, high)
    significant = p_value is not None and p_value < SIGNIFICANCE_LEVEL
    upper, lower = 1.0 + threshold, 1.0 / (1.0 + threshold)
    # The test counts only when the interval agrees that there is a change (it excludes 1): the rank test on pooled
    # steps ignores that steps of one process vary together, the interval of grouped samples does not.
    if worse > upper and (
        (significant and (interval is None or interval[0] > 1.0)) or (interval is not None and interval[0] > upper)
    ):
        return SLOWER
    if worse < lower and (
        (significant and (interval is None or interval[1] < 1.0)) or (interval is not None and interval[1] < lower)
    ):
        return FASTER
    return NO_CLEAR_DIFFERENCE


def compare_samples(
    old: Sample,
    new: Sample,
    threshold: float,
    *,
    higher_is_better: bool = False,
    resamples: int = 2000,
    seed: int = 0,
) -> SampleComparison:
    """Compare two independent samples of one figure: ratio of medians, its 95% interval, p-value and verdict.

    With fewer than two values on a side there is no test and no interval: the ratio is reported and the verdict is
    ``"no clear difference"`` (one value cannot tell a change from noise). A sample given as groups (one list per
    repeat) is pooled for the medians and the test, and resampled in two stages for the interval.

    Args:
        old: the old run's values (positive finite numbers, at least one), flat or as groups.
        new: the new run's values, likewise.
        threshold: the smallest change worth a verdict, a fraction >= 0 (0.05 is 5%).
        higher_is_better: ``True`` for a speed, ``False`` for a time or a size.
        resamples: bootstrap resamples for the interval.
        seed: the bootstrap's seed.

    Example::

        >>> compare_samples([1.0] * 10, [2.0] * 10, 0.05).verdict
        'slower'
    """
    a, b = _flat(old, "old"), _flat(new, "new")
    _check_positive(a, "old")
    _check_positive(b, "new")
    if a.size < 2 or b.size < 2:
        ratio = float(np.median(b) / np.median(a))
        return SampleComparison(ratio, None, None, NO_CLEAR_DIFFERENCE, False, int(a.size), int(b.size))
    ratio, low, high = ratio_of_medians_ci(old, new, resamples=resamples, seed=seed)
    p_value = mann_whitney_u(a.tolist(), b.tolist()).p_value
    call = verdict(ratio, (low, high), p_value, threshold, higher_is_better=higher_is_better)
    return SampleComparison(ratio, (low, high), p_value, call, call == SLOWER, int(a.size), int(b.size))
