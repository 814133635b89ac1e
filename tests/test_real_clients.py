"""Real clients: models nobody here wrote, whose forward takes several or keyword inputs (tests/_real_clients.py),
through dynamic int8 (onnxruntime), ONNX export and the bench's fit and predict, none with `example_input_array`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_perf._imports import is_available
from lightning_perf.benchmark.spec import RunSpec
from lightning_perf.benchmark.worker import run as run_worker
from lightning_perf.callbacks import QATCallback, TensorRTExportCallback
from tests import _real_clients as clients
from tests._models import trainer as make_trainer

pytestmark = [
    pytest.mark.skipif(
        not all(map(is_available, ("onnx", "onnxscript", "onnxruntime"))), reason="needs the `onnx` extra"
    ),
    pytest.mark.filterwarnings("ignore:.*(does not have many workers|LeafSpec|Seed set|litlogger|GPU available).*"),
]

# (model, data module, the export's input names): positional inputs, keyword inputs of a HF model, a keyword mask.
CLIENTS = {
    "lightning-demo-transformer": ("DemoTransformer", "TupleTokens", ["inputs", "target"]),
    "hf-t5": ("TinyT5", "T5Tokens", ["input_ids", "attention_mask", "decoder_input_ids"]),
    "keyword-mask": ("MaskedPooling", "FeatureTokens", ["features", "mask"]),
}


def _fit(name: str, callback: Any, root: Path) -> None:
    model_name, data_name, _ = CLIENTS[name]
    torch.manual_seed(0)
    model = getattr(clients, model_name)()
    assert model.example_input_array is None
    trainer = make_trainer(
        root, max_steps=2, limit_val_batches=2, callbacks=[callback], accelerator="auto", devices="auto"
    )
    trainer.fit(model, datamodule=getattr(clients, data_name)())


@pytest.mark.parametrize("name", list(CLIENTS))
def test_dynamic_int8_with_onnxruntime_from_the_call_training_made(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_PERF_CACHE", str(tmp_path / "cache"))
    callback = QATCallback(
        mode="dynamic", backend="onnxruntime", benchmark=False, latency_iterations=2, validation_batches=2
    )
    _fit(name, callback, tmp_path)
    report = callback.report
    assert report is not None and report.ok, report.problems if report else None
    assert report.validation.passed and report.validation.batches == 2  # the validation batches, each as trained
    assert report.artifact is not None and report.artifact.is_file()


@pytest.mark.parametrize("name", list(CLIENTS))
def test_onnx_export_has_one_named_input_per_batched_tensor_and_validates_at_several_batch_sizes(
    name: str, tmp_path: Path
) -> None:
    callback = TensorRTExportCallback(backends=["onnx"], batch_range=(1, 2, 4), latency_iterations=0)
    _fit(name, callback, tmp_path)
    report = callback.report
    assert report is not None and report.ok, [a.reason for a in report.attempts] if report else None
    assert [s.name for s in report.inputs] == CLIENTS[name][2]
    assert report.metadata["example_source"] == "the first training call"
    assert report.validation_source == "validation_data"
    assert [v.batch_size for v in report.attempt.validation] == [1, 2, 4]
    import onnxruntime as ort

    session = ort.InferenceSession(str(report.artifact), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == CLIENTS[name][2]
    assert all(i.shape[0] != 4 for i in session.get_inputs())  # the batch dimension of every input is dynamic


@pytest.mark.parametrize("name", list(CLIENTS))
def test_bench_fits_and_predicts_the_model_as_training_calls_it(name: str) -> None:
    model_name, data_name, _ = CLIENTS[name]
    source = {"kind": "import", "model": f"tests._real_clients:{model_name}",
              "datamodule": f"tests._real_clients:{data_name}", "model_args": {}, "datamodule_args": {}}  # fmt: skip
    fit = run_worker(RunSpec(workload=model_name, config="baseline", steps=2, warmup_steps=1, source=source))
    assert fit.ok, fit.error
    assert fit.losses and all(loss == loss for loss in fit.losses)  # no NaN
    spec = RunSpec(workload=model_name, config="baseline", steps=2, warmup_steps=1, source=source, stage="predict")
    predicted = run_worker(spec)
    assert predicted.ok, predicted.error  # Lightning's default predict_step would call forward with the whole batch
    assert len(predicted.predict_step_times_s) == 2
