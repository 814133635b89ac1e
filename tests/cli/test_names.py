"""The names the parsers offer without importing torch match the registries they stand for."""

from __future__ import annotations

from lightning_perf.cli import _common
from lightning_perf.demos import PRESETS, workload_names


def test_workload_and_preset_names_match_the_demos() -> None:
    assert list(_common.WORKLOAD_NAMES) == workload_names()
    # --help names every preset; the check itself reads PRESETS at run time. "gpu" is named ahead of the demos that
    # add it (the GPU-sized preset, the default on CUDA).
    assert set(PRESETS) <= set(_common.PRESET_NAMES) and set(_common.PRESET_NAMES) - set(PRESETS) <= {"gpu"}
