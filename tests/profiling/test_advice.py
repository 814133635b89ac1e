"""Recommendation rules: each fires on its evidence, says it, and names what helps."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_perf.profiling.advice import (
    DEFAULT_THRESHOLDS,
    PHASES,
    LoaderSettings,
    StepBreakdown,
    recommend,
    validate_thresholds,
)
from lightning_perf.profiling.syncs import SyncSite

LOADER = LoaderSettings(num_workers=0, pin_memory=False, persistent_workers=False, batch_size=32, prefetch_factor=None)


def breakdown(**shares: float) -> StepBreakdown:
    full = {name: 0.0 for name in PHASES}
    full.update(shares)
    step = 0.1
    medians = {name: share * step for name, share in full.items()}
    kwargs: dict[str, Any] = {"shares": full, "medians": medians, "step_median_s": step, "steps": 50, "loader": LOADER}
    kwargs["cpu_count"] = 8
    return StepBreakdown(**kwargs)


def rules(b: StepBreakdown) -> dict[str, Any]:
    return {rec.rule: rec for rec in recommend(b)}


def test_data_wait_with_no_workers_suggests_workers_from_the_cpu_count() -> None:
    rec = rules(breakdown(data=0.5, forward=0.3, backward=0.2))["data_wait"]
    assert rec.severity == "high"
    assert "data is 50% of step time (median 50.0 ms of a 100 ms step, 50 steady steps)" in rec.evidence
    assert "8 CPUs per training process" in rec.evidence and "num_workers=0" in rec.evidence
    assert rec.actions[0].startswith("set DataLoader(num_workers=7)")


def test_data_wait_below_the_threshold_or_with_busy_workers() -> None:
    assert "data_wait" not in rules(breakdown(data=0.15, forward=0.85))
    assert "data_wait" in rules(
        replace(breakdown(data=0.15, forward=0.85), thresholds={**DEFAULT_THRESHOLDS, "data": 0.1})
    )
    busy = replace(breakdown(data=0.5, forward=0.5), loader=replace(LOADER, num_workers=8, persistent_workers=True))
    assert "cheaper" in rules(busy)["data_wait"].actions[0]
    some = replace(breakdown(data=0.5, forward=0.5), loader=replace(LOADER, num_workers=2, prefetch_factor=2))
    actions = rules(some)["data_wait"].actions
    assert "raise num_workers from 2 towards 8" in actions[0]
    assert any("persistent_workers=True" in a for a in actions)


def test_workers_beyond_the_cpus_of_every_process_on_the_node() -> None:
    b = replace(breakdown(forward=1.0), loader=replace(LOADER, num_workers=6), processes_per_node=2)
    rec = rules(b)["num_workers_above_cpus"]
    assert rec.evidence == "6 workers x 2 processes on 8 usable CPUs"
    assert "at most 4" in rec.actions[0]


def test_pin_memory_only_on_cuda() -> None:
    assert "pin_memory" not in rules(breakdown(forward=1.0))
    on_gpu = rules(replace(breakdown(forward=0.8, transfer=0.2), device_type="cuda"))
    assert on_gpu["pin_memory"].severity == "medium"
    assert "set DataLoader(pin_memory=True)" in on_gpu["transfer"].actions


def test_persistent_workers_when_restarts_cost_a_noticeable_share_of_an_epoch() -> None:
    loader = replace(LOADER, num_workers=4)
    short = replace(breakdown(forward=1.0), loader=loader, steps_per_epoch=10, epoch_restart_s=0.5)
    rec = rules(short)["persistent_workers"]
    assert "waits 500 ms longer" in rec.evidence and "50% of a 1.00 s epoch of 10 steps" in rec.evidence
    long = replace(short, steps_per_epoch=1000)
    assert "persistent_workers" not in rules(long)
    assert "persistent_workers" not in rules(replace(short, loader=replace(loader, persistent_workers=True)))


def test_optimizer_step_names_the_fused_optimizer_callback_unless_in_use() -> None:
    b = breakdown(forward=0.4, backward=0.3, optimizer=0.3)
    assert rules(b)["optimizer_step"].callbacks == ("FusedOptimizerCallback",)
    assert rules(replace(b, active_callbacks=frozenset({"FusedOptimizerCallback"})))["optimizer_step"].callbacks == ()
    fused = rules(replace(b, optimizers_fused=True))["optimizer_step"]
    assert fused.callbacks == () and "already run fused" in fused.evidence


def test_other_overhead() -> None:
    assert "log_every_n_steps" in rules(breakdown(forward=0.5, other=0.5))["other_overhead"].actions[0]


def test_host_syncs_list_their_sites_and_rate() -> None:
    sites = [SyncSite("item", "/code/model.py", 42, "training_step", 6), SyncSite("cpu", "/code/m.py", 7, "f", 2)]
    b = replace(breakdown(forward=1.0), host_syncs=sites, sync_steps_checked=2, sync_method="torch-function-mode")
    rec = rules(b)["host_syncs"]
    assert rec.severity == "low"  # on CPU: what would synchronize on a GPU
    assert rec.evidence.startswith("4.0 per step over 2 checked steps (torch-function-mode): 6x item at ")
    assert "/code/model.py:42 in training_step" in rec.evidence
    assert rules(replace(b, device_type="cuda"))["host_syncs"].severity == "high"
    assert "host_syncs" not in rules(replace(b, sync_steps_checked=0))


def test_an_idle_gpu_suggests_a_larger_batch_and_compile() -> None:
    rec = rules(replace(breakdown(forward=0.2, backward=0.2, other=0.6), device_type="cuda"))["device_idle"]
    assert "40% of step time" in rec.evidence and "larger batch than 32" in rec.actions[0]
    assert rec.callbacks == ("CompileCallback",)
    assert "device_idle" not in rules(breakdown(forward=0.2, backward=0.2, other=0.6))  # not on CPU


def test_compute_bound_suggestions_depend_on_model_device_and_what_is_in_use() -> None:
    cuda = {"device_type": "cuda", "has_convolutions": True, "fast_bf16": True, "tf32_capable": True}
    b = replace(breakdown(forward=0.5, backward=0.5), **cuda)
    rec = rules(b)["compute_bound"]
    assert rec.actions[0] == "train in mixed precision: Trainer(precision='bf16-mixed')"
    assert rec.callbacks == (
        "ChannelsLastCallback",
        "CompileCallback",
        "BackendFlagsCallback",
        "GradCheckpointCallback",
    )
    in_use = frozenset(rec.callbacks)
    mixed = replace(b, precision="bf16-mixed", active_callbacks=in_use)
    assert "compute_bound" not in rules(mixed)
    cpu = rules(replace(b, device_type="cpu", fast_bf16=False, tf32_capable=False, has_convolutions=False))
    assert cpu["compute_bound"].callbacks == ("CompileCallback",)


def test_most_severe_first_and_nothing_without_steps() -> None:
    recs = recommend(replace(breakdown(data=0.4, forward=0.6), device_type="cuda"))
    severities = [r.severity for r in recs]
    assert severities == sorted(severities, key=["high", "medium", "low"].index)
    assert recommend(replace(breakdown(data=0.9), steps=0)) == []
    assert "[high] Training waits for data." in recs[0].format()


def test_loader_settings_are_read_from_a_dataloader() -> None:
    loader = DataLoader(torch.arange(10), batch_size=4, num_workers=2, pin_memory=False, persistent_workers=True)
    settings = LoaderSettings.from_dataloader(loader)
    assert settings == LoaderSettings(2, False, True, 4, 2)
    assert LoaderSettings.from_dataloader([1, 2, 3]) is None
    assert settings is not None and asdict(settings)["num_workers"] == 2


def test_validate_thresholds() -> None:
    assert validate_thresholds(None, "X") == dict(DEFAULT_THRESHOLDS)
    assert validate_thresholds({"data": 0.5}, "X")["data"] == 0.5
    with pytest.raises(ValueError, match=r"`X\(thresholds=\{'step': 0.5\}\)` is not valid: 'step' not a phase"):
        validate_thresholds({"step": 0.5}, "X")
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        validate_thresholds({"other": True}, "X")
