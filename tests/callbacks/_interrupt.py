"""Shared by the callback tests: a fit that fails or is interrupted at a given step, and what "the plain model" is."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from tests._models import trainer

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


class RaiseAt(Callback):
    """Raises ``error`` in ``on_train_batch_start`` of batch ``batch_idx``."""

    def __init__(self, error: BaseException, batch_idx: int = 3) -> None:
        self.error = error
        self.batch_idx = batch_idx

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.batch_idx:
            raise self.error


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def plain_model_signature(model: nn.Module) -> dict[str, Any]:
    """Module types, instance-level forwards and other hooks, parameter objects and state_dict keys, by name."""
    return {
        "types": [(name, type(m)) for name, m in model.named_modules()],
        "instance_attrs": [
            (name, key)
            for name, m in model.named_modules()
            for key in m.__dict__
            if key in ("forward", "configure_model") or key.startswith("_lightning_perf")
        ],
        "hooks": [(name, attr, len(getattr(m, attr))) for name, m in model.named_modules() for attr in _HOOK_DICTS],
        "parameters": [(name, id(p)) for name, p in model.named_parameters()],
        "state_dict": list(model.state_dict()),
    }


@contextlib.contextmanager
def _sigint_restored() -> Iterator[None]:
    # Lightning ignores SIGINT from the first KeyboardInterrupt on: give the test process its handler back.
    handler = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


def fit_interrupted(root: Any, model: pl.LightningModule, callback: Callback, error: BaseException) -> list[float]:
    """Fit ``model`` with ``callback`` until ``error`` is raised at batch 3; returns the losses of steps 0-2."""
    recorder = LossRecorder()
    expected = SystemExit if isinstance(error, KeyboardInterrupt) else type(error)  # Lightning exits on Ctrl+C
    with _sigint_restored(), pytest.raises(expected):
        torch.manual_seed(0)
        trainer(root, callbacks=[callback, recorder, RaiseAt(error)], max_steps=6).fit(model)
    return recorder.losses


def fit_losses(root: Any, model: pl.LightningModule, callback: Callback | None, steps: int = 3) -> list[float]:
    recorder = LossRecorder()
    torch.manual_seed(0)
    callbacks = [recorder] if callback is None else [callback, recorder]
    trainer(root, callbacks=callbacks, max_steps=steps).fit(model)
    return recorder.losses
