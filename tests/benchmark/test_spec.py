"""One validated bench spec: every check once, names resolved with a suggestion, the device chosen and said why, the
workload's GPU size on CUDA, the worker's spec derived from it, and a one-repeat bench that claims no interval."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import lightning_perf.demos as demos
from lightning_perf.benchmark import runner
from lightning_perf.benchmark.results import ONE_REPEAT
from lightning_perf.benchmark.runner import run_benchmark, summarize_runs
from lightning_perf.benchmark.spec import BenchSpec, RunSettings, RunSpec, SpecError, check_config_names
from lightning_perf.benchmark.worker import RunResult
from lightning_perf.optimizations import BASELINE
from lightning_perf.profiling import PeakFlops
from tests._models import run_result


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A visible CUDA device named "Fake GPU", and demos that offer a "gpu" preset."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Fake GPU")
    monkeypatch.setattr(demos, "PRESETS", (*[p for p in demos.PRESETS if p != "gpu"], "gpu"))


def test_auto_is_the_cpu_here_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = BenchSpec(configs="channels_last", preset=None)
    assert (spec.device, spec.device_reason, spec.preset) == ("cpu", "auto: no CUDA device is visible", "default")
    assert spec.names == (BASELINE, "channels_last")


def test_auto_chooses_cuda_and_the_gpu_preset_when_a_gpu_is_visible(fake_cuda: None) -> None:
    spec = BenchSpec(configs="channels_last", preset=None)
    assert (spec.device, spec.device_reason, spec.preset) == ("cuda", "auto: CUDA is visible (Fake GPU)", "gpu")
    assert BenchSpec(configs="channels_last", preset="tiny").preset == "tiny"  # an explicit size stays
    assert BenchSpec(configs="channels_last", device="cpu", preset=None).preset == "default"


def test_cuda_asked_for_where_none_is_visible_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SpecError, match=r"BenchSpec\(device='cuda:1'\)` is not valid. Expected cpu or auto") as info:
        BenchSpec(configs="channels_last", device="cuda:1")
    assert (info.value.option, info.value.value) == ("--device", "cuda:1")


@pytest.mark.parametrize(
    ("kwargs", "option", "expected"),
    [
        (
            {"configs": "chanels_last"},
            "--configs",
            "unknown configuration 'chanels_last': did you mean 'channels_last'?",
        ),
        ({"configs": "baseline,,compile"}, "--configs", "with no empty name between commas"),
        ({"configs": "baseline+nothing_like_it"}, "--configs", "unknown configuration 'nothing_like_it': --list shows"),
        ({"configs": "bf16-mixed+16-mixed"}, "--configs", "a stack that can be built: Cannot stack"),
        ({"workload": "convnt"}, "--workload", "(did you mean 'convnet'?)"),
        ({"preset": "defualt"}, "--preset", "(did you mean 'default'?)"),
        ({"warmup_steps": 0}, "--warmup-steps", "an integer >= 1"),
        ({"batch_size": 4, "batch_sizes": (1, 2)}, "--batch-sizes", "no batch_sizes together with batch_size"),
        ({"stage": "train"}, "--stage", "one of fit, predict, validate, test"),
    ],
)
def test_a_bad_setting_names_itself_its_value_and_a_suggestion(kwargs: dict, option: str, expected: str) -> None:
    with pytest.raises(SpecError) as info:
        BenchSpec(**{"configs": "channels_last", "device": "cpu", **kwargs})
    assert info.value.option == option and expected in info.value.expected
    assert str(info.value).startswith("`BenchSpec(")
    # Not a list of every registered name: a suggestion, or where to find them.
    assert "fused_optimizer" not in info.value.expected


def test_names_are_resolved_once_in_order_without_duplicates_and_stage_filtered() -> None:
    assert check_config_names(" bf16-mixed, baseline,bf16-mixed ") == ("bf16-mixed", "baseline")
    spec = BenchSpec(configs=["fused_optimizer", "bf16-true"], stage="predict", device="cpu")
    assert spec.names == (BASELINE, "bf16-true")
    assert dict(spec.left_out) == {"fused_optimizer": "applies to training only, not to predict"}
    again = BenchSpec(**{**spec.to_dict(), "left_out": spec.left_out, "batch_sizes": ()})  # a rebuilt spec is equal
    assert (again.names, again.left_out) == (spec.names, spec.left_out)


def test_the_workers_spec_carries_every_shared_setting() -> None:
    spec = BenchSpec(configs="channels_last", device="cpu", preset="tiny", steps=4, seed=7, repeats=2)
    run = spec.run_spec("channels_last", 0)
    assert isinstance(run, RunSpec) and run.config == "channels_last" and run.count_flops
    shared = [f for f in RunSettings.__dataclass_fields__]
    assert {f: getattr(run, f) for f in shared} == {f: getattr(spec, f) for f in shared}
    assert not spec.run_spec("channels_last", 1).count_flops
    sweep = BenchSpec(configs="channels_last", device="cpu", batch_sizes=(1, 8))
    assert [(s.batch_size, s.batch_sizes) for s in sweep.per_batch_size()] == [(1, ()), (8, ())]


def _result(config: str, repeat: int, step: float) -> RunResult:
    steps = (step * (1 + 0.02 * np.random.default_rng(repeat + len(config)).standard_normal(8))).tolist()
    predict_fields = {"predict_step_median_s": step / 3, "predict_step_times_s": [step / 3] * 4}
    memory = {"step_memory_bytes": 100 if config == BASELINE else 26, "peak_memory_bytes": 200}
    return run_result(config, repeat, steps, throughput=None, flops_per_step=10**9 if repeat == 0 else None,
                      **memory, **predict_fields)  # fmt: skip


def test_one_repeat_says_it_has_no_interval_for_every_ratio() -> None:
    rows = {s.config: s for s in summarize_runs({BASELINE: [_result(BASELINE, 0, 0.2)], "x": [_result("x", 0, 0.1)]})}
    x = rows["x"]
    for ratio in ("speedup", "memory_ratio", "predict_speedup"):
        assert x.get(f"{ratio}_verdict") == ONE_REPEAT and x.get(f"{ratio}_ci95") is None, ratio
    assert x.memory_ratio == pytest.approx(0.26)  # the figure stays; only the verdict declines


def test_the_results_file_records_the_device_its_reason_and_the_mfu_peaks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    planned: list[RunSpec] = []

    def fake_run(spec: RunSpec, tmp: Path, timeout_s: float) -> RunResult:
        planned.append(spec)
        return _result(spec.config, spec.repeat, 0.2 if spec.config == BASELINE else 0.1)

    monkeypatch.setattr(runner, "_run_in_subprocess", fake_run)
    spec = BenchSpec(configs="channels_last,backend_flags", device="cpu", preset="tiny", repeats=2)
    peaks: list[Any] = []
    report = run_benchmark(spec, peak=lambda *setting: peaks.append(setting) or PeakFlops(1e11, "given (test)"))
    assert [(s.config, s.repeat) for s in planned[:3]] == [(BASELINE, 0), ("channels_last", 0), ("backend_flags", 0)]
    machine = report.to_dict()["machine"]
    assert machine["device"] == "cpu" and machine["device_reason"] == spec.device_reason
    assert {("cpu", p["precision"], p["fast_fp32_matmul"]) for p in machine["mfu_peaks"]} == set(peaks)
    assert all(p["peak_flops_per_second"] == 1e11 and p["source"] == "given (test)" for p in machine["mfu_peaks"])
    assert {"gpu", "gpu_driver", "cuda", "torch"} <= set(machine)  # on a GPU machine: its name, driver, CUDA
    assert report.options["configs"] == [BASELINE, "channels_last", "backend_flags"]
