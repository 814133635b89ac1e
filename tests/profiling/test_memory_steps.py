"""A hand-written loop samples memory and gets the leak verdict with MemorySteps: no Trainer, a scripted probe."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from lightning_perf.profiling import MemorySample
from lightning_perf.profiling.memory_steps import (
    LEAK_CHECK_EVERY_N_STEPS,
    SCREEN_READ_EVERY_N_STEPS_CPU,
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

    def resident(self) -> int:  # the cheap signal: here the same bytes (a real resident set is far noisier)
        self.calls["resident"] += 1
        return 2 * self.bytes

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


def run(leak: int, steps: int, **kwargs: Any) -> tuple[MemorySteps, list[int], list[str]]:
    probe = ScriptedProbe(leak)
    memory = MemorySteps(probe, every_n_steps=10, warmup_steps=20, **kwargs)  # type: ignore[arg-type]
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


# The first screen runs once the resident set (one step in 4) holds 18 readings past warm-up (step 20 here).
SCREEN = 20 + 18 * SCREEN_READ_EVERY_N_STEPS_CPU


def test_a_steady_leak_is_screened_confirmed_over_the_next_steps_and_reported_once() -> None:
    memory, checked, messages = run(leak=4096, steps=150)
    # The screen at step 92 passes; memory in use is read at every point of the next 30 steps, then judged.
    assert checked == [SCREEN + 1 + 30] and len(messages) == 1 and "grows by 4 KiB/step" in messages[0]
    report = memory.summary()
    assert (report["steps_seen"], report["steps_sampled"]) == (150, 15)
    assert report["leaks"]["leaking"] == ["after_data", "after_forward", "after_backward", "after_optimizer"]
    assert (report["leaks"]["first_step"], report["leaks"]["stopped_at_step"]) == (20, SCREEN + 31)
    trend = report["leaks"]["trends"]["after_optimizer"]
    assert (trend.first_step, trend.last_step, trend.samples) == (SCREEN + 1, SCREEN + 30, 30)  # the confirmation
    screen = {"step": SCREEN, "rate_bytes_per_step": 8192, "confirmed": True}  # the resident set: 2x the bytes here
    assert report["leaks"]["screen"]["confirmations"] == [screen]
    assert report["snapshots"]["after_optimizer"]["time_s"]["median"] == 3e-6  # three readings after "after_data"
    assert "leak: memory in use grows at" in summary_lines(report)[1]


def test_the_optional_threshold_can_only_silence() -> None:
    memory, checked, messages = run(leak=4096, steps=150, leak_threshold=float(1 << 30))  # 1 GiB/step: none reaches it
    leaks = memory.summary()["leaks"]
    trend = leaks["trends"]["after_optimizer"]
    assert checked == [SCREEN + 31] and messages == [] and leaks["leaking"] == []
    assert trend.significant and not trend.leaking and trend.threshold == 1 << 30
    assert leaks["screen"]["confirmations"][0]["confirmed"] is False  # refused by the bound, not by the data


class FragmentingProbe(ScriptedProbe):
    """The resident set grows a page per reading (four from the 45th on), memory in use does not: what glibc's heap
    does to a clean run."""

    def resident(self) -> int:
        self.calls["resident"] += 1
        self.pages = getattr(self, "pages", 0) + (1 if self.calls["resident"] < 45 else 4)
        return self.bytes + 4096 * self.pages


def test_a_resident_set_that_grows_while_memory_in_use_is_flat_is_refused_and_screened_again_only_faster() -> None:
    probe = FragmentingProbe(leak=0)
    memory = MemorySteps(probe, every_n_steps=10, warmup_steps=20)  # type: ignore[arg-type]
    checked = []
    for _ in range(520):
        memory.begin_step(epoch=0)
        memory.sample("after_forward")
        memory.sample("after_backward", overwrite=True)
        probe.bytes += [0, 512, -512][memory.step_index % 3]  # churn, no growth
        memory.end_step(epoch=0, end_ns=memory.step_index * 1_000_000)
        if memory.leak_check_due():
            checked.append(memory.step_index)
            assert memory.check_leaks(every_point=False) == []
    memory.check_leaks()
    screens = memory.summary()["leaks"]["screen"]["confirmations"]
    # The creep (1 KiB/step) is confirmed once, and refused; the same creep opens no second confirmation (each costs
    # 30 woken steps), a faster one (from step 176) does once it fills the screened window, and is refused in turn.
    assert [s["step"] for s in screens] == [SCREEN, 480] and not any(s["confirmed"] for s in screens)
    assert screens[0]["rate_bytes_per_step"] == 1024 < 2 * 1024 < screens[1]["rate_bytes_per_step"]
    assert checked == [SCREEN + 31, 511]
    assert memory.summary()["leaks"]["leaking"] == [] and memory.summary()["leaks"]["screen"]["trend"].significant


def test_flat_memory_is_never_confirmed_and_memory_in_use_is_read_on_snapshots_only() -> None:
    memory, checked, messages = run(leak=0, steps=300)
    assert checked == [] and messages == []
    report = memory.summary()
    assert report["leaks"]["leaking"] == [] and report["leaks"]["stopped_at_step"] is None
    screen = report["leaks"]["screen"]
    # One step in 4, one in 8 once 64 readings are kept (step 256): evenly spread, from warm-up on.
    assert screen["confirmations"] == [] and screen["read_every_n_steps"] == 8
    assert screen["trend"].samples == len(range(24, 300, 8))
    assert report["peak_above_start"]["median"] == 1 << 20  # CPU: the peak (3 MiB) above the resident set (2 MiB)
    assert report["overhead"]["step_s_mean"] == 1e-3


def test_between_snapshots_a_step_reads_only_the_resident_set_and_its_hooks_may_stay_silent() -> None:
    """On CPU: a full snapshot one step in ``every_n_steps``, the resident set at the end of one step in 4 (8 from step
    256, when 64 readings are kept), no other probe call (no heap walk) in the other steps, which say so beforehand
    (``reading``)."""
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
            assert not memory.leak_check_due()
        else:
            memory.read_cheap(memory.step_index - 1, epoch=0)  # what the callback's countdown does
        per_step.append(probe.calls - before)
    for step in range(400):
        calls, snapshot, read = per_step[step], step % 50 == 0, step % (4 if step < 256 else 8) == 0
        assert reading[step] == snapshot, step
        # a snapshot: a sample per point; the peak (3x the bytes) is above the level (2x): it is reset
        assert calls == Counter(
            **(dict(sample=4, reset_peak=1) if snapshot else {}), **(dict(resident=1) if read else {})
        ), step


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
    snapshots = sum(1 for s in range(LEAK_CHECK_EVERY_N_STEPS, steps) if s % 50 == 0)
    figures = memory.summary()["overhead"]
    probe_ns = snapshots * 2 * 100_000  # a snapshot here: after_data and after_optimizer
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
                ran = 0
                while ran < quiet:  # the countdown: the cheap reading of each quiet step, cut short by a screen
                    probe.bytes += leak
                    ran += 1
                    if memory.read_cheap(memory.step_index + ran - 1, epoch=0):
                        break
                memory.skip(ran, counted=True)
                step += ran
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
            else:
                memory.read_cheap(memory.step_index - 1, epoch=0)
            step += 1
        return memory, probe, found

    (every, every_probe, every_found), (skipping, skipping_probe, skipping_found) = loop(False), loop(True)
    assert skipping_probe.calls == every_probe.calls and skipping_found == every_found
    assert bool(every_found) == bool(leak)
    assert skipping.step_index == every.step_index == 1500 and skipping.steps == every.steps
    assert skipping.series.series(0) == every.series.series(0)
    overhead = skipping.summary()["overhead"]
    assert skipping.cheap.series(0) == every.cheap.series(0)
    assert overhead["heavy_calls"] < 100  # snapshots and a confirmation: the rest ran with no call but the reading
