"""The bench's results as data: one row per configuration (:class:`ConfigSummary`), the whole report
(:class:`BenchReport`) and a finished run's progress event (:class:`RunEvent`).

Measured by :mod:`lightning_perf.benchmark.runner`, formatted and written by :mod:`lightning_perf.benchmark.report`;
the keys are described in the runner's module notes (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from lightning_perf.profiling.intervals import RatioEstimate

__all__ = ["ONE_REPEAT", "BenchReport", "ConfigSummary", "ProgressFn", "RunEvent"]

ONE_REPEAT = "one repeat: no interval"
"""The verdict of every ratio measured in one repeat: one pair of processes says nothing about the process-to-process
spread (the largest source of noise here), so there is no interval and no verdict either way."""


@dataclass
class ConfigSummary:
    """One configuration's figures, aggregated over repeats (the keys are described in the module notes)."""

    config: str
    runs: int = 0
    skipped: str | None = None
    error: str | None = None
    disturbed: bool = False
    likely_cause: str | None = None
    step_median_s: float | None = None
    paired_baseline_step_s: float | None = None  # baseline's step over the repeats this row's ratio pairs with
    step_min_s: float | None = None  # smallest and largest per-repeat median
    step_max_s: float | None = None
    step_p10_s: float | None = None  # over all steady-state steps of all repeats
    step_p90_s: float | None = None
    speedup: float | None = None  # baseline step time / this step time, paired per repeat
    speedup_ci95: list[float] | None = None
    speedup_verdict: str | None = None
    speedup_method: str | None = None
    speedup_n: int | None = None
    speedup_min: float | None = None  # smallest and largest per-repeat ratio
    speedup_max: float | None = None
    throughput: float | None = None
    warmup_s: float | None = None
    model_init_s: float | None = None
    first_batch_s: float | None = None
    first_forward_s: float | None = None
    first_step_s: float | None = None  # the cold first training step (compilation with an empty cache included)
    settled: bool | None = None  # --repeats auto: the speed-up's interval within +-target (None: no ratio)
    unsettled: str | None = None  # "unsettled after N repeats ...: about M repeats (~T more) would settle it"
    peak_memory_bytes: float | None = None
    step_memory_bytes: float | None = None
    memory_ratio: float | None = None  # steady-state step memory / baseline's
    memory_ratio_ci95: list[float] | None = None
    memory_ratio_verdict: str | None = None
    memory_ratio_method: str | None = None
    memory_ratio_n: int | None = None
    predict_step_median_s: float | None = None
    predict_throughput: float | None = None
    predict_speedup: float | None = None  # baseline predict time / this predict time, paired per repeat
    predict_speedup_ci95: list[float] | None = None
    predict_speedup_verdict: str | None = None
    predict_speedup_method: str | None = None
    predict_speedup_n: int | None = None
    final_train_loss: float | None = None
    flops_per_step: int | None = None  # utilization: see lightning_perf.benchmark.utilization
    flops_error: str | None = None
    step_median_ci95_s: list[float] | None = None
    achieved_flops_per_second: float | None = None
    achieved_flops_per_second_ci95: list[float] | None = None
    peak_flops_per_second: float | None = None
    peak_source: str | None = None
    peak_causes: list[str] = field(default_factory=list)
    mfu: float | None = None  # achieved FLOP/s / peak FLOP/s, a fraction
    mfu_ci95: list[float] | None = None
    step_times_s: list[list[float]] = field(default_factory=list)
    predict_step_times_s: list[list[float]] = field(default_factory=list)
    # Inference stages: latency_p50_s/_p95_s/_p99_s and the ratios of INFERENCE_RATIOS, each with _ci95, _verdict,
    # _method, _n; written flat into the JSON summary row.
    inference: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str) -> Any:
        """A field, or an inference figure (``None`` when absent)."""
        return getattr(self, key) if key in self.__dataclass_fields__ else self.inference.get(key)

    def estimate(self, name: str) -> RatioEstimate | None:
        """The ratio ``name`` (``speedup``, ``memory_ratio``, ``predict_speedup``, or one of
        :data:`INFERENCE_RATIOS`) as a :class:`RatioEstimate`."""
        ratio, ci = self.get(name), self.get(f"{name}_ci95")
        if ratio is None or self.get(f"{name}_verdict") is None:
            return None
        low, high = ci if ci is not None else (ratio, ratio)
        method, n = self.get(f"{name}_method"), self.get(f"{name}_n")
        return RatioEstimate(ratio, low, high, method, self.get(f"{name}_verdict"), n)

    def set_estimate(self, name: str, estimate: RatioEstimate) -> None:
        for key, value in estimate.to_dict(name).items():
            if key in self.__dataclass_fields__:
                setattr(self, key, value)
            else:
                self.inference[key] = value

    def to_dict(self) -> dict[str, Any]:
        """The JSON summary row: every field, the inference figures flat among them."""
        row = asdict(self)
        return {**{k: v for k, v in row.items() if k != "inference"}, **row["inference"]}


@dataclass
class BenchReport:
    options: dict[str, Any]
    command: str
    summaries: list[ConfigSummary] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    machine: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    reliability: dict[str, Any] = field(default_factory=lambda: {"reliable": True, "causes": []})
    left_out: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. a configuration's precision over the --config file's
    settling: dict[str, Any] = field(default_factory=dict)  # how the repeats ended (benchmark.answer.settling_record)
    recommendation: dict[str, Any] = field(default_factory=dict)  # the winners' stack (answer.recommendation_record)

    @property
    def stage(self) -> str:
        return str(self.options.get("stage", "fit"))

    @property
    def failed(self) -> list[ConfigSummary]:
        return [s for s in self.summaries if s.error is not None]

    @property
    def reliable(self) -> bool:
        return bool(self.reliability.get("reliable", True))

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "summaries"}
        return {"kind": "lightning-perf-bench", **data, "summary": [s.to_dict() for s in self.summaries]}


ProgressFn = Callable[[int, int, str], None]


@dataclass(frozen=True)
class RunEvent:
    """One finished run, for a progress line: which, what it measured, and how far the bench is."""

    config: str
    repeat: int
    repeats: int
    done: int
    total: int
    step_median_s: float | None
    elapsed_s: float
    remaining_s: float
    status: str  # "ok", "skipped: ...", "failed: ..."
    unit: str = "step"  # "batch" for an inference stage (the median is then a batch's latency)

    def line(self, width: int = 80) -> str:
        """``"[3/9] channels_last repeat 1/3: step 41.2 ms, elapsed 0:32, about 1:05 left"``, at most ``width``
        columns: a long configuration name (a stack) first drops the words around the clocks, then is shortened."""
        what = f"{self.unit} {self.step_median_s * 1e3:.1f} ms" if self.step_median_s is not None else self.status
        repeat = f"repeat {self.repeat + 1}" + (f"/{self.repeats}" if self.repeats else "")  # auto: no count known
        head, name = f"[{self.done}/{self.total}] ", self.config
        elapsed, left = _clock(self.elapsed_s), _clock(self.remaining_s)
        line = f"{head}{name} {repeat}: {what}, elapsed {elapsed}, about {left} left"
        if len(line) <= width:
            return line
        tail = f" {repeat}: {what}, {elapsed}, ~{left} left"
        room = max(12, width - len(head) - len(tail))
        if len(name) > room:
            name = name[: room // 2] + "…" + name[len(name) - (room - room // 2 - 1) :]
        return head + name + tail


def _clock(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"
