"""The reliability verdict with the probes replaced: undisturbed, and each cause on its own."""

from __future__ import annotations

import pytest

from lightning_perf.profiling.reliability import (
    FREQUENCY_MIN_SHARE,
    LOAD_PER_CORE_MAX,
    OTHER_CORES_MAX,
    STEAL_SHARE_MAX,
    ConditionMonitor,
    Probes,
    RunConditions,
    assess,
)

QUIET_STEPS = {"baseline": [[0.10, 0.11, 0.10, 0.105]] * 3, "fast": [[0.05, 0.051, 0.05, 0.052]] * 3}


class FakeMachine:
    """Counters that advance by what the test says happened during a run."""

    def __init__(self, cores: int = 2) -> None:
        self.t = self.busy = self.steal = self.ours = 0.0
        self.load: float | None = 0.5
        self.freq: tuple[float, float] | None = (3000.0, 3000.0)
        self.cores = cores

    def probes(self) -> Probes:
        return Probes(
            clock=lambda: self.t,
            system_cpu=lambda: (self.busy, self.steal),
            own_cpu=lambda: self.ours,
            load_average=lambda: self.load,
            frequency=lambda: self.freq,
            cpu_count=lambda: self.cores,
        )

    def run(self, wall: float, ours: float, others: float = 0.0, steal: float = 0.0) -> None:
        self.t += wall
        self.ours += ours
        self.busy += ours + others
        self.steal += steal


def _monitor_one_run(machine: FakeMachine, **happened: float) -> RunConditions:
    monitor = ConditionMonitor(machine.probes())
    token = monitor.start()
    machine.run(**happened)
    return monitor.stop(token, "fast, repeat 1", config="fast", repeat=0)


def test_a_quiet_run_is_reliable() -> None:
    machine = FakeMachine()
    run = _monitor_one_run(machine, wall=10.0, ours=19.5)
    assert run.other_cores == 0.0 and run.steal_share == 0.0 and (run.config, run.repeat) == ("fast", 0)
    verdict = assess([run], QUIET_STEPS, cores_used=2, cpu_count=2)
    assert verdict.reliable and verdict.causes == [] and verdict.disturbed_runs == []
    data = verdict.to_dict()
    assert data["reliable"] is True and data["other_cores_max"] == 0.0 and "dispersion" in data


def test_other_processes_load_is_a_cause() -> None:
    run = _monitor_one_run(FakeMachine(), wall=10.0, ours=10.0, others=10.0)
    assert run.other_cores == pytest.approx(1.0)
    verdict = assess([run], QUIET_STEPS, cores_used=2, cpu_count=2)
    assert not verdict.reliable and verdict.disturbed_runs == ["fast, repeat 1"]
    assert len(verdict.causes) == 1 and verdict.causes[0].startswith("other processes' load")
    assert "1.00 cores" in verdict.causes[0]


def test_other_processes_on_free_cores_do_not_count() -> None:
    # 8 cores, the bench uses 2: others may keep 6 busy before they compete with it.
    run = _monitor_one_run(FakeMachine(cores=8), wall=10.0, ours=20.0, others=50.0)
    assert assess([run], QUIET_STEPS, cores_used=2, cpu_count=8).reliable
    busier = _monitor_one_run(FakeMachine(cores=8), wall=10.0, ours=20.0, others=10 * (6 + OTHER_CORES_MAX + 0.1))
    assert not assess([busier], QUIET_STEPS, cores_used=2, cpu_count=8).reliable


def test_steal_time_is_a_cause() -> None:
    run = _monitor_one_run(FakeMachine(), wall=10.0, ours=18.0, steal=20.0 * (STEAL_SHARE_MAX + 0.03))
    verdict = assess([run], QUIET_STEPS, cores_used=2, cpu_count=2)
    assert not verdict.reliable and verdict.causes[0].startswith("steal time")


def test_load_average_is_a_cause() -> None:
    machine = FakeMachine()
    machine.load = LOAD_PER_CORE_MAX * 2 + 1
    verdict = assess([_monitor_one_run(machine, wall=5.0, ours=9.0)], QUIET_STEPS, cores_used=2, cpu_count=2)
    assert not verdict.reliable and verdict.causes[0].startswith("load average 4.0 on 2 cores")


def test_low_frequency_is_a_cause_and_missing_counters_are_not() -> None:
    machine = FakeMachine()
    machine.freq = (3000.0 * (FREQUENCY_MIN_SHARE - 0.1), 3000.0)
    verdict = assess([_monitor_one_run(machine, wall=5.0, ours=9.0)], QUIET_STEPS, cores_used=2, cpu_count=2)
    assert not verdict.reliable and verdict.causes[0].startswith("CPU frequency at 60%")
    machine.freq, machine.load = None, None
    run = _monitor_one_run(machine, wall=5.0, ours=9.0)
    assert run.frequency_share is None and run.load_average is None
    assert assess([run], QUIET_STEPS, cores_used=2, cpu_count=2).reliable


def test_repeats_that_disagree_are_a_cause() -> None:
    steps = {"baseline": QUIET_STEPS["baseline"], "fast": [[0.05] * 4, [0.05] * 4, [0.09] * 4]}
    verdict = assess([], steps, cores_used=2, cpu_count=2)
    assert not verdict.reliable and verdict.disturbed_configs == ["fast"]
    assert verdict.causes == ["dispersion of fast: its per-repeat medians are 80% apart"]


def test_outlier_steps_are_a_cause() -> None:
    steps = {"baseline": [[0.1] * 8 + [0.5] * 2]}
    verdict = assess([], steps, cores_used=2, cpu_count=2)
    assert not verdict.reliable and "20% of its steps took over 2x their median" in verdict.causes[0]


def test_the_real_probes_count_a_reaped_worker_as_ours() -> None:
    import subprocess
    import sys

    probes = Probes.system()
    before = probes.own_cpu()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    assert probes.own_cpu() - before > 0.05  # the child's CPU time (its loop), known once it is reaped
    busy, steal = probes.system_cpu()
    assert busy > 0 and steal >= 0 and probes.cpu_count() >= 1
    load = probes.load_average()
    assert load is None or load >= 0
