"""Performance optimizations for PyTorch Lightning: callbacks and strategies you stack on any Trainer.

``import lightning_perf`` is cheap: callbacks and strategies load on first use, and no optional dependency
(torchao, onnx, onnxruntime, tensorrt, flash-attn, matplotlib) is imported until a feature needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_perf._warnings import FallbackWarning, LightningPerfWarning, MeasurementWarning, NoEffectWarning

__version__ = "0.1.0.dev0"

__all__ = [
    "FallbackWarning",
    "LightningPerfWarning",
    "MeasurementWarning",
    "NoEffectWarning",
    "__version__",
]

_LAZY_SUBPACKAGES = ("callbacks", "strategies")


def __getattr__(name: str) -> Any:
    # `from lightning_perf import ChannelsLastCallback` works without importing every callback up front.
    for sub in _LAZY_SUBPACKAGES:
        module = importlib.import_module(f"lightning_perf.{sub}")
        if name in getattr(module, "__all__", ()):
            return getattr(module, name)
    raise AttributeError(f"module 'lightning_perf' has no attribute {name!r}")
