"""Performance optimizations for PyTorch Lightning: callbacks and strategies you stack on any Trainer.

``import lightning_perf`` is cheap: callbacks and strategies load on first use, no optional dependency (torchao,
onnx, onnxruntime, tensorrt, flash-attn, matplotlib, monai) is imported until a feature needs it, and Lightning itself
is not imported either, so :mod:`lightning_perf.functional`, :mod:`lightning_perf.profiling` and
:mod:`lightning_perf.deploy` serve plain PyTorch training loops. ``from lightning_perf import
SlidingWindowInferenceCallback`` (or any other callback or strategy) imports only what it needs.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_perf._warnings import (
    FallbackWarning,
    LightningPerfWarning,
    MeasurementWarning,
    NoEffectWarning,
    PartialEffectWarning,
)

__version__ = "0.1.0"

__all__ = [
    "FallbackWarning",
    "LightningPerfWarning",
    "MeasurementWarning",
    "NoEffectWarning",
    "PartialEffectWarning",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # `from lightning_perf import ChannelsLastCallback` works without importing every callback up front.
    for sub in ("callbacks", "strategies"):
        module = importlib.import_module(f"lightning_perf.{sub}")
        if name in getattr(module, "__all__", ()):
            return getattr(module, name)
    raise AttributeError(f"module 'lightning_perf' has no attribute {name!r}")
