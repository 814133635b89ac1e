"""Deprecated location: ``lightning-perf autotune`` moved to :mod:`lightning_perf.cli.autotune`."""

from __future__ import annotations

from lightning_perf._deprecation import moved_names

_MOVED = {"add_autotune_parser": "lightning_perf.cli.autotune:add_parser"}

__getattr__ = moved_names(__name__, _MOVED)
