"""PhaseTimer: exact timings from an injected clock, warm-up apart, repeated phases, errors, lazy CUDA resolution."""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Iterable

import pytest
import torch

from lightning_perf.profiling import PhaseTimer
from lightning_perf.profiling.report import to_jsonable

MS = 1_000_000  # ns


class FakeClock:
    """A clock the test drives: returns ``now``, then advances it by ``tick`` (0: time stands still)."""

    def __init__(self, tick: int = 0) -> None:
        self.now = 0
        self.tick = tick

    def __call__(self) -> int:
        value = self.now
        self.now += self.tick
        return value


def scripted(values: Iterable[int]):
    """A clock returning exactly ``values``, one per call; running out fails the test."""
    it = iter(values)
    return lambda: next(it)


def run_phase(timer: PhaseTimer, clock: FakeClock, name: str, duration_ns: int) -> None:
    timer.start(name)
    clock.now += duration_ns
    timer.stop(name)


def cpu_timer(clock: FakeClock, **kwargs) -> PhaseTimer:
    return PhaseTimer(device="cpu", clock=clock, **kwargs)


def test_one_phase_is_timed_exactly() -> None:
    clock = FakeClock()
    timer = cpu_timer(clock)
    run_phase(timer, clock, "forward", 3 * MS)
    timer.end_step()
    assert timer.steps == [{"forward": 0.003}]
    assert timer.num_steps == 1
    timer.steps[0]["forward"] = 99.0  # results are copies
    assert timer.steps == [{"forward": 0.003}]


def test_warmup_steps_are_kept_apart() -> None:
    clock = FakeClock()
    timer = cpu_timer(clock, warmup_steps=2)
    for ms in (100, 90, 10, 20, 30):
        run_phase(timer, clock, "step", ms * MS)
        timer.end_step()
        if ms == 90:  # all steps are warm-up until warm-up ends
            assert timer.steps == [] and timer.summary() == {} and timer.step_totals() == []
    assert timer.warmup_steps_records == [{"step": 0.1}, {"step": 0.09}]
    assert timer.steps == [{"step": 0.01}, {"step": 0.02}, {"step": 0.03}]
    steady = timer.summary()["step"]
    assert steady.count == 3
    assert steady.median == pytest.approx(0.02)
    assert timer.summary(warmup=True)["step"].median == pytest.approx(0.095)


def test_a_phase_repeated_in_a_step_adds_up() -> None:
    # e.g. two `manual_backward` calls within one training step, nested in an outer "step" phase
    clock = FakeClock()
    timer = cpu_timer(clock)
    timer.start("step")
    run_phase(timer, clock, "backward", 3 * MS)
    clock.now += MS
    run_phase(timer, clock, "backward", 4 * MS)
    timer.stop("step")
    timer.end_step()
    run_phase(timer, clock, "backward", 5 * MS)
    timer.end_step()
    (first, second) = timer.steps
    assert first == {"backward": pytest.approx(0.007), "step": pytest.approx(0.008)}
    assert second == {"backward": pytest.approx(0.005)}
    stats = timer.summary()
    assert stats["backward"].count == 2
    assert stats["step"].count == 1  # absent from the second step, not counted as zero there
    assert timer.step_totals(phases=["backward"]) == pytest.approx([0.007, 0.005])
    assert timer.step_totals() == pytest.approx([0.015, 0.005])


def test_phase_context_manager_stops_even_when_the_body_raises() -> None:
    clock = FakeClock()
    timer = cpu_timer(clock)
    with pytest.raises(KeyError), timer.phase("forward"):
        clock.now += 2 * MS
        raise KeyError("boom")
    assert timer.running == ()
    timer.end_step()
    assert timer.steps == [{"forward": pytest.approx(0.002)}]


def test_add_records_an_external_duration_in_the_current_step() -> None:
    clock = FakeClock()
    timer = cpu_timer(clock)
    run_phase(timer, clock, "data", 1 * MS)
    timer.add("data", 0.5)
    timer.add("compile", 2.0)
    timer.end_step()
    assert timer.steps == [{"data": pytest.approx(0.501), "compile": 2.0}]


@pytest.mark.parametrize("seconds", [-0.1, math.nan, math.inf])
def test_add_refuses_impossible_durations(seconds: float) -> None:
    timer = cpu_timer(FakeClock())
    with pytest.raises(ValueError, match="seconds="):
        timer.add("x", seconds)


def test_misuse_is_a_clear_error_and_end_step_with_a_running_phase_changes_nothing() -> None:
    clock = FakeClock()
    timer = cpu_timer(clock)
    timer.start("forward")
    with pytest.raises(RuntimeError, match=r"stop\('backward'\).*without a matching.*Running phases: 'forward'"):
        timer.stop("backward")
    with pytest.raises(RuntimeError, match="already running"):
        timer.start("forward")
    clock.now += MS
    with pytest.raises(RuntimeError, match="still running: 'forward'"):
        timer.end_step()
    assert timer.num_steps == 0
    clock.now += MS
    timer.stop("forward")
    timer.end_step()
    assert timer.steps == [{"forward": pytest.approx(0.002)}]


_BAD = {"warmup_steps": (-1, 1.5, True, "2", None), "max_pending_steps": (0, -3, 2.0), "clock": (123,)}


@pytest.mark.parametrize(("name", "bad"), [(name, value) for name, values in _BAD.items() for value in values])
def test_bad_arguments_are_named(name: str, bad: object) -> None:
    """warmup_steps: an int >= 0; max_pending_steps: an int >= 1; clock: a callable (TypeError)."""
    with pytest.raises(TypeError if name == "clock" else ValueError, match=rf"PhaseTimer\({name}={bad!r}\)"):
        PhaseTimer(device="cpu", **{name: bad})


def test_phase_excludes_the_timers_own_bookkeeping_and_overhead_is_counted() -> None:
    # start reads the clock on entry and exit and starts the phase at the exit read; stop ends it at its entry read.
    clock = scripted([0, 10, 110, 115, 200, 203, 300, 301, 401, 402, 500, 502])
    timer = PhaseTimer(device="cpu", warmup_steps=1, clock=clock)
    timer.start("forward")  # 0 .. 10
    timer.stop("forward")  # 110 .. 115
    timer.end_step()  # 200 .. 203
    timer.start("forward")  # 300 .. 301
    timer.stop("forward")  # 401 .. 402
    timer.end_step()  # 500 .. 502
    assert timer.warmup_steps_records == [{"forward": 100e-9}]
    assert timer.steps == [{"forward": 100e-9}]
    assert timer.overhead_ns == (10 + 5 + 3) + (1 + 1 + 2)
    assert timer.overhead_per_step_ns(warmup=True).median == 18
    assert timer.overhead_per_step_ns().median == 4
    assert timer.overhead_per_step_ns().count == 1


def test_overhead_of_the_open_step_is_in_the_total() -> None:
    timer = cpu_timer(FakeClock(tick=1))
    timer.start("a")
    timer.stop("a")
    assert timer.overhead_ns == 2
    assert timer.overhead_per_step_ns().count == 0


def test_to_dict_is_json_ready() -> None:
    clock = FakeClock()
    timer = cpu_timer(clock, warmup_steps=1)
    for ms in (5, 1, 2):
        run_phase(timer, clock, "step", ms * MS)
        timer.end_step()
    data = timer.to_dict()
    assert data["device"] == "cpu"
    assert data["num_steps"] == 3
    assert data["summary"]["step"]["median"] == pytest.approx(0.0015)
    assert data["warmup"] == [{"step": 0.005}]
    assert set(data["overhead"]) == {"total_ns", "per_step_ns"}
    json.dumps(to_jsonable(data), allow_nan=False)  # the empty-summary NaNs become null


def test_cpu_timer_pickles() -> None:
    clock_timer = PhaseTimer(device="cpu")  # the default clock is a builtin, which pickles
    clock_timer.start("a")
    clock_timer.stop("a")
    clock_timer.end_step()
    copy = pickle.loads(pickle.dumps(clock_timer))
    assert copy.steps == clock_timer.steps


# ------------------------------------------------------------------------------------ CUDA logic, with fake events


class FakeDevice:
    """A device that runs behind the host: events complete only when the test says so."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.recorded = 0
        self.completed = 0
        self.events_created = 0
        self.event_waits = 0
        self.device_syncs = 0


class FakeEvent:
    """Stands in for ``torch.cuda.Event``: ``query`` never blocks, ``elapsed_time`` needs both events complete."""

    device: FakeDevice

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "a timing event must be created with enable_timing=True"
        self.device.events_created += 1
        self.seq = 0
        self.time_ms = math.nan

    def record(self, stream: object = None) -> None:
        self.device.recorded += 1
        self.seq = self.device.recorded
        self.time_ms = self.device.now_ms

    def query(self) -> bool:
        return 0 < self.seq <= self.device.completed

    def synchronize(self) -> None:
        self.device.event_waits += 1
        self.device.completed = max(self.device.completed, self.seq)

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("cudaErrorNotReady: the fake device has not reached this event")
        return end.time_ms - self.time_ms


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeDevice:
    device = FakeDevice()

    def synchronize(dev: object = None) -> None:
        device.device_syncs += 1
        device.completed = device.recorded

    monkeypatch.setattr(FakeEvent, "device", device, raising=False)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return device


def cuda_step(timer: PhaseTimer, device: FakeDevice, phases: dict[str, float]) -> None:
    for name, ms in phases.items():
        timer.start(name)
        device.now_ms += ms
        timer.stop(name)
    timer.end_step()


def test_cuda_steps_stay_pending_without_any_synchronize(fake_cuda: FakeDevice) -> None:
    timer = PhaseTimer(device="cuda", warmup_steps=1, clock=FakeClock())
    for ms in (50.0, 2.0, 4.0, 6.0):
        cuda_step(timer, fake_cuda, {"forward": ms, "backward": 2 * ms})
    assert timer.pending_steps == 4
    assert fake_cuda.device_syncs == 0
    assert fake_cuda.event_waits == 0
    # Asking for results resolves everything with a single synchronize.
    assert timer.steps == [{"forward": 0.002 * i, "backward": 0.004 * i} for i in (1, 2, 3)]
    assert timer.warmup_steps_records == [{"forward": 0.05, "backward": 0.1}]
    assert fake_cuda.device_syncs == 1
    timer.finalize()
    timer.summary()
    assert fake_cuda.device_syncs == 1
    assert timer.pending_steps == 0


def test_cuda_completed_steps_resolve_at_end_step(fake_cuda: FakeDevice) -> None:
    timer = PhaseTimer(device="cuda", clock=FakeClock())
    cuda_step(timer, fake_cuda, {"forward": 1.0})
    cuda_step(timer, fake_cuda, {"forward": 2.0})
    fake_cuda.completed = fake_cuda.recorded  # the device caught up with both steps
    cuda_step(timer, fake_cuda, {"forward": 3.0})  # its own events are not done yet
    assert timer.pending_steps == 1
    assert fake_cuda.device_syncs == 0
    assert timer._steady_records == [{"forward": 0.001}, {"forward": 0.002}]


def test_cuda_pending_steps_are_bounded_by_waiting_on_the_oldest_only(fake_cuda: FakeDevice) -> None:
    timer = PhaseTimer(device="cuda", clock=FakeClock(), max_pending_steps=2)
    for _ in range(5):
        cuda_step(timer, fake_cuda, {"forward": 1.0})
    assert timer.pending_steps == 2
    assert fake_cuda.device_syncs == 0
    assert fake_cuda.event_waits > 0
    assert fake_cuda.completed < fake_cuda.recorded  # the recent steps were never waited for
    assert len(timer.steps) == 5


def test_cuda_events_are_reused_once_read(fake_cuda: FakeDevice) -> None:
    timer = PhaseTimer(device="cuda", clock=FakeClock())
    for _ in range(50):
        cuda_step(timer, fake_cuda, {"forward": 1.0, "backward": 1.0})
        fake_cuda.completed = fake_cuda.recorded
    assert fake_cuda.events_created <= 8
    assert len(timer.steps) == 50


def test_cuda_add_and_repeated_phases(fake_cuda: FakeDevice) -> None:
    timer = PhaseTimer(device="cuda", clock=FakeClock())
    for ms in (1.0, 3.0):
        timer.start("backward")
        fake_cuda.now_ms += ms
        timer.stop("backward")
    timer.add("backward", 0.5)
    timer.end_step()
    assert timer.steps == [{"backward": pytest.approx(0.504)}]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_events_never_synchronize_during_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    real_synchronize = torch.cuda.synchronize
    calls: list[object] = []

    def counting_synchronize(device: torch.device | str | int | None = None) -> None:
        calls.append(device)
        real_synchronize(device)

    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    monkeypatch.setattr(torch.cuda, "synchronize", counting_synchronize)
    timer = PhaseTimer(device="cuda", warmup_steps=1)
    for _ in range(6):
        with timer.phase("matmul"):
            y = x @ x
        with timer.phase("relu"):
            y.relu_()
        timer.end_step()
    assert calls == []
    steps = timer.steps
    assert len(calls) <= 1
    assert len(steps) == 5
    assert all(record["matmul"] > 0 and record["relu"] > 0 for record in steps)
    assert timer.pending_steps == 0


def test_recent_steps_span_warmup_and_steady_state_without_waiting(fake_cuda: FakeDevice) -> None:
    timer = PhaseTimer(device="cuda", warmup_steps=2, clock=FakeClock())
    for ms in (1.0, 2.0, 3.0):
        cuda_step(timer, fake_cuda, {"forward": ms})
    assert timer.recent_steps(5) == []  # nothing read back yet, and asking does not wait
    fake_cuda.completed = fake_cuda.recorded
    cuda_step(timer, fake_cuda, {"forward": 4.0})  # resolves the three finished steps; its own is pending
    assert fake_cuda.device_syncs == 0
    assert timer.recent_steps(2) == [{"forward": 0.002}, {"forward": 0.003}]
    assert timer.recent_steps(10) == [{"forward": 0.001}, {"forward": 0.002}, {"forward": 0.003}]
    assert timer.recent_steps(0) == []
    assert fake_cuda.device_syncs == 0 and timer.pending_steps == 1
