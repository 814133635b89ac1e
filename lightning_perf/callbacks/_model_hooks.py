"""Where model surgery runs: after ``configure_model``, before optimizers and DDP exist (DESIGN.md).

``Callback.setup`` runs before ``LightningModule.configure_model``. A module that builds its layers in
``configure_model`` would be missed by surgery done in ``setup``, so when the module overrides that hook the work is
queued and run right after it. Several callbacks may queue work; it runs in the order the callbacks were given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

_QUEUE_ATTR = "_lightning_perf_after_configure_model"

SurgeryFn = Callable[["pl.LightningModule"], Any]


def run_after_configure_model(pl_module: pl.LightningModule, fn: SurgeryFn) -> None:
    """Call ``fn(pl_module)`` once the module's layers exist; call this from ``Callback.setup``.

    If the module does not override ``configure_model``, its layers exist already and ``fn`` runs now. Otherwise the
    bound hook is shadowed for one call by a wrapper that runs the original hook and then every queued function;
    the shadow is removed as soon as it has run, so the module is left exactly as it was.
    """
    if not is_overridden("configure_model", pl_module):
        fn(pl_module)
        return
    queue: list[SurgeryFn] | None = pl_module.__dict__.get(_QUEUE_ATTR)
    if queue is not None:
        queue.append(fn)
        return
    queue = [fn]
    original = pl_module.configure_model  # the bound method of the user's class

    def configure_model_then_surgery() -> None:
        try:
            original()
            for queued in queue:
                queued(pl_module)
        finally:
            discard_pending_surgery(pl_module)

    object.__setattr__(pl_module, _QUEUE_ATTR, queue)
    object.__setattr__(pl_module, "configure_model", configure_model_then_surgery)


def discard_pending_surgery(pl_module: pl.LightningModule) -> None:
    """Remove the shadowing wrapper (call from ``teardown`` in case ``configure_model`` never ran)."""
    pl_module.__dict__.pop(_QUEUE_ATTR, None)
    pl_module.__dict__.pop("configure_model", None)


_TRANSFORMS_ATTR = "_lightning_perf_batch_transforms"

BatchTransform = Callable[[Any], Any]


class _AfterBatchTransfer:
    """Stands in for the module's ``on_after_batch_transfer``: the class's hook first, then each transform.

    A small class rather than a closure so that a module carrying it still pickles (``ddp_spawn``).
    """

    def __init__(self, module: pl.LightningModule, transforms: list[BatchTransform]) -> None:
        self.module = module
        self.transforms = transforms

    def __call__(self, batch: Any, dataloader_idx: int) -> Any:
        batch = type(self.module).on_after_batch_transfer(self.module, batch, dataloader_idx)
        for transform in self.transforms:
            batch = transform(batch)
        return batch


def add_batch_transform(pl_module: pl.LightningModule, transform: BatchTransform) -> None:
    """Apply ``transform`` to every batch once it is on the device, after the module's own hook.

    Callbacks have no ``on_after_batch_transfer`` hook; this chains onto the module's, for training, validation, test
    and predict alike. Call :func:`remove_batch_transform` in ``teardown``. Adding the same transform twice is a no-op.
    """
    transforms: list[BatchTransform] | None = pl_module.__dict__.get(_TRANSFORMS_ATTR)
    if transforms is None:
        transforms = []
        object.__setattr__(pl_module, _TRANSFORMS_ATTR, transforms)
        object.__setattr__(pl_module, "on_after_batch_transfer", _AfterBatchTransfer(pl_module, transforms))
    if transform not in transforms:
        transforms.append(transform)


def remove_batch_transform(pl_module: pl.LightningModule, transform: BatchTransform) -> None:
    """Undo :func:`add_batch_transform`; the module's own hook is back once no transform is left."""
    transforms: list[BatchTransform] | None = pl_module.__dict__.get(_TRANSFORMS_ATTR)
    if transforms is None:
        return
    if transform in transforms:
        transforms.remove(transform)
    if not transforms:
        pl_module.__dict__.pop(_TRANSFORMS_ATTR, None)
        pl_module.__dict__.pop("on_after_batch_transfer", None)
