"""Which trials can apply to a model on a device: checked once in the tuner's process, before any trial runs.

A trial that cannot change anything (the attention swap on a model without attention, channels-last on a model
without convolutions) or that would measure an emulation (bf16 on a CPU without bf16 instructions) is skipped with
its reason instead of costing a trial and, worse, a chance for noise to look like a win.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ModelCapabilities", "model_capabilities", "skip_reason"]


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model holds that optimizations act on.

    One field per :data:`lightning_perf.optimizations.MODEL_FEATURES` name (what an entry's ``model_needs`` names).

    Attributes:
        attention: names of the attention modules the attention swap knows (its registered adapters).
        convolutions: names of the 2D and 3D convolution layers (what channels-last acts on).
    """

    attention: tuple[str, ...] = ()
    convolutions: tuple[str, ...] = ()


def model_capabilities(model: Any) -> ModelCapabilities:
    """Count the modules that the optimizations act on, with the detection the optimizations themselves use."""
    from lightning_perf.functional.attention import SwappedAttention, attention_adapters
    from lightning_perf.functional.channels_last import find_conv_layers

    adapters = attention_adapters()
    attention: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(outer + ".") for outer in attention):
            continue
        if isinstance(module, SwappedAttention) or any(a.matches(module, name) for a in adapters):
            attention.append(name)
    found = find_conv_layers(model)
    return ModelCapabilities(attention=tuple(attention), convolutions=tuple(found[2] + found[3]))


def skip_reason(name: str, capabilities: ModelCapabilities, device: Any, *, explicit: bool = False) -> str | None:
    """Why the trial of optimization ``name`` cannot apply to this model on ``device``, or ``None``.

    Args:
        name: the optimization (bench configuration) name.
        capabilities: the model's, from :func:`model_capabilities`.
        device: a ``torch.device``.
        explicit: the user named it: an emulated bf16 is measured anyway (what it costs is then the question).
    """
    from lightning_perf.optimizations import MODEL_FEATURES, find

    optimization = find(name)
    for need in optimization.model_needs if optimization is not None else ():
        if not getattr(capabilities, need):
            return f"the model has no {MODEL_FEATURES[need]}: {name} changes nothing"
    if device.type == "cpu" and not explicit and _needs_bf16(name):
        from lightning_perf.benchmark import configs

        if not configs.device_capabilities(device)["fast_bf16"]:
            return "this CPU has no bf16 instructions (avx512_bf16, AMX): bf16 would be emulated, slower than fp32"
    return None


def _needs_bf16(name: str) -> bool:
    """Whether the optimization ``name`` computes in bf16 (its entry requires bf16)."""
    from lightning_perf.optimizations import find

    optimization = find(name)
    return optimization is not None and "bf16" in optimization.requires
