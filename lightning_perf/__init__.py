"""Performance optimizations for PyTorch Lightning: callbacks and strategies you stack on any Trainer.

``import lightning_perf`` is cheap: callbacks and strategies load on first use, no optional dependency (torchao,
onnx, onnxruntime, tensorrt, flash-attn, matplotlib, monai) is imported until a feature needs it, and Lightning itself
is not imported either, so :mod:`lightning_perf.functional`, :mod:`lightning_perf.profiling` and
:mod:`lightning_perf.deploy` serve plain PyTorch training loops. ``from lightning_perf import
SlidingWindowInferenceCallback`` (or any other callback or strategy) imports only what it needs.
"""

from __future__ import annotations

from lightning_perf._lazy import lazy_exports
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


# `from lightning_perf import ChannelsLastCallback` works without importing every callback up front.
__getattr__, __dir__ = lazy_exports(globals(), {}, ("lightning_perf.callbacks", "lightning_perf.strategies"))
