"""A real, short bench while other processes burn CPU says it was disturbed, and by what.

Not a timing assertion: the busy processes keep more cores busy than the bench leaves free, so the CPU time they take
(measured by the system's counters, not by how slow the steps were) is above the threshold on any machine. They run at
the lowest priority: they take every core the bench leaves idle (its worker's start-up is single-threaded) without
slowing the bench itself down, so the test costs about what the same bench costs on a quiet machine.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lightning_perf.benchmark.report import console_rows, reliability_lines
from lightning_perf.benchmark.runner import run_benchmark
from lightning_perf.benchmark.spec import BenchSpec

# Each loop ends itself after this many seconds even if the finally below were never reached.
BUSY_LIFETIME_S = 600
# The lowest priority (nice 19): a loop runs only on a core nothing else wants.
BUSY_LOOP = "import os, time\nos.nice(19)\n" + (
    f"end = time.monotonic() + {BUSY_LIFETIME_S}\nwhile time.monotonic() < end:\n    pass\n"
)


@pytest.mark.slow
def test_a_bench_beside_busy_processes_is_not_reliable() -> None:
    cores = os.cpu_count() or 1
    free = max(0, cores - torch.get_num_threads())
    # Enough loops to take every core the bench leaves free and then some (3 on a 2-core machine).
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(free + 3)]
    try:
        options = BenchSpec(
            workload="convnet",
            preset="tiny",
            configs=["baseline", "fused_optimizer"],
            steps=3,
            warmup_steps=1,
            repeats=1,
            predict_batches=0,
            timeout_s=300.0,
        )
        report = run_benchmark(options)
    finally:
        for process in busy:
            process.kill()
        for process in busy:
            process.wait(timeout=30)
    assert all(s.error is None for s in report.summaries)
    reliability = report.to_dict()["reliability"]
    assert reliability["reliable"] is False
    load = [cause for cause in reliability["causes"] if cause.startswith("other processes' load")]
    assert load, reliability["causes"]
    assert reliability["other_cores_max"] > free + 0.25
    assert any(line.startswith("warning: measurement disturbed by other processes' load") for line in
               reliability_lines(report))  # fmt: skip
    fused = next(row for row in console_rows(report) if row[0] == "fused_optimizer")
    assert fused[2].startswith("?") and "(disturbed)" in fused[3]
