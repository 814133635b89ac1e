"""From a prepared (trained or calibrated) model to the quantized one, whatever its back-end."""

from __future__ import annotations

import torch
from torch import nn

from lightning_perf._imports import require
from lightning_perf._io import failure_reason
from lightning_perf.deploy.quantize.pt2e_x86 import calibrate, convert_x86
from lightning_perf.deploy.quantize.torchao import convert_torchao, float_linear_layers
from lightning_perf.functional.quantization.device import retarget_graph
from lightning_perf.functional.quantization.qat import (
    INFO_KEY,
    QuantizationError,
    QuantizationRecipe,
    quiet_deepcopy,
    recipe_of,
    set_quantization_info,
)

__all__ = ["calibrate", "convert", "float_copy", "restore_float"]


def convert(prepared: nn.Module, recipe: QuantizationRecipe | None = None, *, owner: str = "convert") -> nn.Module:
    """The quantized model of a prepared (trained or calibrated) one, in eval mode; ``prepared`` is not changed.

    ``x86``: ``convert_pt2e`` of a copy, an int8 q/dq graph to be lowered with ``torch.compile`` and
    ``torch._inductor.config.patch(freezing=True)`` (:func:`~lightning_perf.deploy.quantize.compiled_latency` does)
    or saved (:func:`~lightning_perf.deploy.quantize.save_quantized`). ``torchao``: ``QATConfig(base_config,
    step="convert")`` (QAT) or ``base_config`` itself (PTQ) applied to a copy.

    Raises:
        ValueError: if ``prepared`` was not made by :func:`~lightning_perf.functional.quantization.qat.prepare` and no
        recipe is given.
        QuantizationError: if torchao's conversion fails.
    """
    recipe = recipe or recipe_of(prepared)
    if recipe is None:
        raise ValueError("convert() needs a module returned by prepare(), or its recipe.")
    require("torchao", f"{owner}(backend={recipe.backend!r})")
    model = quiet_deepcopy(prepared)
    if recipe.backend == "x86":
        model = model.cpu()  # X86InductorQuantizer's int8 kernels are CPU kernels
        if isinstance(model, torch.fx.GraphModule):
            retarget_graph(model, torch.device("cpu"))  # fine-tuned on a GPU: the graph's own tensors too
    model.eval()
    try:
        model = convert_x86(model) if recipe.backend == "x86" else convert_torchao(model, recipe, owner)
    except Exception as exc:
        raise QuantizationError(f"torchao could not convert the model: {failure_reason(exc)}") from exc
    set_quantization_info(model, recipe=recipe, float_keys=list(model.state_dict()), converted=True)
    return model.eval()


def float_copy(prepared: nn.Module) -> nn.Module:
    """A plain float copy (eval mode) of a model prepared with the ``torchao`` backend: its fake-quantized layers
    swapped back for ``nn.Linear``, with the trained weights.

    Raises:
        ValueError: for an ``x86`` model (the float module it was captured from is the float model).
    """
    recipe = recipe_of(prepared)
    if recipe is None or recipe.backend != "torchao":
        raise ValueError("float_copy() applies to models prepared with backend='torchao'.")
    model = float_linear_layers(quiet_deepcopy(prepared), recipe)
    model.__dict__.pop(INFO_KEY, None)
    return model.eval()


def restore_float(prepared: nn.Module, float_module: nn.Module | None = None) -> nn.Module:
    """Undo :func:`~lightning_perf.functional.quantization.qat.prepare`: the plain float module to put back in the
    model.

    ``x86``: ``float_module``, the module the graph was captured from (its parameters are the prepared graph's, so
    what was trained is kept), in the prepared model's train/eval mode. ``torchao``: ``prepared`` itself, its
    fake-quantized layers swapped back for ``nn.Linear`` in place (same parameters). A module that is not prepared is
    returned as it is.

    Raises:
        ValueError: for an ``x86`` model without its ``float_module``.
    """
    recipe = recipe_of(prepared)
    if recipe is None:
        return prepared
    training = prepared.training
    if recipe.backend == "x86" or recipe.mode == "ptq":
        if float_module is None:
            raise ValueError("restore_float() of a graph-prepared model needs the float module it was captured from.")
        return float_module.train(training)
    model = float_linear_layers(prepared, recipe)
    model.__dict__.pop(INFO_KEY, None)
    return model.train(training)
