"""Performance optimizations for PyTorch Lightning: callbacks and strategies you stack on any Trainer.

``import lightning_perf`` is cheap: callbacks and strategies load on first use, and no optional dependency
(torchao, onnx, onnxruntime, tensorrt, flash-attn, matplotlib) is imported until a feature needs it.
"""

from __future__ import annotations

import functools
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

_LAZY_SUBPACKAGES = ("callbacks", "strategies", "tuning")

# Names for `Trainer(strategy="...")`, registered on any `lightning_perf` import without importing the strategies
# (Lightning is loaded already: `_warnings` imports it). The entry builds the class on first use.
_STRATEGY_NAMES = {"ddp_powersgd": "PowerSGDDDPStrategy"}


def _build_strategy(class_name: str, **kwargs: Any) -> Any:
    return getattr(importlib.import_module("lightning_perf.strategies"), class_name)(**kwargs)


def _register_strategy_names() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for name, class_name in _STRATEGY_NAMES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(
                name, functools.partial(_build_strategy, class_name), description=f"lightning_perf {class_name}"
            )


_register_strategy_names()


def __getattr__(name: str) -> Any:
    # `from lightning_perf import ChannelsLastCallback` works without importing every callback up front.
    for sub in _LAZY_SUBPACKAGES:
        module = importlib.import_module(f"lightning_perf.{sub}")
        if name in getattr(module, "__all__", ()):
            return getattr(module, name)
    raise AttributeError(f"module 'lightning_perf' has no attribute {name!r}")
