"""Deprecated location: the model source moved to :mod:`lightning_perf.benchmark.sources`."""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = (
    "LOADER_SETTINGS",
    "ImportSource",
    "ModelSource",
    "ObjectSource",
    "WorkloadSource",
    "apply_data_settings",
    "batch_size_holder",
    "import_object",
    "init_parameters",
    "rebuild_loader",
)


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        from lightning_perf.benchmark import sources

        warnings.warn(
            f"lightning_perf.tuning.sources.{name} moved to lightning_perf.benchmark.sources; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(sources, name)
    raise AttributeError(f"module 'lightning_perf.tuning.sources' has no attribute {name!r}")
