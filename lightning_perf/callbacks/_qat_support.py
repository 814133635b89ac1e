"""What :class:`~lightning_perf.callbacks.QATCallback` needs from the Trainer besides its hooks: the checkpoint-load
stand-in, the pruning check, the first batch of a split and the default output folder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelPruning
from torch import nn

from lightning_perf._validation import check_bool
from lightning_perf.callbacks.tensorrt_export import _val_dataloader
from lightning_perf.deploy.inputs import split_inputs, submodule_inputs, through_batch_hooks

__all__ = [
    "SCHEDULE_UNITS",
    "RestoreBeforeWeights",
    "check_options",
    "check_pruning",
    "default_dirpath",
    "example_inputs",
    "first_batch",
    "holds_tensors_of",
    "resolve_submodule",
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


def resolve_submodule(owner: str, pl_module: pl.LightningModule, name: str | None) -> tuple[str, nn.Module]:
    """The submodule called ``name``, or by default the LightningModule's only child holding parameters."""
    if name is not None:
        try:
            return name, pl_module.get_submodule(name)
        except AttributeError:
            children = [n for n, _ in pl_module.named_children()]
            raise ValueError(
                f"`{owner}(submodule={name!r})`: {type(pl_module).__name__} has no submodule "
                f"{name!r}. Its children: {', '.join(children) or 'none'}."
            ) from None
    holders = [(n, c) for n, c in pl_module.named_children() if next(c.parameters(), None) is not None]
    if len(holders) != 1:
        found = ", ".join(n for n, _ in holders) or "none"
        raise ValueError(
            f"`{owner}()` quantizes one submodule of the LightningModule (which itself cannot be "
            f"exported) and could not choose in {type(pl_module).__name__}: children holding parameters: {found}. "
            'Pass `submodule="<name>"`.'
        )
    return holders[0]


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


def holds_tensors_of(prepared: nn.Module, module: nn.Module) -> bool:
    """Whether ``prepared`` (an x86 graph) holds ``module``'s own parameters and buffers, so putting it back in
    ``module``'s place trains and reads the same tensors."""
    held = prepared.state_dict(keep_vars=True)
    return all(held.get(key) is value for key, value in module.state_dict(keep_vars=True).items())


SCHEDULE_UNITS = ("epoch", "step")


def check_options(owner: str, options: dict[str, Any]) -> list[int]:
    """Check ``QATCallback``'s constructor arguments (``options``: its ``locals()``); returns the batch sizes to time.

    Raises:
        ValueError: for an invalid value, naming the argument, the value and what is expected.
        TypeError: for a ``dirpath`` that is not a path.
    """
    mode = options["mode"]
    submodule = options["submodule"]
    disable_observers_after = options["disable_observers_after"]
    freeze_bn_after = options["freeze_bn_after"]
    fake_quant_after = options["fake_quant_after"]
    schedule_unit = options["schedule_unit"]
    eval_converted_every_n_epochs = options["eval_converted_every_n_epochs"]
    calibration_batches = options["calibration_batches"]
    validation_batches = options["validation_batches"]
    export = options["export"]
    benchmark = options["benchmark"]
    benchmark_batch_sizes = options["benchmark_batch_sizes"]
    latency_iterations = options["latency_iterations"]
    latency_warmup = options["latency_warmup"]
    dirpath = options["dirpath"]
    filename = options["filename"]
    onnx = options["onnx"]
    input_key = options["input_key"]
    strict = options["strict"]
    if submodule is not None and (not isinstance(submodule, str) or not submodule):
        raise ValueError(f"`{owner}(submodule={submodule!r})` is not valid. Expected a dotted module name.")
    for name, value in (
        ("disable_observers_after", disable_observers_after),
        ("freeze_bn_after", freeze_bn_after),
        ("eval_converted_every_n_epochs", eval_converted_every_n_epochs),
        ("validation_batches", validation_batches),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"`{owner}({name}={value!r})` is not valid. Expected None or an int >= 0.")
    for name, value, minimum in (
        ("fake_quant_after", fake_quant_after, 0),
        ("calibration_batches", calibration_batches, 1),
        ("latency_iterations", latency_iterations, 1),
        ("latency_warmup", latency_warmup, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"`{owner}({name}={value!r})` is not valid. Expected an int >= {minimum}.")
    if eval_converted_every_n_epochs == 0:
        raise ValueError(f"`{owner}(eval_converted_every_n_epochs=0)` is not valid. Expected None or an int >= 1.")
    if schedule_unit not in SCHEDULE_UNITS:
        raise ValueError(
            f"`{owner}(schedule_unit={schedule_unit!r})` is not valid. Expected one of: {', '.join(SCHEDULE_UNITS)}."
        )
    if mode == "ptq" and not export:
        raise ValueError(f"`{owner}(mode='ptq', export=False)` would do nothing. PTQ exports the quantized model.")
    if mode != "qat" and (disable_observers_after, freeze_bn_after, fake_quant_after) != (None, None, 0):
        raise ValueError(
            f"`{owner}(mode={mode!r}, ...)`: the observer, batch-norm and fake-quant schedules apply to QAT only."
        )
    for name in ("min_cosine", "min_agreement"):
        value = options.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"`{owner}({name}={value!r})` is not valid. Expected a number in [0, 1].")
    if mode == "dynamic":
        _check_dynamic(owner, options)
    sizes = [benchmark_batch_sizes] if isinstance(benchmark_batch_sizes, int) else list(benchmark_batch_sizes)
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(
            f"`{owner}(benchmark_batch_sizes={benchmark_batch_sizes!r})` is not valid. Expected positive ints."
        )
    if not isinstance(filename, str) or not filename or "/" in filename or filename.startswith("."):
        raise ValueError(f"`{owner}(filename={filename!r})` is not valid. Expected a plain, non-hidden file stem.")
    for name, value in (("export", export), ("benchmark", benchmark), ("onnx", onnx), ("strict", strict)):
        check_bool(owner, name, value)
    if dirpath is not None and not isinstance(dirpath, (str, os.PathLike)):
        raise TypeError(f"`{owner}(dirpath={dirpath!r})` is not valid. Expected None or a directory path.")
    if input_key is not None and (not isinstance(input_key, str) or not input_key):
        raise ValueError(f"`{owner}(input_key={input_key!r})` is not valid. Expected None or a non-empty key.")
    return sizes


def _check_dynamic(owner: str, options: dict[str, Any]) -> None:
    """The options that mean nothing for ``mode="dynamic"`` (no training change, no calibration, no torchao config)."""
    for name, default, why in (
        ("base_config", None, "the torchao back-end of mode 'dynamic' uses Int8DynamicActivationInt8WeightConfig"),
        ("eval_converted_every_n_epochs", None, "training is not touched: there is no converted copy to follow"),
        ("onnx", False, "backend='onnxruntime' is the ONNX int8 model (saved as <filename>.onnx)"),
    ):
        if options[name] != default:
            raise ValueError(
                f"`{owner}(mode='dynamic', {name}={options[name]!r})` is not valid: {why}. Leave it at {default!r}."
            )
