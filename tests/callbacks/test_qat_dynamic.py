"""QATCallback(mode="dynamic"): training untouched, predict/test/validate through an int8 copy swapped in for the
run and undone after it (and on failure), the end-of-fit artifact set, resume and fit twice, early errors."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_perf.callbacks import QATCallback
from lightning_perf.deploy.quantize import dynamic
from lightning_perf.profiling.latency import LatencyRow
from tests._models import trainer

QUICK = {"backend": "eager", "benchmark": False, "validation_batches": 2}


class Classifier(pl.LightningModule):
    """An MLP on a linearly separable 4-class problem; records the layer types each step runs with."""

    def __init__(self, fail_predict_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 16, generator=g)
        y = (x @ torch.randn(16, 4, generator=g)).argmax(-1)
        self.data = torch.utils.data.TensorDataset(x, y)
        self.fail_predict_at = fail_predict_at
        self.seen: dict[str, set[str]] = {}

    def _record(self, stage: str) -> None:
        self.seen.setdefault(stage, set()).update(
            f"{type(m).__module__}.{type(m).__name__}" for m in self.net.modules()
        )
        self.seen.setdefault(stage + "_training", set()).add(str(self.net.training))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._record("fit")
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._record(self.trainer.state.fn)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._record("test")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._record("predict")
        if self.fail_predict_at is not None and batch_idx == self.fail_predict_at:
            raise RuntimeError("predict failed")
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def _loader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=64)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader


def _trainer(root: Path, callbacks: list[Any], **overrides: Any) -> pl.Trainer:
    defaults = {"max_epochs": 8, "max_steps": -1, "limit_val_batches": 1.0}
    return trainer(root, callbacks=callbacks, **{**defaults, **overrides})


def _int8(types: set[str]) -> bool:
    return any(".quantized.dynamic." in t for t in types) and "torch.nn.modules.linear.Linear" not in types


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    dynamic.clear_cache()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "x86"}, r"QATCallback\(backend='x86'\)` is not valid. Expected one of 'auto', 'eager'"),
        ({"backend": "fbgemm"}, r"backend='fbgemm'"),
        ({"mode": "int8"}, r"mode='int8'.*'qat', 'ptq', 'dynamic'"),
        ({"min_agreement": 1.5}, r"min_agreement=1.5"),
        ({"min_agreement": float("nan")}, r"min_agreement=nan"),
        ({"base_config": "Int8DynamicActivationInt8WeightConfig"}, r"mode='dynamic', base_config="),
        ({"eval_converted_every_n_epochs": 1}, r"eval_converted_every_n_epochs=1"),
        ({"onnx": True}, r"onnx=True"),
        ({"freeze_bn_after": 1}, r"apply to QAT only"),
        ({"strict": 1}, r"strict=1"),
        ({"refresh": "yes"}, r"refresh='yes'.*Expected True or False"),
        ({"refresh": True, "mode": "qat"}, r"mode='qat', refresh=True.*only mode 'dynamic'"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        QATCallback(**{"mode": "dynamic", **kwargs})


def test_defaults() -> None:
    assert QATCallback(mode="dynamic").backend == "auto"
    assert QATCallback().backend == "x86"


def test_fit_trains_float_then_saves_the_int8_set_and_predict_runs_int8(tmp_path: Path) -> None:
    model = Classifier()
    plain_keys = list(model.state_dict())
    callback = QATCallback(mode="dynamic", dirpath=tmp_path / "out", **QUICK)
    _trainer(tmp_path, [callback]).fit(model)
    assert "torch.nn.modules.linear.Linear" in model.seen["fit"] and not _int8(model.seen["fit"])
    assert not _int8(model.seen["validate" if "validate" in model.seen else "fit"])
    report = json.loads((tmp_path / "out" / "model_int8" / "model_int8.json").read_text())
    assert report["ok"] and report["backend"] == "eager" and report["int8_bytes"] < report["float_bytes"]
    assert report["validation"]["top1_agreement"] >= 0.95
    assert report["validation"]["accuracy_gap_pp"] is not None
    assert callback.report is not None and callback.report.ok

    trained = {k: v.clone() for k, v in model.state_dict().items()}
    net = model.net
    float_out = torch.cat(_trainer(tmp_path, []).predict(model))
    model.seen = {}
    out = torch.cat(_trainer(tmp_path, [callback]).predict(model))
    assert _int8(model.seen["predict"]) and model.seen["predict_training"] == {"False"}
    assert (out.argmax(-1) == float_out.argmax(-1)).float().mean() >= 0.95
    assert not torch.equal(out, float_out)  # it really ran int8
    # The float module is back, with its weights and keys.
    assert model.net is net and list(model.state_dict()) == plain_keys
    assert all(torch.equal(trained[k], v) for k, v in model.state_dict().items())


def test_validate_and_test_run_int8_of_their_own(tmp_path: Path) -> None:
    model = Classifier()
    callback = QATCallback(mode="dynamic", export=False, **QUICK)
    _trainer(tmp_path, [callback]).validate(model)
    _trainer(tmp_path, [callback]).test(model)
    assert _int8(model.seen["validate"]) and _int8(model.seen["test"])
    assert type(model.net[0]) is nn.Linear


def test_exception_during_predict_restores_the_float_module(tmp_path: Path) -> None:
    model = Classifier(fail_predict_at=1)
    net = model.net
    callback = QATCallback(mode="dynamic", export=False, **QUICK)
    with pytest.raises(RuntimeError, match="predict failed"):
        _trainer(tmp_path, [callback]).predict(model)
    assert model.net is net and type(model.net[0]) is nn.Linear
    assert _int8(model.seen["predict"])
    model.fail_predict_at, model.seen = None, {}
    _trainer(tmp_path, [callback]).predict(model)  # a second run behaves as the first
    assert _int8(model.seen["predict"]) and model.net is net
    model.seen = {}
    _trainer(tmp_path, [callback], max_epochs=1).fit(model)  # fit after predict trains the float module
    assert not _int8(model.seen["fit"]) and model.net is net
    assert pickle.loads(pickle.dumps(callback)).mode == "dynamic"


def test_checkpoints_keep_plain_keys_resume_and_fit_twice(tmp_path: Path) -> None:
    model = Classifier()
    callback = QATCallback(mode="dynamic", export=False, **QUICK)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _trainer(tmp_path, [callback, checkpoint], max_epochs=2, enable_checkpointing=True).fit(model)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert set(saved["state_dict"]) == set(Classifier().state_dict())
    Classifier().load_state_dict(saved["state_dict"])  # loads into the plain model, strictly
    resumed = Classifier()
    trainer = _trainer(tmp_path, [QATCallback(mode="dynamic", export=False, **QUICK)], max_epochs=3)
    trainer.fit(resumed, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert trainer.current_epoch == 3 and not _int8(resumed.seen["fit"])
    _trainer(tmp_path, [callback], max_epochs=1).fit(model)  # fit twice with the same callback
    model.seen = {}
    _trainer(tmp_path, [callback]).predict(model, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert _int8(model.seen["predict"]) and type(model.net[0]) is nn.Linear


def test_a_new_run_takes_the_cached_choice_and_refresh_measures_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second predict (a new callback, as in a new process: only the cache file is shared) times nothing;
    `refresh=True` measures again."""
    monkeypatch.setattr(dynamic, "dynamic_candidates", lambda flags=None: (["eager"], {}))
    timed: list[str] = []
    row = LatencyRow(64, "float", "eager", 1e-3, 1e-3, 5e-4, 5e-4, 2.0, 1.0, 1.0, 2, speedup_ci95=[1.9, 2.1],
                     speedup_verdict="faster")  # fmt: skip

    def scripted(*args: Any, name: str, **kwargs: Any) -> list[LatencyRow]:
        timed.append(name)
        return [row]

    monkeypatch.setattr(dynamic, "eager_latency", scripted)
    model, choices = Classifier(), []
    for refresh in (False, False, True):
        callback = QATCallback(mode="dynamic", export=False, refresh=refresh, latency_iterations=2, latency_warmup=0)
        _trainer(tmp_path, [callback]).predict(model)
        choice = getattr(callback._quantizer, "choice", None)  # mode 'dynamic' keeps its last choice
        choices.append((choice is not None and choice.cached, len(timed)))
    assert choices == [(False, 1), (True, 1), (False, 2)]
