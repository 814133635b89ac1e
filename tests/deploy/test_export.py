"""`export_model`: ONNX end to end on the reference workloads, fallback, validation, atomic writes, argument errors.

Each real ONNX export costs a few seconds, so the end-to-end tests are few and each checks many things at once; the
rest runs on the checks' building blocks or with the expensive step replaced.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_perf import FallbackWarning
from lightning_perf._imports import is_available
from lightning_perf.demos import make_workload
from lightning_perf.deploy.artifacts import committed_set, write_set
from lightning_perf.deploy.backend import BackendUnavailable, validate_options
from lightning_perf.deploy.export import ExportError, export_model
from lightning_perf.deploy.inputs import DimRange, build_input_specs, example_inputs_from_shapes
from lightning_perf.deploy.onnx import OnnxBackend, OnnxRunner
from lightning_perf.deploy.validate import DEFAULT_TOLERANCES, Tolerance, compare_outputs
from lightning_perf.functional.inputs import as_input_tuple, split_inputs

needs_onnx = pytest.mark.skipif(
    not all(map(is_available, ("onnx", "onnxscript", "onnxruntime"))), reason="needs the `onnx` extra"
)
SMALL = {"batch_range": (1, 2, 4), "latency_iterations": 2, "latency_warmup": 1, "device": "cpu"}


def _files(path: Path) -> list[str]:
    """What a reader finds in ``path``: plain files by name, each committed set's files as ``<set>/<file>``.

    Staging directories and temporary links are debris and fail the test; ``.<set>.versions`` holds the sets.
    """
    names = []
    for entry in path.iterdir():
        assert not entry.name.startswith(".staging-") and ".link-" not in entry.name, f"debris: {entry.name}"
        if entry.name.startswith("."):
            continue
        committed = committed_set(path, entry.name)
        if committed is not None:
            names += [f"{entry.name}/{f.name}" for f in committed.iterdir()]
        else:
            names.append(entry.name)
    return sorted(names)


def _snapshot(model: nn.Module) -> tuple[bool, dict[str, torch.Tensor]]:
    return model.training, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model: nn.Module, snapshot: tuple[bool, dict[str, torch.Tensor]]) -> None:
    training, state = snapshot
    assert model.training is training
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)


def _run_onnx(path: Path, inputs: torch.Tensor) -> torch.Tensor:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: inputs.numpy()})
    return torch.from_numpy(out)


# ---------------------------------------------------------------------------------------------- end to end (ONNX)


@needs_onnx
@pytest.mark.slow
def test_convnet_falls_back_from_tensorrt_to_a_validated_onnx_export(tmp_path: Path) -> None:
    """The default backends on a CPU: TensorRT is unavailable (a real fallback, with its reason), ONNX passes."""
    model, data = make_workload("convnet", "tiny", seed=0)
    data.setup("validate")
    model.train()
    before = _snapshot(model)
    with pytest.warns(FallbackWarning, match=r"'tensorrt' is unavailable: .*(tensorrt|CUDA).*falling back to 'onnx'"):
        report = export_model(
            model, model.example_input_array, dirpath=tmp_path, validation_data=data.val_dataloader(), **SMALL
        )
    _assert_unchanged(model, before)

    assert report.ok and report.backend == "onnx"
    assert [a.status for a in report.attempts] == ["unavailable", "ok"]
    assert report.artifact == tmp_path / "model" / "model.onnx"
    assert report.report_path == tmp_path / "model" / "model.export.json"
    assert _files(tmp_path) == ["model/model.export.json", "model/model.onnx", "model/model.onnx.data"]  # no debris
    onnx_attempt = report.attempts[1]
    assert [v.batch_size for v in onnx_attempt.validation] == [1, 2, 4]
    for result in onnx_attempt.validation:
        (check,) = result.outputs
        assert result.passed and check.passed and check.name == "output"
        assert check.shape == check.expected_shape == [result.batch_size, 10]
        assert check.max_abs_diff is not None and check.max_abs_diff < 1e-4
        assert check.cosine is not None and check.cosine > 0.9999
    assert [row.batch_size for row in onnx_attempt.latency] == [1, 2, 4]
    for row in onnx_attempt.latency:
        assert row.iterations == 2 and row.eager_median_s > 0 and row.export_median_s > 0
        # Export time over eager time from the paired blocks, with its 95% interval and verdict.
        low, high = row.speedup_ci95
        assert low <= row.speedup <= high and row.speedup_n == 1  # the ABBA blocks pooled: one process
        assert row.speedup_verdict in ("faster", "slower", "no clear difference")
        assert [len(b) for b in row.baseline_blocks_s] == [len(b) for b in row.candidate_blocks_s] == [1, 1]
        assert row.export_throughput == pytest.approx(row.batch_size / row.export_median_s)

    # The artifact stands on its own: a fresh onnxruntime session on real data, at a batch size never traced.
    x = next(iter(data.val_dataloader()))[0][:3]
    with torch.no_grad():
        torch.testing.assert_close(_run_onnx(report.artifact, x), model.eval()(x), atol=1e-4, rtol=1e-4)

    saved = json.loads((tmp_path / "model" / "model.export.json").read_text())
    assert saved["ok"] is True and saved["backend"] == "onnx" and saved["precision"] == "fp32"
    assert saved["validation_source"] == "validation_data"
    shapes = {f"{kind}_shape": [n, 3, 16, 16] for kind, n in (("min", 1), ("opt", 2), ("max", 4))}
    assert saved["inputs"] == [{"name": "input", "dtype": "float32", **shapes}]
    assert saved["attempts"][0]["reason"] and saved["attempts"][1]["latency"][0]["eager_median_s"] > 0
    saved_row = saved["attempts"][1]["latency"][0]
    assert saved_row["speedup_ci95"] == onnx_attempt.latency[0].speedup_ci95 and saved_row["speedup_verdict"]
    assert saved["versions"]["onnxruntime"] and "torch" in saved["environment"]
    # Timed at equal threads: the onnxruntime session runs as many intra-op threads as torch, said in the report.
    assert saved["attempts"][1]["threads"] == saved["torch_threads"] == torch.get_num_threads()


@needs_onnx
@pytest.mark.slow
@pytest.mark.parametrize("workload", ["unet3d", "vit"])
def test_onnx_export_of_reference_workloads_passes_validation(workload: str, tmp_path: Path) -> None:
    model, data = make_workload(workload, "tiny", seed=0)
    data.setup("validate")
    options = {**SMALL, "backends": ["onnx"], "dirpath": tmp_path, "filename": workload}
    report = export_model(model, model.example_input_array, validation_data=data.val_dataloader(), **options)
    assert report.ok, report.attempts[0].reason
    assert _files(tmp_path) == [f"{workload}/{workload}.{ext}" for ext in ("export.json", "onnx", "onnx.data")]
    assert all(v.passed for v in report.attempts[0].validation)
    assert len(report.attempts[0].latency) == 3


@needs_onnx
@pytest.mark.slow
def test_wrong_export_is_caught_kept_as_failed_and_strict_raises(tmp_path: Path, monkeypatch) -> None:
    """An export whose runtime computes something else fails validation, is kept under `.failed`, never as final."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    original_call = OnnxRunner.__call__

    def perturbed(self: Any, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        return [t + 0.05 for t in original_call(self, inputs)]

    monkeypatch.setattr(OnnxRunner, "__call__", perturbed)
    example = torch.randn(4, 6)
    with pytest.warns(
        FallbackWarning,
        match=r"'onnx' produced an export that failed validation: at batch size 1: "
        r"max abs diff .* exceeds atol=0.0001.*nothing was exported",
    ):
        report = export_model(model, example, backends=["onnx"], dirpath=tmp_path, **SMALL)
    assert not report.ok and report.artifact is None and report.backend is None
    (attempt,) = report.attempts
    assert attempt.status == "failed_validation" and attempt.latency == []
    assert attempt.validation[0].outputs[0].max_abs_diff == pytest.approx(0.05, abs=1e-5)
    failed = ["model.failed/model.export.json", "model.failed/model.failed.onnx", "model.failed/model.failed.onnx.data"]
    assert _files(tmp_path) == failed  # a failed export is its own set: it never replaces a good one
    saved = json.loads((tmp_path / "model.failed" / "model.export.json").read_text())
    assert saved["attempts"][0]["status"] == "failed_validation"
    # The kept artifact loads on its own (its weights file was renamed with it) and is the real export.
    torch.testing.assert_close(
        _run_onnx(tmp_path / "model.failed" / "model.failed.onnx", example),
        model(example).detach(),
        atol=1e-5,
        rtol=1e-5,
    )

    with pytest.raises(ExportError, match="failed validation"):
        export_model(model, example, backends=["onnx"], dirpath=tmp_path / "strict", strict=True, **SMALL)
    assert _files(tmp_path / "strict") == failed


@needs_onnx
@pytest.mark.slow
def test_extra_dynamic_dimension_and_integer_inputs(tmp_path: Path) -> None:
    """A token model with a dynamic sequence length: integer inputs keep their dtype, lengths vary within range."""

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(11, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids)).mean(dim=1)

    model = Tokens()
    example = torch.randint(0, 11, (2, 6))
    options = {**SMALL, "latency_iterations": 0, "backends": ["onnx"], "dirpath": tmp_path}
    report = export_model(model, example, dynamic_dims={1: (3, 6, 9)}, **options)
    assert report.ok and report.attempts[0].latency == []
    assert report.inputs[0].dtype == torch.int64
    assert report.inputs[0].min_shape == (1, 3) and report.inputs[0].max_shape == (4, 9)
    import onnxruntime as ort

    session = ort.InferenceSession(str(report.artifact), providers=["CPUExecutionProvider"])
    for shape in ((1, 3), (4, 9), (3, 7)):
        ids = torch.randint(0, 11, shape)
        (out,) = session.run(None, {"input": ids.numpy()})
        torch.testing.assert_close(torch.from_numpy(out), model(ids).detach(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------- GPU: TensorRT path


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_tensorrt_export_is_saved_reloaded_validated_and_timed(precision: str, tmp_path: Path) -> None:
    torch_tensorrt = pytest.importorskip("torch_tensorrt", reason="needs the `tensorrt` extra (GPU machines only)")
    model, data = make_workload("convnet", "tiny", seed=0)
    data.setup("validate")
    options = {"backends": ["tensorrt", "onnx"], "batch_range": (1, 8, 32), "latency_iterations": 10, "device": "cuda"}
    options.update(precision=precision, dirpath=tmp_path, validation_data=data.val_dataloader())
    report = export_model(model, model.example_input_array, **options)
    attempt = report.attempts[0]
    assert report.ok and report.backend == "tensorrt", attempt.reason
    assert report.artifact == tmp_path / "model" / "model.trt.pt2"
    assert [v.batch_size for v in attempt.validation] == [1, 8, 32] and all(v.passed for v in attempt.validation)
    assert [r.batch_size for r in attempt.latency] == [1, 8, 32] and all(r.export_median_s > 0 for r in attempt.latency)
    assert attempt.runtime and "torch-tensorrt" in attempt.runtime

    # The saved file works on its own, at a batch size inside the range that was never validated.
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    reloaded = torch_tensorrt.load(str(report.artifact)).module()
    x = next(iter(data.val_dataloader()))[0][:5].cuda()
    with torch.no_grad():
        expected = model.eval().cuda()(x)
        tol = DEFAULT_TOLERANCES[precision]
        torch.testing.assert_close(reloaded(x.to(dtype)).float(), expected, atol=tol.atol * 10, rtol=tol.rtol * 10)


@pytest.mark.gpu
@pytest.mark.slow
def test_onnx_on_the_cuda_execution_provider(tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime", reason="needs the `onnx` extra")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime-gpu (CUDAExecutionProvider)")
    model, data = make_workload("vit", "tiny", seed=0)
    data.setup("validate")
    for precision in ("fp32", "fp16"):
        options = {"backends": ["onnx"], "batch_range": (1, 8, 32), "latency_iterations": 10, "device": "cuda"}
        options.update(precision=precision, dirpath=tmp_path / precision, validation_data=data.val_dataloader())
        report = export_model(model, model.example_input_array, **options)
        assert report.ok, report.attempts[0].reason
        assert "CUDAExecutionProvider" in (report.attempts[0].runtime or "")


# ------------------------------------------------------------------------------------------------ atomic writes


class _HalfWrittenExport:
    """Stands in for an ONNX program whose save writes part of the weights and then fails."""

    def save(self, destination: str, external_data: bool = True) -> None:
        Path(destination + ".data").write_bytes(b"\0" * 1024)
        Path(destination).write_bytes(b"partial")
        raise OSError("disk full")


@needs_onnx
def test_export_failing_half_way_leaves_no_partial_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(OnnxBackend, "build", lambda self, *args: _HalfWrittenExport())
    write_set(tmp_path, "model", {"model.onnx": b"previous good export"})
    with pytest.warns(FallbackWarning, match="'onnx' failed: OSError: disk full"):
        report = export_model(nn.Linear(3, 2), torch.randn(2, 3), backends=["onnx"], dirpath=tmp_path, **SMALL)
    assert not report.ok and report.attempts[0].status == "error"
    # No staging directory, no half-written files; the earlier set is untouched and the report is in its own set.
    assert _files(tmp_path) == ["model.failed/model.export.json", "model/model.onnx"]
    assert (tmp_path / "model" / "model.onnx").read_bytes() == b"previous good export"

    with pytest.raises(ExportError, match="disk full") as info:
        export_model(
            nn.Linear(3, 2), torch.randn(2, 3), backends=["onnx"], dirpath=tmp_path / "s", strict=True, **SMALL
        )
    assert isinstance(info.value.__cause__, OSError)
    assert _files(tmp_path / "s") == ["model.failed/model.export.json"]


def test_tensorrt_unavailable_without_an_export_runs_nothing(tmp_path: Path) -> None:
    """TensorRT alone on the CPU: a fallback warning with the reason, a report, no artifact, no error."""
    with pytest.warns(FallbackWarning, match="'tensorrt' is unavailable.*nothing was exported"):
        report = export_model(nn.Linear(3, 2), torch.randn(2, 3), backends=["tensorrt"], dirpath=tmp_path, **SMALL)
    assert not report.ok and report.attempts[0].status == "unavailable"
    assert _files(tmp_path) == ["model.failed/model.export.json"]


def test_a_precision_no_listed_backend_computes_here_is_refused_before_any_export(tmp_path: Path) -> None:
    for precision, device in (("fp16", "cpu"), ("bf16", "cpu"), ("bf16", "cuda")):
        options = {**SMALL, "device": device, "backends": ["onnx"], "precision": precision, "dirpath": tmp_path}
        with pytest.raises(ValueError, match=rf"precision='{precision}'\)` cannot be exported.*fp32 exports"):
            export_model(nn.Linear(3, 2), torch.randn(2, 3), **options)
    assert not tmp_path.exists() or _files(tmp_path) == []


@needs_onnx
def test_half_precision_onnx_without_a_gpu_provider_is_unavailable_with_the_reason() -> None:
    """On a CUDA device whose onnxruntime has only the CPU provider, fp16 ONNX is a fallback with the reason."""
    import onnxruntime

    options = validate_options(backends=["onnx"], precision="fp16", device="cuda")
    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has a CUDA provider")
    with pytest.raises(BackendUnavailable, match="fp16 ONNX needs a GPU execution provider"):
        OnnxBackend().check(options)


# -------------------------------------------------------------------------------------------------- validation


def test_compare_checks_names_shapes_non_finite_and_tolerances() -> None:
    ref = [torch.tensor([[1.0, -2.0, 3.0]])]
    tol = DEFAULT_TOLERANCES["fp32"]
    (ok,) = compare_outputs([ref[0] + 5e-5], ["output"], ref, ["output"], tol)
    assert ok.passed and ok.max_abs_diff == pytest.approx(5e-5, rel=1e-2) and ok.cosine == pytest.approx(1.0)
    (far,) = compare_outputs([ref[0] + 1e-3], ["output"], ref, ["output"], tol)
    assert not far.passed and "exceeds atol" in (far.problem or "")
    (nan,) = compare_outputs([torch.tensor([[1.0, float("nan"), 3.0]])], ["output"], ref, ["output"], tol)
    assert not nan.passed and nan.non_finite == 1 and "NaN/Inf" in (nan.problem or "")
    (shape,) = compare_outputs([torch.zeros(1, 4)], ["output"], ref, ["output"], tol)
    assert not shape.passed and "shape (1, 4)" in (shape.problem or "")
    (names,) = compare_outputs(ref, ["logits"], ref, ["output"], tol)
    assert not names.passed and "output names ['logits']" in (names.problem or "")
    # fp16 tolerance: 0.5% off passes; within atol but pointing the other way fails on the cosine.
    (half,) = compare_outputs([ref[0] * 1.005], ["output"], ref, ["output"], DEFAULT_TOLERANCES["fp16"])
    assert half.passed
    (cosine,) = compare_outputs(
        [torch.ones(1, 3)], ["output"], [torch.ones(1, 3)], ["output"], Tolerance(10.0, 0.0, 0.9)
    )
    assert cosine.passed and cosine.cosine == pytest.approx(1.0)
    (opposite,) = compare_outputs(
        [-torch.ones(1, 3)], ["output"], [torch.ones(1, 3)], ["output"], Tolerance(10.0, 0.0, 0.9)
    )
    assert not opposite.passed and "cosine similarity -1" in (opposite.problem or "")


# ------------------------------------------------------------------------------------------------------ inputs


def test_split_inputs_of_tuples_lists_dicts_and_tensors() -> None:
    x, y = torch.zeros(2, 3), torch.ones(2)
    assert split_inputs(x)[0] is x
    assert split_inputs((x, y))[0] is x and split_inputs([x, y])[0] is x
    assert split_inputs(((x, y), y)) == (x, y)
    assert split_inputs({"image": x, "label": y})[0] is x
    assert split_inputs({"pixels": x, "label": y}, input_key="pixels")[0] is x
    with pytest.raises(ValueError, match=r"keys \['label', 'pixels'\].*input_key="):
        split_inputs({"pixels": x, "label": y})
    with pytest.raises(ValueError, match="forward` takes a dict"):
        split_inputs(({"a": x}, y))
    with pytest.raises(ValueError, match="forward` takes a dict"):
        as_input_tuple({"a": x})
    with pytest.raises(ValueError, match="batch dimension"):
        as_input_tuple(torch.tensor(1.0))


def test_input_specs_and_example_from_shapes() -> None:
    (ids,) = example_inputs_from_shapes([(5,)], dtype=torch.float16)
    assert ids.shape == (1, 5) and ids.dtype == torch.float16
    first, second = example_inputs_from_shapes([(3, 8), (2,)], batch_size=4)
    assert first.shape == (4, 3, 8) and second.shape == (4, 2) and not torch.equal(first[0], first[1])
    example = (torch.zeros(1, 3, 8), torch.zeros(1, 4))
    spec, other = build_input_specs(example, DimRange(1, 4, 16), [{2: DimRange(4, 8, 32)}])
    assert spec.name == "input_0" and other.name == "input_1"
    assert (spec.min_shape, spec.opt_shape, spec.max_shape) == ((1, 3, 4), (4, 3, 8), (16, 3, 32))
    assert other.dynamic_dims == {0: DimRange(1, 4, 16)}
    assert spec.accepts((2, 3, 5)) and not spec.accepts((2, 4, 5)) and not spec.accepts((32, 3, 8))
    with pytest.raises(ValueError, match=r"outside its range 9\.\.32"):
        build_input_specs(example, DimRange(1, 4, 16), [{2: DimRange(9, 9, 32)}])
    with pytest.raises(ValueError, match="dimension 3 is not valid"):
        build_input_specs(example, DimRange(1, 4, 16), [{3: DimRange(1, 1, 2)}])
    with pytest.raises(ValueError, match="positive integer"):
        example_inputs_from_shapes([(3, 0)])


def test_validation_data_that_does_not_fit_the_example_fails_before_exporting(tmp_path: Path) -> None:
    batches = [(torch.zeros(2, 5), torch.zeros(2))]
    with pytest.raises(ValueError, match=r"'input' has samples of shape \(5,\).*shapes \[1, 3\] to \[4, 3\]"):
        export_model(
            nn.Linear(3, 2), torch.zeros(1, 3), backends=["onnx"], dirpath=tmp_path, validation_data=batches, **SMALL
        )
    assert not tmp_path.exists() or _files(tmp_path) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backends": ["tensorrt", "openvino"]}, "backends=\\['tensorrt', 'openvino'\\]"),
        ({"backends": []}, "non-empty list"),
        ({"backends": ["onnx", "onnx"]}, "distinct"),
        ({"precision": "int8"}, "precision='int8'.*'fp32', 'fp16', 'bf16'"),
        ({"batch_range": (8, 4, 32)}, "min <= opt <= max, got min=8, opt=4, max=32"),
        ({"batch_range": (1, 64, 32)}, "min=1, opt=64, max=32"),
        ({"batch_range": (1, 8)}, "three positive integers"),
        ({"batch_range": (0, 1, 2)}, "three positive integers"),
        ({"dynamic_dims": {0: (1, 2, 3)}}, "dimension 0 is the batch"),
        ({"dynamic_dims": {1: (5, 2, 3)}}, "min <= opt <= max"),
        ({"validation_batch_sizes": [64]}, "within the batch range 1..32"),
        ({"tolerance": {"atol": -1.0}}, "atol=-1.0"),
        ({"latency_iterations": -1}, "latency_iterations=-1"),
        ({"device": "tpu"}, "device='tpu'"),
        ({"opset": 9}, "opset=9"),
        ({"tolerance": {"nope": 1}}, r"tolerance=\{'nope': 1\}\)` is not valid: no key 'nope'"),
        ({"onnx_providers": ["NoSuchProvider"]}, "'NoSuchProvider' is not one of them.*CUDAExecutionProvider"),
        ({"precision": "bf16", "device": "cpu"}, "precision='bf16'"),
    ],
)
def test_invalid_options_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        validate_options(**kwargs)


def test_default_tolerances_follow_precision() -> None:
    assert validate_options(precision="fp16", device="cuda").tolerance == Tolerance(1e-2, 1e-2, 0.99)
    assert validate_options(precision="fp32", tolerance={"atol": 1e-3}).tolerance.atol == 1e-3
    assert validate_options(precision="fp32").tolerance.atol == pytest.approx(1e-4)
    assert validate_options(batch_range=[2, 2, 2]).batch_range.sizes() == [2]


def test_a_misspelt_export_option_is_named_with_the_function_the_user_called(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError, match=r"`export_model` got unknown option\(s\) \['precison'\]\. Expected .*precision"
    ):
        export_model(nn.Linear(2, 2), torch.randn(1, 2), dirpath=tmp_path, precison="fp16")
    assert not any(tmp_path.iterdir())  # refused before anything is written
