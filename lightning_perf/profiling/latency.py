"""The one latency timer: a baseline and a candidate callable, timed paired and interleaved, one row per batch size.

Entry points: :func:`measure_latency` (one :class:`LatencyRow` per batch size), :func:`paired_blocks`. Why ABBA blocks
and how they pair into a speed-up with its 95% interval and verdict: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_perf._device import synchronize
from lightning_perf._validation import check_int
from lightning_perf.profiling.intervals import METHOD_SINGLE, NO_CLEAR_DIFFERENCE, RatioEstimate, paired_ratio
from lightning_perf.profiling.report import format_ratio
from lightning_perf.profiling.stats import summarize

__all__ = ["LatencyRow", "measure_latency", "paired_blocks", "speedup_estimate"]

Blocks = list[list[float]]
METHOD_NO_TIME = "a call took no measurable time: no interval"

_SUFFIXES = ("median_s", "p90_s", "throughput", "warmup_s")


@dataclass
class LatencyRow:
    """Latency of a baseline and a candidate at one batch size (seconds per call; throughput in samples/s).

    ``baseline`` and ``candidate`` name the two sides (``"eager"``/``"export"``, ``"float"``/``"quantized"``); the
    figures can also be read under those names (``row.eager_median_s`` is ``row.baseline_median_s`` when
    ``baseline == "eager"``; ``<side>_compile_s`` is ``<side>_warmup_s``), and :meth:`to_dict` writes both
    spellings. ``*_warmup_s`` is the first call (compilation included, when there is one), reported apart.

    ``speedup`` is the baseline's time over the candidate's (above 1: the candidate is faster), from the paired
    blocks (:func:`speedup_estimate`), with ``speedup_ci95`` (``[low, high]``, ``low <= speedup <= high``; ``None``
    without an interval), ``speedup_verdict`` (``"faster"``, ``"slower"`` or ``"no clear difference"``),
    ``speedup_method`` and ``speedup_n`` (1: the blocks of one process are pooled per side). ``baseline_blocks_s`` /
    ``candidate_blocks_s`` keep the per-call seconds of each block, so that another tool can build its own comparison.
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
    speedup_ci95: list[float] | None = None
    speedup_verdict: str = NO_CLEAR_DIFFERENCE
    speedup_method: str = METHOD_SINGLE
    speedup_n: int = 1
    baseline_blocks_s: Blocks | None = None
    candidate_blocks_s: Blocks | None = None

    @classmethod
    def from_blocks(
        cls,
        batch_size: int,
        baseline: Blocks,
        candidate: Blocks,
        names: tuple[str, str] = ("baseline", "candidate"),
        warmup_s: tuple[float | None, float | None] = (None, None),
    ) -> LatencyRow:
        """The row of paired blocks of per-call seconds (block ``i`` of each side is one pair, see
        :func:`paired_blocks`): medians and percentiles over all calls, the speed-up with its interval and verdict."""
        base = summarize([t for block in baseline for t in block])
        cand = summarize([t for block in candidate for t in block])
        estimate = speedup_estimate(baseline, candidate)
        return cls(
            batch_size=batch_size,
            baseline=names[0],
            candidate=names[1],
            baseline_median_s=base.median,
            baseline_p90_s=base.p90,
            candidate_median_s=cand.median,
            candidate_p90_s=cand.p90,
            speedup=estimate.ratio,
            baseline_throughput=batch_size / base.median if base.median > 0 else math.inf,
            candidate_throughput=batch_size / cand.median if cand.median > 0 else math.inf,
            iterations=cand.count,
            baseline_warmup_s=warmup_s[0],
            candidate_warmup_s=warmup_s[1],
            speedup_ci95=[estimate.low, estimate.high] if _has_interval(estimate) else None,
            speedup_verdict=estimate.verdict,
            speedup_method=estimate.method,
            speedup_n=estimate.n,
            baseline_blocks_s=[list(block) for block in baseline],
            candidate_blocks_s=[list(block) for block in candidate],
        )

    def format_speedup(self, digits: int = 2) -> str:
        """``"3.10x [2.95-3.22], faster"`` (the interval left out when there is none)."""
        return format_ratio(self.speedup, self.speedup_ci95, self.speedup_verdict, digits, sep=", ")

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


def _has_interval(estimate: RatioEstimate) -> bool:
    return estimate.has_interval and estimate.method != METHOD_NO_TIME


def paired_blocks(
    baseline: Callable[[], Any],
    candidate: Callable[[], Any],
    *,
    iterations: int,
    warmup: int = 0,
    device: Any = None,
) -> tuple[Blocks, Blocks]:
    """Per-call seconds of ``baseline`` and ``candidate`` in ABBA blocks, at least ``iterations`` timed calls each,
    kept per block: ``(baseline blocks, candidate blocks)``, block ``i`` of one side paired with block ``i`` of the
    other (``A1`` with ``B1``, ``A2`` with ``B2``).

    Raises:
        ValueError: if ``iterations < 1`` or ``warmup < 0``.
    """
    check_int("paired_blocks", "iterations", iterations, 1)
    check_int("paired_blocks", "warmup", warmup, 0)
    per_block = math.ceil(iterations / 2)
    blocks: dict[str, Blocks] = {"baseline": [], "candidate": []}
    for name in ("baseline", "candidate", "candidate", "baseline"):
        fn = baseline if name == "baseline" else candidate
        for _ in range(warmup):
            fn()
        synchronize(device)
        block = []
        for _ in range(per_block):
            started = time.perf_counter_ns()
            fn()
            synchronize(device)
            block.append((time.perf_counter_ns() - started) * 1e-9)
        blocks[name].append(block)
    return blocks["baseline"], blocks["candidate"]


def speedup_estimate(baseline: Blocks, candidate: Blocks) -> RatioEstimate:
    """Baseline time over candidate time from paired blocks, with its 95% interval and verdict
    (:func:`~lightning_perf.profiling.intervals.paired_ratio`: ``"faster"`` when the candidate is faster).

    A call timed at zero seconds (below the clock's resolution) leaves no ratio to build an interval from: the
    ratio of the medians is returned with no interval and ``"no clear difference"``.
    """
    if all(t > 0 for block in (*baseline, *candidate) for t in block):
        # The ABBA blocks are one process's calls: pooled per side (the drift between blocks widens the spread), not
        # taken as processes, whose t interval over two blocks (t = 12.7 at one degree of freedom) would find nothing.
        pooled = [[t for block in baseline for t in block]], [[t for block in candidate for t in block]]
        return paired_ratio(*pooled, above_one="faster", below_one="slower")
    base = summarize([t for b in baseline for t in b]).median
    cand = summarize([t for b in candidate for t in b]).median
    ratio = base / cand if cand > 0 else (math.inf if base > 0 else 1.0)
    return RatioEstimate(ratio, ratio, ratio, METHOD_NO_TIME, NO_CLEAR_DIFFERENCE, len(baseline))


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
    """Time ``baseline`` against ``candidate`` (paired, interleaved; see the module notes) into one row.

    Example::

        row = measure_latency(lambda: model(x), lambda: session.run(None, feed), batch_size=32, iterations=20,
                              names=("eager", "export"))
        print(row.format_speedup(), row.speedup_ci95, row.eager_median_s)
    """
    base, cand = paired_blocks(baseline, candidate, iterations=iterations, warmup=warmup, device=device)
    return LatencyRow.from_blocks(batch_size, base, cand, names=names, warmup_s=warmup_s)
