"""Switch the optimizers ``configure_optimizers`` built to torch's fused or foreach implementations."""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_perf._warnings import NoEffectWarning, warn_once
from lightning_perf.callbacks._undo import UndoOnExit
from lightning_perf.functional.fused_optimizer import (
    Implementation,
    set_implementation,
    switch_implementation,
    validate_mode,
)


def _reapply(optimizer: Optimizer, implementation: Implementation) -> None:
    # `Optimizer.load_state_dict` replaces the param groups' flags with the checkpoint's: put ours back.
    set_implementation(optimizer, implementation)


class FusedOptimizerCallback(UndoOnExit):
    """Make the optimizers of a run step with torch's fused (or foreach) kernels, without changing the module's code.

    The optimizers ``configure_optimizers`` built are switched in place: the same objects, with their state, param
    groups and learning-rate schedulers, step through the fused implementation (one kernel over all parameters) where
    torch has one for the optimizer class, device and dtype (Adam, AdamW, SGD, Adagrad on CPU and CUDA in torch 2.13),
    else through the foreach (multi-tensor) one. When a checkpoint is resumed, the switch is made again right after
    the optimizer state is loaded. What was switched and why the others were not is logged once on rank zero; if
    nothing could be switched, one :class:`~lightning_perf.NoEffectWarning` says why. At ``teardown``, and in
    ``on_exception`` when a run fails, the optimizers get back the ``fused`` / ``foreach`` flags they were built with.

    An optimizer built with ``fused=False`` or ``foreach=False`` is left alone: that is torch's way of asking for the
    single-tensor loop.

    Args:
        mode: ``"auto"`` (default): fused where supported, else foreach. ``"fused"``: fused only. ``"foreach"``:
            foreach only.

    Raises:
        ValueError: if ``mode`` is not ``"auto"``, ``"fused"`` or ``"foreach"``.

    Example::

        trainer = Trainer(callbacks=[FusedOptimizerCallback()])
    """

    def __init__(self, mode: Literal["auto", "fused", "foreach"] = "auto") -> None:
        self.mode = validate_mode(mode, type(self).__name__)
        self._handles: list[RemovableHandle] = []
        self._switched: list[tuple[Optimizer, list[dict[str, Any]]]] = []

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The first hook after `strategy.setup` has called `configure_optimizers` (in `setup` no optimizer exists
        # yet). This is not model surgery: the parameters stay the same objects, so DDP is unaffected. A resumed
        # run loads the optimizer state after this hook; the post-load hook registered here switches it back.
        sparse = [m.weight for m in pl_module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
        name = type(self).__name__
        changed, skipped = [], []
        for index, optimizer in enumerate(trainer.optimizers):
            label = f"optimizer {index} ({type(optimizer).__name__})"
            flags = _flags(optimizer)
            choice = switch_implementation(optimizer, self.mode, sparse)
            if choice.implementation is None:
                skipped.append(f"{label} left as it is: {choice.reason}")
                continue
            self._switched.append((optimizer, flags))
            changed.append(f"{label} -> {choice.implementation}")
            hook = partial(_reapply, implementation=choice.implementation)
            self._handles.append(optimizer.register_load_state_dict_post_hook(hook))
        if not changed:
            why = "; ".join(skipped) if skipped else "the run has no optimizer"
            warn_once(f"`{name}(mode={self.mode!r})` changed nothing: {why}.", NoEffectWarning)
            return
        rank_zero_info(f"{name}: " + "; ".join(changed + skipped) + ".")

    def _undo(self, pl_module: pl.LightningModule | None = None) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        # The optimizers step as configure_optimizers built them again (state and param groups are kept).
        for optimizer, flags in self._switched:
            for target, saved in zip((*optimizer.param_groups, optimizer.defaults), flags):
                target.update(saved)
        self._switched.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"], state["_switched"] = [], []  # live objects of a run in progress
        return state


def _flags(optimizer: Optimizer) -> list[dict[str, Any]]:
    """The ``fused`` / ``foreach`` entries of each param group and of ``defaults``, as configured."""
    return [
        {key: target[key] for key in ("fused", "foreach") if key in target}
        for target in (*optimizer.param_groups, optimizer.defaults)
    ]
