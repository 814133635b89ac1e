"""The bench's summary rows: intervals and verdicts per ratio, disturbed rows marked, likely causes, 80 columns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightning_perf.benchmark.report import CONSOLE_COLUMNS, console_rows, reliability_lines, table_rows, unused_output
from lightning_perf.benchmark.results import BenchReport, RunEvent
from lightning_perf.benchmark.runner import add_likely_causes, mark_disturbed, summarize_runs
from lightning_perf.benchmark.spec import BenchSpec
from lightning_perf.benchmark.worker import RunResult
from lightning_perf.optimizations import BASELINE
from lightning_perf.profiling.reliability import Reliability, RunConditions
from tests._models import run_result


def _run(config: str, repeat: int, step: float, seed: int, memory: int = 100, warmup: float = 1.0) -> RunResult:
    rng = np.random.default_rng(seed)
    steps = (step * (1 + 0.03 * rng.standard_normal(12))).tolist()
    predict = (step / 3 * (1 + 0.03 * rng.standard_normal(5))).tolist()
    predict_fields = {"predict_step_median_s": float(np.median(predict)), "predict_step_times_s": predict}
    predict_fields["predict_throughput"] = 4 / float(np.median(predict))
    return run_result(config, repeat, steps, memory, warmup_s=warmup, final_train_loss=0.5, **predict_fields)


def _results(repeats: int) -> dict[str, list[RunResult]]:
    return {
        BASELINE: [_run(BASELINE, r, 0.2, seed=r, memory=400) for r in range(repeats)],
        "fast": [_run("fast", r, 0.1, seed=10 + r, memory=100) for r in range(repeats)],
        "same": [_run("same", r, 0.2, seed=20 + r, memory=400) for r in range(repeats)],
        "slow": [_run("slow", r, 0.5, seed=30 + r, memory=400, warmup=9.0) for r in range(repeats)],
    }


@pytest.mark.parametrize("repeats", [2, 5])
def test_every_ratio_has_an_interval_a_verdict_and_a_method(repeats: int) -> None:
    method = "t interval over paired repeats"  # from two repeats on: the spread between processes counts
    rows = {s.config: s for s in summarize_runs(_results(repeats))}
    assert rows[BASELINE].speedup == 1.0 and rows[BASELINE].speedup_ci95 is None
    for name, verdict in (("fast", "faster"), ("same", "no clear difference"), ("slow", "slower")):
        row = rows[name]
        low, high = row.speedup_ci95
        assert low <= row.speedup <= high
        assert row.speedup_verdict == verdict and row.speedup_method == method and row.speedup_n == repeats
        assert row.predict_speedup_verdict == verdict
        assert row.predict_speedup_ci95[0] <= row.predict_speedup <= row.predict_speedup_ci95[1]
        assert len(row.step_times_s) == repeats and all(len(s) == 12 for s in row.step_times_s)
    assert rows["fast"].memory_ratio == pytest.approx(0.25) and rows["fast"].memory_ratio_verdict == "less memory"
    assert rows["same"].memory_ratio_verdict == "no clear difference"


def test_a_slower_configuration_names_its_likely_cause() -> None:
    results = _results(2)
    results["bf16-mixed"] = [_run("bf16-mixed", r, 0.8, seed=40 + r) for r in range(2)]
    results["compile"] = [_run("compile", r, 0.3, seed=50 + r, warmup=30.0) for r in range(2)]
    rows = summarize_runs(results)
    options = BenchSpec(configs=["bf16-mixed"], preset="tiny")
    add_likely_causes(rows, {"cpu_bf16_instructions": False}, options)
    by_name = {s.config: s for s in rows}
    assert "bf16 is emulated" in by_name["bf16-mixed"].likely_cause
    assert "compile warm-up not amortized" in by_name["compile"].likely_cause
    assert by_name["fast"].likely_cause is None and by_name["slow"].likely_cause is None  # not a known optimization
    rows = summarize_runs(results)
    add_likely_causes(rows, {"cpu_bf16_instructions": True}, options)
    assert {s.config: s for s in rows}["bf16-mixed"].likely_cause is None


def _conditions(config: str, repeat: int) -> RunConditions:
    return RunConditions(f"{config}, repeat {repeat + 1}", 1.0, 0.0, 0.0, config=config, repeat=repeat)


def test_disturbed_rows_are_marked_and_never_printed_as_clean() -> None:
    rows = summarize_runs(_results(2))
    watched = [_conditions(s, r) for s in ("fast", "same", "slow", BASELINE) for r in range(2)]
    mark_disturbed(rows, Reliability(True), watched)
    assert not any(s.disturbed for s in rows)
    clean = {r[0]: r for r in console_rows(BenchReport(options={}, command="x", summaries=rows))}
    assert "?" not in clean["fast"][2] and "disturbed" not in clean["fast"][3]

    mark_disturbed(rows, Reliability(False, ["other processes' load"], disturbed_runs=["fast, repeat 2"]), watched)
    assert [s.config for s in rows if s.disturbed] == ["fast"]
    report = BenchReport(
        options={}, command="x", summaries=rows, reliability={"reliable": False, "causes": ["other processes' load"]}
    )
    printed = {r[0]: r for r in console_rows(report)}
    assert printed["fast"][2].startswith("?") and "(disturbed)" in printed["fast"][3]
    assert "?" not in printed["same"][2]
    assert {r[0]: r for r in table_rows(report)}["fast"][2].startswith("?")
    assert reliability_lines(report) == ["warning: measurement disturbed by other processes' load"]

    # A disturbed baseline touches every ratio: they are all paired with it.
    mark_disturbed(rows, Reliability(False, ["x"], disturbed_runs=["baseline, repeat 1"]), watched)
    assert all(s.disturbed for s in rows)


def test_the_console_table_fits_80_columns() -> None:
    from lightning_perf.profiling.report import text_table

    results = _results(2)
    results["channels_last+compile+fused_optimizer"] = [
        _run("channels_last+compile+fused_optimizer", r, 0.5, seed=60 + r, warmup=30.0) for r in range(2)
    ]
    rows = summarize_runs(results)
    add_likely_causes(rows, {"cpu_bf16_instructions": False}, BenchSpec(preset="tiny"))
    for s in rows:
        s.disturbed = True
    text = text_table(list(CONSOLE_COLUMNS), console_rows(BenchReport(options={}, command="x", summaries=rows)))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "faster" in text and "slower" in text and "(disturbed)" in text


def test_outputs_get_a_run_number_instead_of_being_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "convnet.json"
    assert unused_output(out) == out
    out.with_suffix(".md").write_text("old")
    assert unused_output(out) == tmp_path / "convnet-2.json"
    (tmp_path / "convnet-2.json").write_text("{}")
    assert unused_output(out) == tmp_path / "convnet-3.json"
    assert unused_output(out, force=True) == out


def test_a_progress_line_says_what_finished_and_what_is_left() -> None:
    event = RunEvent("channels_last", 0, 3, 2, 9, 0.0412, 32.0, 112.0, "ok")
    assert event.line() == "[2/9] channels_last repeat 1/3: step 41.2 ms, elapsed 0:32, about 1:52 left"
    skipped = RunEvent("16-mixed", 2, 3, 9, 9, None, 65.0, 0.0, "skipped: needs a CUDA device")
    assert skipped.line() == "[9/9] 16-mixed repeat 3/3: skipped: needs a CUDA device, 1:05, ~0:00 left"
    # A stack's long name: the clocks lose their words first, then the name its middle; never past 80 columns.
    stack = RunEvent("bf16-mixed+channels_last", 2, 3, 12, 14, 0.1523, 139.0, 11.0, "ok")
    assert stack.line() == "[12/14] bf16-mixed+channels_last repeat 3/3: step 152.3 ms, 2:19, ~0:11 left"
    longer = RunEvent("bf16-mixed+channels_last+fused_optimizer+compile", 2, 3, 12, 14, 0.1523, 139.0, 11.0, "ok")
    assert len(longer.line()) == 80 and "…" in longer.line() and longer.line().endswith("~0:11 left")
