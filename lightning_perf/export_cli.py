"""Deprecated: the ``export`` command moved to :mod:`lightning_perf.cli.export` (``add_parser`` / ``run``)."""

from __future__ import annotations

import warnings
from typing import Any

__all__: list[str] = []

_MOVED = {"add_export_parser": "add_parser", "add_parser": "add_parser", "run": "run"}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"lightning_perf.export_cli.{name} moved to lightning_perf.cli.export.{_MOVED[name]}; import it from there",
        DeprecationWarning,
        stacklevel=2,
    )
    from lightning_perf.cli import export

    return getattr(export, _MOVED[name])
