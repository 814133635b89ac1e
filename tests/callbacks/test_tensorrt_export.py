"""TensorRTExportCallback: best checkpoint, untouched model and checkpoints, rank zero, fallback, early errors."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_perf import FallbackWarning, NoEffectWarning
from lightning_perf._imports import is_available
from lightning_perf.callbacks import TensorRTExportCallback
from lightning_perf.callbacks import tensorrt_export as callback_module
from lightning_perf.demos import ConvNetModule, make_workload
from lightning_perf.deploy.export import ExportError
from tests.callbacks._sharded import ShardsItself, one_process_group  # noqa: F401  (a fixture)
from tests.deploy._sets import visible_files

needs_onnx = pytest.mark.skipif(
    not all(map(is_available, ("onnx", "onnxscript", "onnxruntime"))), reason="needs the `onnx` extra"
)
QUICK = {"batch_range": (1, 2, 4), "latency_iterations": 2, "latency_warmup": 1, "device": "cpu"}


def _trainer(root: Path, callbacks: list[Any], **overrides: Any) -> pl.Trainer:
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 3,
        "limit_val_batches": 2,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": root,
        **overrides,
    }
    return pl.Trainer(callbacks=callbacks, **kwargs)


class _FirstStepIsBest(ConvNetModule):
    """Logs the step as the monitored metric (mode "min"): the best checkpoint is the first one, not the final weights.

    It has no ``example_input_array``, so the callback takes its example from the first validation batch.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.example_input_array = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("order", float(self.global_step))
        return super().training_step(batch, batch_idx)


@needs_onnx
@pytest.mark.slow
def test_exports_the_best_checkpoint_and_leaves_model_and_checkpoints_untouched(tmp_path: Path, monkeypatch) -> None:
    pl.seed_everything(0, verbose=False)
    model = _FirstStepIsBest("tiny")
    _, data = make_workload("convnet", "tiny", seed=0)
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="order", mode="min", every_n_train_steps=1, save_top_k=1
    )
    callback = TensorRTExportCallback(backends=["onnx"], **QUICK)

    seen: dict[str, Any] = {}
    real_export = callback_module.export_model

    def spy(model_copy: Any, *args: Any, **kwargs: Any) -> Any:
        # State at the moment of export, to compare with the state after it.
        seen["files"] = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "ckpt").glob("*.ckpt")}
        seen["training"] = trained.training
        seen["params"] = {k: v.clone() for k, v in trained.state_dict().items()}
        seen["copy_is_model"] = model_copy is trained
        return real_export(model_copy, *args, **kwargs)

    trained = model
    monkeypatch.setattr(callback_module, "export_model", spy)
    trainer = _trainer(tmp_path, [checkpoint, callback], enable_checkpointing=True)
    trainer.fit(model, datamodule=data)

    best = Path(checkpoint.best_model_path)
    assert best.name == "epoch=0-step=1.ckpt"  # the first step's weights, not the final ones
    assert not seen["copy_is_model"]
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "ckpt").glob("*.ckpt")} == seen["files"]
    assert model.training is seen["training"]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, seen["params"][key], rtol=0, atol=0, msg=key)

    report = callback.report
    assert report is not None and report.ok and report.backend == "onnx"
    assert report.artifact == tmp_path / "ckpt" / "model" / "model.onnx"  # the set `model`, next to the checkpoints
    assert report.metadata["checkpoint"] == str(best) and report.metadata["source"] == "checkpoint"
    assert report.validation_source == "validation_data"
    saved = json.loads((tmp_path / "ckpt" / "model" / "model.export.json").read_text())
    assert saved["metadata"]["global_step"] == 3

    # The artifact computes what the best checkpoint computes, not what the final weights compute.
    import onnxruntime as ort

    x = next(iter(data.val_dataloader()))[0][:4]
    (out,) = ort.InferenceSession(str(report.artifact), providers=["CPUExecutionProvider"]).run(
        None, {"input": x.numpy()}
    )
    best_model = _FirstStepIsBest.load_from_checkpoint(best, map_location="cpu").eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(out), best_model(x), atol=1e-4, rtol=1e-4)
        assert not torch.allclose(torch.from_numpy(out), model.eval()(x), atol=1e-4)


def test_tensorrt_unavailable_warns_and_the_fit_still_succeeds(tmp_path: Path) -> None:
    model, data = make_workload("convnet", "tiny", seed=0)
    callback = TensorRTExportCallback(backends=["tensorrt"], **QUICK)  # on the CPU TensorRT cannot run anywhere
    trainer = _trainer(tmp_path, [callback])
    with pytest.warns(FallbackWarning, match="'tensorrt' is unavailable"):
        trainer.fit(model, datamodule=data)
    assert trainer.state.finished and trainer.global_step == 3
    assert callback.report is not None and not callback.report.ok
    assert visible_files(tmp_path / "export") == ["model.failed/model.export.json"]


def test_strict_makes_an_export_failure_fail_the_fit(tmp_path: Path) -> None:
    model, data = make_workload("convnet", "tiny", seed=0)
    trainer = _trainer(tmp_path, [TensorRTExportCallback(backends=["tensorrt"], strict=True, **QUICK)])
    with pytest.raises(ExportError, match="'tensorrt' is unavailable"):
        trainer.fit(model, datamodule=data)
    assert trainer.global_step == 3  # training itself ran to the end


def test_a_failure_outside_the_export_warns_and_keeps_the_fit(tmp_path: Path, monkeypatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("cannot copy this model")

    monkeypatch.setattr(callback_module, "_detached_copy", broken)
    model, data = make_workload("convnet", "tiny", seed=0)
    callback = TensorRTExportCallback(backends=["onnx"], **QUICK)
    with pytest.warns(FallbackWarning, match="could not export the model .*cannot copy this model.*unchanged"):
        _trainer(tmp_path, [callback]).fit(model, datamodule=data)
    assert callback.report is None

    strict = TensorRTExportCallback(backends=["onnx"], strict=True, **QUICK)
    with pytest.raises(ExportError, match="cannot copy this model"):
        _trainer(tmp_path, [strict]).fit(model, datamodule=data)


def test_only_rank_zero_exports(tmp_path: Path, monkeypatch) -> None:
    def must_not_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a rank other than zero exported")

    monkeypatch.setattr(callback_module, "export_model", must_not_run)
    monkeypatch.setattr(callback_module, "_detached_copy", must_not_run)
    callback = TensorRTExportCallback(backends=["onnx"], dirpath=tmp_path, **QUICK)
    rank_one = SimpleNamespace(is_global_zero=False, global_rank=1)
    callback.on_fit_end(rank_one, ConvNetModule("tiny"))  # type: ignore[arg-type]
    assert callback.report is None and list(tmp_path.iterdir()) == []


# Under 2-process DDP one artifact set is written: tests/test_generic.py::test_ddp_two_processes.


# --------------------------------------------------------------------------------------------- early errors


class _NoExample(ConvNetModule):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.example_input_array = None


class _DictExample(ConvNetModule):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.example_input_array = {"x": torch.zeros(1, 3, 16, 16)}


@needs_onnx
def test_without_example_or_validation_data_the_call_training_made_is_the_example(tmp_path: Path) -> None:
    _, data = make_workload("convnet", "tiny", seed=0)
    data.setup("fit")
    callback = TensorRTExportCallback(backends=["onnx"], **QUICK)
    trainer = _trainer(tmp_path, [callback])
    trainer.fit(_NoExample("tiny"), train_dataloaders=data.train_dataloader())
    assert callback.report is not None and callback.report.ok, callback.report
    assert callback.report.metadata["example_source"] == "the first training call"
    assert [s.name for s in callback.report.inputs] == ["input"]
    assert callback._recorder is not None and not callback._recorder._handle.hooks_dict_ref()  # the hook removed


def test_dict_example_input_fails_in_setup(tmp_path: Path) -> None:
    _, data = make_workload("convnet", "tiny", seed=0)
    trainer = _trainer(tmp_path, [TensorRTExportCallback(backends=["onnx"], **QUICK)])
    with pytest.raises(ValueError, match="example_input_array is a dict"):
        trainer.fit(_DictExample("tiny"), datamodule=data)
    assert trainer.global_step == 0


def test_a_fit_that_never_calls_forward_says_what_would_give_an_example(tmp_path: Path) -> None:
    class StepCallsTheNet(_NoExample):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    _, data = make_workload("convnet", "tiny", seed=0)
    data.setup("fit")
    callback = TensorRTExportCallback(backends=["onnx"], strict=True, **QUICK)
    with pytest.raises(ExportError, match=r"no example input for StepCallsTheNet.*never called.*input_shapes"):
        _trainer(tmp_path, [callback]).fit(StepCallsTheNet("tiny"), train_dataloaders=data.train_dataloader())
    assert not callback._recorder._handle.hooks_dict_ref()  # teardown took the hook off


def test_input_shapes_stand_in_for_a_missing_example() -> None:
    trainer = SimpleNamespace(fit_loop=None)  # no validation data, and the module has no example input
    callback = TensorRTExportCallback(backends=["onnx"], input_shapes=[(3, 16, 16)], **QUICK)
    callback.setup(trainer, _NoExample("tiny"), "fit")  # type: ignore[arg-type]  # the shapes stand in: no hook
    assert callback.input_shapes == [(3, 16, 16)] and callback._recorder is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backends": ["tensorrt", "tflite"]}, r"TensorRTExportCallback\(backends=\['tensorrt', 'tflite'\]\)"),
        ({"precision": "fp8"}, r"TensorRTExportCallback\(precision='fp8'\).*'fp32', 'fp16', 'bf16'"),
        ({"batch_range": (16, 8, 32)}, "min <= opt <= max, got min=16, opt=8, max=32"),
        ({"batch_range": (1, 64, 32)}, "got min=1, opt=64, max=32"),
        (
            {"input_shapes": [(3, -1)]},
            r"input_shapes=\[\(3, -1\)\]\)`.*input 0's shape \(3, -1\) is not a sequence of positive",
        ),
        ({"filename": "../model"}, "filename='../model'"),
        ({"filename": ""}, "filename=''"),
        ({"backends": []}, r"backends=\[\].*non-empty"),
        ({"backends": ["onnx", "onnx"]}, "distinct"),
        ({"validation_batch_sizes": [64]}, "within the batch range 1..32"),
        ({"tolerance": {"atol": float("nan")}}, "atol=nan"),
        ({"tolerance": 0.1}, "tolerance=0.1"),
        ({"latency_warmup": 1.5}, "latency_warmup=1.5"),
        ({"device": "tpu"}, "device='tpu'"),
        ({"opset": 9}, "opset=9"),
        ({"onnx_providers": "CPUExecutionProvider"}, "onnx_providers='CPUExecutionProvider'"),
        ({"strict": "false"}, r"strict='false'.*True or False"),
        ({"use_best_checkpoint": 1}, r"use_best_checkpoint=1.*True or False"),
        ({"dirpath": 3}, r"dirpath=3.*directory path"),
        ({"input_key": ""}, r"input_key=''"),
        ({"input_key": 0}, r"input_key=0"),
        # Issue 28: each refused at construction, naming the argument, the value and what is valid.
        ({"onnx_providers": ["NoSuchProvider"]}, r"providers=\['NoSuchProvider'\]\)` is not valid: 'NoSuch"),
        ({"onnx_providers": ["CUDAExecutionprovider"]}, r"did you mean 'CUDAExecutionProvider'\?"),
        ({"onnx_providers": []}, r"onnx_providers=\[\].*non-empty list"),
        (
            {"precision": "fp16", "device": "cpu"},
            r"precision='fp16'\)` cannot be .* on cpu.*fp16 needs a CUDA",
        ),
        (
            {"precision": "bf16", "device": "cpu"},
            r"precision='bf16'\)` cannot be.*bf16 needs TensorRT on a CUDA",
        ),
        (
            {"precision": "bf16", "backends": ["onnx"], "device": "cuda"},
            r"'bf16'.*backends=\['onnx'\] on cuda",
        ),
        (
            {"precision": "fp16", "backends": ["onnx"], "device": "cuda", "onnx_providers": ["CPUExecutionProvider"]},
            r"precision='fp16'.*lacks half-precision kernels",
        ),
        ({"input_shapes": [3, 32]}, r"input_shapes=\[3, 32\]\)` is not valid: that is one shape.*\[\(3, 32\)\]\?"),
        ({"input_shapes": [(3, 32), 5]}, r"input_shapes=\[\(3, 32\), 5\]\)`.*input 1's shape 5"),
        ({"input_shapes": "3x32"}, r"input_shapes='3x32'\)` is not valid. Expected a list of shapes"),
        ({"tolerance": {"nope": 1}}, r"tolerance=\{'nope': 1\}\)` is not valid: no key 'nope'.*'atol', 'rtol'"),
        ({"tolerance": {"atol": -1.0}}, r"tolerance=\{'atol': -1.0\}\)` is not valid: `Tolerance\(atol=-1.0\)"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        TensorRTExportCallback(**kwargs)


def test_precisions_that_some_backend_computes_are_accepted() -> None:
    TensorRTExportCallback(precision="bf16", device="cuda")  # TensorRT on a CUDA device (checked again at export)
    TensorRTExportCallback(precision="fp16", backends=["onnx"], device="cuda")  # onnxruntime-gpu's CUDA provider
    TensorRTExportCallback(onnx_providers=["TensorrtExecutionProvider", "CPUExecutionProvider"])


def test_provider_names_are_checked_without_onnxruntime(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_perf.deploy import backend

    monkeypatch.setattr(backend, "is_available", lambda module: False)
    assert "CUDAExecutionProvider" in backend.known_onnx_providers()
    with pytest.raises(ValueError, match=r"'Cuda' is not one of them.*'CUDAExecutionProvider'"):
        TensorRTExportCallback(onnx_providers=["Cuda"])


class _Payload:
    """Unpickling it would create ``marker``: what a crafted checkpoint does to run code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_a_crafted_best_checkpoint_is_never_unpickled(tmp_path: Path, monkeypatch) -> None:
    marker = tmp_path / "pwned"
    crafted = tmp_path / "crafted.ckpt"
    model, data = make_workload("convnet", "tiny", seed=0)
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": _Payload(str(marker))}, crafted)
    with pytest.raises(pickle.UnpicklingError, match=r"add_safe_globals\(\[open\]\)"):
        callback_module._load_state_dict(crafted)
    assert not marker.exists()
    # Through the callback: the export is refused with that reason, the fit ends, nothing ran.
    monkeypatch.setattr(callback_module, "_best_checkpoint", lambda trainer: crafted)
    callback = TensorRTExportCallback(backends=["onnx"], dirpath=tmp_path / "out", **QUICK)
    with pytest.warns(FallbackWarning, match="UnsafeCheckpointError.*add_safe_globals"):
        _trainer(tmp_path, [callback]).fit(model, datamodule=data)
    assert not marker.exists() and callback.report is None


@pytest.mark.parametrize("strategy", ["SingleDeviceStrategy", "ModelParallelStrategy"])
@pytest.mark.usefixtures("one_process_group")
def test_refuses_a_sharded_model(strategy: str, tmp_path: Path) -> None:
    """Under ModelParallelStrategy it refuses in ``setup``; a model sharded by its own ``configure_model`` once that has
    run: one warning naming the strategy and the way out, then nothing exported at the end of the fit."""
    callback = TensorRTExportCallback(backends=["onnx"], dirpath=tmp_path, **QUICK)
    trainer: Any = _trainer(tmp_path, [])
    if strategy == "ModelParallelStrategy":
        trainer = SimpleNamespace(strategy=ModelParallelStrategy(), is_global_zero=True)
    model = ShardsItself()
    expected = rf"TensorRTExportCallback does nothing under {strategy}: .*lightning-perf export"
    with pytest.warns(NoEffectWarning, match=expected):
        callback.setup(trainer, model, "fit")
        model.configure_model()
    assert "configure_model" not in model.__dict__
    callback.on_fit_end(trainer, model)
    assert callback.report is None and not list(tmp_path.iterdir())
