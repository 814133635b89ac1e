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


# (argument named in the message, keyword arguments); the message must show kwargs[argument]
Row = tuple[str, dict[str, Any]]


def _bad(argument: str, *values: Any) -> list[Row]:
    """One row per bad value of one argument."""
    return [(argument, {argument: value}) for value in values]


TABLES: dict[str, tuple[Callable[..., Any], list[Row]]] = {
    "ChannelsLastCallback": (
        ChannelsLastCallback,
        [*_bad("dims", 1, 4, 0, -2, "2", "Auto", "", None, 2.0, True, [2, 3], NAN)],
    ),
    "CompileCallback": (
        CompileCallback,
        [
            *_bad("mode", "fastest", 3),
            *_bad("fullgraph", "false", 1),
            *_bad("dynamic", "true"),
            *_bad("backend", "", 7),
            *_bad("options", "max_autotune"),
            *_bad("regions", [], 5, "all", [3]),
            *_bad("options", {"no_such_inductor_option": 1}),
            *_bad("cache", 3),
            *_bad("stages", [], ["fit", "deploy"]),
            *_bad("strict", "false"),
            *_bad("warmup_steps", 0, -1, 1.5, NAN, True),
        ],
    ),
    "BackendFlagsCallback": (
        BackendFlagsCallback,
        [
            *_bad("cudnn_benchmark", "false", 0),
            *_bad("tf32", "true", 1.0),
            *_bad("float32_matmul_precision", "low", "", NAN),
            *_bad("sdpa_backends", [], ["flash", "fast"], "flash", 3, [1]),
            *_bad("preset", "fast", True),
            ("tf32", {"tf32": False, "float32_matmul_precision": "high"}),
        ],
    ),
    "FusedOptimizerCallback": (
        FusedOptimizerCallback,
        [*_bad("mode", "Fused", "", None, 1, True, NAN, ["fused"], "for-each", "apex", b"fused")],
    ),
    "BottleneckCallback": (
        BottleneckCallback,
        [
            *_bad("warmup_steps", -1, 2.5, "5"),
            *_bad("log_every_n_steps", 0),
            *_bad("progress_bar", "false"),
            *_bad("sync_check_steps", -1),
            ("sync_check_steps", {"warmup_steps": 1, "sync_check_steps": 2}),
            *_bad("thresholds", {"data": NAN}, {"nonsense": 0.5}, "data"),
            *_bad("dirpath", 3),
            *_bad("filename", "", "a/b"),
            *_bad("plot", "false"),
            *_bad("verbose", 0),
        ],
    ),
    "MemoryProfilerCallback": (
        MemoryProfilerCallback,
        [
            *_bad("every_n_steps", 0, INF),
            *_bad("warmup_steps", -3),
            *_bad("points", [], ["everywhere"], "after_backward"),
            *_bad("leak_threshold", 0, NAN, -1.0),
            *_bad("leak_min_samples", 1),
            *_bad("record_history", "false"),
            *_bad("history_max_entries", 0),
            *_bad("oom_snapshot", "no"),
            *_bad("plot", None),
            *_bad("verbose", "yes"),
            *_bad("filename", ".."),
        ],
    ),
    "PowerSGDDDPStrategy": (
        PowerSGDDDPStrategy,
        [
            *_bad("matrix_approximation_rank", 0, 2.0),
            *_bad("start_powerSGD_iter", -1, 1),
            *_bad("min_compression_rate", NAN, -1.0),
            *_bad("use_error_feedback", "false"),
            *_bad("warm_start", 0),
            *_bad("orthogonalization_epsilon", INF),
            *_bad("hook", "fast"),
            *_bad("random_seed", -5),
            *_bad("log_stats", "true"),
            *_bad("bucket_cap_mb", 0, NAN),
            *_bad("static_graph", "false"),
        ],
    ),
    "BackendFlags": (
        BackendFlags,
        [
            *_bad("cudnn_benchmark", "false"),
            *_bad("matmul_tf32", 1),
            *_bad("cudnn_tf32", "true"),
            *_bad("float32_matmul_precision", "low", 1),
            *_bad("sdpa_backends", frozenset(), frozenset({"quick"}), "math"),
            ("matmul_tf32", {"matmul_tf32": True, "float32_matmul_precision": "highest"}),
            *_bad("fp32_precision", "tf32"),
        ],
    ),
    "switch_implementation": (
        lambda **kw: switch_implementation(kw.pop("optimizer", _optimizer()), **kw),
        [
            *_bad("mode", "Fused", None, 0, "", NAN),
            *_bad("sparse_params", 3, "weight", [1, 2]),
            *_bad("optimizer", "adam", None),
        ],
    ),
    "choose_implementation": (
        lambda **kw: choose_implementation(kw.pop("optimizer", _optimizer()), **kw),
        [
            *_bad("mode", "FUSED", True, ["auto"], INF, "none"),
            *_bad("sparse_params", None, 0, "p"),
            *_bad("optimizer", 1, torch.nn.Linear(1, 1)),
        ],
    ),
    "set_implementation": (
        lambda **kw: set_implementation(kw.pop("optimizer", _optimizer()), **kw),
        [
            *_bad("implementation", "auto", None, "Fused", "", 1, True, NAN, ["fused"]),
            ("optimizer", {"optimizer": "sgd", "implementation": "fused"}),
            ("optimizer", {"optimizer": None, "implementation": "foreach"}),
        ],
    ),
    "register_powersgd_hook": (
        lambda **kw: register_powersgd_hook(kw.pop("model", object()), **kw),
        [
            *_bad("hook", "fast"),
            *_bad("matrix_approximation_rank", 0, "2"),
            *_bad("start_powerSGD_iter", -1, 1),
            *_bad("min_compression_rate", NAN),
            *_bad("use_error_feedback", "false"),
            *_bad("warm_start", 1),
            *_bad("orthogonalization_epsilon", -1e-8),
            *_bad("random_seed", 1.5),
            *_bad("synchronous", "yes"),
            *_bad("model", torch.nn.Linear(2, 2)),
        ],
    ),
    "SlidingWindowInferenceCallback": (
        lambda **kw: SlidingWindowInferenceCallback(**{"roi_size": (8, 8, 8), **kw}),
        [
            *_bad("roi_size", (), 0, (8, -8), 8.5, "auto", None),
            *_bad("overlap", 1.0, -0.25, NAN),
            *_bad("sw_batch_size", 0, -4, "Auto", True),
            *_bad("mode", "linear"),
            *_bad("padding_mode", "zeros"),
            *_bad("sigma_scale", 0.0, INF),
            *_bad("cval", NAN),
            *_bad("progress", 1),
            *_bad("process_fn", "identity"),
            *_bad("buffer_steps", 0),
            *_bad("buffer_dim", "last"),
            *_bad("sw_device", "gpu"),
            *_bad("stages", ["predict", "fit"], []),
        ],
    ),
    "QATCallback": (
        QATCallback,
        [
            *_bad("benchmark_batch_sizes", 8, "8", [], [1, 0], [1.0]),  # 8: an int where a list is expected
            ("refresh", {"mode": "dynamic", "refresh": "yes"}),
            ("refresh", {"mode": "dynamic", "refresh": 1}),
            *_bad("refresh", True),  # only mode 'dynamic' caches a measured choice
            *_bad("mode", "int8"),
            *_bad("freeze_bn_after", -1),
            *_bad("fake_quant_after", 1.5),
            *_bad("eval_converted_every_n_epochs", 0),
            *_bad("filename", "../x"),
            *_bad("min_cosine", 2, NAN, True),
            *_bad("submodule", "", 3),
            *_bad("latency_iterations", 0),
            *_bad("calibration_batches", 0),
            *_bad("validation_batches", -1),
            *_bad("disable_observers_after", "3"),
            *_bad("input_key", ""),
            ("backend", {"mode": "dynamic", "backend": "x86"}),
        ],
    ),
    "TensorRTExportCallback": (
        TensorRTExportCallback,
        [
            *_bad("backends", "onx", [], ["onnx", "onnx"], [1]),  # one name alone is a list of it: did-you-mean
            # dimension 0 is the batch; (min, opt, max) needs three ints
            *_bad("dynamic_dims", {0: [1, 2]}, {1: [1, 2]}, {1: (4, 2, 8)}, {"seq": (1, 2, 3)}, 5),
            *_bad("batch_range", 8, (8, 4, 32)),
            *_bad("validation_batch_sizes", 8, [64]),
            *_bad("filename", "a/b"),
            *_bad("precision", "int8"),
            *_bad("latency_iterations", -1),
        ],
    ),
    "ring_allreduce_seconds": (
        lambda **kw: ring_allreduce_seconds(**{"nbytes": 1e6, "workers": 2, "bandwidth_bytes_per_s": 1e9, **kw}),
        [
            *_bad("nbytes", -1, NAN, "1MB"),
            *_bad("workers", 0, 2.5, True),
            *_bad("bandwidth_bytes_per_s", 0, INF, -1e9, None),
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
