"""After training: convert, compare, calibrate, save and time quantized models (lightning_perf.deploy.quantize)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torchao  # noqa: F401  (the `test` extra installs it: a missing install fails here, not skips)
from torch import nn

from lightning_perf import FallbackWarning, _imports
from lightning_perf.deploy.artifacts import committed_set
from lightning_perf.deploy.quantize import save as save_module
from lightning_perf.deploy.quantize.convert import calibrate, convert
from lightning_perf.deploy.quantize.save import QuantizationReport, compiled_latency, export_quantized, save_quantized
from lightning_perf.deploy.validate import compare_models
from lightning_perf.functional.quantization import qat
from lightning_perf.functional.quantization.qat import QuantizationError
from lightning_perf.profiling.latency import LatencyRow
from tests.functional.test_qat import TinyConvNet, TinyMLP, _images, _train


@pytest.fixture(scope="module")
def prepared_conv() -> tuple[nn.Module, nn.Module]:
    """A float TinyConvNet and its x86 QAT-prepared module after a few training steps (shared by read-only tests)."""
    torch.manual_seed(0)
    float_model = TinyConvNet()
    x, y = _images()
    prepared = qat.prepare(float_model, qat.make_recipe("x86", "qat", example_inputs=x[:1]))
    _train(prepared, x, y)
    return float_model, prepared


def _visible(path: Path) -> list[str]:
    """The files a reader finds: each committed set's as ``<set>/<file>``; staging debris fails the test."""
    names = []
    for entry in path.iterdir():
        assert not entry.name.startswith(".staging-"), f"debris: {entry.name}"
        if not entry.name.startswith("."):
            found = committed_set(path, entry.name)
            names += [f"{entry.name}/{f.name}" for f in found.iterdir()] if found else [entry.name]
    return sorted(names)


# --------------------------------------------------------------------------------------------- x86: convert


def test_convert_matches_the_fake_quantized_model_and_leaves_it_alone(
    prepared_conv: tuple[nn.Module, nn.Module],
) -> None:
    _, prepared = prepared_conv
    state = {k: v.clone() for k, v in prepared.state_dict().items()}
    code = prepared.code
    quantized = convert(prepared)
    assert prepared.code == code and prepared.training
    for key, value in prepared.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)
    assert not qat.is_prepared(quantized) and not quantized.training
    targets = {str(n.target) for n in quantized.graph.nodes}
    assert any("quantize_per_tensor" in t for t in targets)
    assert "aten.add_.Tensor" not in targets  # no batch counting left in the inference graph
    x, y = _images(32, seed=1)
    reference = copy.deepcopy(prepared)
    qat.set_observers(reference, False)
    summary = compare_models(reference, quantized, [(x, y)])
    assert summary.passed, summary.problem
    assert summary.cosine > 0.99 and summary.top1_agreement > 0.8
    assert summary.reference_accuracy is not None and summary.accuracy_gap is not None


def test_compare_models_fails_below_min_cosine() -> None:
    torch.manual_seed(0)
    a, b = TinyMLP(), TinyMLP()
    summary = compare_models(a, b, [torch.randn(8, 32)], min_cosine=0.999)
    assert not summary.passed and "cosine similarity" in summary.problem
    assert summary.reference_accuracy is None  # no labels
    with pytest.raises(ValueError, match="no batch"):
        compare_models(a, b, [])


def test_ptq_calibrates_converts_and_saves(tmp_path: Path) -> None:
    torch.manual_seed(0)
    float_model = TinyConvNet().eval()
    x, y = _images(32)
    recipe = qat.make_recipe("x86", "ptq", example_inputs=x[:1])
    prepared = qat.prepare(float_model, recipe)
    assert not prepared.training
    assert calibrate(prepared, [(x[:16], y[:16]), (x[16:], y[16:])]) == 32
    quantized = convert(prepared)
    summary = compare_models(float_model, quantized, [(x, y)])
    assert summary.passed, summary.problem
    path = save_quantized(quantized, x[:1], tmp_path / "ptq.pt2")
    assert path == tmp_path / "ptq" / "ptq.pt2"  # the artifact set `ptq`
    loaded = torch.export.load(path).module()
    torch.testing.assert_close(loaded(x[:5]), quantized(x[:5]))
    assert _visible(tmp_path) == ["ptq/ptq.pt2"]  # no temporary file left behind


# ------------------------------------------------------------------------------------------ export_quantized


def test_export_quantized_writes_artifact_and_report(
    prepared_conv: tuple[nn.Module, nn.Module], tmp_path: Path
) -> None:
    float_model, prepared = prepared_conv
    x, y = _images(16, seed=2)
    report = export_quantized(
        prepared, float_model=float_model, validation_data=[(x, y)], dirpath=tmp_path, benchmark=False
    )
    assert report.ok, report.problems
    assert report.artifact == tmp_path / "model_int8" / "model_int8.pt2" and report.artifact.is_file()
    assert report.report_path == tmp_path / "model_int8" / "model_int8.json"
    data = json.loads(report.report_path.read_text())
    assert data["ok"] and data["recipe"]["backend"] == "x86"
    assert data["validation"]["cosine"] > 0.99 and data["validation"]["samples"] == 16
    assert data["latency"] == []
    loaded = torch.export.load(report.artifact).module()
    assert loaded(x[:3]).shape == (3, 4)
    assert _visible(tmp_path) == ["model_int8/model_int8.json", "model_int8/model_int8.pt2"]


@pytest.mark.skipif(not all(map(_imports.is_available, ("onnx", "onnxscript", "onnxruntime"))), reason="needs onnx")
def test_export_quantized_to_onnx_too(prepared_conv: tuple[nn.Module, nn.Module], tmp_path: Path) -> None:
    import onnxruntime

    _, prepared = prepared_conv
    report = export_quantized(prepared, dirpath=tmp_path, benchmark=False, onnx=True)
    assert report.ok and report.onnx == tmp_path / "model_int8" / "model_int8.onnx"
    assert (tmp_path / "model_int8" / "model_int8.onnx.data").is_file()
    session = onnxruntime.InferenceSession(str(report.onnx), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 3, 8, 8)
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    expected = torch.export.load(report.artifact).module()(x)
    assert torch.nn.functional.cosine_similarity(torch.from_numpy(out).flatten(), expected.flatten(), dim=0) > 0.99


def test_export_failure_warns_and_leaves_the_model(
    prepared_conv: tuple[nn.Module, nn.Module], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, prepared = prepared_conv
    state = {k: v.clone() for k, v in prepared.state_dict().items()}

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("convert exploded")

    monkeypatch.setattr(save_module, "convert", broken)
    with pytest.warns(FallbackWarning, match="convert exploded"):
        report = export_quantized(prepared, dirpath=tmp_path, benchmark=False)
    assert not report.ok and report.artifact is None
    assert _visible(tmp_path) == ["model_int8.failed/model_int8.json"]
    for key, value in prepared.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)
    with pytest.raises(QuantizationError, match="convert exploded"):
        export_quantized(prepared, dirpath=tmp_path, benchmark=False, strict=True)


def test_failed_validation_is_saved_under_a_failed_name(
    prepared_conv: tuple[nn.Module, nn.Module], tmp_path: Path
) -> None:
    _, prepared = prepared_conv
    with pytest.warns(FallbackWarning, match="cosine similarity"):
        report = export_quantized(prepared, dirpath=tmp_path, benchmark=False, min_cosine=1.01)
    assert not report.ok and report.artifact == tmp_path / "model_int8.failed" / "model_int8.failed.pt2"


@pytest.mark.slow
def test_compiled_latency_times_both_models(prepared_conv: tuple[nn.Module, nn.Module]) -> None:
    float_model, prepared = prepared_conv
    quantized = convert(prepared)
    rows = compiled_latency(float_model, quantized, torch.randn(1, 3, 8, 8), (1, 4), iterations=4, warmup=1)
    assert [r.batch_size for r in rows] == [1, 4]
    for row in rows:
        assert row.float_median_s > 0 and row.quantized_median_s > 0 and row.iterations == 4
        assert row.float_compile_s > 0 and row.quantized_compile_s > 0
        low, high = row.speedup_ci95
        assert low <= row.speedup <= high and row.speedup_verdict in ("faster", "slower", "no clear difference")
    assert not torch._inductor.config.freezing  # scoped to the measurement


def test_report_prints_and_writes_each_speedup_with_its_interval_and_verdict() -> None:
    """Mocked timings: float blocks of 4 ms, quantized blocks of 1 ms, with a little noise."""
    row = LatencyRow.from_blocks(
        8, [[4e-3, 4.2e-3], [3.9e-3, 4.1e-3]], [[1e-3, 1.1e-3], [0.95e-3, 1.05e-3]], names=("float", "quantized")
    )
    recipe = qat.make_recipe("x86", "qat", input_shapes=[(3, 8, 8)])
    report = QuantizationReport(ok=True, recipe=recipe, artifact=Path("m.pt2"), latency=[row])
    low, high = row.speedup_ci95
    assert 1 < low <= row.speedup <= high and row.speedup_verdict == "faster"
    text = report.summary("QATCallback")
    assert f"batch 8: 1.02 ms quantized vs 4.05 ms float, both compiled: {row.format_speedup()}" in text
    assert f"[{low:.2f}-{high:.2f}], faster (95% interval, bootstrap over the steps of one repeat)" in text
    (saved,) = json.loads(json.dumps(report.to_dict()))["latency"]
    assert saved["speedup_ci95"] == [low, high] and saved["speedup_verdict"] == "faster"
    assert saved["float_median_s"] == pytest.approx(4.05e-3) and "quantized_blocks_s" not in saved
    assert saved["candidate_blocks_s"] == [[1e-3, 1.1e-3], [0.95e-3, 1.05e-3]]
