"""Comparing two results files: loading both formats, matching, refusing incompatible files, verdicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightning_perf.benchmark.compare import (
    BENCH_KIND,
    PYTEST_BENCHMARK_KIND,
    IncompatibleResultsError,
    ResultsFileError,
    compare_files,
    compare_results,
    load_results,
)
from lightning_perf.benchmark.compare_text import format_table, markdown_report
from tests.benchmark._compare_files import bench_results, pytest_benchmark_results, scaled, write

DOCS_BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench" / "convnet-cpu.json"


def _compare(tmp_path: Path, old: dict, new: dict, **kwargs: Any):
    """Write ``old`` and ``new`` as a.json and b.json and compare them."""
    return compare_files(write(tmp_path / "a.json", old), write(tmp_path / "b.json", new), **kwargs)


def _verdicts(comparison, metric: str = "step time") -> dict[str, str]:
    return {row.config: row.verdict for row in comparison.rows if row.metric == metric}


# ------------------------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("new_format", [True, False])
def test_bench_file_gives_every_figure_per_configuration(tmp_path: Path, new_format: bool) -> None:
    loaded = load_results(write(tmp_path / "a.json", bench_results(new_format=new_format)))
    assert loaded.kind == BENCH_KIND
    assert set(loaded.entries) == {"baseline", "channels_last"}
    baseline = loaded.entries["baseline"]
    assert [len(g) for g in baseline.repeats["step_time"]] == [20, 20, 20]
    assert [len(g) for g in baseline.repeats["throughput"]] == [1, 1, 1]
    assert [len(g) for g in baseline.repeats["step_memory"]] == [1, 1, 1]
    assert [len(g) for g in baseline.repeats["predict_time"]] == ([8] * 3 if new_format else [1] * 3)
    assert loaded.identity["workload"] == "convnet"
    assert loaded.identity["batch size"] == 32
    assert loaded.machine["CPU"] == "Test CPU"
    assert ("commit 0123456789 (dirty)" in loaded.description) is new_format  # the new format's run metadata


def test_a_real_old_format_file_from_the_docs() -> None:
    loaded = load_results(DOCS_BENCH)
    assert "baseline" in loaded.entries
    assert len(loaded.entries["baseline"].repeats["step_time"]) == 3
    comparison = compare_results(loaded, load_results(DOCS_BENCH))
    assert comparison.rows and not comparison.regressions
    assert set(_verdicts(comparison).values()) == {"no clear difference"}


def test_pytest_benchmark_file_with_and_without_raw_data(tmp_path: Path) -> None:
    with_data = load_results(write(tmp_path / "a.json", pytest_benchmark_results()))
    assert with_data.kind == PYTEST_BENCHMARK_KIND
    assert [len(g) for g in with_data.entries["my-model/test_steps[baseline]"].repeats["time"]] == [30]
    stats_only = load_results(write(tmp_path / "b.json", pytest_benchmark_results(save_data=False)))
    entry = stats_only.entries["my-model/test_steps[baseline]"]
    assert not entry.repeats and entry.stats_only["time"] == pytest.approx(0.01, rel=0.05)


def test_a_failed_or_skipped_configuration_is_named_not_compared(tmp_path: Path) -> None:
    data = bench_results()
    broken = json.loads(json.dumps(data))
    for run in broken["runs"]:
        if run["spec"]["config"] == "channels_last":
            run.update(ok=False, error="RuntimeError: boom", step_times_s=[], throughput=None, step_memory_bytes=None)
            run.update(predict_step_times_s=[], step_median_s=None, predict_step_median_s=None)
    comparison = _compare(tmp_path, data, broken)
    assert {row.config for row in comparison.rows} == {"baseline"}
    assert any("channels_last" in note and "failed: RuntimeError: boom" in note for note in comparison.notes)


def test_summary_without_runs_gives_a_ratio_but_no_verdict(tmp_path: Path) -> None:
    data = bench_results()
    data["runs"] = []
    comparison = _compare(tmp_path, data, scaled(data, 2.0))
    step = [row for row in comparison.rows if row.metric == "step time"]
    assert [row.ratio for row in step] == pytest.approx([2.0, 2.0])
    assert all(row.verdict == "no clear difference" and row.note for row in step)
    assert not comparison.regressions


# --------------------------------------------------------------------------------------------------- comparisons


def test_a_file_against_itself_finds_no_regression(tmp_path: Path) -> None:
    path = write(tmp_path / "a.json", bench_results())
    comparison = compare_files(path, path)
    assert not comparison.regressions
    assert {row.metric for row in comparison.rows} == {"step time", "throughput", "step memory", "predict time"}
    assert all(row.ratio == pytest.approx(1.0) for row in comparison.rows)
    assert all(row.ratio_ci95[0] <= 1.0 <= row.ratio_ci95[1] for row in comparison.rows)


def test_doubled_step_times_are_a_regression_of_every_configuration(tmp_path: Path) -> None:
    comparison = _compare(tmp_path, bench_results(), scaled(bench_results(), 2.0))
    assert _verdicts(comparison) == {"baseline": "slower", "channels_last": "slower"}
    assert _verdicts(comparison, "throughput") == {"baseline": "slower", "channels_last": "slower"}
    assert {row.config for row in comparison.regressions} == {"baseline", "channels_last"}
    assert _verdicts(comparison, "step memory") == {"baseline": "no clear difference"} | {
        "channels_last": "no clear difference"
    }


def test_only_the_slowed_configuration_is_named(tmp_path: Path) -> None:
    data = bench_results()
    new = scaled(data, 2.0, configs=("channels_last",))
    comparison = _compare(tmp_path, data, new)
    assert {row.config for row in comparison.regressions} == {"channels_last"}
    assert _verdicts(comparison)["baseline"] == "no clear difference"


def test_halved_step_times_are_faster_not_a_regression(tmp_path: Path) -> None:
    comparison = _compare(tmp_path, bench_results(), scaled(bench_results(), 0.5))
    assert set(_verdicts(comparison).values()) == {"faster"}
    assert not comparison.regressions


def test_a_rerun_with_fresh_noise_is_no_clear_difference(tmp_path: Path) -> None:
    comparison = _compare(tmp_path, bench_results(seed=1), bench_results(seed=2))
    assert set(_verdicts(comparison).values()) == {"no clear difference"}
    assert not comparison.regressions


def test_a_small_slowdown_inside_the_threshold_is_no_clear_difference(tmp_path: Path) -> None:
    comparison = _compare(tmp_path, bench_results(), scaled(bench_results(), 1.03))
    assert not comparison.regressions
    tight = compare_files(tmp_path / "a.json", tmp_path / "b.json", threshold=0.0)
    assert tight.regressions  # the same 3% is called once no threshold shields it


def test_configurations_in_one_file_only_are_listed(tmp_path: Path) -> None:
    comparison = _compare(
        tmp_path,
        bench_results({"baseline": 0.1, "compile": 0.07}),
        bench_results({"baseline": 0.1, "channels_last": 0.08}),
    )
    assert comparison.only_in_old == ["compile"] and comparison.only_in_new == ["channels_last"]
    assert {row.config for row in comparison.rows} == {"baseline"}


def test_one_process_a_side_gives_an_indicative_interval_and_no_verdict(tmp_path: Path) -> None:
    # Every round of a pytest-benchmark file ran in one process: its steps cannot show the swing between processes.
    new = pytest_benchmark_results({"test_steps[baseline]": 0.02}, seed=5)
    comparison = _compare(tmp_path, pytest_benchmark_results(), new)
    (row,) = comparison.rows
    assert row.verdict == "no clear difference" and not comparison.regressions
    assert row.ratio == pytest.approx(2.0, rel=0.05) and row.ratio_ci95 is None and (row.n_old, row.n_new) == (1, 1)
    assert 1.5 < row.within_process_ci95[0] <= row.ratio <= row.within_process_ci95[1] and "one repeat" in row.note
    assert "(+" in format_table(comparison) and comparison.only_in_old == ["my-model/test_steps[channels_last]"]


def test_bench_file_with_one_repeat_against_three_gets_no_verdict(tmp_path: Path) -> None:
    comparison = _compare(tmp_path, bench_results(repeats=1), scaled(bench_results(), 2.0))
    assert _verdicts(comparison) == {"baseline": "no clear difference", "channels_last": "no clear difference"}
    assert all(row.ratio_ci95 is None and row.n_old == 1 and row.n_new == 3 for row in comparison.rows)


def test_pytest_benchmark_statistics_only(tmp_path: Path) -> None:
    new = pytest_benchmark_results({"test_steps[baseline]": 0.02}, save_data=False)
    (row,) = _compare(tmp_path, pytest_benchmark_results(save_data=False), new).rows
    assert row.ratio == pytest.approx(2.0, rel=0.05) and row.verdict == "no clear difference"
    assert row.ratio_ci95 is None and row.within_process_ci95 is None and "statistics only" in row.note


def test_mixed_raw_and_statistics_only_files_use_the_statistics(tmp_path: Path) -> None:
    rows = _compare(tmp_path, pytest_benchmark_results(), pytest_benchmark_results(save_data=False)).rows
    assert rows and all(row.ratio_ci95 is None and row.verdict == "no clear difference" for row in rows)


# ------------------------------------------------------------------------------------------------- incompatible


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"workload": "lm"}, "different workload (old 'convnet', new 'lm')"),
        ({"batch_size": 64}, "different batch size (old 32, new 64)"),
        ({"device": "cuda"}, "different device (old 'cpu', new 'cuda')"),
        ({"cpu": "Other CPU"}, "different machine: CPU (old 'Test CPU', new 'Other CPU')"),
    ],
)
def test_incompatible_bench_files_are_refused_naming_the_difference(tmp_path: Path, change: dict, named: str) -> None:
    with pytest.raises(IncompatibleResultsError) as info:
        _compare(tmp_path, bench_results(), bench_results(**change))
    assert named in str(info.value)
    assert "\n" not in str(info.value)


def test_a_bench_file_and_a_pytest_benchmark_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(IncompatibleResultsError, match="lightning-perf-bench file with a pytest-benchmark file"):
        _compare(tmp_path, bench_results(), pytest_benchmark_results())


def test_pytest_benchmark_files_from_different_cpus_are_refused(tmp_path: Path) -> None:
    other = pytest_benchmark_results()
    other["machine_info"]["cpu"]["brand_raw"] = "Other CPU"
    with pytest.raises(IncompatibleResultsError, match="CPU"):
        _compare(tmp_path, pytest_benchmark_results(), other)


def test_a_machine_recorded_by_one_file_only_is_not_a_difference(tmp_path: Path) -> None:
    data = bench_results()
    bare = json.loads(json.dumps(data))
    del bare["machine"], bare["environment"]
    assert _compare(tmp_path, data, bare).rows


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("", "is not valid JSON"),
        ("[1, 2]", "is a JSON list"),
        ('{"kind": "lightning-perf-autotune"}', "of kind 'lightning-perf-autotune'"),
        ('{"a": 1}', "of an unknown kind"),
        ('{"kind": "lightning-perf-bench", "options": {}, "summary": 3}', "summary is a JSON int"),
        ('{"kind": "lightning-perf-bench", "options": {}, "summary": [], "runs": [{"spec": {}}]}', "spec.config"),
        (
            '{"kind": "lightning-perf-bench", "options": {}, "summary": [], '
            '"runs": [{"spec": {"config": "a"}, "step_times_s": ["x"]}]}',
            "step_times_s[0] is a JSON str",
        ),
        ('{"benchmarks": [{"name": "t", "stats": {"median": "fast"}}]}', "stats.median is 'fast'"),
        ('{"benchmarks": [{"stats": {}}]}', "benchmarks[0].name"),
    ],
)
def test_malformed_files_raise_one_line_naming_the_file(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ResultsFileError) as info:
        load_results(path)
    text = str(info.value)
    assert text.startswith(str(path)) and message in text and "\n" not in text


def test_missing_directory_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(ResultsFileError, match="no such file"):
        load_results(tmp_path / "missing.json")
    with pytest.raises(ResultsFileError, match="directory"):
        load_results(tmp_path)
    binary = tmp_path / "b.json"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(ResultsFileError, match="not text"):
        load_results(binary)


@pytest.mark.parametrize("threshold", [-0.01, float("nan"), True])
def test_bad_threshold_is_refused(tmp_path: Path, threshold: float) -> None:
    path = write(tmp_path / "a.json", bench_results())
    with pytest.raises(ValueError, match="threshold"):
        compare_files(path, path, threshold)


# ----------------------------------------------------------------------------------------------------- printing


def test_table_fits_80_columns_and_names_the_regression(tmp_path: Path) -> None:
    data = bench_results({"baseline": 0.1, "channels_last+compile+fused_optimizer+a_very_long_name_indeed": 0.08})
    comparison = _compare(tmp_path, data, scaled(data, 2.0))
    text = format_table(comparison)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "REGRESSION beyond 5% and the noise: baseline (step time +100%)" in text.replace("\n  ", " ")
    assert "slower" in text and "95% interval" in text


def test_reports_as_markdown_and_json(tmp_path: Path) -> None:
    comparison = _compare(tmp_path, bench_results(), scaled(bench_results(), 2.0))
    md = markdown_report(comparison)
    assert "| baseline | step time |" in md and "**slower**" in md
    report = comparison.to_dict()
    json.dumps(report, allow_nan=False)
    row = report["rows"][0]
    assert row["config"] == "baseline" and row["metric"] == "step time"
    assert row["old_median_s"] == pytest.approx(row["new_median_s"] / 2, rel=1e-9)
    low, high = row["ratio_ci95"]
    assert low <= row["ratio"] <= high and row["verdict"] == "slower"
    assert "baseline: step time" in report["regressions"]


def test_a_disturbed_run_is_warned_about_and_its_rows_marked(tmp_path: Path) -> None:
    data = bench_results()
    causes = ["other processes took 40% of the CPU"]
    data["reliability"] = {"reliable": False, "causes": causes, "disturbed_configs": ["channels_last"]}
    comparison = _compare(tmp_path, data, bench_results())
    assert "other processes took 40% of the CPU" in format_table(comparison).replace("\n  ", " ")
    notes = {row.config: row.note for row in comparison.rows if row.metric == "step time"}
    assert notes == {"baseline": None, "channels_last": "disturbed in the old run: read with care"}


def test_summary_with_per_repeat_step_times_and_no_runs(tmp_path: Path) -> None:
    data = bench_results()
    by_config: dict[str, list] = {}
    for run in data["runs"]:
        by_config.setdefault(run["spec"]["config"], []).append(run["step_times_s"])
    for row in data["summary"]:
        row["step_times_s"] = by_config[row["config"]]
    data["runs"] = []
    doubled = json.loads(json.dumps(data))
    for row in doubled["summary"]:
        row["step_times_s"] = [[2 * t for t in repeat] for repeat in row["step_times_s"]]
    loaded = load_results(write(tmp_path / "a.json", data))
    assert [len(g) for g in loaded.entries["baseline"].repeats["step_time"]] == [20, 20, 20]
    comparison = compare_files(tmp_path / "a.json", write(tmp_path / "b.json", doubled))
    assert _verdicts(comparison) == {"baseline": "slower", "channels_last": "slower"}
