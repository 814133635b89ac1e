"""The one latency timer: ABBA blocks, counts, statistics from profiling.stats, the row and its side-named fields."""

from __future__ import annotations

import math

import pytest

from lightning_perf.profiling import latency
from lightning_perf.profiling.latency import LatencyRow, measure_latency, paired_latency
from lightning_perf.profiling.stats import summarize


def test_latency_blocks_are_timed_apart_and_counted() -> None:
    calls: list[str] = []
    eager, export = paired_latency(
        lambda: calls.append("e"), lambda: calls.append("x"), iterations=4, warmup=1, device="cpu"
    )
    assert eager.count == export.count == 4
    assert "".join(calls) == "eee" + "xxx" + "xxx" + "eee"  # ABBA blocks, each with one warm-up call first
    assert math.isfinite(eager.median) and eager.p90 >= eager.median


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
    zero = summarize([0.0, 0.0])
    row = LatencyRow.from_stats(2, summarize([1.0, 1.0]), zero, names=("float", "quantized"), warmup_s=(3.0, 5.0))
    assert row.speedup == math.inf and row.candidate_throughput == math.inf
    assert row.float_compile_s == 3.0 and row.quantized_compile_s == 5.0
    assert row.to_dict()["quantized_compile_s"] == 5.0


@pytest.mark.parametrize(("kwargs", "message"), [({"iterations": 0}, "iterations=0"), ({"warmup": -1}, "warmup=-1")])
def test_bad_counts_are_named(kwargs: dict, message: str) -> None:
    options = {"iterations": 2, "warmup": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        paired_latency(lambda: None, lambda: None, **options)
