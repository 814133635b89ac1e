"""Quantization after training: one module per back-end, the conversion, and the save with its report.

Submodules: ``pt2e_x86`` and ``torchao`` (back-ends), ``convert``, ``save`` (:func:`export_quantized`,
:func:`save_quantized`, :func:`export_dynamic`), ``dynamic`` (dynamic int8 for CPU inference), ``quantizer`` (one recipe
object per mode, the registry), ``recipes`` and ``qat_quantizer`` (the quantizers
:class:`~lightning_perf.callbacks.QATCallback` schedules). The training-time half is
:mod:`lightning_perf.functional.quantization.qat`. What each holds: docs/architecture.md, Module notes. Names are
imported from their submodule (``lightning_perf.deploy`` holds the main ones).
"""
