"""`lightning-perf export` on a checkpoint of a reference workload, and its argument errors (exit status 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_perf import FallbackWarning
from lightning_perf._imports import is_available
from lightning_perf.cli import export as export_command
from lightning_perf.cli import main
from lightning_perf.demos import ConvNetModule, make_workload
from tests._models import trainer as make_trainer
from tests.deploy._sets import visible_files

CONVNET = "lightning_perf.demos:ConvNetModule"
CONVNET_DATA = "lightning_perf.demos:ConvNetDataModule"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    model, data = make_workload("convnet", "tiny", seed=0)
    trainer = make_trainer(root, max_steps=1, limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    path = root / "convnet.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.mark.slow
@pytest.mark.skipif(not all(map(is_available, ("onnx", "onnxscript", "onnxruntime"))), reason="needs the `onnx` extra")
def test_export_a_checkpoint_with_its_datamodule(checkpoint: Path, tmp_path: Path, capsys) -> None:
    options = ["--batch-range", "1,2,4", "--latency-iterations", "2", "--latency-warmup", "1", "--device", "cpu"]
    argv = ["export", str(checkpoint), "--module-class", CONVNET, "--datamodule-class", CONVNET_DATA, *options]
    argv += ["--dirpath", str(tmp_path)]
    with pytest.warns(FallbackWarning, match="'tensorrt' is unavailable"):
        assert main(argv) == 0
    assert visible_files(tmp_path) == [f"convnet/convnet.{ext}" for ext in ("export.json", "onnx", "onnx.data")]
    report = json.loads((tmp_path / "convnet" / "convnet.export.json").read_text())
    assert report["ok"] and report["backend"] == "onnx" and report["validation_source"] == "validation_data"
    assert report["metadata"] == {"checkpoint": str(checkpoint), "module_class": CONVNET}
    printed = capsys.readouterr().out
    for text in ("Export attempts", "unavailable", "Validation of onnx", "Latency on cpu", "speed-up", "wrote"):
        assert text in printed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--backends", "onnx,coreml"], "argument --backends: 'onnx,coreml' is not valid: unknown backends ['coreml']"),
        (["--backends", "onnx,onnx"], "argument --backends: 'onnx,onnx' is not valid. Expected distinct names"),
        (["--batch-range", "8,4,32"], "argument --batch-range: '8,4,32' is not valid. Expected MIN,OPT,MAX"),
        (["--batch-range", "1,8"], "argument --batch-range: '1,8' is not valid. Expected MIN,OPT,MAX"),
        (["--batch-range", "a,b,c"], "argument --batch-range: 'a,b,c' is not valid"),
        (["--precision", "int4"], "argument --precision: invalid choice: 'int4'"),
        (["--dynamic-dim", "x=1,2,3"], "argument --dynamic-dim: 'x=1,2,3' is not valid. Expected [INPUT:]DIM="),
        (["--dynamic-dim", "0=1,2,3"], "argument --dynamic-dim: '0=1,2,3' is not valid"),
        (["--input-shape", "3x0"], "argument --input-shape: '3x0' is not valid. Expected D1xD2...: positive integer"),
        (["--validation-batch-sizes", "64"], "argument --validation-batch-sizes: 64 is not valid. Expected batch"),
        (["--latency-iterations", "-1"], "argument --latency-iterations: '-1' is not valid. Expected an integer >= 0"),
        (["--latency-warmup", "two"], "argument --latency-warmup: 'two' is not valid"),
        (["--opset", "9"], "argument --opset: '9' is not valid. Expected an integer >= 18"),
        (["--device", "tpu"], "argument --device: 'tpu' is not valid"),
        (["--device", "mps"], "argument --device: 'mps' is not valid. Expected cpu, cuda or cuda:N"),
        (["--filename", "../x"], "argument --filename: '../x' is not valid. Expected a plain, non-hidden file stem"),
        (["--onnx-providers", " , "], "argument --onnx-providers: ' , ' is not valid"),
        (["--backend", "onnx"], "unrecognized arguments: --backend"),  # no abbreviation of --backends
        (["--precision", "fp16", "--device", "cpu"], "(precision='fp16')` cannot be exported with backends="),
        (["--precision", "bf16", "--backends", "onnx"], "bf16 needs TensorRT on a CUDA device"),
        (["--onnx-providers", "NoSuchProvider"], "'NoSuchProvider' is not one of them"),
        (["--module-class", "lightning_perf.demos:NoSuchModule"], "has no attribute 'NoSuchModule'"),
        (["--module-class", "no_such_pkg.models:Net"], "cannot import module 'no_such_pkg.models'"),
        (["--module-class", "lightning_perf.demos:ConvNetDataModule"], "is not a subclass of LightningModule"),
        (["--module-class", "nodots"], "argument --module-class: 'nodots' is not valid. Expected MODULE:CLASS"),
        (["--datamodule-class", CONVNET], "is not a subclass of LightningDataModule"),
    ],
)
def test_bad_arguments_exit_2_and_say_what_is_valid(checkpoint: Path, extra: list[str], message: str, capsys) -> None:
    argv = ["export", str(checkpoint), "--module-class", CONVNET, *extra]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err  # one line, no traceback


def test_export_choices_need_no_torch_and_equal_the_deploy_layer() -> None:
    from lightning_perf.deploy import BACKENDS, PRECISIONS

    assert export_command.EXPORT_BACKENDS == BACKENDS
    assert tuple(PRECISIONS) == export_command.EXPORT_PRECISIONS


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path: Path, capsys) -> None:
    """A crafted checkpoint whose unpickling would create a file: never unpickled, exit 2 naming add_safe_globals."""
    marker = tmp_path / "pwned"
    crafted = tmp_path / "crafted.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": _Payload(str(marker))}, crafted)
    with pytest.raises(SystemExit) as info:
        main(["export", str(crafted), "--module-class", CONVNET, "--input-shape", "3x16x16"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "add_safe_globals" in err and "Traceback" not in err
    assert not marker.exists()


NOT_A_CHECKPOINT = "is not a PyTorch checkpoint:"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (lambda real: b"epoch: 3\nloss: 0.25\n", f"{NOT_A_CHECKPOINT} a text file (it starts with 'epoch: 3')"),
        (lambda real: real[: len(real) // 2], f"{NOT_A_CHECKPOINT} truncated or corrupt zip archive"),
        (lambda real: bytes([0x4D, 0x5A]) + bytes(range(256)) * 4, f"{NOT_A_CHECKPOINT} it starts with the bytes"),
    ],
    ids=["text", "truncated-zip", "random-bytes"],
)
def test_a_file_that_is_not_a_checkpoint_exits_2_with_one_line_before_any_work(
    checkpoint: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, content: Any, problem: str
) -> None:
    path = tmp_path / "model.ckpt"
    path.write_bytes(content(checkpoint.read_bytes()))

    def no_work(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the export started on a file that is not a checkpoint")

    monkeypatch.setattr("lightning_perf.benchmark.sources.import_class", no_work)  # refused before the class import
    with pytest.raises(SystemExit) as info:
        main(["export", str(path), "--module-class", CONVNET, "--input-shape", "3x16x16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert f"argument checkpoint: {str(path)!r} {problem}" in err[0], err[0]
    assert "add_safe_globals" not in err[0] and "Traceback" not in err[0]


def test_a_pytorch_file_that_is_not_a_lightning_checkpoint_is_named_as_such(tmp_path: Path, capsys) -> None:
    path = tmp_path / "weights.pt"
    torch.save({"conv.weight": torch.zeros(2)}, path)
    with pytest.raises(SystemExit) as info:
        main(["export", str(path), "--module-class", CONVNET, "--input-shape", "3x16x16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert "is a PyTorch file but not a Lightning checkpoint: it holds a dict with the keys ['conv.weight']" in err[0]


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_missing_checkpoint_and_missing_example(checkpoint: Path, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["export", str(tmp_path / "nope.ckpt"), "--module-class", CONVNET])
    assert info.value.code == 2 and "Expected the path of an existing file (missing)" in capsys.readouterr().err

    # A module without example_input_array and no datamodule: nothing to take an example from.
    with pytest.raises(SystemExit) as info:
        main(["export", str(checkpoint), "--module-class", "tests.cli.test_export:NoExampleConvNet"])
    assert info.value.code == 2 and "--input-shape" in capsys.readouterr().err


class NoExampleConvNet(ConvNetModule):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.example_input_array = None
