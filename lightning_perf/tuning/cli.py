"""Deprecated location: ``lightning-perf autotune`` moved to :mod:`lightning_perf.cli.autotune`."""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = {"add_autotune_parser": "add_parser"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        from lightning_perf.cli import autotune

        warnings.warn(
            f"lightning_perf.tuning.cli.{name} moved to lightning_perf.cli.autotune.{_MOVED[name]}; "
            "import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(autotune, _MOVED[name])
    raise AttributeError(f"module 'lightning_perf.tuning.cli' has no attribute {name!r}")
