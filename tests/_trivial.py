"""A test-only callback that exercises the generic registry tests before (and besides) the real optimizations."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class CountingCallback(Callback):
    """Counts optimizer-stepped batches and keeps the count across a checkpoint resume."""

    def __init__(self, start: int = 0) -> None:
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"`CountingCallback(start={start!r})` is not valid. Expected a non-negative integer.")
        self.count = start

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.count = state_dict["count"]
