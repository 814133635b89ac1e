"""No test of the bench measures the machine's real peak FLOP/s: the CPU peak cache lives in the test's tmp_path and
the matmul measurement returns a fixed figure (its own tests are in tests/profiling/test_flops.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_perf.profiling import flops

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
