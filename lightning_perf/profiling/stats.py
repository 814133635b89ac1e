"""Summary statistics of repeated measurements: the median and its spread, never a lone mean.

Percentiles use linear interpolation between closest ranks (Hyndman and Fan's type 7, NumPy's default
``method="linear"``): for sorted values ``x[0..n-1]`` the ``q``-th percentile sits at rank ``(n - 1) * q / 100``,
interpolated between its two neighbours. Pure Python, so it costs nothing to import and works on any sequence of
numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields

__all__ = ["Stats", "percentile", "summarize"]

_NAN = float("nan")


@dataclass(frozen=True)
class Stats:
    """Summary of a sample of measurements (seconds, bytes, ratios: whatever unit the values had).

    An empty sample has ``count == 0`` and every other field NaN, so a report can still be written.

    Attributes:
        count: number of values.
        total: their sum.
        mean: arithmetic mean.
        median: 50th percentile; the figure to quote.
        p10: 10th percentile.
        p90: 90th percentile.
        min: smallest value.
        max: largest value.
        std: sample standard deviation (``n - 1`` in the denominator); NaN for fewer than two values.
        iqr: interquartile range, 75th minus 25th percentile: a spread that outliers do not inflate.
    """

    count: int
    total: float
    mean: float
    median: float
    p10: float
    p90: float
    min: float
    max: float
    std: float
    iqr: float

    def to_dict(self) -> dict[str, float | int]:
        """The fields as a plain dict (NaN stays NaN; :func:`~lightning_perf.profiling.write_json` writes null)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, float | int | None]) -> Stats:
        """Rebuild from :meth:`to_dict` output, also after a JSON round trip where NaN became ``None``."""
        values = {f.name: data.get(f.name) for f in fields(cls)}
        count = int(values.pop("count") or 0)
        return cls(count=count, **{k: _NAN if v is None else float(v) for k, v in values.items()})


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100) of already sorted values, by linear interpolation; NaN when empty.

    Raises:
        ValueError: if ``q`` is outside [0, 100].
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"`percentile(q={q!r})` is out of range. Expected a number between 0 and 100.")
    n = len(sorted_values)
    if n == 0:
        return _NAN
    rank = (n - 1) * q / 100.0
    lower = math.floor(rank)
    upper = min(lower + 1, n - 1)
    low_value = float(sorted_values[lower])
    return low_value + (float(sorted_values[upper]) - low_value) * (rank - lower)


def summarize(values: Sequence[float]) -> Stats:
    """Summarize ``values`` into :class:`Stats`.

    Args:
        values: the measurements, in any order. Infinite values are kept; NaN is refused because it has no rank.

    Returns:
        The statistics; for an empty sequence ``count == 0`` and NaN everywhere else.

    Raises:
        ValueError: if a value is NaN.

    Example::

        >>> summarize([1.0, 2.0, 3.0, 4.0]).median
        2.5
    """
    data = sorted(float(v) for v in values)
    n = len(data)
    if n == 0:
        return Stats(0, _NAN, _NAN, _NAN, _NAN, _NAN, _NAN, _NAN, _NAN, _NAN)
    # NaN compares false with everything, so after sorting it may sit anywhere: look at every value.
    if any(math.isnan(v) for v in data):
        bad = sum(math.isnan(v) for v in data)
        raise ValueError(f"`summarize()` got {bad} NaN value(s) among {n}. Expected numbers; drop failed runs first.")
    total = math.fsum(data)
    mean = total / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in data) / (n - 1)) if n > 1 else _NAN
    return Stats(
        count=n,
        total=total,
        mean=mean,
        median=percentile(data, 50.0),
        p10=percentile(data, 10.0),
        p90=percentile(data, 90.0),
        min=data[0],
        max=data[-1],
        std=std,
        iqr=percentile(data, 75.0) - percentile(data, 25.0),
    )
