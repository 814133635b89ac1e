"""Quantization after training: one module per back-end, the conversion, and the save with its report.

Submodules: ``pt2e_x86`` and ``torchao`` (back-ends), ``convert``, ``save`` (:func:`export_quantized`,
:func:`save_quantized`), ``dynamic`` and ``dynamic_save`` (dynamic int8 for CPU inference), ``quantizer`` (one recipe
object per mode, the registry), ``recipes`` and ``qat_quantizer`` (the quantizers
:class:`~lightning_perf.callbacks.QATCallback` schedules). The training-time half is
:mod:`lightning_perf.functional.qat`. What each holds: docs/architecture.md, Module notes.
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
