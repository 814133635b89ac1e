"""The tuner re-measures what was disturbed while its budget lasts, and when it still cannot decide it says why in the
YAML's header and ends with the exact command to run later. Scripted trials and a scripted watcher; no timing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import lightning_perf.tuning.tuner as tuner_module
from lightning_perf.benchmark import threads as thread_rules
from lightning_perf.cli import main
from lightning_perf.cli.autotune import retry_command
from lightning_perf.tuning.conditions import TrialWatch
from lightning_perf.tuning.remeasure import MAX_MEASUREMENTS
from tests.tuning._scripted import script_trials, scripted_result
from tests.tuning.test_honest_tuner import LOAD, _disturbances, _tuner


def test_a_baseline_disturbed_twice_is_measured_again_and_the_search_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = script_trials(monkeypatch, {"baseline": scripted_result(0.1, 8), "+channels_last": scripted_result(0.05, 8)})
    _disturbances(monkeypatch, {"baseline": [[LOAD], [LOAD]]})  # a passing load: the third run is clean
    tuner = _tuner(optimizations=["channels_last"], time_budget_s=100.0)
    result = tuner.run()
    assert ran[:4] == ["baseline", "baseline", "baseline", "baseline (repeat)"] and "+channels_last" in ran
    base = result.trials[0]
    assert base.remeasured_because == [LOAD] and base.disturbed == []
    assert result.recommendation.reliable and result.recommendation.configs == ("channels_last",)
    assert result.undecided == [] and "baseline" in result.reliability["remeasured_trials"]
    # The two set-aside runs' time was given back to the budget (2 s each, scripted).
    assert tuner._stretch is not None and tuner._stretch.budget_s == pytest.approx(104.0)


def test_the_budget_stretches_at_most_to_twice_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    script_trials(monkeypatch, {"baseline": scripted_result(0.100, 8, wall=2.0)})
    _disturbances(monkeypatch, {"baseline": [[LOAD]] * 2})
    tuner = _tuner(optimizations=[], time_budget_s=3.0, noise_check=False)
    tuner.run()
    assert tuner._stretch is not None and tuner._stretch.budget_s == pytest.approx(6.0)  # 4 s lost, capped at 3


def test_a_reference_disturbed_every_time_stops_after_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = script_trials(monkeypatch, {"baseline": scripted_result(0.1, 8), "+channels_last": scripted_result(0.05, 8)})
    _disturbances(monkeypatch, {"baseline": [[LOAD]] * 10})
    result = _tuner(optimizations=["channels_last"], time_budget_s=100.0).run()
    assert ran == ["baseline"] * MAX_MEASUREMENTS
    assert not result.recommendation.reliable
    assert f"measured {MAX_MEASUREMENTS} times, disturbed every time" in result.trials[0].reason
    assert result.undecided and "the reference was disturbed" in result.undecided[0]


@pytest.mark.parametrize(("third", "reliable"), [(0.104, True), (0.600, False)])
def test_two_baselines_apart_get_a_third_run(monkeypatch: pytest.MonkeyPatch, third: float, reliable: bool) -> None:
    script = {"baseline": scripted_result(0.100, 8), "baseline (repeat)": scripted_result(0.278, 8),
              "baseline (again)": scripted_result(third, 8), "+channels_last": scripted_result(0.05, 8)}  # fmt: skip
    ran = script_trials(monkeypatch, script)
    result = _tuner(optimizations=["channels_last"], time_budget_s=100.0).run()
    assert ran[:3] == ["baseline", "baseline (repeat)", "baseline (again)"]
    assert result.recommendation.reliable is reliable and ("+channels_last" in ran) is reliable
    again = next(t for t in result.trials if t.label == "baseline (again)")
    if reliable:
        assert "baseline (repeat) (34.8 ms per sample) set aside" in again.reason
    else:
        assert any("agreed with neither" in c for c in result.recommendation.causes)


def test_the_trials_run_with_the_threads_decided_at_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    script_trials(monkeypatch, {"baseline": scripted_result(0.100, 8)})  # 2 usable cores
    monkeypatch.setattr(thread_rules, "load_average", lambda: 1.4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    tuner = _tuner(optimizations=[])
    result = tuner.run()
    assert result.to_dict()["threads"]["threads"] == 1 and tuner._watch.threads == 1
    assert tuner._spec(tuner_module.Candidate("baseline", "baseline")).threads == 1
    assert "# measured with 1 intra-op thread(s) per trial" in result.to_yaml()
    assert _tuner(optimizations=[], threads=2).threads == 2
    with pytest.raises(ValueError, match=r"AutoTuner\(threads=0\)"):
        _tuner(threads=0)


@pytest.mark.parametrize(
    ("load", "threads", "watched", "rerun"),
    [
        (lambda t: 2.0 if t < 40 else 0.0, 2, 40.0, False),  # a burst that ends within the minute: the quiet choice
        (lambda t: 2.0, 1, 60.0, False),  # a steady load: the loaded choice, after the whole minute
        (lambda t: 2.0 if t < 61.5 else 0.0, 1, 60.0, True),  # outlasted the watch, gone by the end: said
    ],
)
def test_a_load_at_the_start_is_watched_before_the_trials_threads_are_chosen(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    load: Any,
    threads: int,
    watched: float,
    rerun: bool,
) -> None:
    real_sample = thread_rules.sample_other_cores
    script_trials(monkeypatch, {"baseline": scripted_result(0.100, 8)})  # 2 usable cores, load average 0
    monkeypatch.setattr(thread_rules, "sample_other_cores", real_sample)
    monkeypatch.setattr(thread_rules, "START_WATCH_S", 60.0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    clock = [0.0]

    def other_cores_now(self: TrialWatch, window_s: float = 1.0) -> float:  # a scripted load read on a scripted clock
        clock[0] += window_s
        return load(clock[0])

    monkeypatch.setattr(TrialWatch, "other_cores_now", other_cores_now)
    tuner = _tuner(optimizations=[], progress=True)
    result = tuner.run()
    record = result.to_dict()["threads"]
    assert (record["threads"], record["watched_s"], record["start_other_cores"]) == (threads, watched, 2.0)
    assert (
        tuner._watch.threads == threads
        and tuner._spec(tuner_module.Candidate("baseline", "baseline")).threads == threads
    )
    assert capsys.readouterr().out.count(thread_rules.WATCH_LINE) == 1
    (note,) = [n for n in result.recommendation.notes if n.startswith("other load at start")]
    assert f"watched {watched:.0f} s" in note and ("a quiet re-run would use 2 threads" in note) is rerun


def test_an_undecided_run_ends_with_the_command_and_an_explained_empty_yaml(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script_trials(monkeypatch, {"baseline": scripted_result(0.100, 8)})
    _disturbances(monkeypatch, {"baseline": [[LOAD]] * 10})
    out = tmp_path / "tuned.yaml"
    argv = ["autotune", "--workload", "convnet", "--preset", "tiny", "--optimizations", "channels_last",
            "--no-batch-size", "--no-data-loading", "--time-budget", "100", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    command = "lightning-perf " + " ".join(argv)
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == f"run this when the machine is quiet: {command}"
    text = out.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any(line.startswith("# trainer: {} below: nothing decided") and LOAD in line for line in header)
    assert f"# run this when the machine is quiet: {command}" in header
    assert yaml.safe_load(text) == {"trainer": {}}
    data: dict[str, Any] = yaml.safe_load(out.with_suffix(".json").read_text())
    assert data["retry_command"] == command and data["undecided"]


def test_a_decided_empty_yaml_says_why_too(monkeypatch: pytest.MonkeyPatch) -> None:
    script_trials(monkeypatch, {"baseline": scripted_result(0.100, 8), "+channels_last": scripted_result(0.099, 8)})
    result = _tuner(optimizations=["channels_last"]).run()
    assert result.undecided == [] and result.next_step() is None
    assert "# trainer: {} below: no candidate was measurably faster; keep the Trainer as it is" in result.to_yaml()


def test_the_retry_command_doubles_the_budget_only_when_it_ran_short() -> None:
    argv = ["autotune", "--workload", "convnet", "--time-budget", "60"]
    assert retry_command(argv, 60.0, ["the reference was disturbed (x)"]) == "lightning-perf " + " ".join(argv)
    short = ["not measured or not confirmed for lack of budget: +compile"]
    assert retry_command(argv, 60.0, short).endswith("--time-budget 120")
    assert retry_command(["autotune", "--time-budget=60"], 60.0, short).endswith("--time-budget=120")
    assert retry_command(["autotune", "--model", "a b:C"], 300.0, short) == (
        "lightning-perf autotune --model 'a b:C' --time-budget 600"
    )
