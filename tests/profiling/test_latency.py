"""The one latency timer: ABBA blocks, counts, statistics from profiling.stats, the row and its side-named fields."""

from __future__ import annotations

import math

import pytest

from lightning_perf.profiling import latency
from lightning_perf.profiling.intervals import METHOD_BOOTSTRAP, NO_CLEAR_DIFFERENCE
from lightning_perf.profiling.latency import (
    METHOD_NO_TIME,
    LatencyRow,
    measure_latency,
    paired_blocks,
    speedup_estimate,
)


class _Clock:
    """A mocked ``perf_counter_ns``: each side's calls advance it by the next duration of that side's list."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.t = 0
        monkeypatch.setattr(latency.time, "perf_counter_ns", lambda: self.t)

    def side(self, durations_ms: list[float]):
        queue = list(durations_ms)

        def call() -> None:
            self.t += int(queue.pop(0) * 1e6)

        return call


def test_latency_blocks_are_timed_apart_and_counted() -> None:
    calls: list[str] = []
    eager, export = paired_blocks(
        lambda: calls.append("e"), lambda: calls.append("x"), iterations=4, warmup=1, device="cpu"
    )
    assert [len(b) for b in eager] == [len(b) for b in export] == [2, 2]
    assert "".join(calls) == "eee" + "xxx" + "xxx" + "eee"  # ABBA blocks, each with one warm-up call first
    assert all(math.isfinite(t) and t >= 0 for block in eager + export for t in block)


def test_row_statistics_come_from_the_stats_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mocked clock: every timed call of the baseline takes 4 ms and of the candidate 1 ms, exactly."""
    clock = {"t": 0}

    def side(duration_ns: int):
        def call() -> None:
            clock["t"] += duration_ns

        return call

    monkeypatch.setattr(latency.time, "perf_counter_ns", lambda: clock["t"])
    row = measure_latency(
        side(4_000_000), side(1_000_000), batch_size=8, iterations=6, warmup=0, names=("eager", "export")
    )
    assert row.iterations == 6
    assert row.baseline_median_s == pytest.approx(4e-3) and row.candidate_median_s == pytest.approx(1e-3)
    assert row.speedup == pytest.approx(4.0)
    assert row.candidate_throughput == pytest.approx(8 / 1e-3)
    # Read under the sides' own names, and written with both spellings.
    assert row.eager_median_s == row.baseline_median_s and row.export_p90_s == row.candidate_p90_s
    data = row.to_dict()
    assert data["eager_median_s"] == data["baseline_median_s"] and data["export_throughput"] == pytest.approx(8000)
    with pytest.raises(AttributeError, match="no attribute 'gpu_median_s'"):
        _ = row.gpu_median_s


def test_compile_time_alias_and_zero_median() -> None:
    row = LatencyRow.from_blocks(2, [[1.0, 1.0]], [[0.0, 0.0]], names=("float", "quantized"), warmup_s=(3.0, 5.0))
    assert row.speedup == math.inf and row.candidate_throughput == math.inf
    assert row.float_compile_s == 3.0 and row.quantized_compile_s == 5.0
    assert row.to_dict()["quantized_compile_s"] == 5.0
    # A call timed at zero leaves no interval: said so, never a verdict.
    assert row.speedup_ci95 is None and row.speedup_method == METHOD_NO_TIME
    assert row.speedup_verdict == NO_CLEAR_DIFFERENCE and row.format_speedup() == "infx, no clear difference"


def test_blocks_are_kept_per_side_in_abba_order(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock(monkeypatch)
    base, cand = paired_blocks(
        clock.side([1, 2, 3, 4]), clock.side([10, 20, 30, 40]), iterations=4, warmup=0, device="cpu"
    )
    # Blocks A1 B1 B2 A2: A1 pairs with B1 and A2 with B2.
    assert base == [pytest.approx([1e-3, 2e-3]), pytest.approx([3e-3, 4e-3])]
    assert cand == [pytest.approx([10e-3, 20e-3]), pytest.approx([30e-3, 40e-3])]


@pytest.mark.parametrize(
    ("baseline_ms", "candidate_ms", "verdict"),
    [
        # The candidate takes a quarter of the time in every pair: faster, and the interval says so.
        ([4.0, 4.1, 3.9, 4.0, 4.2, 3.8], [1.0, 1.05, 0.95, 1.0, 1.1, 0.9], "faster"),
        ([1.0, 1.05, 0.95, 1.0, 1.1, 0.9], [3.0, 3.1, 2.9, 3.0, 3.3, 2.7], "slower"),
        # Both take the same time up to noise that goes either way: no clear difference.
        ([1.0, 1.3, 0.8, 1.0, 1.2, 0.9], [1.1, 0.8, 1.2, 1.0, 0.9, 1.3], NO_CLEAR_DIFFERENCE),
    ],
)
def test_speedup_has_a_95_interval_and_a_verdict(
    monkeypatch: pytest.MonkeyPatch, baseline_ms: list[float], candidate_ms: list[float], verdict: str
) -> None:
    clock = _Clock(monkeypatch)
    row = measure_latency(
        clock.side(baseline_ms), clock.side(candidate_ms), batch_size=4, iterations=6, names=("float", "quantized")
    )
    low, high = row.speedup_ci95
    assert low <= row.speedup <= high
    assert row.speedup_verdict == verdict and row.speedup_method == METHOD_BOOTSTRAP and row.speedup_n == 1
    if verdict == "faster":
        assert low > 1 and row.speedup == pytest.approx(4.0, rel=0.05)
    elif verdict == "slower":
        assert high < 1
    else:
        assert low <= 1 <= high
    assert row.format_speedup() == f"{row.speedup:.2f}x [{low:.2f}-{high:.2f}], {verdict}"
    # The JSON row: the interval and verdict beside the ratio, every time in seconds under a key ending in `_s`.
    data = row.to_dict()
    assert data["speedup_ci95"] == [low, high] and data["speedup_verdict"] == verdict
    assert data["baseline_blocks_s"] == row.baseline_blocks_s and len(data["candidate_blocks_s"]) == 2
    assert data["float_median_s"] == row.baseline_median_s and data["quantized_p90_s"] == row.candidate_p90_s
    not_times = {k for k in data if not k.endswith("_s")}
    speedup = {"speedup", "speedup_ci95", "speedup_verdict", "speedup_method", "speedup_n"}
    throughputs = {f"{side}_throughput" for side in ("baseline", "candidate", "float", "quantized")}
    assert not_times == {"batch_size", "baseline", "candidate", "iterations", *speedup, *throughputs}


def test_a_call_below_the_clock_resolution_gives_no_interval() -> None:
    estimate = speedup_estimate([[1e-3, 0.0], [1e-3, 1e-3]], [[5e-4, 5e-4], [5e-4, 5e-4]])
    assert estimate.ratio == pytest.approx(2.0) and estimate.low == estimate.high == estimate.ratio
    assert estimate.verdict == NO_CLEAR_DIFFERENCE and "no interval" in estimate.method
    row = LatencyRow.from_blocks(1, [[1e-3, 0.0], [1e-3, 1e-3]], [[5e-4, 5e-4], [5e-4, 5e-4]])
    assert row.speedup_ci95 is None and row.format_speedup() == "2.00x, no clear difference"


@pytest.mark.parametrize(("kwargs", "message"), [({"iterations": 0}, "iterations=0"), ({"warmup": -1}, "warmup=-1")])
def test_bad_counts_are_named(kwargs: dict, message: str) -> None:
    options = {"iterations": 2, "warmup": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        paired_blocks(lambda: None, lambda: None, **options)
