"""A Trainer for callback tests: CPU, one device, no logger, checkpoints, progress bar, summary or validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl


def quiet_trainer(root: Path, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    """A Trainer writing under ``root``; ``kwargs`` override the quiet defaults (e.g. ``logger=CSVLogger(...)``)."""
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "default_root_dir": root,
    }
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)
