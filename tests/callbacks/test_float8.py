"""Float8TrainingCallback: every gate's message, conversion during fit, undo at teardown and on exception.

This machine has no float8 GPU: the conversion tests lift the hardware gate (the callback then emulates the float8
products off CUDA, which runs the same torchao layers in high precision) and script the shape timings.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_perf import LightningPerfWarning, NoEffectWarning
from lightning_perf.callbacks import CompileCallback, Float8TrainingCallback
from lightning_perf.callbacks import float8 as float8_callback
from lightning_perf.callbacks.compile import runs_compiled
from lightning_perf.demos import make_workload
from lightning_perf.functional.quantization.float8 import LinearShape, is_sm_at_least_89
from tests._models import trainer
from tests.callbacks._interrupt import LossRecorder, RaiseAt, plain_model_signature

pytest.importorskip("torchao")

pytestmark = pytest.mark.filterwarnings("ignore:.*is an Enum subclass:UserWarning")  # torchao's import on torch 2.13

ONE_STEP: dict[str, Any] = {"max_steps": 1, "limit_val_batches": 0}
MLP_UP = ["net.blocks.0.mlp.0", "net.blocks.1.mlp.0"]  # the tiny lm's 32 -> 128 layers


class Probe(Callback):
    """Records, at the start and the end of training, the model's layer types and its state_dict (keys, dtypes)."""

    def __init__(self) -> None:
        self.types: dict[str, str] = {}
        self.state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.types = {n: type(m).__name__ for n, m in pl_module.named_modules() if isinstance(m, nn.Linear)}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def _lm() -> tuple[pl.LightningModule, pl.LightningDataModule]:
    torch.manual_seed(0)
    return make_workload("lm", "tiny", seed=0)


def _float8_layers(probe: Probe) -> list[str]:
    return [name for name, kind in probe.types.items() if kind == "Float8Linear"]


@pytest.fixture
def gate_lifted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the device has float8 tensor cores (the products are then emulated on the CPU)."""
    monkeypatch.setattr(float8_callback, "float8_unsupported_reason", lambda device: None)


# ------------------------------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"recipe": "int8"}, ValueError, "recipe='int8'"),
        ({"filter": "fast"}, ValueError, "filter='fast'"),
        ({"filter": 3}, ValueError, "filter=3"),
        ({"skip_last": "yes"}, TypeError, "skip_last='yes'"),
        ({"refresh": 1}, TypeError, "refresh=1"),
        ({"rows": 8}, ValueError, "rows=8"),
    ],
)
def test_arguments_are_checked(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Float8TrainingCallback(**kwargs)


def test_torchao_missing_names_the_qat_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_perf._imports as imports

    monkeypatch.setattr(imports, "is_available", lambda module: module != "torchao")
    with pytest.raises(ModuleNotFoundError, match=r"lightning-perf\[qat\]"):
        Float8TrainingCallback()


# ------------------------------------------------------------------------------------------------------- gates


def test_without_a_float8_gpu_it_warns_and_changes_nothing(tmp_path: Path) -> None:
    model, data = _lm()
    probe = Probe()
    with pytest.warns(NoEffectWarning, match=r"compute capability 8\.9"):
        trainer(tmp_path, precision="bf16-mixed", callbacks=[Float8TrainingCallback(), probe], **ONE_STEP).fit(
            model, data
        )
    assert _float8_layers(probe) == [] and probe.types


@pytest.mark.usefixtures("gate_lifted")
def test_a_precision_other_than_bf16_is_refused_with_what_float8_needs(tmp_path: Path) -> None:
    model, data = _lm()
    probe = Probe()
    with pytest.warns(NoEffectWarning, match=r"precision='32-true'.*bf16-mixed"):
        trainer(tmp_path, callbacks=[Float8TrainingCallback(filter="all"), probe], **ONE_STEP).fit(model, data)
    assert _float8_layers(probe) == []


@pytest.mark.usefixtures("gate_lifted")
def test_layers_already_sharded_are_refused_naming_the_strategy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(float8_callback, "sharded_linears", lambda model: ["net.blocks.0.attn.qkv"])
    model, data = _lm()
    probe = Probe()
    with pytest.warns(NoEffectWarning, match=r"SingleDeviceStrategy.*already sharded.*before `fully_shard`"):
        trainer(
            tmp_path, precision="bf16-mixed", callbacks=[Float8TrainingCallback(filter="all"), probe], **ONE_STEP
        ).fit(model, data)
    assert _float8_layers(probe) == []


def test_validate_test_and_predict_are_left_alone(tmp_path: Path) -> None:
    model, data = _lm()
    callback = Float8TrainingCallback()
    trainer(tmp_path, precision="bf16-mixed", callbacks=[callback], limit_val_batches=1).validate(model, data)
    assert callback.plan is None and callback.converted == []


def test_compile_is_found_as_a_callback_or_a_compiled_module(tmp_path: Path) -> None:
    model, _ = _lm()
    assert not runs_compiled(trainer(tmp_path), model)
    assert runs_compiled(trainer(tmp_path, callbacks=[CompileCallback()]), model)
    model.net.blocks[0].compile()
    assert runs_compiled(trainer(tmp_path), model)


# ------------------------------------------------------------------------------------------- conversion and undo


@pytest.mark.usefixtures("gate_lifted")
def test_fit_trains_in_float8_and_ends_with_the_plain_model(tmp_path: Path) -> None:
    model, data = _lm()
    plain = plain_model_signature(model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    probe = Probe()
    callback = Float8TrainingCallback(filter="all")
    with pytest.warns(LightningPerfWarning, match="slow without torch.compile"):
        trainer(tmp_path, precision="bf16-mixed", callbacks=[callback, probe], **ONE_STEP).fit(model, data)
    # During training: every eligible layer but the output head in float8.
    assert sorted(_float8_layers(probe)) == sorted(n for n in probe.types if n != "net.head")
    assert callback.plan is not None and callback.plan.decisions["net.head"].reason == "the output layer (skip_last)"
    # A checkpoint taken while converted has the plain model's keys and dtypes, and loads into the plain model.
    assert {k: v.dtype for k, v in probe.state.items()} == {k: v.dtype for k, v in initial.items()}
    fresh, _ = _lm()
    fresh.load_state_dict(probe.state)
    # Afterwards: the plain model (same modules, Parameters, keys), holding the trained weights.
    assert plain_model_signature(model) == plain and callback.converted == []
    assert not torch.equal(model.state_dict()["net.blocks.0.mlp.0.weight"], initial["net.blocks.0.mlp.0.weight"])
    torch.testing.assert_close(model.state_dict(), probe.state)


@pytest.mark.usefixtures("gate_lifted")
@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_failed_or_interrupted_fit_ends_with_the_plain_model(tmp_path: Path, error: BaseException) -> None:
    import signal

    model, data = _lm()
    plain = plain_model_signature(model)
    callback = Float8TrainingCallback(filter="all")
    expected = SystemExit if isinstance(error, KeyboardInterrupt) else RuntimeError
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(expected), pytest.warns(LightningPerfWarning, match="torch.compile"):
            trainer(tmp_path, precision="bf16-mixed", callbacks=[callback, RaiseAt(error, 1)], limit_val_batches=0).fit(
                model, data
            )
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT after a KeyboardInterrupt
    assert plain_model_signature(model) == plain and callback.converted == []


@pytest.mark.usefixtures("gate_lifted")
def test_auto_times_each_shape_at_the_batch_rows_keeps_winners_and_reuses_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    timed: list[LinearShape] = []

    def scripted(shape: LinearShape, **kwargs: Any) -> tuple[list[list[float]], list[list[float]]]:
        timed.append(shape)
        factor = 0.6 if (shape.in_features, shape.out_features) == (32, 128) else 1.3  # only the MLP's up wins
        return [[1.0, 1.02]] * 6, [[factor * (1 + 0.001 * i), factor * 1.02] for i in range(6)]

    monkeypatch.setattr(float8_callback, "time_linear_shape", scripted)
    callback = Float8TrainingCallback(filter="auto")
    probe = Probe()
    model, data = _lm()
    with caplog.at_level(logging.INFO), pytest.warns(LightningPerfWarning, match="torch.compile"):
        trainer(tmp_path, precision="bf16-mixed", callbacks=[callback, probe], **ONE_STEP).fit(model, data)
    # Rows from the first training batch (32 sequences x 32 tokens), each distinct shape timed once.
    assert sorted((s.in_features, s.out_features) for s in timed) == [(32, 32), (32, 96), (32, 128), (128, 32)]
    assert {s.rows for s in timed} == {32 * 32}
    assert sorted(_float8_layers(probe)) == MLP_UP
    assert "1024x32x128+bias: 1.6" in caplog.text and "-> float8" in caplog.text and "-> bf16" in caplog.text

    timed.clear()
    caplog.clear()
    model, data = _lm()
    with caplog.at_level(logging.INFO):  # the compile warning was given once already
        trainer(tmp_path, precision="bf16-mixed", callbacks=[callback, probe], **ONE_STEP).fit(model, data)
    assert timed == [] and sorted(_float8_layers(probe)) == MLP_UP  # from the cache; each shape was logged once
    assert "Per shape" not in caplog.text


@pytest.mark.usefixtures("gate_lifted")
def test_no_layer_chosen_warns_with_the_reasons(tmp_path: Path) -> None:
    model, data = _lm()
    with pytest.warns(NoEffectWarning, match="converted no layer.*left out by filter_fn"):
        trainer(tmp_path, precision="bf16-mixed", callbacks=[Float8TrainingCallback(filter=_never)], **ONE_STEP).fit(
            model, data
        )


def _never(module: nn.Module, fqn: str) -> bool:
    return False


# ----------------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::lightning_perf.NoEffectWarning")
def test_float8_fit_on_the_gpu_tracks_bf16(tmp_path: Path) -> None:
    """A small transformer, 300 steps, bf16-mixed + compile with and without float8: the losses stay close."""
    if not is_sm_at_least_89("cuda"):
        pytest.skip("float8 needs a GPU of compute capability 8.9+")

    def losses(callbacks: list[Callback]) -> list[float]:
        torch.manual_seed(0)
        model, data = make_workload("lm", "default", seed=0, dim=256, depth=4)
        recorder = LossRecorder()
        kwargs = {"accelerator": "cuda", "precision": "bf16-mixed", "max_steps": 300, "limit_val_batches": 0}
        trainer(tmp_path, callbacks=[*callbacks, CompileCallback(), recorder], **kwargs).fit(model, data)
        return recorder.losses

    callback = Float8TrainingCallback(filter="all")
    bf16, fp8 = losses([]), losses([callback])
    assert callback.plan is not None and callback.plan.names
    tail_bf16, tail_fp8 = sum(bf16[-30:]) / 30, sum(fp8[-30:]) / 30
    assert abs(tail_fp8 - tail_bf16) <= 0.05 * tail_bf16, (tail_bf16, tail_fp8)
