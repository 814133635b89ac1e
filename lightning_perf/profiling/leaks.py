"""Memory-leak detection: a significant, steady growth of memory sampled at the same point of many training steps.

Entry points: :func:`detect_leaks` (the verdict per point: rate, significance, steadiness, practical size, with no
absolute bound in bytes), :class:`LeakSeries`, :class:`ResidentSeries`, and the statistics :func:`theil_sen_slope`,
:func:`sen_slope_interval`, :func:`rises_steadily`, :func:`noise_floor`. No Lightning; plain NumPy. The rules, why each
holds and the measurements behind them: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lightning_perf._validation import check_int, check_number

__all__ = [
    "MAX_TREND_POINTS",
    "MIN_LEAK_SAMPLES",
    "NOISE_BLOCK",
    "NOISE_FLOOR_STEPS",
    "SEGMENTS",
    "LeakSeries",
    "LeakTrend",
    "ResidentSeries",
    "SlopeInterval",
    "could_leak",
    "detect_leaks",
    "noise_floor",
    "rises_steadily",
    "sen_slope_interval",
    "theil_sen_slope",
    "trend_of",
]

MAX_TREND_POINTS = 256
"""Above this many samples, the slope is fitted on medians of consecutive groups (the pairs grow as n^2)."""
SEGMENTS = 3
"""Consecutive parts of the samples in each of which the growth must be significant (steadiness)."""
MIN_SEGMENT_SAMPLES = 6
"""Below six samples, Sen's 95% interval cannot exclude zero even for a perfectly straight line."""
MIN_LEAK_SAMPLES = SEGMENTS * MIN_SEGMENT_SAMPLES
"""The fewest samples with which a point can be flagged at all (18)."""
NOISE_FLOOR_STEPS = 4
"""A leak's growth over this many steps must reach the noise floor (see :func:`detect_leaks`)."""
NOISE_BLOCK = 32
"""Samples per block over which :func:`noise_floor` measures the readings' scatter."""
_Z_975 = 1.959963984540054  # the 97.5th percentile of the standard normal distribution
_MAD_TO_SIGMA = 1.4826  # scales a median absolute deviation to a standard deviation for normal noise


def _thin(xs: Sequence[float], ys: Sequence[float], max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """Medians of consecutive groups of equal size, at most ``max_points`` of them, so a long run costs a bounded time.

    The few leading samples that do not fill a group are left out (the latest samples are the ones that matter).
    """
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if x.size <= max_points:
        return x, y
    size = -(-x.size // max_points)  # ceil: at most max_points groups
    groups = x.size // size
    start = x.size - groups * size
    return (
        np.median(x[start:].reshape(groups, size), axis=1),
        np.median(y[start:].reshape(groups, size), axis=1),
    )


def _check_series(name: str, xs: Sequence[float], ys: Sequence[float], max_points: int) -> None:
    if len(xs) != len(ys):
        raise ValueError(f"`{name}()` needs one y per x: got {len(xs)} xs and {len(ys)} ys.")
    check_int(name, "max_points", max_points, 2)


def _pair_slopes(px: np.ndarray, py: np.ndarray) -> np.ndarray:
    i, j = np.triu_indices(len(px), 1)
    dx = px[j] - px[i]
    keep = dx != 0
    return (py[j] - py[i])[keep] / dx[keep]


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
    _check_series("theil_sen_slope", xs, ys, max_points)
    slopes = _pair_slopes(*_thin(xs, ys, max_points))
    return float(np.median(slopes)) if slopes.size else math.nan


@dataclass(frozen=True)
class SlopeInterval:
    """A Theil-Sen slope with Sen's distribution-free 95% interval.

    Attributes:
        slope: the median pairwise slope; NaN without two distinct positions.
        low: lower bound of the 95% interval; ``-inf`` when too few samples bound it.
        high: upper bound of the 95% interval; ``inf`` when too few samples bound it.
        samples: the samples the slope was fitted on (after thinning).
    """

    slope: float
    low: float
    high: float
    samples: int

    @property
    def grows(self) -> bool:
        """Whether the whole interval lies above zero: growth that noise alone would rarely produce."""
        return self.low > 0


def sen_slope_interval(xs: Sequence[float], ys: Sequence[float], max_points: int = MAX_TREND_POINTS) -> SlopeInterval:
    """The Theil-Sen slope and Sen's (1968) distribution-free 95% confidence interval for it.

    With ``N`` pairwise slopes sorted, the bounds are the ``M1``-th and ``(M2 + 1)``-th of them, where
    ``M1, M2 = (N -+ z * sqrt(Var S)) / 2``, ``z = 1.96`` and ``Var S`` is the variance of Kendall's S with the
    correction for tied ``y`` values, ``(n(n-1)(2n+5) - sum t(t-1)(2t+5)) / 18``. Ranks are rounded outwards, so the
    interval is never narrower than 95%. It assumes independent deviations from the line; the callers guard against
    correlated noise with the steadiness and noise-floor rules (see the module notes).

    Args:
        xs: positions (e.g. step indices), increasing.
        ys: values at those positions.
        max_points: above this many samples, consecutive groups are first reduced to their medians.

    Raises:
        ValueError: if ``xs`` and ``ys`` differ in length or ``max_points`` < 2.

    Example::

        >>> r = sen_slope_interval(range(10), [3 * x for x in range(10)])
        >>> (r.slope, r.low, r.high)
        (3.0, 3.0, 3.0)
    """
    _check_series("sen_slope_interval", xs, ys, max_points)
    x, y = _thin(xs, ys, max_points)
    slopes = np.sort(_pair_slopes(x, y))
    n, pairs = len(x), int(slopes.size)
    if pairs == 0:
        return SlopeInterval(math.nan, -math.inf, math.inf, n)
    _, ties = np.unique(y, return_counts=True)
    variance = (n * (n - 1) * (2 * n + 5) - float(np.sum(ties * (ties - 1) * (2 * ties + 5)))) / 18.0
    spread = _Z_975 * math.sqrt(max(variance, 0.0))
    lower_rank = math.floor((pairs - spread) / 2)  # 1-based ranks of the bounds among the sorted slopes
    upper_rank = math.ceil((pairs + spread) / 2) + 1
    low = float(slopes[lower_rank - 1]) if lower_rank >= 1 else -math.inf
    high = float(slopes[upper_rank - 1]) if upper_rank <= pairs else math.inf
    return SlopeInterval(float(np.median(slopes)), low, high, n)


def noise_floor(xs: Sequence[float], ys: Sequence[float], slope: float, block: int = NOISE_BLOCK) -> float:
    """The scatter of the readings around the line of ``slope``, measured locally: the noise floor.

    The samples are cut into consecutive blocks of ``block`` samples (a shorter tail joins the last block); in each,
    the residuals from the line (each block at its own median level) give a robust scatter, 1.4826 x their median
    absolute deviation (the standard deviation for normal noise; a minority of wild readings does not move it). The
    floor is the median over the blocks. Measured over blocks of fixed length rather than the whole window, it does
    not grow with the length of the run when the allocator drifts like a random walk. The line is the whole run's,
    not each block's own: a block's own line would follow the allocator's jumps and make its churn look smooth.

    Returns:
        The floor in the units of ``ys``; NaN when there are no samples or the slope is NaN.
    """
    if len(ys) == 0 or math.isnan(slope):
        return math.nan
    residuals = np.asarray(ys, dtype=np.float64) - slope * np.asarray(xs, dtype=np.float64)
    blocks = max(1, residuals.size // max(int(block), 2))
    bounds = [b * residuals.size // blocks for b in range(blocks + 1)]
    scatters = [
        np.median(np.abs(part - np.median(part)))
        for part in (residuals[lo:hi] for lo, hi in itertools.pairwise(bounds))
    ]
    return float(_MAD_TO_SIGMA * np.median(scatters))


def rises_steadily(ys: Sequence[float]) -> bool:
    """Whether consecutive readings go up significantly more often than down: a one-sided sign test at 2.5%.

    The readings are first smoothed by a running median of three, which removes a single wild reading (a transient
    buffer alive at the moment of reading) and keeps a rise or a level shift. Differences of zero are left out. With
    ``u`` rises among ``n`` nonzero differences the test asks ``u - n/2 > 1.96 * sqrt(n)/2`` (the normal approximation
    of the binomial), the level of the lower bound of a 95% interval. One jump or one drop changes a single
    difference, whatever its size.
    """
    y = list(ys)  # plain Python: on the few dozen readings of a screen, 8x faster than NumPy's per-call overhead
    if len(y) >= 3:
        y = [y[0], *(sorted(t)[1] for t in zip(y, y[1:], y[2:])), y[-1]]
    ups, downs = sum(b > a for a, b in itertools.pairwise(y)), sum(b < a for a, b in itertools.pairwise(y))
    n = ups + downs
    return n > 0 and ups - n / 2 > _Z_975 * math.sqrt(n) / 2


@dataclass(frozen=True)
class LeakTrend:
    """The growth of memory sampled at one point of the step, and whether it is a leak.

    Attributes:
        point: where in the step the memory was sampled (e.g. ``"after_optimizer"``).
        slope: robust growth rate in bytes per step (Theil-Sen); NaN with too few samples.
        samples: number of samples the trend was fitted on (warm-up excluded).
        first_step: step index of the first of them.
        last_step: step index of the last of them.
        first_bytes: memory at the first sample.
        last_bytes: memory at the last sample.
        leaking: significant (lower bound above zero), steady (significant in every segment) and reaching the noise
            floor within :data:`NOISE_FLOOR_STEPS` steps, over at least the minimum number of samples (see the
            module notes).
        slope_low: lower bound of the slope's 95% interval (Sen), bytes per step.
        slope_high: upper bound of the slope's 95% interval, bytes per step.
        noise_floor: robust scatter of the samples around the fitted line, in bytes.
        segments_growing: in how many of the :data:`SEGMENTS` consecutive parts the readings rise steadily
            (:func:`rises_steadily`).
        threshold: the optional extra bound in bytes per step the slope had to exceed (None: none).
    """

    point: str
    slope: float
    samples: int
    first_step: int
    last_step: int
    first_bytes: int
    last_bytes: int
    leaking: bool
    slope_low: float = -math.inf
    slope_high: float = math.inf
    noise_floor: float = math.nan
    segments_growing: int = 0
    threshold: float | None = None

    @property
    def growth(self) -> float:
        """Bytes gained over the observed steps according to the trend (``slope`` times the steps spanned)."""
        return self.slope * (self.last_step - self.first_step) if self.samples else math.nan

    @property
    def significant(self) -> bool:
        """Whether the slope's 95% interval lies above zero."""
        return self.slope_low > 0

    def to_dict(self) -> dict[str, Any]:
        """The fields plus ``growth``, ``significant`` and ``slope_ci95: [low, high]``, for JSON reports."""
        return {
            **asdict(self),
            "slope_ci95": [self.slope_low, self.slope_high],
            "growth": self.growth,
            "significant": self.significant,
        }


def _check_samples(name: str, min_samples: Any) -> int:
    if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < MIN_LEAK_SAMPLES:
        raise ValueError(
            f"`{name}(min_samples={min_samples!r})` is not valid. Expected an int >= {MIN_LEAK_SAMPLES} "
            f"({SEGMENTS} segments of at least {MIN_SEGMENT_SAMPLES} samples: fewer can never show significant "
            "growth)."
        )
    return min_samples


def trend_of(
    point: str,
    steps: Sequence[int],
    values: Sequence[int],
    min_samples: int = 30,
    threshold: float | None = None,
) -> LeakTrend:
    """Judge one point's samples (see the module notes); :func:`detect_leaks` does it for every point."""
    n = len(steps)
    if n < 2:
        first, last = (int(steps[0]), int(steps[-1])) if n else (-1, -1)
        first_bytes, last_bytes = (int(values[0]), int(values[-1])) if n else (0, 0)
        return LeakTrend(point, math.nan, n, first, last, first_bytes, last_bytes, False, threshold=threshold)
    whole = sen_slope_interval(steps, values)
    floor = noise_floor(steps, values, whole.slope)
    growing = 0
    if n >= min_samples:
        for s in range(SEGMENTS):
            lo, hi = s * n // SEGMENTS, (s + 1) * n // SEGMENTS
            growing += rises_steadily(values[lo:hi])
    leaking = (
        n >= min_samples
        and whole.grows
        and growing == SEGMENTS
        and whole.slope * NOISE_FLOOR_STEPS >= floor
        and (threshold is None or whole.slope > threshold)
    )
    return LeakTrend(
        point=point,
        slope=whole.slope,
        samples=n,
        first_step=int(steps[0]),
        last_step=int(steps[-1]),
        first_bytes=int(values[0]),
        last_bytes=int(values[-1]),
        leaking=bool(leaking),
        slope_low=whole.low,
        slope_high=whole.high,
        noise_floor=floor,
        segments_growing=growing,
        threshold=threshold,
    )


def could_leak(values: Sequence[int], min_samples: int = 30) -> bool:
    """Two of :func:`trend_of`'s conditions, the cheap ones: at least ``min_samples`` readings, rising steadily in
    each of the :data:`SEGMENTS` parts. False means :func:`trend_of` would not flag the point either, so a check
    renewed while training can stop here (tens of microseconds) instead of fitting the trend (milliseconds)."""
    n = len(values)
    return n >= min_samples and all(
        rises_steadily(values[s * n // SEGMENTS : (s + 1) * n // SEGMENTS]) for s in range(SEGMENTS)
    )


def detect_leaks(
    series: Mapping[str, tuple[Sequence[int], Sequence[int]]],
    threshold: float | None = None,
    min_samples: int = 30,
) -> dict[str, LeakTrend]:
    """Fit a robust trend per point and flag the points whose memory grows steadily and significantly.

    A point is flagged when, over at least ``min_samples`` samples, the Theil-Sen slope's 95% interval lies above
    zero, the readings rise steadily in each of :data:`SEGMENTS` consecutive parts of the samples, and the growth over
    :data:`NOISE_FLOOR_STEPS` steps reaches the noise floor of the readings (the module notes say why).

    Args:
        series: ``{point: (steps, bytes)}``, steps increasing, warm-up already left out.
        threshold: optional extra bound: a slope must also exceed this many bytes per step (> 0). ``None`` (the
            default) sets no absolute bound.
        min_samples: fewer samples than this never flag a point (at least :data:`MIN_LEAK_SAMPLES`).

    Returns:
        ``{point: LeakTrend}`` in the order of ``series``.

    Raises:
        ValueError: if ``threshold`` is not None nor a positive finite number, or ``min_samples`` is too small.

    Example::

        >>> steps = list(range(100))
        >>> detect_leaks({"after_optimizer": (steps, [10_000 + 1024 * s for s in steps])})["after_optimizer"].leaking
        True
    """
    if threshold is not None:
        check_number("detect_leaks", "threshold", threshold, 0.0, exclusive=True)
    min_samples = _check_samples("detect_leaks", min_samples)
    return {
        point: trend_of(point, steps, values, min_samples, None if threshold is None else float(threshold))
        for point, (steps, values) in series.items()
    }


class LeakSeries:
    """Memory in use at named points of every step, in fixed storage, for :func:`detect_leaks`.

    Storage is allocated once (``capacity`` rows of int64), so recording does not itself grow the heap it measures.
    One step in ``stride`` is recorded. When the storage is full, every other row is
    dropped and from then on the stride doubles: a run of any length keeps an evenly spread series of at most
    ``capacity`` steps.

    Args:
        points: the names of the points, in step order.
        capacity: rows kept at most (>= 2 * :data:`MIN_LEAK_SAMPLES`).
        stride: record one step in this many from the start (steps whose index is a multiple of it).

    Raises:
        ValueError: for no point, a capacity too small or not an int, or a stride below 1.

    Example::

        series = LeakSeries(["after_optimizer"])
        for step in range(100):
            if series.start_step(step, epoch=0):
                series.record("after_optimizer", probe.allocated())
        trends = detect_leaks(series.series(first_step=10))
    """

    _MISSING = -1

    def __init__(self, points: Sequence[str], capacity: int = 2048, stride: int = 1) -> None:
        if not points:
            raise ValueError("`LeakSeries(points=[])` is not valid. Expected at least one point name.")
        check_int("LeakSeries", "capacity", capacity, 2 * MIN_LEAK_SAMPLES)
        check_int("LeakSeries", "stride", stride, 1)
        self.points = tuple(points)
        self._column = {p: i for i, p in enumerate(self.points)}
        self._values = np.full((capacity, len(self.points)), self._MISSING, dtype=np.int64)
        self._steps = np.zeros(capacity, dtype=np.int64)
        self._epochs = np.zeros(capacity, dtype=np.int64)
        self.rows = 0
        self.stride = stride
        self.stopped_at: int | None = None
        self._row = -1

    def stop(self, step: int) -> None:
        """Record nothing from ``step`` on (what was recorded stays)."""
        self.stopped_at = step
        self._row = -1

    def start_step(self, step: int, epoch: int) -> bool:
        """Open a row for ``step`` if it is one of the recorded steps (every ``stride``-th); return whether it is."""
        if self.stopped_at is not None or step % self.stride:
            self._row = -1
            return False
        if self.rows == len(self._steps):
            half = (self.rows + 1) // 2
            self._values[:half] = self._values[: self.rows : 2]
            self._steps[:half] = self._steps[: self.rows : 2]
            self._epochs[:half] = self._epochs[: self.rows : 2]
            self._values[half:] = self._MISSING
            self.rows, self.stride = half, self.stride * 2
            if step % self.stride:
                self._row = -1
                return False
        self._row = self.rows
        self._steps[self._row] = step
        self._epochs[self._row] = epoch
        self.rows += 1
        return True

    def skip_step(self) -> None:
        """A step known not to be recorded (:meth:`will_record` said so) begins: no row for it."""
        self._row = -1

    def will_record(self, step: int) -> bool:
        """Whether :meth:`start_step` would open a row for ``step`` (at the current stride; a halving on that very
        step can still make it skip)."""
        return self.stopped_at is None and step % self.stride == 0

    def wants(self, point: str, overwrite: bool = True) -> bool:
        """Whether :meth:`record` of ``point`` would store a value now: a reading not worth taking otherwise."""
        return self._row >= 0 and (overwrite or self._values[self._row, self._column[point]] == self._MISSING)

    @property
    def recording(self) -> bool:
        """Whether the current step has a row."""
        return self._row >= 0

    def record(self, point: str, value: int, overwrite: bool = True) -> None:
        """Store ``value`` for ``point`` in the current step's row (nothing when the step is not recorded)."""
        if self._row < 0:
            return
        cell = (self._row, self._column[point])
        if overwrite or self._values[cell] == self._MISSING:
            self._values[cell] = value

    def first_step_of_epoch_after(self, epoch: int) -> int | None:
        """The first recorded step of a later epoch than ``epoch``; None when the run has not got there."""
        later = np.nonzero(self._epochs[: self.rows] > epoch)[0]
        return int(self._steps[later[0]]) if later.size else None

    def series(self, first_step: int = 0) -> dict[str, tuple[list[int], list[int]]]:
        """``{point: (steps, bytes)}`` of the recorded steps from ``first_step`` on, for :func:`detect_leaks`."""
        keep = self._steps[: self.rows] >= first_step
        out = {}
        for point, column in self._column.items():
            values = self._values[: self.rows, column]
            ok = keep & (values != self._MISSING)
            out[point] = (self._steps[: self.rows][ok].tolist(), values[ok].tolist())
        return out


class ResidentSeries:
    """One reading per recorded step, in preallocated storage: the hot path of a signal read at every step.

    :meth:`add` costs two array stores and a few integer checks (no NumPy scalar, no allocation): it runs on every
    training step. When the storage is full, every other row is dropped and the stride doubles, as in
    :class:`LeakSeries`.

    Example::

        series = ResidentSeries()
        for step in range(100):
            series.add(step, epoch=0, value=probe.resident())
        steps, values = series.series(first_step=10)
    """

    __slots__ = ("rows", "second_epoch", "steps", "stride", "values")

    def __init__(self, capacity: int = 2048, stride: int = 1) -> None:
        self.steps, self.values = array("q", bytes(8 * capacity)), array("q", bytes(8 * capacity))
        self.rows, self.stride = 0, stride
        self.second_epoch: int | None = None  # the first recorded step of a later epoch than the first

    def add(self, step: int, epoch: int, value: int) -> bool:
        """Record ``value`` for ``step`` if it is one of the recorded steps (every ``stride``-th); return whether."""
        if step % self.stride:
            return False
        rows = self.rows
        if rows == len(self.steps):
            half = (rows + 1) // 2
            self.steps[:half], self.values[:half] = self.steps[:rows:2], self.values[:rows:2]
            rows, self.stride = half, self.stride * 2
            if step % self.stride:
                self.rows = rows
                return False
        self.steps[rows], self.values[rows], self.rows = step, value, rows + 1
        if epoch and self.second_epoch is None:
            self.second_epoch = step
        return True

    def series(self, first_step: int = 0) -> tuple[list[int], list[int]]:
        """``(steps, values)`` of the recorded steps from ``first_step`` on."""
        steps = self.steps[: self.rows].tolist()
        start = next((i for i, step in enumerate(steps) if step >= first_step), len(steps))
        return steps[start:], self.values[start : self.rows].tolist()
