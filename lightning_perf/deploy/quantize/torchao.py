"""The ``torchao`` back-end after training: ``QATConfig(step="convert")`` (QAT) or the base config itself (PTQ),
and the float copy of a fake-quantized model. torchao is imported only inside the functions."""

from __future__ import annotations

from torch import nn

from lightning_perf._imports import require
from lightning_perf.functional.quantization.config import resolve_base_config
from lightning_perf.functional.quantization.qat import QuantizationRecipe

__all__ = ["convert_torchao", "float_linear_layers"]


def convert_torchao(model: nn.Module, recipe: QuantizationRecipe, owner: str = "convert") -> nn.Module:
    """Quantize ``model`` (a copy the caller owns) in place as ``recipe`` says; returns it."""
    torchao = require("torchao", f"{owner}(backend='torchao')")
    base = resolve_base_config(recipe.base_config, owner)
    config = torchao.quantization.qat.QATConfig(base, step="convert") if recipe.mode == "qat" else base
    torchao.quantization.quantize_(model, config)
    return model


def float_linear_layers(model: nn.Module, recipe: QuantizationRecipe, owner: str = "float_copy") -> nn.Module:
    """Swap ``model``'s fake-quantized layers (a copy the caller owns) back for ``nn.Linear``, in place."""
    torchao = require("torchao", f"{owner}(backend='torchao')")
    if recipe.mode == "qat":
        torchao.quantization.quantize_(model, torchao.quantization.qat.QATConfig(step="convert"))
    return model
