"""Activation checkpointing of a model's blocks during ``fit``: less activation memory for some recompute time."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_perf._validation import check_bool
from lightning_perf._warnings import warn_once
from lightning_perf.callbacks._model_hooks import discard_pending_surgery, run_after_configure_model
from lightning_perf.functional.grad_checkpoint import (
    CheckpointedForward,
    apply_activation_checkpointing,
    resolve_module_classes,
    select_blocks,
    validate_portion,
)
from lightning_perf.functional.surgery import find_forward_patch, unpatch_forward


class GradCheckpointCallback(Callback):
    """Activation checkpointing (non-reentrant) of the model's blocks while it trains.

    Each chosen block drops its intermediate activations in forward and recomputes them in backward: peak activation
    memory falls to about the blocks' inputs plus one block's activations, for roughly one more forward pass of
    compute (typically +20-35% step time). Use the memory to train with a larger batch, longer sequences or a deeper
    model. Names, ``state_dict`` keys and gradients stay those of the plain model; BatchNorm running statistics are
    updated once per step, as without checkpointing. The blocks are patched in ``setup`` (after ``configure_model``,
    before the optimizer and DDP exist) and unpatched in ``teardown``, or in ``on_exception`` when the fit fails or is
    interrupted: after ``fit`` the model is as it was.

    Works on a single device and under DDP, with mixed precision and with ``torch.compile``. Under FSDP use Lightning's
    own ``FSDPStrategy(activation_checkpointing_policy={Block})`` instead: this callback then warns and does nothing.

    Args:
        modules: which blocks: ``"auto"`` (the largest group of repeated blocks, found by structure: the layers of a
            transformer, the residual blocks of a ResNet), or block classes: ``nn.Module`` subclasses, dotted class
            paths (``"torch.nn.TransformerEncoderLayer"``, YAML-friendly) or bare class names (``"Block"``) matched
            against the classes in the model.
        filter_fn: ``filter_fn(module, name) -> bool`` choosing the blocks, instead of ``modules``. A block inside a
            chosen block is not wrapped again.
        every_n: checkpoint only every ``every_n``-th of the chosen blocks (1, 1 + n, ...): less recompute, less saved.
        fraction: checkpoint only the first ``fraction`` of the chosen blocks, in ``(0, 1]``.
        preserve_rng_state: make the recompute draw the same dropout masks (keep ``True`` unless the blocks have no
            randomness and the last bit of speed matters).

    Attributes:
        wrapped: names of the blocks this callback checkpointed in the last ``fit``.

    Raises:
        ValueError: for a class path that does not import, both ``modules`` and ``filter_fn``, an ``every_n`` below 1
            or a ``fraction`` outside ``(0, 1]`` (at construction); for a bare class name the model does not use (at
            setup).
        TypeError: for arguments of the wrong type (a non-bool ``preserve_rng_state``, a ``filter_fn`` that is not
            callable, ``modules`` that are neither classes nor strings).

    Example::

        from lightning_perf.callbacks import GradCheckpointCallback

        trainer = Trainer(callbacks=[GradCheckpointCallback()])  # every transformer layer
        trainer = Trainer(callbacks=[GradCheckpointCallback("torch.nn.TransformerEncoderLayer", every_n=2)])
    """

    def __init__(
        self,
        modules: str | type[nn.Module] | Sequence[str | type[nn.Module]] = "auto",
        filter_fn: Callable[[nn.Module, str], bool] | None = None,
        every_n: int | None = None,
        fraction: float | None = None,
        preserve_rng_state: bool = True,
    ) -> None:
        if filter_fn is not None and not callable(filter_fn):
            raise TypeError(
                f"`GradCheckpointCallback(filter_fn={filter_fn!r})` is not valid: it is not callable. Expected a "
                "function `filter_fn(module, name) -> bool`."
            )
        if filter_fn is not None and not (isinstance(modules, str) and modules == "auto"):
            raise ValueError(
                f"`GradCheckpointCallback(modules={modules!r}, filter_fn=...)`: give either `modules` or `filter_fn`."
            )
        if not (isinstance(modules, str) and modules == "auto"):
            try:
                resolve_module_classes(modules)  # a class path that does not import fails here, not at fit time
            except (TypeError, ValueError) as err:
                raise type(err)(f"`GradCheckpointCallback(modules={modules!r})` is not valid. {err}") from err
        try:
            validate_portion(every_n, fraction)
        except (TypeError, ValueError) as err:
            raise type(err)(f"`GradCheckpointCallback(every_n={every_n!r}, fraction={fraction!r})`: {err}") from err
        check_bool("GradCheckpointCallback", "preserve_rng_state", preserve_rng_state)
        self.modules = modules
        self.filter_fn = filter_fn
        self.every_n = every_n
        self.fraction = fraction
        self.preserve_rng_state = preserve_rng_state
        self.wrapped: list[str] = []
        self._patched: list[nn.Module] = []  # the blocks to unpatch, held by object (a name may be rebound meanwhile)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return  # nothing to save without a backward pass
        if isinstance(trainer.strategy, FSDPStrategy):
            warn_once(
                "GradCheckpointCallback does nothing under FSDP: use "
                "`FSDPStrategy(activation_checkpointing_policy={YourBlock})`, which checkpoints inside the FSDP units."
            )
            return
        self.wrapped = []
        self._patched = []
        run_after_configure_model(pl_module, self._apply)

    def _apply(self, pl_module: pl.LightningModule) -> None:
        chosen = select_blocks(pl_module, self.modules, self.filter_fn)
        if not chosen:
            what = (
                "found no repeated blocks" if self.filter_fn is None and self.modules == "auto" else "matched nothing"
            )
            warn_once(
                f"GradCheckpointCallback({self._describe()}) {what} in {type(pl_module).__name__}: training goes on "
                "without activation checkpointing. Name the block class with `modules=` or pass `filter_fn=`."
            )
            return
        already = [name for name, m in chosen if find_forward_patch(m, CheckpointedForward) is not None]
        self.wrapped = apply_activation_checkpointing(
            pl_module,
            self.modules,
            filter_fn=self.filter_fn,
            every_n=self.every_n,
            fraction=self.fraction,
            preserve_rng_state=self.preserve_rng_state,
        )
        self._patched = [pl_module.get_submodule(n) for n in self.wrapped]
        classes = sorted({type(m).__name__ for m in self._patched})
        message = (
            f"GradCheckpointCallback: activation checkpointing on {len(self.wrapped)} of {len(chosen)} blocks "
            f"({', '.join(classes)}): {_abbreviate(self.wrapped)}"
        )
        if already:
            message += f"; already checkpointed before: {_abbreviate(already)}"
        rank_zero_info(message)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._undo(pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # A failed or interrupted fit never reaches teardown: undo the same way here.
        self._undo(pl_module)

    def _undo(self, pl_module: pl.LightningModule) -> None:
        discard_pending_surgery(pl_module)
        for block in self._patched:
            unpatch_forward(block, CheckpointedForward)
        self._patched = []

    def _describe(self) -> str:
        if self.filter_fn is not None:
            return f"filter_fn={getattr(self.filter_fn, '__name__', self.filter_fn)!r}"
        return f"modules={self.modules!r}"


def _abbreviate(names: list[str], keep: int = 6) -> str:
    if len(names) <= keep:
        return ", ".join(names)
    return ", ".join(names[: keep - 2]) + f", ... ({len(names) - keep + 2} more), " + ", ".join(names[-2:])
