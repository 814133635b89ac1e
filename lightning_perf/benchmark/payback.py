"""When a compiled configuration pays for its cold compile: its cold first step apart from its warm ones, and the number
of training steps after which it is repaid.

Entry point: :func:`compile_costs` (pure: reads figures). The break-even rule: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning_perf.optimizations as optimizations
from lightning_perf._validation import check_number
from lightning_perf.optimizations import BASELINE
from lightning_perf.profiling.stats import median

if TYPE_CHECKING:
    from lightning_perf.benchmark.results import ConfigSummary

__all__ = ["CompileCost", "break_even_steps", "compile_costs", "compiles"]


def compiles(config: str) -> bool:
    """Whether a configuration (``a+b`` for a stack) holds a part with a long warm-up (compilation)."""
    return any((o := optimizations.find(part)) is not None and o.long_warmup for part in config.split("+"))


def break_even_steps(cold_first_step_s: float, baseline_step_s: float, step_s: float) -> float | None:
    """Training steps after which a cold first step is repaid by the steps it saves: ``(cold first step - baseline
    step) / (baseline step - step)``; ``None`` when the configuration saves nothing per step (never repaid), ``0``
    when its first step is no longer than baseline's steps.

    Raises:
        ValueError: for a time that is not a positive finite number of seconds.
    """
    for name, value in (("cold_first_step_s", cold_first_step_s), ("baseline_step_s", baseline_step_s),
                        ("step_s", step_s)):  # fmt: skip
        check_number("break_even_steps", name, value, 0.0, exclusive=True)
    saved = baseline_step_s - step_s
    if saved <= 0:
        return None
    return max(0.0, (cold_first_step_s - baseline_step_s) / saved)


@dataclass(frozen=True)
class CompileCost:
    """One compiled configuration's cold start and when it is repaid.

    Attributes:
        config: the configuration.
        cold_first_step_s: the first step of its first process (a cold compile).
        warm_first_step_s: the median first step of its later processes (the cache warm), ``None`` with one process.
        step_s: its steady-state step; baseline_step_s: baseline's, over the repeats its speed-up pairs with.
        break_even_steps: training steps after which the cold first step is repaid; ``None`` when its speed-up's
            interval does not lie above 1 (then ``why`` says so).
    """

    config: str
    cold_first_step_s: float
    warm_first_step_s: float | None
    step_s: float
    baseline_step_s: float
    break_even_steps: float | None
    why: str = ""

    def text(self) -> str:
        """``"compile: cold first step 26.3 s, warm 2.1 s; pays for itself after ~240 training steps"``."""
        warm = f", warm {self.warm_first_step_s:.1f} s" if self.warm_first_step_s is not None else ""
        head = f"{self.config}: cold first step {self.cold_first_step_s:.1f} s{warm}"
        if self.break_even_steps is None:
            return f"{head}; {self.why}"
        return f"{head}; {payback_phrase(self.break_even_steps)}"


def payback_phrase(steps: float) -> str:
    """``"pays for itself after ~240 training steps"`` (two significant figures: the figure is an estimate)."""
    if steps < 1:
        return "pays for itself from its first step"
    rounded = int(float(f"{steps:.2g}")) if steps >= 10 else math.ceil(steps)
    return f"pays for itself after ~{rounded} training step{'s' if rounded != 1 else ''}"


def compile_costs(summaries: Sequence[ConfigSummary], runs: Sequence[Mapping[str, Any]]) -> list[CompileCost]:
    """The cost of each compiled configuration's cold start, from its runs in the order they ran (the first ok run
    with a first step is the cold one) and its summary row (steady step, speed-up and its interval)."""
    base = next((s for s in summaries if s.config == BASELINE), None)
    costs = []
    for s in summaries:
        if s.config == BASELINE or not compiles(s.config) or not s.step_median_s:
            continue
        firsts = [r["first_step_s"] for r in runs if _of(r, s.config) and r.get("first_step_s")]
        baseline_step = s.paired_baseline_step_s or (base.step_median_s if base is not None else None)
        if not firsts or not baseline_step:
            continue
        estimate = s.estimate("speedup")
        faster = estimate is not None and estimate.has_interval and estimate.low > 1.0
        steps = break_even_steps(firsts[0], baseline_step, s.step_median_s) if faster else None
        why = ""
        if steps is None:
            why = "no break-even: its speed-up's interval does not lie above 1" if estimate is not None and (
                estimate.has_interval
            ) else "no break-even: one repeat gives its speed-up no interval"  # fmt: skip
        warm = median(sorted(firsts[1:])) if len(firsts) > 1 else None
        costs.append(CompileCost(s.config, firsts[0], warm, s.step_median_s, baseline_step, steps, why))
    return costs


def _of(run: Mapping[str, Any], config: str) -> bool:
    return bool(run.get("ok")) and (run.get("spec") or {}).get("config") == config
