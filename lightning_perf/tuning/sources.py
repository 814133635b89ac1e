"""Deprecated location: the model source moved to :mod:`lightning_perf.benchmark.sources`."""

from __future__ import annotations

from lightning_perf._deprecation import moved_names

_MOVED = {
    name: "lightning_perf.benchmark.sources"
    for name in (
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
}

__getattr__ = moved_names(__name__, _MOVED)
