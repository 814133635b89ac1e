"""Undo on every exit: the one place that ties a callback's ``_undo`` to both ways out of a Lightning run."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class UndoOnExit(Callback):
    """A callback whose changes (module forwards, wrappers, optimizers, process globals) go back on every exit.

    Lightning calls ``teardown`` at the end of a run that finished and only ``on_exception`` for one that failed or
    was interrupted: both call :meth:`_undo`, which must be safe to call twice and when nothing was changed.
    """

    def _undo(self, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._undo(pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._undo(pl_module)
