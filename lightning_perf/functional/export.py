"""Deprecated: deployment export moved to :mod:`lightning_perf.deploy` (``lightning_perf.deploy.export`` and the
modules beside it). Each name here still resolves, with a ``DeprecationWarning`` naming its new home."""

from __future__ import annotations

from lightning_perf._deprecation import moved_names

_MOVED = {
    "BACKENDS": "lightning_perf.deploy.backend",
    "PRECISIONS": "lightning_perf.deploy.backend",
    "validate_options": "lightning_perf.deploy.backend",
    "DEFAULT_TOLERANCES": "lightning_perf.deploy.validate",
    "OutputCheck": "lightning_perf.deploy.validate",
    "Tolerance": "lightning_perf.deploy.validate",
    "ValidationResult": "lightning_perf.deploy.validate",
    "DimRange": "lightning_perf.deploy.inputs",
    "InputSpec": "lightning_perf.deploy.inputs",
    "as_input_tuple": "lightning_perf.deploy.inputs",
    "build_input_specs": "lightning_perf.deploy.inputs",
    "example_inputs_from_shapes": "lightning_perf.deploy.inputs",
    "split_inputs": "lightning_perf.deploy.inputs",
    "BackendAttempt": "lightning_perf.deploy.export",
    "ExportError": "lightning_perf.deploy.export",
    "ExportReport": "lightning_perf.deploy.export",
    "export": "lightning_perf.deploy.export",
    "export_model": "lightning_perf.deploy.export",
    "LatencyRow": "lightning_perf.profiling.latency",
}

__all__: list[str] = []


__getattr__ = moved_names(__name__, _MOVED)


def __dir__() -> list[str]:
    return sorted(_MOVED)
