"""A hand-written loop samples memory and gets the leak verdict with MemorySteps: no Trainer, a scripted probe."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from lightning_perf.profiling import MemorySample
from lightning_perf.profiling.memory_steps import (
    LEAK_CHECK_EVERY_N_STEPS,
    LEAK_READ_EVERY_N_STEPS_CPU,
    MemorySteps,
    leak_message,
    summary_lines,
)


class ScriptedProbe:
    """Memory in use grows by ``leak`` bytes at each step's end; every reading is a tick of its clock; calls counted."""

    device, source = torch.device("cpu"), "cpu-mallinfo2"

    def __init__(self, leak: int, peak_factor: int = 3) -> None:
        self.leak, self.bytes, self.ns, self.peak_factor = leak, 1 << 20, 0, peak_factor
        self.calls: Counter[str] = Counter()

    def allocated(self) -> int:
        self.calls["allocated"] += 1
        return self.bytes

    def sample(self) -> MemorySample:
        self.calls["sample"] += 1
        self.ns += 1000
        return MemorySample(
            "cpu", self.bytes, 2 * self.bytes, self.peak_factor * self.bytes, self.ns, self.source, True
        )

    def reset_peak(self, level: MemorySample | None = None) -> bool:
        # The real probe skips the write where the level is the peak already; the scripted one counts what it is asked.
        self.calls["reset_peak" if level is None or level.peak > level.reserved else "reset_skipped"] += 1
        return True


def run(leak: int, steps: int) -> tuple[MemorySteps, list[int], list[str]]:
    probe = ScriptedProbe(leak)
    memory = MemorySteps(probe, every_n_steps=10, warmup_steps=20)  # type: ignore[arg-type]
    checked, messages = [], []
    for step in range(steps):
        memory.begin_step(epoch=0)
        memory.sample("after_forward")
        memory.sample("after_backward", overwrite=True)
        probe.bytes += leak
        memory.end_step(epoch=0, end_ns=(step + 1) * 1_000_000)
        if memory.leak_check_due():
            checked.append(memory.step_index)
            found = memory.check_leaks(every_point=False)
            messages += [leak_message("loop", found)] if found else []
    memory.check_leaks()
    return memory, checked, messages


def test_a_steady_leak_is_reported_once_and_the_every_step_readings_stop() -> None:
    memory, checked, messages = run(leak=4096, steps=120)
    assert checked == [50] and len(messages) == 1 and "grows by 4 KiB/step" in messages[0]
    report = memory.summary()
    assert (report["steps_seen"], report["steps_sampled"]) == (120, 12)
    assert report["leaks"]["leaking"] == ["after_data", "after_forward", "after_backward", "after_optimizer"]
    assert (report["leaks"]["first_step"], report["leaks"]["stopped_at_step"]) == (20, 50)
    assert report["snapshots"]["after_optimizer"]["time_s"]["median"] == 3e-6  # three readings after "after_data"
    assert "leak: memory in use grows at" in summary_lines(report)[1]


def test_flat_memory_is_not_a_leak_and_the_verdict_is_renewed_on_a_schedule() -> None:
    memory, checked, messages = run(leak=0, steps=300)
    # Then every quarter of the steps so far, at least 50, on CPU at the next step the series reads (one in 128):
    # due after 100 steps, renewed at the end of step 128; due after 179, renewed after step 256.
    assert checked == [50, 129, 257] and messages == []
    report = memory.summary()
    assert report["leaks"]["leaking"] == [] and report["leaks"]["stopped_at_step"] is None
    assert report["peak_above_start"]["median"] == 1 << 20  # CPU: the peak (3 MiB) above the resident set (2 MiB)
    assert report["overhead"]["step_s_mean"] == 1e-3


def test_between_readings_a_step_reads_nothing_and_its_hooks_may_stay_silent() -> None:
    """After the first verdict, on CPU: a full snapshot one step in ``every_n_steps``, the leak series' last point one
    step in LEAK_READ_EVERY_N_STEPS_CPU, and no probe call at all in the other steps, which say so (``reading``)."""
    probe = ScriptedProbe(leak=0)
    memory = MemorySteps(probe, every_n_steps=50, warmup_steps=20)  # type: ignore[arg-type]
    per_step: list[Counter[str]] = []
    reading: list[bool] = []
    for _ in range(400):
        before = Counter(probe.calls)
        memory.plan_step()
        reading.append(memory.reading)
        memory.begin_step(epoch=0)
        if memory.reading:  # the callback silences the other hooks of a step that reads nothing
            memory.sample("after_forward")
            memory.sample("after_forward")  # Lightning's second hook of the same point: kept once, read once
            memory.sample("after_backward", overwrite=True)
            memory.end_step(epoch=0, end_ns=memory.step_index * 1_000_000)
            if memory.leak_check_due():
                memory.check_leaks(every_point=False)
        per_step.append(probe.calls - before)
    steady = range(LEAK_CHECK_EVERY_N_STEPS, 400)
    checks = {128, 256, 384}  # renewals (due after 100, 179, 321 steps) wait for the series' next reading step
    for step in steady:
        calls, snapshot, grid = per_step[step], step % 50 == 0, step % LEAK_READ_EVERY_N_STEPS_CPU == 0
        assert reading[step] == (snapshot or grid or step in checks), step
        if snapshot:  # a sample per point; the peak (3x the bytes) is above the level (2x): it is reset
            assert calls == Counter(sample=4, reset_peak=1), step
        elif grid:
            assert calls == Counter(allocated=1), step  # the last point only
        else:
            assert not calls, step
    assert all(per_step[step] == Counter(sample=4, reset_peak=1) for step in (0,))
    assert sum(per_step[s]["allocated"] for s in range(1, LEAK_CHECK_EVERY_N_STEPS)) == 4 * 49  # dense at first


def test_the_peak_is_not_reset_where_it_is_the_level_already() -> None:
    probe = ScriptedProbe(leak=0, peak_factor=2)  # peak == reserved: the resident set is at its high-water mark
    memory = MemorySteps(probe, every_n_steps=10, warmup_steps=0)  # type: ignore[arg-type]
    for _ in range(30):
        memory.begin_step(epoch=0)
        memory.end_step(epoch=0, end_ns=memory.step_index)
    assert probe.calls["reset_skipped"] == 3 and probe.calls["reset_peak"] == 0


def test_the_self_report_is_the_time_of_the_hooks_steady_steps_timed_whole_where_they_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scripted clock: each clock read ticks 10 ns, each probe call costs 100,000 ns. The reading steps are timed
    whole, so the report holds every probe call's time exactly; the others are one step in 17, two ticks a call."""
    clock = {"ns": 0}

    def tick() -> int:
        clock["ns"] += 10
        return clock["ns"]

    monkeypatch.setattr("lightning_perf.profiling.timer.time.perf_counter_ns", tick)
    probe = ScriptedProbe(leak=0, peak_factor=2)
    for name in ("allocated", "sample"):
        real = getattr(probe, name)

        def dear(_real: Any = real) -> Any:
            clock["ns"] += 100_000
            return _real()

        setattr(probe, name, dear)
    memory = MemorySteps(probe, every_n_steps=50, warmup_steps=0)  # type: ignore[arg-type]
    memory.cost.dispatch_ns = 0.0
    steps = 850
    for _ in range(steps):
        memory.plan_step()
        entry = memory.cost.begin()
        memory.begin_step(epoch=0)
        memory.cost.end(entry)
        if memory.reading:
            entry = memory.cost.begin()
            memory.end_step(epoch=0, end_ns=memory.step_index * 2_000_000)  # 2 ms steps
            memory.cost.end(entry)
    steady = range(LEAK_CHECK_EVERY_N_STEPS, steps)
    snapshots = sum(1 for s in steady if s % 50 == 0)
    grid = sum(1 for s in steady if s % 50 and s % LEAK_READ_EVERY_N_STEPS_CPU == 0)
    figures = memory.summary()["overhead"]
    probe_ns = (snapshots * 2 + grid) * 100_000  # a snapshot here: after_data and after_optimizer; the grid: one
    assert figures["heavy_ns_total"] >= probe_ns  # every reading's time is in the report
    assert figures["heavy_ns_total"] <= probe_ns + 100 * figures["heavy_calls"]  # plus a few ticks a call
    assert figures["steady_steps"] == steps - LEAK_CHECK_EVERY_N_STEPS
    assert figures["share_of_step"] == pytest.approx(figures["hooks_ns_per_step"] / 2e6)


@pytest.mark.parametrize("leak", [0, 64 << 10])
def test_a_loop_that_skips_the_quiet_steps_reads_and_concludes_as_one_that_runs_them(leak: int) -> None:
    """:meth:`MemorySteps.quiet_ahead` says how many steps read nothing; a loop that runs them without any call and
    says so with :meth:`MemorySteps.skip` (the callback's countdown) reads the same points of the same steps, and
    reaches the same verdict, as a loop that calls every step; the quiet steps are counted (quiet calls)."""

    def loop(skip_ahead: bool, steps: int = 1500) -> tuple[MemorySteps, ScriptedProbe, list[int]]:
        probe = ScriptedProbe(leak)
        memory = MemorySteps(probe, every_n_steps=100, warmup_steps=20)  # type: ignore[arg-type]
        found, step = [], 0
        while step < steps:
            if skip_ahead and (quiet := min(memory.quiet_ahead(), steps - step)):
                probe.bytes += leak * quiet
                memory.skip(quiet)
                step += quiet
                continue
            memory.plan_step()
            memory.begin_step(epoch=0)
            if memory.reading:
                memory.sample("after_forward")
                memory.sample("after_backward", overwrite=True)
            probe.bytes += leak
            if memory.reading:
                memory.end_step(epoch=0, end_ns=memory.step_index * 1_000_000)
                if memory.leak_check_due() and memory.check_leaks(every_point=False):
                    found.append(memory.step_index)
            step += 1
        return memory, probe, found

    (every, every_probe, every_found), (skipping, skipping_probe, skipping_found) = loop(False), loop(True)
    assert skipping_probe.calls == every_probe.calls and skipping_found == every_found
    assert bool(every_found) == bool(leak)
    assert skipping.step_index == every.step_index == 1500 and skipping.steps == every.steps
    assert skipping.series.series(0) == every.series.series(0)
    overhead = skipping.summary()["overhead"]
    assert overhead["quiet_calls"] > 1000 and overhead["heavy_calls"] + overhead["quiet_calls"] <= 1500
