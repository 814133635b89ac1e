"""Summary statistics of repeated measurements: the median and its spread, never a lone mean.

The one statistics module of the package (the bench, the tuner, export validation, the leak trend and the reports use
it). Built on NumPy, not hand-written: percentiles are ``numpy.percentile`` with its default ``method="linear"``
(Hyndman and Fan's type 7, the standard library's ``statistics.quantiles(method="inclusive")``): for sorted values
``x[0..n-1]`` the ``q``-th percentile sits at rank ``(n - 1) * q / 100``, interpolated between its two neighbours.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np

__all__ = ["Stats", "median", "median_of_repeats", "percentile", "summarize"]

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
    """The ``q``-th percentile (0 to 100) of the values, by linear interpolation; NaN when empty.

    The values need not be sorted (the name stays for the callers that pass sorted ones).

    Raises:
        ValueError: if ``q`` is outside [0, 100].
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"`percentile(q={q!r})` is out of range. Expected a number between 0 and 100.")
    if len(sorted_values) == 0:
        return _NAN
    with np.errstate(invalid="ignore"):  # an infinite neighbour gives NaN, as inf - inf does
        return float(np.percentile(np.asarray(sorted_values, dtype=np.float64), q))


def median(values: Sequence[float]) -> float:
    """The median of the values (the mean of the two middle ones for an even count); NaN when empty."""
    return percentile(values, 50.0)


def median_of_repeats(repeats: Sequence[Sequence[float] | float]) -> float:
    """The figure a repeated measurement quotes: the median of the per-repeat medians; NaN when there is none.

    The one definition of a configuration's step time shared by ``lightning-perf bench`` (its table) and
    ``lightning-perf compare`` (reading the same file), so both print the same number. Each repeat is one process:
    its steady-state step times (warm-up excluded) or one figure; empty repeats are skipped. Per repeat first, so a
    repeat with more steps does not weigh more, and the ratios (paired per repeat) and the time quoted agree.

    Example::

        >>> median_of_repeats([[1.0, 1.2, 1.1], [2.0, 2.1], 1.5])
        1.5
    """
    medians = []
    for repeat in repeats:
        values = [float(repeat)] if isinstance(repeat, (int, float)) else [float(v) for v in repeat]
        if values:
            medians.append(median(values))
    return median(medians)


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
    data = np.asarray([float(v) for v in values], dtype=np.float64)
    n = int(data.size)
    if n == 0:
        return Stats(0, _NAN, _NAN, _NAN, _NAN, _NAN, _NAN, _NAN, _NAN, _NAN)
    if (bad := int(np.isnan(data).sum())) > 0:
        raise ValueError(f"`summarize()` got {bad} NaN value(s) among {n}. Expected numbers; drop failed runs first.")
    total = math.fsum(data.tolist())
    with np.errstate(invalid="ignore"):  # infinite values give NaN spreads, as inf - inf does
        p10, p25, p50, p75, p90 = (float(v) for v in np.percentile(data, [10.0, 25.0, 50.0, 75.0, 90.0]))
        std = float(np.std(data, ddof=1)) if n > 1 else _NAN
    return Stats(
        count=n,
        total=total,
        mean=total / n,
        median=p50,
        p10=p10,
        p90=p90,
        min=float(data.min()),
        max=float(data.max()),
        std=std,
        iqr=p75 - p25,
    )
