"""Whether a measurement can be trusted: what else ran on the machine while it went, and how much it scattered.

A :class:`ConditionMonitor` is read at the start and the end of every measured run (a run being one worker process:
the figures are differences of cumulative counters, so nothing is sampled while the run goes and nothing slows it).
Per run it records:

- the CPU time other processes took: the system's busy CPU time minus this process's and its reaped workers', as an
  average number of busy cores;
- steal time (CPU time the hypervisor gave to other guests), where the platform reports it;
- the 1-minute load average and the CPU frequency against its maximum, where the platform reports them.

:func:`assess` turns those runs and the step samples into a :class:`Reliability`: a verdict, the causes in words, the
figures behind them, and which runs and configurations were disturbed. The thresholds are named constants below, each
with its reason. The probes are plain callables (:class:`Probes`), so the verdict is tested with them replaced.
"""

from __future__ import annotations

import math
import os
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
    "REPEAT_SPREAD_MAX",
    "STEAL_SHARE_MAX",
    "ConditionMonitor",
    "Probes",
    "Reliability",
    "RunConditions",
    "assess",
]

OTHER_CORES_MAX = 0.25
"""Other processes may take this many cores on average beyond the cores the bench leaves free. A quarter of a busy
core on a core our threads use costs about a quarter of that core's time slices: enough to move a step time by several
percent, the size of the differences a bench is asked to tell apart."""
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


@dataclass(frozen=True)
class Probes:
    """Where the monitor reads the machine's counters (replaced in tests).

    Attributes:
        clock: seconds, monotonic.
        system_cpu: cumulative ``(busy_s, steal_s)`` of the whole machine, all cores summed.
        own_cpu: cumulative CPU seconds of this process and its reaped children (a measured run's worker is started
            after the first reading and reaped before the second, so its whole CPU time falls in the difference; a
            child still running, such as a process the caller started beside the bench, counts as another process).
        load_average: the 1-minute load average, or ``None``.
        frequency: ``(current_mhz, max_mhz)``, or ``None``.
        cpu_count: logical CPUs.
    """

    clock: Callable[[], float]
    system_cpu: Callable[[], tuple[float, float]]
    own_cpu: Callable[[], float]
    load_average: Callable[[], float | None]
    frequency: Callable[[], tuple[float, float] | None]
    cpu_count: Callable[[], int]

    @classmethod
    def system(cls) -> Probes:
        """The real probes (psutil and ``os``); each degrades to ``None``/0 where the platform has no counter."""
        import psutil

        me = psutil.Process()

        def system_cpu() -> tuple[float, float]:
            t = psutil.cpu_times()
            busy = sum(getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))
            return busy, getattr(t, "steal", 0.0)

        def own_cpu() -> float:
            t = me.cpu_times()
            return t.user + t.system + t.children_user + t.children_system

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

        return cls(
            clock=time.perf_counter,
            system_cpu=system_cpu,
            own_cpu=own_cpu,
            load_average=load_average,
            frequency=frequency,
            cpu_count=lambda: os.cpu_count() or 1,
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
    """

    label: str
    wall_s: float
    other_cores: float
    steal_share: float
    load_average: float | None = None
    frequency_share: float | None = None
    config: str | None = None
    repeat: int | None = None


class ConditionMonitor:
    """Reads the counters around each run; :meth:`runs` are the :class:`RunConditions` so far.

    Args:
        probes: where to read (default :meth:`Probes.system`).

    Example::

        monitor = ConditionMonitor()
        token = monitor.start()
        ...  # run one measurement in a child process and wait for it
        monitor.stop(token, "baseline, repeat 1")
    """

    def __init__(self, probes: Probes | None = None) -> None:
        self.probes = probes if probes is not None else Probes.system()
        self.runs: list[RunConditions] = []

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

    def start(self) -> dict[str, Any]:
        """Read the counters before a run; pass the result to :meth:`stop`."""
        return self._read()

    def stop(
        self, start: Mapping[str, Any], label: str, *, config: str | None = None, repeat: int | None = None
    ) -> RunConditions:
        """Read the counters after a run and record its conditions (``config`` and ``repeat`` say which run)."""
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


def assess(
    runs: Sequence[RunConditions],
    step_samples: Mapping[str, Sequence[Sequence[float]]],
    *,
    cores_used: int,
    cpu_count: int,
) -> Reliability:
    """Judge whether the measurement was disturbed.

    Args:
        runs: the conditions of every run (:attr:`ConditionMonitor.runs`).
        step_samples: per configuration, the steady-state step times of each repeat.
        cores_used: the cores the measured processes keep busy (torch's thread count on CPU).
        cpu_count: the machine's logical CPUs.

    Returns:
        The verdict with its causes; each cause names what disturbed the run and its size.
    """
    figures: dict[str, Any] = {"cores_used": cores_used, "cpu_count": cpu_count, "runs_watched": len(runs)}
    causes, disturbed = _machine_causes(runs, cores_used, cpu_count, figures) if runs else ([], [])
    scattered = _dispersion_causes(step_samples, causes, figures)
    return Reliability(not causes, causes, figures, disturbed_runs=disturbed, disturbed_configs=scattered)


def _machine_causes(
    runs: Sequence[RunConditions], cores_used: int, cpu_count: int, figures: dict[str, Any]
) -> tuple[list[str], list[str]]:
    """What disturbed the runs from outside, and which runs it disturbed; the conditions' figures go to ``figures``."""
    free = max(0, cpu_count - cores_used)
    causes: list[str] = []
    disturbed: list[str] = []
    total_wall = sum(r.wall_s for r in runs)
    figures["other_cores_mean"] = sum(r.other_cores * r.wall_s for r in runs) / total_wall
    figures["other_cores_max"] = max(r.other_cores for r in runs)
    figures["steal_share_max"] = max(r.steal_share for r in runs)
    loads = [r.load_average for r in runs if r.load_average is not None]
    freqs = [r.frequency_share for r in runs if r.frequency_share is not None]
    figures["load_average_max"] = max(loads) if loads else None
    figures["frequency_share_min"] = min(freqs) if freqs else None

    busy = [r for r in runs if r.other_cores > free + OTHER_CORES_MAX]
    if busy:
        worst = max(busy, key=lambda r: r.other_cores)
        causes.append(
            f"other processes' load: they kept {worst.other_cores:.2f} cores busy on average during "
            f"{worst.label} ({len(busy)} of {len(runs)} runs above {free + OTHER_CORES_MAX:.2f}; "
            f"the bench uses {cores_used} of {cpu_count} cores)"
        )
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
