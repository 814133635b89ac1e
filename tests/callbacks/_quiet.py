"""A Trainer for callback tests: CPU, one device, no logger, checkpoints, progress bar, summary or validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from tests._models import trainer


def quiet_trainer(root: Path, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    """A Trainer writing under ``root``; ``kwargs`` override the quiet defaults (e.g. ``logger=CSVLogger(...)``)."""
    return trainer(root, callbacks=callbacks, **{"max_steps": -1, "limit_val_batches": 0, **kwargs})
