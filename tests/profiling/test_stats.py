"""summarize: exact percentiles by linear interpolation, empty input, NaN refused, dict round trip."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from lightning_perf.profiling import Stats, summarize
from lightning_perf.profiling.stats import median, percentile


def test_known_values() -> None:
    s = summarize([4.0, 1.0, 3.0, 2.0])  # order does not matter
    assert s.count == 4
    assert s.total == 10.0
    assert s.mean == 2.5
    assert s.median == 2.5
    assert s.p10 == pytest.approx(1.3)  # rank 0.3 between 1 and 2
    assert s.p90 == pytest.approx(3.7)
    assert (s.min, s.max) == (1.0, 4.0)
    assert s.iqr == pytest.approx(3.25 - 1.75)
    assert s.std == pytest.approx(statistics.stdev([1, 2, 3, 4]))


def test_percentiles_match_the_inclusive_method_of_the_standard_library() -> None:
    values = [0.3, 7.0, 1.5, 2.25, 9.0, 4.0, 4.0, 11.5, 0.0, 6.0, 3.0]
    quartiles = statistics.quantiles(values, n=4, method="inclusive")  # type 7, like ours
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    s = summarize(values)
    assert s.median == pytest.approx(quartiles[1])
    assert s.iqr == pytest.approx(quartiles[2] - quartiles[0])
    assert s.p10 == pytest.approx(deciles[0])
    assert s.p90 == pytest.approx(deciles[-1])


def test_single_value() -> None:
    s = summarize([0.25])
    assert (s.count, s.median, s.p10, s.p90, s.min, s.max, s.iqr) == (1, 0.25, 0.25, 0.25, 0.25, 0.25, 0.0)
    assert math.isnan(s.std)  # no spread can be estimated from one value


def test_empty_gives_count_zero_and_nans() -> None:
    s = summarize([])
    assert s.count == 0
    for name in ("total", "mean", "median", "p10", "p90", "min", "max", "std", "iqr"):
        assert math.isnan(getattr(s, name)), name


def test_nan_is_refused() -> None:
    with pytest.raises(ValueError, match="1 NaN value"):
        summarize([1.0, math.nan, 2.0])


def test_accepts_any_number_sequence() -> None:
    assert summarize((1, 2, 3)).median == 2.0
    assert summarize(range(5)).p90 == pytest.approx(3.6)


def test_dict_round_trip_through_json_with_nan_as_null() -> None:
    s = summarize([1.0])
    data = json.loads(
        json.dumps({k: None if isinstance(v, float) and math.isnan(v) else v for k, v in s.to_dict().items()})
    )
    assert data["std"] is None
    back = Stats.from_dict(data)
    assert back.count == 1 and back.median == 1.0 and math.isnan(back.std)
    assert Stats.from_dict(summarize([1.0, 5.0]).to_dict()) == summarize([1.0, 5.0])


def test_stats_is_frozen() -> None:
    s = summarize([1.0])
    with pytest.raises(AttributeError):
        s.median = 2.0  # type: ignore[misc]


@pytest.mark.parametrize("q", [-1.0, 100.5])
def test_percentile_range_is_checked(q: float) -> None:
    with pytest.raises(ValueError, match=f"q={q!r}"):
        percentile([1.0], q)


def test_percentile_ends() -> None:
    data = [1.0, 2.0, 10.0]
    assert percentile(data, 0) == 1.0
    assert percentile(data, 100) == 10.0
    assert percentile(data, 75) == 6.0
    assert math.isnan(percentile([], 50))


@pytest.mark.parametrize("values", [[3.0], [2.0, 1.0], [5.0, 1.0, 4.0], [1.0, 9.0, 2.0, 7.0], [0.5] * 6])
def test_median_is_the_standard_librarys(values: list[float]) -> None:
    assert median(values) == statistics.median(values)


def test_median_of_nothing_is_nan() -> None:
    assert math.isnan(median([]))
