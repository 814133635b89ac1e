"""`lightning-perf export` on a checkpoint of a reference workload, and its argument errors (exit status 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_perf import FallbackWarning
from lightning_perf._imports import is_onnx_available, is_onnxruntime_available
from lightning_perf.cli import main
from lightning_perf.demos import ConvNetModule, make_workload

CONVNET = "lightning_perf.demos:ConvNetModule"
CONVNET_DATA = "lightning_perf.demos:ConvNetDataModule"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    model, data = make_workload("convnet", "tiny", seed=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(model, datamodule=data)
    path = root / "convnet.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.mark.slow
@pytest.mark.skipif(not (is_onnx_available() and is_onnxruntime_available()), reason="needs the `onnx` extra")
def test_export_a_checkpoint_with_its_datamodule(checkpoint: Path, tmp_path: Path, capsys) -> None:
    argv = [
        "export",
        str(checkpoint),
        "--module-class",
        CONVNET,
        "--datamodule-class",
        CONVNET_DATA,
        "--batch-range",
        "1,2,4",
        "--latency-iterations",
        "2",
        "--latency-warmup",
        "1",
        "--device",
        "cpu",
        "--dirpath",
        str(tmp_path),
    ]
    with pytest.warns(FallbackWarning, match="'tensorrt' is unavailable"):
        assert main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["convnet.export.json", "convnet.onnx", "convnet.onnx.data"]
    report = json.loads((tmp_path / "convnet.export.json").read_text())
    assert report["ok"] and report["backend"] == "onnx" and report["validation_source"] == "validation_data"
    assert report["metadata"] == {"checkpoint": str(checkpoint), "module_class": CONVNET}
    printed = capsys.readouterr().out
    for text in ("Export attempts", "unavailable", "Validation of onnx", "Latency on cpu", "speed-up", "wrote"):
        assert text in printed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--backends", "onnx,coreml"], "backends=['onnx', 'coreml']"),
        (["--batch-range", "8,4,32"], "min <= opt <= max, got min=8, opt=4, max=32"),
        (["--batch-range", "1,8"], "is not MIN,OPT,MAX"),
        (["--precision", "int4"], "invalid choice: 'int4'"),
        (["--dynamic-dim", "x=1,2,3"], "is not [INPUT:]DIM=MIN,OPT,MAX"),
        (["--input-shape", "3x0"], "positive integer sizes"),
        (["--module-class", "lightning_perf.demos:NoSuchModule"], "cannot import it"),
        (["--module-class", "lightning_perf.demos:ConvNetDataModule"], "is not a LightningModule subclass"),
        (["--module-class", "nodots"], "expected MODULE:CLASS"),
        (["--datamodule-class", CONVNET], "is not a LightningDataModule subclass"),
    ],
)
def test_bad_arguments_exit_2_and_say_what_is_valid(checkpoint: Path, extra: list[str], message: str, capsys) -> None:
    argv = ["export", str(checkpoint), "--module-class", CONVNET, *extra]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_checkpoint_and_missing_example(checkpoint: Path, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["export", str(tmp_path / "nope.ckpt"), "--module-class", CONVNET])
    assert info.value.code == 2 and "does not exist" in capsys.readouterr().err

    # A module without example_input_array and no datamodule: nothing to take an example from.
    with pytest.raises(SystemExit) as info:
        main(["export", str(checkpoint), "--module-class", "tests.test_export_cli:NoExampleConvNet"])
    assert info.value.code == 2 and "--input-shape" in capsys.readouterr().err


class NoExampleConvNet(ConvNetModule):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.example_input_array = None
