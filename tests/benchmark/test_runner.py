"""The harness's arithmetic: paired ratios per repeat, spread over repeats, failures and skips kept visible."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_perf.benchmark.report import table_rows
from lightning_perf.benchmark.results import BenchReport
from lightning_perf.benchmark.runner import summarize_runs
from lightning_perf.benchmark.spec import BenchSpec
from lightning_perf.benchmark.worker import RunResult
from tests._models import run_result


def _result(config: str, repeat: int, step: float, memory: int = 100, predict: float = 10.0) -> RunResult:
    extra = {"step_median_s": step, "throughput": 4 / step, "final_train_loss": 0.5}  # exact, not a float's median
    predict_fields = {"predict_throughput": predict, "predict_step_median_s": 4 / predict}
    return run_result(config, repeat, [step * 0.9, step, step * 1.1], memory, **extra, **predict_fields)


def test_ratios_are_paired_within_a_repeat() -> None:
    # The machine got twice as slow in repeat 1; paired ratios stay exactly 2x, unpaired medians would not.
    results = {
        "baseline": [_result("baseline", 0, 0.2, memory=400), _result("baseline", 1, 0.4, memory=400)],
        "fast": [_result("fast", 0, 0.1, memory=100, predict=30.0), _result("fast", 1, 0.2, memory=100, predict=30.0)],
    }
    baseline, fast = summarize_runs(results)
    assert baseline.speedup == pytest.approx(1.0)
    assert fast.speedup == pytest.approx(2.0)
    assert (fast.speedup_min, fast.speedup_max) == (pytest.approx(2.0), pytest.approx(2.0))
    assert fast.step_median_s == pytest.approx(0.15)
    assert (fast.step_min_s, fast.step_max_s) == (pytest.approx(0.1), pytest.approx(0.2))
    assert fast.memory_ratio == pytest.approx(0.25)
    assert fast.predict_speedup == pytest.approx(3.0)


def test_failures_and_skips_are_reported_not_dropped() -> None:
    results = {
        "baseline": [_result("baseline", 0, 0.2)],
        "broken": [RunResult(spec={"config": "broken", "repeat": 0}, ok=False, error="RuntimeError: boom")],
        "gpu": [RunResult(spec={"config": "gpu", "repeat": 0}, ok=False, skipped="needs a CUDA device")],
    }
    summaries = summarize_runs(results)
    by_name = {s.config: s for s in summaries}
    assert by_name["broken"].error == "RuntimeError: boom" and by_name["broken"].speedup is None
    assert by_name["gpu"].skipped == "needs a CUDA device" and by_name["gpu"].error is None
    report = BenchReport(options={}, command="x", summaries=summaries)
    assert [s.config for s in report.failed] == ["broken"]
    rows = {row[0]: row for row in table_rows(report)}
    assert rows["broken"][1] == "failed: RuntimeError: boom"
    assert rows["gpu"][1] == "skipped: needs a CUDA device"


def test_spec_adds_baseline_and_validates() -> None:
    spec = BenchSpec(workload="convnet", configs=["bf16-mixed"], preset="tiny", device="cpu")
    assert spec.names == ("baseline", "bf16-mixed")
    with pytest.raises(ValueError, match=r"workload='nope'\)` is not valid. Expected one of convnet"):
        BenchSpec(workload="nope")
    with pytest.raises(ValueError, match=r"steps=0\)` is not valid"):
        BenchSpec(steps=0)
    with pytest.raises(ValueError, match=r"device='tpu'\)` is not valid"):
        BenchSpec(device="tpu")


def test_worker_records_losses_and_data_wait_for_a_custom_builder() -> None:
    """The auto-tuner's path through the worker: a builder of the user's objects, per-step losses, data wait."""
    from lightning_perf.benchmark.sources import apply_data_settings
    from lightning_perf.benchmark.spec import RunSpec
    from lightning_perf.benchmark.worker import MEMORY_STEPS, SETTLE_STEPS, run
    from tests.tuning._user_models import PlainDataModule, SmallConvNet

    def build(spec: RunSpec) -> tuple[SmallConvNet, PlainDataModule]:
        model, data = SmallConvNet(), PlainDataModule(batch_size=4)
        apply_data_settings(model, data, spec.batch_size, spec.loader_overrides)
        return model, data

    spec = RunSpec(workload="mine", config="baseline", steps=4, warmup_steps=2, predict_batches=0, batch_size=6)
    result = run(spec, build=build)
    assert result.ok and result.batch_size == 6
    # Every step's loss: 2 warm-up, the CPU's memory and settling steps (untimed), 4 timed.
    assert len(result.losses) == 6 + MEMORY_STEPS + SETTLE_STEPS and all(loss > 0 for loss in result.losses)
    assert len(result.step_times_s) == 4
    assert len(result.data_wait_s) == 4 and all(0 <= w < max(result.step_times_s) for w in result.data_wait_s)
    assert result.throughput == pytest.approx(6 / result.step_median_s)


def test_a_cpu_run_measures_memory_before_it_times_steps_at_full_allocation_speed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Memory over the steps right after the warm-up under the truthful allocator setting (the process starts with
    it), switched off before a settling step and the timed ones: a step under it pays page faults per large tensor
    (the default lm: 300 ms instead of 156 ms), which the bench once timed as the configurations' steps."""
    from lightning_perf.benchmark import worker
    from lightning_perf.benchmark.spec import RunSpec
    from tests.tuning._user_models import PlainDataModule, SmallConvNet

    events: list[str] = []

    class Logged(SmallConvNet):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            events.append("step")
            return super().training_step(batch, batch_idx)

    monkeypatch.setattr(worker, "truthful_cpu_peak", lambda on=True: events.append(f"truthful={on}") or True)
    spec = RunSpec(workload="mine", config="baseline", steps=4, warmup_steps=2, predict_batches=0)
    result = worker.run(spec, build=lambda _: (Logged(), PlainDataModule(batch_size=4)))
    assert result.ok and result.step_memory_bytes is not None
    untimed = 2 + worker.MEMORY_STEPS + worker.SETTLE_STEPS
    assert events.count("truthful=False") == 1 and events.index("truthful=False") == 2 + worker.MEMORY_STEPS
    assert len(events) == untimed + 4 + 1 and len(result.step_times_s) == 4  # the last 4 steps are the timed ones


def test_a_callback_that_did_not_apply_is_kept_and_noted_beside_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """channels_last on a model without convolutions measures the plain model: the report says so, not stderr alone."""
    from lightning_perf import _warnings
    from lightning_perf.benchmark.runner import _no_effect_notes
    from lightning_perf.benchmark.sources import apply_data_settings
    from lightning_perf.benchmark.spec import RunSpec
    from lightning_perf.benchmark.worker import run
    from tests.tuning._user_models import PlainDataModule, SmallMLP

    monkeypatch.setattr(_warnings, "_emitted", set())  # warn_once: an earlier test in this process may have said it

    def build(spec: RunSpec) -> tuple[SmallMLP, PlainDataModule]:
        model, data = SmallMLP(), PlainDataModule(batch_size=4)
        apply_data_settings(model, data, spec.batch_size, spec.loader_overrides)
        return model, data

    spec = RunSpec(workload="mine", config="channels_last", steps=2, warmup_steps=1, predict_batches=0)
    with pytest.warns(_warnings.NoEffectWarning, match="ChannelsLastCallback"):  # still shown, not swallowed
        result = run(spec, build=build)
    assert result.ok and len(result.no_effect) == 1 and "ChannelsLastCallback" in result.no_effect[0]
    plain = run(RunSpec(workload="mine", config="baseline", steps=2, warmup_steps=1, predict_batches=0), build=build)
    assert plain.no_effect == []
    again = RunResult(spec={"config": "channels_last", "repeat": 1}, no_effect=list(result.no_effect))
    notes = _no_effect_notes({"baseline": [plain], "channels_last": [result, again]})
    assert len(notes) == 1 and notes[0].startswith("channels_last: did not apply, so this row measures without it: ")


def test_every_row_says_the_baseline_its_ratio_used_and_the_stack_row_gets_the_flops() -> None:
    from lightning_perf.benchmark.runner import _paired_baseline_notes

    base = [_result("baseline", r, step) for r, step in enumerate((0.2, 0.2, 0.3, 0.3))]  # the stack's rounds: slower
    base[0].flops_per_step = 10**9
    results = {"baseline": base, "a": [_result("a", 0, 0.1), _result("a", 1, 0.1)],
               "a+b": [_result("a+b", 2, 0.1), _result("a+b", 3, 0.1)]}  # fmt: skip
    rows = {s.config: s for s in summarize_runs(results)}
    assert rows["a"].paired_baseline_step_s == pytest.approx(0.2) and rows[
        "a+b"
    ].paired_baseline_step_s == pytest.approx(0.3)
    assert rows["a+b"].flops_per_step == 10**9  # counted on repeat 0, which the stack never runs
    notes = _paired_baseline_notes(list(rows.values()))
    assert len(notes) == 2 and notes[0].startswith(
        "a: its speed-up pairs with baseline's runs of the same repeats, 200.0 ms"
    )


def test_the_attention_swap_is_decided_by_a_configurations_first_run_and_replayed_by_the_later_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Worker: the first run times (scripted here), records the decision and its timings; a run handed that decision
    runs the same code without timing and says so. Runner: only the first run decides; every later repeat of that
    configuration is handed its decision, and the report's notes say what was decided from which timings."""
    import json
    from dataclasses import replace

    from lightning_perf.benchmark import runner, worker
    from lightning_perf.benchmark.spec import RunSpec
    from lightning_perf.profiling import PeakFlops
    from tests.benchmark.test_auto_bench import Quiet
    from tests.callbacks.test_flash_attention import GPTModule

    timed: list[int] = []
    scripted = lambda *args, **kwargs: timed.append(1) or (1.0, 2.0)  # noqa: E731  own code faster: kept
    monkeypatch.setattr("lightning_perf.callbacks.flash_attention.time_against_original", scripted)
    spec = RunSpec(workload="mine", config="bf16-mixed+flash_attention", steps=2, warmup_steps=1, predict_batches=0)
    first = worker.run(spec, build=lambda _: (GPTModule(), None))
    assert first.ok, first.error
    names = ["net.blocks.0.attn", "net.blocks.1.attn"]
    decision = {"timings": [{"modules": names, "own_ms": 1.0, "swapped_ms": 2.0, "kept_own": True}]}
    assert first.decided == {"FlashAttentionCallback": {"first_batch": decision}}
    decided = json.loads(json.dumps(first.decided))  # as the runner hands it on
    later = worker.run(replace(spec, repeat=1, decided=decided), build=lambda _: (GPTModule(), None))
    assert later.ok and timed == [1]
    assert later.decided == {"FlashAttentionCallback": {"first_batch": {**decision, "replayed": True}}}

    handed: list[tuple[str, int, dict]] = []

    def run(spec: RunSpec, tmp: Any, timeout_s: float) -> RunResult:
        handed.append((spec.config, spec.repeat, spec.decided))
        steps = [0.2 if spec.config == "baseline" else 0.1] * 6
        return RunResult(spec={"config": spec.config, "repeat": spec.repeat}, batch_size=4, step_median_s=0.1,
                         step_times_s=steps, decided=first.decided if spec.repeat == 0 and spec.config != "baseline"
                         else later.decided if spec.config != "baseline" else {})  # fmt: skip

    bench = BenchSpec(configs="flash_attention", device="cpu", preset="tiny", repeats=3, predict_batches=0)
    report = runner.run_benchmark(bench, run=run, monitor=Quiet(), peak=lambda *a: PeakFlops(None, "unknown: test"))
    assert [d for c, r, d in handed if c == "flash_attention"] == [{}, first.decided, first.decided]
    assert all(d == {} for c, r, d in handed if c == "baseline")
    assert any(n.startswith("flash_attention: FlashAttentionCallback decided at the first run, every repeat ran the "
                            "same code: own code for net.blocks.0.attn, net.blocks.1.attn (first batch: own 1.00 ms, "
                            "swapped 2.00 ms)") for n in report.notes)  # fmt: skip


@pytest.mark.slow
@pytest.mark.serial  # a statistical guarantee of separate processes' timings: a busy neighbour makes false verdicts
def test_baseline_against_the_a_a_control_end_to_end_finds_no_clear_difference() -> None:
    """``--configs baseline,aa_control`` on the tiny preset: the control runs as any configuration does (a fresh
    process per repeat, interleaved with baseline) and its speed-up's interval holds 1. Two repeats, so the rotation
    puts each first once: an order effect widens the interval instead of moving it (nominal false verdicts: <= 5%)."""
    from lightning_perf.benchmark import runner
    from lightning_perf.benchmark.configs import AA_CONTROL
    from lightning_perf.profiling import PeakFlops
    from lightning_perf.profiling.intervals import METHOD_T, NO_CLEAR_DIFFERENCE
    from tests.benchmark.test_auto_bench import Quiet

    order: list[tuple[str, int]] = []

    def run(spec: Any, tmp: Any, timeout_s: float) -> RunResult:
        order.append((spec.config, spec.repeat))
        return runner._run_in_subprocess(spec, tmp, timeout_s)

    spec = BenchSpec(configs=f"baseline,{AA_CONTROL}", preset="tiny", device="cpu", repeats=2, steps=4,
                     warmup_steps=1, predict_batches=0, threads=1, timeout_s=300.0)  # fmt: skip
    report = runner.run_benchmark(spec, run=run, monitor=Quiet(), peak=lambda *a: PeakFlops(None, "unknown: test"))
    assert order == [("baseline", 0), (AA_CONTROL, 0), (AA_CONTROL, 1), ("baseline", 1)]
    row = next(s for s in report.summaries if s.config == AA_CONTROL)
    assert row.runs == 2 and row.speedup_method == METHOD_T and row.speedup_n == 2, row.error
    low, high = row.speedup_ci95
    assert low <= 1.0 <= high and row.speedup_verdict == NO_CLEAR_DIFFERENCE
