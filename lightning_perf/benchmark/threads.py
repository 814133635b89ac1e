"""The worker processes' intra-op threads, the same for every configuration of a bench or tuning run.

:func:`decide_threads` leaves out of the usable cores one per core other processes keep busy (rounded), at least 1:
sampled over a second when the run starts (:func:`sample_other_cores`), else the 1-minute load average. A load present
at the start is watched (:func:`choose_threads`: every :data:`RECHECK_S` s for up to :data:`START_WATCH_S` s, saying
:data:`WATCH_LINE`) and the count chosen from the last sample. Where it still cost the run threads, the bench samples
again after each run and, once that load is gone, chooses again (:func:`recheck_threads`, once per bench run; the runs
measured before are set aside; the tuner keeps its first choice). :func:`start_load_note` says for how many threads the
answer holds. A count set by hand (``--threads``, ``BenchSpec(threads=...)``, ``OMP_NUM_THREADS``) wins. Workers get
the count and the wait policy in their environment (:func:`thread_env`). Why and the figures: docs/guide.md, "Worker
threads on a shared machine". Pure logic over plain numbers and a monitor's samples, so a test scripts them.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_perf._validation import check_int

__all__ = [
    "ThreadChoice",
    "choose_threads",
    "decide_for_run",
    "decide_threads",
    "load_average",
    "recheck_threads",
    "sample_other_cores",
    "start_load_note",
    "thread_env",
    "threads_line",
]

PASSIVE = "PASSIVE"
SAMPLE_S = 1.0
"""The starting sample of other processes' busy cores: a second holds a hundred scheduler ticks per core, enough to
tell a busy core from an idle one, and adds one second to a bench's start."""
START_WATCH_S = 60.0
"""The longest a load present at the start is watched before the threads are chosen: a burst that ends within it no
longer decides the whole run (read at call time, so a test may set it)."""
RECHECK_S = 5.0
"""The window of each later sample while watching: the wait between checks is the sample itself."""
WATCH_LINE = f"other load at start: sampling up to {START_WATCH_S:.0f} s before choosing threads"


def load_average() -> float | None:
    """The 1-minute load average (runnable processes), or ``None`` where the platform has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op threads every worker of one run uses, and why.

    Attributes:
        threads: intra-op threads per worker.
        cores: the usable cores the choice was made from.
        load: the 1-minute load average when the run started (``None``: unknown).
        wait_policy: ``OMP_WAIT_POLICY`` given to the workers: the environment's; else ``PASSIVE`` where other
            processes kept a core busy at the start (the count left one out for it); else ``None``: OpenMP's default.
        reason: where the count came from (``"auto"``, ``"asked for"``, ``"OMP_NUM_THREADS"``).
        other_cores: other processes' busy cores the count was chosen from (``None``: not sampled; the load
            average decided).
        start_other_cores: other processes' busy cores in the first sample, before any watching.
        watched_s: seconds the load present at the start was watched before the choice (0: none was).
        switch: ``{"from", "to", "in_round", "why"}`` where the bench chose again once that load was gone.
    """

    threads: int
    cores: int
    load: float | None
    wait_policy: str | None
    reason: str
    other_cores: float | None = None
    start_other_cores: float | None = None
    watched_s: float = 0.0
    switch: dict[str, Any] | None = None

    @property
    def set_by_hand(self) -> bool:
        """The count was given (``--threads``, ``OMP_NUM_THREADS``), not chosen from the machine's load."""
        return self.reason not in ("auto", "not decided yet")

    @property
    def line(self) -> str:
        """``"threads: 1 (2 cores, 1.0 busy with other work, load 0.4)"`` (the sampled busy cores where sampled),
        with the reason when the count was not chosen automatically."""
        load = "load unknown" if self.load is None else f"load {self.load:.1f}"
        busy = "" if self.other_cores is None else f"{self.other_cores:.1f} busy with other work, "
        source = "" if self.reason == "auto" else f", {self.reason}"
        return f"threads: {self.threads} ({self.cores} cores, {busy}{load}{source})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide_threads(
    cores: int | None,
    load: float | None,
    asked: int | None = None,
    environ: Mapping[str, str] | None = None,
    other_cores: float | None = None,
) -> ThreadChoice:
    """The workers' intra-op threads for one run.

    Args:
        cores: the usable cores (``None``: unknown, taken as 1).
        load: the 1-minute load average at the run's start (``None``: unknown, taken as 0); it decides only where
            ``other_cores`` is ``None``.
        asked: an explicit count (``--threads``); it wins over everything.
        environ: the environment to read ``OMP_NUM_THREADS`` and ``OMP_WAIT_POLICY`` from (default: ``os.environ``).
        other_cores: other processes' busy cores sampled now; where given, it decides (the load average lags).

    Raises:
        ValueError: ``asked`` below 1, or ``cores`` below 1.

    Example::

        >>> decide_threads(2, 1.4, environ={}).line
        'threads: 1 (2 cores, load 1.4)'
        >>> decide_threads(2, 0.2, environ={}).threads
        2
        >>> decide_threads(2, 0.2, environ={}, other_cores=1.0).threads  # a load that began: not in the average yet
        1
        >>> decide_threads(2, 1.4, environ={}, other_cores=0.0).threads  # a load that ended: still in the average
        2
    """
    check_int("decide_threads", "asked", asked, 1, allow_none=True)
    check_int("decide_threads", "cores", cores, 1, allow_none=True)
    usable = cores or 1
    environ = os.environ if environ is None else environ
    busy = 0
    if asked is not None:
        threads, reason = asked, "asked for"
    elif _positive_int(environ.get("OMP_NUM_THREADS")):
        threads, reason = int(environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    else:
        busy = _busy(other_cores if other_cores is not None and math.isfinite(other_cores) else load)
        threads, reason = max(1, usable - busy), "auto"
    # Threads that spin between parallel regions would compete with a load there at the start (guide).
    policy = environ.get("OMP_WAIT_POLICY") or (PASSIVE if busy else None)
    return ThreadChoice(threads, usable, load, policy, reason, other_cores)


def thread_env(threads: int | None, wait_policy: str | None = None) -> dict[str, str]:
    """A worker's environment for ``threads`` intra-op threads, set before torch starts: ``OMP_NUM_THREADS`` and
    ``OMP_WAIT_POLICY`` (``wait_policy``, else the one this environment sets, else none: OpenMP's default); no
    ``OMP_NUM_THREADS`` for ``None`` (torch's default)."""
    policy = wait_policy or os.environ.get("OMP_WAIT_POLICY")
    return {**({"OMP_NUM_THREADS": str(threads)} if threads else {}), **({"OMP_WAIT_POLICY": policy} if policy else {})}


def _busy(cores: float | None) -> int:
    """Whole cores busy with other work, as the count leaves them out (half a core or more counts as one)."""
    return math.floor(cores + 0.5) if cores is not None and math.isfinite(cores) and cores > 0 else 0


def _positive_int(text: str | None) -> bool:
    return text is not None and text.strip().isdigit() and int(text) >= 1


def decide_for_run(
    asked: int | None,
    machine: Mapping[str, Any],
    probe: Callable[[], float | None] | None = None,
    other_cores: float | None = None,
) -> ThreadChoice:
    """:func:`decide_threads` with the usable cores of ``machine`` (a
    :func:`~lightning_perf.profiling.machine.describe_machine` dict), the load average now (``probe``, default
    :func:`load_average`) and other processes' busy cores sampled now (``other_cores``, from
    :func:`sample_other_cores`)."""
    cores = machine.get("cpu_count_usable") or machine.get("cpu_count")
    return decide_threads(int(cores) if cores else None, (probe or load_average)(), asked, other_cores=other_cores)


def sample_other_cores(monitor: Any, window_s: float = SAMPLE_S) -> float | None:
    """Other processes' busy cores over the next ``window_s`` seconds, read by ``monitor`` (a
    :class:`~lightning_perf.profiling.reliability.ConditionMonitor`: the same counters that judge the runs); ``None``
    for a monitor that cannot sample (a test's stand-in) or a failed reading."""
    try:
        value = monitor.other_cores_now(window_s)
    except Exception:  # no such method (a test's stand-in) or no counters on this platform: the load average decides
        return None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def choose_threads(
    monitor: Any, asked: int | None, machine: Mapping[str, Any], say: Callable[[str], None] | None = None
) -> ThreadChoice:
    """:func:`decide_for_run` from other processes' busy cores at the start, watched while they keep a core busy and
    the count is chosen automatically (no ``asked``, no ``OMP_NUM_THREADS``).

    The first sample takes :data:`SAMPLE_S`; where it finds a busy core, ``say`` (default: stderr) gets
    :data:`WATCH_LINE` once and ``monitor`` samples again over :data:`RECHECK_S` windows, up to
    :data:`START_WATCH_S` in all, until a sample is quiet; the last one decides. The samples' windows are the only
    waiting, so a scripted monitor runs it without a clock.
    """
    first = now = sample_other_cores(monitor)
    auto, watched = asked is None and not _positive_int(os.environ.get("OMP_NUM_THREADS")), 0.0
    while auto and _busy(now) and watched + RECHECK_S <= START_WATCH_S:
        if not watched:
            (say or _stderr)(WATCH_LINE)
        watched += RECHECK_S
        if (later := sample_other_cores(monitor, RECHECK_S)) is None:  # the counters failed: the last good one decides
            break
        now = later
    return replace(decide_for_run(asked, machine, other_cores=now), start_other_cores=first, watched_s=watched)


def recheck_threads(
    choice: ThreadChoice, monitor: Any, machine: Mapping[str, Any], in_round: int, say: Callable[[str], None] | None
) -> ThreadChoice | None:
    """After a run of round ``in_round``: where ``choice`` left cores out for a load present at the start and a fresh
    sample finds it gone (the rule that ends the watch), the count chosen again from that sample, with its
    :attr:`switch` said in one line; ``None`` otherwise: a count set by hand, every core used, a load still there, a
    second switch."""
    if choice.set_by_hand or choice.switch or choice.threads >= choice.cores or not _busy(choice.other_cores):
        return None
    if (now := sample_other_cores(monitor)) is None or _busy(now):
        return None
    new = decide_for_run(None, machine, other_cores=now)  # every core: none is busy now
    why = f"measured at {choice.threads} thread{'s' * (choice.threads > 1)} while the load present at the start lasted"
    gone = f"the load present at the start is gone in round {in_round}: threads {choice.threads} -> {new.threads}"
    (say or _stderr)(f"{gone}, the rounds so far are measured again")
    switch = {"from": choice.threads, "to": new.threads, "in_round": in_round, "why": why}
    return replace(new, start_other_cores=choice.start_other_cores, watched_s=choice.watched_s, switch=switch)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def start_load_note(choice: ThreadChoice, monitor: Any) -> str | None:
    """Where a load was present at the start: how long it was watched, for how many threads the figures hold, and,
    where it cost the run threads but is gone by the end (``monitor`` samples once more), that a quiet re-run would
    use every core and may answer differently. ``None`` for a quiet start or a count set by hand."""
    if choice.set_by_hand or not _busy(choice.start_other_cores):
        return None
    watched = f", watched {choice.watched_s:.0f} s" if choice.watched_s else ""
    text = (
        f"other load at start ({choice.start_other_cores:.1f} cores busy{watched}): the figures hold for "
        f"{choice.threads} thread{'s' if choice.threads != 1 else ''} per worker"
    )
    if switch := choice.switch:
        text += f" (from {switch['from']} in round {switch['in_round']}, when it was gone: the runs before set aside)"
    elif choice.threads < choice.cores and not _busy(end := sample_other_cores(monitor)) and end is not None:
        text += f"; that load was gone by the end: a quiet re-run would use {choice.cores} threads and may differ"
    return text


def threads_line(machine: Mapping[str, Any]) -> str | None:
    """The header line of a report whose ``machine`` holds a ``threads`` record (``None`` for an older report)."""
    record = machine.get("threads")
    if not isinstance(record, Mapping) or "threads" not in record:
        return None
    load, policy, others = record.get("load"), record.get("wait_policy"), record.get("other_cores")
    return ThreadChoice(
        int(record["threads"]), int(record.get("cores") or 1), load, policy, str(record.get("reason")), others
    ).line
