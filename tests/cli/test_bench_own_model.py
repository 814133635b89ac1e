"""`lightning-perf bench` on the user's own model: `--model`/`--datamodule`, LightningCLI `--config` files (the
tuner's YAML round trip included), `--stage predict` with latency percentiles against baseline, `--batch-sizes`.

The user's project is tests/benchmark/_own_models.py (a data module keeping its batch size in `hparams`, a callback
named in a YAML's `trainer.callbacks`). Most tests build and measure in this process; one runs the real bench (one
worker process) and compares its file with itself.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_perf.benchmark import runner
from lightning_perf.benchmark.configs import default_configs, get_config, split_by_stage
from lightning_perf.benchmark.lightning_config import load_lightning_config
from lightning_perf.benchmark.report import INFERENCE_CONSOLE_COLUMNS, inference_console_rows, markdown_report
from lightning_perf.benchmark.results import BenchReport
from lightning_perf.benchmark.spec import BenchSpec, RunSpec
from lightning_perf.benchmark.worker import MEMORY_STEPS, SETTLE_STEPS, RunResult
from lightning_perf.benchmark.worker import run as run_worker
from lightning_perf.cli import main
from lightning_perf.profiling.report import text_table

OWN = "tests.benchmark._own_models"
MODEL, DATA = f"{OWN}:Classifier", f"{OWN}:Points"

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*(does not have many workers|LeafSpec|Seed set|litlogger|GPU available|TPU available).*"
)


def _yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def user_yaml(tmp_path: Path) -> Path:
    """A user's LightningCLI file: classes, arguments and trainer settings, one setting the bench owns."""
    return _yaml(
        tmp_path / "cli.yaml",
        f"""
model:
  class_path: {OWN}.Classifier
  init_args: {{hidden: 8}}
data:
  class_path: {OWN}.Points
  init_args: {{batch_size: 8, samples: 32}}
trainer:
  precision: 64-true
  gradient_clip_val: 1.0
  max_epochs: 3
  callbacks:
    - class_path: {OWN}.CountBatches
      init_args: {{path: {tmp_path / "count.txt"}}}
""",
    )


def _one_error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(["bench", *argv])
    assert info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--model", MODEL],
            "argument --model: 'tests.benchmark._own_models:Classifier' is not valid. Expected --data",
        ),
        (["--model", f"{OWN}_nope:Net", "--datamodule", DATA], "argument --model: model="),
        (["--model", f"{OWN}:Missing", "--datamodule", DATA], "has no attribute 'Missing'"),
        (["--model", MODEL, "--datamodule", f"{OWN}:Classifier"], "is not a subclass of LightningDataModule"),
        (["--model", f"{OWN}:Broken", "--datamodule", DATA], "width=4 is not supported"),
        (["--model", MODEL, "--datamodule", DATA, "--model-args", "{bad"], "argument --model-args: '{bad'"),
        (["--model", MODEL, "--datamodule", DATA, "--model-args", '{"depth": 2}'], "unexpected keyword argument"),
        (["--workload", "convnet", "--model", MODEL], "not allowed with argument"),
        (["--model-args", "{}"], "--model-args together with --model or --config"),
        (["--model", MODEL, "--datamodule", DATA, "--batch-size", "2", "--batch-sizes", "1,2"], "--batch-sizes"),
        (["--batch-sizes", "2,2"], "argument --batch-sizes: '2,2' is not valid"),
        (["--stage", "train"], "argument --stage: invalid choice"),
    ],
)
def test_bad_own_model_invocations_exit_2_with_one_line(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert expected in _one_error_line(argv, capsys)


def test_bad_config_files_exit_2_with_one_line(
    user_yaml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _one_error_line(["--workload", "convnet", "--config", str(user_yaml)], capsys)
    assert "no --config with --workload" in line
    unknown = _yaml(tmp_path / "bad.yaml", f"model:\n  class_path: {OWN}.Classifier\ntrainer:\n  frobnicate: 1\n")
    assert "argument --config: LightningCLI refused" in _one_error_line(["--config", str(unknown)], capsys)
    no_data = _yaml(tmp_path / "nodata.yaml", f"model:\n  class_path: {OWN}.Classifier\n")
    assert "builds no data module" in _one_error_line(["--config", str(no_data)], capsys)
    assert "existing file" in _one_error_line(["--config", str(tmp_path / "absent.yaml")], capsys)


def test_a_config_builds_what_lightning_cli_builds(user_yaml: Path, tmp_path: Path) -> None:
    from tests.benchmark._own_models import Classifier, CountBatches, Points

    built = load_lightning_config([str(user_yaml)])
    assert isinstance(built.model, Classifier) and built.model.hparams.hidden == 8
    assert isinstance(built.datamodule, Points) and built.datamodule.hparams.batch_size == 8
    callbacks = built.trainer_kwargs.pop("callbacks")
    assert [type(c) for c in callbacks] == [CountBatches]
    assert built.trainer_kwargs == {"precision": "64-true", "gradient_clip_val": 1.0}
    assert built.ignored == {"max_epochs": 3}  # the bench decides how long a run is
    # Several files merge in order, as LightningCLI merges them: the later one's values win.
    later = _yaml(tmp_path / "later.yaml", "data:\n  init_args: {batch_size: 2}\ntrainer:\n  precision: 32-true\n")
    merged = load_lightning_config([str(user_yaml), str(later)])
    assert merged.datamodule.hparams.batch_size == 2 and merged.datamodule.hparams.samples == 32
    assert merged.trainer_kwargs["precision"] == "32-true" and merged.trainer_kwargs["gradient_clip_val"] == 1.0


def test_the_autotune_yaml_round_trips_as_config(
    monkeypatch: pytest.MonkeyPatch, user_yaml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.tuning._scripted import script_trials, scripted_result

    ran = script_trials(
        monkeypatch, {"baseline": scripted_result(0.100, 8), "+fused_optimizer": scripted_result(0.050, 8)}
    )
    tuned = tmp_path / "tuned.yaml"
    argv = ["autotune", "--config", str(user_yaml), "--precisions", "", "--optimizations", "fused_optimizer"]
    assert main([*argv, "--no-batch-size", "--no-data-loading", "--quiet", "--output", str(tuned)]) == 0
    assert "+fused_optimizer" in ran, ran
    assert "FusedOptimizerCallback" in tuned.read_text(), tuned.read_text()
    # The tuner's file after the user's: both sets of callbacks' settings are LightningCLI's to merge.
    built = load_lightning_config([str(user_yaml), str(tuned)])
    assert "FusedOptimizerCallback" in [type(c).__name__ for c in built.trainer_kwargs["callbacks"]]
    # Alone, after classes named on the command line (its model:/data: sections carry arguments only).
    alone = load_lightning_config([str(tuned)], model=MODEL, datamodule=DATA, datamodule_args={"samples": 16})
    assert type(alone.model).__name__ == "Classifier" and alone.datamodule.hparams.samples == 16


def test_predict_on_a_config_runs_the_users_callbacks_and_a_configuration_overrides_the_precision(
    user_yaml: Path, tmp_path: Path
) -> None:
    source = {"kind": "config", "configs": [str(user_yaml)]}
    # precision: what the runner resolves from the file when --precision is not given
    spec = RunSpec(workload="Classifier", config="baseline", steps=3, warmup_steps=1, source=source, stage="predict",
                   precision="64-true")  # fmt: skip
    result = run_worker(spec)
    assert result.ok, result.error
    assert result.precision == "64-true" and set(result.trainer_settings) == {"callbacks", "gradient_clip_val"}
    assert (tmp_path / "count.txt").read_text().split() == ["TrainerFn.PREDICTING", "4"]  # 1 warm-up + 3 timed
    assert len(result.predict_step_times_s) == 3 and result.step_times_s == result.predict_step_times_s
    assert 0 < result.latency_p50_s <= result.latency_p95_s <= result.latency_p99_s
    assert result.predict_throughput == pytest.approx(8 / result.latency_p50_s)
    assert result.first_batch_s > 0 and result.warmup_s >= result.first_batch_s
    # 4 batches leave none to measure CPU memory over apart from the timed ones: no memory figure, rather than one
    # that slows the timed batches (profiling.memory.truthful_cpu_peak).
    assert result.peak_memory_bytes is None and result.step_memory_bytes is None
    overridden = run_worker(replace(spec, config="bf16-true"))
    assert overridden.ok and overridden.precision == "bf16-true"
    fit_only = run_worker(replace(spec, config="fused_optimizer"))
    assert fit_only.skipped == "applies to training only, not to predict"


def test_fit_on_classes_by_import_path_sets_the_batch_size_in_hparams() -> None:
    source = {"kind": "import", "model": MODEL, "datamodule": DATA, "model_args": {}, "datamodule_args": {}}
    result = run_worker(RunSpec(workload="Classifier", config="baseline", steps=2, warmup_steps=1, batch_size=2,
                                predict_batches=2, source=source))  # fmt: skip
    assert result.ok, result.error
    untimed = 1 + MEMORY_STEPS + SETTLE_STEPS  # warm-up, then the CPU's memory and settling steps
    assert result.batch_size == 2 and len(result.losses) == untimed + 2 and len(result.step_times_s) == 2
    assert result.predict_step_median_s is not None
    spec = RunSpec(workload="Classifier", config="baseline", steps=2, warmup_steps=1, source=source, stage="validate")
    validated = run_worker(spec)
    assert validated.ok and len(validated.predict_step_times_s) == 2 and validated.losses == []


def test_configurations_say_which_stages_they_apply_to() -> None:
    kept, left_out = split_by_stage(["baseline", "channels_last", "fused_optimizer", "grad_checkpoint"], "predict")
    assert kept == ["baseline", "channels_last"]
    assert dict(left_out) == {
        "fused_optimizer": "applies to training only, not to predict",
        "grad_checkpoint": "applies to training only, not to predict",
    }
    assert split_by_stage(["bf16-true"], "fit")[1] == [
        ("bf16-true", "applies to predict/validate/test only, not to fit")
    ]
    assert get_config("channels_last+fused_optimizer").stages == ("fit",)
    assert get_config("bf16-true+fused_optimizer").why_not_stage("fit") == "its parts apply to no stage in common"
    import torch

    caps = {"cpu": True, "cuda": False, "fast_bf16": True}
    predict, why = default_configs(torch.device("cpu"), caps, stage="predict")
    assert "bf16-true" in predict and "fused_optimizer" not in predict
    assert dict(why)["fused_optimizer"] == "applies to training only, not to predict"
    assert "bf16-true" not in default_configs(torch.device("cpu"), caps, stage="fit")[0]


def _latency_result(config: str, repeat: int, latency: float) -> RunResult:
    times = (latency * (1 + 0.02 * np.random.default_rng(repeat).standard_normal(12))).tolist()
    return RunResult(
        spec={"config": config, "repeat": repeat, "stage": "predict"},
        batch_size=8,
        step_times_s=times,
        step_median_s=float(np.median(times)),
        predict_step_times_s=times,
        predict_step_median_s=float(np.median(times)),
        predict_throughput=8 / float(np.median(times)),
        latency_p50_s=float(np.percentile(times, 50)),
        latency_p95_s=float(np.percentile(times, 95)),
        latency_p99_s=float(np.percentile(times, 99)),
        first_batch_s=latency * 3,
        warmup_s=latency * 4,
        peak_memory_bytes=100 << 20,
    )


def test_an_inference_summary_has_every_latency_ratio_with_its_interval_and_fits_80_columns() -> None:
    results = {
        "baseline": [_latency_result("baseline", r, 0.010) for r in range(3)],
        "compile_reduce_overhead": [_latency_result("compile_reduce_overhead", r, 0.005) for r in range(3)],
    }
    summaries = runner.summarize_runs(results)
    fast = summaries[1].to_dict()
    for name in ("latency_p50_speedup", "latency_p95_speedup", "latency_p99_speedup", "predict_throughput_ratio",
                 "first_batch_speedup", "warmup_speedup"):  # fmt: skip
        assert fast[name] == pytest.approx(2.0, rel=0.1), name
        low, high = fast[f"{name}_ci95"]
        assert low <= fast[name] <= high and fast[f"{name}_verdict"] == "faster", name
    assert fast["peak_memory_ratio_verdict"] == "no clear difference"
    assert fast["latency_p50_s"] == pytest.approx(0.005, rel=0.05)
    report = BenchReport(
        options={"workload": "Classifier", "preset": "default", "device": "cpu", "repeats": 3, "steps": 12,
                 "warmup_steps": 1, "stage": "predict", "source": {"kind": "import", "model": MODEL}},
        command="lightning-perf bench ...", summaries=summaries
    )  # fmt: skip
    lines = text_table(list(INFERENCE_CONSOLE_COLUMNS), inference_console_rows(report)).splitlines()
    assert max(len(line) for line in lines) <= 80 and "compile_reduce" in "".join(lines)
    markdown = markdown_report(report)
    assert "p99 speed-up [95% CI]" in markdown and "faster" in markdown and f"`{MODEL}`" in markdown


@pytest.fixture
def fake_bench(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``run_benchmark`` replaced by synthetic latencies that shrink per sample as the batch grows."""
    seen: list[Any] = []

    def run_benchmark(options: BenchSpec, progress: Any = None, command: Any = None, **kw: Any):
        seen.append(options)
        scale = 0.01 * (options.batch_size or 1) ** 0.5
        results = {
            name: [_latency_result(name, r, scale / (1 + i)) for r in range(options.repeats or 3)]
            for i, name in enumerate(options.configs)
        }
        return BenchReport(options=options.to_dict(), command=command,
                                  summaries=runner.summarize_runs(results))  # fmt: skip

    monkeypatch.setattr(runner, "run_benchmark", run_benchmark)
    return seen


def test_batch_sizes_sweep_one_section_per_size_and_the_scaling_table(
    fake_bench: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "sweep.json"
    argv = ["bench", "--model", MODEL, "--datamodule", DATA, "--stage", "predict", "--batch-sizes", "1,4"]
    assert main([*argv, "--configs", "baseline,channels_last", "--quiet", "--output", str(output)]) == 0
    assert [o.batch_size for o in fake_bench] == [1, 4]
    assert all(o.stage == "predict" and o.source["model"] == MODEL for o in fake_bench)
    data = json.loads(output.read_text())
    assert data["kind"] == "lightning-perf-bench-sweep" and data["batch_sizes"] == [1, 4]
    assert [r["batch_size"] for r in data["by_batch_size"]] == [1, 4]
    assert "latency_p95_speedup_ci95" in data["by_batch_size"][1]["summary"][1]
    markdown = output.with_suffix(".md").read_text()
    assert "### Batch scaling (predict samples/s" in markdown, markdown
    header = next(line for line in markdown.splitlines() if line.startswith("| config") and "batch 1" in line)
    assert header.split("|")[2:4] == [" batch 1 ", " batch 4 "], header
    assert markdown.count("### `Classifier`, predict on cpu, batch size") == 2
    assert f"wrote {output}" in capsys.readouterr().out
    assert main(["compare", str(output), str(output)]) == 0  # per configuration and batch size
    assert "channels_last @ batch 4" in capsys.readouterr().out


def test_a_real_predict_run_records_its_source_and_stage_and_compares(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "own.json"
    argv = ["bench", "--model", MODEL, "--datamodule", DATA, "--datamodule-args", '{"samples": 24}', "--stage"]
    argv += ["predict", "--configs", "baseline,fused_optimizer", "--steps", "2", "--warmup-steps", "1"]
    assert main([*argv, "--repeats", "1", "--quiet", "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert "fused_optimizer: applies to training only" not in printed or "left out" in printed
    data = json.loads(output.read_text())
    assert data["options"]["stage"] == "predict"
    assert data["options"]["source"] == {"kind": "import", "model": MODEL, "datamodule": DATA, "model_args": {},
                                         "datamodule_args": {"samples": 24}}  # fmt: skip
    assert data["left_out"] == [{"config": "fused_optimizer", "reason": "applies to training only, not to predict"}]
    (baseline,) = data["summary"]
    assert baseline["config"] == "baseline" and baseline["latency_p50_s"] > 0 and baseline["latency_p99_s"] > 0
    assert main(["compare", str(output), str(output)]) == 0
    assert "predict time" in capsys.readouterr().out
