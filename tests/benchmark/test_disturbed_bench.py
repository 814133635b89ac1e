"""A real, short bench while other processes burn CPU says it was disturbed, and by what.

Not a timing assertion: the busy processes keep more cores busy than the bench leaves free, so the CPU time they take
(measured by the system's counters, not by how slow the steps were) is above the threshold on any machine. Two more
run at the lowest priority: they take what the bench leaves idle without slowing it down. The bench is the
one tests/benchmark/test_utilization.py reads too (the ``busy_tiny_bench`` fixture of tests/benchmark/conftest.py).
"""

from __future__ import annotations

import pytest

from lightning_perf.benchmark.report import console_rows, reliability_lines
from tests.benchmark.conftest import BusyBench


@pytest.mark.slow
def test_a_bench_beside_busy_processes_is_not_reliable(busy_tiny_bench: BusyBench) -> None:
    report, free = busy_tiny_bench.report, busy_tiny_bench.free_cores
    assert all(s.error is None for s in report.summaries)
    reliability = report.to_dict()["reliability"]
    assert reliability["reliable"] is False
    load = [cause for cause in reliability["causes"] if cause.startswith("other processes' load")]
    assert load, reliability["causes"]
    assert reliability["other_cores_max"] > free + 0.25
    assert any(line.startswith("warning: measurement disturbed by other processes' load") for line in
               reliability_lines(report))  # fmt: skip
    row = next(row for row in console_rows(report) if row[0] == "channels_last")
    assert row[2].startswith("?") and "(disturbed)" in row[3]
