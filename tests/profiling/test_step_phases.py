"""A hand-written loop times its phases with StepPhases and summarize_steps: no Trainer, a scripted clock."""

from __future__ import annotations

import pytest
import torch

from lightning_perf.profiling import PhaseTimer
from lightning_perf.profiling.step_phases import (
    MEASURED,
    LiveSchedule,
    StepPhases,
    StepSampler,
    batch_size_of,
    binned,
    first_dataloader,
    live_figures,
    merge_ranks,
    report_lines,
    report_text,
    summarize_steps,
)
from lightning_perf.profiling.timer import HookCost, PhaseLedger
from tests._models import ScriptedClock


def test_a_hand_written_loop_gets_phases_shares_and_interrupted_steps() -> None:
    clock = ScriptedClock()
    phases = StepPhases(PhaseLedger(MEASURED, warmup_steps=1, clock=clock))
    phases.open_gap()
    for step in range(5):
        clock.advance(1)  # the wait for the batch: "data"
        phases.begin_step("forward")
        clock.advance(2)
        phases.switch("backward")
        clock.advance(4)
        phases.switch(None)
        clock.advance(1)  # no phase: "other"
        phases.end_step(8)  # the wait for the next batch begins
        if step == 2:  # validation after the third step: the fourth one's wait is cut, and it is left out
            phases.interrupt()
            clock.advance(50)
            phases.open_gap()
    report = summarize_steps(phases)
    assert report["steps"] == {"total": 5, "warmup": 1, "steady": 4, "interrupted": 1}
    steady = report["steady_state"]
    assert steady["step"]["median"] == pytest.approx(8e-3)
    assert steady["shares"]["backward"] == pytest.approx(0.5) and steady["shares"]["other"] == pytest.approx(0.125)
    assert report["throughput"]["samples_per_s"] == pytest.approx(1000.0)
    assert report["per_step"]["interrupted"] == [False, False, True, False]
    assert report["overhead"]["hook_calls"] == 0  # the loop counted none of its calls on phases.cost


def test_long_runs_are_binned_to_at_most_the_bars_asked_for() -> None:
    records = [{"data": float(i), "transfer": 0.0, "forward": 1.0, "backward": 1.0, "optimizer": 0.0, "other": 0.0}
               for i in range(10)]  # fmt: skip
    bars = binned(records, bars=4)
    assert len(bars) == 4 and bars[0]["data"] == pytest.approx(0.5) and bars[-1]["data"] == pytest.approx(8.0)


def test_validation_is_timed_apart_and_live_figures_feed_a_progress_bar() -> None:
    clock = ScriptedClock()
    timer = PhaseLedger(MEASURED, clock=clock)
    phases = StepPhases(timer, validation=PhaseTimer(torch.device("cpu"), clock=clock))
    phases.begin_epoch()
    for _ in range(2):
        clock.advance(1)
        phases.begin_step("forward")
        clock.advance(3)
        phases.end_step(4)
        phases.pause()  # validation: the open wait for data is cut, the next step marked interrupted
        clock.advance(20)
        phases.resume()
    assert phases.validation.summary()["validation"].total == pytest.approx(40e-3)
    metrics, bar = live_figures(phases, window=2)
    assert metrics["forward"] == pytest.approx(0.75) and metrics["step_s"] == pytest.approx(4e-3)
    assert bar == {"data%": 25.0, "fwd%": 75.0, "bwd%": 0.0, "opt%": 0.0, "samples/s": 1000.0}


def test_a_phase_timer_gives_the_same_records_as_the_ledger() -> None:
    """The CUDA path (a PhaseTimer behind StepPhases) and the CPU ledger agree on the same scripted loop."""
    records = []
    for make in (lambda c: PhaseLedger(MEASURED, clock=c), lambda c: PhaseTimer(torch.device("cpu"), clock=c)):
        clock = ScriptedClock()
        phases = StepPhases(make(clock))
        phases.open_gap()
        for _ in range(3):
            clock.advance(1)
            phases.begin_step("forward")
            clock.advance(2)
            phases.switch(None)
            clock.advance(0.5)
            phases.end_step(4)
        phases.interrupt()
        records.append(summarize_steps(phases)["per_step"]["records"])
    assert records[0] == records[1] and records[0][0]["other"] == pytest.approx(0.5e-3)


class CountingClock(ScriptedClock):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __call__(self) -> int:
        self.reads += 1
        return self.now


def test_one_clock_read_per_boundary_and_no_object_kept_per_step() -> None:
    import sys

    clock = CountingClock()
    phases = StepPhases(PhaseLedger(MEASURED, clock=clock), cost=HookCost(every=10**9, first=10**9))

    def step() -> None:
        clock.advance(1)
        phases.begin_step("transfer")
        phases.switch("forward")
        phases.switch("backward")
        phases.switch(None)
        phases.switch("optimizer")
        phases.switch(None)
        phases.end_step(32)

    phases.open_gap()
    for _ in range(2000):  # the typed arrays reach a size where their growth is rare
        step()
    before_reads, before_blocks = clock.reads, sys.getallocatedblocks()
    for _ in range(100):
        step()
    assert clock.reads - before_reads == 7 * 100  # seven boundaries a step, the last one also opens "data"
    assert sys.getallocatedblocks() - before_blocks <= 2  # an array's occasional regrowth at most, never per step
    assert len(phases.timer.steps) == 2100 and phases.timer.steps[-1]["forward"] == 0.0


def test_hook_cost_times_one_step_in_every_from_first_and_counts_every_call() -> None:
    cost = HookCost(every=3, first=2, dispatch_ns=100.0)
    timed = []
    for step in range(9):
        cost.step(step)
        timed.append(cost.timing)
        for _ in range(4):  # four hooks a step
            cost.end(cost.begin())
    assert timed == [False, False, True, False, False, True, False, False, True]
    figures = cost.figures(steps=7, step_s=1e-3)  # the steady steps: from `first` on
    assert (figures["hook_calls"], figures["warmup_hook_calls"], figures["timed_calls"]) == (28, 8, 12)
    assert figures["hooks_ns_total"] == pytest.approx(28 * (figures["hook_body_ns"] + 100.0))
    assert figures["share_of_step"] == pytest.approx(figures["hooks_ns_per_step"] / 1e6)


def test_hook_cost_times_heavy_steps_whole_and_bills_them_as_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scripted clock: routine calls take 10 ns, the heavy step's calls 1,000 ns; the heavy ones are not averaged
    into every call (one step in `every` would otherwise bill the dear one to all, or miss it)."""
    now = {"ns": 1}  # a clock read of 0 means "not timed"
    monkeypatch.setattr("lightning_perf.profiling.timer.time.perf_counter_ns", lambda: now["ns"])
    cost = HookCost(every=4, first=0, dispatch_ns=0.0)
    for step in range(8):
        cost.step(step, heavy=step == 5)
        for _ in range(2):
            entry = cost.begin()
            now["ns"] += 1000 if step == 5 else 10
            cost.end(entry)
    figures = cost.figures(steps=8, step_s=1e-6)
    assert (figures["hook_calls"], figures["timed_calls"], figures["heavy_calls"]) == (16, 4, 2)
    assert figures["heavy_ns_total"] == 2000 and figures["hook_body_ns_mean"] == figures["hook_body_ns"] == 10
    assert figures["hooks_ns_total"] == 2000 + 14 * 10


def _sampled_loop(
    phases: StepPhases, clock: ScriptedClock, steps: int, validation_after: int = -1
) -> tuple[list, list]:
    """A loop that calls the observer the way Lightning does with silenced hooks: the step's hooks only while the
    sampler is live, a per-step counter (an optimizer's post-hook) only while it is not."""
    started, ended = [], []
    phases.begin_epoch()
    for step in range(steps):
        clock.advance(1)  # data
        if phases.sampler.live:
            started.append(step)
            phases.begin_step("forward")
        clock.advance(3)
        if phases.sampler.live:
            phases.switch("optimizer")
        clock.advance(2)
        if not phases.sampler.live:  # the post-hook on a skipped step: a quiet call that counts it
            phases.cost.quiet_calls += 1
            phases.sampler.count()
        if phases.sampler.live:
            ended.append(step)
            phases.finish_batch(4)
        if step == validation_after:
            phases.pause()
            clock.advance(50)
            phases.resume()
    return started, ended


def test_a_sampler_times_warm_up_then_one_step_in_every() -> None:
    sampler = StepSampler(every=4, first=2)
    assert [s for s in range(12) if sampler.sampled(s)] == [0, 1, 2, 6, 10]
    assert [s for s in range(5) if StepSampler().sampled(s)] == [0, 1, 2, 3, 4]


def test_sampled_phases_open_the_wait_at_the_end_of_the_step_before() -> None:
    clock = ScriptedClock()
    phases = StepPhases(PhaseLedger(MEASURED, warmup_steps=2, clock=clock), sampler=StepSampler(every=4, first=2))
    started, ended = _sampled_loop(phases, clock, 40, validation_after=13)
    sampled = [0, 1, *range(2, 40, 4)]
    assert started == sampled and ended == sorted({*sampled, *range(5, 40, 4)})
    report = summarize_steps(phases)
    assert report["steps"] == {"total": 12, "warmup": 2, "steady": 10, "interrupted": 1}
    assert report["per_step"]["interrupted"] == [s == 14 for s in range(2, 40, 4)]  # validation before step 14
    clean = [r for r, cut in zip(report["per_step"]["records"], report["per_step"]["interrupted"]) if not cut]
    assert all(r == pytest.approx({**r, "data": 1e-3, "forward": 3e-3, "optimizer": 2e-3, "step": 6e-3}) for r in clean)
    assert report["steps_run"] == report["sampling"]["steps_run"] == 40
    assert report["overhead"]["steady_steps"] == 38 and report["overhead"]["quiet_calls"] == 40 - len(started)
    assert (
        "12 timed steps of 40, one in 4"
        in report_lines({**report, "recommendations": [], "validation": {"runs": 0}})[0]
    )


def test_sample_every_one_is_every_step() -> None:
    clock = ScriptedClock()
    phases = StepPhases(PhaseLedger(MEASURED, warmup_steps=1, clock=clock))
    started, ended = _sampled_loop(phases, clock, 10)
    assert started == ended == list(range(10))
    report = summarize_steps(phases)
    assert report["steps"]["total"] == report["steps_run"] == 10 and not report["per_step"]["sampled"]


def test_hook_cost_bills_routine_calls_at_the_median_body_and_quiet_calls_a_flag_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One interrupted timed call (a collection inside it) is not billed to every call; a quiet call (a skipped step's
    flag check) costs what :func:`quiet_call_ns` measured, not a hook body."""
    now = {"ns": 1}
    monkeypatch.setattr("lightning_perf.profiling.timer.time.perf_counter_ns", lambda: now["ns"])
    cost = HookCost(every=1, first=0, dispatch_ns=0.0)
    cost.quiet_ns = 2.0
    for step in range(5):
        cost.step(step)
        entry = cost.begin()
        now["ns"] += 100_000 if step == 2 else 10
        cost.end(entry)
    cost.quiet_calls = 1000
    figures = cost.figures(steps=5, step_s=1e-3)
    assert figures["hook_body_ns"] == 10 and figures["hook_body_ns_mean"] > 10_000
    assert figures["hooks_ns_total"] == 5 * 10 + 1000 * 2.0


# ------------------------------------------------------------------------------- an observer's calls, no Trainer


def _observed_loop(phases: StepPhases, clock: ScriptedClock, steps: int) -> list[bool]:
    """The calls an observer makes (Lightning's hooks in BottleneckCallback), from a plain loop: ``enter`` inside the
    step, a per-step counter on skipped steps, ``end_batch`` at a step's end while the sampler is live. Returns which
    of those ends closed a timed step."""
    closed = []
    phases.begin_epoch()
    for _ in range(steps):
        clock.advance(1)
        phases.enter("transfer", only_from="data")  # runs on every step, timed or not
        clock.advance(0.5)
        phases.enter(None, only_from="transfer")
        if phases.sampler.live:
            phases.begin_step("forward")
        clock.advance(3)
        phases.enter("optimizer")
        clock.advance(2)
        if not phases.sampler.live:  # the per-step counter (an optimizer's post-hook) on a skipped step
            phases.cost.quiet_calls += 1
            phases.sampler.count()
        if phases.sampler.live:  # the end of a timed step, or of the one before it (just woken by the counter)
            closed.append(phases.end_batch([torch.zeros(4, 2)]))
    return closed


def test_an_observer_loop_times_its_sampled_steps_and_counts_the_others_quietly() -> None:
    clock = ScriptedClock()
    phases = StepPhases.for_device(torch.device("cpu"), warmup_steps=1, sample_every=3, clock=clock, dense_steps=0)
    assert isinstance(phases.timer, PhaseLedger) and phases.syncs.recorder is None
    closed = _observed_loop(phases, clock, 10)  # timed: 0 (warm-up), 1, 4, 7; their ends and the ends before them
    assert closed == [True, True, False, True, False, True, False]
    report = summarize_steps(phases)
    assert report["steps"]["total"] == 4 and report["steps_run"] == 10
    for record in report["per_step"]["records"]:
        assert record == pytest.approx({"data": 1e-3, "transfer": 0.5e-3, "forward": 3e-3, "backward": 0.0,
                                        "optimizer": 2e-3, "other": 0.0, "step": 6.5e-3})  # fmt: skip
    # Quiet calls: the two transfer calls and the optimizer's of each skipped step, and its counter.
    assert phases.cost.quiet_calls == 6 * 4
    assert report["throughput"]["batch_size_median"] == 4


def test_enter_switches_only_from_the_phase_named_and_counts_every_call() -> None:
    clock = ScriptedClock()
    phases = StepPhases(PhaseLedger(MEASURED, clock=clock), cost=HookCost(every=10**9, first=0))
    phases.enter("transfer", only_from="data")  # no step open: counted, nothing switched
    assert phases.current is None and phases.cost.warmup_calls == 1  # before any step: warm-up
    phases.open_gap()
    phases.enter("backward", only_from="forward")  # "data" runs: not from "forward"
    assert phases.current == "data"
    phases.enter("transfer", only_from="data")
    assert phases.current == "transfer" and phases.cost.warmup_calls == 3 and phases.cost.quiet_calls == 0


def test_live_schedule_is_due_once_every_steps_have_run_and_never_at_zero() -> None:
    live = LiveSchedule(every=50, sample_every=32)
    assert live.window == 2 and not live.due(49) and live.due(50)
    live.last = 64
    assert not live.due(113) and live.due(114)
    never = LiveSchedule(every=0, sample_every=32)
    assert never.window == 0 and not never.due(10**6)


def test_ranks_are_merged_with_the_world_throughput() -> None:
    report: dict = {"throughput": {"samples_per_s": 10.0}}
    merge_ranks(report, None, world_size=1)
    assert report == {"throughput": {"samples_per_s": 10.0}}
    ranks = {"samples_per_s": {"min": 9.0, "mean": 10.0, "max": 11.0}}
    merge_ranks(report, ranks, world_size=4)
    assert report["ranks"] is ranks and report["throughput"]["world_samples_per_s"] == 40.0


def test_report_text_holds_the_table_and_the_lines() -> None:
    clock = ScriptedClock()
    phases = StepPhases(PhaseLedger(MEASURED, clock=clock))
    phases.open_gap()
    for _ in range(3):
        clock.advance(1)
        phases.begin_step("forward")
        clock.advance(2)
        phases.end_step(8)
    report = {**summarize_steps(phases), "device": "cpu", "recommendations": [], "validation": {"runs": 0}}
    text = report_text(report, "Owner")
    assert "Owner: 3 steady steps" in text
    assert "forward" in text and "recommendations: none" in text and "samples/s" in text


def test_a_paused_hook_cost_still_bills_a_heavy_call_as_heavy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The end of a heavy step pauses the cost (the observer goes quiet) before its own call ends: that call is billed
    as the heavy call it is, never as a routine body (which would be billed to every routine call)."""
    now = {"ns": 1}
    monkeypatch.setattr("lightning_perf.profiling.timer.time.perf_counter_ns", lambda: now["ns"])
    cost = HookCost(every=10**9, first=0)
    cost.step(0, heavy=True)
    entry = cost.begin()
    now["ns"] += 5000
    cost.pause()
    cost.end(entry)
    assert (cost.heavy_calls, cost.timed_calls, cost.heavy_ns) == (1, 0, 5000)
    assert cost.begin() == 0  # nothing timed after the pause


def test_live_figures_from_the_ledger_totals_equal_those_from_its_records() -> None:
    clock = ScriptedClock()
    phases = StepPhases(PhaseLedger(MEASURED, clock=clock))
    phases.open_gap()
    for step in range(6):
        clock.advance(1 + step)
        phases.begin_step("forward")
        clock.advance(2)
        phases.switch(None)  # "other"
        clock.advance(0.5)
        phases.switch("optimizer")
        clock.advance(1)
        phases.end_step(8)
    totals, steps = phases.timer.recent_totals(3)
    records = phases.timer.recent_steps(3)
    assert steps == 3 and sum(totals.values()) == pytest.approx(sum(r["step"] for r in records) * 1e9)
    assert totals["other"] == 3 * 500_000 and totals["backward"] == 0
    metrics, bar = live_figures(phases, 3, prefix="bottleneck/", bar=False)
    assert bar == {} and metrics["bottleneck/other"] == pytest.approx(1.5 / (3 * 3.5 + 4 + 5 + 6))
    assert metrics["bottleneck/step_s"] == pytest.approx((3 * 3.5 + 4 + 5 + 6) / 3 / 1e3)
    assert metrics["bottleneck/samples_per_s"] == pytest.approx(8 / metrics["bottleneck/step_s"])
    assert phases.timer.recent_totals(0) == ({name: 0 for name in (*MEASURED, "other")}, 0)


def test_a_skipped_steps_counter_is_billed_at_its_timed_median_the_flag_checks_at_theirs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One counter call in 16 is timed (a scripted clock: each takes 3,000 ns); every counter call is billed that,
    the other quiet calls a flag check's cost; before any is timed, a counter call is billed a flag check too."""
    now = {"ns": 1}
    monkeypatch.setattr("lightning_perf.profiling.timer.time.perf_counter_ns", lambda: now["ns"])
    cost = HookCost(every=10**9, first=0)
    cost.quiet_ns = 2.0
    for _ in range(15):
        cost.quiet_step(now["ns"])
    assert cost.counter_body_ns() == 2.0
    for _ in range(17):
        entry = now["ns"]
        now["ns"] += 3000
        cost.quiet_step(entry)
    cost.quiet_calls += 10  # flag checks
    figures = cost.figures(steps=32, step_s=1e-3)
    assert (figures["quiet_calls"], figures["quiet_counter_calls"], figures["quiet_counter_ns"]) == (42, 32, 3000.0)
    assert figures["hooks_ns_total"] == 32 * 3000.0 + 10 * 2.0


def test_the_batch_size_and_the_loader_are_found_depth_first_through_nests() -> None:
    scalar, images = torch.tensor(1.0), torch.zeros(6, 3)
    assert batch_size_of({"step": scalar, "inputs": [scalar, {"x": images}], "y": torch.zeros(2)}) == 6
    assert batch_size_of((scalar, "text")) is None
    loader = torch.utils.data.DataLoader([1, 2])
    assert first_dataloader({"a": [], "b": [{"c": loader}]}) is loader and first_dataloader([[], ()]) is None
