"""The workers' intra-op threads: decided once from scripted cores and load, the same for every run, put in the
worker's environment and torch, and recorded in each result, the JSON report and the header line. No timing."""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_perf.benchmark import threads as thread_rules
from lightning_perf.benchmark.console import console_lines
from lightning_perf.benchmark.isolation import run_isolated
from lightning_perf.benchmark.runner import run_benchmark
from lightning_perf.benchmark.spec import BenchSpec, RunSpec, SpecError
from lightning_perf.benchmark.threads import decide_for_run, decide_threads, thread_env, threads_line
from lightning_perf.benchmark.worker import RunResult, run
from lightning_perf.profiling import PeakFlops
from lightning_perf.profiling.reliability import ConditionMonitor
from tests.benchmark.test_auto_bench import Quiet


@pytest.fixture(autouse=True)
def _threads_not_set_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # `pytest -n 2` sets 1 per worker (tests/conftest.py)


@pytest.mark.parametrize(
    ("cores", "load", "threads"),
    [
        (2, 1.4, 1),  # one core's worth of other work: leave it that core
        (2, 0.3, 2),  # quiet: every core
        (2, 6.7, 1),  # never below one
        (16, 3.2, 13),
        (2, None, 2),  # no load average on this platform: as if quiet
        (None, 0.0, 1),  # cores unknown: one
    ],
)
def test_threads_follow_the_cores_and_the_load(cores: int | None, load: float | None, threads: int) -> None:
    choice = decide_threads(cores, load, environ={})
    assert (choice.threads, choice.reason) == (threads, "auto")
    # Idle OpenMP threads sleep where a load was there at the start: spinning against another process made 2 threads
    # 2.5-7.6x slower than 1 (guide); on a quiet machine OpenMP's default, as a user's training runs (PASSIVE slowed
    # lm's bf16-mixed step 1.4x there).
    policy = {"OMP_WAIT_POLICY": "PASSIVE"} if (load or 0) >= 0.5 else {}
    assert thread_env(choice.threads, choice.wait_policy) == {"OMP_NUM_THREADS": str(threads), **policy}


def test_an_explicit_count_wins_then_the_environment() -> None:
    assert decide_threads(2, 1.4, asked=2, environ={"OMP_NUM_THREADS": "1"}).threads == 2
    from_env = decide_threads(2, 0.0, environ={"OMP_NUM_THREADS": "1"})
    assert (from_env.threads, from_env.reason) == (1, "OMP_NUM_THREADS")
    assert decide_threads(2, 0.0, environ={"OMP_NUM_THREADS": "many"}).reason == "auto"
    assert decide_threads(2, 0.0, environ={"OMP_WAIT_POLICY": "ACTIVE"}).wait_policy == "ACTIVE"  # the user's own
    with pytest.raises(ValueError, match=r"decide_threads\(asked=0\).*integer >= 1"):
        decide_threads(2, 0.0, asked=0)
    with pytest.raises(SpecError, match="threads"):
        BenchSpec(threads=0)


def test_the_header_line_reads_from_the_report_record() -> None:
    choice = decide_threads(2, 1.4, environ={})
    assert choice.line == "threads: 1 (2 cores, load 1.4)"
    assert threads_line({"threads": choice.to_dict()}) == choice.line
    assert decide_threads(2, None, asked=2).line == "threads: 2 (2 cores, load unknown, asked for)"
    assert threads_line({}) is None  # a report from before threads were recorded
    assert thread_env(None) == {}


def test_the_worker_environment_carries_the_threads_before_torch_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: dict[str, str | None] = {}

    class Process:  # records the environment a spawned child would inherit, and starts nothing
        exitcode = 1

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def start(self) -> None:
            seen.update({k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")})

        def join(self, timeout: float | None = None) -> None:
            pass

        def is_alive(self) -> bool:
            return False

    context = type("Context", (), {"Process": Process})
    monkeypatch.setattr(multiprocessing, "get_context", lambda method: context())
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    result = run_isolated(RunSpec(config="baseline", threads=1), tmp_path, 10.0)
    assert seen == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": None}  # OpenMP's own wait policy: none of ours
    assert "OMP_NUM_THREADS" not in os.environ  # only the child's environment had it
    assert result is not None and not result.ok


def test_a_run_uses_and_records_its_threads_and_puts_torch_back() -> None:
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    spec = RunSpec(config="baseline", workload="convnet", preset="tiny", steps=2, warmup_steps=1, predict_batches=0,
                   threads=wanted)  # fmt: skip
    result = run(spec)
    assert result.ok, result.error
    assert result.threads == wanted and result.spec["threads"] == wanted
    assert torch.get_num_threads() == before


def test_every_run_of_a_bench_gets_the_same_threads_recorded_in_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(thread_rules, "load_average", lambda: 1.4)
    import lightning_perf.profiling.machine as machine

    described = machine.describe_machine()
    monkeypatch.setattr(machine, "describe_machine", lambda: {**described, "cpu_count_usable": 2})
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    asked: list[tuple[int | None, str | None]] = []

    def scripted(spec: RunSpec, tmp: Path, timeout_s: float) -> RunResult:
        asked.append((spec.threads, spec.wait_policy))
        steps = [0.2 if spec.config == "baseline" else 0.1] * 6
        return RunResult(spec={"config": spec.config, "repeat": spec.repeat, "threads": spec.threads}, batch_size=4,
                         step_median_s=steps[0], step_times_s=steps, threads=spec.threads,
                         wait_policy="PASSIVE" if spec.repeat else "ACTIVE")  # fmt: skip

    spec = BenchSpec(configs="channels_last", device="cpu", preset="tiny", repeats=2, predict_batches=0)
    monitor: Any = Quiet()  # sees an idle machine
    report = run_benchmark(spec, run=scripted, monitor=monitor, peak=lambda *a: PeakFlops(None, "unknown: test"))
    assert asked and set(asked) == {(1, "PASSIVE")}  # the load at the start: idle OpenMP threads sleep
    data = json.loads(json.dumps(report.to_dict(), default=str))
    assert data["machine"]["threads"]["wait_policy"] == ["ACTIVE", "PASSIVE"]  # what the runs started with
    assert data["machine"]["threads"]["threads"] == 1 and data["options"]["threads"] == 1
    assert {r["threads"] for r in data["runs"]} == {1}
    assert console_lines(report)[0] == "threads: 1 (2 cores, load 1.4)"


def test_decide_for_run_reads_the_usable_cores_of_the_machine_record() -> None:
    choice = decide_for_run(None, {"cpu_count": 8, "cpu_count_usable": 2}, probe=lambda: 0.0)
    assert (choice.cores, choice.threads) == (2, 2)


# ------------------------------------------------------------------ the machine now, not the lagging load average


@pytest.mark.parametrize(
    ("load", "sampled", "threads"),
    [
        (0.3, 1.0, 1),  # a busy loop that began seconds ago: not in the 1-minute average yet, in the sample
        (1.4, 0.0, 2),  # a load that ended seconds ago: still in the average, not in the sample (the sample decides)
        (1.4, None, 1),  # no sample (a monitor that cannot take one): the average decides
        (0.0, 2.0, 1),  # never below one
    ],
)
def test_the_sampled_busy_cores_decide_over_the_load_average(load: float, sampled: float | None, threads: int) -> None:
    choice = decide_for_run(None, {"cpu_count_usable": 2}, probe=lambda: load, other_cores=sampled)
    assert (choice.threads, choice.reason, choice.other_cores) == (threads, "auto", sampled)
    assert choice.to_dict()["other_cores"] == sampled and choice.to_dict()["load"] == load


def test_the_header_line_names_the_sampled_busy_cores() -> None:
    choice = decide_threads(2, 0.3, environ={}, other_cores=1.0)
    assert choice.line == "threads: 1 (2 cores, 1.0 busy with other work, load 0.3)"
    assert threads_line({"threads": choice.to_dict()}) == choice.line
    assert decide_threads(2, 0.3, asked=2, environ={}, other_cores=1.0).set_by_hand
    assert not choice.set_by_hand


def test_a_monitor_that_cannot_sample_leaves_the_load_average_to_decide() -> None:
    assert thread_rules.sample_other_cores(Quiet()) is None

    class Broken:
        def other_cores_now(self, window_s: float) -> float:
            raise OSError("no counters")

    assert thread_rules.sample_other_cores(Broken()) is None


def _bench_beside(monkeypatch: pytest.MonkeyPatch, others: Callable[[int], float]) -> Any:
    """A scripted bench on a scripted two-core machine: ``others(run)`` cores busy with other work during run ``n``
    (run 0: the starting sample); each run takes 10 s and keeps its threads' cores busy."""
    import lightning_perf.profiling.machine as machine_module
    from tests.profiling.test_reliability_start import Machine

    monkeypatch.setattr(thread_rules, "load_average", lambda: 0.2)  # lagging: the load began seconds ago
    described = machine_module.describe_machine()
    monkeypatch.setattr(machine_module, "describe_machine", lambda: {**described, "cpu_count_usable": 2})
    monkeypatch.setattr(machine_module, "usable_cpu_count", lambda: 2)
    machine, count = Machine(cores=2), [0]
    machine.others = others(0)

    def scripted(spec: RunSpec, tmp: Path, timeout_s: float) -> RunResult:
        count[0] += 1
        machine.others = others(count[0])
        machine.advance(10.0, {100 + count[0]: float(spec.threads or 2)})
        machine.reap(100 + count[0])
        steps = [0.2 if spec.config == "baseline" else 0.1] * 6
        return RunResult(spec={"config": spec.config, "repeat": spec.repeat, "threads": spec.threads}, batch_size=4,
                         step_median_s=steps[0], step_times_s=steps, threads=spec.threads)  # fmt: skip

    spec = BenchSpec(configs="channels_last", device="cpu", preset="tiny", repeats=2, predict_batches=0)
    monitor = ConditionMonitor(machine.probes(), sample_every_s=None)
    return run_benchmark(spec, run=scripted, monitor=monitor, peak=lambda *a: PeakFlops(None, "unknown: test"))


def test_a_steady_busy_loop_from_the_start_gets_its_core_and_disturbs_no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    report = _bench_beside(monkeypatch, lambda run: 1.0)
    data = json.loads(json.dumps(report.to_dict(), default=str))
    assert data["machine"]["threads"]["threads"] == 1 and data["machine"]["threads"]["other_cores"] == 1.0
    reliability = data["reliability"]
    assert reliability["reliable"] is True and reliability["disturbed_runs"] == []
    assert reliability["other_cores_start"] == 1.0
    assert not any("re-run" in note for note in report.notes)
    assert any(note.startswith("a steady load of 1.00 cores was present from the start") for note in report.notes)
    assert console_lines(report)[0] == "threads: 1 (2 cores, 1.0 busy with other work, load 0.2)"


def test_a_load_that_comes_after_the_start_disturbs_the_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    report = _bench_beside(monkeypatch, lambda run: 0.0 if run < 2 else 1.0)  # quiet start: two threads
    data = report.to_dict()
    assert data["machine"]["threads"]["threads"] == 2
    assert data["reliability"]["reliable"] is False
    assert data["reliability"]["causes"][0].startswith("other processes' load")
    assert any("re-run" in note for note in report.notes)


# ------------------------------------------------------------------ a load present at the start is watched first


class ScriptedLoad(Quiet):
    """A monitor whose samples read ``load(t)`` on a scripted clock that each sample's window advances (no sleep)."""

    def __init__(self, load: Callable[[float], float]) -> None:
        self.load, self.t, self.windows = load, 0.0, []

    def other_cores_now(self, window_s: float) -> float:
        self.t += window_s
        self.windows.append(window_s)
        return self.load(self.t)


@pytest.fixture
def watching(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(thread_rules, "START_WATCH_S", 60.0)  # the bench tests' conftest turns watching off


@pytest.mark.usefixtures("watching")
@pytest.mark.parametrize(
    ("load", "threads", "watched"),
    [
        (lambda t: 2.0 if t < 40 else 0.0, 2, 40.0),  # a burst that ends within the minute: the quiet choice
        (lambda t: 2.0, 1, 60.0),  # a steady load: the loaded choice, after the whole minute
        (lambda t: 0.2, 2, 0.0),  # quiet at the start: one sample, nothing watched, nothing said
    ],
)
def test_a_load_at_the_start_is_watched_for_up_to_a_minute_before_the_threads_are_chosen(
    monkeypatch: pytest.MonkeyPatch, load: Callable[[float], float], threads: int, watched: float
) -> None:
    monkeypatch.setattr(thread_rules, "load_average", lambda: 1.9)  # a lagging average: the samples decide
    said: list[str] = []
    monitor = ScriptedLoad(load)
    choice = thread_rules.choose_threads(monitor, None, {"cpu_count_usable": 2}, said.append)
    assert (choice.threads, choice.watched_s, choice.start_other_cores) == (threads, watched, load(1.0))
    assert said == ([thread_rules.WATCH_LINE] if watched else [])
    assert said[:1] in ([], ["other load at start: sampling up to 60 s before choosing threads"])
    assert monitor.windows == [1.0] + [5.0] * int(watched // 5)  # checked every 5 s, stopped at the first quiet one


@pytest.mark.usefixtures("watching")
def test_a_count_set_by_hand_is_not_watched_for() -> None:
    said: list[str] = []
    choice = thread_rules.choose_threads(ScriptedLoad(lambda t: 2.0), 2, {"cpu_count_usable": 2}, said.append)
    assert (choice.threads, choice.watched_s, choice.other_cores, said) == (2, 0.0, 2.0, [])


GONE = "the load present at the start is gone in round 1: threads 1 -> 2, the rounds so far are measured again"
WHY = "measured at 1 thread while the load present at the start lasted"


@pytest.mark.usefixtures("watching")
@pytest.mark.parametrize(
    ("load", "asked", "used", "note"),
    [
        # A burst that ends within the minute: two threads from the start, nothing set aside.
        (
            lambda t: 2.0 if t < 40 else 0.0,
            None,
            [2] * 4,
            "(2.0 cores busy, watched 40 s): the figures hold for 2 threads per worker",
        ),
        # A burst that outlasts the minute (ends at 75 s: round 1 ran from 61 to 81 s): chosen again after round 1.
        (
            lambda t: 2.0 if t < 75 else 0.0,
            None,
            [1] * 2 + [2] * 4,
            "(2.0 cores busy, watched 60 s): the figures hold for 2 threads per worker (from 1 in round 1, when it "
            "was gone: the runs before set aside)",
        ),
        # One that ends at 68 s, during round 1's first run: chosen again after that run, not after the round.
        (
            lambda t: 2.0 if t < 68 else 0.0,
            None,
            [1] + [2] * 4,
            "(2.0 cores busy, watched 60 s): the figures hold for 2 threads per worker (from 1 in round 1, when it "
            "was gone: the runs before set aside)",
        ),
        (lambda t: 2.0, None, [1] * 4, "(2.0 cores busy, watched 60 s): the figures hold for 1 thread per worker"),
        (lambda t: 2.0 if t < 5 else 0.0, 1, [1] * 4, None),  # set by hand: never watched nor chosen again
    ],
)
def test_the_bench_chooses_its_threads_again_once_when_the_start_load_is_gone(
    monkeypatch: pytest.MonkeyPatch,
    load: Callable[[float], float],
    asked: int | None,
    used: list[int],
    note: str | None,
) -> None:
    import lightning_perf.profiling.machine as machine_module

    described = machine_module.describe_machine()
    monkeypatch.setattr(machine_module, "describe_machine", lambda: {**described, "cpu_count_usable": 2})
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monitor, said, ran = ScriptedLoad(load), [], []

    def scripted(spec: RunSpec, tmp: Path, timeout_s: float) -> RunResult:
        monitor.t += 10.0  # each run takes 10 s
        ran.append((spec.threads, spec.wait_policy))
        # channels_last is 4x faster at one thread, 2x at two: a ratio from the set-aside round would not be 2.0.
        steps = [0.2 if spec.config == "baseline" else 0.05 * (spec.threads or 1)] * 6
        return RunResult(spec={"config": spec.config, "repeat": spec.repeat, "threads": spec.threads}, batch_size=4,
                         step_median_s=steps[0], step_times_s=steps, threads=spec.threads)  # fmt: skip

    spec = BenchSpec(configs="channels_last", device="cpu", preset="tiny", repeats=2, predict_batches=0, threads=asked)
    report = run_benchmark(spec, run=scripted, monitor=monitor, say=said.append,
                           peak=lambda *a: PeakFlops(None, "unknown: test"))  # fmt: skip
    data = json.loads(json.dumps(report.to_dict(), default=str))
    switched = used[0] != used[-1]
    assert [t for t, _ in ran] == used
    assert said == [thread_rules.WATCH_LINE] * (asked is None) + [GONE] * switched
    record = data["machine"]["threads"]
    assert record["threads"] == used[-1] and data["options"]["threads"] == used[-1]
    assert record["switch"] == ({"from": 1, "to": 2, "in_round": 1, "why": WHY} if switched else None)
    # Only the fresh rounds are in the figures, numbered from 0 again; the set-aside ones are named in the notes.
    assert [(r["spec"]["config"], r["spec"]["repeat"], r["threads"]) for r in data["runs"]] == [
        (c, r, used[-1]) for c in ("baseline", "channels_last") for r in (0, 1)
    ]
    row = next(s for s in report.summaries if s.config == "channels_last")
    assert row.speedup == pytest.approx(4.0 / used[-1])
    again = used.count(1) if switched else 0  # the runs measured at one thread before the switch
    assert any(n.endswith(f"re-run (disturbed, kept out of the figures): {WHY}") for n in data["notes"]) == switched
    assert any(n.startswith(f"{again} repeat{'s' * (again > 1)} re-run") for n in data["notes"]) == switched
    # Idle OpenMP threads sleep while the load is there; the quiet rounds run OpenMP's default, as training does.
    assert {p for t, p in ran[-4:]} == {"PASSIVE" if used[-1] == 1 and asked is None else None}
    assert [n.removeprefix("other load at start ") for n in data["notes"] if n.startswith("other load at start")] == (
        [note] if note else []
    )


def test_a_load_gone_only_by_the_end_says_a_quiet_re_run_may_differ() -> None:
    choice = replace(decide_threads(2, None, environ={}, other_cores=2.0), start_other_cores=2.0, watched_s=60.0)
    assert thread_rules.start_load_note(choice, ScriptedLoad(lambda t: 0.0)) == (
        "other load at start (2.0 cores busy, watched 60 s): the figures hold for 1 thread per worker; that load was "
        "gone by the end: a quiet re-run would use 2 threads and may differ"
    )
