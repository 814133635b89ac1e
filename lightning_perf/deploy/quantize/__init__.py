"""Quantization after training: one module per back-end, the conversion, and the save with its report.

- :mod:`~lightning_perf.deploy.quantize.pt2e_x86`: PT2E calibration and ``convert_pt2e`` (``backend="x86"``);
- :mod:`~lightning_perf.deploy.quantize.torchao`: ``QATConfig(step="convert")`` (``backend="torchao"``);
- :mod:`~lightning_perf.deploy.quantize.convert`: :func:`convert` and :func:`float_copy`, whatever the back-end;
- :mod:`~lightning_perf.deploy.quantize.save`: :func:`export_quantized` (convert, validate, save, time, report) and
  :func:`save_quantized`;
- :mod:`~lightning_perf.deploy.quantize.dynamic`: dynamic int8 for CPU inference (:func:`quantize_dynamic`: eager
  ``torch.ao``, ONNX Runtime or torchao, the fastest correct one measured on the module), and
  :mod:`~lightning_perf.deploy.quantize.dynamic_save`: :func:`export_dynamic` (validate, time, save, report).

Quantization as data: :mod:`~lightning_perf.deploy.quantize.quantizer` holds one recipe object per mode (QAT x86, QAT
torchao, static PTQ, dynamic int8) and the registry keyed on the recipe's type;
:func:`lightning_perf.deploy.quantize.recipes.quantizer_for` builds the quantizer that carries a recipe out
(:mod:`~lightning_perf.deploy.quantize.qat_quantizer`, :mod:`~lightning_perf.deploy.quantize.recipes`), which
:class:`~lightning_perf.callbacks.QATCallback` schedules. The training-time half (prepare, the observer / fake-quant /
batch-norm schedules) is :mod:`lightning_perf.functional.qat`.
"""

from __future__ import annotations

from lightning_perf.deploy.quantize.convert import calibrate, convert, float_copy
from lightning_perf.deploy.quantize.dynamic import DynamicQuantization, quantize_dynamic
from lightning_perf.deploy.quantize.dynamic_save import DynamicReport, export_dynamic
from lightning_perf.deploy.quantize.save import (
    QuantizationReport,
    compiled_latency,
    export_quantized,
    save_quantized,
    write_program,
)
from lightning_perf.deploy.validate import ValidationSummary, compare_models

__all__ = [
    "DynamicQuantization",
    "DynamicReport",
    "QuantizationReport",
    "ValidationSummary",
    "calibrate",
    "compare_models",
    "compiled_latency",
    "convert",
    "export_dynamic",
    "export_quantized",
    "float_copy",
    "quantize_dynamic",
    "save_quantized",
    "write_program",
]
