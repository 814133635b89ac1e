"""Other processes' load judged against the bench's starting conditions, and bursts caught within a run: scripted
counters and clock, no sleeps, no timing."""

from __future__ import annotations

import threading

import pytest

from lightning_perf.profiling.reliability import (
    OTHER_CORES_MAX,
    PEAK_MARGIN,
    PEAK_WINDOW_S,
    ConditionMonitor,
    LoadSampler,
    Probes,
    RunConditions,
    assess,
    other_cores_limit,
)


class Machine:
    """A scripted machine: :meth:`advance` moves the clock and the counters by what others and our workers did."""

    def __init__(self, cores: int = 2) -> None:
        self.t = self.busy = self.own = 0.0
        self.cores = cores
        self.children: dict[int, float] = {}
        self.others = 0.0  # cores other processes keep busy, while time passes

    def probes(self, *, tree: bool = True) -> Probes:
        return Probes(
            clock=lambda: self.t,
            system_cpu=lambda: (self.busy, 0.0),
            own_cpu=lambda: self.own,
            load_average=lambda: None,
            frequency=lambda: None,
            cpu_count=lambda: self.cores,
            tree_cpu=(lambda: (self.own, dict(self.children))) if tree else None,
            wait=self.advance,
        )

    def advance(self, seconds: float, workers: dict[int, float] | None = None) -> None:
        """``seconds`` pass: others keep :attr:`others` cores busy, each worker pid its given cores."""
        self.t += seconds
        self.busy += self.others * seconds
        for pid, cores in (workers or {}).items():
            self.children[pid] = self.children.get(pid, 0.0) + cores * seconds
            self.busy += cores * seconds

    def reap(self, pid: int) -> None:
        """The worker ends: its CPU time moves to this process's reaped children (``own_cpu``)."""
        self.own += self.children.pop(pid)


def _run(monitor: ConditionMonitor, machine: Machine, others_by_second: list[float], label: str) -> RunConditions:
    """One worker (pid 100, one core) for ``len(others_by_second)`` seconds, sampled every second."""
    token = monitor.start()
    for others in others_by_second:
        machine.others = others
        machine.advance(1.0, {100: 1.0})
        monitor.sample()
    machine.reap(100)
    return monitor.stop(token, label)


# ------------------------------------------------------------------ judged against the start


def test_a_steady_load_present_from_the_start_is_not_a_disturbance_and_is_said() -> None:
    machine = Machine()
    machine.others = 1.0
    monitor = ConditionMonitor(machine.probes(), sample_every_s=None)
    start = monitor.other_cores_now()
    assert start == pytest.approx(1.0)
    runs = [_run(monitor, machine, [1.0] * 20, f"baseline, repeat {i}") for i in range(1, 4)]
    verdict = assess(runs, {}, cores_used=1, cpu_count=2, start_other_cores=start)
    assert verdict.reliable and verdict.disturbed_runs == []
    note = verdict.figures["start_load"]
    assert note.startswith("a steady load of 1.00 cores was present from the start")
    assert "the bench used 1 of 2 cores and judged runs against it" in note
    assert verdict.to_dict()["other_cores_start"] == pytest.approx(1.0)
    assert verdict.figures["other_cores_limit"] == pytest.approx(1.0 + OTHER_CORES_MAX)


def test_a_load_rising_after_the_start_is_a_disturbance() -> None:
    machine = Machine()
    monitor = ConditionMonitor(machine.probes(), sample_every_s=None)
    start = monitor.other_cores_now()  # quiet
    assert start == 0.0
    run = _run(monitor, machine, [1.0] * 20, "baseline, repeat 1")
    verdict = assess([run], {}, cores_used=2, cpu_count=2, start_other_cores=start)
    assert not verdict.reliable and verdict.disturbed_runs == ["baseline, repeat 1"]
    assert verdict.causes[0].startswith("other processes' load: they kept 1.00 cores busy on average")
    # A steady load at the start, then more: the rise counts.
    risen = RunConditions("fast, repeat 1", 20.0, 1.6, 0.0)
    assert assess([risen], {}, cores_used=1, cpu_count=2, start_other_cores=1.0).disturbed_runs == [risen.label]


def test_a_starting_load_larger_than_the_choice_could_leave_free_is_not_excused() -> None:
    run = RunConditions("baseline, repeat 1", 20.0, 1.33, 0.0)  # two busy loops beside one thread, on two cores
    verdict = assess([run], {}, cores_used=1, cpu_count=2, start_other_cores=2.0)
    assert verdict.disturbed_runs == [run.label]
    assert "more than the 1 core(s) the bench could leave free" in verdict.figures["start_load"]
    level, note = other_cores_limit(1, 2, 1.4)  # the choice rounded 1.4 to one core: the rest is excused too
    assert level == pytest.approx(1.4) and note is not None and note.startswith("a steady load of 1.40 cores")


def test_a_starting_load_sharing_threads_set_by_hand_is_not_excused_and_says_why() -> None:
    run = RunConditions("baseline, repeat 1", 20.0, 0.9, 0.0)  # one busy loop sharing two threads' cores
    verdict = assess([run], {}, cores_used=2, cpu_count=2, start_other_cores=1.0, threads_set=True)
    assert verdict.disturbed_runs == [run.label]
    note = verdict.figures["start_load"]
    assert "the threads were set by hand (the bench used 2 of 2 cores, leaving 0 free)" in note
    assert "it shares the bench's cores" in note and "counts as a disturbance" in note
    # Set by hand, but leaving the load its core: excused like an automatic choice.
    beside = RunConditions("baseline, repeat 1", 20.0, 1.0, 0.0)
    assert assess([beside], {}, cores_used=1, cpu_count=2, start_other_cores=1.0, threads_set=True).reliable


def test_without_a_starting_sample_only_the_free_cores_are_excused() -> None:
    assert other_cores_limit(1, 2) == (1.0, None)
    assert other_cores_limit(2, 2, 0.2) == (0.2, None)  # too small to name


# ------------------------------------------------------------------ bursts within a run


def test_a_burst_over_part_of_a_run_is_caught_by_its_busiest_window() -> None:
    machine = Machine()
    monitor = ConditionMonitor(machine.probes(), sample_every_s=None)
    others = [0.0] * 30 + [2.0] * 8 + [0.0] * 22  # two busy loops for 8 s of a 60-s run
    run = _run(monitor, machine, others, "channels_last, repeat 2")
    limit = 1 + OTHER_CORES_MAX
    assert run.other_cores < limit  # the average alone misses it
    assert run.other_cores_peak == pytest.approx(2.0)
    verdict = assess([run], {}, cores_used=1, cpu_count=2, start_other_cores=0.0)
    assert verdict.disturbed_runs == [run.label]
    assert verdict.causes[0].startswith(f"other processes' load: they kept 2.00 cores busy over {PEAK_WINDOW_S:g} s")
    assert verdict.figures["other_cores_peak_max"] == pytest.approx(2.0)
    # A blip of one core for 2 s stays within the margin.
    blip = _run(monitor, machine, [0.0] * 30 + [1.0] * 2 + [0.0] * 28, "channels_last, repeat 3")
    assert blip.other_cores_peak is not None and blip.other_cores_peak < limit + PEAK_MARGIN
    assert assess([blip], {}, cores_used=1, cpu_count=2).reliable


def test_the_sampler_counts_our_workers_as_ours_and_a_process_beside_as_others() -> None:
    machine = Machine()
    machine.children[7] = 5.0  # started by the caller before the run: another process
    sampler = LoadSampler(machine.probes())
    machine.advance(1.0, {7: 1.0, 100: 1.0})  # pid 100 is a new worker: all its time is ours
    sampler.sample()
    machine.advance(1.0, {7: 1.0, 100: 1.0})
    sampler.sample()
    assert [others for _, others in sampler.intervals] == [pytest.approx(1.0), pytest.approx(1.0)]
    machine.advance(1.0, {7: 1.0, 100: 1.0})
    machine.reap(100)  # ended before the next reading: that interval is unknown, not a burst
    sampler.sample()
    assert sampler.intervals[-1][1] is None
    assert sampler.peak() == pytest.approx(1.0)  # shorter than the window: the known intervals' average


def test_a_short_run_without_samples_has_no_peak_and_old_runs_load() -> None:
    machine = Machine()
    monitor = ConditionMonitor(machine.probes(), sample_every_s=None)
    token = monitor.start()
    machine.advance(0.5)
    assert monitor.stop(token, "baseline, repeat 1").other_cores_peak is None
    no_tree = ConditionMonitor(machine.probes(tree=False))  # a caller's own counters: averages only
    assert no_tree.stop(no_tree.start(), "x").other_cores_peak is None
    assert RunConditions("x", 1.0, 0.0, 0.0).other_cores_peak is None  # the field older result files lack


def test_the_sampler_thread_stops_with_the_run_and_never_outlives_it() -> None:
    machine = Machine()
    before = set(threading.enumerate())
    monitor = ConditionMonitor(machine.probes(), sample_every_s=3600.0)  # the thread waits; it never samples here
    token = monitor.start()
    assert {t.name for t in set(threading.enumerate()) - before} == {"lightning-perf-load"}
    monitor.stop(token, "baseline, repeat 1")
    assert set(threading.enumerate()) - before == set()
    monitor.start()  # a run that raised: close() ends its sampler
    monitor.close()
    assert set(threading.enumerate()) - before == set()
    monitor.start()
    monitor.start()  # a second start ends the first's sampler
    monitor.close()
    assert set(threading.enumerate()) - before == set()


def test_the_starting_sample_needs_a_way_to_wait() -> None:
    machine = Machine()
    probes = machine.probes()
    quiet = Probes(probes.clock, probes.system_cpu, probes.own_cpu, probes.load_average, probes.frequency,
                   probes.cpu_count)  # fmt: skip
    assert ConditionMonitor(quiet).other_cores_now() is None
    machine.others = 5.0  # more than the machine has: capped at its cores
    assert ConditionMonitor(probes).other_cores_now(2.0) == pytest.approx(2.0)
