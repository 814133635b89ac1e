"""Whether a measurement can be trusted: what else ran on the machine while it went, and how much it scattered.

Entry points: :class:`ConditionMonitor` (read around every measured run, with a :class:`LoadSampler` thread),
:func:`assess` (the :class:`Reliability` verdict with its causes), :func:`other_cores_limit`, and :class:`Probes`
(replaceable in tests). What is recorded and how a starting load is judged: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "FREQUENCY_MIN_SHARE",
    "LOAD_PER_CORE_MAX",
    "OTHER_CORES_MAX",
    "OUTLIER_FACTOR",
    "OUTLIER_SHARE_MAX",
    "PEAK_MARGIN",
    "PEAK_WINDOW_S",
    "REPEAT_SPREAD_MAX",
    "SAMPLE_EVERY_S",
    "STEAL_SHARE_MAX",
    "ConditionMonitor",
    "LoadSampler",
    "Probes",
    "Reliability",
    "RunConditions",
    "assess",
    "other_cores_limit",
]

OTHER_CORES_MAX = 0.25
"""Other processes may take this many cores on average beyond the cores the bench leaves free. A quarter of a busy
core on a core our threads use costs about a quarter of that core's time slices: enough to move a step time by several
percent, the size of the differences a bench is asked to tell apart."""
PEAK_WINDOW_S = 5.0
"""The window of the peak load within a run: long enough to hold several one-second samples (one sample is as noisy
as the scheduler's accounting), short enough that a burst of a few seconds is not averaged away by a long run."""
PEAK_MARGIN = 0.5
"""A run's busiest window may exceed the run's threshold by this many cores before it counts: a short job (a process
starting, a shell command) of two seconds on one core raises a 5-s window by 0.4 cores and barely moves the run;
half a core more over five seconds is a load that took time slices from the run."""
SAMPLE_EVERY_S = 1.0
"""How often the sampler reads the counters during a run: about a millisecond of this idle process's time per
reading, nothing in the worker."""
START_ROUNDING = 0.5
"""The automatic thread choice rounds the starting load to whole cores (:mod:`lightning_perf.benchmark.threads`), so
a starting load up to half a core above the cores it left free was made room for; a larger one was not (it keeps one
thread at least)."""
STEADY_NOTE_MIN = 0.5
"""A starting load of half a core or more is named in the results (the thread choice counted it as a core)."""
STEAL_SHARE_MAX = 0.02
"""Steal time above 2% of the CPU time means the hypervisor is giving our cores to other guests: invisible from
inside, and as disturbing as a local process."""
LOAD_PER_CORE_MAX = 1.5
"""A 1-minute load average above 1.5 runnable threads per core means threads wait for a core (ours included: one
worker with its threads is about one per core)."""
FREQUENCY_MIN_SHARE = 0.7
"""A CPU clocked below 70% of its maximum during a run (thermal or power limits) runs every step proportionally
slower, and not evenly across configurations."""
REPEAT_SPREAD_MAX = 0.25
"""Per-repeat medians of one configuration more than 25% apart ((max - min) / median): the repeats disagree beyond
what a quiet machine shows (a few percent), so the comparison carries the disturbance, whatever its source."""
OUTLIER_FACTOR = 2.0
OUTLIER_SHARE_MAX = 0.1
"""More than 10% of a configuration's steady-state steps took over twice their repeat's median: the steps were
interrupted (preemption, page faults, another process), not merely noisy."""


RUN_STARTERS: set[int] = set()
"""Processes that start this process's measured runs for it (the bench's fork server,
:mod:`lightning_perf.benchmark.isolation`): their CPU time and their children's is this process's own."""


@dataclass(frozen=True)
class Probes:
    """Where the monitor reads the machine's counters (replaced in tests).

    Attributes:
        clock: seconds, monotonic.
        system_cpu: cumulative ``(busy_s, steal_s)`` of the whole machine, all cores summed.
        own_cpu: cumulative CPU seconds of this process and its reaped children, and of each process in
            :data:`RUN_STARTERS` with its reaped children and live descendants (a measured run's worker is started
            after the first reading and reaped, by this process or by the bench's fork server, before the second, so
            its whole CPU time falls in the difference; a child still running, such as a process the caller started
            beside the bench, counts as another process).
        load_average: the 1-minute load average, or ``None``.
        frequency: ``(current_mhz, max_mhz)``, or ``None``.
        cpu_count: logical CPUs.
        tree_cpu: ``(this process's CPU seconds, {pid: CPU seconds} of each live descendant)`` for the sampler during
            a run (``None``: no sampling, no peak).
        wait: sleeps the given seconds, for :meth:`ConditionMonitor.other_cores_now` (``None``: no starting sample).
    """

    clock: Callable[[], float]
    system_cpu: Callable[[], tuple[float, float]]
    own_cpu: Callable[[], float]
    load_average: Callable[[], float | None]
    frequency: Callable[[], tuple[float, float] | None]
    cpu_count: Callable[[], int]
    tree_cpu: Callable[[], tuple[float, dict[int, float]]] | None = None
    wait: Callable[[float], None] | None = None

    @classmethod
    def system(cls) -> Probes:
        """The real probes (psutil and ``os``); each degrades to ``None``/0 where the platform has no counter."""
        import psutil

        me = psutil.Process()

        def system_cpu() -> tuple[float, float]:
            t = psutil.cpu_times()
            busy = sum(getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))
            return busy, getattr(t, "steal", 0.0)

        def cpu_s(process: Any, reaped: bool = True) -> float | None:
            """A process's CPU seconds (and its reaped children's); None once it is gone (or a zombie)."""
            try:
                t = process.cpu_times()
            except psutil.Error:
                return None
            return t.user + t.system + (t.children_user + t.children_system if reaped else 0.0)

        def family(process: Any) -> list[Any]:
            """``process`` and its live descendants."""
            try:
                return [process, *process.children(recursive=True)]
            except psutil.Error:
                return [process]

        def own_cpu() -> float:
            total = cpu_s(me) or 0.0
            for pid in RUN_STARTERS:
                try:
                    starter = psutil.Process(pid)
                except psutil.Error:  # gone: its time is in this process's reaped children's
                    continue
                total += sum(filter(None, map(cpu_s, family(starter))))  # one gone since: in its parent's reaped
            return total

        def load_average() -> float | None:
            try:
                return os.getloadavg()[0]
            except (AttributeError, OSError):
                return None

        def frequency() -> tuple[float, float] | None:
            try:
                freq = psutil.cpu_freq()
            except (AttributeError, NotImplementedError, OSError):
                return None
            if freq is None or not freq.max or not freq.current:
                return None
            return float(freq.current), float(freq.max)

        def tree_cpu() -> tuple[float, dict[int, float]]:
            own = me.cpu_times()
            # A child gone (or a zombie) since the listing is left out: that interval is unknown.
            live = {child.pid: t for child in family(me)[1:] if (t := cpu_s(child, reaped=False)) is not None}
            return own.user + own.system, live

        return cls(
            clock=time.perf_counter,
            system_cpu=system_cpu,
            own_cpu=own_cpu,
            load_average=load_average,
            frequency=frequency,
            cpu_count=lambda: os.cpu_count() or 1,
            tree_cpu=tree_cpu,
            wait=time.sleep,
        )


@dataclass
class RunConditions:
    """The machine's conditions during one run.

    Attributes:
        label: which run (e.g. ``"bf16-mixed, repeat 2"``).
        wall_s: its duration.
        other_cores: average number of cores busy with other processes' work.
        steal_share: steal time as a share of all CPU time (0 where not reported).
        load_average: the larger 1-minute load average of the run's start and end, or ``None``.
        frequency_share: the lower CPU frequency of start and end, as a share of the maximum, or ``None``.
        config: the configuration measured, when the caller said.
        repeat: the repeat (from 0), when the caller said.
        other_cores_peak: other processes' busy cores over the busiest :data:`PEAK_WINDOW_S` seconds of the run (the
            whole run's sampled average when it was shorter), or ``None`` where it was not sampled.
    """

    label: str
    wall_s: float
    other_cores: float
    steal_share: float
    load_average: float | None = None
    frequency_share: float | None = None
    config: str | None = None
    repeat: int | None = None
    other_cores_peak: float | None = None


class LoadSampler:
    """Other processes' busy cores, interval by interval, while one run goes (read by :class:`ConditionMonitor`).

    Each :meth:`sample` takes the system's busy CPU time since the previous one, minus what this process and its
    descendants took (each live descendant's own difference; one first seen is new, so all of its time falls in the
    interval). Descendants alive when the sampler was made (a process the caller started beside the bench) count as
    other processes, as in the run's average. An interval in which a descendant ended is unknown (its last moments
    were not read) and left out of every window. :meth:`run_every` samples in a daemon thread until :meth:`halt`.

    Args:
        probes: the counters (``probes.tree_cpu`` must be set).
        window_s: the window of :meth:`peak`.
    """

    def __init__(self, probes: Probes, window_s: float = PEAK_WINDOW_S) -> None:
        if probes.tree_cpu is None:
            raise ValueError("LoadSampler needs probes.tree_cpu")
        self.probes, self.window_s = probes, window_s
        self.intervals: list[tuple[float, float | None]] = []  # (seconds, others' CPU seconds; None: unknown)
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        t, busy, own, live = self._reading()
        self._beside = frozenset(live)  # started before the run: other processes, as in the run's average
        self._prev: tuple[float, float, float, dict[int, float]] = (t, busy, own, {})

    def _reading(self) -> tuple[float, float, float, dict[int, float]]:
        tree = self.probes.tree_cpu
        assert tree is not None
        own, live = tree()
        return self.probes.clock(), self.probes.system_cpu()[0], own, dict(live)

    def sample(self) -> None:
        """Read the counters and record the interval since the previous reading."""
        t, busy, own, live = self._reading()
        live = {pid: cpu for pid, cpu in live.items() if pid not in self._beside}
        t0, busy0, own0, live0 = self._prev
        self._prev = (t, busy, own, live)
        seconds = t - t0
        if seconds <= 0:
            return
        others: float | None = None
        if all(pid in live for pid in live0):
            ours = (own - own0) + sum(cpu - live0.get(pid, 0.0) for pid, cpu in live.items())
            others = min(max(busy - busy0 - ours, 0.0), seconds * max(1, self.probes.cpu_count()))
        with self._lock:
            self.intervals.append((seconds, others))

    def peak(self) -> float | None:
        """Others' busy cores over the busiest window of :attr:`window_s` seconds of known intervals (the average of
        every known interval where no stretch of them is that long); ``None`` with none known."""
        with self._lock:
            intervals = list(self.intervals)
        best: float | None = None
        for end in range(len(intervals)):
            seconds = cpu = 0.0
            for length, others in reversed(intervals[: end + 1]):
                if others is None:
                    break
                seconds, cpu = seconds + length, cpu + others
                if seconds >= self.window_s:
                    best = max(best if best is not None else 0.0, cpu / seconds)
                    break
        if best is None:
            known = [(length, others) for length, others in intervals if others is not None]
            total = sum(length for length, _ in known)
            best = sum(others for _, others in known) / total if total > 0 else None
        return best

    def run_every(self, every_s: float) -> None:
        """Sample every ``every_s`` seconds in a daemon thread until :meth:`halt`."""
        self._thread = threading.Thread(target=self._loop, args=(every_s,), name="lightning-perf-load", daemon=True)
        self._thread.start()

    def _loop(self, every_s: float) -> None:
        while not self._halt.wait(every_s):
            try:
                self.sample()
            except Exception:  # a counter that fails ends the sampling; the run's average still judges it
                return

    def halt(self) -> None:
        """Stop sampling and wait for the thread to end (at once: it waits on an event)."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None


class ConditionMonitor:
    """Reads the counters around each run; :meth:`runs` are the :class:`RunConditions` so far.

    Args:
        probes: where to read (default :meth:`Probes.system`).
        sample_every_s: how often the :class:`LoadSampler` reads the counters during a run, in its daemon thread
            (``None``: no thread; :meth:`sample` takes a reading, as a test does). No sampling without
            ``probes.tree_cpu``.

    Example::

        monitor = ConditionMonitor()
        token = monitor.start()
        ...  # run one measurement in a child process and wait for it
        monitor.stop(token, "baseline, repeat 1")
    """

    def __init__(self, probes: Probes | None = None, *, sample_every_s: float | None = SAMPLE_EVERY_S) -> None:
        self.probes = probes if probes is not None else Probes.system()
        self.sample_every_s = sample_every_s
        self.runs: list[RunConditions] = []
        self._sampler: LoadSampler | None = None

    def _read(self) -> dict[str, Any]:
        p = self.probes
        busy, steal = p.system_cpu()
        return {
            "t": p.clock(),
            "busy": busy,
            "steal": steal,
            "ours": p.own_cpu(),
            "load": p.load_average(),
            "freq": p.frequency(),
        }

    def other_cores_now(self, window_s: float = 1.0) -> float | None:
        """Other processes' busy cores over the next ``window_s`` seconds (this process waits meanwhile): the bench's
        starting conditions. ``None`` where the probes cannot wait."""
        p = self.probes
        if p.wait is None:
            return None
        t0, busy0, ours0 = p.clock(), p.system_cpu()[0], p.own_cpu()
        p.wait(window_s)
        t1, busy1, ours1 = p.clock(), p.system_cpu()[0], p.own_cpu()
        if t1 <= t0:
            return None
        cores = max(1, p.cpu_count())
        return min(max((busy1 - busy0 - (ours1 - ours0)) / (t1 - t0), 0.0), float(cores))

    def start(self) -> dict[str, Any]:
        """Read the counters before a run (and start sampling it); pass the result to :meth:`stop`."""
        self.close()
        token = self._read()
        if self.probes.tree_cpu is not None:
            try:
                sampler = LoadSampler(self.probes)
            except Exception:  # no process counters here: the run's average alone judges it
                return token
            self._sampler = token["sampler"] = sampler
            if self.sample_every_s is not None:
                sampler.run_every(self.sample_every_s)
        return token

    def sample(self) -> None:
        """One reading of the running sampler (its thread takes them itself; a test calls this)."""
        if self._sampler is not None:
            self._sampler.sample()

    def close(self) -> None:
        """Stop a sampler still running (a run that raised before :meth:`stop`); harmless when none is."""
        if self._sampler is not None:
            self._sampler.halt()
            self._sampler = None

    def stop(
        self, start: Mapping[str, Any], label: str, *, config: str | None = None, repeat: int | None = None
    ) -> RunConditions:
        """Read the counters after a run and record its conditions (``config`` and ``repeat`` say which run)."""
        sampler = start.get("sampler")
        if sampler is not None:
            sampler.halt()
            if sampler is self._sampler:
                self._sampler = None
        end = self._read()
        wall = max(end["t"] - start["t"], 1e-9)
        cores = max(1, self.probes.cpu_count())
        others = (end["busy"] - start["busy"]) - (end["ours"] - start["ours"])
        loads = [x for x in (start["load"], end["load"]) if x is not None]
        freqs = [cur / top for cur, top in (x for x in (start["freq"], end["freq"]) if x is not None)]
        conditions = RunConditions(
            label=label,
            wall_s=wall,
            other_cores=max(0.0, others / wall),
            steal_share=max(0.0, (end["steal"] - start["steal"]) / (wall * cores)),
            load_average=max(loads) if loads else None,
            frequency_share=min(freqs) if freqs else None,
            config=config,
            repeat=repeat,
            other_cores_peak=sampler.peak() if sampler is not None else None,
        )
        self.runs.append(conditions)
        return conditions


@dataclass
class Reliability:
    """The verdict on a set of runs.

    Attributes:
        reliable: no cause was found.
        causes: one sentence per cause, naming it and its figure.
        figures: the measured conditions (worst run's and averages), for the results file.
        disturbed_runs: labels of the runs disturbed by the machine.
        disturbed_configs: configurations whose own samples scattered or were interrupted.
    """

    reliable: bool
    causes: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    disturbed_runs: list[str] = field(default_factory=list)
    disturbed_configs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The ``reliability`` object of a results file: ``reliable``, ``causes``, then the figures and lists."""
        data = asdict(self)
        figures = data.pop("figures")
        return {**data, **figures}


def _dispersion(samples: Sequence[Sequence[float]]) -> tuple[float | None, float]:
    """(spread of the per-repeat medians relative to their median, share of outlier steps)."""
    repeats = [np.asarray(s, dtype=np.float64) for s in samples if len(s)]
    if not repeats:
        return None, 0.0
    medians = np.array([np.median(r) for r in repeats])
    spread = float((medians.max() - medians.min()) / np.median(medians)) if len(repeats) > 1 else None
    outliers = sum(int((r > OUTLIER_FACTOR * np.median(r)).sum()) for r in repeats)
    return spread, outliers / sum(r.size for r in repeats)


def other_cores_limit(
    cores_used: int, cpu_count: int, start_other_cores: float | None = None, threads_set: bool = False
) -> tuple[float, str | None]:
    """The other processes' busy cores a run is judged against (before :data:`OTHER_CORES_MAX`), and a sentence on
    the starting load where there was one.

    The free cores (``cpu_count - cores_used``) are always excused. A starting load (``start_other_cores``, sampled
    before the first run) is excused where it fits in them, give or take :data:`START_ROUNDING` (the automatic thread
    choice rounds it to whole cores): a steady load the threads left room for is not a disturbance, a rise above it
    is. A starting load larger than that shares the bench's cores (more than the automatic choice could make room
    for, or threads set by hand, ``threads_set``): it is not excused, and the sentence says why, since runs sharing
    their cores with it scatter and change the ratios between configurations (docs/guide.md, "Worker threads on a
    shared machine").

    Example::

        >>> other_cores_limit(1, 2, 1.0)[0]
        1.0
        >>> other_cores_limit(1, 2, 2.0)[0]
        1.0
    """
    free = float(max(0, cpu_count - cores_used))
    if start_other_cores is None or not math.isfinite(start_other_cores):
        return free, None
    start = max(0.0, start_other_cores)
    used = f"the bench used {cores_used} of {cpu_count} cores"
    if start < free + START_ROUNDING:
        note = None
        if start >= STEADY_NOTE_MIN:
            note = f"a steady load of {start:.2f} cores was present from the start; {used} and judged runs against it"
        return max(free, start), note
    if threads_set:
        why = f"the threads were set by hand ({used}, leaving {free:g} free)"
    else:
        why = f"more than the {free:g} core(s) the bench could leave free ({used}, one thread at least)"
    return free, (
        f"a load of {start:.2f} cores was present from the start, {why}: it shares the bench's cores, so runs were "
        f"judged against the free cores and that load counts as a disturbance"
    )


def assess(
    runs: Sequence[RunConditions],
    step_samples: Mapping[str, Sequence[Sequence[float]]],
    *,
    cores_used: int,
    cpu_count: int,
    start_other_cores: float | None = None,
    threads_set: bool = False,
) -> Reliability:
    """Judge whether the measurement was disturbed.

    Args:
        runs: the conditions of every run (:attr:`ConditionMonitor.runs`).
        step_samples: per configuration, the steady-state step times of each repeat.
        cores_used: the cores the measured processes keep busy (torch's thread count on CPU).
        cpu_count: the machine's logical CPUs.
        start_other_cores: other processes' busy cores when the bench started (:meth:`ConditionMonitor.other_cores_now`;
            ``None``: unknown, only the free cores are excused); see :func:`other_cores_limit`.
        threads_set: the threads were set by hand (not chosen from the starting load).

    Returns:
        The verdict with its causes; each cause names what disturbed the run and its size. ``figures`` hold
        ``other_cores_start``, ``other_cores_limit`` (the threshold of a run's average; its busiest window may exceed
        it by :data:`PEAK_MARGIN`) and ``start_load`` (the sentence on the starting load, or ``None``).
    """
    figures: dict[str, Any] = {"cores_used": cores_used, "cpu_count": cpu_count, "runs_watched": len(runs)}
    level, note = other_cores_limit(cores_used, cpu_count, start_other_cores, threads_set)
    figures.update(other_cores_start=start_other_cores, other_cores_limit=level + OTHER_CORES_MAX, start_load=note)
    causes, disturbed = _machine_causes(runs, level, cores_used, cpu_count, figures) if runs else ([], [])
    scattered = _dispersion_causes(step_samples, causes, figures)
    return Reliability(not causes, causes, figures, disturbed_runs=disturbed, disturbed_configs=scattered)


def _load_cause(
    runs: Sequence[RunConditions], level: float, cores_used: int, cpu_count: int
) -> tuple[str | None, list[RunConditions]]:
    """Other processes' load: the runs whose average, or busiest window, was above the limit, and the sentence."""
    limit, peak_limit = level + OTHER_CORES_MAX, level + OTHER_CORES_MAX + PEAK_MARGIN
    on_average = [r for r in runs if r.other_cores > limit]
    in_bursts = [
        r for r in runs if r not in on_average and r.other_cores_peak is not None and r.other_cores_peak > peak_limit
    ]
    busy = [r for r in runs if r in on_average or r in in_bursts]
    if not busy:
        return None, []
    bench = f"the bench uses {cores_used} of {cpu_count} cores"
    if on_average:
        worst = max(on_average, key=lambda r: r.other_cores)
        text = (
            f"other processes' load: they kept {worst.other_cores:.2f} cores busy on average during {worst.label} "
            f"({len(busy)} of {len(runs)} runs above {limit:.2f}"
        )
        text += f", {len(in_bursts)} of them in a burst; {bench})" if in_bursts else f"; {bench})"
    else:
        worst = max(in_bursts, key=lambda r: r.other_cores_peak or 0.0)
        text = (
            f"other processes' load: they kept {worst.other_cores_peak:.2f} cores busy over {PEAK_WINDOW_S:g} s of "
            f"{worst.label} ({len(busy)} of {len(runs)} runs with a burst above {peak_limit:.2f}; {bench})"
        )
    return text, busy


def _machine_causes(
    runs: Sequence[RunConditions], level: float, cores_used: int, cpu_count: int, figures: dict[str, Any]
) -> tuple[list[str], list[str]]:
    """What disturbed the runs from outside, and which runs it disturbed; the conditions' figures go to ``figures``."""
    causes: list[str] = []
    disturbed: list[str] = []
    total_wall = sum(r.wall_s for r in runs)
    figures["other_cores_mean"] = sum(r.other_cores * r.wall_s for r in runs) / total_wall
    figures["other_cores_max"] = max(r.other_cores for r in runs)
    peaks = [r.other_cores_peak for r in runs if r.other_cores_peak is not None]
    figures["other_cores_peak_max"] = max(peaks) if peaks else None
    figures["steal_share_max"] = max(r.steal_share for r in runs)
    loads = [r.load_average for r in runs if r.load_average is not None]
    freqs = [r.frequency_share for r in runs if r.frequency_share is not None]
    figures["load_average_max"] = max(loads) if loads else None
    figures["frequency_share_min"] = min(freqs) if freqs else None

    load_cause, busy = _load_cause(runs, level, cores_used, cpu_count)
    if load_cause:
        causes.append(load_cause)
    stolen = [r for r in runs if r.steal_share > STEAL_SHARE_MAX]
    if stolen:
        worst = max(stolen, key=lambda r: r.steal_share)
        causes.append(
            f"steal time: the hypervisor took {100 * worst.steal_share:.1f}% of the CPU time during {worst.label}"
        )
    loaded = [r for r in runs if r.load_average is not None and r.load_average > LOAD_PER_CORE_MAX * cpu_count]
    if loaded:
        worst = max(loaded, key=lambda r: r.load_average or 0.0)
        causes.append(
            f"load average {worst.load_average:.1f} on {cpu_count} cores during {worst.label} "
            f"(above {LOAD_PER_CORE_MAX:g} per core)"
        )
    slow = [r for r in runs if r.frequency_share is not None and r.frequency_share < FREQUENCY_MIN_SHARE]
    if slow:
        worst = min(slow, key=lambda r: r.frequency_share or 1.0)
        causes.append(f"CPU frequency at {100 * (worst.frequency_share or 0):.0f}% of its maximum during {worst.label}")
    for group in (busy, stolen, loaded, slow):
        disturbed.extend(r.label for r in group if r.label not in disturbed)
    return causes, disturbed


def _dispersion_causes(
    step_samples: Mapping[str, Sequence[Sequence[float]]], causes: list[str], figures: dict[str, Any]
) -> list[str]:
    """The configurations whose step times scattered (the causes to ``causes``, every one's figures to ``figures``)."""
    scattered: list[str] = []
    dispersion: dict[str, Any] = {}
    for config, samples in step_samples.items():
        spread, outlier_share = _dispersion(samples)
        dispersion[config] = {"repeat_spread": spread, "outlier_step_share": outlier_share}
        reasons = []
        if spread is not None and math.isfinite(spread) and spread > REPEAT_SPREAD_MAX:
            reasons.append(f"its per-repeat medians are {100 * spread:.0f}% apart")
        if outlier_share > OUTLIER_SHARE_MAX:
            reasons.append(f"{100 * outlier_share:.0f}% of its steps took over {OUTLIER_FACTOR:g}x their median")
        if reasons:
            scattered.append(config)
            causes.append(f"dispersion of {config}: " + " and ".join(reasons))
    figures["dispersion"] = dispersion
    return scattered
