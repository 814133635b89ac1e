"""Generic tests over every registered callback and strategy (``tests/callback_settings.py``)."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml

from lightning_perf.demos import WORKLOADS, make_workload
from tests.callback_settings import SETTINGS, Setting, params, public_classes

REPO_ROOT = Path(__file__).resolve().parents[1]


def _trainer(setting: Setting, root: Path, extra: Any = None, **overrides: Any) -> pl.Trainer:
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 3,
        "limit_val_batches": 2,
        "limit_test_batches": 2,
        "limit_predict_batches": 2,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": root,
    }
    kwargs.update(setting.trainer_kwargs)
    kwargs.update(overrides)
    instance = setting.build() if extra is None else extra
    if setting.is_strategy:
        kwargs["strategy"] = instance
    else:
        kwargs["callbacks"] = [instance]
    return pl.Trainer(**kwargs)


def _workload(setting: Setting, seed: int = 0) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    """The setting's workload; ``seed`` picks the model's initial weights and the data (a checkpoint restores both).

    The global seed stays 0: DDP-based strategies seed their sampler from it, even on one device.
    """
    pl.seed_everything(0, verbose=False)
    return make_workload(setting.workload, setting.preset, seed=seed)


def test_every_public_class_has_a_setting() -> None:
    registered = {s.cls for s in SETTINGS if not s.test_only}
    missing = [cls.__name__ for cls in public_classes() if cls not in registered]
    assert not missing, f"public classes without an entry in tests/callback_settings.py: {missing}"


@pytest.mark.parametrize("setting", params())
def test_short_fit(setting: Setting, tmp_path: Path) -> None:
    model, data = _workload(setting)
    trainer = _trainer(setting, tmp_path)
    trainer.fit(model, datamodule=data)
    assert trainer.state.finished
    assert trainer.global_step == 3
    loss = trainer.callback_metrics["train_loss"]
    assert math.isfinite(float(loss))


@pytest.mark.parametrize("setting", params())
def test_fit_twice(setting: Setting, tmp_path: Path) -> None:
    """The same callback instance drives two fits, on the same model, one after the other."""
    model, data = _workload(setting)
    instance = setting.build()
    for _ in range(2):
        # A strategy belongs to one Trainer (Lightning sets its accelerator): each fit gets its own.
        trainer = _trainer(setting, tmp_path, extra=setting.build() if setting.is_strategy else instance)
        trainer.fit(model, datamodule=data)
        assert trainer.global_step == 3
        assert math.isfinite(float(trainer.callback_metrics["train_loss"]))


@pytest.mark.parametrize("setting", params())
def test_fit_validate_test_predict(setting: Setting, tmp_path: Path) -> None:
    model, data = _workload(setting)
    trainer = _trainer(setting, tmp_path)
    trainer.fit(model, datamodule=data)
    (val,) = trainer.validate(model, datamodule=data, verbose=False)
    (test,) = trainer.test(model, datamodule=data, verbose=False)
    predictions = trainer.predict(model, datamodule=data)
    assert math.isfinite(val["val_loss"]) and math.isfinite(test["test_loss"])
    assert predictions and all(torch.isfinite(p).all() for p in predictions)


@pytest.mark.parametrize("setting", params())
def test_resume_equals_uninterrupted(setting: Setting, tmp_path: Path) -> None:
    """Two epochs in one go equal one epoch, a checkpoint, and a resumed second epoch with fresh objects."""
    limits = {"limit_train_batches": 2, "max_steps": -1}

    model, data = _workload(setting)
    straight = _trainer(setting, tmp_path / "straight", max_epochs=2, **limits)
    straight.fit(model, datamodule=data)

    first_model, first_data = _workload(setting)
    first = _trainer(setting, tmp_path / "first", max_epochs=1, **limits)
    first.fit(first_model, datamodule=first_data)
    ckpt = tmp_path / "epoch1.ckpt"
    first.save_checkpoint(ckpt)

    resumed_model, resumed_data = _workload(setting, seed=1)  # different init: the checkpoint must win
    resumed = _trainer(setting, tmp_path / "resumed", max_epochs=2, **limits)
    resumed.fit(resumed_model, datamodule=resumed_data, ckpt_path=ckpt)

    assert resumed.global_step == straight.global_step == 4
    expected, actual = model.state_dict(), resumed_model.state_dict()
    assert expected.keys() == actual.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=setting.resume_atol, rtol=0, msg=key)


@pytest.mark.parametrize("setting", params())
def test_checkpoint_loads_into_plain_model(setting: Setting, tmp_path: Path) -> None:
    """A checkpoint written with the callback has the plain model's keys and loads without the callback."""
    model, data = _workload(setting)
    trainer = _trainer(setting, tmp_path)
    trainer.fit(model, datamodule=data)
    ckpt = tmp_path / "with.ckpt"
    trainer.save_checkpoint(ckpt)

    plain_cls = WORKLOADS[setting.workload].module_cls
    plain, _ = _workload(setting)
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    assert set(state) == set(plain.state_dict())
    loaded = plain_cls.load_from_checkpoint(ckpt, map_location="cpu")
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, state[key], atol=0, rtol=0, msg=key)


@pytest.mark.parametrize("setting", params())
def test_built_from_lightning_cli_yaml(setting: Setting, tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    entry = {"class_path": setting.class_path, "init_args": dict(setting.kwargs)}
    trainer_cfg: dict[str, Any] = {"accelerator": "cpu", "devices": 1, "logger": False}
    trainer_cfg.update({k: v for k, v in setting.trainer_kwargs.items() if isinstance(v, (str, int, float, bool))})
    trainer_cfg["strategy" if setting.is_strategy else "callbacks"] = entry if setting.is_strategy else [entry]
    config = {
        "trainer": trainer_cfg,
        "model": {"preset": setting.preset},
        "data": {"preset": setting.preset},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    workload = WORKLOADS[setting.workload]
    cli = LightningCLI(
        workload.module_cls,
        workload.datamodule_cls,
        run=False,
        args=["--config", str(path)],
        save_config_callback=None,
    )
    if setting.is_strategy:
        assert isinstance(cli.trainer.strategy, setting.cls)
    else:
        assert any(isinstance(cb, setting.cls) for cb in cli.trainer.callbacks)


@pytest.mark.parametrize("setting", params())
def test_pickles_before_and_after_fit(setting: Setting, tmp_path: Path) -> None:
    instance = setting.build()
    clone = pickle.loads(pickle.dumps(instance))
    assert type(clone) is setting.cls
    if setting.is_strategy:
        return  # a strategy holds its trainer's process state after fit; the DDP test covers it
    model, data = _workload(setting)
    _trainer(setting, tmp_path, extra=instance).fit(model, datamodule=data)
    clone = pickle.loads(pickle.dumps(instance))
    assert type(clone) is setting.cls
    assert clone.state_dict().keys() == instance.state_dict().keys()


@pytest.mark.distributed
@pytest.mark.parametrize("setting", params([s for s in SETTINGS if s.ddp]))
def test_ddp_two_processes(setting: Setting, tmp_path: Path) -> None:
    """A 2-process DDP fit on CPU (gloo) runs the callback on both ranks and ends with identical weights."""
    result = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "_ddp_fit.py"), setting.id, str(result), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(result.read_text())
    assert report["world_size"] == 2
    assert report["global_step"] == 3
    assert report["ranks_agree"], "parameters differ between ranks after DDP training"
