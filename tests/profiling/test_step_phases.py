"""A hand-written loop times its phases with StepPhases and summarize_steps: no Trainer, a scripted clock."""

from __future__ import annotations

import pytest
import torch

from lightning_perf.profiling import PhaseTimer
from lightning_perf.profiling.step_phases import StepPhases, binned, live_figures, summarize_steps


class Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns

    def wait(self, ms: float) -> None:
        self.ns += int(ms * 1e6)


def test_a_hand_written_loop_gets_phases_shares_and_interrupted_steps() -> None:
    clock = Clock()
    phases = StepPhases(PhaseTimer(torch.device("cpu"), warmup_steps=1, clock=clock), clock=clock)
    phases.open_gap()
    for step in range(5):
        clock.wait(1)  # the wait for the batch: "data"
        phases.begin_step("forward")
        clock.wait(2)
        phases.switch("backward")
        clock.wait(4)
        phases.switch(None)
        clock.wait(1)  # no phase: "other"
        entry = phases.end_step(8, clock())
        phases.open_gap()
        phases.charge(entry)
        if step == 2:  # validation after the third step: the fourth one's wait is cut, and it is left out
            phases.interrupt()
            clock.wait(50)
            phases.open_gap()
    report = summarize_steps(phases)
    assert report["steps"] == {"total": 5, "warmup": 1, "steady": 4, "interrupted": 1}
    steady = report["steady_state"]
    assert steady["step"]["median"] == pytest.approx(8e-3)
    assert steady["shares"]["backward"] == pytest.approx(0.5) and steady["shares"]["other"] == pytest.approx(0.125)
    assert report["throughput"]["samples_per_s"] == pytest.approx(1000.0)
    assert report["per_step"]["interrupted"] == [False, False, True, False]
    assert report["overhead"]["hooks_ns_total"] == 0  # the scripted clock never moves inside the bookkeeping


def test_long_runs_are_binned_to_at_most_the_bars_asked_for() -> None:
    records = [{"data": float(i), "transfer": 0.0, "forward": 1.0, "backward": 1.0, "optimizer": 0.0, "other": 0.0}
               for i in range(10)]  # fmt: skip
    bars = binned(records, bars=4)
    assert len(bars) == 4 and bars[0]["data"] == pytest.approx(0.5) and bars[-1]["data"] == pytest.approx(8.0)


def test_validation_is_timed_apart_and_live_figures_feed_a_progress_bar() -> None:
    clock = Clock()
    timer = PhaseTimer(torch.device("cpu"), clock=clock)
    phases = StepPhases(timer, clock=clock, validation=PhaseTimer(torch.device("cpu"), clock=clock))
    phases.begin_epoch()
    for _ in range(2):
        clock.wait(1)
        phases.begin_step("forward")
        clock.wait(3)
        phases.end_step(4, clock())
        phases.open_gap()
        phases.pause()  # validation: the open wait for data is cut, the next step marked interrupted
        clock.wait(20)
        phases.resume()
    assert phases.validation.summary()["validation"].total == pytest.approx(40e-3)
    metrics, bar = live_figures(phases, window=2)
    assert metrics["forward"] == pytest.approx(0.75) and metrics["step_s"] == pytest.approx(4e-3)
    assert bar == {"data%": 25.0, "fwd%": 75.0, "bwd%": 0.0, "opt%": 0.0, "samples/s": 1000.0}
