"""Where model surgery runs: after ``configure_model``, before optimizers and DDP exist (DESIGN.md).

``Callback.setup`` runs before ``LightningModule.configure_model``. A module that builds its layers in
``configure_model`` would be missed by surgery done in ``setup``, so when the module overrides that hook the work is
queued and run right after it. Several callbacks may queue work; it runs in the order the callbacks were given.
A callback that needs the whole model in one process asks :func:`refuse_sharded` first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelPruning
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_perf._warnings import NoEffectWarning, warn_once
from lightning_perf.functional.sharding import is_sharded

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


def sharded_strategy(trainer: pl.Trainer, pl_module: pl.LightningModule | None = None) -> str | None:
    """The strategy's class name when the model trains sharded, else ``None``.

    Sharded: the strategy is ``ModelParallelStrategy`` or ``FSDPStrategy`` (known in ``setup``), or the module holds
    FSDP2-sharded modules or DTensor parameters (``fully_shard`` in ``configure_model``: known once it has run).
    """
    strategy = getattr(trainer, "strategy", None)
    if isinstance(strategy, (ModelParallelStrategy, FSDPStrategy)) or (pl_module is not None and is_sharded(pl_module)):
        return type(strategy).__name__
    return None


def refuse_sharded(
    owner: str, trainer: pl.Trainer, pl_module: pl.LightningModule | None, why: str, instead: str
) -> bool:
    """Whether ``owner`` must stand aside because the model trains sharded (:func:`sharded_strategy`); if so it warns
    once (a :class:`~lightning_perf.NoEffectWarning` naming the strategy, the reason and what to do instead)."""
    strategy = sharded_strategy(trainer, pl_module)
    if strategy is None:
        return False
    warn_once(f"{owner} does nothing under {strategy}: {why}. Instead: {instead}.", NoEffectWarning)
    return True


BatchTransform = Callable[[Any], Any]
HookOwner = Union["pl.LightningModule", "pl.LightningDataModule"]

BATCH_HOOKS: tuple[str, ...] = ("on_before_batch_transfer", "on_after_batch_transfer")
"""The module hooks a batch transform can chain onto: before the batch moves to the device, or once it is there."""

# Where each hook's transforms are kept on the owner (the after-transfer name predates the before-transfer one).
_TRANSFORMS_ATTRS = {
    "on_before_batch_transfer": "_lightning_perf_before_transfer_transforms",
    "on_after_batch_transfer": "_lightning_perf_batch_transforms",
}


class _ChainedBatchHook:
    """Stands in for a batch-transfer hook (see :data:`BATCH_HOOKS`): the class's hook first, then each transform.

    ``__wrapped__`` is the class's own hook, so Lightning's ``is_overridden`` (which decides whether the module's or
    the datamodule's hook runs, and warns when both exist) sees exactly what it would see without the stand-in. A
    small class rather than a closure so that an object carrying it still pickles (``ddp_spawn``).
    """

    def __init__(
        self, owner: HookOwner, transforms: list[BatchTransform], hook: str = "on_after_batch_transfer"
    ) -> None:
        self.owner = owner
        self.transforms = transforms
        self.hook = hook

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return getattr(type(self.owner), self.hook)  # type: ignore[no-any-return]

    def __call__(self, batch: Any, dataloader_idx: int) -> Any:
        batch = self.__wrapped__(self.owner, batch, dataloader_idx)
        for transform in self.transforms:
            batch = transform(batch)
        return batch


def _datamodule(pl_module: pl.LightningModule) -> pl.LightningDataModule | None:
    trainer = getattr(pl_module, "_trainer", None)
    return getattr(trainer, "datamodule", None) if trainer is not None else None


def _hook_owner(pl_module: pl.LightningModule, hook: str) -> HookOwner:
    """Whose ``hook`` Lightning calls: the datamodule's when it overrides the hook, else the module's (Lightning's
    ``_DataHookSelector``)."""
    datamodule = _datamodule(pl_module)
    if datamodule is not None and is_overridden(hook, datamodule):
        return datamodule
    return pl_module


def _check_hook(hook: str) -> str:
    if hook not in _TRANSFORMS_ATTRS:
        raise ValueError(f"`hook={hook!r}` is not a batch-transfer hook. Expected one of: {', '.join(BATCH_HOOKS)}.")
    return _TRANSFORMS_ATTRS[hook]


def add_batch_transform(
    pl_module: pl.LightningModule, transform: BatchTransform, hook: str = "on_after_batch_transfer"
) -> None:
    """Apply ``transform`` to every batch right after the user's ``hook`` (by default once it is on the device).

    Callbacks have no batch-transfer hooks; this chains onto the one Lightning calls (the datamodule's if it overrides
    the hook, else the module's), for training, validation, test and predict alike. With
    ``hook="on_before_batch_transfer"`` the transform sees the batch still on the host, just before it is moved.
    Call it once the module is attached to its Trainer (``setup``) and :func:`remove_batch_transform` in
    ``teardown``. Adding the same transform twice is a no-op.

    Raises:
        ValueError: if ``hook`` is not one of :data:`BATCH_HOOKS`.
    """
    attr = _check_hook(hook)
    owner = _hook_owner(pl_module, hook)
    transforms: list[BatchTransform] | None = owner.__dict__.get(attr)
    if transforms is None:
        transforms = []
        object.__setattr__(owner, attr, transforms)
        object.__setattr__(owner, hook, _ChainedBatchHook(owner, transforms, hook))
    if transform not in transforms:
        transforms.append(transform)


def remove_batch_transform(
    pl_module: pl.LightningModule, transform: BatchTransform, hook: str = "on_after_batch_transfer"
) -> None:
    """Undo :func:`add_batch_transform`; the class's own hook is back once no transform is left.

    Raises:
        ValueError: if ``hook`` is not one of :data:`BATCH_HOOKS`.
    """
    attr = _check_hook(hook)
    for owner in (pl_module, _datamodule(pl_module)):
        transforms: list[BatchTransform] | None = None if owner is None else owner.__dict__.get(attr)
        if owner is None or transforms is None:
            continue
        if transform in transforms:
            transforms.remove(transform)
        if not transforms:
            owner.__dict__.pop(attr, None)
            owner.__dict__.pop(hook, None)


# ----------------------------------------------------------------------------- before a checkpoint's weights load


class _BeforeWeightsLoad:
    """Stands in for the module's ``on_load_checkpoint`` during a Trainer run: its own hook first, then each callback's
    ``before_weights_load(module, checkpoint)``. Lightning calls this hook right before ``load_state_dict``, so a
    callback whose surgery the checkpoint records (a prepared QAT submodule) can redo it and complete the weights. A
    small class, not a closure, so that a module carrying it still pickles."""

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module
        self.callbacks: list[Any] = []

    @property
    def __wrapped__(self) -> Any:
        return type(self.module).on_load_checkpoint

    def __call__(self, checkpoint: dict[str, Any]) -> None:
        type(self.module).on_load_checkpoint(self.module, checkpoint)
        for callback in self.callbacks:
            callback.before_weights_load(self.module, checkpoint)


def add_before_weights_load(pl_module: pl.LightningModule, callback: Any) -> None:
    """Call ``callback.before_weights_load(pl_module, checkpoint)`` whenever Lightning is about to load a checkpoint's
    weights into ``pl_module`` (after the module's own ``on_load_checkpoint``). Undo with
    :func:`remove_before_weights_load` in ``teardown``; adding a callback twice is a no-op."""
    stand_in = pl_module.__dict__.get("on_load_checkpoint")
    if not isinstance(stand_in, _BeforeWeightsLoad):
        stand_in = _BeforeWeightsLoad(pl_module)
        object.__setattr__(pl_module, "on_load_checkpoint", stand_in)
    if callback not in stand_in.callbacks:
        stand_in.callbacks.append(callback)


def remove_before_weights_load(pl_module: pl.LightningModule, callback: Any) -> None:
    """Undo :func:`add_before_weights_load`; the class's own hook is back once no callback is left."""
    stand_in = pl_module.__dict__.get("on_load_checkpoint")
    if isinstance(stand_in, _BeforeWeightsLoad):
        if callback in stand_in.callbacks:
            stand_in.callbacks.remove(callback)
        if not stand_in.callbacks:
            del pl_module.__dict__["on_load_checkpoint"]


def check_pruning_order(callback: Callback, owner: str, trainer: pl.Trainer, refusal: str | None = None) -> None:
    """Refuse the combinations with Lightning's ``ModelPruning`` in which pruning would silently do nothing.

    ``ModelPruning`` collects its modules in its own ``setup`` and masks their weights through forward hooks: a callback
    that puts modules in place of others must come before it, so that the pruner finds the new ones; one whose model
    runs no module hooks (``refusal`` says why and what to do instead) cannot train with it at all.

    Raises:
        ValueError: naming ``owner`` and the fix.
    """
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    pruners = [cb for cb in callbacks if isinstance(cb, ModelPruning)]
    if pruners and refusal is not None:
        raise ValueError(f"`{owner}` cannot train with `ModelPruning`: {refusal}.")
    if any(callbacks.index(p) < callbacks.index(callback) for p in pruners):
        raise ValueError(
            f"Put `{type(callback).__name__}` before `ModelPruning` in `Trainer(callbacks=[...])`: the pruner collects "
            "its layers in its own `setup`, and must find the layers the callback puts in place, not the ones they "
            "replace."
        )
