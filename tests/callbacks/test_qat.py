"""QATCallback: the open bugs of Lightning 1.x's QuantizationAwareTraining are the test list (resume, test from a
checkpoint, fit twice, loading into a fresh model, keyword arguments to forward, pruning), plus schedules, PTQ,
the end-of-fit artifact, fallbacks and early errors."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchao  # noqa: F401  (the `test` extra installs it: a missing install fails here, not skips)
from lightning.pytorch.callbacks import Callback, ModelPruning
from lightning.pytorch.loggers import Logger
from torch import nn

from lightning_perf import FallbackWarning, NoEffectWarning, _imports
from lightning_perf.callbacks import QATCallback
from lightning_perf.demos import ConvNetModule, make_workload
from lightning_perf.deploy.quantize import save as save_module
from lightning_perf.functional.quantization import qat

QUICK = {"benchmark": False, "validation_batches": 1}


def _trainer(root: Path, callbacks: list[Any], **overrides: Any) -> pl.Trainer:
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 3,
        "limit_val_batches": 2,
        "limit_test_batches": 2,
        "limit_predict_batches": 1,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": root,
        **overrides,
    }
    return pl.Trainer(callbacks=callbacks, **kwargs)


def _convnet(seed: int = 0) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    pl.seed_everything(seed, verbose=False)
    return make_workload("convnet", "tiny", seed=seed)


# ---------------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "fbgemm"}, r"QATCallback\(backend='fbgemm'\)` is not valid. Expected one of 'x86', 'torchao'"),
        ({"base_config": "IntxWeightOnlyConfig"}, r"x86 backend .* takes no base config"),
        ({"backend": "torchao", "base_config": "Int8DynamicActivationInt8WeightConfig"}, r"cannot train"),
        ({"schedule_unit": "batch"}, r"schedule_unit='batch'.*'epoch', 'step'"),
        ({"mode": "ptq", "freeze_bn_after": 1}, r"apply to QAT only"),
        ({"mode": "ptq", "export": False}, r"would do nothing"),
        ({"export": "yes"}, r"export='yes'.*True or False"),
        ({"benchmark": 0}, r"benchmark=0.*True or False"),
        ({"onnx": "false"}, r"onnx='false'.*True or False"),
        ({"strict": None}, r"strict=None.*True or False"),
        ({"dirpath": 7}, r"dirpath=7.*directory path"),
    ],
)
def test_bad_options_fail_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        QATCallback(**kwargs)


def test_torchao_missing_names_the_qat_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_imports, "is_available", lambda module: False)
    with pytest.raises(
        ModuleNotFoundError, match=r"QATCallback\(backend='x86'\) needs `torchao`.*lightning-perf\[qat\]"
    ):
        QATCallback()


def test_base_config_from_yaml_is_kept_as_plain_data() -> None:
    callback = QATCallback(
        "torchao", base_config={"Int8DynamicActivationIntxWeightConfig": {"weight_dtype": "int4"}}, benchmark=False
    )
    assert callback.base_config == {"Int8DynamicActivationIntxWeightConfig": {"weight_dtype": "int4"}}


# ------------------------------------------------------------------------------------------------ bad models


def test_unknown_submodule_is_named(tmp_path: Path) -> None:
    model, data = _convnet()
    with pytest.raises(ValueError, match=r"has no submodule 'backbone'. Its children: net, train_metric"):
        _trainer(tmp_path, [QATCallback(submodule="backbone", **QUICK)]).fit(model, datamodule=data)


def test_two_parameter_holders_need_a_name(tmp_path: Path) -> None:
    model, data = _convnet()
    model.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"children holding parameters: net, extra. Pass `submodule="):
        _trainer(tmp_path, [QATCallback(**QUICK)]).fit(model, datamodule=data)


class _NotExportable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.fc(x.flatten(1))
        return logits if bool(x.mean() > 0) else -logits


def test_model_that_cannot_be_exported_fails_in_setup_with_the_reason(tmp_path: Path) -> None:
    model, data = _convnet()
    model.net = _NotExportable()
    with pytest.raises(qat.QuantizationError, match=r"torch.export could not capture _NotExportable .*data-dependent"):
        _trainer(tmp_path, [QATCallback(**QUICK)]).fit(model, datamodule=data)


def test_nothing_to_quantize_warns_and_trains_unchanged(tmp_path: Path) -> None:
    model, data = make_workload("unet3d", "tiny")  # 3D convolutions: X86InductorQuantizer has nothing to do
    float_net = model.net
    callback = QATCallback(**QUICK)
    with pytest.warns(NoEffectWarning, match="found nothing to quantize in UNet3D"):
        _trainer(tmp_path, [callback]).fit(model, datamodule=data)
    assert model.net is float_net and callback.report is None and callback.state_dict()["recipe"] is None


def test_x86_refuses_model_pruning(tmp_path: Path) -> None:
    model, data = _convnet()
    callbacks = [QATCallback(**QUICK), ModelPruning("l1_unstructured", amount=0.5)]
    with pytest.raises(ValueError, match=r"cannot train with `ModelPruning`"):
        _trainer(tmp_path, callbacks).fit(model, datamodule=data)


# ----------------------------------------------------------------------------------------------------- x86 QAT


def test_fit_prepares_before_optimizers_and_exports_at_the_end(tmp_path: Path) -> None:
    model, data = _convnet()
    float_net = model.net
    callback = QATCallback(**QUICK)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    probe = _Prepared()
    trainer = _trainer(tmp_path, [callback, probe])
    trainer.fit(model, datamodule=data)
    assert probe.seen == {"train": [True]}  # trained prepared
    # The plain float submodule is back, with the QAT-trained weights and batch-norm statistics.
    assert model.net is float_net and not qat.is_prepared(model.net)
    assert list(model.state_dict()) == list(initial)
    assert any(not torch.equal(v, initial[k]) for k, v in model.state_dict().items() if k.endswith("running_mean"))
    assert any(not torch.equal(v, initial[k]) for k, v in model.state_dict().items() if k.endswith("weight"))
    # The optimizer trained the prepared graph's parameters (the float module's own Parameter objects).
    optimizer_params = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimizer_params == {id(p) for p in model.parameters()} == {id(p) for p in float_net.parameters()}
    report = callback.report
    assert report is not None and report.ok, report and report.problems
    assert report.artifact == tmp_path / "quantized" / "model_int8" / "model_int8.pt2"
    data_json = json.loads((tmp_path / "quantized" / "model_int8" / "model_int8.json").read_text())
    assert data_json["recipe"]["input_shapes"] == [[3, 16, 16]]
    assert data_json["validation"]["cosine"] > 0.99 and data_json["metadata"]["submodule"] == "net"
    program = torch.export.load(report.artifact).module()
    assert program(torch.randn(2, 3, 16, 16)).shape == (2, 10)
    assert callback.state_dict()["recipe"]["backend"] == "x86" and callback.quantization_state
    # validate/test/predict with the callback run the prepared (fake-quantized) model and put the plain one back.
    (val,) = trainer.validate(model, datamodule=data, verbose=False)
    (tested,) = trainer.test(model, datamodule=data, verbose=False)
    predictions = trainer.predict(model, datamodule=data)
    assert val["val_loss"] > 0 and tested["test_loss"] > 0 and predictions and predictions[0].shape[-1] == 10
    assert probe.seen == {"train": [True], "validate": [True], "test": [True], "predict": [True]}
    assert model.net is float_net and list(model.state_dict()) == list(initial)


def test_export_false_trains_without_converting(tmp_path: Path) -> None:
    model, data = _convnet()
    callback = QATCallback(export=False)
    _trainer(tmp_path, [callback]).fit(model, datamodule=data)
    assert not qat.is_prepared(model.net) and callback.report is None and callback.quantization_state
    assert not (tmp_path / "quantized").exists()


def test_after_a_fit_a_failure_keeps_its_state_a_clone_prepares_again_and_a_second_fit_goes_on(tmp_path: Path) -> None:
    """One trained callback: a failed second fit gives back the state the fit reached; a second fit starts from it and
    trains it on; a failed validate keeps the state; a pickled clone prepares the float module again from it."""
    model, data = _convnet()
    float_net = model.net
    callback = QATCallback(**QUICK)
    _trainer(tmp_path, [callback]).fit(model, datamodule=data)
    first = callback.quantization_state
    with pytest.raises(RuntimeError, match="failed at step 2"):
        _trainer(tmp_path, [callback, _FailAtStep(RuntimeError, step=2)], max_steps=5).fit(model, datamodule=data)
    assert not qat.is_prepared(model.net)
    after = callback.quantization_state
    assert after.keys() == first.keys()
    for key, value in first.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, msg=key)

    class AtStart(Callback):
        state: dict[str, torch.Tensor] = {}

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            AtStart.state = {k: v.clone() for k, v in pl_module.net.state_dict().items()}

    trainer = _trainer(tmp_path, [callback, AtStart()])
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 3 and callback.report is not None and callback.report.ok
    # The second fit started from the observers' ranges the first one reached (not from fresh observers)...
    for key, value in first.items():
        torch.testing.assert_close(AtStart.state[key], value, rtol=0, atol=0, msg=key)
    # ...trained them on, and left the plain model again.
    assert any(not torch.equal(v, first[k]) for k, v in callback.quantization_state.items())
    assert model.net is float_net and not qat.is_prepared(model.net)

    class FailInValidation(Callback):
        def on_validation_batch_start(self, *args: Any) -> None:
            raise RuntimeError("failed in validation")

    trained = callback.quantization_state
    with pytest.raises(RuntimeError, match="failed in validation"):
        _trainer(tmp_path, [callback, FailInValidation()]).validate(model, datamodule=data, verbose=False)
    assert model.net is float_net and not qat.is_prepared(model.net)
    assert callback.quantization_state.keys() == trained.keys() and callback.recipe is not None

    clone = pickle.loads(pickle.dumps(callback))  # without the prepared graph: it does not pickle
    x = torch.randn(4, 3, 16, 16)
    model.eval()
    with callback.prepared(model) as kept:
        expected = kept(x)
    assert not qat.is_prepared(model.net)
    with clone.prepared(model) as again:
        assert isinstance(again, qat.PreparedGraphModule) and again is not kept
        torch.testing.assert_close(again(x), expected, rtol=0, atol=0)
    assert not qat.is_prepared(model.net)
    no_state = r"prepared\(\)` has no quantization-aware training"
    with pytest.raises(ValueError, match=no_state), QATCallback().prepared(model):
        pass


Trained = tuple[pl.LightningModule, Path, QATCallback]  # the model, its checkpoint, the callback


@pytest.fixture(scope="module")
def qat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """One QAT fit and its checkpoint, shared by the tests that only read them (each fit prepares, converts and
    exports: seconds)."""
    tmp_path = tmp_path_factory.mktemp("qat")
    model, data = _convnet()
    callback = QATCallback(**QUICK)
    trainer = _trainer(tmp_path / "run", [callback])
    trainer.fit(model, datamodule=data)
    path = tmp_path / "qat.ckpt"
    trainer.save_checkpoint(path)
    return model, path, callback


def test_checkpoint_has_plain_keys_and_the_quantization_state_in_the_callback_entry(qat_checkpoint: Trained) -> None:
    model, path, callback = qat_checkpoint
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    plain, _ = _convnet()
    assert set(checkpoint["state_dict"]) == set(plain.state_dict()) == set(model.state_dict())
    entry = checkpoint["callbacks"][callback.state_key]
    assert entry["recipe"] == callback.state_dict()["recipe"]
    expected = {f"net.{k}" for k in callback.quantization_state}
    assert set(entry["quantization_state"]) == expected and expected


def test_resume_reprepares_before_the_weights_load(qat_checkpoint: Trained, tmp_path: Path) -> None:
    model, path, trained = qat_checkpoint
    fresh, data = _convnet(seed=1)
    callback = QATCallback(**QUICK)
    # max_steps equal to the checkpoint's: the run restores everything and stops, so the state is the checkpoint's.
    _trainer(tmp_path / "resumed", [callback]).fit(fresh, datamodule=data, ckpt_path=path)
    assert not qat.is_prepared(fresh.net)
    expected = model.state_dict()
    assert list(fresh.state_dict()) == list(expected)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
    assert callback.recipe == trained.recipe
    state, expected_state = callback.quantization_state, trained.quantization_state
    assert state.keys() == expected_state.keys() and state
    for key, value in state.items():
        torch.testing.assert_close(value, expected_state[key], rtol=0, atol=0, msg=key)


def test_test_with_ckpt_path_on_a_fresh_model(qat_checkpoint: Trained, tmp_path: Path) -> None:
    model, path, callback = qat_checkpoint
    _, data = _convnet()
    (trained,) = _trainer(tmp_path / "a", [callback]).test(model, datamodule=data, verbose=False)
    fresh, _ = _convnet(seed=3)
    probe = _Prepared()
    (restored,) = _trainer(tmp_path / "b", [QATCallback(**QUICK), probe]).test(
        fresh, datamodule=data, ckpt_path=path, verbose=False
    )
    assert probe.seen == {"test": [True]} and not qat.is_prepared(fresh.net)
    assert restored == pytest.approx(trained, abs=1e-6)


def test_checkpoint_recipe_wins_over_the_callback_settings(tmp_path: Path) -> None:
    """A checkpoint from the torchao backend, tested with a default (x86) callback: prepared as the checkpoint says."""
    model, data = make_workload("lm", "tiny")
    trainer = _trainer(tmp_path / "run", [QATCallback("torchao", **QUICK)])
    trainer.fit(model, datamodule=data)
    trainer.save_checkpoint(tmp_path / "lm.ckpt")
    fresh, _ = make_workload("lm", "tiny", seed=5)
    keys = list(fresh.state_dict())
    callback = QATCallback(**QUICK)
    _trainer(tmp_path / "t", [callback]).test(fresh, datamodule=data, ckpt_path=tmp_path / "lm.ckpt")
    assert callback.recipe is not None and callback.recipe.backend == "torchao"
    assert list(fresh.state_dict()) == keys and not any(qat.is_prepared(m) for m in fresh.modules())


def test_load_checkpoint_into_a_fresh_model(qat_checkpoint: Trained) -> None:
    model, path, callback = qat_checkpoint
    fresh, _ = _convnet(seed=7)
    recipe = QATCallback.load_checkpoint(fresh, path)
    assert recipe == callback.recipe and qat.is_prepared(fresh.net)
    x = torch.randn(5, 3, 16, 16)
    model.eval()
    fresh.eval()
    with callback.prepared(model):
        torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_checkpoint_without_the_callback_state_loads_into_a_prepared_model(tmp_path: Path) -> None:
    """A float checkpoint (or a weights-only one) fine-tuned with QAT: the observers start from where they are."""
    model, data = _convnet()
    trainer = _trainer(tmp_path, [], max_steps=2)
    trainer.fit(model, datamodule=data)
    trainer.save_checkpoint(tmp_path / "float.ckpt")
    fresh, _ = _convnet(seed=1)
    resumed = _trainer(tmp_path, [QATCallback(**QUICK)], max_steps=3)
    resumed.fit(fresh, datamodule=data, ckpt_path=tmp_path / "float.ckpt")
    assert resumed.global_step == 3 and not qat.is_prepared(fresh.net)


class _KeywordForward(ConvNetModule):
    """`forward` takes a keyword argument: Lightning 1.x's callback replaced forward and dropped it."""

    def forward(self, x: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
        return self.net(x) / temperature

    def compute(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs, target = batch
        logits = self(inputs, temperature=2.0)
        return nn.functional.cross_entropy(logits, target), logits.detach(), target


def test_forward_keyword_arguments_still_reach_the_model(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    model = _KeywordForward("tiny")
    _, data = _convnet()
    _trainer(tmp_path, [QATCallback(**QUICK)]).fit(model, datamodule=data)
    x = torch.randn(2, 3, 16, 16)
    model.eval()
    torch.testing.assert_close(model(x, temperature=4.0) * 2, model(x, temperature=2.0))


class _Flattening(ConvNetModule):
    """The LightningModule reshapes its input before the submodule, and has no `example_input_array`."""

    def __init__(self) -> None:
        super().__init__("tiny")
        self.net = nn.Sequential(nn.Linear(3 * 16 * 16, 64), nn.ReLU(), nn.Linear(64, 10))
        self.example_input_array = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


def test_example_input_is_what_the_submodule_receives_from_the_first_batch(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    model = _Flattening()
    _, data = _convnet()
    callback = QATCallback(**QUICK)
    _trainer(tmp_path, [callback]).fit(model, datamodule=data)
    assert callback.recipe is not None and callback.recipe.input_shapes == ((3 * 16 * 16,),)


class _Prepared(Callback):
    """Records, per loop, whether the model's ``net`` was prepared when the loop started."""

    def __init__(self) -> None:
        self.seen: dict[str, list[bool]] = {}

    def _record(self, loop: str, pl_module: pl.LightningModule) -> None:
        self.seen.setdefault(loop, []).append(qat.is_prepared(pl_module.net))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record("train", pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._record("validate", pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record("test", pl_module)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record("predict", pl_module)


class _Probe(Callback):
    """Records, after every training forward, what the step ran with: observers, batch-norm training, fake quant.

    After each validation Lightning puts the modules back in training mode by assigning ``module.training``
    directly: the graph must follow that too, or training would go on with inference batch norm.
    """

    def __init__(self) -> None:
        self.seen: list[tuple[int, bool, bool, bool]] = []

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        state = pl_module.net.state_dict()
        observers = all(int(v) == 1 for k, v in state.items() if k.endswith("observer_enabled"))
        fake_quant = all(int(v) == 1 for k, v in state.items() if k.endswith("fake_quant_enabled"))
        bn_training = [n.args[5] for n in pl_module.net.graph.nodes if n.target is torch.ops.aten.batch_norm.default]
        self.seen.append((trainer.global_step, observers, all(bn_training), fake_quant))


def test_step_schedules(tmp_path: Path) -> None:
    model, data = _convnet()
    probe = _Probe()
    callback = QATCallback(
        disable_observers_after=3, freeze_bn_after=2, fake_quant_after=1, schedule_unit="step", **QUICK
    )
    _trainer(tmp_path, [callback, probe], max_steps=4).fit(model, datamodule=data)
    assert probe.seen == [
        (0, True, True, False),
        (1, True, True, True),
        (2, True, False, True),
        (3, False, False, True),
    ]


def test_epoch_schedules_and_periodic_converted_checks(tmp_path: Path) -> None:
    class Metrics(Logger):
        name, version = "memory", "0"
        logged: list[dict[str, float]] = []

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.logged.append(metrics)

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

    model, data = _convnet()
    probe = _Probe()
    callback = QATCallback(disable_observers_after=1, eval_converted_every_n_epochs=1, **QUICK)
    trainer = _trainer(tmp_path, [callback, probe], max_steps=-1, max_epochs=2, limit_train_batches=2, logger=Metrics())
    trainer.fit(model, datamodule=data)
    assert [s[1] for s in probe.seen] == [True, True, False, False]
    assert all(s[2] for s in probe.seen)  # batch norm trains in epoch 2 too, after the first validation
    assert [h["epoch"] for h in callback.history] == [0, 1]
    assert all(h["cosine"] > 0.99 and h["accuracy_gap_pp"] is not None for h in callback.history)
    logged = [m for m in Metrics.logged if "qat/accuracy_gap_pp" in m]
    assert len(logged) == 2 and "qat/int8_top1_agreement" in logged[0]


def test_eval_does_not_move_the_quantization_ranges(tmp_path: Path) -> None:
    model, data = _convnet()
    callback = QATCallback(**QUICK)
    _trainer(tmp_path, [callback]).fit(model, datamodule=data)
    ranges = ("min_val", "max_val", "scale", "zero_point")
    before = {k: v for k, v in callback.quantization_state.items() if k.endswith(ranges)}
    assert before
    probe = _Prepared()
    _trainer(tmp_path, [callback, probe]).validate(model, datamodule=data, verbose=False)
    assert probe.seen == {"validate": [True]}
    after = callback.quantization_state
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, msg=key)


# ------------------------------------------------------------------------------------- failures at the end


def test_failure_at_the_end_warns_and_leaves_model_and_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("export exploded")

    class Snapshot(Callback):
        """Reads the checkpoint files when fit ends, before QATCallback's end-of-fit work (it comes first)."""

        files: dict[Path, bytes] = {}

        def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            Snapshot.files = {path: path.read_bytes() for path in tmp_path.rglob("*.ckpt")}

    monkeypatch.setattr(save_module, "export_quantized", broken)
    model, data = _convnet()
    trainer = _trainer(tmp_path, [Snapshot(), QATCallback(**QUICK)], enable_checkpointing=True)
    with pytest.warns(FallbackWarning, match="export exploded.*unchanged"):
        trainer.fit(model, datamodule=data)
    assert Snapshot.files and {p: p.read_bytes() for p in tmp_path.rglob("*.ckpt")} == Snapshot.files
    assert not qat.is_prepared(model.net)
    first = next(iter(Snapshot.files))
    assert set(torch.load(first, weights_only=True)["state_dict"]) == set(_convnet()[0].state_dict())
    model2, data2 = _convnet()
    with pytest.raises(qat.QuantizationError, match="export exploded"):
        _trainer(tmp_path / "strict", [QATCallback(strict=True, **QUICK)]).fit(model2, datamodule=data2)


# --------------------------------------------------------------------------------------------- torchao backend


def test_torchao_backend_on_the_language_model(tmp_path: Path) -> None:
    model, data = make_workload("lm", "tiny")
    keys = set(model.state_dict())
    callback = QATCallback("torchao", **QUICK)
    trainer = _trainer(tmp_path, [callback])
    trainer.fit(model, datamodule=data)
    assert set(model.state_dict()) == keys
    assert callback.report is not None and callback.report.ok, callback.report.problems
    assert callback.report.validation.cosine > 0.99
    program = torch.export.load(callback.report.artifact).module()
    assert program(torch.zeros(2, 32, dtype=torch.long)).shape[:2] == (2, 32)


def test_torchao_backend_with_pruning(tmp_path: Path) -> None:
    model, data = make_workload("lm", "tiny")
    pruning = ModelPruning("l1_unstructured", amount=0.5, parameter_names=["weight"], verbose=0)
    callback = QATCallback("torchao", **QUICK)

    class Layer(Callback):
        seen: list[str] = []

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            Layer.seen.append(type(pl_module.net.blocks[0].mlp[0]).__name__)

    _trainer(tmp_path, [callback, pruning, Layer()], max_steps=-1, max_epochs=1, limit_train_batches=2).fit(
        model, datamodule=data
    )
    assert Layer.seen == ["FakeQuantizedLinear"] and type(model.net.blocks[0].mlp[0]) is nn.Linear
    # Global L1 pruning of every `weight` (amount 0.5), applied to the fake-quantized layers and made permanent.
    weights = [m.weight for m in model.net.modules() if isinstance(getattr(m, "weight", None), nn.Parameter)]
    zeros = sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)
    assert zeros == pytest.approx(0.5, abs=0.01)
    assert all(not hasattr(m, "weight_orig") for m in model.net.modules())
    assert callback.report is not None and callback.report.ok


def test_torchao_pruner_first_is_refused(tmp_path: Path) -> None:
    model, data = make_workload("lm", "tiny")
    callbacks = [ModelPruning("l1_unstructured", amount=0.5), QATCallback("torchao", **QUICK)]
    with pytest.raises(ValueError, match="Put `QATCallback` before `ModelPruning`"):
        _trainer(tmp_path, callbacks).fit(model, datamodule=data)


def test_torchao_observer_schedule_has_no_effect(tmp_path: Path) -> None:
    model, data = make_workload("lm", "tiny")
    with pytest.warns(NoEffectWarning, match="no observers"):
        _trainer(tmp_path, [QATCallback("torchao", disable_observers_after=1, **QUICK)], max_steps=1).fit(
            model, datamodule=data
        )


# ----------------------------------------------------------------------------------------------------------- PTQ


def test_ptq_after_fit_leaves_training_alone(tmp_path: Path) -> None:
    model, data = _convnet()
    float_net = model.net
    callback = QATCallback(mode="ptq", calibration_batches=1, **QUICK)
    _trainer(tmp_path, [callback]).fit(model, datamodule=data)
    assert model.net is float_net and not qat.is_prepared(model.net)
    report = callback.report
    assert report is not None and report.ok, report.problems
    assert report.recipe.mode == "ptq" and report.metadata["calibration_samples"] == 32
    assert report.validation.batches == 1


def test_ptq_through_validate(tmp_path: Path) -> None:
    model, data = _convnet()
    callback = QATCallback(mode="ptq", calibration_batches=1, filename="ptq", **QUICK)
    _trainer(tmp_path, [callback]).validate(model, datamodule=data, verbose=False)
    assert callback.report is not None and callback.report.ok
    assert (tmp_path / "quantized" / "ptq" / "ptq.pt2").is_file()


# --------------------------------------------------------------------------------------------------------- timing


@pytest.mark.slow
def test_end_of_fit_benchmark_times_both_compiled_models(tmp_path: Path) -> None:
    model, data = _convnet()
    callback = QATCallback(benchmark_batch_sizes=(1, 4), latency_iterations=2, latency_warmup=1, validation_batches=1)
    _trainer(tmp_path, [callback]).fit(model, datamodule=data)
    rows = callback.report.latency
    assert [r.batch_size for r in rows] == [1, 4]
    assert all(r.float_median_s > 0 and r.quantized_median_s > 0 for r in rows)
    saved = json.loads(callback.report.report_path.read_text())
    assert [row["batch_size"] for row in saved["latency"]] == [1, 4]
    for row in saved["latency"]:
        low, high = row["speedup_ci95"]
        assert low <= row["speedup"] <= high and row["speedup_verdict"] in ("faster", "slower", "no clear difference")


# ------------------------------------------------------------------------------------------- trust: any exit, files


class _FailAtStep(Callback):
    def __init__(self, error: type[BaseException], step: int = 3) -> None:
        self.error, self.step = error, step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == self.step - 1:
            raise self.error(f"failed at step {self.step}")


def _plain_facts(model: nn.Module) -> dict[str, Any]:
    return {
        "types": {name: type(m) for name, m in model.named_modules()},
        "forwards": {name: "forward" in vars(m) for name, m in model.named_modules()},
        "hooks": {
            name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for name, m in model.named_modules()
        },
        "parameters": {name: id(p) for name, p in model.named_parameters()},
        "keys": list(model.state_dict()),
        "instance_attrs": sorted(k for k in vars(model) if k in ("on_load_checkpoint", "configure_model")),
    }


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_fit_puts_the_plain_model_back(tmp_path: Path, error: type[BaseException]) -> None:
    import signal

    model, data = _convnet()
    before = _plain_facts(model)
    float_net = model.net
    callback = QATCallback(**QUICK)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises((RuntimeError, SystemExit)):  # Lightning turns a KeyboardInterrupt into exit status 1
            _trainer(tmp_path, [callback, _FailAtStep(error)], max_steps=5).fit(model, datamodule=data)
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores Ctrl-C after an interrupt; give it back
    assert model.net is float_net and not qat.is_prepared(model.net)
    assert _plain_facts(model) == before
    x = torch.randn(2, 3, 16, 16)
    model.eval()
    torch.testing.assert_close(model(x), float_net(x), rtol=0, atol=0)
    model.train()  # as before the first fit (Lightning keeps modules that are in eval mode at fit start so)
    # A second fit behaves as the first: prepared again, trained, exported.
    again = QATCallback(**QUICK)
    trainer = _trainer(tmp_path / "again", [again])
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 3 and again.report is not None and again.report.ok
    assert model.net is float_net and _plain_facts(model) == before


def test_a_failed_torchao_fit_swaps_the_linear_layers_back(tmp_path: Path) -> None:
    model, data = make_workload("lm", "tiny")
    before = _plain_facts(model)
    with pytest.raises(RuntimeError, match="failed at step 3"):
        _trainer(tmp_path, [QATCallback(backend="torchao", **QUICK), _FailAtStep(RuntimeError)], max_steps=5).fit(
            model, datamodule=data
        )
    after = _plain_facts(model)
    assert after["types"] == before["types"] and after["keys"] == before["keys"]
    assert after["hooks"] == before["hooks"] and after["forwards"] == before["forwards"]
    assert set(after["parameters"]) == set(before["parameters"])
    assert not any(qat.is_prepared(m) for m in model.modules())


class _Payload:
    """Unpickling it would create ``marker``: what a crafted checkpoint does to run code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_load_checkpoint_never_unpickles_a_crafted_file(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    crafted = tmp_path / "crafted.ckpt"
    fresh, _ = _convnet()
    torch.save({"state_dict": fresh.state_dict(), "callbacks": {}, "hyper_parameters": _Payload(str(marker))}, crafted)
    with pytest.raises(pickle.UnpicklingError, match=r"holds builtins.open|io.open") as info:
        QATCallback.load_checkpoint(fresh, crafted)
    assert "torch.serialization.add_safe_globals([open])" in str(info.value)
    assert not marker.exists()
