"""Registry-wide trust tests (issue 16): a callback never changes what training computes, and undoes every change on
any exit.

Driven by ``tests/callback_settings.py``: a new entry is covered automatically, compared in the terms its
``numerics`` field declares.

- Training unchanged: models with dropout and batch norm (``tests/_models.py``) train 3 steps and validate once,
  with and without the callback, from the same seed; per-step losses, gradients (at ``on_before_optimizer_step``)
  and the final ``state_dict`` are compared; during ``training_step`` every module that trains in the plain run
  trains in the optimized run (by name), and during validation every module is in eval mode.
- Undo on every exit: a ``RuntimeError`` or ``KeyboardInterrupt`` at step 3 of fit (and a ``RuntimeError`` inside
  validate and predict) leaves the plain model: module types, no instance-level ``forward`` or batch hooks, the same
  module hooks, the same parameters (names, shapes, dtypes, strides: ``ChannelsLastCallback`` restores the weights'
  layout too), the same ``state_dict`` keys, the optimizers' ``fused``/``foreach`` flags as ``configure_optimizers``
  set them, the process-global backend flags; and a second fit with the same callback instance gives the first
  fit's losses.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn import functional as F

from lightning_perf.functional.backend_flags import capture
from tests import _device
from tests._models import BranchesOnTraining, ConvBNDropout, EncoderWithDropout, FusedQKVTransformer
from tests.callback_settings import CLOSE, LOSSY_BAND, SETTINGS, Setting, params
from tests.callbacks._interrupt import _HOOK_DICTS

pytestmark = pytest.mark.filterwarnings("ignore::lightning_perf.NoEffectWarning")

SEQ, DIM, SAMPLES, BATCH = 8, 32, 32, 8  # dim 32: torchao's QAT groups 32 input features
MODELS: dict[str, Callable[[], nn.Module]] = {
    "conv_bn_dropout": ConvBNDropout,
    "fused_qkv_attention": lambda: FusedQKVTransformer(dim=DIM, seq=SEQ),
    "encoder_mha_dropout": lambda: EncoderWithDropout(dim=DIM),
    "branches_on_training": lambda: BranchesOnTraining(dim=DIM),
}
# The model each entry's undo test runs on: the kind its reference workload has (convolutions or attention).
UNDO_MODEL = {"convnet": "conv_bn_dropout", "unet3d": "conv_bn_dropout", "vit": "fused_qkv_attention"}
UNDO_MODEL["lm"] = "fused_qkv_attention"


class TrustModule(pl.LightningModule):
    """Any network on deterministic data (no shuffling), recording its modules' training flags at every step.

    Images ``(B, 3, 8, 8)`` with a class each for the conv net, sequences ``(B, T, dim)`` with a class per token
    otherwise: every batch also carries an integer tensor that transforms must leave alone.
    """

    def __init__(self, model: str) -> None:
        super().__init__()
        self.net = MODELS[model]()
        g = torch.Generator().manual_seed(1)
        if model == "conv_bn_dropout":
            x, y = torch.randn(SAMPLES, 3, 8, 8, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g)
        else:
            x, y = torch.randn(SAMPLES, SEQ, DIM, generator=g), torch.randint(0, DIM, (SAMPLES, SEQ), generator=g)
        self.data = torch.utils.data.TensorDataset(x, y)
        self.example_input_array = x[:BATCH]
        self.train_flags: list[dict[str, bool]] = []
        self.val_flags: list[dict[str, bool]] = []
        self.built: list[tuple[torch.optim.Optimizer, list[dict[str, Any]]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = self(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.train_flags.append({name: m.training for name, m in self.named_modules()})
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.val_flags.append({name: m.training for name, m in self.named_modules()})
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # SGD with momentum, not Adam: Adam turns the rounding noise of a zero gradient (an attention key's bias)
        # into full-size steps, so a reordered sum changes weights by the learning rate, whatever the callback.
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        self.built.append((optimizer, _optimizer_flags(optimizer)))
        return optimizer

    def _loader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=BATCH)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader


def _optimizer_flags(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    keys = ("fused", "foreach")
    return [{k: g.get(k) for k in keys} for g in (*optimizer.param_groups, optimizer.defaults)]


class Capture(Callback):
    """Per-step losses and gradients, keyed by the plain model's parameter names (found by identity)."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = {}
        for index, p in enumerate(p for group in optimizer.param_groups for p in group["params"]):
            if p.grad is not None:
                grads[self.names.get(id(p), f"<not a parameter of the plain model: #{index}>")] = (
                    p.grad.detach().clone()
                )
        self.grads.append(grads)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


class Raise(Callback):
    """Raises ``exception`` when the loop ``where`` reaches ``batch_idx``."""

    def __init__(self, exception: type[BaseException], where: str, batch_idx: int) -> None:
        self.exception, self.where, self.batch_idx = exception, where, batch_idx

    def _maybe(self, where: str, batch_idx: int) -> None:
        if where == self.where and batch_idx == self.batch_idx:
            raise self.exception(f"raised by the test at {where} batch {batch_idx}")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._maybe("fit", batch_idx)

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, *a: Any) -> None:
        self._maybe("validate", batch_idx)

    def on_predict_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, *a: Any) -> None:
        self._maybe("predict", batch_idx)


def _trainer(setting: Setting, root: Path, instance: Any, extra: list[Callback], **overrides: Any) -> pl.Trainer:
    kwargs: dict[str, Any] = {
        "accelerator": _device.accelerator(),  # pytest --device cuda (tests/_device.py)
        "devices": 1,
        "max_epochs": 1,
        "limit_train_batches": 3,
        "limit_val_batches": 1,
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
    callbacks = list(extra)
    if instance is not None and setting.is_strategy:
        kwargs["strategy"] = instance
    elif instance is not None:
        callbacks.insert(0, instance)  # the callback under test first, the test's own callbacks after it
    return pl.Trainer(callbacks=callbacks, **kwargs)


def _model(name: str) -> TrustModule:
    pl.seed_everything(0, verbose=False)
    return TrustModule(name)


def _fit(setting: Setting, model_name: str, root: Path, instance: Any) -> tuple[TrustModule, Capture]:
    model = _model(model_name)
    capture_cb = Capture({id(p): n for n, p in model.named_parameters()})
    pl.seed_everything(0, verbose=False)
    _trainer(setting, root, instance, [capture_cb]).fit(model)
    return model, capture_cb


_PLAIN: dict[str, tuple[TrustModule, Capture]] = {}


def _plain(model_name: str, root: Path) -> tuple[TrustModule, Capture]:
    """One plain reference run per model for the whole module (the plain run has no callback under test)."""
    if model_name not in _PLAIN:
        _PLAIN[model_name] = _fit(SETTINGS[0], model_name, root, None)
    return _PLAIN[model_name]


def _unique(settings: list[Setting]) -> list[Setting]:
    """One entry per (class, arguments): the same callback on other workloads adds nothing on these models."""
    seen, out = set(), []
    for s in settings:
        key = (s.cls, repr(sorted(s.kwargs.items())))
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _compare(setting: Setting, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    if setting.numerics == "exact":
        assert torch.equal(actual, expected), f"{setting.id}: {what} differs from the plain run"
    elif setting.numerics == "close":
        torch.testing.assert_close(
            actual, expected, rtol=CLOSE["rtol"], atol=CLOSE["atol"], msg=lambda m: f"{setting.id}: {what}: {m}"
        )
    else:
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, f"{setting.id}: {what}"
        if actual.is_floating_point():
            assert torch.isfinite(actual).all(), f"{setting.id}: {what} is not finite"


# Entries whose every fit costs seconds (compilation, export, int8 conversion) run on the models that exercise what
# they change; every other entry runs on all four.
COSTLY = {
    "CompileCallback": ("conv_bn_dropout", "branches_on_training"),  # guards on the training flag
    "TensorRTExportCallback": ("conv_bn_dropout",),  # acts after training only
    "QATCallback": ("conv_bn_dropout", "branches_on_training"),
    "QATCallback-torchao": ("fused_qkv_attention",),  # replaces nn.Linear layers
}


def _combinations() -> list[Any]:
    out = []
    for param in params(_unique(SETTINGS)):
        setting = param.values[0]
        for model_name in COSTLY.get(setting.id, MODELS):
            out.append(pytest.param(setting, model_name, marks=param.marks, id=f"{setting.id}-{model_name}"))
    return out


def _compare_loss(setting: Setting, step: int, loss: float, reference: float) -> None:
    if setting.numerics == "lossy":
        assert math.isfinite(loss), f"{setting.id}: loss at step {step} is {loss}"
        assert reference / LOSSY_BAND <= loss <= reference * LOSSY_BAND, (
            f"{setting.id} ({setting.numerics_reason}): loss {loss} at step {step}, plain {reference}"
        )
    else:
        _compare(setting, f"loss at step {step}", torch.tensor(loss), torch.tensor(reference))


@pytest.mark.filterwarnings("ignore::lightning_perf.FallbackWarning")  # a fallback keeps training as it is
@pytest.mark.parametrize(("setting", "model_name"), _combinations())
def test_training_unchanged(setting: Setting, model_name: str, tmp_path: Path) -> None:
    plain, plain_run = _plain(model_name, tmp_path / "plain")
    model, run = _fit(setting, model_name, tmp_path, setting.build())

    # Training flags: in every training_step, what trains in the plain run trains here; in validation nothing does.
    assert len(model.train_flags) == len(plain.train_flags) == 3
    for step, (flags, plain_flags) in enumerate(zip(model.train_flags, plain.train_flags)):
        wrong = {n: f for n, f in flags.items() if f != plain_flags.get(n, plain_flags[""])}
        assert not wrong, f"{setting.id}: at training step {step} these modules are not in training mode: {wrong}"
    assert model.val_flags and all(not any(f.values()) for f in model.val_flags), (
        f"{setting.id}: modules in training mode during validation: "
        f"{sorted({n for f in model.val_flags for n, t in f.items() if t})}"
    )

    # Per-step losses.
    assert len(run.losses) == len(plain_run.losses) == 3
    for step, (loss, reference) in enumerate(zip(run.losses, plain_run.losses)):
        _compare_loss(setting, step, loss, reference)

    # Gradients, by the plain model's parameter names.
    assert len(run.grads) == len(plain_run.grads) == 3
    for step, (grads, plain_grads) in enumerate(zip(run.grads, plain_run.grads)):
        assert grads.keys() == plain_grads.keys(), f"{setting.id}: gradients at step {step} are of other parameters"
        for name in plain_grads:
            _compare(setting, f"gradient of {name} at step {step}", grads[name], plain_grads[name])

    # The final state_dict (weights, batch norm running statistics, counters).
    state, reference_state = model.state_dict(), plain.state_dict()
    assert state.keys() == reference_state.keys()
    for key in reference_state:
        _compare(setting, f"final {key}", state[key], reference_state[key])


# ---------------------------------------------------------------------------------------------- undo on every exit


def _global_hooks() -> dict[str, list[int]]:
    from torch.nn.modules import module as torch_module

    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks")
    return {n: list(getattr(torch_module, n)) for n in names if hasattr(torch_module, n)}


def _tensor_form(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.stride(), t.device.type)


def _structure(model: TrustModule) -> dict[str, Any]:
    """What makes the model the plain model: every part a callback may change."""
    modules = {}
    for name, m in model.named_modules():
        own_callables = sorted(k for k, v in vars(m).items() if callable(v) and not isinstance(v, nn.Module))
        modules[name] = {
            "type": type(m),
            "instance callables": own_callables,
            "hooks": {h: list(getattr(m, h, {})) for h in _HOOK_DICTS},
        }
    return {
        "modules": modules,
        "parameters": {n: (_tensor_form(p), type(p)) for n, p in model.named_parameters()},
        "buffers": {n: _tensor_form(b) for n, b in model.named_buffers()},
        "state_dict keys": list(model.state_dict()),
        "global module hooks": _global_hooks(),
        "backend flags": capture(),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
    }


def _diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    out = []
    for key in before:
        if key == "modules":
            for name in sorted(set(before[key]) | set(after[key])):
                b, a = before[key].get(name), after[key].get(name)
                if b != a:
                    out.append(f"module {name!r}: {b} -> {a}")
        elif isinstance(before[key], dict):
            for name in sorted(set(before[key]) | set(after[key])):
                if before[key].get(name) != after[key].get(name):
                    out.append(f"{key} {name!r}: {before[key].get(name)} -> {after[key].get(name)}")
        elif before[key] != after[key]:
            out.append(f"{key}: {before[key]} -> {after[key]}")
    return out


def _acts_in(setting: Setting, loop: str) -> bool:
    """Whether the class overrides a Callback hook that Lightning calls during ``trainer.<loop>()``."""
    if setting.is_strategy:
        return True
    stage = "validation" if loop == "validate" else loop
    hooks = ["setup", f"on_{stage}_start", f"on_{stage}_batch_start", f"on_{stage}_batch_end", f"on_{stage}_end"]
    hooks += [f"on_{stage}_epoch_start", f"on_{stage}_epoch_end"]
    return any(getattr(setting.cls, h) is not getattr(Callback, h) for h in hooks)


# The fit exits first, the first with a fresh instance; each later exit reuses the instance the earlier ones left.
EXITS: list[tuple[str, type[BaseException]]] = [("fit", RuntimeError), ("fit", KeyboardInterrupt)]
EXITS += [("validate", RuntimeError), ("predict", RuntimeError)]


@pytest.mark.parametrize("setting", params())
def test_undone_on_every_exit(setting: Setting, tmp_path: Path) -> None:
    """One instance fails in turn at each exit that concerns it, then drives a clean fit from the same start."""
    model_name = UNDO_MODEL[setting.workload]
    model = _model(model_name)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    before = _structure(model)
    instance = setting.build()
    first = Capture(names)
    for where, exception in EXITS:
        if (setting.is_strategy and where == "predict") or (where != "fit" and not _acts_in(setting, where)):
            continue  # a DDP strategy predicts as plain DDP; a callback without a hook in that loop has nothing to undo
        model.load_state_dict(initial)
        model.train()  # Lightning leaves the modules in the mode of the loop that failed, plain or not
        raised = SystemExit if exception is KeyboardInterrupt else exception  # Lightning exits on Ctrl+C
        failing = [first if not first.losses else Capture(names), Raise(exception, where, 3 if where == "fit" else 0)]
        sigint = signal.getsignal(signal.SIGINT)
        again = setting.build() if setting.is_strategy and first.losses else instance  # a strategy: one per Trainer
        trainer = _trainer(setting, tmp_path / where, again, failing, limit_train_batches=4)  # batch 3 is reached
        try:
            pl.seed_everything(0, verbose=False)
            with pytest.raises(raised):
                getattr(trainer, where)(model, **({"verbose": False} if where == "validate" else {}))
        finally:
            signal.signal(signal.SIGINT, sigint)  # Lightning ignores SIGINT from a Ctrl+C on
        problems = _diff(before, _structure(model))
        said = f"{setting.id} left the model changed after {exception.__name__} in {where}:\n"
        assert not problems, said + "\n".join(problems)
        for optimizer, flags in model.built:
            assert _optimizer_flags(optimizer) == flags, (
                f"{setting.id} left the optimizer's fused/foreach flags changed"
            )

    # The same instance drives a fit from the same start as the first failing one: its losses, as the plain run's.
    model.load_state_dict(initial)
    model.train()
    second = Capture(names)
    pl.seed_everything(0, verbose=False)
    _trainer(setting, tmp_path / "again", setting.build() if setting.is_strategy else instance, [second]).fit(model)
    assert first.losses == second.losses[: len(first.losses)] and len(first.losses) == 3
    _, plain_run = _plain(model_name, tmp_path / "plain")
    assert len(second.losses) == len(plain_run.losses)
    for step, (loss, reference) in enumerate(zip(second.losses, plain_run.losses)):
        _compare_loss(setting, step, loss, reference)
    problems = _diff(before, _structure(model))
    assert not problems, f"{setting.id}: the model is not plain after the second fit:\n" + "\n".join(problems[:5])
