"""Per-step phase timing that never stalls the device on the hot path.

Entry points: :class:`PhaseTimer` (host clock on CPU, CUDA events read back late on CUDA), :class:`PhaseLedger` and
:class:`HookCost` (an observer's own cost). Not thread-safe: one per thread. How CUDA events are resolved without
waiting on recent work: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import math
import statistics
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_perf._device import as_device
from lightning_perf._validation import check_int
from lightning_perf.profiling.stats import Stats, summarize

__all__ = ["HookCost", "PhaseLedger", "PhaseTimer"]

Clock = Callable[[], int]


class _PhaseAccumulator:
    """What one phase accumulated within one step: host nanoseconds, added seconds, CUDA event pairs."""

    __slots__ = ("added_s", "events", "ns")

    def __init__(self) -> None:
        self.ns = 0
        self.added_s = 0.0
        self.events: list[tuple[Any, Any]] = []


class _Phase:
    # A tiny class instead of ``contextlib.contextmanager``: this runs every step, and a generator costs more.
    __slots__ = ("_name", "_timer")

    def __init__(self, timer: PhaseTimer, name: str) -> None:
        self._timer = timer
        self._name = name

    def __enter__(self) -> None:
        self._timer.start(self._name)

    def __exit__(self, *exc_info: object) -> None:
        self._timer.stop(self._name)


class PhaseTimer:
    """Time named phases of each step, device-aware, with warm-up steps reported apart from steady state.

    A phase may run several times within a step (e.g. several ``manual_backward`` calls): its durations add up
    for that step. Different phases may nest. A step's record maps each phase that ran in it to seconds; a
    phase that did not run in a step is absent from that step's record (not zero), so :meth:`summary` describes
    the steps in which the phase occurred.

    Args:
        device: where the timed work runs; ``None`` means CUDA when available, else CPU. CUDA work is timed with
            CUDA events recorded on the current stream, anything else with ``clock``.
        warmup_steps: number of leading steps reported apart as warm-up.
        clock: a monotonic clock in integer nanoseconds; it times CPU phases and the timer's own overhead.
        max_pending_steps: on CUDA, how many closed steps may wait unresolved (see the module notes).

    Raises:
        ValueError: if ``warmup_steps`` is not an int >= 0 or ``max_pending_steps`` is not an int >= 1.
        TypeError: if ``clock`` is not callable.

    Example::

        timer = PhaseTimer(device="cpu", warmup_steps=2)
        for batch in batches:
            with timer.phase("forward"):
                loss = model(batch).sum()
            with timer.phase("backward"):
                loss.backward()
            timer.end_step()
        print(timer.summary()["forward"].median, timer.overhead_ns)
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        warmup_steps: int = 0,
        clock: Clock = time.perf_counter_ns,
        max_pending_steps: int = 16,
    ) -> None:
        check_int("PhaseTimer", "warmup_steps", warmup_steps, 0)
        check_int("PhaseTimer", "max_pending_steps", max_pending_steps, 1)
        if not callable(clock):
            raise TypeError(
                f"`PhaseTimer(clock={clock!r})` is not callable. Expected a function returning nanoseconds as int, "
                "like `time.perf_counter_ns`."
            )
        self.device = as_device(device)
        self.warmup_steps = warmup_steps
        self.max_pending_steps = max_pending_steps
        self._cuda = self.device.type == "cuda"
        self._clock = clock
        self._open: dict[str, Any] = {}  # phase -> start ns (CPU) or start event (CUDA)
        self._current: dict[str, _PhaseAccumulator] = {}
        self._num_steps = 0
        self._pending: deque[tuple[int, dict[str, _PhaseAccumulator]]] = deque()
        self._event_pool: list[Any] = []
        self._warmup_records: list[dict[str, float]] = []
        self._steady_records: list[dict[str, float]] = []
        self._overhead_records: list[int] = []  # per closed step, ns
        self._overhead_current_ns = 0

    # ----------------------------------------------------------------------------------------------------- hot path

    def start(self, name: str) -> None:
        """Start phase ``name`` in the current step.

        Raises:
            RuntimeError: if ``name`` is already running.
        """
        entry = self._clock()
        if name in self._open:
            raise RuntimeError(f"`PhaseTimer.start({name!r})`: phase {name!r} is already running. Stop it first.")
        if self._cuda:
            event = self._event_pool.pop() if self._event_pool else torch.cuda.Event(enable_timing=True)
            event.record()
            self._open[name] = event
            self._overhead_current_ns += self._clock() - entry
        else:
            # The phase starts at the last clock read, so the bookkeeping above is not billed to it.
            now = self._clock()
            self._open[name] = now
            self._overhead_current_ns += now - entry

    def stop(self, name: str) -> None:
        """Stop phase ``name``; its duration is added to the phase's total for the current step.

        Raises:
            RuntimeError: if ``name`` was not started.
        """
        entry = self._clock()  # first thing: the phase ends here, not after the bookkeeping below
        began = self._open.pop(name, None)
        if began is None:
            running = ", ".join(repr(n) for n in self._open) or "none"
            raise RuntimeError(
                f"`PhaseTimer.stop({name!r})` without a matching `start({name!r})`. Running phases: {running}."
            )
        acc = self._current.get(name)
        if acc is None:
            acc = self._current[name] = _PhaseAccumulator()
        if self._cuda:
            end = self._event_pool.pop() if self._event_pool else torch.cuda.Event(enable_timing=True)
            end.record()
            acc.events.append((began, end))
        else:
            acc.ns += entry - began
        self._overhead_current_ns += self._clock() - entry

    def phase(self, name: str) -> _Phase:
        """A context manager timing its body as phase ``name`` (stopped even if the body raises).

        Example::

            with timer.phase("forward"):
                out = model(x)
        """
        return _Phase(self, name)

    def add(self, name: str, seconds: float) -> None:
        """Add an externally measured duration to phase ``name`` in the current step.

        Raises:
            ValueError: if ``seconds`` is negative or not finite.
        """
        entry = self._clock()
        seconds = float(seconds)
        if not math.isfinite(seconds) or seconds < 0.0:
            raise ValueError(f"`PhaseTimer.add({name!r}, seconds={seconds!r})`: expected a finite number >= 0.")
        acc = self._current.get(name)
        if acc is None:
            acc = self._current[name] = _PhaseAccumulator()
        acc.added_s += seconds
        self._overhead_current_ns += self._clock() - entry

    def end_step(self) -> None:
        """Close the current step (numbered from 0) and open the next.

        Raises:
            RuntimeError: if a phase is still running; nothing is changed, so the caller may stop it and retry.
        """
        entry = self._clock()
        if self._open:
            running = ", ".join(repr(n) for n in self._open)
            raise RuntimeError(
                f"`PhaseTimer.end_step()` while phases are still running: {running}. Stop them before ending the step."
            )
        index = self._num_steps
        self._num_steps += 1
        current, self._current = self._current, {}
        if self._cuda:
            self._pending.append((index, current))
            self._resolve_completed()
        else:
            self._store(index, {name: acc.ns / 1e9 + acc.added_s for name, acc in current.items()})
        self._overhead_records.append(self._overhead_current_ns + self._clock() - entry)
        self._overhead_current_ns = 0

    # ------------------------------------------------------------------------------------------------ resolution

    def _store(self, index: int, record: dict[str, float]) -> None:
        (self._warmup_records if index < self.warmup_steps else self._steady_records).append(record)

    def _resolve(self, index: int, current: dict[str, _PhaseAccumulator]) -> None:
        record: dict[str, float] = {}
        for name, acc in current.items():
            ms = 0.0
            for began, end in acc.events:
                ms += began.elapsed_time(end)
                self._event_pool.append(began)
                self._event_pool.append(end)
            record[name] = ms / 1e3 + acc.added_s
        self._store(index, record)

    @staticmethod
    def _completed(current: dict[str, _PhaseAccumulator]) -> bool:
        return all(began.query() and end.query() for acc in current.values() for began, end in acc.events)

    def _resolve_completed(self) -> None:
        # Oldest first: stream order makes later steps finish later, so stop at the first one still running.
        while self._pending and self._completed(self._pending[0][1]):
            self._resolve(*self._pending.popleft())
        while len(self._pending) > self.max_pending_steps:
            index, current = self._pending.popleft()
            for acc in current.values():
                for began, end in acc.events:
                    began.synchronize()
                    end.synchronize()
            self._resolve(index, current)

    def finalize(self) -> None:
        """Resolve every closed step now; on CUDA at most one ``torch.cuda.synchronize``. Idempotent.

        Called by every result accessor, so calling it yourself is only needed to choose *when* the wait happens.
        The step in progress (not yet ended) is not included in any result.
        """
        synchronized = False
        while self._pending:
            if not synchronized and not self._completed(self._pending[0][1]):
                torch.cuda.synchronize(self.device)
                synchronized = True
            self._resolve(*self._pending.popleft())

    # --------------------------------------------------------------------------------------------------- results

    @property
    def num_steps(self) -> int:
        """Steps closed so far, warm-up included (resolved or not)."""
        return self._num_steps

    @property
    def pending_steps(self) -> int:
        """Closed CUDA steps whose events are not read back yet (always 0 on CPU)."""
        return len(self._pending)

    @property
    def running(self) -> tuple[str, ...]:
        """Phases started and not stopped yet, in start order."""
        return tuple(self._open)

    @property
    def steps(self) -> list[dict[str, float]]:
        """Steady-state step records, oldest first: ``{phase: seconds}`` (a copy)."""
        self.finalize()
        return [dict(record) for record in self._steady_records]

    @property
    def warmup_steps_records(self) -> list[dict[str, float]]:
        """Warm-up step records, oldest first: ``{phase: seconds}`` (a copy)."""
        self.finalize()
        return [dict(record) for record in self._warmup_records]

    def recent_steps(self, count: int) -> list[dict[str, float]]:
        """The last ``count`` step records already read back, oldest first, warm-up included, without waiting.

        Unlike every other accessor this never synchronizes: on CUDA it leaves out the closed steps whose events the
        device has not reached yet, so live reporting (a progress bar, a logger) can call it every few steps.
        """
        if count <= 0:
            return []
        recent = self._steady_records[-count:]
        if len(recent) < count:
            recent = self._warmup_records[len(recent) - count :] + recent
        return [dict(record) for record in recent]

    def _records(self, warmup: bool) -> list[dict[str, float]]:
        self.finalize()
        return self._warmup_records if warmup else self._steady_records

    def summary(self, warmup: bool = False) -> dict[str, Stats]:
        """Statistics per phase over the steady-state steps (or the warm-up steps) in which it ran.

        Args:
            warmup: summarize the warm-up steps instead.

        Returns:
            ``{phase: Stats}`` in seconds, phases in order of first appearance; empty when no step was closed.
        """
        return _phase_stats(self._records(warmup))

    def step_totals(self, warmup: bool = False, phases: Sequence[str] | None = None) -> list[float]:
        """Per step, the sum of its phase durations in seconds.

        Args:
            warmup: use the warm-up steps instead of steady state.
            phases: which phases to add up (default: all). Pass the top-level ones when phases nest, or nested time
                is counted twice.
        """
        wanted = None if phases is None else set(phases)
        return [
            math.fsum(s for name, s in record.items() if wanted is None or name in wanted)
            for record in self._records(warmup)
        ]

    @property
    def overhead_ns(self) -> int:
        """Total host time spent inside this timer's methods so far, in nanoseconds (all steps and the open one)."""
        return sum(self._overhead_records) + self._overhead_current_ns

    def overhead_per_step_ns(self, warmup: bool = False) -> Stats:
        """Statistics of the timer's own cost per closed step, in nanoseconds (steady state unless ``warmup``)."""
        split = min(self.warmup_steps, len(self._overhead_records))
        return summarize(self._overhead_records[:split] if warmup else self._overhead_records[split:])

    def to_dict(self) -> dict[str, Any]:
        """Everything measured, as plain JSON-ready data (NaN in empty statistics; ``write_json`` writes null)."""
        self.finalize()
        return {
            "device": str(self.device),
            "warmup_steps": self.warmup_steps,
            "num_steps": self._num_steps,
            "summary": {name: stats.to_dict() for name, stats in self.summary().items()},
            "warmup_summary": {name: stats.to_dict() for name, stats in self.summary(warmup=True).items()},
            "steps": self.steps,
            "warmup": self.warmup_steps_records,
            "overhead": {"total_ns": self.overhead_ns, "per_step_ns": self.overhead_per_step_ns().to_dict()},
        }

    def __getstate__(self) -> dict[str, Any]:
        # CUDA events cannot travel between processes: read everything back first and drop the spare ones.
        self.finalize()
        state = self.__dict__.copy()
        state["_event_pool"] = []
        return state

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(device={str(self.device)!r}, warmup_steps={self.warmup_steps}, "
            f"num_steps={self._num_steps})"
        )


class PhaseLedger:
    """Phases that follow one another within each step (never nested), on the host clock: one clock read per boundary.

    The cheap CPU twin of :class:`PhaseTimer` for an observer on the hot path of every step: :meth:`switch` reads the
    clock once and bills the time since the last boundary to the phase that was running; a step's totals are kept in
    a preallocated list and appended to typed arrays at :meth:`end_step`, so a steady step makes no Python object that
    outlives it. Time in the step outside every named phase (``switch(..., None)``) counts in ``"step"`` only; between
    :meth:`close` and the next :meth:`open` nothing is counted. Records and statistics read like :class:`PhaseTimer`'s
    (``{phase: seconds}`` per step, ``"step"`` included), built when asked for.

    Args:
        phases: the phase names, in any order.
        warmup_steps: number of leading steps reported apart as warm-up.
        clock: a monotonic clock in integer nanoseconds.

    Example::

        ledger = PhaseLedger(["data", "forward"])
        ledger.open("data")
        for batch in loader:
            ledger.switch("forward")
            model(batch)
            ledger.end_step("data")  # the wait for the next batch starts at the same clock read
    """

    def __init__(self, phases: Sequence[str], warmup_steps: int = 0, clock: Clock = time.perf_counter_ns) -> None:
        self.phases = tuple(phases)
        self.device = torch.device("cpu")
        self.warmup_steps = warmup_steps
        self._clock = clock
        n = len(self.phases)
        self._index: dict[str | None, int] = {name: i for i, name in enumerate(self.phases)}
        self._index[None] = n  # in the step, no named phase
        self._stopped = n + 1  # not counted
        self._acc = [0] * (n + 2)
        self._zeros = [0] * (n + 2)
        self._current = self._stopped
        self._ran = 0
        self._last = 0
        self._ns = array("q")  # per step, the totals of _acc (the last slot, not counted, left out of every figure)
        self._ran_masks = array("q")
        self._num_steps = 0

    def open(self, phase: str | None) -> int:
        """Start (or restart after :meth:`close`) the step's clock in ``phase``; returns the clock read."""
        now = self._last = self._clock()
        self._current = index = self._index[phase]
        self._ran |= 1 << index
        return now

    def switch(self, phase: str | None) -> int:
        """Bill the time since the last boundary to the running phase and run ``phase``; returns the clock read."""
        now = self._clock()
        self._acc[self._current] += now - self._last
        self._last = now
        self._current = index = self._index[phase]
        self._ran |= 1 << index
        return now

    def close(self) -> int:
        """Stop the step's clock without ending the step (an interruption); returns the clock read."""
        now = self.switch(None)
        self._current = self._stopped
        return now

    def end_step(self, then: str | None = None) -> int:
        """Close the step; with ``then``, the next step's clock starts in that phase at the same clock read."""
        now = self._clock()  # inlines close(): this runs at the end of every timed step
        acc = self._acc
        acc[self._current] += now - self._last
        self._ns.extend(acc)
        acc[:] = self._zeros
        self._ran_masks.append(self._ran)
        self._num_steps += 1
        if then is None:
            self._current, self._ran = self._stopped, 0
        else:
            self._current = index = self._index[then]
            self._ran, self._last = 1 << index, now
        return now

    # --------------------------------------------------------------------------------------------------- results

    def _record(self, step: int) -> dict[str, float]:
        width = len(self.phases) + 2
        row = self._ns[step * width : (step + 1) * width - 1]
        ran = self._ran_masks[step]
        record = {name: row[i] / 1e9 for i, name in enumerate(self.phases) if ran >> i & 1}
        record["step"] = sum(row) / 1e9
        return record

    @property
    def num_steps(self) -> int:
        """Steps closed so far, warm-up included."""
        return self._num_steps

    @property
    def steps(self) -> list[dict[str, float]]:
        """Steady-state step records, oldest first: ``{phase: seconds}``, ``"step"`` included."""
        return [self._record(i) for i in range(min(self.warmup_steps, self._num_steps), self._num_steps)]

    @property
    def warmup_steps_records(self) -> list[dict[str, float]]:
        """Warm-up step records, oldest first."""
        return [self._record(i) for i in range(min(self.warmup_steps, self._num_steps))]

    def recent_steps(self, count: int) -> list[dict[str, float]]:
        """The last ``count`` step records, oldest first, warm-up included."""
        return [self._record(i) for i in range(max(0, self._num_steps - max(count, 0)), self._num_steps)]

    def recent_totals(self, count: int) -> tuple[dict[str, int], int]:
        """Nanoseconds by phase summed over the last ``count`` steps (warm-up included; ``"other"``: the steps' time
        outside every phase), and how many steps that is: what :meth:`recent_steps` would add up, with no record."""
        width, steps = len(self.phases) + 2, min(max(count, 0), self._num_steps)
        rows = self._ns[(self._num_steps - steps) * width : self._num_steps * width]
        totals = {name: sum(rows[i::width]) for i, name in enumerate(self.phases)}
        totals["other"] = sum(rows[width - 2 :: width])
        return totals, steps

    def summary(self, warmup: bool = False) -> dict[str, Stats]:
        """Statistics per phase over the steady-state steps (or the warm-up steps) in which it ran."""
        return _phase_stats(self.warmup_steps_records if warmup else self.steps)


def _phase_stats(records: Sequence[dict[str, float]]) -> dict[str, Stats]:
    """Statistics per phase over the step records in which it ran, phases in order of first appearance."""
    values: dict[str, list[float]] = {}
    for record in records:
        for name, seconds in record.items():
            values.setdefault(name, []).append(seconds)
    return {name: summarize(v) for name, v in values.items()}


class _Flag:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def call(self) -> bool:
        self.n += 1
        return True


_QUIET_NS: list[float] = []


def quiet_call_ns() -> float:
    """What a quiet call costs (a method call that reads a flag and counts): timed once per process, the median of
    five loops of 2,000 calls."""
    if not _QUIET_NS:
        flag, loops = _Flag(), []
        for _ in range(5):
            start = time.perf_counter_ns()
            for _ in range(2000):
                flag.call()
            loops.append((time.perf_counter_ns() - start) / 2000)
        _QUIET_NS.append(statistics.median(loops))
    return _QUIET_NS[0]


class HookCost:
    """What an observer's own hooks cost in steady state, without timing every one: each call counted, one routine step
    in ``every`` timed end to end, every call of a *heavy* step (one that reads or computes more than a counter:
    the observer says which when the step begins) timed end to end, plus ``dispatch_ns``, what the caller's framework
    spends to call one hook (measured once by the caller, e.g. Lightning's callback loop on an empty hook).

    Steps before ``first`` are warm-up: their calls are counted apart (``warmup_hook_calls``) and left out of the
    steady figures, so that the share compares with a step time measured after warm-up. Calls made before the first
    :meth:`step` count as warm-up too.

    Hot path: ``entry = cost.begin()`` first thing in a hook and ``cost.end(entry)`` last: two clock reads on a timed
    step (:attr:`timing`, set by :meth:`step`), none on the others. ``every`` is best prime, so that the periodically
    timed steps fall evenly on the steps of any period of the observer (every 10th, every 4th...). Heavy steps are
    timed whole because they are rare and dear: sampling one routine step in ``every`` would miss them or, hitting
    one, bill its cost to every step.

    Example::

        cost = HookCost(every=17)
        for step, batch in enumerate(loader):
            cost.step(step, heavy=step % 50 == 0)
            entry = cost.begin()
            ...  # the observer's hook
            cost.end(entry)
        print(cost.figures(steps, step_s)["share_of_step"])
    """

    __slots__ = (
        "bodies",
        "calls",
        "counter_bodies",
        "counter_calls",
        "dispatch_ns",
        "every",
        "first",
        "heavy",
        "heavy_calls",
        "heavy_ns",
        "quiet_calls",
        "quiet_ns",
        "reading_calls",
        "reading_ns",
        "steady",
        "timed_calls",
        "timed_ns",
        "timing",
        "warmup_calls",
    )  # fmt: skip

    BODIES = 256  # the last routine bodies kept (preallocated ring): their median is the routine call's cost

    def __init__(self, every: int = 17, first: int = 0, dispatch_ns: float = 0.0) -> None:
        self.every, self.first, self.dispatch_ns = every, first, dispatch_ns
        self.calls = self.timed_calls = self.timed_ns = self.heavy_calls = self.heavy_ns = self.warmup_calls = 0
        self.quiet_calls = 0  # calls on steps the observer skips (sampling): a flag read, no framework dispatch
        self.quiet_ns = quiet_call_ns()
        self.bodies = array("q", bytes(8 * self.BODIES))
        self.counter_calls = 0  # of the quiet calls, a skipped step's counter (see `quiet_step`)
        self.reading_calls = self.reading_ns = 0  # of the quiet calls, those that also read something (timed whole)
        self.counter_bodies = array("q", bytes(8 * self.BODIES))
        self.timing = self.heavy = self.steady = False

    def pause(self) -> None:
        """The observer skips the steps to come (sampling): nothing is timed until the next :meth:`step`. A call that
        began timed before the pause is still billed as its step was (heavy or routine) when it ends."""
        self.timing = False

    def step(self, index: int, heavy: bool = False) -> None:
        """Step ``index`` begins: from :attr:`first` on, it is timed whole if ``heavy``, else if it is one in
        :attr:`every`."""
        self.steady = steady = index >= self.first
        self.heavy = heavy and steady
        self.timing = steady and (heavy or (index - self.first) % self.every == 0)

    def begin(self) -> int:
        """A hook starts: the clock on a timed step, else 0."""
        return time.perf_counter_ns() if self.timing else 0

    def end(self, entry: int) -> None:
        """The hook that began with ``entry`` (from :meth:`begin`) ends: counted, and timed if ``entry``."""
        if entry:
            self.add(entry)
        elif self.steady:
            self.calls += 1
        else:
            self.warmup_calls += 1

    def add(self, entry_ns: int) -> None:
        """Count a call of a timed step that began at ``entry_ns`` (``time.perf_counter_ns``) and ends now."""
        elapsed = time.perf_counter_ns() - entry_ns
        self.calls += 1
        if self.heavy:
            self.heavy_ns += elapsed
            self.heavy_calls += 1
        else:
            self.bodies[self.timed_calls % self.BODIES] = elapsed
            self.timed_ns += elapsed
            self.timed_calls += 1

    def quiet_step(self, entry_ns: int, steady: bool = True, reads: bool = False) -> None:
        """A skipped step's counter (the observer's one call on such a step that does more than read a flag, e.g. an
        optimizer's step post-hook) ends; it began at ``entry_ns`` (``time.perf_counter_ns``). A quiet call; one in 16
        is timed, and all are billed at the median of those (:meth:`counter_body_ns`): in a running fit, cold caches
        make it cost several times what a warm loop measures (:func:`quiet_call_ns`). A warm-up step's (not
        ``steady``) is left out; one that ``reads`` something (a dearer call on some of those steps, e.g. one in 8) is
        timed whole, apart."""
        if not steady:
            return
        self.quiet_calls += 1
        if reads:
            self.reading_calls += 1
            self.reading_ns += time.perf_counter_ns() - entry_ns
            return
        n = self.counter_calls = self.counter_calls + 1
        if not n & 15:
            self.counter_bodies[((n >> 4) - 1) % self.BODIES] = time.perf_counter_ns() - entry_ns

    def counter_body_ns(self) -> float:
        """The median timed :meth:`quiet_step` call, else (none timed yet) :attr:`quiet_ns`."""
        n = min(self.counter_calls >> 4, self.BODIES)
        return float(statistics.median(self.counter_bodies[:n])) if n else self.quiet_ns

    def body_ns(self) -> float:
        """A routine call's body: the median of the last :attr:`BODIES` timed ones (a rare interruption, such as a
        garbage collection inside a timed call, would otherwise be billed to every call)."""
        n = min(self.timed_calls, self.BODIES)
        return float(statistics.median(self.bodies[:n])) if n else 0.0

    def total_ns(self) -> float:
        """The estimated cost of every steady call: heavy calls as timed, routine calls x their median timed body,
        the dispatch of every call; quiet calls (:attr:`quiet_calls`) x a flag check's cost (:func:`quiet_call_ns`),
        without dispatch, but a skipped step's counters (:meth:`quiet_step`) x their median timed call."""
        routine, flags = self.calls - self.heavy_calls, self.quiet_calls - self.counter_calls - self.reading_calls
        return (
            self.heavy_ns
            + self.reading_ns
            + routine * self.body_ns()
            + self.calls * self.dispatch_ns
            + flags * self.quiet_ns
            + self.counter_calls * self.counter_body_ns()
        )

    def figures(self, steps: int, step_s: float) -> dict[str, Any]:
        """The report's ``overhead`` over ``steps`` steady steps of mean ``step_s``: the estimate per step and as a
        share of ``step_s``, with how it was made. With sampling, ``steps`` counts every steady step run, the skipped
        ones too: the cost is an average over all steps, as an outside measurement sees it."""
        total = self.total_ns()
        per_step = total / steps if steps > 0 else math.nan
        return {
            "hook_calls": self.calls,
            "quiet_calls": self.quiet_calls,
            "warmup_hook_calls": self.warmup_calls,
            "timed_calls": self.timed_calls,
            "heavy_calls": self.heavy_calls,
            "hook_body_ns_mean": self.timed_ns / self.timed_calls if self.timed_calls else math.nan,
            "hook_body_ns": self.body_ns() if self.timed_calls else math.nan,
            "quiet_call_ns": self.quiet_ns,
            "quiet_counter_calls": self.counter_calls,
            "quiet_counter_ns": self.counter_body_ns(),
            "quiet_reading_calls": self.reading_calls,
            "quiet_reading_ns_total": self.reading_ns,
            "heavy_ns_total": self.heavy_ns,
            "dispatch_ns_per_call": self.dispatch_ns,
            "hooks_ns_total": total,
            "hooks_ns_per_step": per_step,
            "steady_steps": steps,
            "share_of_step": (per_step / 1e9) / step_s if step_s > 0 else math.nan,
            "method": f"steady steps (from step {self.first}): every hook call counted; heavy steps timed whole, one "
            f"routine step in {self.every} timed end to end, billed at the median body; the framework's dispatch "
            "of one call timed on an empty hook (at setup, or sampled in the loop where the observer says so) and "
            "billed to every hook call; quiet calls (skipped steps) billed a flag check's cost, plus a dispatch "
            "where the framework still calls the hook, and a skipped step's counter one in 16 timed, billed at "
            "their median (those that read something timed whole)",
        }
