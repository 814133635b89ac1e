"""MemoryProfilerCallback: snapshot points and interval, leak detection, reports, logging, CUDA history and OOM."""

from __future__ import annotations

import csv
import json
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from lightning_perf import MeasurementWarning, NoEffectWarning
from lightning_perf.callbacks import MemoryProfilerCallback
from lightning_perf.callbacks.memory_profiler import POINTS
from lightning_perf.demos import ConvNetModule, make_workload
from tests.callbacks._quiet import quiet_trainer


class LeakyConvNet(ConvNetModule):
    """Keeps the output of an extra forward pass, with its autograd graph and every activation it saved."""

    def __init__(self) -> None:
        super().__init__("tiny")
        self.kept: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.kept.append(self(batch[0]))
        return super().training_step(batch, batch_idx)


def fit_convnet(root: Path, callback: MemoryProfilerCallback, model: pl.LightningModule | None = None, **kw: Any):
    pl.seed_everything(0, verbose=False)
    plain, data = make_workload("convnet", "tiny", seed=0)
    fit = quiet_trainer(root, [callback], **kw)
    fit.fit(model or plain, datamodule=data)
    return fit


# ---------------------------------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_steps": 0}, "every_n_steps=0"),
        ({"every_n_steps": -3}, "every_n_steps=-3"),
        ({"warmup_steps": -1}, "warmup_steps=-1"),
        ({"points": ["after_forward", "after_lunch"]}, r"unknown point\(s\) \['after_lunch'\]"),
        ({"points": []}, "no point given"),
        ({"leak_threshold": 0}, "leak_threshold=0"),
        ({"leak_threshold": -1.0}, "leak_threshold=-1.0"),
        ({"leak_threshold": float("inf")}, "leak_threshold=inf"),
        ({"leak_min_samples": 1}, "leak_min_samples=1"),
        ({"log_every_n_steps": 0}, "log_every_n_steps=0"),
        ({"filename": "../memory"}, "without a directory"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MemoryProfilerCallback(**kwargs)


def test_points_must_be_a_list_of_names() -> None:
    with pytest.raises(TypeError, match="Expected a list of names"):
        MemoryProfilerCallback(points="after_forward")
    assert MemoryProfilerCallback(points=["after_optimizer", "after_data"]).points == ("after_data", "after_optimizer")


# ----------------------------------------------------------------------------------------------------- snapshots


def test_samples_every_n_steps_at_each_point_in_step_order(tmp_path: Path) -> None:
    callback = MemoryProfilerCallback(every_n_steps=3, warmup_steps=0, verbose=False)
    fit_convnet(tmp_path, callback, max_steps=7)
    report = callback.report
    assert report["steps_seen"] == 7 and report["steps_sampled"] == 3
    assert report["source"] == "cpu-mallinfo2"
    assert [s["step"] for s in report["samples"][:: len(POINTS)]] == [0, 3, 6]
    for step in (0, 3, 6):
        mine = [s for s in report["samples"] if s["step"] == step]
        assert [s["point"] for s in mine] == list(POINTS)
        times = [s["timestamp_ns"] for s in mine]
        assert times == sorted(times)
        assert all(s["allocated"] > 0 and s["reserved"] > 0 and s["peak"] >= s["reserved"] for s in mine)
    table = report["snapshots"]
    assert list(table) == list(POINTS)
    assert table["after_data"]["time_s"]["median"] == 0.0
    assert table["after_optimizer"]["time_s"]["median"] > table["after_forward"]["time_s"]["median"] > 0
    assert report["peak_since_reset"] is True


def test_only_the_requested_points_are_sampled(tmp_path: Path) -> None:
    callback = MemoryProfilerCallback(every_n_steps=1, points=["after_backward"], verbose=False)
    fit_convnet(tmp_path, callback, max_steps=3)
    assert {s["point"] for s in callback.report["samples"]} == {"after_backward"}
    assert list(callback.report["snapshots"]) == ["after_backward"]
    assert callback.report["peak"]["count"] == 3  # the step's peak is read at its end all the same


def test_reports_go_to_the_default_root_dir_and_peaks_to_the_logger(tmp_path: Path) -> None:
    callback = MemoryProfilerCallback(every_n_steps=2, log_every_n_steps=2)
    logger = CSVLogger(tmp_path, name="run", version=0)
    fit_convnet(tmp_path, callback, max_steps=6, logger=logger)
    out = tmp_path / "run" / "version_0"
    saved = json.loads((out / "memory_profile.json").read_text())
    assert saved["callback"] == "MemoryProfilerCallback" and saved["every_n_steps"] == 2
    assert saved["leaks"]["leaking"] == []
    assert (out / "memory_profile.png").stat().st_size > 0
    rows = [r for r in csv.DictReader((out / "metrics.csv").open()) if r.get("memory/peak")]
    # Steps 0, 2, 4 are sampled (global steps 1, 3, 5 once they end); a log needs 2 steps since the last one.
    assert [int(r["step"]) for r in rows] == [3, 5]
    assert all(float(r["memory/peak"]) >= float(r["memory/reserved"]) > 0 for r in rows)


def test_without_matplotlib_a_note_replaces_the_chart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lightning_perf.callbacks._observer.is_matplotlib_available", lambda: False)
    callback = MemoryProfilerCallback(every_n_steps=1, verbose=False)
    fit_convnet(tmp_path, callback, max_steps=3)
    assert (tmp_path / "memory_profile.json").exists() and not (tmp_path / "memory_profile.png").exists()
    assert "matplotlib" in callback.report["plot_note"]


def test_history_on_cpu_says_it_does_nothing(tmp_path: Path) -> None:
    callback = MemoryProfilerCallback(record_history=True, verbose=False)
    with pytest.warns(NoEffectWarning, match="records CUDA allocations only"):
        fit_convnet(tmp_path, callback, max_steps=2)
    assert callback.report["files"] == {"history": None, "oom_snapshots": []}


# ------------------------------------------------------------------------------------------------------- leaks


@pytest.mark.parametrize("attempt", range(2))
def test_a_module_that_keeps_its_graphs_is_caught(tmp_path: Path, attempt: int) -> None:
    callback = MemoryProfilerCallback(every_n_steps=1, warmup_steps=3, verbose=False)
    with pytest.warns(MeasurementWarning, match=r"grows by .*per step") as caught:
        fit_convnet(tmp_path, callback, model=LeakyConvNet(), max_steps=24)
    assert len([w for w in caught if issubclass(w.category, MeasurementWarning)]) == 1  # said once per fit
    leaks = callback.report["leaks"]
    assert leaks["leaking"] == list(POINTS)
    trend = leaks["trends"]["after_optimizer"]
    assert trend.slope > 500 * 1024  # the kept activations: about 1.2 MiB per step on this model
    assert trend.samples == 21 and trend.first_step == 3


@pytest.mark.parametrize("attempt", range(2))
def test_a_clean_model_is_not_flagged(tmp_path: Path, attempt: int) -> None:
    # Our warnings are errors in tests: a false alarm fails here. Validation and a logger run in between samples.
    callback = MemoryProfilerCallback(every_n_steps=1, warmup_steps=3, verbose=False)
    logger = CSVLogger(tmp_path, name="run")
    fit_convnet(tmp_path, callback, max_steps=40, logger=logger, limit_val_batches=2, val_check_interval=10)
    trends = callback.report["leaks"]["trends"]
    # The verdict, not the measured slope: allocator noise on a shared machine moves the figure, never the verdict.
    assert callback.report["leaks"]["leaking"] == []
    assert set(trends) == set(POINTS) and all(t.samples == 37 for t in trends.values())


# ------------------------------------------------------------------------------------------------------------ GPU


class Linear(pl.LightningModule):
    def __init__(self, blow_up_at: int | None = None) -> None:
        super().__init__()
        self.layer = nn.Linear(64, 64)
        self.blow_up_at = blow_up_at

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.blow_up_at:
            torch.empty(1 << 50, dtype=torch.uint8, device=self.device)  # 1 PiB: more than any GPU has
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.gpu
def test_out_of_memory_writes_a_snapshot_and_still_raises(tmp_path: Path) -> None:
    callback = MemoryProfilerCallback(every_n_steps=1, record_history=True)
    data = DataLoader(torch.randn(32, 64), batch_size=4)
    with pytest.raises(torch.OutOfMemoryError):
        quiet_trainer(tmp_path, [callback], accelerator="cuda", max_steps=4).fit(Linear(blow_up_at=2), data)
    path = tmp_path / "memory_profile_oom_rank0.pickle"
    snapshot = pickle.loads(path.read_bytes())
    assert snapshot["segments"] and any(snapshot["device_traces"])  # the history leading up to the failure
    assert callback._oom_handle is None and not callback._recording  # listener and recording gone at teardown


@pytest.mark.gpu
def test_history_is_written_at_fit_end_and_recording_stops(tmp_path: Path) -> None:
    callback = MemoryProfilerCallback(every_n_steps=1, record_history=True, verbose=False)
    data = DataLoader(torch.randn(32, 64), batch_size=4)
    quiet_trainer(tmp_path, [callback], accelerator="cuda", max_steps=4).fit(Linear(), data)
    history = Path(callback.report["files"]["history"])
    assert history == tmp_path / "memory_profile_history_rank0.pickle"
    assert any(pickle.loads(history.read_bytes())["device_traces"])
    assert callback.report["source"] == "cuda" and callback.report["peak"]["max"] > 0
    before = [len(trace) for trace in torch.cuda.memory._snapshot()["device_traces"]]
    torch.ones(1024, device="cuda")  # after teardown nothing is recorded any more
    assert [len(trace) for trace in torch.cuda.memory._snapshot()["device_traces"]] == before
