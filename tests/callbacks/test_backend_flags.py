"""BackendFlagsCallback: set for the run, restored exactly afterwards (also after a failure), quiet only when useful."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_perf import LightningPerfWarning, NoEffectWarning
from lightning_perf.callbacks import BackendFlagsCallback
from lightning_perf.functional import backend_flags as bf
from lightning_perf.functional.backend_flags import BackendFlags, capture
from tests._models import trainer


def _trainer(tmp_path: Path, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    return trainer(tmp_path, callbacks=callbacks, **{"max_steps": 2, **kwargs})


class Probe(pl.Callback):
    """Reads the settings while training runs, and which of Lightning's end hooks were called."""

    def __init__(self) -> None:
        self.during: BackendFlags | None = None
        self.hooks: list[str] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.during = capture()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.hooks.append("teardown")

    def on_exception(self, *args: Any) -> None:
        self.hooks.append("on_exception")


@pytest.fixture
def fast_cpu_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make "medium" count as effective whatever CPU runs the tests (the setting itself works on any CPU)."""
    monkeypatch.setattr(bf, "has_fast_cpu_bf16", lambda: True)


def test_settings_hold_during_the_run_and_are_restored_after(tmp_path: Path, fast_cpu_bf16: None) -> None:
    before = capture()
    probe = Probe()
    callback = BackendFlagsCallback(float32_matmul_precision="medium", sdpa_backends=["math"])
    _trainer(tmp_path, [callback, probe]).fit(BoringModel())
    assert probe.during is not None
    assert probe.during.float32_matmul_precision == "medium" and probe.during.sdpa_backends == {"math"}
    assert probe.during != before
    assert capture() == before
    # A later Trainer in the same process starts from the settings as they were.
    later = Probe()
    _trainer(tmp_path, [later]).fit(BoringModel())
    assert later.during == before


def test_restored_after_an_exception_which_lightning_reports_through_on_exception(
    tmp_path: Path, fast_cpu_bf16: None
) -> None:
    class Failing(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            assert torch.get_float32_matmul_precision() == "medium"
            raise RuntimeError("boom")

    before = capture()
    probe = Probe()
    trainer = _trainer(tmp_path, [BackendFlagsCallback(float32_matmul_precision="medium"), probe])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Failing())
    assert probe.hooks == ["on_exception"]  # Lightning 2.6 does not call `teardown` when a run fails
    assert capture() == before


def test_every_stage_sets_and_restores(tmp_path: Path) -> None:
    before = capture()
    seen: dict[str, frozenset[str] | None] = {}

    class Model(BoringModel):
        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            seen["validate"] = capture().sdpa_backends
            return super().validation_step(batch, batch_idx)

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            seen["predict"] = capture().sdpa_backends
            return super().predict_step(batch, batch_idx)

    trainer = _trainer(tmp_path, [BackendFlagsCallback(sdpa_backends=["flash", "math"])], limit_predict_batches=1)
    model = Model()
    trainer.validate(model, verbose=False)
    assert capture() == before
    trainer.predict(model)
    assert seen == {"validate": {"flash", "math"}, "predict": {"flash", "math"}}
    assert capture() == before


def test_settings_without_effect_on_cpu_warn_once_and_are_not_applied(tmp_path: Path) -> None:
    before = capture()
    probe = Probe()
    callback = BackendFlagsCallback(cudnn_benchmark=not before.cudnn_benchmark, tf32=True, sdpa_backends=["math"])
    with pytest.warns(NoEffectWarning) as record:
        _trainer(tmp_path, [callback, probe]).fit(BoringModel())
        _trainer(tmp_path, [callback]).fit(BoringModel())
    messages = sorted(str(w.message) for w in record if issubclass(w.category, NoEffectWarning))
    assert len(messages) == 2
    assert "cudnn_benchmark is left alone: cuDNN autotuning only concerns CUDA" in messages[0]
    assert "tf32 is left alone: TF32 needs an Ampere or newer GPU" in messages[1]
    assert probe.during is not None
    assert probe.during.cudnn_benchmark == before.cudnn_benchmark and probe.during.matmul_tf32 == before.matmul_tf32
    assert probe.during.sdpa_backends == {"math"}  # the setting that does matter on CPU still applies
    assert capture() == before


def test_fastest_preset_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bf, "has_fast_cpu_bf16", lambda: True)
    probe = Probe()
    _trainer(tmp_path, [BackendFlagsCallback(preset="fastest"), probe]).fit(BoringModel())
    assert probe.during is not None and probe.during.float32_matmul_precision == "medium"

    monkeypatch.setattr(bf, "has_fast_cpu_bf16", lambda: False)
    with pytest.warns(NoEffectWarning, match=r"preset='fastest'.*no backend setting speeds up cpu"):
        _trainer(tmp_path, [BackendFlagsCallback(preset="fastest")]).fit(BoringModel())


def test_no_argument_on_cpu_sets_nothing_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bf, "has_fast_cpu_bf16", lambda: True)
    before = capture()
    probe = Probe()
    callback = BackendFlagsCallback()
    assert callback.preset == "recommended"
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = _trainer(tmp_path, [callback, probe])
        trainer.fit(BoringModel())
        trainer.validate(BoringModel(), verbose=False)
    # An info line, not a warning: nothing is wrong with the user's setup.
    assert not [w for w in record if issubclass(w.category, LightningPerfWarning)]
    assert probe.during == before and capture() == before
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("BackendFlagsCallback")]
    assert len(lines) == 1, lines
    assert "nothing set on cpu" in lines[0] and "without changing its numerics" in lines[0]
    assert "float32_matmul_precision='medium'" in lines[0]  # what this (bf16) CPU could opt into


def test_no_argument_on_cuda_chooses_the_recommended_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    callback = BackendFlagsCallback()
    monkeypatch.setattr(bf, "supports_tf32", lambda device=None: True)
    assert callback.flags_for(torch.device("cuda")) == BackendFlags(
        cudnn_benchmark=True, matmul_tf32=True, cudnn_tf32=True, float32_matmul_precision="high"
    )
    monkeypatch.setattr(bf, "supports_tf32", lambda device=None: False)  # pre-Ampere: no TF32 units
    assert callback.flags_for(torch.device("cuda")) == BackendFlags(cudnn_benchmark=True)
    assert callback.flags_for(torch.device("cpu")) == BackendFlags()


def test_recommended_preset_with_an_explicit_tf32_does_not_contradict_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bf, "supports_tf32", lambda device=None: True)
    flags = BackendFlagsCallback(preset="recommended", tf32=False).flags_for(torch.device("cuda"))
    assert flags.cudnn_benchmark is True and flags.matmul_tf32 is False and flags.float32_matmul_precision is None
    flags = BackendFlagsCallback(preset="recommended", float32_matmul_precision="highest").flags_for(
        torch.device("cuda")
    )
    assert flags.float32_matmul_precision == "highest" and flags.matmul_tf32 is None and flags.cudnn_tf32 is True


def test_explicit_settings_override_the_preset() -> None:
    callback = BackendFlagsCallback(preset="fastest", float32_matmul_precision="highest", cudnn_benchmark=False)
    cuda = callback.flags_for(torch.device("cuda"))
    assert cuda.cudnn_benchmark is False and cuda.float32_matmul_precision == "highest"
    assert cuda.matmul_tf32 is None  # decided by the explicit precision, not contradicted by the preset


def test_lightning_benchmark_flag_is_set_at_trainer_init_and_what_comes_back(tmp_path: Path) -> None:
    """`Trainer(benchmark=True)` writes cudnn.benchmark in its constructor and never restores it: the callback
    restores what it found at setup, which is the Trainer's value, not the one from before the Trainer."""
    original = torch.backends.cudnn.benchmark
    try:
        trainer = _trainer(tmp_path, [BackendFlagsCallback(sdpa_backends=["flash", "math"])], benchmark=not original)
        assert torch.backends.cudnn.benchmark is (not original)  # already at construction
        trainer.fit(BoringModel())
        assert torch.backends.cudnn.benchmark is (not original)
    finally:
        torch.backends.cudnn.benchmark = original


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tf32": "yes"}, TypeError, r"tf32='yes'.*Expected True, False or None"),
        ({"cudnn_benchmark": 1}, TypeError, r"cudnn_benchmark=1"),
        ({"float32_matmul_precision": "low"}, ValueError, r"float32_matmul_precision='low'"),
        ({"sdpa_backends": ["flash", "turbo"]}, ValueError, r"Callback\(sdpa_backends=\['flash', 'turbo'\]\)"),
        ({"preset": "fast"}, ValueError, r"preset='fast'.*Expected one of 'recommended', 'fastest'"),
        ({"tf32": True, "float32_matmul_precision": "highest"}, ValueError, "contradict each other"),
    ],
)
def test_constructor_validation(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        BackendFlagsCallback(**kwargs)


@pytest.mark.gpu
def test_cuda_settings_apply_and_restore(tmp_path: Path) -> None:
    before = capture()
    probe = Probe()
    callback = BackendFlagsCallback(cudnn_benchmark=not before.cudnn_benchmark, tf32=not before.matmul_tf32)
    _trainer(tmp_path, [callback, probe], accelerator="gpu").fit(BoringModel())
    assert probe.during is not None
    assert probe.during.cudnn_benchmark is (not before.cudnn_benchmark)
    assert probe.during.matmul_tf32 is (not before.matmul_tf32) and probe.during.cudnn_tf32 is (not before.matmul_tf32)
    assert capture() == before


@pytest.mark.gpu
def test_no_argument_on_cuda_applies_and_restores_the_recommended_settings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = capture()
    probe = Probe()
    with caplog.at_level(logging.INFO):
        _trainer(tmp_path, [BackendFlagsCallback(), probe], accelerator="gpu").fit(BoringModel())
    assert probe.during is not None and probe.during.cudnn_benchmark is True
    if torch.cuda.get_device_capability() >= (8, 0):
        assert probe.during.matmul_tf32 is True and probe.during.cudnn_tf32 is True
        assert probe.during.float32_matmul_precision == "high"
    assert "the settings recommended for cuda" in caplog.text
    assert capture() == before


@pytest.mark.gpu
def test_callback_wins_over_trainer_benchmark_during_the_run_on_cuda(tmp_path: Path) -> None:
    original = torch.backends.cudnn.benchmark
    probe = Probe()
    try:
        callback = BackendFlagsCallback(cudnn_benchmark=False)
        _trainer(tmp_path, [callback, probe], accelerator="gpu", benchmark=True).fit(BoringModel())
        assert probe.during is not None and probe.during.cudnn_benchmark is False
        assert torch.backends.cudnn.benchmark is True  # the Trainer's own value comes back
    finally:
        torch.backends.cudnn.benchmark = original
