"""The worker processes' intra-op threads: decided once per bench or tuning run, the same for every configuration.

On a small machine shared with other work, torch's default (one intra-op thread per core) makes the threads of one
step wait on each other while another process holds a core, and a step can run many times slower than with fewer
threads; which configuration suffers most depends on how many parallel regions its step has, so the ratios change
too. :func:`decide_threads` takes the usable cores (``cpu_count_usable`` of
:func:`lightning_perf.profiling.machine.describe_machine`: the process's CPU affinity) and the 1-minute load average
seen when the run starts, and leaves out one core per unit of load (rounded): ``cores - round(load)``, at least 1.
An explicit count (``--threads``, ``BenchSpec(threads=...)``) or an ``OMP_NUM_THREADS`` already set in the
environment wins. The choice reaches each worker twice: in its environment before torch starts
(:meth:`ThreadChoice.env`: ``OMP_NUM_THREADS`` and ``OMP_WAIT_POLICY=PASSIVE``, so an idle OpenMP thread sleeps
instead of spinning against another process, also one that arrives after the run started) and by
``torch.set_num_threads`` in the worker. Figures behind the rule: docs/guide.md, "Worker threads on a shared
machine".

Pure logic over plain numbers; the probes (:func:`load_average`) are separate, so a test scripts cores and load.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from lightning_perf._validation import check_int

__all__ = ["ThreadChoice", "decide_for_run", "decide_threads", "load_average", "thread_env", "threads_line"]

PASSIVE = "PASSIVE"


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
        wait_policy: ``OMP_WAIT_POLICY`` given to the workers: ``PASSIVE`` unless the environment sets one (``None``:
            OpenMP's default).
        reason: where the count came from (``"auto"``, ``"asked for"``, ``"OMP_NUM_THREADS"``).
    """

    threads: int
    cores: int
    load: float | None
    wait_policy: str | None
    reason: str

    def env(self) -> dict[str, str]:
        """The worker's environment entries, set before torch starts."""
        return thread_env(self.threads, self.wait_policy)

    @property
    def line(self) -> str:
        """``"threads: 1 (2 cores, load 1.4)"``, with the reason when the count was not chosen automatically."""
        load = "load unknown" if self.load is None else f"load {self.load:.1f}"
        source = "" if self.reason == "auto" else f", {self.reason}"
        return f"threads: {self.threads} ({self.cores} cores, {load}{source})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide_threads(
    cores: int | None,
    load: float | None,
    asked: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ThreadChoice:
    """The workers' intra-op threads for one run.

    Args:
        cores: the usable cores (``None``: unknown, taken as 1).
        load: the 1-minute load average at the run's start (``None``: unknown, taken as 0).
        asked: an explicit count (``--threads``); it wins over everything.
        environ: the environment to read ``OMP_NUM_THREADS`` and ``OMP_WAIT_POLICY`` from (default: ``os.environ``).

    Raises:
        ValueError: ``asked`` below 1, or ``cores`` below 1.

    Example::

        >>> decide_threads(2, 1.4, environ={}).line
        'threads: 1 (2 cores, load 1.4)'
        >>> decide_threads(2, 0.2, environ={}).threads
        2
    """
    check_int("decide_threads", "asked", asked, 1, allow_none=True)
    check_int("decide_threads", "cores", cores, 1, allow_none=True)
    usable = cores or 1
    environ = os.environ if environ is None else environ
    if asked is not None:
        threads, reason = asked, "asked for"
    elif _positive_int(environ.get("OMP_NUM_THREADS")):
        threads, reason = int(environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    else:
        busy = math.floor(load + 0.5) if load is not None and math.isfinite(load) and load > 0 else 0
        threads, reason = max(1, usable - busy), "auto"
    return ThreadChoice(threads, usable, load, environ.get("OMP_WAIT_POLICY") or PASSIVE, reason)


def thread_env(threads: int | None, wait_policy: str | None = None) -> dict[str, str]:
    """A worker's environment for ``threads`` intra-op threads, set before torch starts: ``OMP_NUM_THREADS`` and
    ``OMP_WAIT_POLICY`` (``wait_policy``, else the one this environment sets, else ``PASSIVE``); empty for ``None``
    (torch's default)."""
    if threads is None:
        return {}
    policy = wait_policy or os.environ.get("OMP_WAIT_POLICY") or PASSIVE
    return {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": policy}


def _positive_int(text: str | None) -> bool:
    return text is not None and text.strip().isdigit() and int(text) >= 1


def decide_for_run(
    asked: int | None, machine: Mapping[str, Any], probe: Callable[[], float | None] | None = None
) -> ThreadChoice:
    """:func:`decide_threads` with the usable cores of ``machine`` (a
    :func:`~lightning_perf.profiling.machine.describe_machine` dict) and the load now (``probe``, default
    :func:`load_average`)."""
    cores = machine.get("cpu_count_usable") or machine.get("cpu_count")
    return decide_threads(int(cores) if cores else None, (probe or load_average)(), asked)


def threads_line(machine: Mapping[str, Any]) -> str | None:
    """The header line of a report whose ``machine`` holds a ``threads`` record (``None`` for an older report)."""
    record = machine.get("threads")
    if not isinstance(record, Mapping) or "threads" not in record:
        return None
    load, policy = record.get("load"), record.get("wait_policy")
    return ThreadChoice(
        int(record["threads"]), int(record.get("cores") or 1), load, policy, str(record.get("reason"))
    ).line
