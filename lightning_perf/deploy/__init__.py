"""Everything after training, without Lightning: example inputs and the batch path, parity checks, the one atomic
artifact-set writer, ONNX and TensorRT export, and quantization back-ends.

Submodules: :mod:`~lightning_perf.deploy.inputs`, :mod:`~lightning_perf.deploy.validate`,
:mod:`~lightning_perf.deploy.artifacts`, :mod:`~lightning_perf.deploy.export` (with ``onnx``, ``tensorrt`` and
``backend``) and :mod:`~lightning_perf.deploy.quantize`. Heavy optional dependencies are imported only where used. What
each holds: docs/architecture.md, Module notes.
"""

from __future__ import annotations

from lightning_perf.deploy.artifacts import ArtifactWriteError, StagedSet, committed_set, write_set
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
from lightning_perf.deploy.quantize.dynamic import quantize_dynamic
from lightning_perf.deploy.quantize.save import QuantizationReport, export_quantized, save_quantized
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
    "StagedSet",
    "Tolerance",
    "ValidationResult",
    "build_input_specs",
    "committed_set",
    "example_inputs_from_shapes",
    "export_model",
    "export_quantized",
    "model_inputs",
    "quantize_dynamic",
    "save_quantized",
    "through_batch_hooks",
    "validate_options",
    "write_set",
]
