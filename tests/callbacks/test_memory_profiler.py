"""MemoryProfilerCallback: snapshot points and interval, leak detection, reports, logging, CUDA history and OOM."""

from __future__ import annotations

import csv
import json
import logging
import pickle
import re
import subprocess
import sys
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
        ({"points": ["after_forward", "after_lunch"]}, "'after_lunch' is not one of them"),
        ({"points": []}, "Expected a non-empty list"),
        ({"leak_threshold": 0}, "leak_threshold=0"),
        ({"leak_threshold": -1.0}, "leak_threshold=-1.0"),
        ({"leak_threshold": float("inf")}, "leak_threshold=inf"),
        ({"leak_min_samples": 1}, "leak_min_samples=1"),
        ({"leak_min_samples": 17}, "leak_min_samples=17"),
        ({"leak_threshold": float("nan")}, "leak_threshold=nan"),
        ({"log_every_n_steps": 0}, "log_every_n_steps=0"),
        ({"filename": "../memory"}, "plain, non-hidden file stem"),
        ({"points": "after_forward"}, "Expected a non-empty list of distinct names"),
        ({"overwrite": "yes"}, "overwrite"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(TypeError if "overwrite" in kwargs else ValueError, match=match):
        MemoryProfilerCallback(**kwargs)


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
    assert MemoryProfilerCallback(points=["after_optimizer", "after_data"]).points == ("after_data", "after_optimizer")


def test_reports_go_to_the_default_root_dir_and_peaks_to_the_logger(tmp_path: Path) -> None:
    callback = MemoryProfilerCallback(every_n_steps=2, log_every_n_steps=2, plot=True)
    logger = CSVLogger(tmp_path, name="run", version=0)
    fit_convnet(tmp_path, callback, max_steps=6, logger=logger)
    out = tmp_path / "run" / "version_0"
    saved = json.loads((out / "memory_profile.json").read_text())
    assert saved["callback"] == "MemoryProfilerCallback" and saved["every_n_steps"] == 2
    assert saved["leaks"]["leaking"] == []
    assert (out / "memory_profile.png").stat().st_size > 0
    rows = [r for r in csv.DictReader((out / "metrics.csv").open()) if r.get("memory/peak")]
    # One step in `log_every_n_steps` (steps 1, 3, 5: global steps 2, 4, 6 once they end), whether sampled or not.
    assert [int(r["step"]) for r in rows] == [2, 4, 6]
    assert all(float(r["memory/peak"]) >= float(r["memory/reserved"]) > 0 for r in rows)


def test_without_matplotlib_a_note_replaces_the_chart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lightning_perf.callbacks._observer.is_available", lambda module: False)
    callback = MemoryProfilerCallback(every_n_steps=1, verbose=False, plot=True)
    fit_convnet(tmp_path, callback, max_steps=3)
    assert (tmp_path / "memory_profile.json").exists() and not (tmp_path / "memory_profile.png").exists()
    assert "matplotlib" in callback.report["plot_note"]


def test_history_on_cpu_says_it_does_nothing(tmp_path: Path) -> None:
    callback = MemoryProfilerCallback(record_history=True, verbose=False)
    with pytest.warns(NoEffectWarning, match="records CUDA allocations only"):
        fit_convnet(tmp_path, callback, max_steps=2)
    assert callback.report["files"] == {"history": None, "oom_snapshots": []}


# ------------------------------------------------------------------------------------------------------- leaks
# Real allocators are measured here, so only verdicts are asserted (and bounds every machine shares, such as the
# bytes a model keeps by construction), never a measured figure: allocator noise moves figures, not verdicts.
# Our warnings are errors in tests, so a false alarm in a clean run fails the test by itself.


class TinyMLP(pl.LightningModule):
    """A small MLP on random data; subclasses add what they keep from step to step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class LogsAValuePerStep(TinyMLP):
    """Logs a value every step: the logger's buffers fill and flush, which must not look like a leak."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss


def fit_mlp(root: Path, callback: MemoryProfilerCallback, model: pl.LightningModule, steps: int, **kw: Any) -> None:
    pl.seed_everything(0, verbose=False)
    data = DataLoader(torch.randn(64 * 8, 32), batch_size=8)  # 64 steps per epoch
    quiet_trainer(root, [callback], max_steps=steps, **kw).fit(model, data)


def leak_warnings(caught: Any) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, MeasurementWarning)]


def test_a_module_that_keeps_its_graphs_is_caught(fresh_fits: dict[str, Any]) -> None:
    leak = fresh_fits["graphs"]
    messages = [m for m in leak["warnings"] if "leak" in m]
    assert len(messages) == 1  # said once per fit, however often the verdict is renewed
    assert "KiB/step (95% interval" in messages[0]
    assert leak["leaking"] == list(POINTS)
    trend = leak["trend"]
    # The first epoch (16 steps) is left out; the resident set (one step in 4) is screened once it holds 18 readings
    # past it (step 88), memory in use is read at every point of the next 30 steps, and the verdict comes after them.
    assert leak["first_step"] == 16 and leak["stopped_at_step"] == 119
    assert leak["screens"][0]["step"] == 88 and leak["screens"][0]["confirmed"]
    assert (trend["first_step"], trend["last_step"], trend["samples"]) == (89, 118, 30)
    assert trend["slope_low"] <= trend["slope"] <= trend["slope_high"]
    # The kept outputs alone are 32 x 10 float32 per step; their graph keeps far more (a bound on any machine).
    assert trend["slope_low"] > 32 * 10 * 4


class KeepsBytes(TinyMLP):
    """Keeps a detached tensor of ``size`` bytes per step: no graph, just bytes that never go."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.kept = size, list[torch.Tensor]()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.kept.append(torch.full((self.size // 4,), loss.item()))
        return loss


_LONG_EPOCH_FITS = """
import json, sys, warnings
from pathlib import Path
import lightning.pytorch as pl, torch
from torch.utils.data import DataLoader
from lightning_perf import MeasurementWarning
from lightning_perf.callbacks import MemoryProfilerCallback
from tests.callbacks._quiet import quiet_trainer
from tests.callbacks.test_memory_profiler import KeepsBytes, LeakyConvNet, TinyMLP, fit_convnet

out = {}
for kind in ("clean", "4k", "256k", "graphs"):
    callback = MemoryProfilerCallback(verbose=False)
    pl.seed_everything(0, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if kind == "graphs":  # 16-step epochs
            fit_convnet(Path(sys.argv[1]) / kind, callback, model=LeakyConvNet(), max_steps=124)
        else:
            data = DataLoader(torch.randn(450 * 8, 32), batch_size=8)  # one epoch of 450 steps: no epoch end to help
            model = TinyMLP() if kind == "clean" else KeepsBytes({"4k": 4096, "256k": 256 << 10}[kind])
            quiet_trainer(Path(sys.argv[1]) / kind, [callback], max_epochs=1).fit(model, data)
    leaks = callback.report["leaks"]
    out[kind] = {
        "warnings": [str(w.message) for w in caught if issubclass(w.category, MeasurementWarning)],
        "leaking": leaks["leaking"], "stopped_at_step": leaks["stopped_at_step"], "first_step": leaks["first_step"],
        "steps": callback.report["steps_seen"], "trend": leaks["trends"]["after_optimizer"].to_dict(),
        "screens": leaks["screen"]["confirmations"], "resident": leaks["screen"]["trend"].to_dict(),
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fresh_fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A clean MLP, then one that keeps 4 KiB a step, then 256 KiB a step, each one epoch of 450 steps, then a convnet
    that keeps its graphs over 16-step epochs, in one fresh process: in the heap of a whole test suite (garbage of
    earlier tests, freed mid-series) a leak first fills free memory, so the resident set does not rise for a while, and
    memory in use moves by hundreds of KiB between two readings: not the process a training run is."""
    code = [sys.executable, "-c", _LONG_EPOCH_FITS, str(tmp_path_factory.mktemp("fits"))]
    proc = subprocess.run(code, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_within_one_long_epoch_a_leak_is_flagged_by_step_300_and_a_clean_twin_never(fresh_fits: dict[str, Any]) -> None:
    clean, small, large = fresh_fits["clean"], fresh_fits["4k"], fresh_fits["256k"]
    assert clean["steps"] == 450 and clean["leaking"] == [] and clean["warnings"] == []
    assert not any(s["confirmed"] for s in clean["screens"])  # a screen may fire; a confirmation may not
    # The resident set: one step in 4, one in 8 once 64 readings are kept (step 256), evenly spread past warm-up.
    assert clean["resident"]["samples"] == len(range(56, 450, 8))
    for leak, size in ((small, 4096), (large, 256 << 10)):
        (message,) = [m for m in leak["warnings"] if re.search(r"leak.*KiB/step", m)]
        assert any(f"({point})" in message for point in POINTS)  # names the phase that grows
        assert leak["leaking"] and leak["stopped_at_step"] <= 300, leak
        assert leak["screens"][-1]["confirmed"] and leak["screens"][-1]["step"] < leak["stopped_at_step"]
        assert leak["resident"]["slope"] > size / 2  # the resident set grows at least about as fast


@pytest.mark.parametrize(
    ("model", "logged"), [(TinyMLP, False), (LogsAValuePerStep, True)], ids=["mlp", "logs-a-value-per-step"]
)
def test_models_that_do_not_leak_are_not_flagged(tmp_path: Path, model: type[TinyMLP], logged: bool) -> None:
    # Our warnings are errors in tests: a false alarm fails here. Several epochs of 64 steps, a logger flushing.
    callback = MemoryProfilerCallback(verbose=False)
    kwargs: dict[str, Any] = {"logger": CSVLogger(tmp_path, name="run"), "log_every_n_steps": 5} if logged else {}
    fit_mlp(tmp_path, callback, model(), steps=600, **kwargs)
    leaks = callback.report["leaks"]
    assert leaks["leaking"] == [] and leaks["stopped_at_step"] is None
    assert leaks["first_step"] == 50 and leaks["screen"]["trend"].samples == len(range(64, 600, 16))  # 64 kept


def test_a_clean_model_is_not_flagged(tmp_path: Path) -> None:
    # Validation and a logger run in between steps.
    callback = MemoryProfilerCallback(verbose=False)
    logger = CSVLogger(tmp_path, name="run")
    fit_convnet(tmp_path, callback, max_steps=80, logger=logger, limit_val_batches=2, val_check_interval=10)
    leaks = callback.report["leaks"]
    # The verdict, not the measured slope: allocator noise on a shared machine moves the figure, never the verdict.
    assert leaks["leaking"] == [] and leaks["screen"]["trend"].samples == len(range(16, 80, 4))


def test_the_resident_set_is_read_one_step_in_4_and_memory_in_use_on_snapshots_only(tmp_path: Path) -> None:
    callback = MemoryProfilerCallback(every_n_steps=10, warmup_steps=0, verbose=False)
    fit_mlp(tmp_path, callback, TinyMLP(), steps=200)
    assert callback.report["steps_sampled"] == 20  # full snapshots: steps 0, 10, 20, ...
    screen = callback.report["leaks"]["screen"]
    assert (screen["trend"].samples, screen["trend"].first_step, screen["trend"].last_step) == (50, 0, 196)
    assert screen["read_every_n_steps"] == 4  # (a screen may fire in a test suite's heap; a verdict may not)
    # Memory in use: on snapshot steps, and on a confirmation's 30 steps if a screen fired (none in a quiet process).
    assert all(t.samples in (0, 30) for t in callback.report["leaks"]["trends"].values())


# ----------------------------------------------------------------------------------------------- report files


def test_report_files_are_announced_and_a_second_run_does_not_overwrite_the_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        first = MemoryProfilerCallback(every_n_steps=1, verbose=False, plot=True)
        fit_mlp(tmp_path, first, TinyMLP(), steps=3)
        second = MemoryProfilerCallback(every_n_steps=1, verbose=False, plot=True)
        fit_mlp(tmp_path, second, TinyMLP(), steps=3)
    assert first.report["json"] == str(tmp_path / "memory_profile.json")
    assert second.report["json"] == str(tmp_path / "memory_profile-2.json")
    assert second.report["plot"] == str(tmp_path / "memory_profile-2.png")
    assert json.loads((tmp_path / "memory_profile.json").read_text())["steps_seen"] == 3
    for path in (first.report["json"], first.report["plot"], second.report["json"], second.report["plot"]):
        assert caplog.text.count(f"MemoryProfilerCallback: wrote {path}\n") == 1


def test_overwrite_true_writes_over_the_earlier_report(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fit_mlp(tmp_path, MemoryProfilerCallback(every_n_steps=1, verbose=False, plot=False), TinyMLP(), steps=3)
    with caplog.at_level(logging.INFO):
        again = MemoryProfilerCallback(every_n_steps=1, verbose=False, plot=False, overwrite=True)
        fit_mlp(tmp_path, again, TinyMLP(), steps=5)
    assert again.report["json"] == str(tmp_path / "memory_profile.json")
    assert json.loads((tmp_path / "memory_profile.json").read_text())["steps_seen"] == 5
    assert not (tmp_path / "memory_profile-2.json").exists()
    assert f"MemoryProfilerCallback: wrote {tmp_path / 'memory_profile.json'}" in caplog.text


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
    assert callback._cuda is not None and not callback._cuda.active  # listener and recording gone at teardown


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


def test_the_self_report_counts_every_hook_call_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each per-step hook is wrapped to count its calls; the report's count must match, and its total follow it.
    Between readings none runs (Lightning skips the hooks silenced then): the optimizer's post-hook counts down."""
    calls = {"n": 0}
    by_hook: dict[str, int] = {}
    names = ["on_train_batch_start", "on_before_zero_grad", "on_before_backward", "on_after_backward",
             "on_train_batch_end"]  # fmt: skip
    for name in names:
        real = getattr(MemoryProfilerCallback, name)

        def counted(self: Any, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls["n"] += 1
            by_hook[_name] = by_hook.get(_name, 0) + 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(MemoryProfilerCallback, name, counted)
    callback = MemoryProfilerCallback(every_n_steps=100, verbose=False)
    fit_mlp(tmp_path, callback, TinyMLP(), steps=120)
    # Steps that read: the snapshots (0, 100), every hook. The others run none: the optimizer's post-hook reads the
    # resident set and counts them down, each billed a counter call (no Lightning dispatch); warm-up (0-49) left out.
    assert by_hook["on_train_batch_start"] == by_hook["on_train_batch_end"] == 2
    assert all(by_hook[name] == 2 for name in names[1:4])
    overhead = callback.report["overhead"]
    assert overhead["hook_calls"] + overhead["warmup_hook_calls"] == calls["n"] == 10
    assert overhead["warmup_hook_calls"] == 5 and overhead["steady_steps"] == 70
    assert overhead["heavy_calls"] == overhead["hook_calls"] == 5 and overhead["dispatch_ns_per_call"] > 0
    # The quiet steps that read (the resident set, one in 4) are timed whole, the countdown's last is a counter; the
    # others only count down (no clock read, no call) and are billed as flag checks.
    assert overhead["quiet_calls"] == 70 - 1 and overhead["quiet_counter_calls"] == 1
    assert overhead["quiet_reading_calls"] == len(range(52, 120, 4)) - 1 and overhead["timed_calls"] == 0  # not 100
    flags = overhead["quiet_calls"] - overhead["quiet_counter_calls"] - overhead["quiet_reading_calls"]
    quiet = overhead["quiet_counter_calls"] * overhead["quiet_counter_ns"] + overhead["quiet_reading_ns_total"]
    quiet += flags * overhead["quiet_call_ns"]
    total = overhead["heavy_ns_total"] + quiet + overhead["hook_calls"] * overhead["dispatch_ns_per_call"]
    assert overhead["hooks_ns_total"] == pytest.approx(total)
    # After the fit the hooks are the class's again, and a copy carries none of the run's silencing.
    assert not {"on_before_backward", "on_before_optimizer_step"} & set(callback.__dict__)
    clone = pickle.loads(pickle.dumps(callback))
    assert clone.report is not None and not {"on_train_batch_end"} & set(clone.__dict__)


def test_with_gradient_accumulation_the_countdown_runs_in_the_batch_start_hook(tmp_path: Path) -> None:
    # The optimizer steps once in two batches: its post-hook cannot count batches, so the batch's start stays live.
    starts = {"n": 0}

    class Counting(MemoryProfilerCallback):
        def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
            starts["n"] += 1
            super().on_train_batch_start(*args, **kwargs)

    callback = Counting(every_n_steps=100, warmup_steps=100, verbose=False)  # no leak screen before step 172
    fit_mlp(tmp_path, callback, TinyMLP(), steps=70, accumulate_grad_batches=2)  # 140 batches
    assert starts["n"] == 140
    overhead = callback.report["overhead"]  # steady: 90 batches, of which 100 reads (a snapshot)
    assert overhead["quiet_counter_calls"] + overhead["quiet_reading_calls"] == overhead["quiet_calls"] == 90 - 1
    assert overhead["quiet_reading_calls"] == len(range(52, 140, 4)) - 1  # the resident set, one batch in 4
    assert callback.report["leaks"]["screen"]["trend"].last_step == 136  # batches (one in 4), as without accumulation
