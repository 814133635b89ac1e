"""``AutoTuner(stage="predict")`` / ``lightning-perf autotune --stage predict``: tuning for inference.

The search list (from the one list of optimizations, filtered by stage), the decisions on scripted per-batch
latencies, one real in-process search of a tiny model, the recommendation's stage and bench command, and the flag.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import lightning_perf.tuning.remeasure as remeasure
from lightning_perf import optimizations
from lightning_perf.benchmark.sources import ImportSource, WorkloadSource
from lightning_perf.benchmark.worker import RunResult
from lightning_perf.optimizations import INFERENCE_STAGES, Optimization
from lightning_perf.tuning.inference import NO_DATA_STAGE, precision_names, search_plan, trial_skip_reason
from lightning_perf.tuning.recommend import bench_command
from lightning_perf.tuning.tuner import AutoTuner, Candidate, TuningError
from tests.tuning._scripted import quiet_machine, script_trials, scripted_result
from tests.tuning._user_models import PredictDataModule, SmallConvNet

TRAINING_ONLY = "applies to training only, not to predict"


def inference_result(latency_s: float, batch: int, *, wall: float = 2.0) -> RunResult:
    """A scripted inference run: per-batch latencies, predict throughput, and no loss (inference has none)."""
    result = scripted_result(latency_s, batch, wall=wall, losses=[])
    result.throughput, result.data_wait_s = None, []
    result.predict_throughput = batch / sorted(result.step_times_s)[5]
    result.latency_p95_s = result.latency_p99_s = max(result.step_times_s)
    return result


# --------------------------------------------------------------------------- the search list


def test_predict_search_leaves_out_training_only_optimizations_with_the_reason() -> None:
    plan = search_plan("predict", device="cpu")
    assert "fused_optimizer" in plan.optimizations and "fused_optimizer" not in plan.searched_optimizations
    assert plan.left_out["fused_optimizer"] == TRAINING_ONLY
    for name in plan.searched_optimizations:
        assert "predict" in optimizations.get(name).stages
    assert "channels_last" in plan.searched_optimizations and "compile" in plan.searched_optimizations
    # Inference precisions: the pure ones first; fp16 autocast (CUDA only) is not a CPU default.
    assert plan.searched_precisions[:2] == ("bf16-true", "16-true") and "16-mixed" not in plan.precisions
    assert "16-mixed" in search_plan("predict", device="cuda:0").precisions
    # Training keeps its own lists: no pure-precision weights in a fit search.
    assert precision_names("fit") == ("bf16-mixed", "16-mixed")
    # Inference-only entries are named in a fit search, with the reason, and never tried.
    fit_plan = search_plan("fit", device="cpu")
    assert fit_plan.left_out == {"dynamic_int8": "applies to predict/validate/test only, not to fit"}
    assert "dynamic_int8" not in fit_plan.searched_optimizations
    assert "dynamic_int8" in plan.searched_optimizations


@pytest.fixture
def inference_only() -> Iterator[Optimization]:
    options = {"tuner_stage": "optimization", "tuner_order": 60, "stages": INFERENCE_STAGES}
    callback = "lightning_perf.callbacks.ChannelsLastCallback"
    description = "an inference-only stand-in (as dynamic int8 will be)"
    entry = optimizations.register(Optimization("dummy_int8", description, callback=callback, **options))
    yield entry
    optimizations.unregister(entry.name)


def test_an_inference_only_entry_of_the_registry_is_searched_for_inference_only(inference_only: Optimization) -> None:
    assert "dummy_int8" in search_plan("predict").searched_optimizations
    assert "dummy_int8" in search_plan("test").searched_optimizations
    fit = search_plan("fit")
    assert fit.left_out["dummy_int8"] == "applies to predict/validate/test only, not to fit"


def test_bf16_weights_on_a_cpu_without_bf16_are_skipped_as_training_bf16_is(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_perf.benchmark import configs
    from lightning_perf.benchmark.structure import ModelStructure

    monkeypatch.setattr(configs, "device_capabilities", lambda device: {"fast_bf16": False})
    none = ModelStructure()
    for name in ("bf16-true", "bf16-mixed"):
        assert "no bf16 instructions" in trial_skip_reason(name, none, "cpu")
        assert trial_skip_reason(name, none, "cpu", explicit=True) is None  # named by the user: measured anyway
    assert trial_skip_reason("16-mixed", none, "cpu") == "fp16 autocast with a gradient scaler is for CUDA devices"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": "train"}, r"`AutoTuner\(stage='train'\)` is not valid\. Expected one of 'fit', 'predict'"),
        ({"stage": None}, r"`AutoTuner\(stage=None\)` is not valid"),
        ({"precisions": ["bf16-true"]}, r"'bf16-true' is not searched for stage='fit'"),
        ({"stage": "predict", "precisions": ["fp8"]}, r"'fp8' is unknown\. Expected names from bf16-true"),
    ],
)
def test_bad_stage_and_precision_for_the_stage(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AutoTuner(workload="convnet", preset="tiny", **kwargs)


# --------------------------------------------------------------------------- decisions on scripted latencies


def test_predict_decisions_on_latency_and_throughput(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = script_trials(
        monkeypatch,
        {
            "baseline": inference_result(0.010, 8),
            "+bf16-true": inference_result(0.006, 8),  # no loss to compare: kept on latency alone
            "+channels_last": inference_result(0.0061, 8),
            "+compile": inference_result(0.0060, 8),
            "batch_size=16": inference_result(0.009, 16),  # slower per batch, faster per sample: 1.33x throughput
        },
    )
    options = {"precisions": ["bf16-true"], "optimizations": ["channels_last", "fused_optimizer", "compile"]}
    # confirm_below=1.0: single-pair wins (confirmation is tested with training)
    tuner = AutoTuner(SmallConvNet(), PredictDataModule(), stage="predict", max_batch_size=16, confirm_below=1.0,
                      progress=False, **options)  # fmt: skip
    assert tuner._spec(Candidate("x", "baseline")).stage == "predict"  # the worker runs the inference stage
    result = tuner.run()
    trials = {t.label: t for t in result.trials}
    assert "+fused_optimizer" not in ran
    assert trials["+fused_optimizer"].verdict == "skipped" and trials["+fused_optimizer"].reason == TRAINING_ONLY
    assert trials["num_workers"].verdict == "skipped" and trials["num_workers"].reason == NO_DATA_STAGE
    assert trials["+bf16-true"].verdict == "kept" and trials["+bf16-true"].loss_deviation is None
    assert trials["+bf16-true"].speedup_ci95 is not None and "1.67x" in trials["+bf16-true"].reason
    assert trials["+channels_last"].verdict == "rejected" and trials["+compile"].verdict == "rejected"
    assert trials["batch_size=16"].verdict == "kept" and "1.33x" in trials["batch_size=16"].reason
    baseline = trials["baseline"]
    assert baseline.throughput == pytest.approx(800, rel=0.02) and baseline.latency_p95_s is not None
    rec = result.recommendation
    assert rec.stage == result.stage == "predict"
    assert rec.configs == ("bf16-true",) and rec.batch_size == 16
    assert rec.trainer_kwargs == {"precision": "bf16-true"}
    assert any("python train.py predict --config" in note for note in rec.notes)
    assert any("bf16-true change the outputs' numerics" in note and "speed only" in note for note in rec.notes)


def test_a_run_whose_data_ran_out_is_not_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    short = inference_result(0.009, 16)
    short.step_times_s = short.step_times_s[:2]  # the predict split gave two batches after the warm-up
    script_trials(monkeypatch, {"baseline": inference_result(0.010, 8), "batch_size=16": short})
    kwargs: dict[str, Any] = {"stage": "predict", "precisions": [], "optimizations": [], "progress": False}
    result = AutoTuner(SmallConvNet(), PredictDataModule(), max_batch_size=16, **kwargs).run()
    trial = result.trials[-1]
    assert trial.label == "batch_size=16" and trial.verdict == "failed" and not trial.measured
    assert "the predict data ran out: 2 batch(es) timed after the warm-up at batch size 16" in trial.reason
    assert result.recommendation.batch_size is None

    script_trials(monkeypatch, {"baseline": short})
    with pytest.raises(TuningError, match=r"baseline trial cannot be measured: the predict data ran out: 2 batch"):
        AutoTuner(SmallConvNet(), PredictDataModule(), **kwargs).run()


def test_training_keeps_rejecting_a_run_without_losses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss check is skipped for inference only: a fit trial without losses is still rejected."""
    script_trials(monkeypatch, {"baseline": scripted_result(0.010, 8), "+channels_last": inference_result(0.006, 8)})
    options = {"tune_batch_size": False, "tune_data_loading": False, "progress": False}
    result = AutoTuner(
        SmallConvNet(), PredictDataModule(), precisions=[], optimizations=["channels_last"], **options
    ).run()
    assert [t.verdict for t in result.trials if t.label == "+channels_last"] == ["rejected"]
    assert result.stage == "fit" and result.recommendation.configs == ()


# --------------------------------------------------------------------------- a real search, in process


def test_a_tiny_model_tuned_for_predict_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    quiet_machine(monkeypatch)  # real trials; the watcher's verdict on this machine's load is tested on its own
    monkeypatch.setattr(remeasure, "baseline_spread_cause", lambda first_s, second_s: None)  # a busy machine
    model, data = SmallConvNet(), PredictDataModule(batch_size=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options = {"max_batch_size": 16, "steps": 4, "warmup_steps": 1, "isolation": "in-process", "progress": False}
    result = AutoTuner(model, data, stage="predict", precisions=[], optimizations=["channels_last", "fused_optimizer"],
                       **options).run()  # fmt: skip
    labels = [t.label for t in result.trials]
    assert labels[:3] == ["baseline", "baseline (repeat)", "+channels_last"], labels
    assert "+fused_optimizer" in labels and "num_workers" in labels and "batch_size=16" in labels
    baseline = result.trials[0]
    assert baseline.verdict == "baseline" and baseline.batch_size == 8
    assert baseline.step_median_s and baseline.throughput and baseline.latency_p95_s  # per-batch latency, samples/s
    assert baseline.loss_deviation is None and baseline.data_wait_share is None
    assert all(t.verdict in ("baseline", "kept", "rejected", "skipped", "confirm") for t in result.trials), (
        result.table_rows()
    )
    assert result.to_dict()["stage"] == "predict" and result.to_dict()["recommendation"]["stage"] == "predict"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert data.batch_size == 8 and model._trainer is None


# --------------------------------------------------------------------------- outputs and the command line


def test_bench_command_measures_the_stage_tuned() -> None:
    source = WorkloadSource("convnet", "tiny", 0)
    candidate = Candidate("x", "batch_size", configs=("bf16-true",), batch_size=16)
    command = bench_command(source, "cpu", candidate, "predict")
    assert command is not None and command.endswith("--device cpu --stage predict --batch-size 16")
    assert "--configs baseline,bf16-true" in command
    assert "--stage" not in (bench_command(source, "cpu", candidate) or "")

    from lightning_perf.cli import build_parser

    args = build_parser().parse_args(command.split()[1:])  # the bench accepts it as printed
    assert args.stage == "predict" and args.batch_size == 16
    # The user's classes by import path: the same command with --model/--datamodule and their arguments, quoted.
    own = ImportSource(
        "tests.tuning._user_models:SmallConvNet",
        "tests.tuning._user_models:PredictDataModule",
        datamodule_args={"batch_size": 8, "samples": 64},
    )
    command = bench_command(own, "cpu", candidate, "test")
    assert command is not None and "--stage test" in command
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.model == own.model and args.datamodule == own.datamodule and args.stage == "test"
    assert args.datamodule_args == {"batch_size": 8, "samples": 64} and args.model_args is None


ARGS = ["autotune", "--workload", "convnet", "--preset", "tiny", "--precisions", "", "--optimizations", ""]
ARGS += ["--no-batch-size", "--quiet"]


def test_cli_stage_predict_writes_the_stage(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_perf.cli import main

    script_trials(monkeypatch, {"baseline": inference_result(0.010, 8)})
    output = tmp_path / "tuned.yaml"
    assert main([*ARGS, "--stage", "predict", "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert "autotune (predict)" in out and "batch ms (IQR)" in out
    report = json.loads(output.with_suffix(".json").read_text())
    assert report["stage"] == "predict" and report["recommendation"]["stage"] == "predict"
    assert report["bench_command"].endswith("--stage predict")
    assert [t["verdict"] for t in report["trials"] if t["label"] == "num_workers"] == ["skipped"]
    text = output.read_text()
    assert "tuned for: predict" in text.splitlines()[1]
    assert set(yaml.safe_load(text)) <= {"trainer", "data", "model"}  # a LightningCLI config: no extra top-level key


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stage", "bogus"], "argument --stage: invalid choice: 'bogus' (choose from 'fit', 'predict'"),
        (["--precisions", "bf16-true"], "'bf16-true' is not searched for stage='fit'"),
    ],
)
def test_cli_bad_stage_exits_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_perf.cli import main

    with pytest.raises(SystemExit) as info:
        main(["autotune", "--workload", "convnet", "--preset", "tiny", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
