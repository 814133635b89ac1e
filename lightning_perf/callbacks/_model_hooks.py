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
