"""Compile measured when it pays: the cold first step apart from the warm ones, and the break-even step count, from
scripted runs (no compile runs here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightning_perf.benchmark.console import cold_start_lines, console_lines
from lightning_perf.benchmark.payback import break_even_steps, compile_costs, compiles, payback_phrase
from lightning_perf.benchmark.report import markdown_report
from lightning_perf.benchmark.results import ConfigSummary
from lightning_perf.benchmark.runner import run_benchmark, summarize_runs
from lightning_perf.benchmark.spec import BenchSpec, RunSpec
from lightning_perf.benchmark.worker import RunResult
from lightning_perf.optimizations import BASELINE
from lightning_perf.profiling import PeakFlops
from lightning_perf.profiling.intervals import METHOD_BOOTSTRAP, METHOD_SINGLE, RatioEstimate
from tests.benchmark.test_auto_bench import Quiet


def test_break_even_is_the_extra_first_step_over_the_saving_per_step() -> None:
    assert break_even_steps(26.3, 0.5, 0.3) == pytest.approx((26.3 - 0.5) / 0.2)  # 129 steps
    assert break_even_steps(0.4, 0.5, 0.3) == 0.0  # a first step shorter than baseline's steps: repaid at once
    assert break_even_steps(26.3, 0.5, 0.5) is None and break_even_steps(26.3, 0.5, 0.6) is None  # never repaid
    for bad in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match=r"break_even_steps\(step_s=.*Expected a finite number > 0"):
            break_even_steps(26.3, 0.5, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("steps", "text"),
    [(129.0, "~130 training steps"), (240.4, "~240 training steps"), (3.2, "~4 training steps"),
     (1.0, "~1 training step"), (0.3, "from its first step"), (12345.0, "~12000 training steps")],
)  # fmt: skip
def test_the_break_even_is_said_in_round_figures(steps: float, text: str) -> None:
    assert text in payback_phrase(steps)


def test_only_configurations_that_compile_count() -> None:
    assert compiles("compile") and compiles("flash_attention+compile_regional") and compiles("fp8")
    assert not compiles("channels_last+fused_optimizer") and not compiles("unknown_name")


def row(config: str, step_s: float, ratio: float | None = None, low: float = 0.0, n: int = 3) -> ConfigSummary:
    s = ConfigSummary(config=config, runs=n, step_median_s=step_s)
    if ratio is not None:
        method, high = (METHOD_SINGLE, ratio) if n == 1 else (METHOD_BOOTSTRAP, ratio * 1.1)
        verdict = "faster" if low > 1 else "no clear difference"
        s.set_estimate("speedup", RatioEstimate(ratio, low if n > 1 else ratio, high, method, verdict, n))
        s.paired_baseline_step_s = 0.5
    return s


def run(config: str, repeat: int, first_step_s: float | None, ok: bool = True) -> dict:
    return {"spec": {"config": config, "repeat": repeat}, "ok": ok, "first_step_s": first_step_s}


def test_the_first_process_is_the_cold_one_and_the_others_are_warm() -> None:
    summaries = [row(BASELINE, 0.5), row("compile", 0.3, 1.66, 1.5), row("channels_last", 0.4, 1.25, 1.1)]
    runs = [run(BASELINE, 0, 0.9), run("compile", 0, 26.3), run("compile", 1, 2.2), run("compile", 2, 2.0),
            run("compile", 3, 99.0, ok=False), run("channels_last", 0, 0.8)]  # fmt: skip
    (cost,) = compile_costs(summaries, runs)
    assert (cost.config, cost.cold_first_step_s, cost.warm_first_step_s) == ("compile", 26.3, pytest.approx(2.1))
    assert cost.break_even_steps == pytest.approx((26.3 - 0.5) / 0.2)
    assert cost.text() == "compile: cold first step 26.3 s, warm 2.1 s; pays for itself after ~130 training steps"


def test_no_break_even_unless_the_speed_up_s_interval_lies_above_one() -> None:
    unclear = compile_costs([row(BASELINE, 0.5), row("compile", 0.45, 1.1, 0.95)], [run("compile", 0, 26.3)])
    assert unclear[0].break_even_steps is None and unclear[0].warm_first_step_s is None
    assert unclear[0].text() == (
        "compile: cold first step 26.3 s; no break-even: its speed-up's interval does not lie above 1"
    )
    single = compile_costs([row(BASELINE, 0.5), row("compile", 0.3, 1.66, n=1)], [run("compile", 0, 26.3)])
    assert single[0].break_even_steps is None and "one repeat" in single[0].why


def result(config: str, repeat: int, first_step_s: float) -> RunResult:
    return RunResult(spec={"config": config, "repeat": repeat}, step_times_s=[0.3, 0.31], step_median_s=0.305,
                     first_step_s=first_step_s)  # fmt: skip


def test_the_summary_s_first_step_is_the_cold_first_process_not_a_median() -> None:
    rows = summarize_runs({BASELINE: [result(BASELINE, 0, 1.0)],
                           "compile": [result("compile", 0, 30.0), result("compile", 1, 2.0),
                                       result("compile", 2, 2.0)]})  # fmt: skip
    assert {s.config: s.first_step_s for s in rows} == {BASELINE: 1.0, "compile": 30.0}


STEP = {BASELINE: 0.5, "compile_regional": 0.3, "fused_optimizer": 0.45, "fused_optimizer+compile_regional": 0.28}


def scripted(ran: list[tuple[str, int]]):
    seen: set[str] = set()

    def run_one(spec: RunSpec, tmp: Path, timeout_s: float) -> RunResult:
        ran.append((spec.config, spec.repeat))
        rng = np.random.default_rng(len(ran))
        steps = (STEP[spec.config] * (1 + 0.002 * rng.standard_normal(8))).tolist()
        cold = "compile" in spec.config and spec.config not in seen  # the configuration's first process compiles
        seen.add(spec.config)
        first = 20.0 if cold else 2.0 if "compile" in spec.config else 0.6
        return RunResult(spec={"config": spec.config, "repeat": spec.repeat}, batch_size=4, step_times_s=steps,
                         step_median_s=float(np.median(steps)), warmup_s=first + 1, first_step_s=first)  # fmt: skip

    return run_one


def test_the_bench_reports_the_cold_start_apart_and_the_recommendation_carries_the_break_even() -> None:
    ran: list[tuple[str, int]] = []
    spec = BenchSpec(configs="compile_regional,fused_optimizer", device="cpu", preset="tiny", repeats=3,
                     predict_batches=0)  # fmt: skip
    report = run_benchmark(spec, run=scripted(ran), monitor=Quiet(),  # type: ignore[arg-type]  # a scripted monitor
                           peak=lambda *a: PeakFlops(None, "unknown: test"))  # fmt: skip
    stack = "fused_optimizer+compile_regional"
    assert report.recommendation["stack"] == stack
    rows = {s.config: s for s in report.summaries}
    assert rows["compile_regional"].first_step_s == 20.0 and rows[stack].first_step_s == 20.0  # cold, not a median
    base, step = rows[stack].paired_baseline_step_s, rows[stack].step_median_s
    assert base is not None and step is not None
    expected = (20.0 - base) / (base - step)
    assert report.recommendation["break_even_steps"] == pytest.approx(expected)
    assert report.recommendation["cold_first_step_s"] == 20.0
    text = "\n".join(report.recommendation["lines"])
    assert "It compiles: its first step took 20.0 s cold; it pays for itself after ~" in text.replace("\n  ", " ")
    assert text.index("pays for itself") < text.index("Add to your Trainer:")
    lines = cold_start_lines(report)
    assert lines[0].startswith("compile_regional: cold first step 20.0 s, warm 2.0 s; pays for itself after ~")
    assert any(line.startswith(f"{stack}: cold first step 20.0 s") for line in lines)
    assert all(len(line) <= 80 for line in console_lines(report))
    assert "- `compile_regional`: cold first step 20.0 s, warm 2.0 s" in markdown_report(report)


def test_a_configuration_s_processes_share_one_compile_cache_inside_the_workdir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import os

    from lightning_perf.benchmark import isolation

    seen: list[tuple[str, str]] = []

    class Process:  # records the cache its child would get, and runs nothing
        def __init__(self, target, args, name):  # type: ignore[no-untyped-def]
            self.config, self.exitcode = args[0]["config"], 1

        def start(self) -> None:
            seen.append((self.config, os.environ["TORCHINDUCTOR_CACHE_DIR"]))

        def join(self, timeout: float | None = None) -> None:
            return None

        def is_alive(self) -> bool:
            return False

    monkeypatch.setattr(isolation.multiprocessing, "get_context", lambda method: type("C", (), {"Process": Process}))
    for config, repeat in (("compile", 0), (BASELINE, 0), ("compile", 1), ("bf16-mixed+compile", 0)):
        isolation.run_isolated(RunSpec(config=config, repeat=repeat), tmp_path, 10.0)
    caches = dict(enumerate(path for _, path in seen))
    assert caches[0] == caches[2] and len({caches[0], caches[1], caches[3]}) == 3  # per configuration, not per run
    assert all(Path(path).is_relative_to(tmp_path) for path in caches.values())
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ or os.environ["TORCHINDUCTOR_CACHE_DIR"] not in caches.values()
