"""Every bad constructor argument is named (issue 16, point 5): one table per public class or config function.

Each row builds the object with one bad argument (or a contradictory pair) and expects ``ValueError`` or
``TypeError`` at construction, whose message names the argument and shows the value given (its ``repr``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_perf.callbacks import (
    BackendFlagsCallback,
    BottleneckCallback,
    ChannelsLastCallback,
    CompileCallback,
    FusedOptimizerCallback,
    MemoryProfilerCallback,
    QATCallback,
    SlidingWindowInferenceCallback,
    TensorRTExportCallback,
)
from lightning_perf.functional.backend_flags import BackendFlags
from lightning_perf.functional.fused_optimizer import choose_implementation, set_implementation, switch_implementation
from lightning_perf.functional.powersgd import register_powersgd_hook, ring_allreduce_seconds
from lightning_perf.strategies import PowerSGDDDPStrategy

NAN, INF = math.nan, math.inf


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])


# (argument named in the message, keyword arguments, the value to show; None: kwargs[argument])
Row = tuple[str, dict[str, Any]]

TABLES: dict[str, tuple[Callable[..., Any], list[Row]]] = {
    "ChannelsLastCallback": (
        ChannelsLastCallback,
        [
            ("dims", {"dims": 1}),
            ("dims", {"dims": 4}),
            ("dims", {"dims": 0}),
            ("dims", {"dims": -2}),
            ("dims", {"dims": "2"}),
            ("dims", {"dims": "Auto"}),
            ("dims", {"dims": ""}),
            ("dims", {"dims": None}),
            ("dims", {"dims": 2.0}),
            ("dims", {"dims": True}),
            ("dims", {"dims": [2, 3]}),
            ("dims", {"dims": NAN}),
        ],
    ),
    "CompileCallback": (
        CompileCallback,
        [
            ("mode", {"mode": "fastest"}),
            ("mode", {"mode": 3}),
            ("fullgraph", {"fullgraph": "false"}),
            ("fullgraph", {"fullgraph": 1}),
            ("dynamic", {"dynamic": "true"}),
            ("backend", {"backend": ""}),
            ("backend", {"backend": 7}),
            ("options", {"options": "max_autotune"}),
            ("regions", {"regions": []}),
            ("regions", {"regions": 5}),
            ("regions", {"regions": "all"}),
            ("regions", {"regions": [3]}),
            ("options", {"options": {"no_such_inductor_option": 1}}),
            ("cache", {"cache": 3}),
            ("stages", {"stages": []}),
            ("stages", {"stages": ["fit", "deploy"]}),
            ("strict", {"strict": "false"}),
            ("warmup_steps", {"warmup_steps": 0}),
            ("warmup_steps", {"warmup_steps": -1}),
            ("warmup_steps", {"warmup_steps": 1.5}),
            ("warmup_steps", {"warmup_steps": NAN}),
            ("warmup_steps", {"warmup_steps": True}),
        ],
    ),
    "BackendFlagsCallback": (
        BackendFlagsCallback,
        [
            ("cudnn_benchmark", {"cudnn_benchmark": "false"}),
            ("cudnn_benchmark", {"cudnn_benchmark": 0}),
            ("tf32", {"tf32": "true"}),
            ("tf32", {"tf32": 1.0}),
            ("float32_matmul_precision", {"float32_matmul_precision": "low"}),
            ("float32_matmul_precision", {"float32_matmul_precision": ""}),
            ("float32_matmul_precision", {"float32_matmul_precision": NAN}),
            ("sdpa_backends", {"sdpa_backends": []}),
            ("sdpa_backends", {"sdpa_backends": ["flash", "fast"]}),
            ("sdpa_backends", {"sdpa_backends": "flash"}),
            ("sdpa_backends", {"sdpa_backends": 3}),
            ("sdpa_backends", {"sdpa_backends": [1]}),
            ("preset", {"preset": "fast"}),
            ("preset", {"preset": True}),
            ("tf32", {"tf32": False, "float32_matmul_precision": "high"}),
        ],
    ),
    "FusedOptimizerCallback": (
        FusedOptimizerCallback,
        [
            ("mode", {"mode": "Fused"}),
            ("mode", {"mode": ""}),
            ("mode", {"mode": None}),
            ("mode", {"mode": 1}),
            ("mode", {"mode": True}),
            ("mode", {"mode": NAN}),
            ("mode", {"mode": ["fused"]}),
            ("mode", {"mode": "for-each"}),
            ("mode", {"mode": "apex"}),
            ("mode", {"mode": b"fused"}),
        ],
    ),
    "BottleneckCallback": (
        BottleneckCallback,
        [
            ("warmup_steps", {"warmup_steps": -1}),
            ("warmup_steps", {"warmup_steps": 2.5}),
            ("warmup_steps", {"warmup_steps": "5"}),
            ("log_every_n_steps", {"log_every_n_steps": 0}),
            ("progress_bar", {"progress_bar": "false"}),
            ("sync_check_steps", {"sync_check_steps": -1}),
            ("sync_check_steps", {"warmup_steps": 1, "sync_check_steps": 2}),
            ("thresholds", {"thresholds": {"data": NAN}}),
            ("thresholds", {"thresholds": {"nonsense": 0.5}}),
            ("thresholds", {"thresholds": "data"}),
            ("dirpath", {"dirpath": 3}),
            ("filename", {"filename": ""}),
            ("filename", {"filename": "a/b"}),
            ("plot", {"plot": "false"}),
            ("verbose", {"verbose": 0}),
        ],
    ),
    "MemoryProfilerCallback": (
        MemoryProfilerCallback,
        [
            ("every_n_steps", {"every_n_steps": 0}),
            ("every_n_steps", {"every_n_steps": INF}),
            ("warmup_steps", {"warmup_steps": -3}),
            ("points", {"points": []}),
            ("points", {"points": ["everywhere"]}),
            ("points", {"points": "after_backward"}),
            ("leak_threshold", {"leak_threshold": 0}),
            ("leak_threshold", {"leak_threshold": NAN}),
            ("leak_threshold", {"leak_threshold": -1.0}),
            ("leak_min_samples", {"leak_min_samples": 1}),
            ("record_history", {"record_history": "false"}),
            ("history_max_entries", {"history_max_entries": 0}),
            ("oom_snapshot", {"oom_snapshot": "no"}),
            ("plot", {"plot": None}),
            ("verbose", {"verbose": "yes"}),
            ("filename", {"filename": ".."}),
        ],
    ),
    "PowerSGDDDPStrategy": (
        PowerSGDDDPStrategy,
        [
            ("matrix_approximation_rank", {"matrix_approximation_rank": 0}),
            ("matrix_approximation_rank", {"matrix_approximation_rank": 2.0}),
            ("start_powerSGD_iter", {"start_powerSGD_iter": -1}),
            ("start_powerSGD_iter", {"start_powerSGD_iter": 1}),
            ("min_compression_rate", {"min_compression_rate": NAN}),
            ("min_compression_rate", {"min_compression_rate": -1.0}),
            ("use_error_feedback", {"use_error_feedback": "false"}),
            ("warm_start", {"warm_start": 0}),
            ("orthogonalization_epsilon", {"orthogonalization_epsilon": INF}),
            ("hook", {"hook": "fast"}),
            ("random_seed", {"random_seed": -5}),
            ("log_stats", {"log_stats": "true"}),
            ("bucket_cap_mb", {"bucket_cap_mb": 0}),
            ("bucket_cap_mb", {"bucket_cap_mb": NAN}),
            ("static_graph", {"static_graph": "false"}),
        ],
    ),
    "BackendFlags": (
        BackendFlags,
        [
            ("cudnn_benchmark", {"cudnn_benchmark": "false"}),
            ("matmul_tf32", {"matmul_tf32": 1}),
            ("cudnn_tf32", {"cudnn_tf32": "true"}),
            ("float32_matmul_precision", {"float32_matmul_precision": "low"}),
            ("float32_matmul_precision", {"float32_matmul_precision": 1}),
            ("sdpa_backends", {"sdpa_backends": frozenset()}),
            ("sdpa_backends", {"sdpa_backends": frozenset({"quick"})}),
            ("sdpa_backends", {"sdpa_backends": "math"}),
            ("matmul_tf32", {"matmul_tf32": True, "float32_matmul_precision": "highest"}),
            ("fp32_precision", {"fp32_precision": "tf32"}),
        ],
    ),
    "switch_implementation": (
        lambda **kw: switch_implementation(kw.pop("optimizer", _optimizer()), **kw),
        [
            ("mode", {"mode": "Fused"}),
            ("mode", {"mode": None}),
            ("mode", {"mode": 0}),
            ("mode", {"mode": ""}),
            ("mode", {"mode": NAN}),
            ("sparse_params", {"sparse_params": 3}),
            ("sparse_params", {"sparse_params": "weight"}),
            ("sparse_params", {"sparse_params": [1, 2]}),
            ("optimizer", {"optimizer": "adam"}),
            ("optimizer", {"optimizer": None}),
        ],
    ),
    "choose_implementation": (
        lambda **kw: choose_implementation(kw.pop("optimizer", _optimizer()), **kw),
        [
            ("mode", {"mode": "FUSED"}),
            ("mode", {"mode": True}),
            ("mode", {"mode": ["auto"]}),
            ("mode", {"mode": INF}),
            ("mode", {"mode": "none"}),
            ("sparse_params", {"sparse_params": None}),
            ("sparse_params", {"sparse_params": 0}),
            ("sparse_params", {"sparse_params": "p"}),
            ("optimizer", {"optimizer": 1}),
            ("optimizer", {"optimizer": torch.nn.Linear(1, 1)}),
        ],
    ),
    "set_implementation": (
        lambda **kw: set_implementation(kw.pop("optimizer", _optimizer()), **kw),
        [
            ("implementation", {"implementation": "auto"}),
            ("implementation", {"implementation": None}),
            ("implementation", {"implementation": "Fused"}),
            ("implementation", {"implementation": ""}),
            ("implementation", {"implementation": 1}),
            ("implementation", {"implementation": True}),
            ("implementation", {"implementation": NAN}),
            ("implementation", {"implementation": ["fused"]}),
            ("optimizer", {"optimizer": "sgd", "implementation": "fused"}),
            ("optimizer", {"optimizer": None, "implementation": "foreach"}),
        ],
    ),
    "register_powersgd_hook": (
        lambda **kw: register_powersgd_hook(kw.pop("model", object()), **kw),
        [
            ("hook", {"hook": "fast"}),
            ("matrix_approximation_rank", {"matrix_approximation_rank": 0}),
            ("matrix_approximation_rank", {"matrix_approximation_rank": "2"}),
            ("start_powerSGD_iter", {"start_powerSGD_iter": -1}),
            ("start_powerSGD_iter", {"start_powerSGD_iter": 1}),
            ("min_compression_rate", {"min_compression_rate": NAN}),
            ("use_error_feedback", {"use_error_feedback": "false"}),
            ("warm_start", {"warm_start": 1}),
            ("orthogonalization_epsilon", {"orthogonalization_epsilon": -1e-8}),
            ("random_seed", {"random_seed": 1.5}),
            ("synchronous", {"synchronous": "yes"}),
            ("model", {"model": torch.nn.Linear(2, 2)}),
        ],
    ),
    "SlidingWindowInferenceCallback": (
        lambda **kw: SlidingWindowInferenceCallback(**{"roi_size": (8, 8, 8), **kw}),
        [
            ("roi_size", {"roi_size": ()}),
            ("roi_size", {"roi_size": 0}),
            ("roi_size", {"roi_size": (8, -8)}),
            ("roi_size", {"roi_size": 8.5}),
            ("roi_size", {"roi_size": "auto"}),
            ("roi_size", {"roi_size": None}),
            ("overlap", {"overlap": 1.0}),
            ("overlap", {"overlap": -0.25}),
            ("overlap", {"overlap": NAN}),
            ("sw_batch_size", {"sw_batch_size": 0}),
            ("sw_batch_size", {"sw_batch_size": -4}),
            ("sw_batch_size", {"sw_batch_size": "Auto"}),
            ("sw_batch_size", {"sw_batch_size": True}),
            ("mode", {"mode": "linear"}),
            ("padding_mode", {"padding_mode": "zeros"}),
            ("sigma_scale", {"sigma_scale": 0.0}),
            ("sigma_scale", {"sigma_scale": INF}),
            ("cval", {"cval": NAN}),
            ("progress", {"progress": 1}),
            ("process_fn", {"process_fn": "identity"}),
            ("buffer_steps", {"buffer_steps": 0}),
            ("buffer_dim", {"buffer_dim": "last"}),
            ("sw_device", {"sw_device": "gpu"}),
            ("stages", {"stages": ["predict", "fit"]}),
            ("stages", {"stages": []}),
        ],
    ),
    "QATCallback": (
        QATCallback,
        [
            ("benchmark_batch_sizes", {"benchmark_batch_sizes": 8}),  # an int where a list is expected
            ("benchmark_batch_sizes", {"benchmark_batch_sizes": "8"}),
            ("benchmark_batch_sizes", {"benchmark_batch_sizes": []}),
            ("benchmark_batch_sizes", {"benchmark_batch_sizes": [1, 0]}),
            ("benchmark_batch_sizes", {"benchmark_batch_sizes": [1.0]}),
            ("refresh", {"mode": "dynamic", "refresh": "yes"}),
            ("refresh", {"mode": "dynamic", "refresh": 1}),
            ("refresh", {"refresh": True}),  # only mode 'dynamic' caches a measured choice
            ("mode", {"mode": "int8"}),
            ("freeze_bn_after", {"freeze_bn_after": -1}),
            ("fake_quant_after", {"fake_quant_after": 1.5}),
            ("eval_converted_every_n_epochs", {"eval_converted_every_n_epochs": 0}),
            ("filename", {"filename": "../x"}),
            ("min_cosine", {"min_cosine": 2}),
            ("min_cosine", {"min_cosine": NAN}),
            ("min_cosine", {"min_cosine": True}),
            ("submodule", {"submodule": ""}),
            ("submodule", {"submodule": 3}),
            ("latency_iterations", {"latency_iterations": 0}),
            ("calibration_batches", {"calibration_batches": 0}),
            ("validation_batches", {"validation_batches": -1}),
            ("disable_observers_after", {"disable_observers_after": "3"}),
            ("input_key", {"input_key": ""}),
            ("backend", {"mode": "dynamic", "backend": "x86"}),
        ],
    ),
    "TensorRTExportCallback": (
        TensorRTExportCallback,
        [
            ("backends", {"backends": "onx"}),  # one name alone is a list of it: an unknown one gets a did-you-mean
            ("backends", {"backends": []}),
            ("backends", {"backends": ["onnx", "onnx"]}),
            ("backends", {"backends": [1]}),
            ("dynamic_dims", {"dynamic_dims": {0: [1, 2]}}),  # dimension 0 is the batch
            ("dynamic_dims", {"dynamic_dims": {1: [1, 2]}}),  # (min, opt, max) needs three ints
            ("dynamic_dims", {"dynamic_dims": {1: (4, 2, 8)}}),
            ("dynamic_dims", {"dynamic_dims": {"seq": (1, 2, 3)}}),
            ("dynamic_dims", {"dynamic_dims": 5}),
            ("batch_range", {"batch_range": 8}),
            ("batch_range", {"batch_range": (8, 4, 32)}),
            ("validation_batch_sizes", {"validation_batch_sizes": 8}),
            ("validation_batch_sizes", {"validation_batch_sizes": [64]}),
            ("filename", {"filename": "a/b"}),
            ("precision", {"precision": "int8"}),
            ("latency_iterations", {"latency_iterations": -1}),
        ],
    ),
    "ring_allreduce_seconds": (
        lambda **kw: ring_allreduce_seconds(**{"nbytes": 1e6, "workers": 2, "bandwidth_bytes_per_s": 1e9, **kw}),
        [
            ("nbytes", {"nbytes": -1}),
            ("nbytes", {"nbytes": NAN}),
            ("nbytes", {"nbytes": "1MB"}),
            ("workers", {"workers": 0}),
            ("workers", {"workers": 2.5}),
            ("workers", {"workers": True}),
            ("bandwidth_bytes_per_s", {"bandwidth_bytes_per_s": 0}),
            ("bandwidth_bytes_per_s", {"bandwidth_bytes_per_s": INF}),
            ("bandwidth_bytes_per_s", {"bandwidth_bytes_per_s": -1e9}),
            ("bandwidth_bytes_per_s", {"bandwidth_bytes_per_s": None}),
        ],
    ),
}


def _cases() -> list[Any]:
    out = []
    for owner, (build, rows) in TABLES.items():
        for index, (argument, kwargs) in enumerate(rows):
            out.append(pytest.param(build, argument, kwargs, id=f"{owner}-{index}-{argument}"))
    return out


@pytest.mark.parametrize("owner", list(TABLES))
def test_each_table_has_ten_bad_inputs(owner: str) -> None:
    assert len(TABLES[owner][1]) >= 10


@pytest.mark.parametrize(("build", "argument", "kwargs"), _cases())
def test_bad_input_is_named(build: Callable[..., Any], argument: str, kwargs: dict[str, Any]) -> None:
    value = kwargs[argument]
    with pytest.raises((ValueError, TypeError)) as info:
        build(**kwargs)
    message = str(info.value)
    assert f"{argument}=" in message, message
    shown = repr(value)
    if isinstance(value, torch.nn.Module):
        shown = type(value).__name__  # a module's repr spans lines; its class names it
    assert shown in message, message


def test_one_backend_name_alone_means_that_backend() -> None:
    assert TensorRTExportCallback(backends="onnx").export_kwargs["backends"] == ["onnx"]


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: QATCallback(benchmark_batch_sizes=8), r"Did you mean benchmark_batch_sizes=\[8\]\?"),
        (lambda: CompileCallback(options={"max_autotun": True}), r"Nearest valid ones: 'max_autotune'"),
        (lambda: CompileCallback(options={"no_such_inductor_option": 1}), r"is not an inductor option\. Nearest"),
        (lambda: TensorRTExportCallback(validation_batch_sizes=8), r"Did you mean validation_batch_sizes=\[8\]\?"),
        (lambda: TensorRTExportCallback(backends="onx"), r"'onx' is not one of them \(did you mean 'onnx'\?\)"),
        (lambda: TensorRTExportCallback(dynamic_dims={0: [1, 2]}), r"dimension 0 is the batch, already dynamic"),
        (lambda: TensorRTExportCallback(dynamic_dims={1: [1, 2]}), r"dimension 1 has \[1, 2\], not \(min, opt, max\)"),
    ],
)
def test_same_kind_of_mistake_same_kind_of_message(build: Callable[[], Any], match: str) -> None:
    """A list given as a scalar, an unknown name, a bad mapping entry: one `_validation` helper per kind says it."""
    with pytest.raises(ValueError, match=match):
        build()


def test_config_without_jsonargparse_is_a_usage_error_naming_the_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    """`bench --config` after an install that lost `jsonargparse[signatures]`: exit 2 and one line saying what to
    install, not "LightningCLI refused" the user's file."""
    import lightning.pytorch.cli as lightning_cli

    from lightning_perf.cli import main

    monkeypatch.setattr(lightning_cli, "_JSONARGPARSE_SIGNATURES_AVAILABLE", False)
    config = tmp_path / "cli.yaml"
    config.write_text("model:\n  class_path: lightning.pytorch.demos.boring_classes.BoringModel\n")
    with pytest.raises(SystemExit) as info:
        main(["bench", "--config", str(config), "--output", str(tmp_path / "out.json")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--config" in err[0] and "pip install 'jsonargparse[signatures]" in err[0] and "refused" not in err[0]


def test_jsonargparse_is_a_dependency_of_the_main_install() -> None:
    """The README's main install (`pip install -e ".[plot]"`) must bring what `bench --config` needs."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert any(dep.replace(" ", "").startswith("jsonargparse[signatures]") for dep in project["dependencies"])
