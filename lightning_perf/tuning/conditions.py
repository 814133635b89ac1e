"""Whether a trial was disturbed: the bench's watcher (:mod:`lightning_perf.profiling.reliability`) around each trial.

The tuner reads the machine's counters before and after every trial process and judges that one run with
:func:`~lightning_perf.profiling.reliability.assess` (other processes' CPU time, steal, load average, frequency, and
the trial's own outlier steps). A disturbed trial is measured once more; one that stays disturbed decides nothing.
Other processes' load is judged against what they kept busy when the search started (sampled by the same monitor
before the thread choice, :meth:`TrialWatch.other_cores_now`): a steady load the threads left cores for is not a
disturbance, a rise above it is (:func:`~lightning_perf.profiling.reliability.other_cores_limit`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_perf.profiling.reliability import ConditionMonitor, Probes, assess, other_cores_limit

__all__ = ["BASELINE_SPREAD_MAX", "TrialWatch", "baseline_spread_cause"]

BASELINE_SPREAD_MAX = 1.5
"""Two runs of the unchanged model more than 1.5x apart are not noise a gain can be measured against: on a quiet
machine they agree within a few percent, so the machine itself changed between them (another process, throttling)."""


@dataclass
class TrialWatch:
    """Watches the machine around each trial; :meth:`causes` says what disturbed one.

    Args:
        device: the device trials run on (on CUDA one core drives the GPU; on CPU torch's threads are busy).
        probes: where to read the counters (default: the real ones).
    """

    device: str = "cpu"
    probes: Probes | None = None
    threads: int | None = None  # the trials' intra-op threads (None: this process's torch threads)
    start_other_cores: float | None = None  # other processes' busy cores when the search started (None: unknown)
    threads_set: bool = False  # the threads were set by hand, not chosen from that starting load
    monitor: ConditionMonitor = field(init=False)

    def __post_init__(self) -> None:
        self.monitor = ConditionMonitor(self.probes)

    def other_cores_now(self, window_s: float = 1.0) -> float | None:
        """Other processes' busy cores over the next ``window_s`` seconds (the search's starting conditions)."""
        return self.monitor.other_cores_now(window_s)

    def judge_from(self, choice: Any) -> str | None:
        """Judge trials with ``choice``'s threads (a :class:`~lightning_perf.benchmark.threads.ThreadChoice`) against
        the starting load it was made from; returns the sentence on that load, if any."""
        self.threads, self.start_other_cores = choice.threads, choice.other_cores
        self.threads_set = bool(choice.set_by_hand)
        cores = 1 if self.device.startswith("cuda") else self.threads
        cpu_count = self.monitor.probes.cpu_count() or os.cpu_count() or 1
        return other_cores_limit(cores, cpu_count, self.start_other_cores, self.threads_set)[1]

    def start(self) -> dict[str, Any]:
        return self.monitor.start()

    def close(self) -> None:
        """Stop the monitor's sampler of a trial that raised."""
        self.monitor.close()

    def causes(self, token: dict[str, Any], label: str, step_times_s: Sequence[float]) -> list[str]:
        """What disturbed the trial that started at ``token`` (empty: nothing)."""
        import torch

        conditions = self.monitor.stop(token, label, config=label)
        cores = 1 if self.device.startswith("cuda") else self.threads or torch.get_num_threads()
        cpu_count = self.monitor.probes.cpu_count() or os.cpu_count() or 1
        verdict = assess([conditions], {label: [list(step_times_s)]}, cores_used=cores, cpu_count=cpu_count,
                         start_other_cores=self.start_other_cores, threads_set=self.threads_set)  # fmt: skip
        return list(verdict.causes)


def baseline_spread_cause(first_s: float, second_s: float) -> str | None:
    """Why two baseline runs cannot serve as a reference (their medians beyond :data:`BASELINE_SPREAD_MAX` apart)."""
    if not (first_s > 0 and second_s > 0 and math.isfinite(first_s) and math.isfinite(second_s)):
        return None
    spread = max(first_s, second_s) / min(first_s, second_s)
    if spread <= BASELINE_SPREAD_MAX:
        return None
    return (
        f"the two baseline runs of the unchanged model differ {spread:.2f}x ({first_s * 1e3:.1f} vs "
        f"{second_s * 1e3:.1f} ms per step; beyond {BASELINE_SPREAD_MAX:g}x the machine changed between them)"
    )
