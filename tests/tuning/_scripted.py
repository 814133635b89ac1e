"""Scripted trials for the tuner's tests: results with known step times, and a trial runner that returns them."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_perf.benchmark.worker import RunResult
from lightning_perf.tuning.conditions import TrialWatch
from lightning_perf.tuning.tuner import AutoTuner, Candidate

__all__ = ["quiet_machine", "script_trials", "scripted_result"]


def scripted_result(
    step_s: float,
    batch: int,
    *,
    wall: float = 2.0,
    spread: float = 0.01,
    losses: list[float] | None = None,
    data_wait: float = 0.0,
    ok: bool = True,
    error: str | None = None,
) -> RunResult:
    times = [step_s * (1 + spread * ((i % 5) - 2) / 2) for i in range(10)]
    return RunResult(
        spec={},
        ok=ok,
        error=error,
        traceback=None if ok else f"Traceback (most recent call last):\n  ...\n{error}",
        batch_size=batch,
        step_times_s=times if ok else [],
        throughput=batch / sorted(times)[5] if ok else None,
        warmup_s=1.0,
        peak_memory_bytes=100 << 20,
        step_memory_bytes=10 << 20,
        losses=losses if losses is not None else [2.0 - 0.05 * i for i in range(13)],
        data_wait_s=[step_s * data_wait] * 10,
        wall_s=wall,
    )


def script_trials(monkeypatch: pytest.MonkeyPatch, script: dict[str, Any]) -> list[str]:
    """Replace the trial runner: ``script`` maps a trial label to a result (or to a callable of the candidate)."""
    ran: list[str] = []

    def measure(self: AutoTuner, candidate: Candidate, timeout: float) -> Any:
        ran.append(candidate.label)
        label = candidate.label
        if label not in script:  # a repeat of the baseline, or a confirming re-run: as scripted for the original
            label = "baseline" if label == "baseline (repeat)" else label.removesuffix(" (again)")
        value = script[label]
        result = value(candidate) if callable(value) else value
        self._count += 1
        if result is not None and result.wall_s:
            self._deadline -= result.wall_s  # the trial's time passes
        return result

    monkeypatch.setattr(AutoTuner, "_measure", measure)
    quiet_machine(monkeypatch)  # unless a test scripts a disturbance: the decisions are tested, not this machine
    # Nor this machine's cores and load (nor its GPU, which a test may fake with torch.cuda.is_available alone).
    monkeypatch.setattr("lightning_perf.tuning.tuner.describe_machine", lambda: {"cpu_count": 2, "cpu_count_usable": 2})
    monkeypatch.setattr("lightning_perf.benchmark.threads.load_average", lambda: 0.0)
    # Nor what other processes keep busy now (no one-second sample: the load average above decides).
    monkeypatch.setattr("lightning_perf.benchmark.threads.sample_other_cores", lambda monitor, window_s=1.0: None)
    return ran


def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The condition watcher finds every trial undisturbed."""
    monkeypatch.setattr(TrialWatch, "causes", lambda self, token, label, steps: [])
