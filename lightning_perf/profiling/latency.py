"""The one latency timer: a baseline and a candidate callable, timed paired and interleaved, one row per batch size.

Both callables run in blocks ordered baseline, candidate, candidate, baseline (ABBA): a linear drift of the machine
(thermal, another process starting) falls on both alike, and blocks rather than alternating calls keep a runtime's
spinning worker threads (onnxruntime's, by default) from slowing the other runtime's next call. Each block starts with
``warmup`` untimed calls. Each call is timed on the host up to a device synchronize: end-to-end latency as a caller
sees it, the only fair clock when the two run on different runtimes. Statistics come from
:func:`lightning_perf.profiling.stats.summarize`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_perf._device import synchronize
from lightning_perf.profiling.stats import Stats, summarize

__all__ = ["LatencyRow", "measure_latency", "paired_latency"]

_SUFFIXES = ("median_s", "p90_s", "throughput", "warmup_s")


@dataclass
class LatencyRow:
    """Latency of a baseline and a candidate at one batch size (seconds per call; throughput in samples/s).

    ``baseline`` and ``candidate`` name the two sides (``"eager"``/``"export"``, ``"float"``/``"quantized"``); the
    figures can also be read under those names (``row.eager_median_s`` is ``row.baseline_median_s`` when
    ``baseline == "eager"``; ``<side>_compile_s`` is ``<side>_warmup_s``), and :meth:`to_dict` writes both
    spellings. ``*_warmup_s`` is the first call (compilation included, when there is one), reported apart.
    """

    batch_size: int
    baseline: str
    candidate: str
    baseline_median_s: float
    baseline_p90_s: float
    candidate_median_s: float
    candidate_p90_s: float
    speedup: float
    baseline_throughput: float
    candidate_throughput: float
    iterations: int
    baseline_warmup_s: float | None = None
    candidate_warmup_s: float | None = None

    @classmethod
    def from_stats(
        cls,
        batch_size: int,
        baseline: Stats,
        candidate: Stats,
        names: tuple[str, str] = ("baseline", "candidate"),
        warmup_s: tuple[float | None, float | None] = (None, None),
    ) -> LatencyRow:
        """The row of two samples of per-call seconds (``speedup`` is the baseline median over the candidate's)."""
        return cls(
            batch_size=batch_size,
            baseline=names[0],
            candidate=names[1],
            baseline_median_s=baseline.median,
            baseline_p90_s=baseline.p90,
            candidate_median_s=candidate.median,
            candidate_p90_s=candidate.p90,
            speedup=baseline.median / candidate.median if candidate.median > 0 else math.inf,
            baseline_throughput=batch_size / baseline.median if baseline.median > 0 else math.inf,
            candidate_throughput=batch_size / candidate.median if candidate.median > 0 else math.inf,
            iterations=candidate.count,
            baseline_warmup_s=warmup_s[0],
            candidate_warmup_s=warmup_s[1],
        )

    def __getattr__(self, name: str) -> Any:
        # Called only for names that are not fields: the side-named spellings (eager_median_s, float_compile_s...).
        if not name.startswith("_"):
            for side in ("baseline", "candidate"):
                label = self.__dict__.get(side)
                if label and name.startswith(label + "_"):
                    suffix = name[len(label) + 1 :]
                    suffix = "warmup_s" if suffix == "compile_s" else suffix
                    if suffix in _SUFFIXES:
                        return self.__dict__[f"{side}_{suffix}"]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields, plus each side's figures under its own name (``eager_median_s``, ``float_compile_s``...)."""
        data = dataclasses.asdict(self)
        for side in ("baseline", "candidate"):
            for suffix in _SUFFIXES:
                data[f"{data[side]}_{suffix}"] = data[f"{side}_{suffix}"]
            data[f"{data[side]}_compile_s"] = data[f"{side}_warmup_s"]
        return data


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`paired_latency({name}={value!r})` is not valid. Expected an int >= {minimum}.")


def paired_latency(
    baseline: Callable[[], Any],
    candidate: Callable[[], Any],
    *,
    iterations: int,
    warmup: int = 0,
    device: Any = None,
) -> tuple[Stats, Stats]:
    """Per-call seconds of ``baseline`` and ``candidate`` in ABBA blocks, at least ``iterations`` timed calls each.

    Raises:
        ValueError: if ``iterations < 1`` or ``warmup < 0``.
    """
    _check_count("iterations", iterations, 1)
    _check_count("warmup", warmup, 0)
    per_block = math.ceil(iterations / 2)
    samples: dict[str, list[float]] = {"baseline": [], "candidate": []}
    for name in ("baseline", "candidate", "candidate", "baseline"):
        fn = baseline if name == "baseline" else candidate
        for _ in range(warmup):
            fn()
        synchronize(device)
        for _ in range(per_block):
            started = time.perf_counter_ns()
            fn()
            synchronize(device)
            samples[name].append((time.perf_counter_ns() - started) * 1e-9)
    return summarize(samples["baseline"]), summarize(samples["candidate"])


def measure_latency(
    baseline: Callable[[], Any],
    candidate: Callable[[], Any],
    *,
    batch_size: int,
    iterations: int,
    warmup: int = 0,
    device: Any = None,
    names: tuple[str, str] = ("baseline", "candidate"),
    warmup_s: tuple[float | None, float | None] = (None, None),
) -> LatencyRow:
    """Time ``baseline`` against ``candidate`` (paired, interleaved; see the module docstring) into one row.

    Example::

        row = measure_latency(lambda: model(x), lambda: session.run(None, feed), batch_size=32, iterations=20,
                              names=("eager", "export"))
        print(row.speedup, row.eager_median_s)
    """
    base, cand = paired_latency(baseline, candidate, iterations=iterations, warmup=warmup, device=device)
    return LatencyRow.from_stats(batch_size, base, cand, names=names, warmup_s=warmup_s)
