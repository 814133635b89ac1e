"""Everything after training, without Lightning: example inputs and the batch path, parity checks, the one atomic
artifact-set writer, ONNX and TensorRT export, and quantization back-ends.

- :mod:`~lightning_perf.deploy.inputs`: example inputs, input specs, the batch hooks;
- :mod:`~lightning_perf.deploy.validate`: an export's or a quantized model's outputs against the model's;
- :mod:`~lightning_perf.deploy.artifacts`: artifact sets committed in one atomic step;
- :mod:`~lightning_perf.deploy.export`: :func:`export_model` with :mod:`~lightning_perf.deploy.onnx` and
  :mod:`~lightning_perf.deploy.tensorrt` (options and the backend base class in :mod:`~lightning_perf.deploy.backend`);
- :mod:`~lightning_perf.deploy.quantize`: conversion, saving and timing of quantized models.

Heavy optional dependencies (onnx, onnxruntime, torch-tensorrt, torchao) are imported only where used.
"""

from __future__ import annotations

from lightning_perf.deploy.artifacts import ArtifactWriteError, committed_set, stage_set, write_set
from lightning_perf.deploy.backend import BACKENDS, PRECISIONS, validate_options
from lightning_perf.deploy.export import BackendAttempt, ExportError, ExportReport, export_model
from lightning_perf.deploy.inputs import (
    DimRange,
    InputSpec,
    build_input_specs,
    example_inputs_from_shapes,
    model_inputs,
    through_batch_hooks,
)
from lightning_perf.deploy.quantize import QuantizationReport, export_quantized, save_quantized
from lightning_perf.deploy.validate import DEFAULT_TOLERANCES, OutputCheck, Tolerance, ValidationResult

__all__ = [
    "BACKENDS",
    "DEFAULT_TOLERANCES",
    "PRECISIONS",
    "ArtifactWriteError",
    "BackendAttempt",
    "DimRange",
    "ExportError",
    "ExportReport",
    "InputSpec",
    "OutputCheck",
    "QuantizationReport",
    "Tolerance",
    "ValidationResult",
    "build_input_specs",
    "committed_set",
    "example_inputs_from_shapes",
    "export_model",
    "export_quantized",
    "model_inputs",
    "save_quantized",
    "stage_set",
    "through_batch_hooks",
    "validate_options",
    "write_set",
]
