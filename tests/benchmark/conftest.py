"""No test of the bench measures the machine's real peak FLOP/s: the CPU peak cache lives in the test's tmp_path and
the matmul measurement returns a fixed figure (its own tests are in tests/profiling/test_flops.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lightning_perf.benchmark.results import BenchReport
from lightning_perf.profiling import PeakFlops, flops

FAKE_PEAK_FLOPS = 1e11


@pytest.fixture(autouse=True)
def _no_real_peak_measurement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, int]]:
    """Returns the ``(dtype, threads)`` of every (fake) measurement, in order."""
    measured: list[tuple[torch.dtype, int]] = []

    def fake(dtype: torch.dtype = torch.float32, threads: int | None = None, *args: object, **kw: object):
        measured.append((dtype, threads or torch.get_num_threads()))
        return flops.PeakFlops(FAKE_PEAK_FLOPS, f"fake matmul {dtype} (tests)")

    monkeypatch.setenv(flops.CACHE_ENV, str(tmp_path / "lightning-perf-cache"))
    monkeypatch.setattr(flops, "measure_cpu_peak_flops", fake)
    return measured


# Each loop ends itself after this many seconds even if the fixture's clean-up were never reached.
BUSY_LIFETIME_S = 600
BUSY_LOOP = f"import time\nend = time.monotonic() + {BUSY_LIFETIME_S}\nwhile time.monotonic() < end:\n    pass\n"
# The lowest priority (nice 19): such a loop runs only on a core nothing else wants.
IDLE_LOOP = "import os\nos.nice(19)\n" + BUSY_LOOP
GIVEN_PEAK = PeakFlops(1e11, "given (test)")


@dataclass
class BusyBench:
    """One real tiny bench (baseline and channels_last, one repeat) run beside busy processes."""

    report: BenchReport
    free_cores: int  # cores the bench's threads leave free
    peaks_asked: list[tuple[str, str, bool]]  # every (device, precision, fast float32 matmul) the peak was asked for


@pytest.fixture(scope="session")
def busy_tiny_bench() -> Iterator[BusyBench]:
    """Worker processes are the dear part of a bench test (a fresh interpreter each): the disturbed-bench test and the
    utilization test read this one run (its peak is given, never measured)."""
    from lightning_perf.benchmark.runner import run_benchmark
    from lightning_perf.benchmark.spec import BenchSpec

    free = max(0, (os.cpu_count() or 1) - torch.get_num_threads())
    # Loops at the bench's own priority take every core it leaves free, and one more competes with it for its own
    # (1 on a 2-core machine where torch runs 2 threads); 2 more at the lowest priority take whatever it leaves idle
    # (its worker's start-up is single-threaded) without slowing it down. Loops that all competed as equals (3 on a
    # 2-core machine) made the bench itself several times slower.
    loops = [BUSY_LOOP] * (free + 1) + [IDLE_LOOP] * 2
    busy = [subprocess.Popen([sys.executable, "-c", loop]) for loop in loops]
    asked: list[tuple[str, str, bool]] = []

    def given_peak(device: str, precision: str, fast_fp32_matmul: bool) -> PeakFlops:
        asked.append((device, precision, fast_fp32_matmul))
        return GIVEN_PEAK

    try:
        options = BenchSpec(
            workload="convnet", preset="tiny", configs=["baseline", "channels_last"], steps=2, warmup_steps=1,
            repeats=1, predict_batches=0, timeout_s=300.0, threads=torch.get_num_threads(),
        )  # fmt: skip
        report = run_benchmark(options, peak=given_peak)
    finally:
        for process in busy:
            process.kill()
        for process in busy:
            process.wait(timeout=30)
    yield BusyBench(report, free, asked)
