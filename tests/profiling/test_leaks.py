"""Robust memory-growth trends (Theil-Sen) and leak flags."""

from __future__ import annotations

import math

import pytest

from lightning_perf.profiling.leaks import detect_leaks, theil_sen_slope


def test_slope_of_a_line_is_exact() -> None:
    assert theil_sen_slope([0, 1, 2, 3], [5, 8, 11, 14]) == 3.0


def test_a_minority_of_wild_samples_does_not_move_the_slope() -> None:
    xs = list(range(20))
    ys = [1000 + 10 * x for x in xs]
    for i in (3, 9, 15):
        ys[i] += 10**9  # garbage-collection pauses, one-off buffers
    assert theil_sen_slope(xs, ys) == pytest.approx(10.0)


def test_flat_noise_has_a_slope_near_zero() -> None:
    ys = [100, 104, 98, 101, 99, 103, 97, 102, 100, 101] * 3
    assert abs(theil_sen_slope(range(len(ys)), ys)) < 0.5


def test_long_series_are_thinned_but_keep_their_trend() -> None:
    xs = list(range(5000))
    assert theil_sen_slope(xs, [7 * x + (x % 3) for x in xs], max_points=64) == pytest.approx(7.0, rel=1e-3)


def test_degenerate_and_bad_inputs() -> None:
    assert math.isnan(theil_sen_slope([1], [1]))
    assert math.isnan(theil_sen_slope([2, 2], [1, 5]))  # no two distinct positions
    with pytest.raises(ValueError, match="one y per x"):
        theil_sen_slope([1, 2], [1])
    with pytest.raises(ValueError, match="max_points=1"):
        theil_sen_slope([1, 2], [1, 2], max_points=1)


def test_detect_leaks_flags_only_points_above_the_threshold_with_enough_samples() -> None:
    steps = list(range(5, 25))
    trends = detect_leaks(
        {
            "after_forward": (steps, [10_000 + 2048 * s for s in steps]),
            "after_optimizer": (steps, [10_000 + (s % 2) * 64 for s in steps]),
            "after_backward": (steps[:4], [10_000 + 10**6 * s for s in steps[:4]]),  # steep but too few samples
        },
        threshold=1024,
        min_samples=10,
    )
    assert [p for p, t in trends.items() if t.leaking] == ["after_forward"]
    leak = trends["after_forward"]
    assert (leak.slope, leak.samples, leak.first_step, leak.last_step) == (2048, 20, 5, 24)
    assert leak.growth == 2048 * 19
    assert leak.to_dict()["growth"] == leak.growth
    empty = detect_leaks({"after_data": ([], [])}, threshold=1)["after_data"]
    assert empty.samples == 0 and math.isnan(empty.slope) and not empty.leaking


@pytest.mark.parametrize("threshold", [0, -5, float("inf"), float("nan"), True])
def test_detect_leaks_needs_a_positive_threshold(threshold: float) -> None:
    with pytest.raises(ValueError, match="threshold="):
        detect_leaks({}, threshold=threshold)


def test_detect_leaks_needs_two_samples_at_least() -> None:
    with pytest.raises(ValueError, match="min_samples=1"):
        detect_leaks({}, threshold=1.0, min_samples=1)
