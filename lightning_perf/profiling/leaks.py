"""Memory-leak detection: a robust growth rate of memory sampled at the same point of many training steps.

Memory read at one point of a step (say, right after the optimizer step) is flat across steps in a healthy run once
warm-up is over (allocator growth, lazily built optimizer state, cudnn workspaces). A leak, typically a list that
keeps losses or outputs together with their autograd graph, makes it climb by about the same amount every step.

The growth rate is the Theil-Sen estimator: the median of the slopes between every pair of samples. Unlike a
least-squares fit it ignores up to about 29% of wild samples (a garbage-collection pause, a one-off buffer, the
first steps of a new epoch), so a clean run does not look like a leak because of a few spikes, and a leak is not
hidden by them. No Lightning; medians come from :mod:`lightning_perf.profiling.stats`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lightning_perf.profiling.stats import median

__all__ = ["MAX_TREND_POINTS", "LeakTrend", "detect_leaks", "theil_sen_slope"]

MAX_TREND_POINTS = 256
"""Above this many samples, :func:`theil_sen_slope` first takes medians of consecutive groups (O(n^2) pairs)."""


def _thin(xs: Sequence[float], ys: Sequence[float], max_points: int) -> tuple[list[float], list[float]]:
    """Medians of consecutive groups, at most ``max_points`` of them, so a long run costs a bounded time."""
    n = len(xs)
    if n <= max_points:
        return [float(x) for x in xs], [float(y) for y in ys]
    out_x, out_y = [], []
    for g in range(max_points):
        lo, hi = g * n // max_points, (g + 1) * n // max_points
        out_x.append(median([float(x) for x in xs[lo:hi]]))
        out_y.append(median([float(y) for y in ys[lo:hi]]))
    return out_x, out_y


def theil_sen_slope(xs: Sequence[float], ys: Sequence[float], max_points: int = MAX_TREND_POINTS) -> float:
    """The median of the slopes ``(y_j - y_i) / (x_j - x_i)`` over all pairs with ``x_i != x_j``.

    Args:
        xs: positions (e.g. step indices), in increasing order.
        ys: values at those positions (e.g. bytes), as many as ``xs``.
        max_points: above this many samples, consecutive groups are first reduced to their medians.

    Returns:
        The slope in units of ``y`` per unit of ``x``; NaN with fewer than two distinct positions.

    Raises:
        ValueError: if ``xs`` and ``ys`` differ in length or ``max_points`` < 2.

    Example::

        >>> theil_sen_slope([0, 1, 2, 3, 4], [10, 12, 14, 100, 18])  # one spike does not move it
        2.0
    """
    if len(xs) != len(ys):
        raise ValueError(f"`theil_sen_slope()` needs one y per x: got {len(xs)} xs and {len(ys)} ys.")
    if max_points < 2:
        raise ValueError(f"`theil_sen_slope(max_points={max_points!r})` is not valid. Expected an int >= 2.")
    px, py = _thin(xs, ys, max_points)
    slopes = [
        (py[j] - py[i]) / (px[j] - px[i]) for i in range(len(px)) for j in range(i + 1, len(px)) if px[j] != px[i]
    ]
    return median(slopes) if slopes else math.nan


@dataclass(frozen=True)
class LeakTrend:
    """The growth of memory sampled at one point of the step.

    Attributes:
        point: where in the step the memory was sampled (e.g. ``"after_optimizer"``).
        slope: robust growth rate in bytes per step (Theil-Sen); NaN with too few samples.
        samples: number of samples the trend was fitted on (warm-up excluded).
        first_step: step index of the first of them.
        last_step: step index of the last of them.
        first_bytes: memory at the first sample.
        last_bytes: memory at the last sample.
        leaking: whether ``slope`` exceeds the threshold with at least the minimum number of samples.
    """

    point: str
    slope: float
    samples: int
    first_step: int
    last_step: int
    first_bytes: int
    last_bytes: int
    leaking: bool

    @property
    def growth(self) -> float:
        """Bytes gained over the observed steps according to the trend (``slope`` times the steps spanned)."""
        return self.slope * (self.last_step - self.first_step) if self.samples else math.nan

    def to_dict(self) -> dict[str, Any]:
        """The fields plus ``growth``, for JSON reports."""
        return {**asdict(self), "growth": self.growth}


def detect_leaks(
    series: Mapping[str, tuple[Sequence[int], Sequence[int]]],
    threshold: float,
    min_samples: int = 10,
) -> dict[str, LeakTrend]:
    """Fit a robust trend per point and flag the points whose memory grows faster than ``threshold``.

    Args:
        series: ``{point: (steps, bytes)}``, steps increasing, warm-up already left out.
        threshold: growth in bytes per step above which a point is flagged (> 0).
        min_samples: fewer samples than this never flag a point: a trend over a handful of steps is noise.

    Returns:
        ``{point: LeakTrend}`` in the order of ``series``.

    Raises:
        ValueError: if ``threshold`` is not a positive finite number or ``min_samples`` < 2.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < math.inf:
        raise ValueError(f"`detect_leaks(threshold={threshold!r})` is not valid. Expected bytes per step > 0.")
    if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 2:
        raise ValueError(f"`detect_leaks(min_samples={min_samples!r})` is not valid. Expected an int >= 2.")
    trends: dict[str, LeakTrend] = {}
    for point, (steps, values) in series.items():
        n = len(steps)
        slope = theil_sen_slope(steps, values) if n >= 2 else math.nan
        trends[point] = LeakTrend(
            point=point,
            slope=slope,
            samples=n,
            first_step=int(steps[0]) if n else -1,
            last_step=int(steps[-1]) if n else -1,
            first_bytes=int(values[0]) if n else 0,
            last_bytes=int(values[-1]) if n else 0,
            leaking=n >= min_samples and not math.isnan(slope) and slope > threshold,
        )
    return trends
