"""Leak verdicts by significance: Theil-Sen slope, Sen's interval, steadiness and noise floor, on synthetic series.

The series imitate what the memory probe reads on a glibc heap during clean training (measured, see
``lightning_perf/profiling/leaks.py``): jitter of about 64 bytes in 16-byte units, the allocator's churn as occasional
jumps of about 700 bytes that never come back, and rare large one-step spikes. Every test is seeded: a verdict is
the same on every machine.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from lightning_perf.profiling.leaks import (
    MIN_LEAK_SAMPLES,
    NOISE_FLOOR_STEPS,
    LeakSeries,
    detect_leaks,
    noise_floor,
    rises_steadily,
    sen_slope_interval,
    theil_sen_slope,
)

KIB = 1024
SEEDS = range(100)


def allocator_noise(rng: np.random.Generator, n: int, churn: bool = True) -> np.ndarray:
    """Memory in use of a clean run at one point of the step, ``n`` steps (bytes)."""
    y = 50_000_000 + np.round(rng.normal(0.0, 64.0, n) / 16) * 16
    if churn:
        y += np.cumsum(rng.random(n) < 0.07) * 704  # caches and free lists: +700 B now and then, for good
    y += (rng.random(n) < 0.02) * 50_000  # a transient buffer alive at the moment of reading
    return y


def verdict(values: np.ndarray, first_step: int = 0, **kwargs: object):
    steps = list(range(first_step, first_step + len(values)))
    return detect_leaks({"after_optimizer": (steps, values.tolist())}, **kwargs)["after_optimizer"]


# ------------------------------------------------------------------------------------------------------- slope


def test_slope_of_a_line_is_exact_wild_samples_do_not_move_it_and_flat_noise_has_none() -> None:
    assert theil_sen_slope([0, 1, 2, 3], [5, 8, 11, 14]) == 3.0
    xs = list(range(20))
    ys = [1000 + 10 * x for x in xs]
    for i in (3, 9, 15):
        ys[i] += 10**9  # a minority of garbage-collection pauses, one-off buffers
    assert theil_sen_slope(xs, ys) == pytest.approx(10.0)
    ys = [100, 104, 98, 101, 99, 103, 97, 102, 100, 101] * 3
    assert abs(theil_sen_slope(range(len(ys)), ys)) < 0.5


def test_long_series_are_thinned_but_keep_their_trend() -> None:
    xs = list(range(5000))
    assert theil_sen_slope(xs, [7 * x + (x % 3) for x in xs], max_points=64) == pytest.approx(7.0, rel=1e-3)
    assert sen_slope_interval(xs, [7 * x + (x % 3) for x in xs], max_points=64).slope == pytest.approx(7.0, rel=1e-3)


def test_degenerate_and_bad_inputs() -> None:
    assert math.isnan(theil_sen_slope([1], [1]))
    assert math.isnan(theil_sen_slope([2, 2], [1, 5]))  # no two distinct positions
    with pytest.raises(ValueError, match="one y per x"):
        theil_sen_slope([1, 2], [1])
    with pytest.raises(ValueError, match="max_points=1"):
        theil_sen_slope([1, 2], [1, 2], max_points=1)
    with pytest.raises(ValueError, match="one y per x"):
        sen_slope_interval([1, 2], [1])
    empty = sen_slope_interval([], [])
    assert math.isnan(empty.slope) and (empty.low, empty.high) == (-math.inf, math.inf) and not empty.grows


# ---------------------------------------------------------------------------------------------- Sen's interval


def test_sen_interval_of_a_line_is_the_line_and_needs_six_samples_to_exclude_zero() -> None:
    r = sen_slope_interval(range(10), [3 * x for x in range(10)])
    assert (r.slope, r.low, r.high, r.samples) == (3.0, 3.0, 3.0, 10)
    assert r.grows
    # With five points even a perfect line leaves zero inside: Kendall's S cannot be significant at 95%.
    assert sen_slope_interval(range(5), range(5)).low == -math.inf
    assert sen_slope_interval(range(6), range(6)).low == 1.0


def test_sen_interval_covers_the_true_slope_about_95_percent_of_the_time() -> None:
    covered = 0
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        y = 5.0 * np.arange(60) + rng.normal(0.0, 40.0, 60)
        r = sen_slope_interval(range(60), y)
        assert r.low <= r.slope <= r.high
        covered += r.low <= 5.0 <= r.high
    assert 88 <= covered <= 100


def test_ties_narrow_nothing_they_should_not() -> None:
    # Readings that repeat exactly (a calm allocator) keep the tie-corrected variance positive and the bounds finite.
    y = [1000] * 20 + [1016] * 20 + [1000] * 20
    r = sen_slope_interval(range(60), y)
    assert r.low <= 0 <= r.high


# ---------------------------------------------------------------------------------------------- noise floor


def test_noise_floor_is_the_scatter_around_the_line() -> None:
    rng = np.random.default_rng(0)
    y = 100.0 * np.arange(640) + rng.normal(0.0, 50.0, 640)
    assert noise_floor(range(640), y, 100.0) == pytest.approx(50.0, rel=0.15)
    assert noise_floor(range(10), 7.0 * np.arange(10), 7.0) == 0.0
    assert math.isnan(noise_floor([], [], 1.0)) and math.isnan(noise_floor([1], [1], math.nan))


def test_noise_floor_does_not_grow_with_the_run_when_the_allocator_drifts() -> None:
    rng = np.random.default_rng(1)
    walk = np.cumsum(rng.normal(0.0, 64.0, 3000))
    short, long = noise_floor(range(300), walk[:300], 0.0), noise_floor(range(3000), walk, 0.0)
    assert long < 2 * short  # the whole window's scatter of a random walk grows like sqrt(n): about 3x here


# ------------------------------------------------------------------------------------------------ steadiness


def test_rises_steadily_is_a_sign_test_that_one_jump_spike_or_drop_does_not_sway() -> None:
    line = [1000 + 100 * i for i in range(20)]
    assert rises_steadily(line)
    with_drop = line[:10] + [y - 10**6 for y in line[10:]]  # the collector frees a large earlier garbage once
    with_spike = [y + (10**6 if i in (4, 13) else 0) for i, y in enumerate(line)]
    assert rises_steadily(with_drop) and rises_steadily(with_spike)
    assert not rises_steadily([1000] * 10 + [5000] * 10)  # one jump: a single nonzero difference
    assert not rises_steadily([1000, 1016] * 10)  # jitter goes up as often as down
    assert not rises_steadily([]) and not rises_steadily([7])
    assert rises_steadily(range(6)) and not rises_steadily(range(4))  # too few differences to be significant


def test_a_leak_is_still_flagged_when_the_collector_frees_a_lot_once() -> None:
    for seed in range(20):
        rng = np.random.default_rng(3000 + seed)
        y = allocator_noise(rng, 300) + KIB * np.arange(300)
        y[120:] -= 30 * KIB  # garbage of an earlier fit collected in the middle of a third
        assert verdict(y).leaking, seed


# -------------------------------------------------------------------------------------------------- verdicts


@pytest.mark.parametrize("churn", [False, True], ids=["jitter", "jitter+churn"])
def test_noise_alone_is_never_flagged(churn: bool) -> None:
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        for n in (30, 100, 300):
            trend = verdict(allocator_noise(rng, n, churn))
            assert not trend.leaking, (seed, n, trend)


def test_churn_is_significant_yet_not_a_leak() -> None:
    # The allocator's churn really drifts upwards, so its slope is significant; its size per step is what says no.
    rng = np.random.default_rng(3)
    trend = verdict(allocator_noise(rng, 3000))
    assert trend.significant and trend.segments_growing == 3
    assert trend.slope * NOISE_FLOOR_STEPS < trend.noise_floor and not trend.leaking


def test_a_kib_per_step_read_one_step_in_128_is_flagged_though_two_steps_are_below_the_floor() -> None:
    # The CPU leak series after its first verdict: 31 readings 128 steps apart; read that sparsely the readings scatter
    # by 2-3 KB around the line (the heap's jumps between them), more than two steps of a 1 KiB/step leak.
    below_two_steps = 0
    for seed in range(20):
        rng = np.random.default_rng(5000 + seed)
        steps = 128 * np.arange(1, 32)
        values = 50_000_000 + KIB * steps + np.round(rng.normal(0.0, 3000.0, steps.size))
        trend = detect_leaks({"after_optimizer": (steps.tolist(), values.tolist())})["after_optimizer"]
        assert trend.leaking, (seed, trend)
        below_two_steps += trend.slope * 2 < trend.noise_floor
    assert below_two_steps >= 10  # the regime the rule's four steps are for


@pytest.mark.parametrize(
    "series",
    [
        lambda rng: 50_000_000 + np.cumsum(np.round(rng.normal(0.0, 512.0, 300))),
        lambda rng: allocator_noise(rng, 300) + (np.arange(300) >= 140) * 300 * KIB,  # the first validation's caches
    ],
    ids=["random-walk", "one-time-jump"],
)
def test_a_random_walk_or_a_one_time_jump_is_never_flagged(series: Any) -> None:
    for seed in SEEDS:
        trend = verdict(series(np.random.default_rng(seed)))
        assert not trend.leaking, (seed, trend)


@pytest.mark.parametrize("churn", [False, True], ids=["jitter", "jitter+churn"])
def test_a_cache_that_fills_up_and_stops_is_not_a_leak(churn: bool) -> None:
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        y = allocator_noise(rng, 300, churn)
        y += np.minimum(np.arange(300), 180) * 2 * KIB  # 2 KiB per step for 180 steps, then full
        trend = verdict(y)
        assert trend.significant and not trend.leaking, (seed, trend)
        if not churn:  # the last third is flat: steadiness says no (with churn, the noise floor does as well)
            assert trend.segments_growing < 3


def test_one_kib_per_step_is_flagged_within_300_samples() -> None:
    for seed in SEEDS:
        rng = np.random.default_rng(1000 + seed)
        y = allocator_noise(rng, 300) + KIB * np.arange(300)
        trend = verdict(y)
        assert trend.leaking, (seed, trend)
        assert trend.slope_low <= trend.slope <= trend.slope_high
        assert trend.slope_low > 0.9 * KIB and trend.slope_high < 1.2 * KIB  # the churn's ~50 B/step included
        assert trend.to_dict()["slope_ci95"] == [trend.slope_low, trend.slope_high]


def test_one_kib_per_step_sampled_every_tenth_step_is_flagged_too() -> None:
    for seed in range(20):
        rng = np.random.default_rng(2000 + seed)
        y = allocator_noise(rng, 300) + KIB * np.arange(300)
        steps = list(range(0, 300, 10))
        assert detect_leaks({"p": (steps, y[::10].tolist())})["p"].leaking, seed


def test_warm_up_growth_is_left_out_and_would_otherwise_be_flagged() -> None:
    rng = np.random.default_rng(7)
    y = allocator_noise(rng, 300)
    y += np.minimum(np.arange(300), 45) * 64 * KIB  # optimizer state, allocator arenas: steady growth, then done
    assert verdict(y[50:], first_step=50).leaking is False
    assert verdict(y[:45], min_samples=30).leaking is True  # the same rule on the warm-up itself would fire


def test_fewer_samples_than_the_minimum_never_flag() -> None:
    y = 1000.0 + KIB * np.arange(40)
    assert verdict(y, min_samples=40).leaking
    short = verdict(y[:39], min_samples=40)
    assert short.significant and not short.leaking and short.segments_growing == 0


def test_the_optional_threshold_is_an_extra_bound() -> None:
    y = 1000.0 + KIB * np.arange(60)
    assert verdict(y).leaking and verdict(y).threshold is None
    assert verdict(y, threshold=512).leaking
    assert not verdict(y, threshold=4 * KIB).leaking


def test_detect_leaks_judges_each_point_alone() -> None:
    steps = list(range(5, 65))
    trends = detect_leaks(
        {
            "after_forward": (steps, [10_000 + 2048 * s for s in steps]),
            "after_optimizer": (steps, [10_000 + (s % 2) * 64 for s in steps]),
            "after_backward": (steps[:10], [10_000 + 10**6 * s for s in steps[:10]]),  # steep but too few samples
        },
    )
    assert [p for p, t in trends.items() if t.leaking] == ["after_forward"]
    leak = trends["after_forward"]
    assert (leak.slope, leak.samples, leak.first_step, leak.last_step) == (2048, 60, 5, 64)
    assert leak.growth == 2048 * 59
    assert leak.to_dict()["growth"] == leak.growth and leak.to_dict()["significant"] is True
    empty = detect_leaks({"after_data": ([], [])})["after_data"]
    assert empty.samples == 0 and math.isnan(empty.slope) and not empty.leaking


@pytest.mark.parametrize("threshold", [0, -5, float("inf"), float("nan"), True, "1k"])
def test_detect_leaks_refuses_a_bad_threshold(threshold: object) -> None:
    with pytest.raises(ValueError, match="threshold="):
        detect_leaks({}, threshold=threshold)  # type: ignore[arg-type]


@pytest.mark.parametrize("min_samples", [1, MIN_LEAK_SAMPLES - 1, 30.0, True])
def test_detect_leaks_refuses_too_few_samples(min_samples: object) -> None:
    with pytest.raises(ValueError, match=f"min_samples={min_samples!r}"):
        detect_leaks({}, min_samples=min_samples)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ LeakSeries


def test_leak_series_records_every_step_and_keeps_missing_points_out() -> None:
    series = LeakSeries(["after_forward", "after_optimizer"])
    for step in range(5):
        assert series.start_step(step, epoch=step // 3)
        if step != 2:  # a step without a forward reading (e.g. skipped by the user)
            series.record("after_forward", 100 + step)
            series.record("after_forward", 999, overwrite=False)  # the first reading of a step stays
        series.record("after_optimizer", 200 + step)
    out = series.series(first_step=1)
    assert out["after_forward"] == ([1, 3, 4], [101, 103, 104])
    assert out["after_optimizer"] == ([1, 2, 3, 4], [201, 202, 203, 204])
    assert series.first_step_of_epoch_after(0) == 3 and series.first_step_of_epoch_after(1) is None


def test_leak_series_halves_itself_when_full_and_keeps_an_even_spread() -> None:
    series = LeakSeries(["p"], capacity=40)
    recorded = []
    for step in range(200):
        if series.start_step(step, epoch=0):
            recorded.append(step)
            series.record("p", step * 10)
    steps, values = series.series()["p"]
    assert series.stride == 8 and len(steps) <= 40
    assert steps == list(range(0, 200, 8)) and values == [s * 10 for s in steps]
    assert recorded[-1] == 192


def test_leak_series_stops_and_keeps_what_it_has() -> None:
    series = LeakSeries(["p"])
    for step in range(10):
        if step == 6:
            series.stop(step)
        if series.start_step(step, epoch=0):
            series.record("p", step)
        else:
            series.record("p", -5)  # after stop() nothing is written anywhere
    assert series.series()["p"] == ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5])
    assert series.stopped_at == 6 and not series.recording


@pytest.mark.parametrize(("kwargs", "match"), [({"points": []}, "points=\\[\\]"), ({"capacity": 10}, "capacity=10")])
def test_leak_series_refuses_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LeakSeries(**{"points": ["p"], **kwargs})  # type: ignore[arg-type]


def test_could_leak_is_necessary_for_a_verdict() -> None:
    """The screen the checks while training stop at: whenever it says no, the full verdict says no too."""
    from lightning_perf.profiling.leaks import could_leak, trend_of

    rng = np.random.default_rng(0)
    steps = list(range(0, 16 * 60, 16))
    cases = [
        [int(v) for v in 1e6 + rng.normal(0, 1e4, 60)],  # noise
        [int(v) for v in 1e6 + 16 * 1024 * np.arange(60) + rng.normal(0, 1e3, 60)],  # 1 KiB a step, read every 16
        [int(v) for v in 1e6 + 1024 * np.minimum(np.arange(60), 20)],  # a cache that fills up, then stops
        [1_000_000] * 60,  # flat
    ]
    verdicts = []
    for values in cases:
        for n in (17, 30, 60):
            leaking = trend_of("p", steps[:n], values[:n], min_samples=30).leaking
            assert could_leak(values[:n], 30) or not leaking
            verdicts.append(leaking)
    assert verdicts[5] and not any(verdicts[:4] + verdicts[6:])  # the leak over 60 readings, and nothing else
