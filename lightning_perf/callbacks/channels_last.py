"""Train and predict in channels-last memory format: conv weights converted once, each batch on the device."""

from __future__ import annotations

from functools import partial
from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_perf._validation import check_choice
from lightning_perf._warnings import NoEffectWarning, PartialEffectWarning, warn_once
from lightning_perf.callbacks._model_hooks import (
    BatchTransform,
    add_batch_transform,
    discard_pending_surgery,
    remove_batch_transform,
    run_after_configure_model,
)
from lightning_perf.functional.channels_last import apply_channels_last, batch_to_channels_last, validate_dims
from lightning_perf.functional.fused_optimizer import match_state_layout
from lightning_perf.functional.sharding import is_sharded_parameter


def _match_layout(optimizer: Optimizer) -> None:
    match_state_layout(optimizer)


class ChannelsLastCallback(Callback):
    """Run convolutions in channels-last (NHWC / NDHWC) memory format, without changing the model's code.

    At ``setup``, once the module's layers exist and before optimizers do, the weights of its 2D convolutions are
    converted to ``torch.channels_last`` and those of its 3D convolutions to ``torch.channels_last_3d`` (in place: the
    Parameter objects and ``state_dict`` keys stay the same). Every floating-point 4D/5D tensor of each batch is
    converted too, once it is on the device, in training, validation, test and predict; integer tensors (labels,
    masks) are left alone. Gradients and optimizer state follow the weights' layout, also when a resumed run loads
    optimizer state written without channels-last. At ``teardown``, and in ``on_exception`` when a run fails, the
    weights get back the layout they had (same values, same Parameter objects); a checkpoint written with the
    callback loads into a plain model and the other way round.

    A model without 2D/3D convolutions is left as it is, with one :class:`~lightning_perf.NoEffectWarning`.

    Under FSDP2 (``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``) the sharded weights keep their
    layout: FSDP2 gathers them contiguous before every forward, so converting a shard would change nothing. The inputs
    are converted as always, and the convolution kernels run in channels-last, reordering the gathered weights per call
    (one :class:`~lightning_perf.PartialEffectWarning` says so).

    Args:
        dims: ``"auto"`` (default) converts the 2D convolutions and 4D inputs and the 3D convolutions and 5D inputs
            that the model has; ``2`` or ``3`` converts only that rank.

    Raises:
        ValueError: if ``dims`` is not ``"auto"``, 2 or 3 (``2.0`` and ``True`` are not).

    Example::

        trainer = Trainer(callbacks=[ChannelsLastCallback()])
    """

    def __init__(self, dims: Literal["auto", 2, 3] = "auto") -> None:
        self.dims = validate_dims(check_choice(type(self).__name__, "dims", dims, ("auto", 2, 3)), type(self).__name__)
        self._transform: BatchTransform | None = None
        self._handles: list[RemovableHandle] = []
        self._converted: list[tuple[torch.nn.Parameter, tuple[int, ...]]] = []
        self._reported = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        run_after_configure_model(pl_module, self._convert)

    def _convert(self, pl_module: pl.LightningModule) -> None:
        strides = {p: p.stride() for p in pl_module.parameters()}
        report = apply_channels_last(pl_module, self.dims)
        # Remembered so that teardown (and on_exception) give the weights back the layout they came with.
        self._converted.extend((p, stride) for p, stride in strides.items() if p.stride() != stride)
        if not report.dims:
            warn_once(
                f"`{type(self).__name__}(dims={self.dims!r})` does nothing: {report.skipped_reason}. "
                "The model and its batches are left as they are.",
                NoEffectWarning,
            )
            return
        if (report.changed or report.sharded) and not self._reported:  # each stage converts again: say it once
            rank_zero_info(f"{type(self).__name__}: {report.summary()}.")
            self._reported = True
        if report.sharded:
            trainer = getattr(pl_module, "_trainer", None)  # `pl_module.trainer` raises outside a Trainer
            strategy = type(trainer.strategy).__name__ if trainer is not None else "fully_shard"
            warn_once(
                f"{type(self).__name__} under {strategy}: the weights of {len(report.sharded)} convolution(s) are "
                "FSDP2 shards and keep FSDP2's layout (it gathers them contiguous before every forward, so a "
                "converted shard would not reach the kernel); inputs are converted and the kernels reorder the "
                "gathered weights per call. Channels-last weights need DDP or a single device.",
                PartialEffectWarning,
            )
        self._transform = partial(batch_to_channels_last, dims=report.dims)
        add_batch_transform(pl_module, self._transform)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._transform is None:
            return
        # A resumed run loads optimizer state after this hook. State written by a run without channels-last is in
        # contiguous format, which torch's fused optimizer kernels mis-handle next to channels-last weights.
        for optimizer in trainer.optimizers:
            self._handles.append(optimizer.register_load_state_dict_post_hook(_match_layout))

    def _undo(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        discard_pending_surgery(pl_module)
        if self._transform is not None:
            remove_batch_transform(pl_module, self._transform)
            self._transform = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        with torch.no_grad():
            for param, stride in self._converted:
                if is_sharded_parameter(param):
                    continue  # never converted (FSDP2 keeps its own layout); a plain copy_ would mix Tensor and DTensor
                # Same values, same Parameter object (optimizers and DDP keep theirs): only the layout goes back.
                param.data = torch.empty_strided(param.shape, stride, dtype=param.dtype, device=param.device).copy_(
                    param.data
                )
        if self._converted:
            self._converted.clear()
            for optimizer in trainer.optimizers:  # their state follows (fused kernels need matching layouts)
                match_state_layout(optimizer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._undo(trainer, pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning calls `on_exception`, not `teardown`, when a run fails.
        self._undo(trainer, pl_module)
