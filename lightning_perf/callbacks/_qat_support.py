"""What :class:`~lightning_perf.callbacks.QATCallback` needs from the Trainer besides its hooks: the checkpoint-load
stand-in, the pruning check, the first batch of a split and the default output folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelPruning
from torch import nn

from lightning_perf.callbacks.tensorrt_export import _val_dataloader
from lightning_perf.deploy.inputs import split_inputs, submodule_inputs, through_batch_hooks

__all__ = [
    "RestoreBeforeWeights",
    "check_pruning",
    "default_dirpath",
    "example_inputs",
    "first_batch",
    "submodule_batches",
]


class RestoreBeforeWeights:
    """Stands in for the module's ``on_load_checkpoint`` during a Trainer run: its own hook first, then each callback
    prepares the model as the checkpoint's recipe says and puts the quantization state back, before Lightning loads
    the weights (Lightning calls this hook right before ``load_state_dict``). A small class, not a closure, so that a
    module carrying it still pickles."""

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module
        self.callbacks: list[Any] = []  # QATCallback instances, each with `before_weights_load(module, checkpoint)`

    @property
    def __wrapped__(self) -> Any:
        return type(self.module).on_load_checkpoint

    def __call__(self, checkpoint: dict[str, Any]) -> None:
        type(self.module).on_load_checkpoint(self.module, checkpoint)
        for callback in self.callbacks:
            callback.before_weights_load(self.module, checkpoint)


def check_pruning(callback: Callback, backend: str, trainer: pl.Trainer) -> None:
    """Refuse the combinations with Lightning's ``ModelPruning`` in which pruning would silently do nothing.

    ``ModelPruning`` collects its modules in its own ``setup`` and masks their weights through forward hooks. An
    exported x86 graph reads the weights directly and runs no module hooks; with the torchao backend the pruner
    must see the fake-quantized layers, so it must come after the QAT callback.
    """
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    pruners = [cb for cb in callbacks if isinstance(cb, ModelPruning)]
    if not pruners:
        return
    owner = type(callback).__name__
    if backend == "x86":
        raise ValueError(
            f"`{owner}(backend='x86')` cannot train with `ModelPruning`: the exported graph reads the weights "
            "directly and never runs the pruning hooks, so nothing would be pruned. Use backend='torchao' (with "
            f"{owner} before ModelPruning in `callbacks`), or prune and make it permanent before QAT."
        )
    position = callbacks.index(callback)
    if any(callbacks.index(p) < position for p in pruners):
        raise ValueError(
            f"Put `{owner}` before `ModelPruning` in `Trainer(callbacks=[...])`: the pruner collects its layers in "
            "its own `setup`, and must find the fake-quantized ones, not the float layers they replace."
        )


def first_batch(trainer: pl.Trainer, pl_module: pl.LightningModule, split: str) -> Any:
    """The first batch of the training (``split="train"``) or validation data, through the module's batch hooks."""
    if split == "train":
        source = getattr(trainer.fit_loop, "_data_source", None)
        loader = source.dataloader() if source is not None and source.is_defined() else None
    else:
        loader = _val_dataloader(trainer, pl_module)
    if loader is None:
        return None
    for batch in loader:
        return through_batch_hooks(pl_module, batch, datamodule=getattr(trainer, "datamodule", None))
    return None


def default_dirpath(trainer: pl.Trainer) -> Path:
    """The ``ModelCheckpoint``'s directory, else ``<default_root_dir>/quantized``."""
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None) if callback is not None else None
    return Path(dirpath) if dirpath else Path(trainer.default_root_dir) / "quantized"


def example_inputs(
    owner: str, trainer: pl.Trainer, pl_module: pl.LightningModule, module: nn.Module, split: str, input_key: Any
) -> tuple[torch.Tensor, ...]:
    """What ``module`` receives when the LightningModule runs its ``example_input_array`` (else the inputs of the
    first batch of ``split``), on the CPU."""
    example = pl_module.example_input_array
    source = "example_input_array"
    if example is None:
        batch = first_batch(trainer, pl_module, split)
        if batch is None:
            raise ValueError(
                f"`{owner}` needs an example input: set `example_input_array` on "
                f"{type(pl_module).__name__} or give the trainer data."
            )
        example, source = split_inputs(batch, input_key), "the first batch"
    elif not isinstance(example, dict):
        example = through_batch_hooks(pl_module, example, datamodule=getattr(trainer, "datamodule", None))
    return submodule_inputs(pl_module, module, example, source, device=pl_module.device, owner=owner)


def submodule_batches(
    owner: str, pl_module: pl.LightningModule, module: nn.Module, loader: Any, input_key: Any
) -> Iterator[Any]:
    """Validation batches as ``(submodule inputs, labels)``: what ``module`` receives for each, and the labels."""
    datamodule = getattr(pl_module.trainer, "datamodule", None)
    for batch in loader:
        batch = through_batch_hooks(pl_module, batch, datamodule=datamodule)
        inputs = split_inputs(batch, input_key)
        inputs = submodule_inputs(pl_module, module, inputs, "a validation batch", device=pl_module.device, owner=owner)
        labels = batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None
        yield (inputs, labels)
