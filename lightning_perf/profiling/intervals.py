"""Ratios with a 95% interval and a verdict: how a comparison says "faster", "slower" or "no clear difference".

Two runs measured apart (``lightning-perf compare``) go through :func:`unpaired_ratio`; the rest of this note is
about paired ratios (:func:`paired_ratio`).

A ratio compares two configurations measured in the same session, repeat by repeat (repeat ``i`` of the numerator is
paired with repeat ``i`` of the denominator, so a drift of the machine falls on both). The method follows the number
of paired repeats:

- ``t interval over paired repeats`` (two or more): one ratio per repeat (of the per-repeat medians when steps are
  given), a Student t interval on the logarithms of those ratios, transformed back; the point estimate is their
  geometric mean. Each repeat is its own process (in the bench), so the spread between them holds the variation
  between processes (20-50% between processes of one configuration on a shared 2-core machine) as well as the steps'
  noise inside each: a bootstrap over steps, or over two or three repeats, sees little of it (with two repeats its
  interval is about the span of the two ratios, which misses 1 half the time in an A/A comparison). The price:
  with 2 repeats the t quantile is 12.7, with 3 it is 4.3, so few repeats give wide intervals.
- ``bootstrap over the steps of one repeat`` (one repeat with step samples): the steps resampled with replacement
  (a seeded NumPy generator); it sees only the noise inside that one process, and says so in its name. The bench
  gives one repeat no interval at all.

The verdict is the side of 1 on which the whole interval lies, and a ratio at least ``threshold`` away from 1 (the
bench passes :data:`lightning_perf.benchmark.compare.DEFAULT_THRESHOLD`, 5%): above gives ``above_one`` (``"faster"``
for a speed-up, baseline time / candidate time), below gives ``below_one`` (``"slower"``); else ``"no clear
difference"``.

False verdicts: when the per-repeat log-ratios are independent and normal (processes that vary log-normally), a
comparison of two identical configurations (A/A) gets a verdict with probability at most 5% (2.5% per side) at every
number of repeats: close to 5% when the spread between processes is large against the threshold (simulated, 10% or
30% per process: 4.5-5.5% at 2, 3 and 5 repeats), lower when it is small (2% per process: 0.5-1%). At 5%, 20 A/A runs
give at most one false verdict with probability 74%; at 2%, 94%. The power is what the spread allows: a real 1.5x is
found at 5 repeats 99% of the time with 10% per process, 35% with 30% (then 8 repeats: 64%).
Plain NumPy: no SciPy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_perf._validation import check_int, check_number
from lightning_perf.profiling.report import format_ratio

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "METHOD_BOOTSTRAP",
    "METHOD_SINGLE",
    "METHOD_T",
    "METHOD_WELCH",
    "NO_CLEAR_DIFFERENCE",
    "RatioEstimate",
    "paired_ratio",
    "t_critical_95",
    "unpaired_ratio",
]

BOOTSTRAP_RESAMPLES = 2000
"""Resamples of the bootstrap: enough for stable 2.5th/97.5th percentiles (about 50 resamples lie beyond each)."""
NO_CLEAR_DIFFERENCE = "no clear difference"
METHOD_T = "t interval over paired repeats"
METHOD_BOOTSTRAP = "bootstrap over the steps of one repeat"
METHOD_SINGLE = "one paired repeat: no interval"
METHOD_WELCH = "Welch t interval over the repeats of two runs"

# Two-sided 95% quantiles of Student's t distribution, t_{0.975}(df), for df = 1..30 (standard tables).
_T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip

Samples = Sequence[float] | Sequence[Sequence[float]]


def t_critical_95(df: int) -> float:
    """The two-sided 95% critical value of Student's t with ``df`` degrees of freedom.

    Exact to three decimals up to 30 degrees of freedom (table); beyond, the Cornish-Fisher expansion around the
    normal quantile 1.95996, within 0.001 of the exact value.

    Raises:
        ValueError: if ``df`` is not a positive integer.
    """
    check_int("t_critical_95", "df", df, 1)
    if df <= len(_T_975):
        return _T_975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class RatioEstimate:
    """A ratio of two paired measurements with its 95% interval and verdict.

    Attributes:
        ratio: the point estimate (geometric mean of the paired per-repeat ratios).
        low: lower end of the 95% interval (``low <= ratio``); equal to ``ratio`` when there is no interval.
        high: upper end (``ratio <= high``).
        method: how the interval was obtained (:data:`METHOD_T`, :data:`METHOD_WELCH`, :data:`METHOD_BOOTSTRAP` or
            :data:`METHOD_SINGLE`).
        verdict: ``above_one`` / ``below_one`` of :func:`paired_ratio` when the interval excludes 1 and the ratio
            is beyond the threshold, else :data:`NO_CLEAR_DIFFERENCE`.
        n: the number of paired repeats.
    """

    ratio: float
    low: float
    high: float
    method: str
    verdict: str
    n: int

    @property
    def has_interval(self) -> bool:
        """Whether an interval was computed (not a single figure per side)."""
        return self.method != METHOD_SINGLE

    def to_dict(self, prefix: str) -> dict[str, Any]:
        """The estimate under results-JSON keys: ``prefix``, ``prefix_ci95`` (``[low, high]``, or ``None`` without
        an interval), ``prefix_verdict``, ``prefix_method`` and ``prefix_n``."""
        return {
            prefix: self.ratio,
            f"{prefix}_ci95": [self.low, self.high] if self.has_interval else None,
            f"{prefix}_verdict": self.verdict,
            f"{prefix}_method": self.method,
            f"{prefix}_n": self.n,
        }

    def format(self, digits: int = 2) -> str:
        """``"1.52x [1.40-1.65]"`` (or ``"1.52x"`` without an interval)."""
        return format_ratio(self.ratio, [self.low, self.high] if self.has_interval else None, digits=digits)


def _as_repeats(samples: Samples, name: str, owner: str = "paired_ratio") -> list[np.ndarray]:
    repeats = []
    for i, item in enumerate(samples):
        values = np.atleast_1d(np.asarray(item, dtype=np.float64))
        if values.ndim != 1 or values.size == 0:
            raise ValueError(f"`{owner}`: {name}[{i}] has no values. Expected a number or a non-empty list.")
        if not np.all(np.isfinite(values)) or np.any(values <= 0):
            raise ValueError(f"`{owner}`: {name}[{i}] holds {values.tolist()!r}. Expected positive finite numbers.")
        repeats.append(values)
    return repeats


def _verdict(ratio: float, low: float, high: float, threshold: float, above_one: str, below_one: str) -> str:
    if low > 1.0 and ratio >= 1.0 + threshold:
        return above_one
    if high < 1.0 and ratio <= 1.0 / (1.0 + threshold):
        return below_one
    return NO_CLEAR_DIFFERENCE


def paired_ratio(
    numerator: Samples,
    denominator: Samples,
    *,
    above_one: str = "faster",
    below_one: str = "slower",
    threshold: float = 0.0,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> RatioEstimate:
    """The paired ratio ``numerator / denominator`` with a 95% interval and a verdict.

    Args:
        numerator: per repeat, either one figure or the step samples of that repeat (their median is the figure).
            For a speed-up pass the baseline's step times here and the candidate's as ``denominator``.
        denominator: per repeat, the same; repeat ``i`` is paired with ``numerator``'s repeat ``i``.
        above_one: the verdict when the whole interval lies above 1 (and the ratio is beyond ``threshold``).
        below_one: the verdict when it lies below 1 (and the ratio is below ``1 / (1 + threshold)``).
        threshold: the smallest change worth a verdict, a fraction >= 0 (0.05: 5%).
        resamples: bootstrap resamples (one repeat with steps).
        seed: the bootstrap generator's seed.

    Returns:
        The estimate, with ``low <= ratio <= high``.

    Raises:
        ValueError: for no repeats, a different number of repeats on each side, a value that is not a positive
            finite number, or a bad ``threshold`` or ``resamples``.

    Example::

        >>> est = paired_ratio([[2.0, 2.1, 1.9]] * 5, [[1.0, 1.05, 0.95]] * 5)
        >>> round(est.ratio, 3), est.verdict
        (2.0, 'faster')
    """
    num, den = _as_repeats(numerator, "numerator"), _as_repeats(denominator, "denominator")
    if not num or len(num) != len(den):
        raise ValueError(
            f"`paired_ratio` got {len(num)} numerator and {len(den)} denominator repeats. "
            "Expected the same positive number of repeats on both sides (repeat i pairs with repeat i)."
        )
    check_int("paired_ratio", "resamples", resamples, 100)
    check_number("paired_ratio", "threshold", threshold, 0.0)
    n = len(num)
    logs = np.array([math.log(np.median(a) / np.median(b)) for a, b in zip(num, den)])
    ratio = float(math.exp(logs.mean()))
    if n >= 2:
        half = t_critical_95(n - 1) * float(logs.std(ddof=1)) / math.sqrt(n)
        low, high, method = math.exp(logs.mean() - half), math.exp(logs.mean() + half), METHOD_T
    elif num[0].size > 1 and den[0].size > 1:
        rng = np.random.default_rng(seed)
        (a,), (b,) = num, den
        ma = np.median(rng.choice(a, size=(resamples, a.size), replace=True), axis=1)
        mb = np.median(rng.choice(b, size=(resamples, b.size), replace=True), axis=1)
        boot = ma / mb
        low, high, method = float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5)), METHOD_BOOTSTRAP
    else:
        return RatioEstimate(ratio, ratio, ratio, METHOD_SINGLE, NO_CLEAR_DIFFERENCE, n)
    low, high = min(low, ratio), max(high, ratio)  # a percentile interval can miss a skewed point estimate
    return RatioEstimate(ratio, low, high, method, _verdict(ratio, low, high, threshold, above_one, below_one), n)


def unpaired_ratio(
    numerator: Samples, denominator: Samples, *, above_one: str, below_one: str, threshold: float = 0.0
) -> RatioEstimate:
    """The ratio ``numerator / denominator`` of two independent runs (two sessions, nothing paired) with its 95%
    interval and verdict (the rule of :func:`paired_ratio`).

    Each side is a list of repeats, each its own process: one figure, or the step samples whose median is the figure.
    The interval is Welch's t interval on the difference of the mean log figures (Welch-Satterthwaite degrees of
    freedom rounded down), transformed back, so the variation between processes counts at every number of repeats;
    the ratio is that of the geometric means. Simulated A/A comparisons (log-normal spread between processes of 2%,
    10% or 30%, 12 steps with 5% noise each) get a verdict in at most 5% of cases with as many repeats a side (0.2-4%
    at 2, 3 and 5), about 6% at 2 against 5 (Welch's approximation is a little liberal when the sides differ).

    Raises:
        ValueError: for fewer than two repeats on a side (one process shows nothing of the spread between them) or a
            value that is not a positive finite number.
    """
    sides = [
        np.log([np.median(r) for r in _as_repeats(s, name, "unpaired_ratio")])
        for s, name in ((numerator, "numerator"), (denominator, "denominator"))
    ]
    if min(len(s) for s in sides) < 2:
        raise ValueError(
            f"`unpaired_ratio` got {len(sides[0])} numerator and {len(sides[1])} denominator repeats. "
            "Expected at least 2 on each side."
        )
    num, den = sides
    var_num, var_den = num.var(ddof=1) / num.size, den.var(ddof=1) / den.size
    spread = var_num + var_den
    df = spread**2 / (var_num**2 / (num.size - 1) + var_den**2 / (den.size - 1)) if spread > 0 else 1.0
    center = float(num.mean() - den.mean())
    half = t_critical_95(max(1, int(df))) * math.sqrt(spread)
    ratio, low, high = math.exp(center), math.exp(center - half), math.exp(center + half)
    verdict = _verdict(ratio, low, high, threshold, above_one, below_one)
    return RatioEstimate(ratio, low, high, METHOD_WELCH, verdict, min(num.size, den.size))
