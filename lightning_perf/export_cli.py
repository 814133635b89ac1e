"""Deprecated: the ``export`` command moved to :mod:`lightning_perf.cli.export` (``add_parser`` / ``run``)."""

from __future__ import annotations

from lightning_perf._deprecation import moved_names

__all__: list[str] = []

_MOVED = {
    "add_export_parser": "lightning_perf.cli.export:add_parser",
    "add_parser": "lightning_perf.cli.export",
    "run": "lightning_perf.cli.export",
}

__getattr__ = moved_names(__name__, _MOVED)
