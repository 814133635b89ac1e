"""What callbacks that export or quantize read from the Trainer besides their hooks: its validation loader, the first
batch of a split, what a submodule receives for them, the default output folder and the run's metadata.

Batches go through the same path as training batches (the datamodule's and the module's own transfer hooks,
:func:`~lightning_perf.deploy.inputs.through_batch_hooks`); the logic that uses them stays in ``deploy``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_perf.deploy.inputs import submodule_inputs, through_batch_hooks
from lightning_perf.functional.inputs import CapturedCall, call_of, split_inputs

if TYPE_CHECKING:
    from lightning_perf.deploy.quantize.quantizer import LoopData

__all__ = [
    "default_dirpath",
    "example_inputs",
    "first_batch",
    "has_val_data",
    "loop_data",
    "run_metadata",
    "step_call",
    "submodule_batches",
    "val_dataloader",
]


def _val_source(trainer: pl.Trainer) -> Any:
    # Lightning's own `Trainer.enable_validation` reads this to know whether validation data was given in any form.
    return getattr(getattr(getattr(trainer.fit_loop, "epoch_loop", None), "val_loop", None), "_data_source", None)


def has_val_data(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether the fit has validation data in any form (loaders, a datamodule's or the module's ``val_dataloader``)."""
    source = _val_source(trainer)
    if source is not None:
        return bool(source.is_defined())
    datamodule = getattr(trainer, "datamodule", None)  # set by the data connector, not declared on the class
    return (datamodule is not None and is_overridden("val_dataloader", datamodule)) or is_overridden(
        "val_dataloader", pl_module
    )


def val_dataloader(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The first validation loader the fit used, or the one the data source defines if validation never ran."""
    loaders = trainer.val_dataloaders
    if loaders is None and has_val_data(trainer, pl_module):
        source = _val_source(trainer)
        loaders = source.dataloader() if source is not None else None
    if isinstance(loaders, Mapping):
        loaders = next(iter(loaders.values()), None)
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    return loaders


def first_batch(trainer: pl.Trainer, pl_module: pl.LightningModule, split: str) -> Any:
    """The first batch of the training (``split="train"``) or validation data, through the module's batch hooks."""
    if split == "train":
        source = getattr(trainer.fit_loop, "_data_source", None)
        loader = source.dataloader() if source is not None and source.is_defined() else None
    else:
        loader = val_dataloader(trainer, pl_module)
    if loader is None:
        return None
    for batch in loader:
        return through_batch_hooks(pl_module, batch, datamodule=getattr(trainer, "datamodule", None))
    return None


def default_dirpath(trainer: pl.Trainer, folder: str) -> Path:
    """The ``ModelCheckpoint``'s directory, else ``<default_root_dir>/<folder>``."""
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None) if callback is not None else None
    return Path(dirpath) if dirpath else Path(trainer.default_root_dir) / folder


def run_metadata(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """What a report records about the run: its step, its epoch and the module's class."""
    return {
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "model_class": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
    }


def example_inputs(
    owner: str,
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    module: nn.Module,
    split: str,
    input_key: Any,
    call: CapturedCall | None = None,
) -> tuple[torch.Tensor, ...] | CapturedCall:
    """What ``module`` receives when the LightningModule runs its ``example_input_array`` (else ``call``, the call
    training made, else the inputs of the first batch of ``split``), on the CPU."""
    example: Any = pl_module.example_input_array
    source = "example_input_array"
    if example is None and call is not None:
        example, source = call, call.source
    elif example is None:
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


def step_call(pl_module: pl.LightningModule, batch: Any, call: CapturedCall | None, input_key: Any) -> Any:
    """The model inputs of ``batch``: the call ``validation_step`` (else ``training_step``) makes to ``forward``
    (not run) when training's ``call`` is more than one positional tensor, else (or if no step makes one)
    :func:`split_inputs`."""
    if call is not None and not (call.positional and len(call.tensors) == 1):
        steps = [pl_module.validation_step] if is_overridden("validation_step", pl_module) else []
        for step in (*steps, pl_module.training_step):
            with contextlib.suppress(Exception):  # a step this batch does not suit (a predict batch without labels)
                found = call_of(pl_module, functools.partial(step, batch, 0), "a batch", cpu=False)
                if found is not None:
                    return found
    return split_inputs(batch, input_key)


def submodule_batches(
    owner: str,
    pl_module: pl.LightningModule,
    module: nn.Module,
    loader: Any,
    input_key: Any,
    call: CapturedCall | None = None,
) -> Iterator[Any]:
    """Validation batches as ``(submodule inputs, labels)``: what ``module`` receives for each, and the labels."""
    datamodule = getattr(pl_module.trainer, "datamodule", None)
    for batch in loader:
        batch = through_batch_hooks(pl_module, batch, datamodule=datamodule)
        inputs = step_call(pl_module, batch, call, input_key)
        inputs = submodule_inputs(pl_module, module, inputs, "a validation batch", device=pl_module.device, owner=owner)
        labels = batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None
        yield (inputs, labels)


def loop_data(
    owner: str,
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    dirpath: Path,
    input_key: Any,
    call: CapturedCall | None = None,
) -> LoopData:
    """What a quantizer needs from the loop (:class:`~lightning_perf.deploy.quantize.quantizer.LoopData`): example
    inputs and validation batches of a submodule (``call``: the call training made), where to write, the run's
    metadata."""
    from lightning_perf.deploy.quantize.quantizer import LoopData  # the export callback needs no quantization

    def example(module: nn.Module, split: str) -> tuple[torch.Tensor, ...] | CapturedCall:
        return example_inputs(owner, trainer, pl_module, module, split, input_key, call)

    def validation(module: nn.Module) -> Iterator[Any] | None:
        loader = val_dataloader(trainer, pl_module)
        return None if loader is None else submodule_batches(owner, pl_module, module, loader, input_key, call)

    return LoopData(example=example, validation=validation, dirpath=dirpath, metadata=run_metadata(trainer, pl_module))
