"""BottleneckCallback: phase attribution (exact, on a scripted clock), live logging, advice, reports, safety."""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_perf.callbacks import BottleneckCallback, MemoryProfilerCallback
from lightning_perf.demos import make_workload
from lightning_perf.profiling import step_phases as sp
from lightning_perf.profiling.advice import PHASES
from tests._models import ScriptedClock
from tests.callbacks._interrupt import LossRecorder
from tests.callbacks._quiet import quiet_trainer


class SlowData(Dataset):
    """Each sample costs ``ms`` on the scripted clock to load."""

    def __init__(self, clock: ScriptedClock, ms: float, n: int = 64) -> None:
        self.clock, self.ms, self.n = clock, ms, n
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.clock.advance(self.ms)
        return self.x[i]


class TimedSGD(torch.optim.SGD):
    """SGD whose update costs ``ms`` on the scripted clock, after the closure (forward and backward) has run."""

    def __init__(self, params: Any, clock: ScriptedClock, ms: float) -> None:
        super().__init__(params, lr=0.1)
        self.clock, self.ms = clock, ms

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.clock.advance(self.ms)
        super().step()
        return loss


class Scripted(pl.LightningModule):
    """Every phase costs a known time on the scripted clock: forward 3, backward 5, optimizer 2, transfer 0.25 ms."""

    cost = {"forward": 3.0, "backward": 5.0, "optimizer": 2.0, "transfer": 0.25, "validation": 7.0}

    def __init__(self, clock: ScriptedClock) -> None:
        super().__init__()
        self.clock = clock
        self.layer = nn.Linear(4, 1)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        self.clock.advance(self.cost["transfer"])
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.clock.advance(self.cost["forward"])
        return self.layer(batch).pow(2).mean()

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.clock.advance(self.cost["backward"])
        super().backward(loss, *args, **kwargs)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.clock.advance(self.cost["validation"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return TimedSGD(self.parameters(), self.clock, self.cost["optimizer"])


class ScriptedManual(Scripted):
    """Manual optimization: two forward/backward pairs and one optimizer step per training step."""

    def __init__(self, clock: ScriptedClock) -> None:
        super().__init__(clock)
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        for _ in range(2):
            self.clock.advance(self.cost["forward"])
            self.manual_backward(self.layer(batch).pow(2).mean())
        opt.step()
        opt.zero_grad()
        self.clock.advance(1.0)  # user code after the step: forward-side work of the step


def scripted_fit(
    tmp_path: Path,
    model_cls: type = Scripted,
    data_ms: float = 0.5,
    callback_kwargs: dict[str, Any] | None = None,
    n: int = 64,
    val_n: int = 0,
    callbacks: tuple[pl.Callback, ...] = (),
    **kwargs: Any,
) -> BottleneckCallback:
    """A fit on the scripted clock; ``val_n`` samples of validation data (none: no validation)."""
    clock = ScriptedClock()
    callback = BottleneckCallback(
        **{"warmup_steps": 1, "sync_check_steps": 0, "verbose": False, "sample_every": 1, **(callback_kwargs or {})}
    )
    callback._clock = clock
    model = model_cls(clock)
    data = DataLoader(SlowData(clock, data_ms, n), batch_size=2)
    val = [DataLoader(SlowData(clock, 0.5, val_n), batch_size=2)] if val_n else []
    kwargs.setdefault("max_steps", 6)
    quiet_trainer(tmp_path, [callback, *callbacks], **kwargs).fit(model, data, *val)
    return callback


def steady_records(callback: BottleneckCallback) -> list[dict[str, float]]:
    assert callback.report is not None
    return callback.report["per_step"]["records"]


# ---------------------------------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        # (test_bad_inputs.py names every argument's bad values; these rows check the kind and the explanation)
        ({"sync_check_steps": 3, "warmup_steps": 2}, "at most warmup_steps"),
        ({"thresholds": {"forward": 0.5}}, r"thresholds=\{'forward': 0.5\}\)` is not valid: 'forward' not a phase"),
        ({"thresholds": {"data": 1.5}}, "strictly between 0 and 1"),
        ({"thresholds": {"data": 0}}, "strictly between 0 and 1"),
        ({"filename": "sub/report"}, "plain, non-hidden file stem"),
        ({"sample_every": 0}, "sample_every=0"),
        ({"thresholds": [0.2]}, "Expected a dict from phase name"),
        ({"overwrite": 1}, "overwrite"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs: dict[str, Any], match: str) -> None:
    error = TypeError if kwargs in ({"thresholds": [0.2]}, {"overwrite": 1}) else ValueError
    with pytest.raises(error, match=match):
        BottleneckCallback(**kwargs)


# ------------------------------------------------------------------------------------------------- attribution


def test_each_phase_gets_exactly_its_time_and_sample_every_one_times_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, list[int]] = {}
    _spy(monkeypatch, seen)
    callback = scripted_fit(tmp_path)  # sample_every=1
    assert all(seen[name] == list(range(6)) for name in _SILENCEABLE)
    assert callback.report["steps_run"] == 6
    assert not callback.report["per_step"]["sampled"] and callback.report["overhead"]["quiet_calls"] == 0
    assert BottleneckCallback().sample_every == 100  # the default
    records = steady_records(callback)
    assert len(records) == 5  # 6 steps, 1 warm-up
    for record in records:
        assert record["data"] == pytest.approx(0.001)  # two samples of 0.5 ms
        assert record["transfer"] == pytest.approx(0.00025)
        assert record["forward"] == pytest.approx(0.003)
        assert record["backward"] == pytest.approx(0.005)
        assert record["optimizer"] == pytest.approx(0.002)
        assert record["other"] == pytest.approx(0.0, abs=1e-12)
        assert record["step"] == pytest.approx(0.01125)
    shares = callback.report["steady_state"]["shares"]
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["backward"] == pytest.approx(5 / 11.25)


def test_under_gradient_accumulation_the_optimizer_runs_once_per_window(tmp_path: Path) -> None:
    callback = scripted_fit(tmp_path, accumulate_grad_batches=2, max_steps=4)  # 8 batches
    records = steady_records(callback)
    assert len(records) == 7
    optimizer = [r["optimizer"] for r in records]
    # Batches 1, 3, 5, 7 step the optimizer (batch 0 is warm-up); the others only accumulate, after zero_grad
    # (the first batch of each window: free on the scripted clock).
    assert optimizer == pytest.approx([0.002, 0.0, 0.002, 0.0, 0.002, 0.0, 0.002])
    assert all(r["forward"] == pytest.approx(0.003) and r["backward"] == pytest.approx(0.005) for r in records)
    assert callback.report["steady_state"]["phases"]["optimizer"]["median"] == pytest.approx(0.002)
    assert callback.report["steady_state"]["shares"]["optimizer"] == pytest.approx(4 * 0.002 / (7 * 0.00925 + 0.008))


def test_manual_optimization_sums_the_phases_of_every_call(tmp_path: Path) -> None:
    callback = scripted_fit(tmp_path, model_cls=ScriptedManual)
    for record in steady_records(callback):
        assert record["forward"] == pytest.approx(0.003 * 2 + 0.001)
        assert record["backward"] == pytest.approx(0.005 * 2)
        assert record["optimizer"] == pytest.approx(0.002)
        assert record["other"] == pytest.approx(0.0, abs=1e-12)


def test_validation_is_timed_apart_and_never_reaches_the_training_phases(tmp_path: Path) -> None:
    callback = scripted_fit(tmp_path, val_n=4, max_steps=8, val_check_interval=3, limit_val_batches=2)
    report = callback.report
    assert report["validation"]["runs"] == 2
    # Each run: two batches of 1 ms loading and 0.25 ms transfer, plus 7 ms of validation_step.
    assert report["validation"]["median_s"] == pytest.approx(2 * (0.001 + 0.00025 + 0.007))
    assert report["steps"]["interrupted"] == 2  # the steps right after each validation run
    clean = [r for r, cut in zip(steady_records(callback), report["per_step"]["interrupted"]) if not cut]
    assert len(clean) == 5 and all(
        r["data"] == pytest.approx(0.001) and r["step"] == pytest.approx(0.01125) for r in clean
    )
    assert report["steady_state"]["phases"]["data"]["median"] == pytest.approx(0.001)


def test_slow_data_is_diagnosed_with_the_loader_settings_as_evidence(tmp_path: Path) -> None:
    callback = scripted_fit(tmp_path, data_ms=20.0)  # 40 ms of loading against 10.25 ms of work
    report = callback.report
    assert report["dataloader"].num_workers == 0
    (rec,) = [r for r in report["recommendations"] if r.rule == "data_wait"]
    assert rec.severity == "high"
    assert "num_workers=0" in rec.evidence and "data is 80% of step time" in rec.evidence
    assert any("set DataLoader(num_workers=" in action for action in rec.actions)
    saved = json.loads(Path(report["json"]).read_text())
    assert saved["recommendations"][0]["rule"] == "data_wait"


# ------------------------------------------------------------------------------------------- reports and output


def test_reports_are_written_to_the_default_root_dir_announced_and_a_second_run_does_not_overwrite_the_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        callback = scripted_fit(tmp_path, callback_kwargs={"plot": True})
        second = scripted_fit(tmp_path, callback_kwargs={"plot": True}, max_steps=4)
    saved = json.loads((tmp_path / "bottleneck.json").read_text())
    assert saved["callback"] == "BottleneckCallback"
    assert set(saved["steady_state"]["shares"]) == set(PHASES)
    assert saved["steps"] == {"total": 6, "warmup": 1, "steady": 5, "interrupted": 0}
    assert saved["throughput"]["batch_size_median"] == 2
    # The hooks' own cost is read from the real clock, so it shows even though the phases ran on a scripted one.
    assert saved["overhead"]["hooks_ns_total"] > 0 and saved["overhead"]["share_of_step"] > 0
    assert (tmp_path / "bottleneck.png").stat().st_size > 0
    assert saved["plot"] == str(tmp_path / "bottleneck.png")
    assert callback.report["json"] == str(tmp_path / "bottleneck.json")
    assert callback.report["plot"] == str(tmp_path / "bottleneck.png")
    assert (second.report["json"], second.report["plot"]) == (
        str(tmp_path / "bottleneck-2.json"),
        str(tmp_path / "bottleneck-2.png"),
    )
    assert json.loads((tmp_path / "bottleneck.json").read_text())["steps"]["total"] == 6  # the first run's, intact
    assert json.loads((tmp_path / "bottleneck-2.json").read_text())["steps"]["total"] == 4
    for path in (callback.report["json"], callback.report["plot"], second.report["json"], second.report["plot"]):
        assert caplog.text.count(f"BottleneckCallback: wrote {path}\n") == 1


def test_overwrite_true_writes_over_the_earlier_report(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    scripted_fit(tmp_path)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again = scripted_fit(tmp_path, callback_kwargs={"overwrite": True, "plot": False}, max_steps=4)
    assert again.report["json"] == str(tmp_path / "bottleneck.json")
    assert json.loads((tmp_path / "bottleneck.json").read_text())["steps"]["total"] == 4
    assert not (tmp_path / "bottleneck-2.json").exists()
    assert caplog.text.count("BottleneckCallback: wrote") == 1  # no chart this time: one file, one line


def test_the_chart_is_opt_in_and_without_matplotlib_a_note_replaces_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with caplog.at_level(logging.INFO):
        callback = scripted_fit(tmp_path, callback_kwargs={"verbose": True})
    assert callback.report["plot"] is None and not (tmp_path / "bottleneck.png").exists()
    assert "pass plot=True for bottleneck.png" in callback.report["plot_note"]
    assert "pass plot=True" in caplog.text and "forward" in caplog.text  # the note and the table, in the log
    monkeypatch.setattr("lightning_perf.callbacks._observer.is_available", lambda module: False)
    callback = scripted_fit(tmp_path, callback_kwargs={"plot": True, "overwrite": True})
    assert callback.report["plot"] is None and not (tmp_path / "bottleneck.png").exists()
    assert "pip install 'lightning-perf[plot]'" in callback.report["plot_note"]


def test_the_self_report_counts_every_hook_call_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of the callback's per-step entry points is wrapped to count its calls; the report's count must match."""
    calls = {"n": 0}
    names = ["_before_transfer", "_after_transfer", "_after_optimizer_step", "on_train_batch_start",
             "on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
             "on_train_batch_end"]  # fmt: skip
    for name in names:
        real = getattr(BottleneckCallback, name)

        def counted(self: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            calls["n"] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(BottleneckCallback, name, counted)
    callback = scripted_fit(tmp_path, max_steps=40)
    overhead = callback.report["overhead"]
    # Nine a step, the first step's transfer before fit start; the warm-up steps' calls apart from the steady ones.
    assert overhead["hook_calls"] + overhead["warmup_hook_calls"] == calls["n"] > 9 * 39
    assert overhead["warmup_hook_calls"] > 0 and overhead["steady_steps"] == 40 - callback.warmup_steps
    assert overhead["timed_calls"] > 0 and overhead["dispatch_ns_per_call"] > 0
    # The estimate: heavy calls as timed, the others at the mean timed body, the dispatch of each: nothing left out.
    routine = overhead["hook_calls"] - overhead["heavy_calls"]
    total = overhead["heavy_ns_total"] + routine * overhead["hook_body_ns"]
    assert overhead["hooks_ns_total"] == pytest.approx(
        total + overhead["hook_calls"] * overhead["dispatch_ns_per_call"]
    )


def test_live_figures_reach_the_logger_and_the_progress_bar(tmp_path: Path) -> None:
    clock = ScriptedClock()
    callback = BottleneckCallback(
        warmup_steps=1, sync_check_steps=0, log_every_n_steps=2, progress_bar=True, sample_every=1
    )
    callback._clock = clock
    logger = CSVLogger(tmp_path, name="run", version=0)
    fit = quiet_trainer(tmp_path, [callback], max_steps=6, logger=logger)
    fit.fit(Scripted(clock), DataLoader(SlowData(clock, 0.5), batch_size=2))
    rows = list(csv.DictReader((tmp_path / "run" / "version_0" / "metrics.csv").open()))
    logged = [r for r in rows if r.get("bottleneck/backward")]
    assert [int(r["step"]) for r in logged] == [2, 4, 6]
    assert float(logged[-1]["bottleneck/backward"]) == pytest.approx(5 / 11.25)
    assert float(logged[-1]["bottleneck/samples_per_s"]) == pytest.approx(2 / 0.01125)
    assert fit.progress_bar_metrics["bwd%"] == pytest.approx(44.4)
    assert fit.progress_bar_metrics["samples/s"] == pytest.approx(177.8)
    assert (tmp_path / "run" / "version_0" / "bottleneck.json").exists()  # the logger's log_dir


# ------------------------------------------------------------------------------------------ host synchronizations


class SyncingModel(Scripted):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.seen = loss.item()  # SYNC-LINE
        return loss


def _line_of(marker: str) -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if line.endswith(marker))


def test_host_syncs_in_the_training_step_are_found_with_their_line(tmp_path: Path) -> None:
    kwargs = {"warmup_steps": 3, "sync_check_steps": 2, "sample_every": 100}
    callback = scripted_fit(tmp_path, SyncingModel, max_steps=5, callback_kwargs=kwargs)
    syncs = callback.report["host_syncs"]
    assert syncs["method"] == "torch-function-mode" and syncs["steps_checked"] == 2
    (site,) = syncs["sites"]
    assert (site.kind, site.filename, site.lineno, site.count) == ("item", __file__, _line_of("# SYNC-LINE"), 2)
    (rec,) = [r for r in callback.report["recommendations"] if r.rule == "host_syncs"]
    assert f"test_bottleneck.py:{site.lineno}" in rec.evidence and "1.0 per step" in rec.evidence
    assert torch._C._len_torch_function_stack() == 0  # the mode is gone after the checked steps


class FailingModel(Scripted):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        raise RuntimeError("model failure")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.opt = super().configure_optimizers()
        return self.opt


def test_a_failing_step_leaves_no_mode_or_hook_behind(tmp_path: Path) -> None:
    clock = ScriptedClock()
    callback = BottleneckCallback(warmup_steps=1, sync_check_steps=1)
    model = FailingModel(clock)
    with pytest.raises(RuntimeError, match="model failure"):
        quiet_trainer(tmp_path, [callback], max_steps=2).fit(model, DataLoader(SlowData(clock, 0.5), batch_size=2))
    assert torch._C._len_torch_function_stack() == 0
    assert "on_before_batch_transfer" not in model.__dict__ and "on_after_batch_transfer" not in model.__dict__
    assert not model.opt._optimizer_step_post_hooks


# --------------------------------------------------------------------------------------------- training unchanged


def _fit_convnet(tmp_path: Path, callbacks: list[pl.Callback]) -> tuple[list[float], dict[str, torch.Tensor]]:
    record = LossRecorder()
    pl.seed_everything(0, verbose=False)
    model, data = make_workload("convnet", "tiny", seed=0)
    quiet_trainer(tmp_path, [*callbacks, record], max_steps=6, limit_val_batches=2, val_check_interval=3).fit(
        model, datamodule=data
    )
    return record.losses, model.state_dict()


def test_observing_does_not_change_training(tmp_path: Path) -> None:
    plain_losses, plain_state = _fit_convnet(tmp_path / "plain", [])
    observers = [
        BottleneckCallback(warmup_steps=2, sync_check_steps=2, verbose=False),
        MemoryProfilerCallback(every_n_steps=1, warmup_steps=1, verbose=False),
    ]
    observed_losses, observed_state = _fit_convnet(tmp_path / "observed", observers)
    assert observed_losses == plain_losses
    for key, value in plain_state.items():
        assert torch.equal(observed_state[key], value), key


def test_lm_dict_batches_give_the_batch_size(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    model, data = make_workload("lm", "tiny", seed=0, batch_size=8)
    callback = BottleneckCallback(warmup_steps=1, sync_check_steps=1, verbose=False)
    quiet_trainer(tmp_path, [callback], max_steps=3).fit(model, datamodule=data)
    assert callback.report["throughput"]["batch_size_median"] == 8
    assert math.isfinite(callback.report["throughput"]["samples_per_s"])


# ------------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_no_device_synchronize_per_step_on_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = torch.cuda.synchronize

    def counting(device: Any = None) -> None:
        calls.append("sync")
        real(device)

    monkeypatch.setattr(torch.cuda, "synchronize", counting)

    class Count(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            per_step.append(len(calls))

    per_step: list[int] = []
    pl.seed_everything(0, verbose=False)
    model, data = make_workload("convnet", "tiny", seed=0)
    observers = [BottleneckCallback(warmup_steps=2, sync_check_steps=1, verbose=False), MemoryProfilerCallback()]
    quiet_trainer(tmp_path, [*observers, Count()], accelerator="cuda", max_steps=12).fit(model, datamodule=data)
    assert per_step == [0] * 12  # nothing synchronized the device during training
    assert len(calls) <= 1  # the timer reads every pending step back at fit end, with at most one wait
    assert torch.cuda.get_sync_debug_mode() == 0
    assert observers[0].report["host_syncs"]["method"] == "cuda-sync-debug-mode"
    assert observers[0].report["device"].startswith("cuda")


@pytest.mark.gpu
def test_cuda_sync_debug_mode_finds_item_in_the_step(tmp_path: Path) -> None:
    class ItemModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.layer(batch).pow(2).mean()
            self.seen = loss.item()  # CUDA-SYNC-LINE
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = BottleneckCallback(warmup_steps=2, sync_check_steps=2, verbose=False)
    data = DataLoader(torch.randn(16, 4), batch_size=2)
    quiet_trainer(tmp_path, [callback], accelerator="cuda", max_steps=4).fit(ItemModel(), data)
    sites = callback.report["host_syncs"]["sites"]
    assert any(s.lineno == _line_of("# CUDA-SYNC-LINE") for s in sites), sites
    assert torch.cuda.get_sync_debug_mode() == 0


# ------------------------------------------------------------------------------------------------------- pickling


class _Unpicklable:
    """Stands for a CUDA event: ``pickle`` refuses it the way it refuses ``torch.cuda.Event``."""

    def __reduce__(self) -> Any:
        raise TypeError("cannot pickle 'Event' object")


def test_pickles_after_fit_with_run_time_device_state_left_behind(tmp_path: Path) -> None:
    import copy
    import pickle

    callback = scripted_fit(tmp_path)
    assert callback._phases is not None and callback._handles == []
    # What a CUDA fit leaves in the timers: events of the last (closed, unresolved) phases.
    callback._phases.timer.events = _Unpicklable()  # type: ignore[attr-defined]
    callback._phases.validation._open["validation"] = _Unpicklable()
    with pytest.raises(TypeError, match="cannot pickle"):
        pickle.dumps(callback._phases)
    clone = pickle.loads(pickle.dumps(callback))
    assert clone.report is not None and callback.report is not None
    assert clone.report.keys() == callback.report.keys()
    assert clone.report["per_step"]["records"] == callback.report["per_step"]["records"]
    assert clone._phases is None  # with its timers and its host-sync recorder
    assert (clone.warmup_steps, clone.filename, clone.thresholds) == (1, "bottleneck", callback.thresholds)
    assert callback._phases is not None  # the original keeps its run
    deep = copy.deepcopy(callback)
    assert deep._phases is None and deep.report is not None
    # The copy measures a fit of its own: its timers are built at fit start.
    clone._clock = ScriptedClock()
    quiet_trainer(tmp_path / "again", [clone], max_steps=3).fit(Scripted(clone._clock), DataLoader(torch.randn(8, 4)))
    assert clone.report is not None and clone.report["steps"]["total"] == 3


def test_a_copy_taken_mid_fit_starts_idle(tmp_path: Path) -> None:
    import pickle

    copies: list[BottleneckCallback] = []

    class CopyMidFit(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 55:  # after the dense steps (1 warm-up + 50): the hooks are silenced
                copies.append(pickle.loads(pickle.dumps(trainer.callbacks[0])))

    callback = scripted_fit(tmp_path, max_steps=60, callback_kwargs={"sample_every": 100}, callbacks=(CopyMidFit(),))
    (copy_,) = copies
    assert copy_._phases is None and copy_._handles == []
    assert not {"on_train_batch_start", "on_train_batch_end"} & copy_.__dict__.keys()  # silenced then: not carried
    assert callback.report is not None and callback.report["steps_run"] == 60
    assert callback.report["steps"]["total"] == 1 + 50 + 1  # warm-up, every step until 50 steady, one in 100


@pytest.mark.gpu
def test_pickles_after_a_cuda_fit(tmp_path: Path) -> None:
    import pickle

    pl.seed_everything(0, verbose=False)
    model, data = make_workload("convnet", "tiny", seed=0)
    callback = BottleneckCallback(warmup_steps=2, sync_check_steps=1, verbose=False)
    quiet_trainer(tmp_path, [callback], accelerator="cuda", max_steps=4).fit(model, datamodule=data)
    clone = pickle.loads(pickle.dumps(callback))
    assert clone.report is not None and clone.report["device"].startswith("cuda") and clone._phases is None


# ------------------------------------------------------------------------------------------------------- sampling

_SILENCEABLE = ("on_train_batch_start", "on_before_zero_grad", "on_before_backward", "on_after_backward",
                "on_before_optimizer_step", "on_train_batch_end")  # fmt: skip


def _spy(monkeypatch: pytest.MonkeyPatch, seen: dict[str, list[int]]) -> None:
    """Record the training step (counted by Lightning's batch progress) in which each of the callback's hooks runs."""
    for name in _SILENCEABLE:
        real = getattr(BottleneckCallback, name)

        def spied(self: Any, trainer: pl.Trainer, *args: Any, _real: Any = real, _name: str = name) -> Any:
            seen.setdefault(_name, []).append(trainer.fit_loop.epoch_loop.batch_progress.total.ready - 1)
            return _real(self, trainer, *args)

        monkeypatch.setattr(BottleneckCallback, name, spied)


def _sampled(steps: int, every: int, first: int) -> list[int]:
    return [s for s in range(steps) if s < first or (s - first) % every == 0]


def test_sampled_steps_run_the_hooks_only_on_sampled_steps_and_the_step_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, list[int]] = {}
    _spy(monkeypatch, seen)
    callback = scripted_fit(
        tmp_path, max_steps=40, callback_kwargs={"warmup_steps": 2, "sample_every": 4, "min_timed_steps": 0}
    )
    sampled = _sampled(40, 4, 2)  # 0, 1 (warm-up), 2, 6, ..., 38
    assert len(sampled) == 12
    for name in _SILENCEABLE[:-1]:
        assert seen[name] == sampled, name
    assert seen["on_train_batch_end"] == sorted({*sampled, *(s - 1 for s in sampled[3:])})  # and the step before
    report = callback.report
    assert report["steps"] == {"total": 12, "warmup": 2, "steady": 10, "interrupted": 0}
    assert report["steps_run"] == 40 and report["sampling"]["sample_every"] == 4
    assert report["per_step"]["sampled"] and report["throughput"]["from_sampled_steps"]
    for record in steady_records(callback):  # exactly as every step is timed: the wait from the step before
        assert record["data"] == pytest.approx(0.001) and record["step"] == pytest.approx(0.01125)
        assert record["other"] == pytest.approx(0.0, abs=1e-12)
    overhead = report["overhead"]
    assert overhead["steady_steps"] == 38 and overhead["quiet_calls"] > 0  # averaged over every step run
    assert overhead["hooks_ns_per_step"] == pytest.approx(overhead["hooks_ns_total"] / 38)
    assert not set(_SILENCEABLE) & callback.__dict__.keys()  # given back at teardown
    assert report["throughput"]["samples_per_s"] == pytest.approx(2 / 0.01125)


class ChainSpy(Scripted):
    """Records, per training step, whether the batch-transfer hooks carried the observer's links for its batch."""

    def __init__(self, clock: ScriptedClock) -> None:
        super().__init__(clock)
        self.chained: list[bool] = []

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.chained.append("on_after_batch_transfer" in self.__dict__)  # our stand-in is on the instance
        return batch


def test_skipped_steps_do_not_even_chain_the_transfer_hooks(tmp_path: Path) -> None:
    seen: list[ChainSpy] = []

    class Spy(ChainSpy):
        def __init__(self, clock: ScriptedClock) -> None:
            super().__init__(clock)
            seen.append(self)

    callback = scripted_fit(
        tmp_path, Spy, max_steps=20, callback_kwargs={"warmup_steps": 2, "sample_every": 4, "min_timed_steps": 0}
    )
    sampled = _sampled(20, 4, 2)
    assert seen[0].chained == [s in sampled for s in range(20)]  # linked for timed steps only
    assert callback.report["per_step"]["records"]  # and the timed steps still have their transfer phase
    assert all(r["transfer"] > 0 for r in steady_records(callback))
    assert "on_after_batch_transfer" not in seen[0].__dict__ and "on_before_batch_transfer" not in seen[0].__dict__


def test_a_sampled_step_after_validation_or_an_epoch_boundary_is_interrupted(tmp_path: Path) -> None:
    callback = scripted_fit(  # 30 steps an epoch: step 30 (sampled) starts one
        tmp_path, n=60, val_n=4, max_steps=40, val_check_interval=5, limit_val_batches=2,
        callback_kwargs={"warmup_steps": 2, "sample_every": 4, "min_timed_steps": 0},
    )  # fmt: skip
    report = callback.report
    assert report["steps_run"] == 40 and report["steps"]["total"] == 12
    assert report["validation"]["runs"] == 8 and report["validation"]["median_s"] == pytest.approx(2 * 0.00825)
    # Sampled steady steps 2, 6, ..., 38: 10 after validation (after step 9), 30 after validation and a new epoch.
    assert report["per_step"]["interrupted"] == [s in (10, 30) for s in _sampled(40, 4, 2)[2:]]
    clean = [r for r, cut in zip(steady_records(callback), report["per_step"]["interrupted"]) if not cut]
    assert all(r["data"] == pytest.approx(0.001) and r["step"] == pytest.approx(0.01125) for r in clean)


@pytest.mark.parametrize(
    ("model_cls", "kwargs", "batches"),
    [(Scripted, {"accumulate_grad_batches": 2, "max_steps": 10}, 20), (ScriptedManual, {"max_steps": 12}, 12)],
)
def test_without_one_optimizer_step_a_batch_the_batch_end_counts_the_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_cls: type, kwargs: dict[str, Any], batches: int
) -> None:
    seen: dict[str, list[int]] = {}
    _spy(monkeypatch, seen)
    callback = scripted_fit(tmp_path, model_cls, callback_kwargs={"sample_every": 4, "min_timed_steps": 0}, **kwargs)
    sampled = _sampled(batches, 4, 1)
    assert seen["on_train_batch_end"] == list(range(batches))  # the counter, always on
    assert seen["on_train_batch_start"] == seen["on_before_backward"][:: 2 if model_cls is ScriptedManual else 1]
    assert seen["on_train_batch_start"] == sampled
    report = callback.report
    assert report["steps_run"] == batches and report["steps"]["total"] == len(sampled)
    for record in steady_records(callback):
        assert record["data"] == pytest.approx(0.001) and record["other"] == pytest.approx(0.0, abs=1e-12)
    if model_cls is ScriptedManual:
        assert all(r["forward"] == pytest.approx(0.007) for r in steady_records(callback))
    else:  # the sampled batches 1, 5, 9, ... end an accumulation window: the optimizer steps in each
        assert all(r["optimizer"] == pytest.approx(0.002) for r in steady_records(callback))


def test_a_failing_sampled_fit_gives_the_hooks_back(tmp_path: Path) -> None:
    clock = ScriptedClock()

    class FailLater(Scripted):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if batch_idx == 7:  # hooks silenced then (sampled: 0, 1, 5, 9, ...)
                raise RuntimeError("late failure")
            return super().training_step(batch, batch_idx)

    callback = BottleneckCallback(warmup_steps=1, sync_check_steps=0, sample_every=4, verbose=False, min_timed_steps=0)
    callback._clock = clock
    with pytest.raises(RuntimeError, match="late failure"):
        quiet_trainer(tmp_path, [callback], max_steps=20).fit(FailLater(clock), DataLoader(SlowData(clock, 0.5)))
    assert not set(_SILENCEABLE) & callback.__dict__.keys()


def test_a_short_fit_is_timed_at_every_steady_step_and_a_very_short_one_says_it_is_indicative(tmp_path: Path) -> None:
    """Defaults (one step in 100 after the dense ones): a 40-step fit's report rests on all 35 steady steps; a 3-step
    fit's (1 steady step past 2 warm-up) says so in its table title and in each piece of advice."""
    fit = scripted_fit(
        tmp_path / "40", max_steps=40, data_ms=20.0, callback_kwargs={"warmup_steps": 5, "sample_every": 100}
    )
    report = fit.report
    assert report is not None and report["steps"]["steady"] == 35 >= 30 and report["steps"]["total"] == 40
    assert report["sampling"]["indicative"] is None
    title = sp.phase_table(report, "BottleneckCallback")[2]
    assert "indicative" not in title
    short = scripted_fit(tmp_path / "3", max_steps=3, data_ms=20.0, callback_kwargs={"warmup_steps": 2})
    assert short.report is not None and short.report["sampling"]["indicative"] == "from 1 timed steps: indicative only"
    assert "(from 1 timed steps: indicative only)" in sp.phase_table(short.report, "BottleneckCallback")[2]
    recs = short.report["recommendations"]
    assert recs and all(r.evidence.startswith("from 1 timed steps: indicative only; ") for r in recs)  # data waits


def test_each_phase_share_carries_its_interval() -> None:
    steady = [{"data": 1.0 + (i % 3) * 0.1, "forward": 2.0, "step": 5.0 + (i % 3) * 0.1} for i in range(40)]
    records = [sp.with_other(r) for r in steady]
    shares, intervals = sp.phase_shares(records), sp.share_intervals(records)
    for name in ("data", "forward", "other"):
        low, high = intervals[name]
        assert low < shares[name] < high and high - low < 0.05, name  # steady steps: narrow, around the share
    assert intervals["backward"] == [0.0, 0.0]  # never ran: exactly zero
    assert all(math.isnan(v) for v in sp.share_intervals(records[:1])["data"])  # one step: no interval
    wide = sp.share_intervals([sp.with_other({"data": d, "step": 5.0}) for d in (0.5, 4.5) * 3])["data"]
    assert wide[1] - wide[0] > 0.3  # steps that disagree: wide
